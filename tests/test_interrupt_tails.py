"""Interrupts (``KeyboardInterrupt``: a ``BaseException``, not an ``Exception``) that used to
leave the manager and a tier disagreeing for good, each raised at exactly one point by
replacing the call that follows it: a store facade call interrupted while it awaits a job on
the transfer threads (the job ran on, its plan was never applied: keys pending for good), and
the end of a job run at once (``store_now`` / ``load_now``) once its copy is done (the engine
was never given back, or a store's blocks stayed in its tier with the plan released), an
inline job's ``take`` (released as never run though it stored; a queued job's plan released
while it ran on; an evicting save or promotion stopped before its job ran, its victims left in the tier), a save's applying before the
manager completed it (a load's before the manager's unpin began, never twice), the settling of a cancelled caller's job (keys pending), and the
release of blocks stored behind a failed write (records the manager forgot). After
each: the engine is idle and closes, every tier holds exactly the keys the manager gives it,
nothing is pending or pinned, and fresh keys save and load the right bytes."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_inline_interrupts import HANG_GUARD, K, interrupt_once, tiers_match

import kvtier
from kvtier.errors import LifecycleError
from kvtier.manager import KeyState, tier_manager
from kvtier.transfer import jobs_now, runs
from kvtier.transfer.jobs import apply_result


def _caches() -> tuple[list[torch.Tensor], int]:
    g = torch.Generator().manual_seed(5)
    caches = [torch.randn((16, 4, 2, 2, 16), generator=g) for _ in range(2)]
    return caches, sum(c[0].numel() * c.element_size() for c in caches)


def _block(caches: list[torch.Tensor], b: int) -> torch.Tensor:
    return torch.cat([c[b].flatten() for c in caches])


async def _interrupted(store: Any, kind: str) -> None:
    """A save of ``K[0:2]`` from blocks 0 and 1, or a load of them into blocks 2 and 3, that
    raises the ``KeyboardInterrupt`` the test arranged."""
    with pytest.raises(KeyboardInterrupt):
        if kind == "save":
            await store.save(K[0:2], [0, 1])
        else:
            await store.load(K[0:2], [2, 3])


async def _goes_on(store: Any, caches: list[torch.Tensor], keys: list[bytes]) -> None:
    """Nothing pending or pinned, the tier matches the manager, fresh keys save and load, and
    those of ``keys`` still held load the bytes stored under them."""
    engine, manager = store.transfers, store.manager
    await asyncio.sleep(0)  # (a settling task, if any, runs)
    engine.wait_idle(HANG_GUARD)
    store._settle_finished()
    assert engine._active == 0 and not engine._inline_running and not engine._jobs and not engine._finished
    assert all(manager.status(k).state in (KeyState.READY, KeyState.MISS) for k in K[0:12])
    stats = manager.stats()
    assert stats["open_plans"] == 0 and stats["tiers"][0]["pending"] == stats["tiers"][0]["pinned"] == 0
    tiers_match(manager, store.backends)
    held = [k for k in keys if manager.status(k).state is KeyState.READY][:2]  # (engine blocks 12-15)
    saved = [_block(caches, b).clone() for b in range(12)]
    assert await store.save(K[20:22], [10, 11]) == 2
    assert await store.load([*held, *K[20:22]], [12, 13, 14, 15][: len(held) + 2]) == len(held) + 2
    for i, src in enumerate([*(K.index(k) for k in held), 10, 11]):
        assert torch.equal(_block(caches, 12 + i), saved[src])
    for k in [*held, *K[20:22]]:
        with pytest.raises(LifecycleError, match="is not pinned"):
            manager.complete_load([k])
    tiers_match(manager, store.backends)


@pytest.mark.parametrize("kind", ["save", "load"])
def test_an_interrupt_while_awaiting_a_threaded_job_applies_the_job_when_it_ends(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The job runs on the transfer threads (nothing inline); the await itself goes up as an
    interrupt. Before, only a cancellation was handled: the job ran on and its plan was never
    applied, so its keys stayed pending (or pinned) for good and every later save skipped them."""
    caches, block_bytes = _caches()

    async def run() -> None:
        config = {"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}], "inline_max_bytes": 0}
        async with kvtier.open(config, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            if kind == "load":
                assert await store.save(K[0:2], [0, 1]) == 2
            interrupt_once(monkeypatch, engine, "wait_async")
            await _interrupted(store, kind)
            monkeypatch.undo()
            await _goes_on(store, caches, list(K[0:2]))
            if kind == "load":
                assert manager.lookup(K[0:2]) == 2
        assert engine.stopped

    asyncio.run(run())


class _ClockThatStops:
    """``time`` for :mod:`kvtier.transfer.jobs_now`: its ``at``-th ``perf_counter`` call from
    now raises the interrupt (the second of a job: right after its copy)."""

    def __init__(self, at: int) -> None:
        self.calls = 0
        self.at = at

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return 0.0


@pytest.mark.parametrize("point", ["start", "clock", "end", "result"])
@pytest.mark.parametrize("kind", ["save", "load"])
def test_an_interrupt_after_the_copy_of_a_job_run_at_once_is_settled(monkeypatch: pytest.MonkeyPatch, kind: str, point: str) -> None:
    """``store_now`` / ``load_now``: the copy is done, then the interrupt comes (the clock read
    after it, the engine's give-back, the result built), or it comes once the engine is
    claimed, before the copy (the clock read there). The engine is given back, and a
    store's blocks are deleted from the tier as its plan is released (they stayed: a record
    the manager forgot, holding a slot for good)."""
    caches, block_bytes = _caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}]}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            now = engine._now
            if kind == "load":
                assert await store.save(K[0:2], [0, 1]) == 2
            if point in ("start", "clock"):  # the clock read before the copy, or after it
                monkeypatch.setattr(jobs_now, "time", _ClockThatStops(1 if point == "start" else 2))
            elif point == "end":
                interrupt_once(monkeypatch, now, "_end")
            else:
                interrupt_once(monkeypatch, jobs_now, "result_of")
            before = engine.counters["inline_jobs"]
            await _interrupted(store, kind)
            monkeypatch.undo()
            assert engine.counters["inline_jobs"] == before + 1 and engine.counters["failed_jobs"] == 1
            if kind == "save":
                assert manager.status(K[0]).state is KeyState.MISS and not store.backends[0].stored_keys()
            await _goes_on(store, caches, list(K[0:2]) if kind == "load" else [])
        assert engine.stopped

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["save", "load"])
def test_an_interrupt_as_an_inline_job_is_taken_applies_its_result(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The inline job ran (a store's blocks are in the tier), then ``take`` goes up as the
    interrupt before it handed the result over. The result is taken in the handler and applied;
    before, the plan was released as if the job never ran, so the manager forgot blocks its
    tier held (and the job's record stayed in the engine)."""
    caches, block_bytes = _caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}]}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            engine._now.enabled = False  # the inline submit, then take
            if kind == "load":
                assert await store.save(K[0:2], [0, 1]) == 2
            interrupt_once(monkeypatch, engine, "take")
            await _interrupted(store, kind)
            monkeypatch.undo()
            assert manager.lookup(K[0:2]) == 2  # the save applied: its blocks ready (0 before)
            await _goes_on(store, caches, list(K[0:2]))
        assert engine.stopped

    asyncio.run(run())


