"""A read of an ``lmdb`` tier counts itself among the jobs being read (``Temperature.jobs``)
and a close waits for that count to fall to nothing before it unmaps the file. An interrupt
(``KeyboardInterrupt``, raised where the interpreter checks for signals: after a call returns,
or as a called function starts) that lands just after the count was taken must still release
it: a count left behind makes every later close wait its whole ``CLOSE_WAIT_S`` and then leave
the environment open, and keeps the tier from ever reading cold. Each read path is interrupted
at the first instruction its frame runs once it is counted (a trace function raising there)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_one, lmdb_plain, lmdb_tier

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.testing import make_key, random_block


def _interrupt_once_counted(jobs: list[None]) -> Any:
    """A trace function raising ``KeyboardInterrupt`` at the first instruction run once ``jobs``
    is not empty (then never again)."""
    fired: list[bool] = []

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode" and jobs and not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return local

    tracer.fired = fired  # type: ignore[attr-defined]
    return tracer


@pytest.mark.parametrize("how", ["one", "one native", "job", "job native", "general"])
def test_an_interrupt_once_a_read_is_counted_releases_its_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``one native`` and ``job native``: the native job of one key (``lmdb_plain.one_read``) and
    of several (``lmdb_plain.job_read``) run no Python while they are counted, so no interrupt
    lands there: the read completes, its count released."""
    monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", how != "general")
    native = how.endswith("native")
    if native and (lmdb_plain.one_read is None or lmdb_plain.job_read is None):
        pytest.skip("built without the native row guard (kvtier.backends._rowguard)")
    if how != "one native":
        monkeypatch.setattr(lmdb_plain, "one_read", None)
    if how != "job native":
        monkeypatch.setattr(lmdb_plain, "job_read", None)
    if not native:  # (the tier's call of either: straight_read)
        monkeypatch.setattr(lmdb_plain, "straight_read", None)
    monkeypatch.setattr(lmdb_tier, "CLOSE_WAIT_S", 0.0)  # a count left behind: the close leaves the file open
    fmt = BlockFormat(block_bytes=4096, dtype="uint8")
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(tmp_path / "store"), sync_mode="fast")
    asyncio.run(backend.open(fmt))
    n = 1 if how.startswith("one") else 3
    keys = [make_key(i) for i in range(n)]
    blocks = [random_block(fmt.block_bytes, i) for i in range(n)]
    backend.write_blocks(keys, blocks)
    rows = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in range(n)]
    assert backend.read_blocks(keys, rows) == [True] * n  # the rows' views are made
    jobs = backend._reader.temperature.jobs
    assert not jobs
    tracer = _interrupt_once_counted(jobs)
    sys.settrace(tracer)
    try:
        if native:
            assert backend.read_blocks(keys, rows) == [True] * n
        else:
            with pytest.raises(KeyboardInterrupt):
                backend.read_blocks(keys, rows)
    finally:
        sys.settrace(None)
    assert bool(tracer.fired) is not native, "Python ran while counted" if native else "the read was never counted"
    assert not jobs, f"{how}: the interrupted read is still counted among the jobs being read"
    assert backend.read_blocks(keys, rows) == [True] * n and all(torch.equal(r, b) for r, b in zip(rows, blocks))
    env = backend._env
    asyncio.run(backend.aclose())
    with pytest.raises(lmdb.Error):  # closed (unmapped), not left open for a read never to end
        env.info()


def _open_with_a_record(path: Path) -> Any:
    fmt = BlockFormat(block_bytes=4096, dtype="uint8")
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path), sync_mode="fast")
    asyncio.run(backend.open(fmt))
    backend.write_blocks([make_key(1)], [random_block(fmt.block_bytes, 1)])
    return backend, fmt


def test_a_close_waits_for_a_read_on_the_event_loop_not_by_blocking_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``aclose`` waits for the reads under way with the event loop running: a read that ends
    while the close waits (here a task of the same loop ends it) lets the close unmap the file.
    Before, the wait slept on the loop's thread, the task could not run, and the close gave up
    after ``CLOSE_WAIT_S`` and left the environment open."""
    monkeypatch.setattr(lmdb_tier, "CLOSE_WAIT_S", 1.0)
    backend, _ = _open_with_a_record(tmp_path / "store")
    jobs = backend._reader.temperature.jobs
    jobs.append(None)  # a read under way

    async def main() -> None:
        async def the_read_ends() -> None:
            await asyncio.sleep(0.01)
            jobs.clear()

        ends = asyncio.create_task(the_read_ends())
        await backend.aclose()
        await ends

    env = backend._env
    asyncio.run(main())
    with pytest.raises(lmdb.Error):  # unmapped
        env.info()


def test_a_close_that_leaves_the_environment_open_keeps_the_path_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a read still runs when the close gives up, the environment stays mapped, and so the
    holder lock stays taken: the same path opened again in this process is refused with an error
    naming this process, never mapped a second time beside the first (which LMDB forbids: its
    locks are per process). Before, the close released the holder lock and the reopen succeeded."""
    monkeypatch.setattr(lmdb_tier, "CLOSE_WAIT_S", 0.0)
    path = tmp_path / "store"
    backend, fmt = _open_with_a_record(path)
    jobs = backend._reader.temperature.jobs
    jobs.append(None)  # a read that never ends
    env = backend._env
    asyncio.run(backend.aclose())
    env.info()  # left open: still mapped
    again = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path), sync_mode="fast")
    with pytest.raises(Exception, match=f"in use by process {os.getpid()}"):
        asyncio.run(again.open(fmt))
    jobs.clear()
