"""An interrupt (``KeyboardInterrupt``: a ``BaseException``, not an ``Exception``) raised by a
tier or a copy inside a job run inline (``submit_*(..., inline=True)``, :mod:`kvtier.transfer.inline`)
goes on up to the caller once the job is settled as its thread would settle it: what it wrote
undone (its evictions run), reported failed, given back, forgotten. Then, with the plan released
in the manager (:func:`~kvtier.transfer.jobs.plan_failed`, as the store facade does): the engine
is idle (``wait_idle`` and ``close`` return), the next job runs inline, no pin or reservation is
left, every tier holds exactly the keys the manager gives it, and a load reads the right bytes.
Without the settling, the engine went on counting the job: ``wait_idle`` timed out and no job
ran inline again. Also the same on the transfer threads, and through ``KVStore``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kvtier.backends.memory import CpuBackend
from test_plain_jobs import HostRig
from test_transfer import make_layout, record_of

import kvtier
from kvtier.backend import BlockFormat
from kvtier.errors import LifecycleError
from kvtier.manager import KeyState, LoadPlan, StorePlan, TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key
from kvtier.transfer import TransferEngine
from kvtier.transfer.jobs import apply_result, plan_failed

K = [make_key(11000 + i) for i in range(40)]
HANG_GUARD = 30.0


def interrupt_once(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str, *, after: bool = False, at: int = 1) -> None:
    """``obj.name`` raises ``KeyboardInterrupt`` on its ``at``-th call from now (``after``: once
    that call has done its work); every other call works as before."""
    inner = getattr(obj, name)
    calls = []

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(True)
        if len(calls) != at:
            return inner(*args, **kwargs)
        if after:
            inner(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(obj, name, call)


def interrupted(engine: TransferEngine, manager: TierManager, plan: StorePlan | LoadPlan, submit: Callable[[], Any]) -> None:
    """``submit()`` goes up as the interrupt; the engine is left idle, with nothing of the job;
    the plan is released in the manager as the store facade releases it."""
    with pytest.raises(KeyboardInterrupt):
        submit()
    assert engine._active == 0 and not engine._inline_running and engine._tier_jobs == 0
    assert not engine._jobs and not engine._finished and engine.poll_finished() == []
    engine.wait_idle(HANG_GUARD)  # timed out without the settling: the job stayed counted
    apply_result(manager, plan, plan_failed(0, plan, "interrupted"))


def tiers_match(manager: TierManager, backends: list[Any]) -> None:
    """Every tier holds exactly the keys the manager gives it (no orphan, no key lost)."""
    for t, backend in enumerate(backends):
        held = set(backend.stored_keys())
        assert held == {k for k in K if manager.holds(k, t)}, f"tier {t}"


def runs_inline(engine: TransferEngine, submit: Callable[[], int]) -> Any:
    """``submit()`` runs its job inline (ended at once, counted in ``inline_jobs``); its result."""
    before = engine.counters["inline_jobs"]
    res = engine.take(submit())
    assert res is not None and engine.counters["inline_jobs"] == before + 1
    return res


#: (straight path, the call interrupted, after its work): each call the path makes, in its order
class TwoTierRig:
    """A host cache, two ``cpu`` tiers of 8 blocks (``write``: through or back), a manager and
    an engine."""

    def __init__(self, write: str) -> None:
        self.layout = make_layout()
        fmt = BlockFormat(block_bytes=self.layout.block_bytes)
        self.backends = [CpuBackend(capacity=8 * fmt.block_bytes) for _ in range(2)]
        for backend in self.backends:
            asyncio.run(backend.open(fmt))
        specs = [TierSpec(f"cpu{t}", 8 * fmt.block_bytes, fmt.block_bytes, LRUPolicy(8)) for t in range(2)]
        self.manager = TierManager(specs, write=write)  # type: ignore[arg-type]
        self.engine = TransferEngine(self.layout, list(self.backends))


STORE_STAGES = [
    (True, "evict_and_reserve", False),  # the straight path's evictions and room, in one call
    (True, "gather", False),  # the copy, before it wrote anything
    (True, "gather", True),  # the copy, once it wrote the blocks: they must not stay
    (False, "delete_blocks", False),  # the general path's eviction
    (False, "delete_blocks", True),
    (False, "reserve", False),  # its room
    (False, "gather", False),
    (False, "gather", True),
]


@pytest.mark.parametrize(("plain", "stage", "after"), STORE_STAGES)
def test_an_interrupted_inline_store_is_settled_and_the_engine_goes_on(
    monkeypatch: pytest.MonkeyPatch, plain: bool, stage: str, after: bool
) -> None:
    rig = HostRig()
    engine, manager, backend = rig.engine, rig.manager, rig.backend
    engine._inline.plain.enabled = plain
    try:
        blocks = rig.blocks()  # the engine blocks' bytes, before any load writes them
        for keys, ids in ((K[0:4], [0, 1, 2, 3]), (K[4:8], [4, 5, 6, 7])):
            plan = manager.prepare_store(keys)
            assert plan is not None
            res = runs_inline(engine, lambda p=plan, i=ids: engine.submit_store(p, i, inline=True))
            apply_result(manager, plan, res)
        plan = manager.prepare_store(K[8:10])  # the tier is full: evicts K[0:2]
        assert plan is not None and plan.drops == ((0, (K[0], K[1])),)
        interrupt_once(monkeypatch, rig.layout if stage == "gather" else backend, stage, after=after)
        interrupted(engine, manager, plan, lambda: engine.submit_store(plan, [8, 9], inline=True))
        assert engine.counters["failed_jobs"] == 1 and engine.counters["jobs"] == 3
        assert [manager.status(k).state for k in K[0:10]] == [KeyState.MISS] * 2 + [KeyState.READY] * 6 + [KeyState.MISS] * 2
        tiers_match(manager, [backend])
        monkeypatch.undo()
        # The next jobs run inline, and every load reads the bytes stored under its keys.
        plan = manager.prepare_store(K[8:10])
        assert plan is not None and plan.keys == (K[8], K[9])
        apply_result(manager, plan, runs_inline(engine, lambda: engine.submit_store(plan, [10, 11], inline=True)))
        load = manager.prepare_load([*K[8:10], *K[2:4]])
        res = runs_inline(engine, lambda: engine.submit_load(load, [12, 13, 14, 15], inline=True))
        assert apply_result(manager, load, res).done == 4
        after_blocks = rig.blocks()
        for dst, src in zip((12, 13, 14, 15), (10, 11, 2, 3)):
            assert torch.equal(after_blocks[dst], blocks[src])
        tiers_match(manager, [backend])
    finally:
        engine.close(HANG_GUARD)
    assert engine.stopped


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize(("stage", "after"), [("slots", False), ("scatter", False), ("scatter", True)])
def test_an_interrupted_inline_load_is_settled_and_its_pins_released(
    monkeypatch: pytest.MonkeyPatch, plain: bool, stage: str, after: bool
) -> None:
    rig = HostRig()
    engine, manager, backend = rig.engine, rig.manager, rig.backend
    engine._inline.plain.enabled = plain
    try:
        blocks = rig.blocks()
        plan = manager.prepare_store(K[0:4])
        assert plan is not None
        apply_result(manager, plan, runs_inline(engine, lambda: engine.submit_store(plan, [0, 1, 2, 3], inline=True)))
        load = manager.prepare_load(K[0:2])
        interrupt_once(monkeypatch, rig.layout if stage == "scatter" else backend, stage, after=after)
        interrupted(engine, manager, load, lambda: engine.submit_load(load, [8, 9], inline=True))
        with pytest.raises(LifecycleError, match="is not pinned"):
            manager.complete_load(K[0:1])  # released: no pin of it is left
        assert engine.counters["failed_jobs"] == 1
        monkeypatch.undo()
        load = manager.prepare_load(K[0:4])
        assert apply_result(manager, load, runs_inline(engine, lambda: engine.submit_load(load, [8, 9, 10, 11], inline=True))).done == 4
        after_blocks = rig.blocks()
        assert all(torch.equal(after_blocks[8 + i], blocks[i]) for i in range(4))
        assert manager.remove(K[0:4], 0) == K[0:4]  # unpinned: forgotten at once
    finally:
        engine.close(HANG_GUARD)
    assert engine.stopped


@pytest.mark.parametrize("write", ["through", "back"])
def test_an_interrupt_in_a_copy_between_tiers_leaves_every_tier_matching_the_manager(
    monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """Write-through copies and write-back demotions (the general path, two ``cpu`` tiers): an
    interrupt in the lower tier's write leaves no copy the manager does not know of."""
    rig = TwoTierRig(write)
    engine, manager, backends = rig.engine, rig.manager, rig.backends
    try:
        blocks = [record_of(rig.layout, b) for b in range(rig.layout.num_engine_blocks)]
        plan = manager.prepare_store(K[0:8])  # fills the first tier
        assert plan is not None
        apply_result(manager, plan, runs_inline(engine, lambda: engine.submit_store(plan, list(range(8)), inline=True)))
        plan = manager.prepare_store(K[8:10])
        assert plan is not None and (plan.demotions if write == "back" else plan.write_through)
        interrupt_once(monkeypatch, backends[1], "write_blocks")
        interrupted(engine, manager, plan, lambda: engine.submit_store(plan, [8, 9], inline=True))
        assert manager.status(K[8]).state is KeyState.MISS and manager.status(K[9]).state is KeyState.MISS
        tiers_match(manager, backends)
        monkeypatch.undo()
        held = [k for k in K[0:8] if manager.status(k).state is KeyState.READY][-6:]
        load = manager.prepare_load(held, promote=False)
        res = runs_inline(engine, lambda: engine.submit_load(load, list(range(10, 10 + len(held))), inline=True))
        assert apply_result(manager, load, res).done == len(held) > 0
        now = [record_of(rig.layout, b) for b in range(10, 10 + len(held))]
        assert all(torch.equal(now[i], blocks[K.index(k)]) for i, k in enumerate(held))
        tiers_match(manager, backends)
    finally:
        engine.close(HANG_GUARD)
    assert engine.stopped


