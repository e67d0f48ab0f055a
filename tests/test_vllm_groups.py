"""The vLLM adapter with several KV-cache groups (hybrid models), without vLLM: each group its
own store on every rank (its own layout and bytes per block), one vLLM job split by vLLM's
group sizes, offload keys routed to their group's manager by the group index vLLM packs into
them. Jobs are driven as vLLM's ``OffloadingConnector`` drives them: keys of all groups in one
list, group after group, and block ids with ``group_sizes`` and ``block_indices``.

Group 0 has two (16, 4, 8) float32 tensors (256 bytes per block), group 1 one (16, 2, 8)
tensor (64 bytes per block, a sliding-window group in these tests); each rank's values differ,
so a byte-exact load proves each group and each rank got its own blocks back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvtier
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integrations.vllm import groups as vg
from kvtier.integrations.vllm.announce import OffloadKeyLog
from kvtier.integrations.vllm.engines import RankEngine, SchedulerEngine, rank_tiers, vllm_namespace
from kvtier.integrations.vllm.ranks import describe_rank
from kvtier.integrations.vllm.worker_side import NULL_BLOCK, WorkerSide, close_sides

HANG_GUARD = 60.0
GROUPS = (0, 1)
SHAPES = {0: [(16, 4, 8), (16, 4, 8)], 1: [(16, 2, 8)]}
BYTES = {0: 256, 1: 64}  # per engine block


def okey(i: int, group: int) -> bytes:
    """vLLM's offload key of block hash ``i`` in ``group`` (``make_offload_key``)."""
    return (b"h%031d" % i) + group.to_bytes(4, "big")


def _kv(rank: int, group: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11 + 7 * rank + group)
    return [torch.randn(*shape, generator=g) + 1000.0 * rank + 100.0 * group for shape in SHAPES[group]]


_CONFIG = SimpleNamespace(
    model=SimpleNamespace(name="tiny-hybrid", dtype="float32"),
    kv_cache_layout="NHD",
    parallel=SimpleNamespace(tp_size=1, pp_size=1),
)


class GroupWorld:
    """``world`` ranks, each with one store per group, and the scheduler side over them."""

    def __init__(self, stores: list[list[Any]], caches: list[list[list[torch.Tensor]]], config: Any) -> None:
        self.world = len(stores)
        self.stores, self.caches = stores, caches
        self.engines = [[RankEngine("e", s, rank=r, group=g) for g, s in zip(GROUPS, per)] for r, per in enumerate(stores)]
        for per in self.engines:
            for e in per:
                e.reports_load_errors = True
        self.workers = [vg.WorkerGroups([WorkerSide(e) for e in per]) for per in self.engines]
        self.sched = [SchedulerEngine("e", self.world, group=g) for g in GROUPS]
        self.side = vg.SchedulerGroups(
            self.sched, config, OffloadKeyLog(None), lambda gpos, layout: vllm_namespace(_CONFIG, 16, layout, {})
        )
        self.side.adopt(
            {
                r: vg.RankGroups(
                    r,
                    self.world,
                    GROUPS,
                    tuple(describe_rank("e", r, self.world, s, vg.group_layout("L", g, 2)) for g, s in zip(GROUPS, per)),
                )
                for r, per in enumerate(stores)
            }
        )
        self.finished: list[list[tuple[int, bool, int, float]]] = [[] for _ in range(self.world)]

    def deliver(self) -> None:
        """Every rank's finished jobs (as vLLM sees them), and their results to the scheduler side."""
        for r, w in enumerate(self.workers):
            for side in w.sides:
                side._transfers.wait(list(side._jobs), timeout=HANG_GUARD)
            self.finished[r] += w.finished()
            self.side.receive(w.take_results(r))

    def store(self, keys: list[bytes], ids: list[int], sizes: list[int], starts: list[int], job: int = 1) -> list[bytes]:
        prepared = self.side.prepare_store(keys)
        assert prepared is not None
        chosen, plans = prepared
        for w in self.workers:
            w.submit_store(job, plans, ids, sizes, starts)
        self.deliver()
        self.side.complete_store(chosen)
        return chosen

    def load(self, keys: list[bytes], ids: list[int], sizes: list[int], starts: list[int], job: int = 2) -> None:
        loads = self.side.prepare_load(keys)
        for w in self.workers:
            w.submit_load(job, loads, ids, sizes, starts)
        self.deliver()
        self.side.complete_load(keys)

    def hits(self, keys: list[bytes]) -> list[bool]:
        return [self.side.lookup(k) for k in keys]

    def records(self, rank: int, group: int) -> int:
        backend = self.stores[rank][GROUPS.index(group)].backends[-1]
        return len(backend) if backend.is_memory else sum(1 for _ in backend.scan())

    async def close(self) -> None:
        for per in self.stores:
            for s in per:
                await s.aclose()


