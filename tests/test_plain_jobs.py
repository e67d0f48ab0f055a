"""The straight path of the usual inline job (:mod:`kvtier.transfer.plain_jobs`) against the
general one (``PlainJobs.enabled`` off): the same bytes in the tier and the engine blocks, the
same results, counters and tier contents, for plain stores (with evictions), plain loads, a
failed copy, a job stopped before its copy, and the jobs it leaves to the general path."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kvtier.backends.memory import CpuBackend
from test_transfer import make_layout, record_of

from kvtier.backend import BlockFormat
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key
from kvtier.transfer import TransferEngine
from kvtier.transfer.jobs import JobResult, StoreRecord

K = [make_key(7000 + i) for i in range(40)]
HANG_GUARD = 30.0
SLOTS = 8


class HostRig:
    """A host cache, one ``cpu`` tier of :data:`SLOTS` blocks, a manager and an engine."""

    def __init__(self) -> None:
        self.layout = make_layout()
        fmt = BlockFormat(block_bytes=self.layout.block_bytes)
        self.backend = CpuBackend(capacity=SLOTS * fmt.block_bytes)
        asyncio.run(self.backend.open(fmt))
        self.manager = TierManager([TierSpec("cpu", SLOTS * fmt.block_bytes, fmt.block_bytes, LRUPolicy(SLOTS))])
        self.engine = TransferEngine(self.layout, [self.backend])

    def tier(self) -> dict[bytes, torch.Tensor]:
        """The tier's records, by key (the bytes of each)."""
        keys = self.backend.stored_keys()
        return {k: self.backend.pool[s].clone() for k, s in zip(keys, self.backend.slots(keys))}

    def blocks(self) -> list[torch.Tensor]:
        return [record_of(self.layout, b) for b in range(self.layout.num_engine_blocks)]


class Rig(HostRig):
    """:class:`HostRig` with the engine's plain path on or off."""

    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.engine._inline.plain.enabled = plain
        self.plain = self.engine._inline.plain
        self.calls = {"store": 0, "load": 0}
        for kind in ("store", "load"):
            setattr(self.plain, kind, self._counted(kind, getattr(self.plain, kind)))

    def _counted(self, kind: str, inner: Any) -> Any:
        def call(rec: Any) -> bool:
            ran = inner(rec)
            self.calls[kind] += ran
            return bool(ran)

        return call

    def store(self, keys: list[bytes], ids: list[int]) -> JobResult:
        plan = self.manager.prepare_store(keys)
        assert plan is not None
        job = self.engine.submit_store(plan, ids, inline=True)
        (res,) = self.engine.wait([job], timeout=HANG_GUARD)
        self.manager.complete_store(res.keys, res.error is None and not res.failed, sizes=res.sizes)
        return res

    def load(self, keys: list[bytes], ids: list[int]) -> JobResult:
        plan = self.manager.prepare_load(keys)
        job = self.engine.submit_load(plan, ids, inline=True)
        (res,) = self.engine.wait([job], timeout=HANG_GUARD)
        self.manager.complete_load(plan.keys)
        return res


def same(a: JobResult, b: JobResult) -> bool:
    """Equal results but for the job id and the seconds."""
    return dataclasses.replace(a, job_id=0, seconds=0.0) == dataclasses.replace(b, job_id=0, seconds=0.0)


@pytest.fixture
def rigs() -> Iterator[tuple[Rig, Rig]]:
    pair = Rig(plain=True), Rig(plain=False)
    yield pair
    for rig in pair:
        rig.engine.close()


def test_plain_stores_that_evict_and_plain_loads_match_the_general_path(rigs: tuple[Rig, Rig]) -> None:
    plain, general = rigs
    for rig in rigs:
        rig.results = [  # type: ignore[attr-defined]
            rig.store(K[0:4], [3, 9, 0, 5]),
            rig.store(K[4:8], [1, 2, 4, 6]),
            rig.store(K[8:12], [7, 8, 10, 11]),  # the tier is full: this one evicts K[0:4]
            rig.load(K[8:12], [12, 13, 14, 15]),
            rig.load(K[4:6], [0, 3]),
        ]
        rig.engine.wait_idle(HANG_GUARD)
    for a, b in zip(plain.results, general.results):  # type: ignore[attr-defined]
        assert a.error is None and same(a, b)
    assert plain.calls == {"store": 3, "load": 2} and general.calls == {"store": 0, "load": 0}
    assert plain.engine.counters == general.engine.counters
    tier_a, tier_b = plain.tier(), general.tier()
    assert list(tier_a) == list(tier_b) == K[4:12]  # K[0:4] evicted
    assert all(torch.equal(tier_a[k], tier_b[k]) for k in tier_a)
    assert all(torch.equal(x, y) for x, y in zip(plain.blocks(), general.blocks()))
    blocks = plain.blocks()
    for b, key in zip((12, 13, 14, 15, 0, 3), (*K[8:12], K[4], K[5])):  # the loads wrote the saved bytes
        assert torch.equal(blocks[b], tier_a[key])
    assert plain.engine._active == general.engine._active == 0


