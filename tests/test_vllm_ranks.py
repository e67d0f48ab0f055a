"""The vLLM adapter with several worker ranks, without vLLM: each rank opens its own tiers for
its own shard, the scheduler side builds one manager from what the ranks describe, and every
job is settled with every rank's result (as vLLM's channels carry them between processes).

Each rank's KV cache holds different values, so a byte-exact load also proves that every rank
got its own shard back."""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from redis_servers import RedisServer
from server_ports import PortTaken, listening, start_on_free_ports
from vllm_world import HANG_GUARD, World, count_writes, cpu, lmdb, open_world

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.engines import rank_tiers
from kvtier.integrations.vllm.ranks import RankTiers, TierRoom, build_manager
from kvtier.testing import make_key

K = [make_key(700 + i) for i in range(16)]


@pytest.fixture(params=[2, 4])
async def world(request: Any) -> AsyncIterator[World]:
    w = await open_world(request.param, [cpu(8, request.param)])
    yield w
    await w.close()


def test_rank_tiers_divide_capacity_and_keep_records_apart() -> None:
    cfg = {
        "tiers": [
            {"backend": "cpu", "capacity": "4GiB"},
            {"backend": "lmdb", "path": "/c", "capacity": 1000},
            {"backend": "redis", "capacity": 1000, "prefix": "p"},
            {"backend": "s3", "capacity": 1000, "bucket": "b"},
        ],
        "write": "through",
    }
    r1 = rank_tiers(cfg, 1, 4)
    assert [t["capacity"] for t in r1["tiers"]] == [1 << 30, 250, 250, 250]
    assert r1["tiers"][1]["path"] == "/c/r1-of-4" and r1["tiers"][2]["prefix"] == "p.r1-of-4"
    assert r1["tiers"][3]["prefix"] == "kvtier.r1-of-4"  # every shared tier keeps its ranks apart
    assert r1["write"] == "through" and cfg["tiers"][1]["path"] == "/c"  # the input is not changed
    assert rank_tiers(cfg, 0, 1)["tiers"][1]["path"] == "/c/r0-of-1"
    with pytest.raises(ConfigError, match=r"tiers\[0\]"):
        rank_tiers({"tiers": ["cpu"]}, 0, 2)


def _two_free_ports() -> int:
    """A localhost port ``p`` with ``p + 1`` free too."""
    import socket

    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            try:
                b.bind(("127.0.0.1", a.getsockname()[1] + 1))
            except OSError:
                continue
            return int(a.getsockname()[1])
    raise RuntimeError("no two adjacent free ports")


def test_each_rank_serves_its_metrics_on_the_base_port_plus_its_rank() -> None:
    cfg = {"tiers": [{"backend": "cpu", "capacity": "1MiB"}], "metrics": {"port": 9400, "addr": "0.0.0.0"}}
    assert [rank_tiers(cfg, r, 4)["metrics"] for r in range(4)] == [{"port": 9400 + r, "addr": "0.0.0.0"} for r in range(4)]
    assert rank_tiers({**cfg, "metrics": {"port": 0}}, 3, 4)["metrics"] == {"port": 0}  # any free port, on every rank
    assert "metrics" not in rank_tiers({"tiers": cfg["tiers"]}, 1, 2)
    assert cfg["metrics"] == {"port": 9400, "addr": "0.0.0.0"}  # the engine's config is left as it was


