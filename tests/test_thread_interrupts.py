"""An interrupt (``KeyboardInterrupt``: a ``BaseException``, not an ``Exception``) raised by a
tier or a copy in a store job on the transfer threads is the job's failure, settled so that the
tiers match the manager once the job's result is applied: reported failed with every write of
its plan failed, and what it wrote deleted, before it is given back. The threads go on. Before,
the device thread handed the job on half done (its demoted copies then orphans in the lower
tier), the tiers thread reported it without undoing it, and a group write that raised one left
its jobs reported stored in a tier that had nothing of them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kvtier.backends.memory import CpuBackend
from test_inline_interrupts import HANG_GUARD, K, interrupt_once, runs_inline, tiers_match
from test_transfer import DictBackend, make_layout, record_of

from kvtier.backend import Backend, BlockFormat
from kvtier.manager import KeyState, TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.transfer import TransferEngine
from kvtier.transfer.jobs import JobResult, apply_result


class Rig:
    """A host cache, a ``cpu`` tier of 8 blocks over a second tier of 8 (``lower``: ``cpu`` or
    a byte tier in a dict), ``write`` through or back, a manager and an engine."""

    def __init__(self, lower: str, write: str) -> None:
        self.layout = make_layout()
        fmt = BlockFormat(block_bytes=self.layout.block_bytes)
        second: Backend = CpuBackend(capacity=8 * fmt.block_bytes) if lower == "cpu" else DictBackend(capacity=8 * fmt.block_bytes)
        self.backends: list[Any] = [CpuBackend(capacity=8 * fmt.block_bytes), second]
        for backend in self.backends:
            asyncio.run(backend.open(fmt))
        if lower != "cpu":
            second.stored_keys = lambda: list(second.data)  # type: ignore[attr-defined]
        specs = [TierSpec(n, 8 * fmt.block_bytes, fmt.block_bytes, LRUPolicy(8)) for n in ("cpu", lower + "-2")]
        self.manager = TierManager(specs, write=write)  # type: ignore[arg-type]
        self.engine = TransferEngine(self.layout, list(self.backends))

    def fill(self) -> None:
        """K[0:8] from engine blocks 0-7, inline: the first tier is full."""
        plan = self.manager.prepare_store(K[0:8])
        assert plan is not None
        apply_result(self.manager, plan, runs_inline(self.engine, lambda: self.engine.submit_store(plan, list(range(8)), inline=True)))

    def threaded_store(self, keys: list[bytes], ids: list[int]) -> JobResult:
        """Store ``keys`` on the transfer threads; its result, applied to the manager."""
        plan = self.manager.prepare_store(keys)
        assert plan is not None
        job = self.engine.submit_store(plan, ids)
        (res,) = self.engine.wait([job], timeout=HANG_GUARD)
        self.engine.wait_idle(HANG_GUARD)
        self.engine.forget([job])
        apply_result(self.manager, plan, res)
        return res


def _goes_on(rig: Rig) -> None:
    """The tiers match the manager; a store and a load still run, with the right bytes."""
    tiers_match(rig.manager, rig.backends)
    assert rig.threaded_store(K[20:21], [10]).success
    load = rig.manager.prepare_load(K[20:21], promote=False)
    job = rig.engine.submit_load(load, [11])
    (res,) = rig.engine.wait([job], timeout=HANG_GUARD)
    apply_result(rig.manager, load, res)
    assert res.success and record_of(rig.layout, 11).equal(record_of(rig.layout, 10))
    tiers_match(rig.manager, rig.backends)


def test_an_interrupt_in_the_device_phase_after_demoting_leaves_no_orphan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device thread demotes K[0:2] into the second tier, then its copy is interrupted:
    the job is reported failed, the demoted copies deleted with it (the manager drops them)."""
    rig = Rig("cpu", "back")
    try:
        rig.fill()
        interrupt_once(monkeypatch, rig.layout, "gather", after=True)
        res = rig.threaded_store(K[8:10], [8, 9])
        assert not res.success and "KeyboardInterrupt" in (res.error or "")
        assert [rig.manager.status(k).state for k in (K[0], K[1], K[8], K[9])] == [KeyState.MISS] * 4
        monkeypatch.undo()
        _goes_on(rig)
    finally:
        rig.engine.close(HANG_GUARD)
    assert rig.engine.stopped


def test_an_interrupt_in_a_demotion_on_the_tiers_thread_leaves_no_key_the_tier_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A demotion into a byte tier runs on the tiers thread; its write is interrupted: the job
    is reported failed with the demotion failed, so the manager does not count K[0:2] there."""
    rig = Rig("dict", "back")
    try:
        rig.fill()
        interrupt_once(monkeypatch, rig.backends[1], "write_blocks")
        res = rig.threaded_store(K[8:10], [8, 9])
        assert not res.success and "KeyboardInterrupt" in (res.error or "")
        assert not rig.manager.holds(K[0], 1) and not rig.manager.holds(K[8], 0)
        monkeypatch.undo()
        _goes_on(rig)
    finally:
        rig.engine.close(HANG_GUARD)
    assert rig.engine.stopped


def test_an_interrupt_in_a_group_write_fails_its_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write-through copy into a byte tier (the tiers thread's group write) is interrupted:
    its job is reported failed and its blocks deleted, not reported stored in that tier."""
    rig = Rig("dict", "through")
    try:
        interrupt_once(monkeypatch, rig.backends[1], "write_blocks")
        res = rig.threaded_store(K[0:2], [0, 1])
        assert not res.success and "KeyboardInterrupt" in (res.error or "")
        assert not rig.manager.holds(K[0], 1) and rig.manager.status(K[0]).state is KeyState.MISS
        monkeypatch.undo()
        _goes_on(rig)
    finally:
        rig.engine.close(HANG_GUARD)
    assert rig.engine.stopped


def test_an_interrupt_in_a_staged_copy_gives_its_staging_budget_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that demotes into a byte tier copies its blocks into staging on the device
    thread; that copy is interrupted: the job fails as above, and the staging it had counted
    is given back (it stayed counted for good, and later jobs found the staging full)."""
    rig = Rig("dict", "back")
    try:
        rig.fill()
        interrupt_once(monkeypatch, rig.layout, "gather")  # the copy into the job's staging
        res = rig.threaded_store(K[8:10], [8, 9])
        assert not res.success and "KeyboardInterrupt" in (res.error or "")
        assert rig.engine._staged_bytes == 0 and rig.engine.counters["staged_jobs"] == 1
        assert [rig.manager.status(k).state for k in (K[0], K[1], K[8], K[9])] == [KeyState.MISS] * 4
        monkeypatch.undo()
        _goes_on(rig)
    finally:
        rig.engine.close(HANG_GUARD)
    assert rig.engine.stopped
