"""A ``file`` commit whose ``close`` of a record's temporary file fails (``EIO``: on NFS a write
error may first be reported there, after the sync): that record is not acknowledged, and is
counted as a failed write; the job's other records are committed; no descriptor is left open or
closed twice (a closed number may already be another file's); nothing raises into the caller.
Injected through the ``os`` that :mod:`kvtier.backends.file_commit` calls."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_commit

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


class _CloseFails:
    """``os`` but for ``close``, which fails with ``EIO`` (after releasing the descriptor, as
    Linux does) for the descriptors whose target ``fails(target)`` says; every open and close is
    noted in :attr:`events`."""

    def __init__(self, fails: Callable[[str], bool]) -> None:
        self.fails = fails
        self.events: list[tuple[str, int]] = []
        self.failed: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, *args: Any, **kwargs: Any) -> int:
        fd = os.open(*args, **kwargs)
        self.events.append(("open", fd))
        return fd

    def close(self, fd: int) -> None:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        self.events.append(("close", fd))
        os.close(fd)
        if self.fails(target):
            self.failed.append(fd)
            raise OSError(errno.EIO, "Input/output error (injected)")


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(("layout", "count", "sync_mode"), [("flat", 3, "durable"), ("sharded", 3, "durable"), ("flat", 3, "fast"), ("flat", 1, "durable")])
def test_a_failed_close_fails_its_record_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, count: int, sync_mode: str) -> None:
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path), sync_mode=sync_mode, layout=layout)
    asyncio.run(backend.open(FMT))
    keys = [make_key(i) for i in range(count)]
    bad = count // 2  # the middle record's close fails (the only one, in a job of one)
    blocks = [random_block(FMT.block_bytes, 10 + i) for i in range(count)]
    before, files = _fds(), {p.name for p in tmp_path.rglob("*") if p.is_file()}
    failing = _CloseFails(lambda target: keys[bad].hex() in target and target.endswith(".tmp"))
    monkeypatch.setattr(file_commit, "os", failing)
    sizes = backend.write_blocks(keys, blocks)  # no exception
    monkeypatch.undo()
    assert len(failing.failed) == 1, failing.failed
    fd = failing.failed[0]
    after = [what for what, n in failing.events[failing.events.index(("close", fd)) + 1 :] if n == fd]
    assert after[:1] != ["close"], failing.events  # its number never closed again before reopened
    assert _fds() <= before  # no descriptor left open
    assert [s is None for s in sizes] == [i == bad for i in range(count)]
    assert backend.counters.write_failures == 1 and backend.counters.blocks_written == count - 1
    added = {p.name for p in tmp_path.rglob("*") if p.is_file()} - files
    assert added == {k.hex() + ".kvb" for i, k in enumerate(keys) if i != bad}  # no temporary file left
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    assert backend.read_blocks(keys, out) == [i != bad for i in range(count)]
    assert all(torch.equal(out[i], blocks[i].view(torch.uint8)) for i in range(count) if i != bad)
    assert backend.write_blocks(keys[bad : bad + 1], blocks[bad : bad + 1]) != [None]  # its room given back
    asyncio.run(backend.aclose())


@pytest.mark.parametrize("count", [1, 3])
def test_a_failed_close_of_the_jobs_directory_loses_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """The job's descriptor of its directory is closed after the commit (its entries synced by
    then): a failed close there is logged, every record stands, nothing is left open."""
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path), sync_mode="durable", layout="flat")
    asyncio.run(backend.open(FMT))
    keys = [make_key(i) for i in range(count)]
    blocks = [random_block(FMT.block_bytes, 20 + i) for i in range(count)]
    before = _fds()
    failing = _CloseFails(lambda target: target == str(tmp_path))
    monkeypatch.setattr(file_commit, "os", failing)
    sizes = backend.write_blocks(keys, blocks)  # no exception
    monkeypatch.undo()
    assert len(failing.failed) == 1 and _fds() <= before
    assert None not in sizes and backend.counters.write_failures == 0
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    assert backend.read_blocks(keys, out) == [True] * count
    asyncio.run(backend.aclose())