async def test_two_ranks_with_a_metrics_port_both_start_and_serve_their_own() -> None:
    """Before, every rank bound the one configured port: with each rank in its own process (as
    under vLLM) the second rank's store failed to open with EADDRINUSE. Each serves its own now."""
    import urllib.request

    pytest.importorskip("prometheus_client")
    loop = asyncio.get_running_loop()

    def opened(base: int) -> tuple[int, World]:
        """The world on ports ``base`` and ``base + 1``; PortTaken when a rank could not bind its
        port because something outside the world took it after the probe."""
        w = asyncio.run_coroutine_threadsafe(open_world(2, [cpu(8, 2)], metrics={"port": base}), loop).result()
        unbound = [base + r for r in range(2) if w.stores[r]._exporter.port is None]
        if unbound:
            asyncio.run_coroutine_threadsafe(w.close(), loop).result()
            if any(listening(p) for p in unbound):
                raise PortTaken(f"metrics port {unbound} taken after its probe")
            raise AssertionError(f"metrics ports {unbound} not served, and nothing else holds them")
        return base, w

    base, w = await asyncio.to_thread(start_on_free_ports, lambda n: _two_free_ports(), start=opened)
    try:
        w.store(K[:2], [0, 1])
        for r in range(2):
            assert w.stores[r]._exporter.port == base + r
            with urllib.request.urlopen(f"http://127.0.0.1:{base + r}/metrics", timeout=HANG_GUARD) as reply:
                assert b"kvtier_tier_blocks" in reply.read()
    finally:
        await w.close()


async def test_a_store_every_rank_made_is_ready_and_each_rank_loads_its_own_shard(world: World) -> None:
    world.store(K[:2], [0, 1])
    assert world.manager.lookup(K[:2]) == 2
    assert all(world.held(r) == 2 for r in range(world.world))
    load_id, plan = world.side.prepare_load(K[:2])
    for w in world.workers:
        w.submit_load(2, load_id, plan, [6, 7])
    world.deliver()
    world.side.complete_load(K[:2])
    for r in range(world.world):
        for t in world.caches[r]:
            assert torch.equal(t[6:8], t[0:2])
        assert not world.workers[r].take_failed_block_ids()
    assert sum(t["pinned"] for t in world.manager.stats()["tiers"]) == 0


async def test_a_rank_that_never_reports_fails_the_store_and_the_others_copies_go(world: World) -> None:
    silent = world.world - 1
    world.store(K[:2], [0, 1], deliver=range(silent))  # vLLM settles the job without that rank's result
    assert world.manager.lookup(K[:2]) == 0
    assert world.sched_engine.counters["results_missing"] == 1
    assert world.held(0) == 2  # rank 0 wrote its copies, which the manager released
    assert world.run_deletes() == 2
    assert all(world.held(r) == 0 for r in range(world.world))
    world.deliver([silent])  # its late result is ignored: the plan is settled
    assert world.manager.lookup(K[:2]) == 0
    world.store(K[:2], [0, 1])  # the room is free again on every rank
    assert world.manager.lookup(K[:2]) == 2


async def test_a_rank_whose_write_fails_releases_the_keys_on_every_rank(world: World, monkeypatch: Any) -> None:
    bad = world.workers[1]._transfers.layout

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected device read failure")

    monkeypatch.setattr(bad, "gather", broken)
    world.store(K[:3], [0, 1, 2])
    assert world.manager.lookup(K[:3]) == 0
    assert world.sched_engine.counters["blocks_store_failed"] == 3
    assert world.held(0) == 3 and world.held(1) == 0
    world.run_deletes()
    assert all(world.held(r) == 0 for r in range(world.world))
    assert sum(t["pending"] for t in world.manager.stats()["tiers"]) == 0


async def test_a_load_missing_on_one_rank_is_recomputed_on_every_rank(tmp_path: Path) -> None:
    w = await open_world(2, [lmdb(tmp_path)])
    try:
        w.store(K[:2], [0, 1])
        await w.stores[1].backends[0].delete([K[0]])  # rank 1 lost its record of K0
        load_id, plan = w.side.prepare_load(K[:2])
        for worker in w.workers:
            worker.submit_load(2, load_id, plan, [6, 7])
        w.deliver()
        # vLLM unions the ranks' failed blocks: block 6 is recomputed on every rank.
        assert w.workers[1].take_failed_block_ids() == {6} and not w.workers[0].take_failed_block_ids()
        w.side.complete_load(K[:2])
        assert w.manager.lookup(K[:2]) == 0 and w.manager.lookup(K[1:2]) == 1
        assert w.run_deletes() == 1  # rank 0's copy of K0 goes too
        assert w.held(0) == 1 and w.held(1) == 1
    finally:
        await w.close()