@pytest.mark.parametrize("where", ["apply_result", "complete_store"])
def test_an_interrupt_before_the_manager_completes_a_save_applies_it(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The job ended and its result is in hand; the interrupt comes as ``finish_store`` applies
    it, before the manager took it (its call to ``apply_result``, or the manager's
    ``complete_store``). The store is applied, then the interrupt goes up; before, its keys
    stayed pending for good (every later save skipped them, every lookup stopped there)."""
    caches, block_bytes = _caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}]}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            if where == "apply_result":
                interrupt_once(monkeypatch, runs, "apply_result")
            else:
                interrupt_once(monkeypatch, manager, "complete_store")
            with pytest.raises(KeyboardInterrupt):
                await store.save(K[0:2], [0, 1])
            monkeypatch.undo()
            assert manager.lookup(K[0:2]) == 2
            await _goes_on(store, caches, list(K[0:2]))
        assert engine.stopped

    asyncio.run(run())


def test_an_interrupt_while_a_cancelled_callers_job_is_settled_applies_its_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save cancelled while its job ran on a thread is settled by the next call; the
    interrupt comes as that job is forgotten. Its plan is applied first; before, it was taken
    off the list of unsettled jobs, then lost (its keys pending for good)."""
    caches, block_bytes = _caches()

    async def run() -> None:
        config = {"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}], "inline_max_bytes": 0}
        async with kvtier.open(config, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            started = asyncio.Event()
            inner = engine.wait_async

            async def waited(job: int) -> Any:
                started.set()
                return await inner(job)

            copying, go = threading.Event(), threading.Event()
            gather = engine.layout.gather

            def held(*args: Any, **kwargs: Any) -> Any:
                copying.set()
                go.wait(HANG_GUARD)  # the job runs on while its caller is cancelled
                return gather(*args, **kwargs)

            monkeypatch.setattr(engine, "wait_async", waited)
            monkeypatch.setattr(engine.layout, "gather", held)
            monkeypatch.setattr(engine, "cancel", lambda job: False)  # a store past its device read: left to end
            task = asyncio.create_task(store.save(K[0:2], [0, 1]))
            await started.wait()
            assert copying.wait(HANG_GUARD)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for settler in list(store._runs.settlers):
                settler.cancel()  # left to the next call, as with no loop to wait on
            await asyncio.sleep(0)
            go.set()
            monkeypatch.undo()
            engine.wait_idle(HANG_GUARD)
            assert store._runs.unsettled
            interrupt_once(monkeypatch, engine, "forget")
            with pytest.raises(KeyboardInterrupt):
                store._settle_finished()
            monkeypatch.undo()
            assert not store._runs.unsettled
            # The job's record, ended, stays until someone polls it: nothing runs.
            assert engine.pending_jobs() == 0 and len(engine.poll_finished()) == 1 and not engine._jobs
            assert all(manager.status(k).state in (KeyState.READY, KeyState.MISS) for k in K[0:2])
            await _goes_on(store, caches, list(K[0:2]))
        assert engine.stopped

    asyncio.run(run())


def test_an_interrupt_as_blocks_behind_a_failed_write_are_released_still_deletes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save of four blocks into a ``file`` tier whose write of the second fails: the two
    behind it are released (the manager forgets them, a queued job deletes their records).
    The interrupt comes as that job is submitted: it is queued all the same; before, the
    tier kept two records the manager had forgotten."""
    caches, block_bytes = _caches()

    async def run() -> None:
        config = {"tiers": [{"backend": "file", "path": str(tmp_path / "file"), "capacity": 16 * block_bytes, "sync_mode": "fast"}]}
        async with kvtier.open(config, kv_caches=caches) as store:
            engine, manager, backend = store.transfers, store.manager, store.backends[0]
            write = backend.write_blocks

            def second_fails(keys: Any, blocks: Any) -> list[int | None]:
                kept = [i for i, k in enumerate(keys) if k != K[1]]
                sizes = write([keys[i] for i in kept], [blocks[i] for i in kept])
                got: list[int | None] = [None] * len(keys)
                for i, size in zip(kept, sizes):
                    got[i] = size
                return got

            monkeypatch.setattr(backend, "write_blocks", second_fails)
            interrupt_once(monkeypatch, engine, "submit_store", at=2)  # the save's job, then the release's
            with pytest.raises(KeyboardInterrupt):
                await store.save(K[0:4], [0, 1, 2, 3])
            monkeypatch.undo()
            engine.wait_idle(HANG_GUARD)
            engine.poll_finished()  # (the release's job, whose caller went up)
            assert [manager.status(k).state for k in K[0:4]] == [KeyState.READY] + [KeyState.MISS] * 3
            rows = [torch.zeros(block_bytes, dtype=torch.uint8) for _ in range(4)]
            assert backend.read_blocks(K[0:4], rows) == [True, False, False, False]  # before: True at 2 and 3
            assert await store.save(K[1:4], [1, 2, 3]) == 3 and await store.load(K[0:4], [8, 9, 10, 11]) == 4
            assert all(torch.equal(_block(caches, 8 + i), _block(caches, i)) for i in range(4))
        assert engine.stopped

    asyncio.run(run())


@pytest.mark.parametrize("where", ["apply_result", "complete_load"])
def test_an_interrupt_before_the_manager_unpins_a_load_applies_it(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """As for a save: the load ended, the interrupt comes before the manager's unpin began.
    The load is applied (its pins released), then the interrupt goes up; before, both blocks
    stayed pinned for good (never evicted, the tier's room lost)."""
    caches, block_bytes = _caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}]}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            assert await store.save(K[0:2], [0, 1]) == 2
            if where == "apply_result":
                interrupt_once(monkeypatch, runs, "apply_result")
            else:
                interrupt_once(monkeypatch, manager, "complete_load")
            with pytest.raises(KeyboardInterrupt):
                await store.load(K[0:2], [2, 3])
            monkeypatch.undo()
            await _goes_on(store, caches, list(K[0:2]))  # (it checks no pin is left on them)
        assert engine.stopped

    asyncio.run(run())


def test_an_interrupt_once_the_unpin_began_never_unpins_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another load holds its own pins on the same blocks. The interrupt comes inside the
    manager's unpin, once it ran: the load is not applied again, so the other load keeps its
    pin (a second unpin would have released it, leaving its blocks free to be evicted while
    it reads them)."""
    caches, block_bytes = _caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}]}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            assert await store.save(K[0:2], [0, 1]) == 2
            other = manager.prepare_load(K[0:2], promote=False)  # the other load's pins
            interrupt_once(monkeypatch, tier_manager, "unpin", after=True)
            with pytest.raises(KeyboardInterrupt):
                await store.load(K[0:2], [2, 3])
            monkeypatch.undo()
            manager.complete_load(other.keys)  # the other load's pins are still there
            with pytest.raises(LifecycleError, match="is not pinned"):
                manager.complete_load(K[0:1])
            await _goes_on(store, caches, list(K[0:2]))
        assert engine.stopped

    asyncio.run(run())


def test_an_interrupt_once_take_took_an_inline_result_deletes_what_the_store_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    """``take`` took the inline store's result, then the interrupt came before the caller held
    it: the outcome is lost, so the plan is released and what the job wrote is deleted by a job
    queued behind it; before, the tier kept two blocks the manager had released."""
    caches, block_bytes = _caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}]}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            engine._now.enabled = False  # the inline submit, then take
            interrupt_once(monkeypatch, engine, "take", after=True)
            with pytest.raises(KeyboardInterrupt):
                await store.save(K[0:2], [0, 1])
            monkeypatch.undo()
            assert manager.lookup(K[0:2]) == 0
            await _goes_on(store, caches, [])  # (the tier holds neither: it matches the manager)
        assert engine.stopped

    asyncio.run(run())


def test_an_interrupt_as_a_queued_jobs_result_is_asked_for_settles_it_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The save's job could not run inline (another job runs on the threads), so it is queued;
    the interrupt comes as the call asks for its result. The job is stopped (it is still
    queued) and settled; before, its plan was released while it stayed queued, and it then
    stored two blocks the manager had forgotten."""
    caches, block_bytes = _caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}]}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            engine._now.enabled = False
            copying, go = threading.Event(), threading.Event()
            gather = engine.layout.gather
            held: list[bool] = []

            def hold_first(*args: Any, **kwargs: Any) -> Any:
                if not held:
                    held.append(True)
                    copying.set()
                    go.wait(HANG_GUARD)
                return gather(*args, **kwargs)

            monkeypatch.setattr(engine.layout, "gather", hold_first)
            first = manager.prepare_store(K[4:6])
            assert first is not None
            first_job = engine.submit_store(first, [4, 5])  # on the threads, held in its copy
            assert copying.wait(HANG_GUARD)
            interrupt_once(monkeypatch, engine, "take")
            with pytest.raises(KeyboardInterrupt):
                await store.save(K[0:2], [0, 1])
            go.set()
            (res,) = engine.wait([first_job], HANG_GUARD)
            engine.forget([first_job])
            apply_result(manager, first, res)
            monkeypatch.undo()
            await _goes_on(store, caches, list(K[0:2]) + list(K[4:6]))
        assert engine.stopped

    asyncio.run(run())