async def open_groups(world: int, tiers: list[dict[str, Any]], *, n: int = 1, **settings: Any) -> GroupWorld:
    """``settings``: more of the engine's kvtier config (``write``, ``flush_on_close_s``, ...)."""
    cfg = {"tiers": tiers, "job_deadline_s": None, "engine_blocks_per_block": n, **settings}
    shares = vg.group_shares([BYTES[g] * n for g in GROUPS])
    stores, caches = [], []
    for r in range(world):
        per_stores, per_caches = [], []
        for gpos, g in enumerate(GROUPS):
            kv = _kv(r, g)
            per_stores.append(await kvtier.open(vg.group_tiers(rank_tiers(cfg, r, world), g, shares[gpos], 2), kv_caches=kv))
            per_caches.append(kv)
        stores.append(per_stores)
        caches.append(per_caches)
    return GroupWorld(stores, caches, load_config(rank_tiers(cfg, 0, world), block_bytes=1))


def cpu(blocks: int, world: int, n: int = 1) -> dict[str, Any]:
    """A memory tier of ``blocks`` chunks in each group (both groups' bytes, all ranks)."""
    return {"backend": "cpu", "capacity": blocks * n * sum(BYTES.values()) * world}


@pytest.fixture(params=[1, 2])
async def world(request: Any) -> AsyncIterator[GroupWorld]:
    w = await open_groups(request.param, [cpu(8, request.param)])
    yield w
    await w.close()


def test_group_tiers_share_the_capacity_by_bytes_per_block_and_keep_records_apart() -> None:
    cfg = {"tiers": [{"backend": "cpu", "capacity": 1000}, {"backend": "lmdb", "path": "/c/r0-of-1", "capacity": 4000}]}
    shares = vg.group_shares([192, 64])
    assert shares == [0.75, 0.25]
    g1 = vg.group_tiers(cfg, 1, shares[1], 2)
    assert [t["capacity"] for t in g1["tiers"]] == [250, 1000] and g1["tiers"][1]["path"] == "/c/r0-of-1-g1"
    assert vg.group_tiers({"tiers": [{"backend": "redis", "capacity": 8}]}, 3, 0.5, 2)["tiers"][0]["prefix"] == "kvtier.g3"
    assert vg.group_tiers({"tiers": [{"backend": "s3", "capacity": 8, "prefix": "a/b"}]}, 1, 0.5, 2)["tiers"][0]["prefix"] == "a/b.g1"
    assert vg.group_tiers(cfg, 0, 1.0, 1) == cfg  # one group: the names records always had
    assert vg.group_layout("fp", 1, 2) == "group1;fp" and vg.group_layout("fp", 0, 1) == "fp"
    assert vg.offload_group(okey(5, 7)) == 7