async def test_a_fresh_world_adopts_the_keys_every_rank_holds_and_deletes_the_orphans(tmp_path: Path) -> None:
    w = await open_world(2, [lmdb(tmp_path)])
    w.store(K[:4], [0, 1, 2, 3])
    await w.stores[1].backends[0].delete([K[3]])  # K3 only on rank 0: an orphan
    await w.close()

    w = await open_world(2, [lmdb(tmp_path)])
    try:
        assert w.adopted == 3 and w.orphans == {0: [K[3]]}
        assert w.manager.lookup(K[:3]) == 3 and w.manager.lookup(K[3:4]) == 0
        assert w.run_deletes() == 1
        assert w.held(0) == 3 and w.held(1) == 3
        load_id, plan = w.side.prepare_load(K[:3])
        for worker in w.workers:
            worker.submit_load(2, load_id, plan, [8, 9, 10])
        w.deliver()
        w.side.complete_load(K[:3])
        for r in range(2):
            for t in w.caches[r]:
                assert torch.equal(t[8:11], t[0:3])
    finally:
        await w.close()

    # Another world size: other directories, no records, no error.
    w = await open_world(1, [lmdb(tmp_path)])
    try:
        assert w.adopted == 0 and w.manager.lookup(K[:3]) == 0
    finally:
        await w.close()


def _room(max_blocks: int, reserve: int, records: tuple[Any, ...] = (), *, shared: bool = False) -> TierRoom:
    return TierRoom("t", max_blocks * reserve, reserve, max_blocks, False, True, shared, False, 1, records)


def _ranks(*tiers: TierRoom, layout: str = "L") -> dict[int, RankTiers]:
    return {r: RankTiers("e", r, len(tiers), 64, layout, (t,)) for r, t in enumerate(tiers)}


def test_build_manager_takes_the_smallest_room_of_the_ranks() -> None:
    # Stages of a pipeline hold different layers: different bytes per block, and so room.
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": 1 << 20}]}, block_bytes=64)
    manager, _, _ = build_manager(_ranks(_room(10, 64), _room(6, 96)), cfg)
    spec = manager.tier_spec(0)
    assert spec.block_reserve == 96 and spec.capacity_bytes == 6 * 96
    assert manager.prepare_store(K[:7]) is None  # 7 blocks do not fit on the smaller rank
    assert manager.prepare_store(K[:6]) is not None


def test_build_manager_ignores_orphans_of_a_shared_tier_and_refuses_another_engine() -> None:
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": 1 << 20}]}, block_bytes=64)
    rec = [(K[i], 64, float(i)) for i in range(3)]
    _, orphans, adopted = build_manager(_ranks(_room(8, 64, tuple(rec), shared=True), _room(8, 64, tuple(rec[:2]), shared=True)), cfg)
    assert adopted == {0: [K[0], K[1]]} and orphans == {}  # K2 may be another host's write in progress
    _, orphans, _ = build_manager(_ranks(_room(8, 64, tuple(rec)), _room(8, 64, tuple(rec[:2]))), cfg)
    assert orphans == {0: [K[2]]}
    with pytest.raises(ConfigError, match=r"ranks 0\.\.1"):
        build_manager({1: _ranks(_room(8, 64), _room(8, 64))[1]}, cfg)
    ranks = _ranks(_room(8, 64), _room(8, 64))
    ranks[1] = _ranks(_room(8, 64), _room(8, 64), layout="other")[1]
    with pytest.raises(ConfigError, match="layout"):
        build_manager(ranks, cfg)


def test_rank_descriptions_cross_processes() -> None:
    ranks = _ranks(_room(8, 64, ((K[0], 64, 1.0),)))
    assert pickle.loads(pickle.dumps(ranks)) == ranks


