"""Engines close their stores from exit hooks; that must work while the interpreter shuts down."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier.testing import make_key
from kvtier.transfer.offloop import off_loop


def test_a_store_closed_from_an_atexit_hook_closes_cleanly(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import atexit, asyncio, torch, kvtier
        from kvtier.testing import make_key

        kv = [torch.randn(8, 4, 16)]
        cfg = {{"tiers": [{{"backend": "cpu", "capacity": "1MiB"}},
                          {{"backend": "lmdb", "path": {str(tmp_path / "db")!r}, "capacity": "8MiB"}}]}}
        store = asyncio.run(kvtier.KVStore(kvtier.config.load_config(cfg), kv_caches=kv).start())

        def bye():
            asyncio.run(store.aclose())
            print("closed", store.manager is not None and store._closed)

        atexit.register(bye)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "closed True"
    assert "Traceback" not in proc.stderr


def test_a_close_from_an_atexit_hook_writes_the_memory_tiers_back(tmp_path: Path) -> None:
    """Under ``write: back`` the blocks held only in the cpu tier reach LMDB even when the close
    runs while the interpreter shuts down (no new thread can start then: the write-back runs
    inline), so the next process is served them."""
    db = str(tmp_path / "db")
    script = textwrap.dedent(
        f"""
        import atexit, asyncio, torch, kvtier
        from kvtier.testing import make_key

        kv = [torch.randn(8, 4, 16)]
        cfg = {{"write": "back", "tiers": [{{"backend": "cpu", "capacity": "1MiB"}},
                          {{"backend": "lmdb", "path": {db!r}, "capacity": "8MiB"}}]}}
        loop = asyncio.new_event_loop()
        store = loop.run_until_complete(kvtier.KVStore(kvtier.config.load_config(cfg), kv_caches=kv).start())
        keys = [make_key(i) for i in range(4)]
        assert loop.run_until_complete(store.save(keys, block_ids=[0, 1, 2, 3])) == 4
        tiers = store.stats()["tiers"]
        print("before", tiers[0]["ready"], tiers[1]["ready"])

        def bye():
            loop.run_until_complete(store.aclose())

        atexit.register(bye)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "before 4 0"  # only in the cpu tier when the script ended
    assert "write-back at close failed" not in proc.stderr, proc.stderr
    check = textwrap.dedent(
        f"""
        import asyncio, torch, kvtier
        from kvtier.testing import make_key

        async def main():
            cfg = {{"tiers": [{{"backend": "lmdb", "path": {db!r}, "capacity": "8MiB"}}]}}
            async with kvtier.open(cfg, kv_caches=[torch.zeros(8, 4, 16)]) as store:
                print(await store.lookup([make_key(i) for i in range(4)]))

        asyncio.run(main())
        """
    )
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "4"



# -- off_loop: only the executor's refusal runs a call inline --------------------------------------

def test_off_loop_runs_a_call_that_raises_about_a_shutdown_once() -> None:
    """A call whose own error mentions a shutdown (a pool of its own refusing work) is not the
    loop's executor refusing it: the error comes out, and the call ran once."""
    runs: list[int] = []

    def refuses_inside() -> None:
        runs.append(1)
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    with pytest.raises(RuntimeError, match="shutdown"):
        asyncio.run(off_loop(refuses_inside))
    assert runs == [1]


def test_off_loop_runs_inline_when_the_executor_refuses() -> None:
    ran_on: list[int] = []

    async def run() -> tuple[int, int]:
        closed = ThreadPoolExecutor(1)
        closed.shutdown()  # refuses new work, as every executor does at interpreter exit
        asyncio.get_running_loop().set_default_executor(closed)
        total: int = await off_loop(lambda a, b: a + b, 2, 3)
        await off_loop(lambda: ran_on.append(threading.get_ident()))
        return total, threading.get_ident()

    total, loop_thread = asyncio.run(run())
    assert total == 5 and ran_on == [loop_thread]


# -- a close never frees what a running job uses ----------------------------------------------

HANG_GUARD = 60.0  # seconds a test waits for a thread before it fails


class _Gated:
    """Holds ``backend``'s ``method`` calls until ``gate`` is set; notes whether the tier was
    closed when each call went on, and sets ``closed`` when the tier is closed."""

    def __init__(self, backend: Any, method: str) -> None:
        self.backend = backend
        self.entered, self.gate, self.closed = threading.Event(), threading.Event(), threading.Event()
        self.closed_when_run: list[bool] = []
        real, real_aclose = getattr(backend, method), backend.aclose

        def held(*args: Any) -> Any:
            self.entered.set()
            assert self.gate.wait(HANG_GUARD)
            self.closed_when_run.append(bool(backend._closed))
            return real(*args)

        async def aclose() -> None:
            await real_aclose()
            self.closed.set()

        setattr(backend, method, held)
        backend.aclose = aclose


async def _closed_while_held(store: Any, held: _Gated) -> None:
    assert await asyncio.to_thread(held.entered.wait, HANG_GUARD)
    store.transfers.close_timeout_s = 0.2
    await store.aclose()  # returns with the job's thread still inside the tier call
    assert not held.closed.is_set() and not held.backend._closed  # left to the thread
    assert store.transfers.counters["cancelled_jobs"] == 1  # stopped, reported failed
    assert not store.transfers.stopped


async def test_a_close_leaves_a_slow_tier_to_the_job_still_writing_it(tmp_path: Path) -> None:
    """The write-through to a slow LMDB tier outlasts the close: the write (and the clean-up of
    the stopped job after it) runs on an open environment, and the last thread closes it."""
    cfg = {"tiers": [{"backend": "cpu", "capacity": "1MiB"}, {"backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "8MiB"}]}
    store = await kvtier.open(cfg, kv_caches=[torch.randn(8, 4, 16)])
    held = _Gated(store.backends[1], "write_blocks")
    plan = await store.prepare_store([make_key(i) for i in range(2)])
    store.transfers.submit_store(plan, [0, 1])
    await _closed_while_held(store, held)
    held.gate.set()  # the slow write returns
    assert await asyncio.to_thread(held.closed.wait, HANG_GUARD)
    assert held.closed_when_run == [False]
    for thread in store.transfers._threads[:3]:
        thread.join(HANG_GUARD)
    assert store.transfers.stopped


async def test_a_close_stops_a_load_stuck_on_a_tier_and_it_never_writes_the_engine_blocks(tmp_path: Path) -> None:
    kv = torch.randn(8, 4, 16)
    cfg = {"tiers": [{"backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "8MiB"}]}
    store = await kvtier.open(cfg, kv_caches=[kv])
    keys = [make_key(i) for i in range(2)]
    assert await store.save(keys, [0, 1]) == 2
    held = _Gated(store.backends[0], "read_blocks")
    before = kv[5:7].clone()
    loading = asyncio.create_task(store.load(keys, [5, 6]))
    await _closed_while_held(store, held)
    assert await loading == 0  # the caller learns at once that nothing was loaded
    held.gate.set()  # the tier answers at last, after the close
    assert await asyncio.to_thread(held.closed.wait, HANG_GUARD)
    assert held.closed_when_run == [False]
    assert torch.equal(kv[5:7], before)  # the stopped load never wrote the engine's blocks