def test_a_failed_copy_is_reported_and_undone_as_on_the_general_path(rigs: tuple[Rig, Rig], monkeypatch: pytest.MonkeyPatch) -> None:
    for rig in rigs:
        rig.store(K[0:2], [0, 1])
        monkeypatch.setattr(rig.layout, "gather", _raises)
        monkeypatch.setattr(rig.layout, "scatter", _raises)
        rig.results = [rig.store(K[2:4], [2, 3]), rig.load(K[0:2], [5, 6])]  # type: ignore[attr-defined]
        rig.engine.wait_idle(HANG_GUARD)
    plain, general = rigs
    for a, b in zip(plain.results, general.results):  # type: ignore[attr-defined]
        assert a.error is not None and "copy broke" in a.error and same(a, b)
    assert plain.calls == {"store": 2, "load": 1}
    assert list(plain.tier()) == list(general.tier()) == K[0:2]  # the failed store's rows were freed
    assert plain.engine.counters == general.engine.counters
    assert plain.engine._active == general.engine._active == 0
    assert plain.manager.lookup(K[2:4]) == general.manager.lookup(K[2:4]) == 0


def _raises(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("copy broke")


def test_a_store_stopped_before_its_copy_is_cleaned_up_by_the_tiers_thread(rigs: tuple[Rig, Rig]) -> None:
    """A job another thread stopped (a close) between its evictions and its copy: it never
    reads an engine block, its evictions stand, its rows are freed, it is given back."""
    for rig in rigs:
        rig.store(K[0:8], list(range(8)))  # the tier is full
        plan = rig.manager.prepare_store(K[8:10])
        assert plan is not None and plan.drops  # it evicts
        rec = StoreRecord(999, plan, (8, 9))
        rec.cancelled = True  # as _stop marks it, before it reports it
        with rig.engine._lock:
            rig.engine._jobs[rec.job_id] = rec
            rig.engine._active += 1
        ran = rig.plain.store(rec) or (rig.engine._stores.device_job(rec) or True)
        assert ran and rec.device_done.is_set()
        rig.engine._finish(rec, JobResult(rec.job_id, "store", False, plan.keys, error="cancelled"))
        rig.engine.wait_idle(HANG_GUARD)
        rig.tier_keys = rig.backend.stored_keys()  # type: ignore[attr-defined]
    plain, general = rigs
    assert plain.calls["store"] == 2 and general.calls["store"] == 0
    assert plain.tier_keys == general.tier_keys and not set(plain.tier_keys) & set(K[8:10])  # type: ignore[attr-defined]
    assert plain.engine._active == general.engine._active == 0


def test_jobs_it_does_not_take_go_the_general_way_unchanged(rigs: tuple[Rig, Rig]) -> None:
    plain, _ = rigs
    plain.store(K[0:4], [0, 1, 2, 3])
    # A key gone from the tier behind the manager's back: a miss the general path reports.
    plain.backend.delete_blocks([K[1]])
    res = plain.load(K[0:4], [8, 9, 10, 11])
    assert plain.calls["load"] == 0 and res.missed == (K[1],)
    # A store with nothing new (every key held) is not a plain store either.
    plan = plain.manager.prepare_store(K[0:1])
    assert plan is not None and not plan.keys
    (res,) = plain.engine.wait([plain.engine.submit_store(plan, [], inline=True)], timeout=HANG_GUARD)
    assert res.success and plain.calls["store"] == 1


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("rows", [[4, 5, 6, 7], [2], [7, 6, 5, 4], [0, 2, 3, 4], list(range(9))])
def test_a_small_runs_copy_matches_the_general_copy(rows: list[int], native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVLayout._small_run`` (a job's own host copy of at most 8 rows on the caller's thread:
    one ascending run of them with torch, any rows with the native copy where built; off the
    caller's team, a larger job natively too) against the general dispatch, save and load, and
    when it applies."""
    ids = [3, 9, 0, 5, 1, 2, 4, 6, 7][: len(rows)]
    back = [15 - i for i in range(len(rows))]
    out = {}
    natively = False
    for fast in (True, False):
        layout = make_layout()
        if layout.native is not None:
            layout.native.enabled = natively = native
        pool = torch.zeros((12, layout.block_bytes), dtype=torch.uint8)
        taken = []
        inner = layout._small_run
        monkeypatch.setattr(layout, "_small_run", lambda *a, t=taken, f=fast, i=inner: t.append(a[3]) is None and f and i(*a))
        saved = [record_of(layout, b) for b in ids]
        with layout.copies.on_callers_team():
            layout.gather(ids, pool, rows, kept=True, checked=True)
            assert all(torch.equal(pool[r], rec) for r, rec in zip(rows, saved))
            pool[rows] += 1  # the load brings back what the save wrote, changed
            layout.scatter(pool, rows, back, kept=True, checked=True)
        assert taken == [True, False]  # asked once per copy
        assert all(torch.equal(record_of(layout, b), rec + 1) for b, rec in zip(back, saved))
        out[fast] = (pool.clone(), [record_of(layout, b) for b in back])
        if fast:
            one_run = len(rows) <= 8 and rows == list(range(rows[0], rows[0] + len(rows)))
            # off the caller's team (a transfer thread) the native copy takes any size (larger jobs split
            # over the copy threads); torch's way: not on a thread that copies unsplit
            assert inner(ids, pool, rows, True) is natively
            with layout.copies.on_callers_team():  # one ascending run only
                assert inner(ids, pool, rows, True) is (one_run or (natively and len(rows) <= 8))
    assert torch.equal(out[True][0], out[False][0])
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1]))


def test_the_metrics_of_a_plain_job_match_the_general_accounting() -> None:
    """``StoreMetrics.record_store`` / ``record_load`` of the usual job (no failure, no copy
    below, one tier, nothing missed or promoted) against the same job sent the general way by
    an empty write-through copy / a promotion of a key outside the plan (neither counts)."""
    from kvtier.manager import LoadPlan, StorePlan
    from kvtier.metrics import StoreMetrics

    keys = tuple(K[30:34])
    snaps = []
    for general in (False, True):
        m = StoreMetrics(2)
        for tier in (0, 1, 5):  # (a tier the metrics do not know is left out either way)
            plan = StorePlan(1, keys, (0, 1, 2, 3), tier=tier, write_through=((1, ()),) if general else ())
            m.record_store(plan, JobResult(1, "store", True, keys, seconds=0.001), 4096)
            load = LoadPlan(keys, (tier,) * 4, promote=(K[39],) if general else ())
            m.record_load(load, JobResult(2, "load", True, keys, seconds=0.002), 4096)
        m.record_load(LoadPlan((), ()), JobResult(3, "load", True, (), seconds=0.002), 4096)
        snaps.append(m.snapshot())
    assert snaps[0] == snaps[1]
    assert snaps[0]["tiers"][1]["hits"] == 4 and snaps[0]["tiers"][0]["bytes_stored"] == 4 * 4096


def test_a_quiet_condition_notifies_only_a_thread_that_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """``QuietCondition`` (the engine's ``_idle`` and ``_inline_done``): ``notify_all`` with no
    thread waiting reaches no condition machinery; a waiting thread is woken as by a plain
    condition, ``wait_for`` and its timeout behave the same, and the count goes back to 0."""
    import threading

    from kvtier.transfer.jobs import QuietCondition

    notified = []
    inner = threading.Condition.notify_all
    cond = QuietCondition(threading.Lock())
    monkeypatch.setattr(threading.Condition, "notify_all", lambda self: (self is cond and notified.append(1), inner(self))[1])
    with cond:
        cond.notify_all()
        assert not cond.wait_for(lambda: False, 0.01) and cond.waiting == 0
    assert notified == []
    state = {"go": False}
    woke = threading.Event()

    def waiter() -> None:
        with cond:
            assert cond.wait_for(lambda: state["go"], HANG_GUARD)
        woke.set()

    t = threading.Thread(target=waiter)
    t.start()
    for _ in range(10_000):  # until the waiter is inside wait()
        with cond:
            if cond.waiting:
                break
        threading.Event().wait(0.001)
    with cond:
        assert cond.waiting == 1
        state["go"] = True
        cond.notify_all()
    assert woke.wait(HANG_GUARD) and notified == [1]
    t.join(HANG_GUARD)
    assert cond.waiting == 0
    engine = Rig(plain=True).engine
    try:
        assert isinstance(engine._idle, QuietCondition) and isinstance(engine._inline_done, QuietCondition)
    finally:
        engine.close()