def test_the_worker_metadata_carries_every_rank_s_results() -> None:
    kv_vllm = pytest.importorskip("kvtier.integrations.vllm")
    pytest.importorskip("vllm")
    meta_cls: Callable[..., Any] = kv_vllm.KvtierWorkerMetadata
    from kvtier.manager import StorePlan
    from kvtier.transfer import JobResult

    r0 = meta_cls(completed_jobs={3: 1}, kvtier_results=[(0, 0, "store", 9, JobResult(0, "store", True, (K[0],)))])
    r1 = meta_cls(completed_jobs={3: 1}, kvtier_results=[(1, 0, "store", 9, JobResult(0, "store", False, (K[0],)))])
    merged = pickle.loads(pickle.dumps(r0)).aggregate(pickle.loads(pickle.dumps(r1)))
    assert merged.completed_jobs == {3: 2}
    assert [(r, ok) for r, _, _, _, res in merged.kvtier_results for ok in [res.success]] == [(0, True), (1, False)]
    spec = kv_vllm.KvtierStoreSpec(((0, StorePlan(4, (K[1],), (0,))), (1, StorePlan(5, (K[2],), (0,)))))
    assert pickle.loads(pickle.dumps(spec)).plans == spec.plans


@pytest.mark.parametrize(("first", "ids", "expected"), [
    (0, [4, 5, 6, 7], ([4, 5, 6, 7], [[4, 5], [6, 7]])),
    (1, [5, 6, 7], ([0, 5, 6, 7], [[5], [6, 7]])),  # a GPU prefix hit ends inside the first chunk
    (1, [5, 6], ([0, 5, 6, 0], [[5], [6]])),  # and the hit ends inside the last one
    (3, [7], ([0, 7], [[7]])),
])
def test_chunks_pad_the_blocks_the_engine_holds_with_the_null_block(
    first: int, ids: list[int], expected: tuple[list[int], list[list[int]]]
) -> None:
    from kvtier.integrations.vllm.worker_side import chunk_block_ids

    assert chunk_block_ids(ids, first, 2, len(expected[1])) == expected
    with pytest.raises(ValueError, match="do not fill"):
        chunk_block_ids([*ids, 8, 9], first, 2, len(expected[1]))


async def test_a_load_from_the_middle_of_a_chunk_writes_no_block_the_engine_holds() -> None:
    w = await open_world(2, [cpu(4, 2)], n=2)
    try:
        w.store(K[:2], [1, 2, 3, 4])  # two chunks of two engine blocks
        before = [[t.clone() for t in cache] for cache in w.caches]
        load_id, plan = w.side.prepare_load(K[:2])
        for worker in w.workers:  # the engine holds the request's block 0 (the first chunk's first) already
            worker.submit_load(5, load_id, plan, [11, 12, 13], first_index=1)
        w.deliver()
        w.side.complete_load(K[:2])
        for r in range(2):
            for t, old in zip(w.caches[r], before[r]):
                assert torch.equal(t[11:14], old[2:5])  # rank r's own shard
                assert torch.equal(t[1:11], old[1:11]) and torch.equal(t[14:], old[14:])
            assert w.engines[r].counters["blocks_loaded"] == 2 and not w.workers[r].take_failed_block_ids()
    finally:
        await w.close()


def test_the_offload_key_log_names_the_adopted_blocks_across_processes(tmp_path: Path) -> None:
    from kvtier.integrations.vllm.announce import OffloadKeyLog, adopted_announcements, offload_key_log_path

    cfg = {"tiers": [{"backend": "cpu", "capacity": 1}, {"backend": "lmdb", "path": str(tmp_path), "capacity": 1}]}
    path = offload_key_log_path(cfg, 2)
    assert path == str(tmp_path / "vllm-offload-keys-of-2.bin")
    assert offload_key_log_path({"tiers": [{"backend": "cpu", "capacity": 1}]}, 1) is None
    writer = OffloadKeyLog(path)  # the process that stored the blocks
    writer.append([(K[0], b"hash-0"), (K[1], b"hash-1")])
    writer.append([(K[2], b"hash-2")])
    with open(path, "ab") as f:
        f.write(b"\x20\x00" + K[3][:7])  # a process killed mid-append: a torn tail
    reader = OffloadKeyLog(path)  # a fresh process
    assert reader.load() == {K[0]: b"hash-0", K[1]: b"hash-1", K[2]: b"hash-2"}
    # K1's record is gone, K5 was never logged: only K0 and K2 are announced (tier 1, LMDB).
    events, keep = adopted_announcements({1: [K[0], K[2], K[5]]}, reader.load())
    assert events == [(1, b"hash-0"), (1, b"hash-2")] and keep == {K[0]: b"hash-0", K[2]: b"hash-2"}
    reader.rewrite(keep)
    assert OffloadKeyLog(path).load() == keep and reader.errors == 0
    blocked = OffloadKeyLog(str(tmp_path / "vllm-offload-keys-of-2.bin" / "not-a-dir"))
    blocked.append([(K[0], b"x")])  # cannot write: counted and logged, never raised
    assert blocked.errors == 1 and blocked.load() == {}


