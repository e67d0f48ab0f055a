"""Small host-memory jobs run on the caller's thread (``submit_*(..., inline=True)``,
:mod:`kvtier.transfer.inline`), compared with the same jobs on the transfer threads: the same
bytes; only memory-to-memory jobs under the byte bound; never ahead of a job already queued,
and no threaded job starts while one runs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends.memory import CpuBackend
from test_transfer import DictBackend, make_layout, record_of

import kvtier
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import LayoutError
from kvtier.manager import LoadPlan, StorePlan, TierManager, TierSpec
from kvtier.manager.plan import Demotion
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key
from kvtier.transfer import TransferEngine, copies
from kvtier.transfer.jobs import JobRecord, LoadRecord, StoreRecord
from kvtier.transfer.layout import KVLayout

K = [make_key(5000 + i) for i in range(32)]
HANG_GUARD = 30.0


class Rig:
    """A host cache, the given tiers (``"cpu"`` or ``"bytes"``), a manager and an engine; every
    ``layout.gather`` / ``scatter`` is logged as (thread, what, event) and may be gated."""

    def __init__(self, tiers: list[str], *, write: str = "through", **engine_kw: Any) -> None:
        self.layout = make_layout()
        fmt = BlockFormat(block_bytes=self.layout.block_bytes)
        self.backends: list[Backend] = []
        specs = []
        for kind in tiers:
            backend: Backend = (CpuBackend if kind == "cpu" else DictBackend)(capacity=16 * fmt.block_bytes)
            asyncio.run(backend.open(fmt))
            self.backends.append(backend)
            specs.append(TierSpec(kind, 16 * fmt.block_bytes, fmt.block_bytes, LRUPolicy(16)))
        self.manager = TierManager(specs, write=write)  # type: ignore[arg-type]
        self.engine = TransferEngine(self.layout, self.backends, **engine_kw)
        self.log: list[tuple[str, str, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        for name in ("gather", "scatter"):
            setattr(self.layout, name, self._logged(name, getattr(self.layout, name)))

    def _logged(self, name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            who = threading.current_thread().name
            self.log.append((who, name, "enter"))
            self.entered.set()
            assert self.gate.wait(HANG_GUARD), "gate never opened"
            try:
                return inner(*args, **kwargs)
            finally:
                self.log.append((who, name, "exit"))

        return call

    def store(self, keys: list[bytes], ids: list[int], *, inline: bool = True) -> int:
        plan = self.manager.prepare_store(keys)
        assert plan is not None
        return self.engine.submit_store(plan, ids, inline=inline)

    def close(self) -> None:
        self.gate.set()
        self.engine.close()


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for r in made:
        r.close()


def test_a_small_store_and_load_in_the_cpu_tier_run_on_the_callers_thread_with_the_threaded_bytes(rigs: list[Rig]) -> None:
    inline, threaded = Rig(["cpu"]), Rig(["cpu"])
    rigs += [inline, threaded]
    me = threading.current_thread().name
    results = {}
    for rig, flag in ((inline, True), (threaded, False)):
        job = rig.store(K[:4], [3, 9, 0, 5], inline=flag)
        (res,) = rig.engine.wait([job], timeout=HANG_GUARD)
        assert res.success
        rig.manager.complete_store(res.keys, True, sizes=res.sizes)
        load = rig.manager.prepare_load(K[:4])
        (res2,) = rig.engine.wait([rig.engine.submit_load(load, [12, 13, 14, 15], inline=flag)], timeout=HANG_GUARD)
        assert res2.success and res2.nbytes == 4 * rig.layout.block_bytes
        rig.manager.complete_load(K[:4])
        results[flag] = [record_of(rig.layout, b) for b in (12, 13, 14, 15)]
        for b, src in zip((12, 13, 14, 15), (3, 9, 0, 5)):
            assert torch.equal(record_of(rig.layout, b), record_of(rig.layout, src))
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    assert inline.engine.counters["inline_jobs"] == 2 and threaded.engine.counters["inline_jobs"] == 0
    assert [who for who, _, step in inline.log if step == "enter"] == [me, me]
    assert [who for who, _, step in threaded.log if step == "enter"] == ["kvtier-store", "kvtier-load"]
    # Reported like any job: in poll_finished, and a later cancel finds it finished.
    assert inline.engine.cancel(job) is False
    assert {r.kind for r in inline.engine.poll_finished()} == {"store", "load"}


def test_jobs_that_touch_a_byte_tier_or_pass_the_bound_are_queued(rigs: list[Rig]) -> None:
    through = Rig(["cpu", "bytes"])  # a write-through copy to a byte tier
    small = Rig(["cpu"], inline_max_bytes=2 * make_layout().block_bytes)
    rigs += [through, small]
    (res,) = through.engine.wait([through.store(K[:2], [0, 1])], timeout=HANG_GUARD)
    assert res.success and set(res.sizes) == {1}  # written to the byte tier
    (res,) = small.engine.wait([small.store(K[:3], [0, 1, 2])], timeout=HANG_GUARD)  # 3 blocks > 2
    assert res.success
    small.engine.wait_idle(HANG_GUARD)  # its thread has let go of it: only the size decides
    (res,) = small.engine.wait([small.store(K[3:5], [3, 4])], timeout=HANG_GUARD)  # 2 blocks: inline
    assert res.success
    assert through.engine.counters["inline_jobs"] == 0
    assert small.engine.counters["inline_jobs"] == 1
    assert [who for who, _, step in small.log if step == "enter"] == ["kvtier-store", threading.current_thread().name]
    # A load out of a byte tier is queued too (write-back demoted K[0] into it).
    disk = Rig(["cpu", "bytes"], write="back")
    rigs.append(disk)
    for i in range(17):
        (res,) = disk.engine.wait([disk.store([K[i]], [i % 16])], timeout=HANG_GUARD)
        disk.manager.complete_store(res.keys, res.success, sizes=res.sizes)
    load = disk.manager.prepare_load(K[:1])
    assert load.tiers == (1,)
    disk.engine.wait_idle(HANG_GUARD)  # nothing else runs: only the tier decides
    before = disk.engine.counters["inline_jobs"]
    (res,) = disk.engine.wait([disk.engine.submit_load(load, [15], inline=True)], timeout=HANG_GUARD)
    assert res.success and disk.engine.counters["inline_jobs"] == before


def test_a_job_submitted_while_another_runs_is_queued_behind_it(rigs: list[Rig]) -> None:
    rig = Rig(["cpu"])
    rigs.append(rig)
    rig.gate.clear()
    first = rig.store(K[:1], [0], inline=False)
    assert rig.entered.wait(HANG_GUARD)  # the store thread holds the first job
    second = rig.store(K[1:2], [1], inline=True)
    assert rig.engine.result(second) is None, "ran inline ahead of a running job"
    rig.gate.set()
    a, b = rig.engine.wait([first, second], timeout=HANG_GUARD)
    assert a.success and b.success and rig.engine.counters["inline_jobs"] == 0
    assert [(who, step) for who, _, step in rig.log] == [("kvtier-store", "enter"), ("kvtier-store", "exit")] * 2


def test_a_job_right_after_a_threaded_one_runs_inline_however_late_its_thread_ends(rigs: list[Rig]) -> None:
    """A threaded job gives itself back to the engine when it reports its result, so the caller
    it wakes finds the engine idle. Its thread used to do that after waking the caller, which
    then, now and then, queued its next job instead of running it inline (and the one after
    that too, behind it). Here a thread's late end (``_retire``) takes 0.3 s."""
    rig = Rig(["cpu"])
    rigs.append(rig)
    engine = rig.engine
    retire = engine._retire

    def late() -> None:
        threading.Event().wait(0.3)
        retire()

    engine._retire = late  # type: ignore[method-assign]
    me = threading.current_thread().name
    (res,) = engine.wait([rig.store(K[:2], [0, 1], inline=False)], timeout=HANG_GUARD)
    rig.manager.complete_store(res.keys, res.success, sizes=res.sizes)
    (res,) = engine.wait([rig.store(K[2:4], [2, 3], inline=True)], timeout=HANG_GUARD)
    assert res.success and engine.counters["inline_jobs"] == 1
    rig.manager.complete_store(res.keys, res.success, sizes=res.sizes)
    load = rig.manager.prepare_load(K[:2])
    (res,) = engine.wait([engine.submit_load(load, [10, 11], inline=False)], timeout=HANG_GUARD)
    assert res.success
    rig.manager.complete_load(K[:2])
    (res,) = engine.wait([rig.store(K[4:6], [4, 5], inline=True)], timeout=HANG_GUARD)
    assert res.success and engine.counters["inline_jobs"] == 2
    assert [who for who, _, step in rig.log if step == "enter"] == ["kvtier-store", me, "kvtier-load", me]
    engine.wait_idle(HANG_GUARD)
    assert engine._active == 0


