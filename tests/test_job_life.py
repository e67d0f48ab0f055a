"""A job's life: cancellation, stalls, closed loops, full queues, deadlines, and leaks (#9).

Stalls are made with gates (``threading.Event``) the test controls, never with sleeps: a test
knows a job is blocked because the gate says it was entered, and lets it go when it chooses.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kvtier.backends.memory import CpuBackend

import kvtier
from kvtier.backend import BlockFormat
from kvtier.manager import KeyState, TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.store import KVStore
from kvtier.testing import make_key
from kvtier.transfer import TransferEngine
from kvtier.transfer.jobs import JobResult, apply_result, combine_results
from kvtier.transfer.layout import KVLayout

K = [make_key(100 + i) for i in range(64)]
NUM_BLOCKS = 16
HANG_GUARD = 60.0  # seconds; only ever reached when a test is about to fail


class Gate:
    """Wraps a callable so that it blocks until ``open()``; ``entered`` tells it was reached."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.entered.set()
            if not self.opened.wait(HANG_GUARD):
                raise RuntimeError("gate never opened")
            return fn(*args, **kwargs)

        return gated

    def open(self) -> None:
        self.opened.set()


def caches(seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, 4, 8, generator=g) for _ in range(2)]


BB = 2 * 4 * 8 * 4  # bytes of one block of caches()


def cpu_tiers(*blocks: int) -> dict[str, Any]:
    return {"tiers": [{"backend": "cpu", "capacity": n * BB} for n in blocks], "job_deadline_s": None}


def no_pins_or_pending(store: KVStore) -> bool:
    tiers = store.stats()["tiers"]
    return all(t["pinned"] == 0 and t["pending"] == 0 for t in tiers)


async def drain(store: KVStore) -> None:
    """Wait until every job queued so far has left every thread of the transfer engine (late
    clean-ups included), then let the event loop run the callbacks they scheduled."""
    assert store.transfers is not None
    await asyncio.to_thread(store.transfers.wait_idle, HANG_GUARD)
    for _ in range(3):
        await asyncio.sleep(0)


# -- defect 1: a planned drop skipped because the key is demoted elsewhere in the plan ---------


async def test_a_key_dropped_from_one_tier_and_demoted_from_another_leaks_nothing() -> None:
    kv = caches()
    a, b, c, d, e, f = K[:6]
    async with kvtier.open({**cpu_tiers(2, 2, 8), "write": "back"}, kv_caches=kv) as store:
        assert await store.save([a, b], [0, 1]) == 2
        assert await store.save([c, d], [2, 3]) == 2  # a, b -> tier 1
        assert await store.load([a], [8]) == 1  # promoted: a is now held in tiers 0 and 1
        assert store.manager is not None
        assert store.manager.holds(a, 0) and store.manager.holds(a, 1)
        await store.touch([d])  # tier 0's eviction order is now a, d
        # Tier 0 drops a (it is already in tier 1), and demoting d makes tier 1 demote a to
        # tier 2: one plan that drops a from tier 0 and moves a out of tier 1.
        assert await store.save([e, f], [4, 5]) == 2
        assert store.manager.holds(a, 2) and not store.manager.holds(a, 0)
        assert len(store.backends[0]) == 2  # type: ignore[arg-type]
        # Every later store keeps working, and every key reads back its own bytes.
        for i in range(6, 12, 2):
            assert await store.save([K[i], K[i + 1]], [i, i + 1]) == 2
        for key, block in ((a, 0), (e, 4), (K[10], 10)):
            assert await store.load([key], [15]) == 1
            assert all(torch.equal(x[15], x[block]) for x in kv)


# -- defect 2: cancelled save / load ------------------------------------------------------------


async def test_a_cancelled_load_never_writes_the_callers_blocks_and_leaves_no_pin(tmp_path: Any) -> None:
    kv = caches()
    cfg = {
        "tiers": [
            {"backend": "cpu", "capacity": 2 * BB},
            {"backend": "file", "path": str(tmp_path), "capacity": 64 * BB},
        ],
        "job_deadline_s": None,
    }
    async with kvtier.open(cfg, kv_caches=kv) as store:
        assert await store.save(K[:2], [0, 1]) == 2
        assert await store.save(K[2:4], [2, 3]) == 2  # K[0], K[1] -> the file tier
        gate = Gate()
        lower = store.backends[1]
        lower.read_blocks = gate.wrap(lower.read_blocks)  # type: ignore[method-assign]
        task = asyncio.create_task(store.load(K[:1], [9], promote=False))
        assert await asyncio.to_thread(gate.entered.wait, HANG_GUARD)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The caller reuses its block at once; the stalled read then ends.
        for x in kv:
            x[9].fill_(-1.0)
        gate.open()
        await drain(store)
        assert all(bool((x[9] == -1.0).all()) for x in kv), "a cancelled load wrote into the caller's block"
        assert no_pins_or_pending(store)
        assert store.stats()["transfers"]["cancelled_jobs"] == 1
        # The key is still there for the next caller.
        assert await store.load(K[:1], [10]) == 1
        assert all(torch.equal(x[10], x[0]) for x in kv)