def test_an_interrupt_before_an_evicting_save_submits_its_job_still_runs_its_evictions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier is full; a save's plan evicts two blocks (the manager forgets them at once),
    then the interrupt comes before its job runs (the call that would run it at once). The
    plan is released and its evictions still reach the tier; before, the tier kept the two
    victims the manager had forgotten."""
    caches, block_bytes = _caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 4 * block_bytes}]}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            assert await store.save(K[0:4], [0, 1, 2, 3]) == 4  # full
            interrupt_once(monkeypatch, engine, "store_now")
            with pytest.raises(KeyboardInterrupt):
                await store.save(K[4:6], [4, 5])
            monkeypatch.undo()
            assert manager.lookup(K[4:6]) == 0 and manager.lookup(K[2:4]) == 2
            await _goes_on(store, caches, list(K[0:4]))  # (the tier holds exactly what the manager does)
        assert engine.stopped

    asyncio.run(run())


def test_an_interrupt_as_a_load_submits_its_promotion_still_runs_its_evictions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load served from the second tier promotes into the full first one: the promotion's
    plan evicts (demotes) a block of the first tier, then the interrupt comes as its job is
    submitted. The plan is released and the eviction still reaches the first tier; before,
    it kept a block the manager had moved out of it."""
    caches, block_bytes = _caches()
    tiers = [{"backend": "cpu", "capacity": 2 * block_bytes}, {"backend": "cpu", "capacity": 8 * block_bytes}]

    async def run() -> None:
        async with kvtier.open({"tiers": tiers}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            assert await store.save(K[0:2], [0, 1]) == 2
            assert await store.save(K[2:4], [2, 3]) == 2  # K[0:2] now in the second tier only
            assert not manager.holds(K[0], 0)
            interrupt_once(monkeypatch, engine, "submit_store")  # the promotion's (the load ran at once)
            with pytest.raises(KeyboardInterrupt):
                await store.load(K[0:1], [6], promote=True)
            monkeypatch.undo()
            assert torch.equal(_block(caches, 6), _block(caches, 0))
            await _goes_on(store, caches, list(K[0:4]))
        assert engine.stopped

    asyncio.run(run())