async def test_two_groups_with_different_bytes_per_block_store_and_load_their_own_blocks(world: GroupWorld) -> None:
    keys = [okey(0, 0), okey(1, 0), okey(0, 1), okey(1, 1)]  # vLLM's order: group after group
    chosen = world.store(keys, [1, 2, 3, 4], [2, 2], [0, 0])
    assert chosen == keys and world.hits(keys) == [True] * 4
    assert all(f == [(1, True, f[0][2], f[0][3])] for f in world.finished)  # one vLLM job, finished once
    assert world.finished[0][0][2] == 2 * BYTES[0] + 2 * BYTES[1]
    for r in range(world.world):
        assert world.records(r, 0) == 2 and world.records(r, 1) == 2
        assert world.stores[r][0].format.block_bytes == BYTES[0] and world.stores[r][1].format.block_bytes == BYTES[1]
    # The same block hash in two groups: two kvtier keys, in two managers.
    g0, g1 = world.side.groups
    assert g0.kkey(keys[0]) != g1.kkey(keys[2])
    assert world.sched[0].manager is not None and world.sched[0].manager.lookup([g1.kkey(keys[2])]) == 0
    world.load(keys, [6, 7, 8, 9], [2, 2], [0, 0])
    for r in range(world.world):
        for t in world.caches[r][0]:
            assert torch.equal(t[6:8], t[1:3])
        for t in world.caches[r][1]:
            assert torch.equal(t[8:10], t[3:5])
        assert not world.workers[r].take_failed_loads()
    assert all(sum(t["pinned"] for t in e.manager.stats()["tiers"]) == 0 for e in world.sched if e.manager)


async def test_a_store_without_keys_of_one_group_touches_only_the_other() -> None:
    w = await open_groups(1, [cpu(8, 1)])
    try:
        w.store([okey(0, 1), okey(1, 1)], [5, 6], [0, 2], [0, 0])  # a sliding-window backfill
        assert w.hits([okey(0, 0), okey(0, 1), okey(1, 1)]) == [False, True, True]
        assert w.records(0, 0) == 0 and w.records(0, 1) == 2
    finally:
        await w.close()


async def test_a_sliding_window_chunk_with_null_leading_blocks_is_not_stored_and_a_load_writes_no_held_block() -> None:
    w = await open_groups(2, [cpu(4, 2, 2)], n=2)
    try:
        keys = [okey(0, 0), okey(1, 0), okey(0, 1), okey(1, 1)]
        # Group 1's window has moved past block 0 of the request: vLLM leaves out its id and
        # says the group's blocks start at block 1; chunk 0 is incomplete.
        w.store(keys, [1, 2, 3, 4, 6, 7, 8], [4, 3], [0, 1])
        assert w.hits(keys) == [True, True, False, True]
        for r in range(2):
            assert w.records(r, 0) == 2 and w.records(r, 1) == 1
            assert w.engines[r][1].counters["null_chunks_not_stored"] == 1
        assert all(f[0][1] for f in w.finished)
        before = [[[t.clone() for t in cache] for cache in per] for per in w.caches]
        # A later request: group 1 holds block 2 already (its window), so its load starts in
        # the middle of chunk 1 (block 3, id 11); group 0 loads both chunks.
        w.load([okey(0, 0), okey(1, 0), okey(1, 1)], [12, 13, 14, 15, 11], [4, 1], [0, 3])
        for r in range(2):
            g0, g1 = w.caches[r]
            for t, old in zip(g0, before[r][0]):
                assert torch.equal(t[12:16], old[1:5])
            for t, old in zip(g1, before[r][1]):
                assert torch.equal(t[11], old[8])  # chunk 1's second block, as stored
                held = [i for i in range(16) if i not in (11, NULL_BLOCK)]
                assert torch.equal(t[held], old[held])  # no block the engine holds is written
            assert not w.workers[r].take_failed_loads()
    finally:
        await w.close()


async def test_a_failed_load_in_one_group_makes_the_request_recompute(tmp_path: Path) -> None:
    w = await open_groups(2, [{"backend": "lmdb", "path": str(tmp_path), "capacity": "32MiB"}])
    try:
        keys = [okey(0, 0), okey(1, 0), okey(0, 1), okey(1, 1)]
        w.store(keys, [1, 2, 3, 4], [2, 2], [0, 0])
        g1 = w.side.groups[1]
        await w.stores[1][1].backends[0].delete([g1.kkey(keys[2])])  # rank 1 lost group 1's block 0
        w.load(keys, [6, 7, 8, 9], [2, 2], [0, 0])
        # Block ids are unique only within a group (vLLM 0.32 raises on them with several
        # groups): the load is reported as a failed receive of the whole request instead.
        assert w.workers[1].take_failed_loads() == {2} and not w.workers[0].take_failed_loads()
        assert all(not worker.take_failed_block_ids() for worker in w.workers)
        assert all(f[-1] == (2, True, f[-1][2], f[-1][3]) for f in w.finished)  # vLLM asserts success
        # Only the lost key is forgotten; the other group's records are still served.
        assert w.hits(keys) == [True, True, False, True]
    finally:
        await w.close()