async def test_a_cancelled_save_before_its_read_stores_nothing_and_leaves_no_reservation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = caches()
    # The first save must hold the store thread, not the event loop: no job runs inline.
    async with kvtier.open({**cpu_tiers(8), "inline_max_bytes": 0}, kv_caches=kv) as store:
        assert store.transfers is not None
        gate = Gate()
        layout = store.transfers.layout
        monkeypatch.setattr(layout, "gather", gate.wrap(layout.gather))
        first = asyncio.create_task(store.save(K[:1], [0]))  # holds the device thread
        assert await asyncio.to_thread(gate.entered.wait, HANG_GUARD)
        second = asyncio.create_task(store.save(K[1:2], [1]))
        await asyncio.sleep(0)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        saved = kv[0][1].clone()
        for x in kv:
            x[1].fill_(7.0)  # reused by the caller: never to be stored under K[1]
        gate.open()
        assert await first == 1
        await drain(store)
        assert no_pins_or_pending(store)
        assert await store.lookup(K[1:2]) == 0
        for x in kv:
            x[1].copy_(saved)


async def test_a_save_cancelled_after_its_read_completes_and_is_applied(tmp_path: Any) -> None:
    kv = caches()
    cfg = {"tiers": [{"backend": "file", "path": str(tmp_path), "capacity": 64 * BB}], "job_deadline_s": None}
    async with kvtier.open(cfg, kv_caches=kv) as store:
        gate = Gate()
        tier = store.backends[0]
        tier.write_blocks = gate.wrap(tier.write_blocks)  # type: ignore[method-assign]
        task = asyncio.create_task(store.save(K[:2], [0, 1]))
        assert await asyncio.to_thread(gate.entered.wait, HANG_GUARD)  # read done, disk write stalled
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.manager is not None and store.manager.status(K[0]).state is KeyState.PENDING
        gate.open()
        await drain(store)
        assert no_pins_or_pending(store)
        assert await store.lookup(K[:2]) == 2
        assert await store.load(K[:2], [10, 11]) == 2
        assert all(torch.equal(x[10], x[0]) and torch.equal(x[11], x[1]) for x in kv)


# -- defect 3: a closed event loop never kills a worker thread --------------------------------


def test_a_waiter_whose_loop_closed_does_not_kill_the_worker() -> None:
    layout = KVLayout(caches())
    backend = CpuBackend(capacity=8 * layout.block_bytes)
    asyncio.run(backend.open(BlockFormat(block_bytes=layout.block_bytes)))
    manager = TierManager([TierSpec("cpu", 8 * layout.block_bytes, layout.block_bytes, LRUPolicy(8))])
    engine = TransferEngine(layout, [backend])
    gate = Gate()
    real = layout.gather
    layout.gather = gate.wrap(real)  # type: ignore[method-assign]
    try:
        plan = manager.prepare_store(K[:1])
        assert plan is not None
        job = engine.submit_store(plan, [0])
        loop = asyncio.new_event_loop()
        waiter = loop.create_task(engine.wait_async(job))
        loop.run_until_complete(asyncio.sleep(0))  # the waiter is registered
        waiter.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
        assert gate.entered.wait(HANG_GUARD)
        gate.open()
        (result,) = engine.wait([job], timeout=HANG_GUARD)
        assert result.success
        threads = {t.name: t for t in threading.enumerate()}
        assert threads["kvtier-store"].is_alive()
        # And it still runs jobs.
        layout.gather = real  # type: ignore[method-assign]
        manager.complete_store(plan.keys)
        plan2 = manager.prepare_store(K[1:2])
        assert plan2 is not None
        (r2,) = engine.wait([engine.submit_store(plan2, [1])], timeout=HANG_GUARD)
        assert r2.success
    finally:
        gate.open()
        engine.close()
        asyncio.run(backend.aclose())


# -- defect 4: submit never blocks; a full queue fails the job at once --------------------------


