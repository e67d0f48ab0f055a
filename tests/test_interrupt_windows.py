"""An interrupt (``KeyboardInterrupt``) that reaches ``KVStore.save`` / ``load`` once the job
has ended, its result in hand but not yet applied to the manager: the result is applied as the
call would have applied it, then the interrupt goes on up. Before, the plan was released as if
the job never ran (the manager forgot blocks its tier held, so later saves stored nothing), or
nothing was done at all (keys pending and blocks pinned for good). Each test raises the
interrupt at one such point, then checks that the manager and every tier agree, that no key is
left pending or pinned, and that a later save and load of fresh keys work."""

from __future__ import annotations

import asyncio
import inspect
import sys
from types import FrameType
from typing import Any

import pytest
import torch
from test_inline_interrupts import interrupt_once

import kvtier
from kvtier.manager import KeyState
from kvtier.testing import make_key
from kvtier.transfer.runs import JobRuns

K = [make_key(12000 + i) for i in range(16)]


class Caches:
    """Engine caches of 12 blocks, and the bytes of one block."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.caches = [torch.randn((12, 4, 2, 2, 16), generator=g) for _ in range(3)]
        self.block_bytes = sum(c[0].numel() * c.element_size() for c in self.caches)

    def block(self, b: int) -> torch.Tensor:
        return torch.cat([c[b].flatten() for c in self.caches])


def line_of(func: Any, text: str, *, after: str) -> int:
    """The number of the first line of ``func`` that reads ``text``, past the one reading ``after``."""
    lines, first = inspect.getsourcelines(func)
    start = next(i for i, line in enumerate(lines) if after in line)
    return first + next(i for i, line in enumerate(lines) if i > start and line.strip() == text)


def interrupt_at_line(func: Any, lineno: int, name: str) -> Any:
    """A trace function that raises ``KeyboardInterrupt`` once, as ``func`` reaches line
    ``lineno`` with its local ``name`` set (as a signal arriving there would)."""
    code = func.__code__
    fired: list[bool] = []

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == lineno and not fired and frame.f_locals.get(name) is not None:
            fired.append(True)
            raise KeyboardInterrupt
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is code and not fired else None

    return tracer


def where_to_interrupt(monkeypatch: pytest.MonkeyPatch, store: Any, where: str, func: Any, after: str, at: int = 1) -> Any:
    """Set up the interrupt ``where``: ``result`` (the line after the job's result is taken in
    ``func``, run at once), ``closed`` (the check for a closing store before the result is
    applied) or ``forget`` (a job on a transfer thread, once it ended and was waited for).
    Returns the trace function to install, if any."""
    engine = store.transfers
    if where == "result":
        return interrupt_at_line(func, line_of(func, "if result is None:", after=after), "result")
    if where == "closed":
        interrupt_once(monkeypatch, store._runs, "_closed", at=at)
    else:
        engine._now.enabled = False
        monkeypatch.setattr(engine._inline, "max_bytes", 0)  # every job on a thread
        interrupt_once(monkeypatch, engine, "forget", after=True)
    return None


async def interrupted(call: Any, tracer: Any) -> None:
    before = sys.gettrace()
    if tracer is not None:
        sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            await call
    finally:
        sys.settrace(before)


def tiers_agree(store: Any) -> None:
    """Every tier holds exactly the keys the manager gives it, and none is pending or pinned."""
    manager = store.manager
    for t, backend in enumerate(store.backends):
        assert set(backend.stored_keys()) == {k for k in K if manager.holds(k, t)}, f"tier {t}"
    assert all(manager.status(k).state in (KeyState.READY, KeyState.MISS) for k in K)
    stats = manager.stats()
    assert stats["open_plans"] == 0
    for t, tier in enumerate(stats["tiers"]):
        assert tier["pending"] == tier["pinned"] == 0 and tier["blocks"] == len(store.backends[t].stored_keys())


@pytest.mark.parametrize("where", ["result", "closed", "forget"])
def test_an_interrupt_once_a_store_ended_applies_its_result(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A 4-block tier: the interrupted save's blocks are ready, and later saves store."""
    c = Caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 4 * c.block_bytes}]}, kv_caches=c.caches) as store:
            manager = store.manager
            saved = [c.block(b) for b in range(6)]
            assert await store.save(K[0:2], [0, 1]) == 2
            tracer = where_to_interrupt(monkeypatch, store, where, JobRuns.save, "transfers.store_now")
            await interrupted(store.save(K[2:4], [2, 3]), tracer)
            monkeypatch.undo()
            assert manager.lookup(K[0:4]) == 4  # released as never run before: 2, the tier holding 4
            tiers_agree(store)
            assert await store.save(K[4:6], [4, 5]) == 2  # 0 before: the manager counted the tier as not full
            assert await store.load(K[2:6], [6, 7, 8, 9]) == 4
            assert all(torch.equal(c.block(6 + i), saved[2 + i]) for i in range(4))
            tiers_agree(store)

    asyncio.run(run())