def test_no_threaded_job_starts_while_an_inline_job_runs(rigs: list[Rig]) -> None:
    rig = Rig(["cpu"])
    rigs.append(rig)
    (res,) = rig.engine.wait([rig.store(K[5:6], [5], inline=False)], timeout=HANG_GUARD)
    rig.manager.complete_store(res.keys, res.success, sizes=res.sizes)
    rig.log.clear()
    rig.gate.clear()
    rig.entered.clear()
    jobs: list[int] = []
    caller = threading.Thread(target=lambda: jobs.append(rig.store(K[:1], [0], inline=True)), name="engine-step")
    caller.start()
    assert rig.entered.wait(HANG_GUARD)  # the inline job is in its copy, on the caller's thread
    rig.entered.clear()
    queued = rig.store(K[1:2], [1], inline=True)  # not inline: one runs
    loaded = rig.engine.submit_load(rig.manager.prepare_load(K[5:6]), [14], inline=False)
    # The store and load threads take their jobs and wait for the inline one to end.
    assert not rig.entered.wait(0.3), "a threaded job started while an inline job ran"
    rig.gate.set()
    caller.join(HANG_GUARD)
    results = rig.engine.wait([jobs[0], queued, loaded], timeout=HANG_GUARD)
    assert all(r.success for r in results)
    assert rig.log[:2] == [("engine-step", "gather", "enter"), ("engine-step", "gather", "exit")]
    assert rig.engine.counters["inline_jobs"] == 1