def test_an_interrupted_load_deletes_the_promotions_it_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that promoted a block from the second tier into the first, then was interrupted
    in its next copy: the promoted copy is deleted, as the manager releases it."""
    rig = TwoTierRig("back")
    engine, manager, backends = rig.engine, rig.manager, rig.backends
    try:
        for keys, ids in ((K[0:8], list(range(8))), (K[8:9], [8])):  # K[0] demoted to the second tier
            plan = manager.prepare_store(keys)
            assert plan is not None
            apply_result(manager, plan, runs_inline(engine, lambda p=plan, i=ids: engine.submit_store(p, i, inline=True)))
        assert manager.status(K[0]).tier == 1
        assert manager.remove([K[1]], 0) == [K[1]]  # room in the first tier for the promotion
        backends[0].delete_blocks([K[1]])
        load = manager.prepare_load([K[0], K[5]])  # K[0] read from the second tier and promoted, then K[5]
        assert load.tiers == (1, 0) and load.promote == (K[0],)
        interrupt_once(monkeypatch, rig.layout, "scatter", at=2)  # K[0] copied and promoted; K[5]'s copy
        interrupted(engine, manager, load, lambda: engine.submit_load(load, [12, 13], inline=True))
        assert not manager.holds(K[0], 0) and K[0] not in backends[0].stored_keys()
        tiers_match(manager, backends)
    finally:
        engine.close(HANG_GUARD)
    assert engine.stopped


@pytest.mark.parametrize("now", [True, False])
def test_a_save_or_load_that_goes_up_as_an_interrupt_leaves_no_pin_or_reservation(monkeypatch: pytest.MonkeyPatch, now: bool) -> None:
    """``KVStore.save`` / ``load`` with a job run at once (``now``) or through the inline
    submit: the interrupt goes up, and the manager holds nothing of the plan: no key left
    pending (it was stored again at once), no pin (a later load and a forget go through)."""
    g = torch.Generator().manual_seed(3)
    caches = [torch.randn((12, 4, 2, 2, 16), generator=g) for _ in range(3)]
    block_bytes = sum(c[0].numel() * c.element_size() for c in caches)

    def block(b: int) -> torch.Tensor:
        return torch.cat([c[b].flatten() for c in caches])

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 6 * block_bytes}]}, kv_caches=caches) as store:
            engine, manager = store.transfers, store.manager
            assert engine is not None and manager is not None
            engine._now.enabled = now
            saved = [block(b) for b in range(6)]
            assert await store.save(K[0:3], [0, 1, 2]) == 3
            interrupt_once(monkeypatch, engine.layout, "gather")
            with pytest.raises(KeyboardInterrupt):
                await store.save(K[3:5], [3, 4])
            assert manager.status(K[3]).state is KeyState.MISS and manager.lookup(K[0:5]) == 3
            assert engine._active == 0 and not engine._jobs and not engine._finished
            interrupt_once(monkeypatch, engine.layout, "scatter")
            with pytest.raises(KeyboardInterrupt):
                await store.load(K[0:2], [8, 9])
            with pytest.raises(LifecycleError, match="is not pinned"):
                manager.complete_load(K[0:1])
            assert await store.save(K[3:5], [3, 4]) == 2 and await store.load(K[0:5], [6, 7, 8, 9, 10]) == 5
            assert all(torch.equal(block(6 + i), saved[i]) for i in range(5))
            assert manager.remove(K[0:2], 0) == K[0:2]  # no pin left on them
            assert engine.counters["failed_jobs"] == 2 and engine._active == 0

    asyncio.run(run())


def test_an_interrupted_load_on_its_thread_is_reported_failed_and_its_promotions_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    """On ``kvtier-load`` an interrupt is the job's failure: reported (a waiter wakes; it used
    to wait forever, the job given back but never reported), its promotions deleted."""
    rig = TwoTierRig("back")
    engine, manager, backends = rig.engine, rig.manager, rig.backends
    try:
        for keys, ids in ((K[0:8], list(range(8))), (K[8:9], [8])):  # K[0] demoted to the second tier
            plan = manager.prepare_store(keys)
            assert plan is not None
            apply_result(manager, plan, runs_inline(engine, lambda p=plan, i=ids: engine.submit_store(p, i, inline=True)))
        assert manager.remove([K[1]], 0) == [K[1]]
        backends[0].delete_blocks([K[1]])
        load = manager.prepare_load([K[0], K[5]])
        assert load.promote == (K[0],)
        interrupt_once(monkeypatch, rig.layout, "scatter", at=2)
        job = engine.submit_load(load, [12, 13])  # on the load thread
        (res,) = engine.wait([job], timeout=HANG_GUARD)
        assert not res.success and res.error is not None and "KeyboardInterrupt" in res.error
        engine.wait_idle(HANG_GUARD)
        applied = apply_result(manager, load, res)
        assert applied.failed_promotions == (K[0],) and not manager.holds(K[0], 0)
        tiers_match(manager, backends)
        monkeypatch.undo()
        load = manager.prepare_load([K[0], K[5]], promote=False)
        assert apply_result(manager, load, runs_inline(engine, lambda: engine.submit_load(load, [12, 13], inline=True))).done == 2
    finally:
        engine.close(HANG_GUARD)
    assert engine.stopped


@pytest.mark.parametrize("how", ["now", "plain", "general"])
def test_an_interrupt_in_the_undo_of_an_interrupted_store_still_gives_the_engine_back(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The copy is interrupted, then so is the undo's first delete: the second interrupt goes
    up, and the engine is idle all the same (the next job runs inline)."""
    rig = HostRig()
    engine, manager, backend = rig.engine, rig.manager, rig.backend
    engine._inline.plain.enabled = how != "general"
    try:
        plan = manager.prepare_store(K[0:2])
        assert plan is not None
        interrupt_once(monkeypatch, rig.layout, "gather")
        deletes = []
        inner = backend.delete_blocks

        def delete(keys: Any) -> None:
            deletes.append(list(keys))
            raise KeyboardInterrupt("in the undo")

        monkeypatch.setattr(backend, "delete_blocks", delete)
        with pytest.raises(KeyboardInterrupt, match="in the undo"):
            if how == "now":
                engine.store_now(plan, [0, 1])
            else:
                engine.submit_store(plan, [0, 1], inline=True)
        assert deletes == [list(K[0:2])]  # the undo's delete of its new blocks, interrupted
        assert engine._active == 0 and not engine._inline_running and not engine._jobs and not engine._finished
        engine.wait_idle(HANG_GUARD)
        monkeypatch.undo()
        inner(K[0:2])  # (what the undo would have deleted)
        apply_result(manager, plan, plan_failed(0, plan, "interrupted"))
        plan = manager.prepare_store(K[2:4])
        assert plan is not None
        assert runs_inline(engine, lambda: engine.submit_store(plan, [2, 3], inline=True)).success
    finally:
        engine.close(HANG_GUARD)
    assert engine.stopped