# -- a rank that never reports a job: the scheduler side's deadline --------------------------


@pytest.fixture(params=[2, 4])
async def timed_world(request: Any) -> AsyncIterator[World]:
    w = await open_world(request.param, [cpu(8, request.param)], deadline_s=10.0)
    yield w
    await w.close()


async def test_a_store_a_rank_never_reports_is_given_up_after_the_deadline(timed_world: World) -> None:
    w = timed_world
    silent = w.world - 1
    w.issue_store(1, K[:2], [0, 1], ranks=range(silent))  # the last rank lost the job
    w.step()
    assert 1 in w.vllm.pending and w.manager.lookup(K[:2]) == 0  # vLLM's count is short
    w.now = 9.0
    w.step()
    assert w.side.take_notices() == () and w.sched_engine.counters["results_expired"] == 0
    w.now = 10.5
    w.step()
    assert w.sched_engine.counters["results_expired"] == 1
    assert w.side.table_sizes()["notices"] == 1  # owed to the workers: not idle yet
    (notice,) = w.side.take_notices()
    assert notice.job_id == 1 and notice.ranks == (silent,)
    w.step(notices=(notice,))  # every rank reads the notice; only the silent one settles
    assert 1 not in w.vllm.pending  # vLLM settled its job: no fence, no pending work left
    assert w.engines[silent].counters["jobs_abandoned"] == 1
    assert sum(e.counters["jobs_abandoned"] for e in w.engines) == 1
    assert w.manager.lookup(K[:2]) == 0
    assert sum(t["pending"] for t in w.manager.stats()["tiers"]) == 0
    assert w.side.table_sizes()["deletes"] == 2 and w.side.table_sizes()["notices"] == 0
    assert w.held(0) == 2 and w.run_deletes() == 2  # the copies the other ranks wrote go
    assert w.side.table_sizes()["deletes"] == 0
    assert all(w.held(r) == 0 for r in range(w.world))
    w.step(notices=(notice,))  # the notice again (or a late report): nothing counted twice
    w.issue_store(2, K[:2], [0, 1])
    w.step()
    assert w.manager.lookup(K[:2]) == 2  # the room is free again on every rank


async def test_a_late_or_doubled_report_never_reaches_vllm(timed_world: World) -> None:
    w = timed_world
    w.issue_store(1, K[:1], [0])
    w.now = 11.0
    w.step(ranks=[0])  # rank 0 reports; the others are late: given up
    (notice,) = w.side.take_notices()
    w.step(notices=(notice,))  # the late ranks' own reports and their settling race
    assert 1 not in w.vllm.pending and w.sched_engine.counters["results_expired"] == 1
    # Counts past the ranks due, or for a job vLLM settled, are dropped, never raised.
    assert w.side.deadlines.completed({1: 1}) == {}
    w.issue_store(2, K[1:2], [1])
    assert w.side.deadlines.completed({2: w.world + 3}) == {2: w.world}
    assert w.side.deadlines.completed({77: 1}) == {77: 1}  # not kvtier's job: vLLM's own rules


# -- loads vLLM never completes: nothing stays behind on the scheduler side ------------------


def _assert_idle(w: World) -> None:
    idle = w.idle()
    assert set(idle.values()) == {0}, idle