def test_a_full_queue_fails_the_job_at_once_and_submit_never_blocks() -> None:
    layout = KVLayout(caches())
    backend = CpuBackend(capacity=16 * layout.block_bytes)
    asyncio.run(backend.open(BlockFormat(block_bytes=layout.block_bytes)))
    manager = TierManager([TierSpec("cpu", 16 * layout.block_bytes, layout.block_bytes, LRUPolicy(16))])
    engine = TransferEngine(layout, [backend], max_queued_jobs=1)
    gate = Gate()
    real = layout.gather
    layout.gather = gate.wrap(real)  # type: ignore[method-assign]
    try:
        plans = [manager.prepare_store(K[i : i + 1]) for i in range(3)]
        assert all(p is not None for p in plans)
        running = engine.submit_store(plans[0], [0])  # type: ignore[arg-type]
        assert gate.entered.wait(HANG_GUARD)
        queued = engine.submit_store(plans[1], [1])  # type: ignore[arg-type]
        done: list[int] = []
        # The queue holds one job: the third is refused at once (this thread never blocks).
        t = threading.Thread(target=lambda: done.append(engine.submit_store(plans[2], [2])))  # type: ignore[arg-type]
        t.start()
        t.join(HANG_GUARD)
        assert done, "submit blocked on a full queue"
        (rejected,) = engine.wait(done, timeout=HANG_GUARD)  # reported before the stall ends
        assert not gate.opened.is_set()
        assert rejected.success is False and rejected.error is not None and "full" in rejected.error
        assert engine.counters["rejected_jobs"] == 1
        gate.open()
        results = {r.job_id: r for r in engine.wait([running, queued], timeout=HANG_GUARD)}
        assert results[running].success and results[queued].success
        for plan, r in zip(plans, (results[running], results[queued], rejected)):
            assert plan is not None
            apply_result(manager, plan, r)
        assert manager.lookup(K[:2]) == 2 and manager.lookup(K[2:3]) == 0
        assert manager.stats()["tiers"][0]["pending"] == 0
    finally:
        gate.open()
        engine.close()
        asyncio.run(backend.aclose())


# -- defect 9: the deadline -------------------------------------------------------------------


async def test_a_stalled_tier_write_passes_its_deadline_releases_keys_and_leaves_no_orphan(tmp_path: Any) -> None:
    kv = caches()
    cfg = {
        "tiers": [
            {"backend": "cpu", "capacity": 4 * BB},
            {"backend": "file", "path": str(tmp_path), "capacity": 64 * BB},
        ],
        "write": "through",
        "job_deadline_s": 0.05,
    }
    async with kvtier.open(cfg, kv_caches=kv) as store:
        assert store.transfers is not None and store.manager is not None
        gate = Gate()
        lower = store.backends[1]
        lower.write_blocks = gate.wrap(lower.write_blocks)  # type: ignore[method-assign]
        # The write-through copy stalls; the deadline fails the job and releases its keys.
        assert await store.save(K[:2], [0, 1]) == 0
        assert gate.entered.is_set() and not gate.opened.is_set()
        assert store.transfers.counters["expired_jobs"] == 1
        assert no_pins_or_pending(store)
        assert await store.lookup(K[:2]) == 0
        gate.open()
        await drain(store)
        # What the late job wrote is deleted again: the tiers match the manager.
        assert len(store.backends[0]) == 0  # type: ignore[arg-type]
        assert not {r.key for r in lower.scan()} & set(K[:2])


def test_the_deadline_never_releases_a_block_whose_device_read_has_not_ended() -> None:
    layout = KVLayout(caches())
    backend = CpuBackend(capacity=8 * layout.block_bytes)
    asyncio.run(backend.open(BlockFormat(block_bytes=layout.block_bytes)))
    manager = TierManager([TierSpec("cpu", 8 * layout.block_bytes, layout.block_bytes, LRUPolicy(8))])
    engine = TransferEngine(layout, [backend], deadline_s=0.01)
    gate = Gate()
    real = layout.gather
    layout.gather = gate.wrap(real)  # type: ignore[method-assign]
    try:
        plan = manager.prepare_store(K[:1])
        assert plan is not None
        job = engine.submit_store(plan, [0])
        assert gate.entered.wait(HANG_GUARD)
        # Far past the deadline, while the read is still under way: the job is not reported.
        expirer = threading.Thread(target=engine.expire_overdue, args=(time.monotonic() + 1000.0,))
        expirer.start()
        expirer.join(0.2)
        assert expirer.is_alive(), "the deadline did not wait for the device read"
        assert engine.result(job) is None
        with pytest.raises(TimeoutError):
            engine.wait_device([job], timeout=0)
        gate.open()
        expirer.join(HANG_GUARD)
        (result,) = engine.wait([job], timeout=HANG_GUARD)
        engine.wait_device([job], timeout=0)
        apply_result(manager, plan, result)
        assert manager.stats()["tiers"][0]["pending"] == 0
    finally:
        gate.open()
        engine.close()
        asyncio.run(backend.aclose())


