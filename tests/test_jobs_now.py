"""A plain store or load run at once with no job record (:mod:`kvtier.transfer.jobs_now`)
against the usual inline submit and ``take``: the same results, counters, tier contents, engine
blocks and engine state, for plain stores (with evictions) and loads, a failed copy, and the jobs
it leaves to the usual path (having changed nothing); and ``KVStore.save`` / ``load`` with it on
and off."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_plain_jobs import HostRig
from test_transfer import record_of

import kvtier
from kvtier.errors import ClosedError
from kvtier.testing import make_key
from kvtier.transfer.jobs import JobResult

K = [make_key(9000 + i) for i in range(40)]
HANG_GUARD = 30.0


class Rig(HostRig):
    """:class:`~test_plain_jobs.HostRig` whose engine stores and loads plain jobs at once
    (``now``) or through the usual inline submit."""

    def __init__(self, now: bool) -> None:
        super().__init__()
        self.now = now
        self.ran_now = 0

    def store(self, keys: list[bytes], ids: list[int]) -> JobResult:
        plan = self.manager.prepare_store(keys)
        assert plan is not None
        res = self.engine.store_now(plan, ids) if self.now else None
        if res is None:
            job = self.engine.submit_store(plan, ids, inline=True, checked=True)
            res = self.engine.take(job)
            assert res is not None  # it ran inline
        else:
            self.ran_now += 1
        self.manager.complete_store(res.keys, res.error is None, sizes=res.sizes)
        return res

    def load(self, keys: list[bytes], ids: list[int]) -> JobResult:
        plan = self.manager.prepare_load(keys)
        res = self.engine.load_now(plan, ids) if self.now else None
        if res is None:
            job = self.engine.submit_load(plan, ids, inline=True, checked=True)
            res = self.engine.take(job)
            assert res is not None  # it ran inline
        else:
            self.ran_now += 1
        self.manager.complete_load(plan.keys)
        return res

    def idle(self) -> bool:
        e = self.engine
        return e._active == 0 and not e._inline_running and not e._jobs and not e._finished and e.poll_finished() == []


def same(a: JobResult, b: JobResult) -> bool:
    """Equal results but for the seconds."""
    return dataclasses.replace(a, seconds=0.0) == dataclasses.replace(b, seconds=0.0)


@pytest.fixture
def rigs() -> Iterator[tuple[Rig, Rig]]:
    pair = Rig(now=True), Rig(now=False)
    yield pair
    for rig in pair:
        rig.engine.close()


def test_plain_stores_that_evict_and_plain_loads_match_the_inline_submit(rigs: tuple[Rig, Rig]) -> None:
    now, usual = rigs
    for rig in rigs:
        rig.results = [  # type: ignore[attr-defined]
            rig.store(K[0:4], [3, 9, 0, 5]),
            rig.store(K[4:8], [1, 2, 4, 6]),
            rig.store(K[8:12], [7, 8, 10, 11]),  # the tier is full: this one evicts K[0:4]
            rig.store(K[12:13], [12]),
            rig.load(K[8:12], [12, 13, 14, 15]),
            rig.load(K[5:7], [0, 3]),
        ]
    for a, b in zip(now.results, usual.results):  # type: ignore[attr-defined]
        assert a.error is None and same(a, b)  # the job ids too: one per job, in order
    assert now.ran_now == 6 and usual.ran_now == 0
    assert now.engine.counters == usual.engine.counters and now.engine.counters["inline_jobs"] == 6
    tier_a, tier_b = now.tier(), usual.tier()
    assert list(tier_a) == list(tier_b) and set(tier_a) == set(K[5:13])  # K[0:4], then K[4] evicted
    assert all(torch.equal(tier_a[k], tier_b[k]) for k in tier_a)
    assert all(torch.equal(x, y) for x, y in zip(now.blocks(), usual.blocks()))
    blocks = now.blocks()
    for b, key in zip((12, 13, 14, 15, 0, 3), (*K[8:12], K[5], K[6])):  # the loads wrote the saved bytes
        assert torch.equal(blocks[b], tier_a[key])
    assert now.idle() and usual.idle()
    assert now.manager.lookup(K[5:13]) == usual.manager.lookup(K[5:13]) == 8


def test_a_failed_copy_is_reported_and_undone_as_by_the_inline_submit(rigs: tuple[Rig, Rig], monkeypatch: pytest.MonkeyPatch) -> None:
    for rig in rigs:
        rig.store(K[0:2], [0, 1])
        monkeypatch.setattr(rig.layout, "gather", _raises)
        monkeypatch.setattr(rig.layout, "scatter", _raises)
        rig.failed = [rig.store(K[2:4], [2, 3]), rig.load(K[0:2], [5, 6])]  # type: ignore[attr-defined]
    now, usual = rigs
    assert now.ran_now == 3
    for a, b in zip(now.failed, usual.failed):  # type: ignore[attr-defined]
        assert a.error is not None and "copy broke" in a.error and same(a, b)
    assert list(now.tier()) == list(usual.tier()) == K[0:2]  # the failed store's rows were freed
    assert now.engine.counters == usual.engine.counters and now.engine.counters["failed_jobs"] == 2
    assert now.idle() and usual.idle()
    assert now.manager.lookup(K[2:4]) == usual.manager.lookup(K[2:4]) == 0


def _raises(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("copy broke")


def _unchanged(rig: Rig, run: Any) -> None:
    """``run()`` calls ``store_now`` or ``load_now``, which must answer ``None`` and change nothing."""
    e = rig.engine
    counters, tier, blocks, active, ids = dict(e.counters), rig.tier(), rig.blocks(), e._active, e._ids
    nxt = next(ids)
    assert run() is None
    assert e.counters == counters and list(rig.tier()) == list(tier) and next(ids) == nxt + 1
    assert all(torch.equal(x, y) for x, y in zip(rig.blocks(), blocks)) and e._active == active and not e._inline_running


def test_jobs_it_does_not_take_are_left_unchanged_to_the_usual_path(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(now=True)
    try:
        rig.store(K[0:8], list(range(8)))  # the tier is full
        plan = rig.manager.prepare_store(K[8:10])
        assert plan is not None and plan.drops
        # switched off, or its straight path is
        rig.engine._now.enabled = False
        _unchanged(rig, lambda: rig.engine.store_now(plan, [8, 9]))
        rig.engine._now.enabled = True
        rig.engine._inline.plain.enabled = False
        _unchanged(rig, lambda: rig.engine.store_now(plan, [8, 9]))
        rig.engine._inline.plain.enabled = True
        # larger than an inline job may be
        monkeypatch.setattr(rig.engine._inline, "max_bytes", rig.layout.block_bytes)
        _unchanged(rig, lambda: rig.engine.store_now(plan, [8, 9]))
        monkeypatch.undo()
        # a plan with a write-through copy (so not a plain store), a load with a promotion
        through = dataclasses.replace(plan, write_through=((0, ()),))
        _unchanged(rig, lambda: rig.engine.store_now(through, [8, 9]))
        load = rig.manager.prepare_load(K[2:4])
        promoting = dataclasses.replace(load, promote=(K[2],))
        _unchanged(rig, lambda: rig.engine.load_now(promoting, [14, 15]))
        # a key gone from the tier behind the manager's back: the usual path reports the miss
        rig.backend.delete_blocks([K[3]])
        _unchanged(rig, lambda: rig.engine.load_now(load, [14, 15]))
        (missed,) = rig.engine.wait([rig.engine.submit_load(load, [14, 15], inline=True)], timeout=HANG_GUARD)
        assert missed.missed == (K[3],)
        rig.manager.complete_load(load.keys)
        rig.manager.remove([K[3]], 0)
        rig.engine.poll_finished()
        load = rig.manager.prepare_load(K[4:6])
        # another job runs: a store on the transfer threads, held in its copy
        started, release = threading.Event(), threading.Event()
        inner = rig.layout.gather

        def held(*args: Any, **kwargs: Any) -> None:
            started.set()
            release.wait(HANG_GUARD)
            inner(*args, **kwargs)

        monkeypatch.setattr(rig.layout, "gather", held)
        other = rig.manager.prepare_store(K[20:21])
        assert other is not None
        job = rig.engine.submit_store(other, [12])
        assert started.wait(HANG_GUARD)
        monkeypatch.setattr(rig.layout, "gather", inner)
        _unchanged(rig, lambda: rig.engine.store_now(plan, [8, 9]))
        _unchanged(rig, lambda: rig.engine.load_now(load, [14, 15]))
        release.set()
        (res,) = rig.engine.wait([job], timeout=HANG_GUARD)
        rig.manager.complete_store(res.keys, res.error is None)
        rig.engine.poll_finished()
        rig.engine.wait_idle(HANG_GUARD)
        # idle again: it runs, and the bytes are the blocks'
        res = rig.engine.store_now(plan, [8, 9])
        assert res is not None and res.error is None and res.keys == tuple(K[8:10])
        rig.manager.complete_store(res.keys)
        assert torch.equal(rig.tier()[K[9]], record_of(rig.layout, 9)) and rig.idle()
        res = rig.engine.load_now(load, [14, 15])
        assert res is not None and res.error is None and res.keys == tuple(K[4:6])
        rig.manager.complete_load(load.keys)
        assert torch.equal(record_of(rig.layout, 15), rig.tier()[K[5]]) and rig.idle()
        # closed: nothing changes, and the usual submit says why
        rig.engine.close()
        last = rig.manager.prepare_store(K[30:31])
        assert last is not None
        assert rig.engine.store_now(last, [13]) is None
        assert rig.engine.load_now(rig.manager.prepare_load(K[8:9]), [13]) is None
        with pytest.raises(ClosedError):
            rig.engine.submit_store(last, [13], inline=True)
    finally:
        rig.engine.close()


CACHE_SHAPE = (12, 4, 2, 2, 16)  # engine blocks, tokens, K/V, heads, dims


def test_save_and_load_give_the_same_answers_with_it_on_and_off() -> None:
    """``KVStore.save`` and ``load`` of one ``cpu`` tier with plain stores run at once and
    through the usual submit: the same counts returned, bytes loaded back, stats and events."""
    out = {}
    for on in (True, False):
        g = torch.Generator().manual_seed(5)
        caches = [torch.randn(CACHE_SHAPE, generator=g) for _ in range(3)]
        block_bytes = sum(c[0].numel() * c.element_size() for c in caches)

        async def run(caches: list[torch.Tensor] = caches, on: bool = on, block_bytes: int = block_bytes) -> Any:
            cfg = {"tiers": [{"backend": "cpu", "capacity": 6 * block_bytes}]}
            async with kvtier.open(cfg, kv_caches=caches) as store:
                assert store.transfers is not None
                store.transfers._now.enabled = on
                counts = [
                    await store.save(K[0:3], [1, 3, 5]),
                    await store.save(K[0:4], [1, 3, 5, 7]),  # three held: one new
                    await store.save(K[4:8], [0, 2, 4, 6]),  # the tier is full: evicts
                    await store.load(K[4:8], [8, 9, 10, 11]),
                    await store.load(K[0:2], [8, 9]),  # evicted: misses
                ]
                loaded = [torch.cat([c[b].flatten() for c in caches]) for b in (8, 9, 10, 11)]
                stats = store.stats()
                events = store.manager.take_events() if store.manager is not None else None
                return counts, loaded, stats, events, store.transfers.counters["inline_jobs"]

        out[on] = asyncio.run(run())
    (c1, l1, s1, e1, i1), (c2, l2, s2, e2, i2) = out[True], out[False]
    assert c1 == c2 and c1[2] == 4 and c1[3] == 4
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert untimed(s1) == untimed(s2) and e1 == e2 and i1 == i2 > 0


def untimed(stats: Any) -> Any:
    """``stats`` with each latency histogram cut to its count (the seconds differ run to run)."""
    if isinstance(stats, dict):
        if "buckets" in stats:
            return {"count": stats["count"]}
        return {k: untimed(v) for k, v in stats.items()}
    return stats