async def test_a_load_one_rank_s_result_never_reached_is_settled_by_vllm_s_count(timed_world: World) -> None:
    w = timed_world
    w.store(K[:2], [0, 1])
    w.issue_load(5, K[:2], [6, 7])
    w.step(lost=[w.world - 1])  # every rank counted the job; one rank's kvtier result was lost
    assert 5 not in w.vllm.pending
    assert w.sched_engine.counters["complete_load_unmatched"] == 0
    assert w.sched_engine.counters["results_missing"] == 1  # settled, counted failed
    _assert_idle(w)
    assert w.manager.lookup(K[:2]) == 2  # a lost report forgets nothing


async def test_an_aborted_request_s_load_is_settled_once_every_rank_finished_it(timed_world: World) -> None:
    w = timed_world
    w.store(K[:4], [0, 1, 2, 3])
    w.issue_load(5, K[:2], [6, 7], request_id="running")
    w.side.request_finished("running")  # aborted while its load runs; vLLM drops the job
    w.vllm.drop(5)
    assert w.idle()["pins"] == 2  # the ranks may still read its source: kept
    w.issue_load(6, K[2:4], [8, 9], request_id="done")
    w.vllm.drop(6)
    w.step()  # both loads done on every rank: the aborted one is settled
    assert w.idle()["pins"] == 2 and w.side.table_sizes()["done_loads"] == 1  # the other waits for vLLM ...
    w.side.request_finished("done")  # ... which drops it with its aborted request
    _assert_idle(w)
    w.side.prepare_load(K[:1], "never-ran")
    w.side.request_finished("never-ran")  # ended before its load was handed to any rank
    _assert_idle(w)
    assert w.manager.lookup(K[:4]) == 4


async def test_loads_done_but_never_completed_are_bounded(timed_world: World, monkeypatch: Any) -> None:
    from kvtier.integrations.vllm import scheduler_side

    monkeypatch.setattr(scheduler_side, "MAX_DONE_LOADS", 2)
    w = timed_world
    w.store(K[:3], [0, 1, 2])
    for i in range(3):
        w.issue_load(10 + i, K[i : i + 1], [8 + i])
        w.vllm.drop(10 + i)  # vLLM never completes any of them
        w.step()
    assert w.side.table_sizes()["done_loads"] == 2 and w.idle()["pins"] == 2  # the oldest was settled


async def test_a_load_stuck_on_one_rank_is_recomputed_and_never_written_late(tmp_path: Path, monkeypatch: Any) -> None:
    w = await open_world(2, [lmdb(tmp_path)], deadline_s=10.0)
    release = threading.Event()
    reading = threading.Event()
    try:
        w.store(K[:2], [0, 1])
        backend = w.stores[1].backends[0]
        real_read = backend.read_blocks

        def stuck_read(keys: Any, out: Any) -> Any:
            reading.set()
            release.wait(HANG_GUARD)  # a tier that stops answering
            return real_read(keys, out)

        monkeypatch.setattr(backend, "read_blocks", stuck_read)
        before = [t[6:8].clone() for t in w.caches[1]]
        w.issue_load(5, K[:2], [6, 7])
        assert reading.wait(HANG_GUARD)
        assert w.step(ranks=[0]) == set()  # rank 0 loaded its shard; rank 1 is stuck
        w.now = 10.5
        w.step(ranks=[0])
        (notice,) = w.side.take_notices()
        assert notice.kind == "load" and notice.ranks == (1,) and notice.block_ids == (6, 7)
        bad = w.step(notices=(notice,))
        assert bad == {6, 7}  # vLLM recomputes both blocks on every rank
        assert 5 not in w.vllm.pending and w.engines[1].counters["jobs_abandoned"] == 1
        assert sum(t["pinned"] for t in w.manager.stats()["tiers"]) == 0
        assert w.manager.lookup(K[:2]) == 2  # a rank that timed out lost no record
        release.set()  # the tier answers at last: the cancelled load must not write the blocks
        w.stores[1].transfers.wait_device([], timeout=HANG_GUARD)
        await w.stores[1].aclose()
        for t, old in zip(w.caches[1], before):
            assert torch.equal(t[6:8], old)
    finally:
        release.set()
        await w.close()


# -- kvtier's counters in vLLM's connector stats ------------------------------------------