def test_a_submit_wakes_the_deadline_watchdog_only_for_a_deadline_before_its_next_check() -> None:
    """Waking the watchdog at every submit cost each job a thread switch; a job due after the
    watchdog's next check needs no wake-up, one due before it gets one (and expires on time)."""
    layout = KVLayout(caches())
    backend = CpuBackend(capacity=8 * layout.block_bytes)
    asyncio.run(backend.open(BlockFormat(block_bytes=layout.block_bytes)))
    manager = TierManager([TierSpec("cpu", 8 * layout.block_bytes, layout.block_bytes, LRUPolicy(8))])
    engine = TransferEngine(layout, [backend], deadline_s=120.0)
    kicks = []
    inner = engine._kick.set
    engine._kick.set = lambda: (kicks.append(1), inner())[-1]  # type: ignore[method-assign]
    try:
        deadline = time.monotonic() + HANG_GUARD
        while engine._deadlines.wake_at == 0.0 and time.monotonic() < deadline:
            time.sleep(0.001)  # the watchdog's first check: it then sleeps up to a second
        for i in range(4):
            plan = manager.prepare_store(K[i : i + 1])
            assert plan is not None
            (r,) = engine.wait([engine.submit_store(plan, [i])], timeout=HANG_GUARD)
            assert r.success
        assert kicks == [], "a job due in 120 s woke the watchdog"
        engine.deadline_s = 0.0001  # due before the next check: the watchdog is woken
        plan = manager.prepare_store(K[8:9])
        assert plan is not None
        job = engine.submit_store(plan, [8])
        assert kicks, "a job due before the next check did not wake the watchdog"
        engine.wait([job], timeout=HANG_GUARD)
    finally:
        engine.close()
        asyncio.run(backend.aclose())


def test_close_waits_for_a_deadline_watchdog_in_the_middle_of_a_check() -> None:
    """A close once left the watchdog running when it was inside a check (seen as a stray
    ``kvtier-deadline`` thread after a connector closed, on a loaded machine)."""
    layout = KVLayout(caches())
    backend = CpuBackend(capacity=8 * layout.block_bytes)
    asyncio.run(backend.open(BlockFormat(block_bytes=layout.block_bytes)))
    engine = TransferEngine(layout, [backend], deadline_s=120.0)
    inside = threading.Event()
    real = engine._deadlines.expire_overdue

    def slow_check(now: float | None = None) -> int:
        inside.set()
        time.sleep(0.3)
        return real(now)

    engine._deadlines.expire_overdue = slow_check  # type: ignore[method-assign]
    engine._kick.set()  # the next check starts now, and takes 0.3 s
    try:
        assert inside.wait(HANG_GUARD)
    finally:
        engine.close()
        asyncio.run(backend.aclose())
    watchdogs = [t for t in engine._threads if t.name == "kvtier-deadline"]
    assert watchdogs and not any(t.is_alive() for t in watchdogs)


# -- the job module itself ----------------------------------------------------------------------


def test_combine_results_fails_a_key_that_failed_on_any_rank() -> None:
    a = JobResult(1, "store", True, (K[0], K[1]), nbytes=10, sizes={1: {K[0]: 5}})
    b = JobResult(1, "store", False, (K[0], K[1]), nbytes=10, failed={0: (K[1],)}, sizes={1: {K[0]: 7}})
    c = combine_results([a, b])
    assert c.success is False and c.failed == {0: (K[1],)} and c.nbytes == 20 and c.sizes == {1: {K[0]: 7}}
    la = JobResult(2, "load", False, (K[0], K[1]), missed=(K[1],), missed_tiers=(1,))
    lb = JobResult(2, "load", False, (K[0], K[1]), missed=(K[0],), missed_tiers=(0,))
    lc = combine_results([la, lb])
    assert lc.missed == (K[0], K[1]) and lc.missed_tiers == (0, 1)
    with pytest.raises(ValueError, match="mixed kinds"):
        combine_results([a, la])
    with pytest.raises(ValueError, match="at least one"):
        combine_results([])