async def test_the_store_facade_runs_small_cpu_jobs_inline_and_queues_disk_ones(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    kv = [torch.randn(16, 4, 8, generator=g) for _ in range(2)]
    bb = 2 * 4 * 8 * 4
    cfg: dict[str, Any] = {"tiers": [{"backend": "cpu", "capacity": 8 * bb}]}
    async with kvtier.open(cfg, kv_caches=kv) as store:
        assert await store.save(K[:4], [0, 1, 2, 3]) == 4
        assert await store.load(K[:4], [8, 9, 10, 11]) == 4
        assert all(torch.equal(x[8:12], x[0:4]) for x in kv)
        assert store.stats()["transfers"]["inline_jobs"] == 2
    async with kvtier.open({**cfg, "inline_max_bytes": 0}, kv_caches=kv) as store:
        assert await store.save(K[:4], [0, 1, 2, 3]) == 4
        assert store.stats()["transfers"]["inline_jobs"] == 0
    disk = {"tiers": [*cfg["tiers"], {"backend": "file", "path": str(tmp_path), "capacity": 64 * bb}]}
    async with kvtier.open(disk, kv_caches=kv) as store:
        assert await store.save(K[4:8], [4, 5, 6, 7]) == 4  # written through to the file tier
        assert store.transfers is not None
        await asyncio.to_thread(store.transfers.wait_idle, HANG_GUARD)  # reported, then let go
        assert await store.load(K[4:8], [12, 13, 14, 15]) == 4  # from the cpu tier: inline
        assert store.stats()["transfers"]["inline_jobs"] == 1


def test_the_bound_is_checked(rigs: list[Rig]) -> None:
    layout: KVLayout = make_layout()
    backend = CpuBackend(capacity=4 * layout.block_bytes)
    asyncio.run(backend.open(BlockFormat(block_bytes=layout.block_bytes)))
    with pytest.raises(ValueError, match="inline_max_bytes"):
        TransferEngine(layout, [backend], inline_max_bytes=-1)
    manager = TierManager([TierSpec("cpu", 4 * layout.block_bytes, layout.block_bytes, LRUPolicy(4))])
    engine = TransferEngine(layout, [backend], inline_max_bytes=0)
    try:
        plan = manager.prepare_store(K[:1])
        assert plan is not None
        (res,) = engine.wait([engine.submit_store(plan, [0], inline=True)], timeout=HANG_GUARD)
        assert res.success and engine.counters["inline_jobs"] == 0
    finally:
        engine.close()


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_an_inline_job_copies_on_the_callers_own_team_and_a_threaded_one_splits(
    native: bool, rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inline, the copy runs unsplit on the caller's thread with its own OpenMP team (the
    engine's: no second team); on the mover torch's copy is dealt out to the copy threads as
    before. The native copy of a small job (kvtier.transfer.block_copy, where built) runs on
    the job's own thread either way: no copy thread."""
    pools: list[int] = []
    inner = copies._pool
    monkeypatch.setattr(copies, "_pool", lambda workers: (pools.append(workers), inner(workers))[-1])
    inline, threaded = Rig(["cpu"]), Rig(["cpu"])
    rigs += [inline, threaded]
    for rig, flag in ((inline, True), (threaded, False)):
        rig.layout.copies = copies.CopySplitter(2, min_bytes=0)  # split even this small job
        natively = rig.layout.native is not None and native
        if rig.layout.native is not None:
            rig.layout.native.enabled = native
        before = len(pools)
        (res,) = rig.engine.wait([rig.store(K[:4], [3, 9, 0, 5], inline=flag)], timeout=HANG_GUARD)
        assert res.success
        split = not flag and not natively
        assert (len(pools) > before) is split, "inline or native: no copy thread; threaded torch: split over them"
        slots = rig.backends[0].slots(K[:4])  # type: ignore[attr-defined]
        pool = rig.backends[0].pool  # type: ignore[attr-defined]
        for slot, b in zip(slots, (3, 9, 0, 5)):
            assert torch.equal(pool[slot], record_of(rig.layout, b))
    assert inline.engine.counters["inline_jobs"] == 1


def test_take_gives_a_finished_jobs_result_once_and_leaves_a_running_job_alone(rigs: list[Rig]) -> None:
    """``take`` (what the store's save and load use after an inline submit): a finished job's
    result, then forgotten as ``forget`` forgets (not polled, unknown to ``result``); a job
    still running: ``None``, and it is reported as usual once it ends."""
    rig = Rig(["cpu"])
    rigs.append(rig)
    first = rig.store(K[:2], [0, 1])  # inline: ended on return
    second = rig.store(K[2:4], [2, 3])
    got = rig.engine.take(first)
    assert got is not None and got.job_id == first and got.success
    assert rig.engine.take(first) is None and rig.engine.result(first) is None
    assert [r.job_id for r in rig.engine.poll_finished()] == [second]
    rig.gate.clear()
    rig.entered.clear()
    third = rig.store(K[4:6], [4, 5], inline=False)
    assert rig.entered.wait(HANG_GUARD)
    assert rig.engine.take(third) is None  # running: left alone
    rig.gate.set()
    (res,) = rig.engine.wait([third], timeout=HANG_GUARD)
    assert res.success and [r.job_id for r in rig.engine.poll_finished()] == [third]
    # The last result reported is dropped from the end; any other is filtered out, in order.
    a, b, c = (rig.store(K[i : i + 1], [i]) for i in (6, 7, 8))
    taken = [rig.engine.take(b), rig.engine.take(c)]
    assert [r.job_id for r in taken if r is not None] == [b, c]
    assert [r.job_id for r in rig.engine.poll_finished()] == [a]


async def test_the_store_checks_a_jobs_block_ids_once_and_a_bare_submit_still_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store facade checks its block ids before any change and submits its jobs
    ``checked``: one check per save or load (a promotion's job included); a submit that is not
    ``checked`` checks as before."""
    layout = make_layout()
    cfg = {"tiers": [{"backend": "cpu", "capacity": 2 * layout.block_bytes}, {"backend": "cpu", "capacity": 8 * layout.block_bytes, "name": "low"}]}
    async with kvtier.open(cfg, kv_caches=layout.kv_caches) as store:
        assert store.layout is not None and store.transfers is not None
        calls: list[int] = []
        inner = store.layout.check_block_ids

        def counted(ids: Any, n: int, **kw: Any) -> list[int]:
            calls.append(n)
            return inner(ids, n, **kw)

        monkeypatch.setattr(store.layout, "check_block_ids", counted)
        assert await store.save(K[:2], [0, 1]) == 2
        assert await store.save(K[2:4], [2, 3]) == 2  # K[0:2] demoted to the second tier
        assert calls == [2, 2]
        assert await store.load(K[:2], [8, 9]) == 2  # from the second tier: promoted after
        assert calls == [2, 2, 2]
        assert store.stats()["transfers"]["jobs"] == 4
        for b, src in zip((8, 9), (0, 1)):
            assert torch.equal(record_of(store.layout, b), record_of(store.layout, src))
        plan = store.manager.prepare_store([K[9]])  # type: ignore[union-attr]
        assert plan is not None
        with pytest.raises(LayoutError, match="out of range"):
            store.transfers.submit_store(plan, [10**6])
        store.manager.complete_store(plan.keys, False)  # type: ignore[union-attr]


def test_eligibility_with_every_tier_in_host_memory_matches_the_tier_by_tier_answer() -> None:
    """``InlineJobs.eligible`` skips the look at a job's tiers once every tier is known to be a
    host memory tier: the same answer as the tier-by-tier path for every kind of plan, and the
    tier-by-tier path wherever a tier is not."""
    block = make_layout().block_bytes
    k = K[:3]
    plans: list[StorePlan | LoadPlan] = [
        StorePlan(1, tuple(k), (0, 1, 2)),
        StorePlan(2, tuple(k), (0, 1, 2), drops=((0, (K[9],)),)),
        StorePlan(3, tuple(k), (0, 1, 2), write_through=((1, tuple(k)),)),
        StorePlan(4, tuple(k[:1]), (0,), demotions=(Demotion(0, 1, (K[9], K[10])),)),
        StorePlan(5, tuple(K[:5]), (0, 1, 2, 3, 4)),  # over the bound
        StorePlan(6, (), ()),
        LoadPlan(tuple(k), (0, 0, 0)),
        LoadPlan(tuple(k), (1, 1, 0), promote=(k[0], k[1])),  # 5 blocks: over the bound
        LoadPlan(tuple(k[:2]), (1, 0), promote=(k[0],)),
        LoadPlan(tuple(K[:5]), (0,) * 5),  # over the bound
    ]
    fmt = BlockFormat(block_bytes=block)
    for tiers in (["cpu", "cpu"], ["cpu", "bytes"]):
        backends: list[Backend] = [(CpuBackend if kind == "cpu" else DictBackend)(capacity=8 * block) for kind in tiers]
        for backend in backends:
            asyncio.run(backend.open(fmt))
        engine = TransferEngine(make_layout(), backends, inline_max_bytes=4 * block)
        inline = engine._inline
        answers = []
        for shortcut in (True, False):
            inline._all_host = None if shortcut else False  # False: every job's tiers are looked at
            recs: list[JobRecord] = [
                StoreRecord(i, p, ()) if isinstance(p, StorePlan) else LoadRecord(i, p, ()) for i, p in enumerate(plans)
            ]
            answers.append([inline.eligible(r) for r in recs])
        assert answers[0] == answers[1]
        assert inline._all_host is False  # (as the second pass left it)
        inline._all_host = None
        inline.eligible(LoadRecord(0, plans[6], ()))
        assert inline._all_host is (tiers == ["cpu", "cpu"])
        if tiers == ["cpu", "cpu"]:
            assert answers[0] == [True, True, False, True, False, True, True, False, True, False]  # (3: 6 blocks)
        else:
            assert answers[0] == [True, True, False, False, False, True, True, False, False, False]
        engine.close()