async def _loaded_world() -> World:
    w = await open_world(2, [cpu(8, 2)])
    w.store(K[:2], [0, 1])
    w.issue_load(3, K[:2], [6, 7])
    w.step()
    return w


async def test_each_rank_reports_the_growth_of_its_counters_once() -> None:
    from kvtier.integrations.vllm.stats import METRICS, CounterDeltas, scheduler_counters, worker_counters

    w = await _loaded_world()
    try:
        deltas = [CounterDeltas() for _ in range(w.world)]
        grown = [d.take(worker_counters(e)) for d, e in zip(deltas, w.engines)]
        assert [g["blocks_loaded"] for g in grown] == [2, 2]  # each rank its shard of 2 blocks
        assert all(g["transfer_bytes_loaded"] == 2 * 256 for g in grown) and set().union(*grown) <= set(METRICS)
        assert [d.take(worker_counters(e)) for d, e in zip(deltas, w.engines)] == [{}, {}]  # nothing new
        w.engines[1].counters["blocks_load_failed"] += 1
        w.engines[1].counters["not_a_metric"] = 5  # never sent: vLLM refuses names it did not register
        assert deltas[1].take(worker_counters(w.engines[1])) == {"blocks_load_failed": 1}
        sched = CounterDeltas()
        assert sched.take(scheduler_counters(w.sched_engine))["blocks_stored"] == 2  # the scheduler side's own
        w.sched_engine.counters["results_expired"] += 2
        assert sched.take(scheduler_counters(w.sched_engine)) == {"results_expired": 2}
    finally:
        await w.close()


async def test_the_ranks_counters_add_up_in_vllm_s_stats_path() -> None:
    kv_vllm = pytest.importorskip("kvtier.integrations.vllm")
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvtier.integrations.vllm.stats import METRICS, PREFIX, CounterDeltas

    w = await _loaded_world()
    try:
        outputs = []
        for r in range(w.world):  # each rank's connector, as vLLM's model runner asks it
            conn = object.__new__(kv_vllm.KvtierConnector)
            worker = kv_vllm.KvtierOffloadingWorker([w.engines[r]], None)
            conn.connector_worker, conn.connector_scheduler = SimpleNamespace(worker=worker), None
            conn._kvtier_deltas = CounterDeltas()
            stats = conn.get_kv_connector_stats()
            out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
            out.kv_connector_output = KVConnectorOutput(kv_connector_stats=stats)
            outputs.append(out)
            assert conn.get_kv_connector_stats() is None  # nothing grew since
        merged = KVOutputAggregator(w.world).aggregate(outputs).kv_connector_output.kv_connector_stats
        # What the front end rebuilds from the engine core's SchedulerStats and logs.
        logged = kv_vllm.KvtierConnector.build_kv_connector_stats(merged.to_dict()).reduce()
        assert logged[PREFIX + "blocks_loaded"] == 4 and logged[PREFIX + "transfer_bytes_loaded"] == 4 * 256
        defined = kv_vllm.KvtierOffloadingSpec.build_metric_definitions({})
        assert set(defined) == {PREFIX + name for name in METRICS} >= set(logged)
    finally:
        await w.close()


# -- KV that is the same on every rank (MLA) -------------------------------------------------


def _redis(server: RedisServer, prefix: str) -> dict[str, Any]:
    return {"backend": "redis", "url": server.url, "capacity": "1MiB", "prefix": prefix, "sync_interval_s": 3600}


def _assert_loaded(w: World, dst: int, src: int, n: int) -> None:
    """Every rank's blocks ``dst..dst+n`` hold exactly what its blocks ``src..src+n`` hold."""
    for r in range(w.world):
        for t in w.caches[r]:
            assert torch.equal(t[dst : dst + n], t[src : src + n])