@pytest.mark.parametrize("where", ["result", "closed", "forget"])
def test_an_interrupt_once_a_load_ended_applies_its_result(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A full 2-block tier: the interrupted load's pins are released, so new keys evict its blocks."""
    c = Caches()

    async def run() -> None:
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 2 * c.block_bytes}]}, kv_caches=c.caches) as store:
            saved = [c.block(b) for b in range(4)]
            assert await store.save(K[0:2], [0, 1]) == 2
            tracer = where_to_interrupt(monkeypatch, store, where, JobRuns.load, "transfers.load_now")
            await interrupted(store.load(K[0:2], [6, 7]), tracer)
            monkeypatch.undo()
            assert all(torch.equal(c.block(6 + i), saved[i]) for i in range(2))
            assert store.metrics.snapshot()["tiers"][0]["hits"] == 2  # applied as served, not released as failed
            tiers_agree(store)  # before: both blocks pinned for good
            assert await store.save(K[2:4], [2, 3]) == 2  # 0 before: nothing to evict
            assert await store.load(K[2:4], [8, 9]) == 2
            assert all(torch.equal(c.block(8 + i), saved[2 + i]) for i in range(2))
            tiers_agree(store)

    asyncio.run(run())


@pytest.mark.parametrize("where", ["closed", "forget"])
def test_an_interrupt_once_a_promotion_ended_applies_its_result(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A load served from the second tier promotes into the first: an interrupt once the
    promotion ended leaves it applied, the first tier holding what the manager says."""
    c = Caches()
    tiers = [{"backend": "cpu", "capacity": 2 * c.block_bytes}, {"backend": "cpu", "capacity": 8 * c.block_bytes}]

    async def run() -> None:
        async with kvtier.open({"tiers": tiers}, kv_caches=c.caches) as store:
            manager = store.manager
            saved = [c.block(b) for b in range(6)]
            assert await store.save(K[0:2], [0, 1]) == 2
            assert await store.save(K[2:4], [2, 3]) == 2  # K[0:2] now in the second tier only
            assert not manager.holds(K[0], 0) and manager.holds(K[0], 1)
            if where == "closed":
                interrupt_once(monkeypatch, store._runs, "_closed", at=2)  # the load's check, then the promotion's
            else:
                store.transfers._now.enabled = False
                monkeypatch.setattr(store.transfers._inline, "max_bytes", 0)  # every job on a thread
                interrupt_once(monkeypatch, store.transfers, "forget", after=True, at=2)  # the load's, then the promotion's
            await interrupted(store.load(K[0:1], [6], promote=True), None)
            monkeypatch.undo()
            assert torch.equal(c.block(6), saved[0])
            assert manager.holds(K[0], 0)  # the promotion applied
            tiers_agree(store)
            assert await store.save(K[4:6], [4, 5]) == 2
            assert await store.load(K[4:6], [8, 9]) == 2
            assert all(torch.equal(c.block(8 + i), saved[4 + i]) for i in range(2))
            tiers_agree(store)

    asyncio.run(run())