async def test_a_job_whose_group_sizes_do_not_fit_fails_as_a_whole(world: GroupWorld) -> None:
    keys = [okey(0, 0), okey(0, 1)]
    prepared = world.side.prepare_store(keys)
    assert prepared is not None
    for w in world.workers:
        w.submit_store(3, prepared[1], [1, 2, 3], [1, 1], [0, 0])  # three ids for two blocks
    world.deliver()
    world.side.complete_store(prepared[0])
    assert world.hits(keys) == [False, False]
    assert all(f == [(3, True, 0, 0.0)] for f in world.finished)
    loads = world.side.prepare_load([])
    for w in world.workers:
        w.submit_load(4, loads, [1], [1], [0])  # one group's sizes for two groups
    assert all(w.take_failed_loads() == {4} for w in world.workers)


class MambaSpec:  # the name vLLM's Mamba state spec has (kvtier matches it by name)
    pass


class Mamba2Spec(MambaSpec):
    pass


class FullAttentionSpec:
    pass


@pytest.mark.parametrize("spec", [MambaSpec, Mamba2Spec])
def test_a_model_with_mamba_state_is_refused_naming_the_group(spec: type) -> None:
    groups = [
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["model.layers.0.self_attn.attn"]),
        SimpleNamespace(kv_cache_spec=spec(), layer_names=["model.layers.1.mixer"]),
    ]
    with pytest.raises(ConfigError, match=r"KV-cache group 1 \(Mamba2?Spec, layers model\.layers\.1\.mixer\)"):
        vg.check_kv_cache_groups(groups)
    vg.check_kv_cache_groups(groups[:1])


async def test_a_rank_s_shutdown_writes_back_its_groups_within_one_budget_newest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each group's write-back used to run after the other's, each with the whole
    ``flush_on_close_s``: the later groups were cut off by vLLM's shutdown timeout. The groups
    now share one budget and are written newest first across them."""
    from kvtier.transfer import flush

    clock = [0.0]  # one second passes per write to a persistent tier
    monkeypatch.setattr(flush, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    monkeypatch.setattr(flush, "CHUNK_BLOCKS", 1)
    tiers = [cpu(8, 1), {"backend": "lmdb", "path": str(tmp_path / "db"), "capacity": "8MiB"}]
    w = await open_groups(1, tiers, write="back", flush_on_close_s=2.5)
    written: list[tuple[int, bytes]] = []
    for gpos, store in enumerate(w.stores[0]):
        persistent, real = store.backends[1], store.backends[1].write_blocks

        def timed(keys: Any, blocks: Any, gpos: int = gpos, real: Any = real) -> Any:
            clock[0] += 1.0
            written.extend((gpos, k) for k in keys)
            return real(keys, blocks)

        persistent.write_blocks = timed
    keys = [okey(i, g) for g in GROUPS for i in range(4)]
    w.store(keys, [0, 1, 2, 3, 0, 1, 2, 3], [4, 4], [0, 0])
    assert w.records(0, 0) == 0 and w.records(0, 1) == 0  # write-back: only in memory
    reports = await close_sides(w.workers[0].sides)
    g0, g1 = w.side.groups
    newest = [(0, g0.kkey(okey(3, 0))), (1, g1.kkey(okey(3, 1))), (0, g0.kkey(okey(2, 0)))]
    assert written == newest  # 2.5 s in all: the newest of each group, then the next, then time is up
    assert [r.flushed for r in reports if r is not None] == [2, 1]
    assert all(r is not None and r.stopped_by == "time" for r in reports)
    assert [e.counters["blocks_flushed_at_close"] for e in w.engines[0]] == [2, 1]