@pytest.mark.parametrize("world_size", [2, 4])
async def test_replicated_kv_is_stored_once_in_a_shared_tier_and_read_by_every_rank(
    redis_server: RedisServer, world_size: int
) -> None:
    prefix = f"mla-once-{world_size}"
    w = await open_world(world_size, [_redis(redis_server, prefix)], replicated=True)
    try:
        written = count_writes(w, 0)
        w.store(K[:3], [0, 1, 2])
        assert written == [3] + [0] * (world_size - 1)  # one copy, written by rank 0 alone
        assert w.manager.lookup(K[:3]) == 3
        assert all(w.held(r) == 3 for r in range(world_size))  # every rank sees the same 3 records
        assert w.stores[1].backends[0].prefix == f"{prefix}.all-of-{world_size}"  # no rank in the name
        assert w.load(K[:3], [8, 9, 10]) == set()
        _assert_loaded(w, 8, 0, 3)  # byte-exact on every rank, from rank 0's record
        # Deletes in the shared tier are the writer's: another rank never deletes rank 0's records.
        assert w.workers[1].submit_deletes(((0, (K[0],)),)) is None
        assert w.held(0) == 3
    finally:
        await w.close()

    w = await open_world(world_size, [_redis(redis_server, prefix)], replicated=True)  # a fresh engine
    try:
        assert w.adopted == 3 and w.orphans == {}
        assert w.manager.lookup(K[:3]) == 3
        assert w.load(K[:3], [11, 12, 13]) == set()
        _assert_loaded(w, 11, 0, 3)
    finally:
        await w.close()


async def test_replicated_kv_stays_per_rank_in_tiers_the_ranks_do_not_share(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    w = await open_world(2, [cpu(8, 2), lmdb(tmp_path), _redis(redis_server, "mla-mixed")], replicated=True)
    try:
        written = [count_writes(w, t) for t in (1, 2)]
        w.store(K[:2], [0, 1])
        assert written == [[2, 2], [2, 0]]  # LMDB: a copy per rank; Redis: once
        assert all(w.held(r, 0) == 2 and w.held(r, 1) == 2 for r in range(2))
        assert {os.path.basename(w.stores[r].backends[1].path) for r in range(2)} == {"r0-of-2", "r1-of-2"}
        # A store a rank fails: the keys go on every rank; the shared copy only by rank 0.
        w.store(K[2:3], [2], deliver=[0])
        assert w.manager.lookup(K[2:3]) == 0
        assert w.run_deletes() >= 1
        assert all(w.held(r, 0) == 2 and w.held(r, 1) == 2 for r in range(2)) and w.held(0, 2) == 2
    finally:
        await w.close()


def test_replicated_kv_refuses_a_per_rank_tier_below_a_shared_one() -> None:
    from kvtier.integrations.vllm.replicated import shared_tiers

    ok = {"tiers": [{"backend": "cpu"}, {"backend": "lmdb"}, {"backend": "redis"}]}
    assert shared_tiers(ok) == frozenset({2})
    with pytest.raises(ConfigError, match=r"tiers\[1\] \(lmdb\).*shared tiers last"):
        shared_tiers({"tiers": [{"backend": "redis"}, {"backend": "lmdb"}]})


async def test_without_replicated_kv_a_redis_tier_keeps_a_shard_per_rank(redis_server: RedisServer) -> None:
    w = await open_world(2, [_redis(redis_server, "per-rank")])  # each rank's own prefix opens
    try:
        written = count_writes(w, 0)
        w.store(K[:2], [0, 1])
        assert written == [2, 2] and w.manager.lookup(K[:2]) == 2
        assert [b.prefix for b in (s.backends[0] for s in w.stores)] == ["per-rank.r0-of-2", "per-rank.r1-of-2"]
    finally:
        await w.close()


def test_replicated_kv_is_detected_from_vllm_s_config() -> None:
    pytest.importorskip("kvtier.integrations.vllm")
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from kvtier.integrations.vllm.connector import replicated_kv

    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.float16)
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float16)

    def config(use_mla: bool) -> Any:
        return SimpleNamespace(model_config=SimpleNamespace(use_mla=use_mla))

    def groups(*specs: Any) -> Any:
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])

    assert replicated_kv(config(True), groups(mla)) is True
    assert replicated_kv(config(False), groups(full)) is False
    assert replicated_kv(config(True), groups(mla, full)) is False  # a group that is sharded by heads
