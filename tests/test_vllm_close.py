"""A vLLM worker rank's shutdown writes back what only its memory tiers hold, without vLLM.

Under vLLM the scheduler side's manager alone knows what each tier holds; a rank's store only
executes the plans, so at close its own manager knows nothing. The rank's shutdown lists its
memory tiers' blocks from the backends and writes those its first persistent tier lacks back
there, so a fresh engine on the same path adopts them on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from redis_servers import RedisServer
from vllm_world import BB, World, count_writes, cpu, lmdb, open_world

from kvtier.errors import BackendError
from kvtier.testing import make_key
from kvtier.transfer.flush import flush_listed_to_persistent

K = [make_key(900 + i) for i in range(8)]


def _assert_loaded(w: World, dst: int, src: int, n: int) -> None:
    for r in range(w.world):
        for t in w.caches[r]:
            assert torch.equal(t[dst : dst + n], t[src : src + n])


async def _reopened_has_all(tiers: list[dict[str, Any]], world: int, n: int, **kw: Any) -> None:
    """A fresh world on the same tiers adopts the ``n`` keys on every rank and loads them exactly."""
    w = await open_world(world, tiers, **kw)
    try:
        assert w.adopted == n and w.orphans == {}
        assert w.manager.lookup(K[:n]) == n
        assert w.load(K[:n], list(range(8, 8 + n))) == set()
        _assert_loaded(w, 8, 0, n)
    finally:
        await w.close()


@pytest.mark.parametrize("world_size", [1, 2])
async def test_write_back_blocks_in_memory_reach_the_persistent_tier_at_shutdown(tmp_path: Path, world_size: int) -> None:
    tiers = [cpu(8, world_size), lmdb(tmp_path)]
    w = await open_world(world_size, tiers, write="back")
    try:
        w.store(K[:4], [0, 1, 2, 3])
        assert all(w.held(r, 0) == 4 and w.held(r, 1) == 0 for r in range(world_size))  # only in memory
    finally:
        await w.close()
    assert all(e.counters["blocks_flushed_at_close"] == 4 for e in w.engines)
    await _reopened_has_all(tiers, world_size, 4, write="back")


@pytest.mark.parametrize("world_size", [1, 2])
async def test_deferred_write_through_blocks_reach_the_persistent_tier_at_shutdown(tmp_path: Path, world_size: int) -> None:
    tiers = [cpu(8, world_size), lmdb(tmp_path)]
    w = await open_world(world_size, tiers)
    try:
        for worker in w.workers:
            worker._transfers.write_through_backlog = -1  # the tiers thread is always "behind"
        w.store(K[:3], [0, 1, 2])
        assert all(w.held(r, 1) == 0 for r in range(world_size))  # every write-through deferred
        assert all(wk._transfers.counters["write_through_deferred"] == 3 for wk in w.workers)
    finally:
        await w.close()
    await _reopened_has_all(tiers, world_size, 3)


async def test_shutdown_writes_only_what_the_persistent_tier_lacks(tmp_path: Path) -> None:
    tiers = [cpu(8, 2), lmdb(tmp_path)]
    w = await open_world(2, tiers)  # write-through: two blocks are there already
    try:
        w.store(K[:2], [0, 1])
        for worker in w.workers:
            worker._transfers.write_through_backlog = -1
        w.store(K[2:5], [2, 3, 4])
        written = count_writes(w, 1)
    finally:
        await w.close()
    assert written == [3, 3]
    await _reopened_has_all(tiers, 2, 5)


async def test_a_rank_that_does_not_write_a_shared_tier_leaves_it_to_the_writer(redis_server: RedisServer) -> None:
    tiers = [
        cpu(8, 2),
        {"backend": "redis", "url": redis_server.url, "capacity": "1MiB", "prefix": "close-shared", "sync_interval_s": 3600},
    ]
    w = await open_world(2, tiers, replicated=True, write="back")
    try:
        w.store(K[:3], [0, 1, 2])
        assert w.held(0, 1) == 0
        written = count_writes(w, 1)
    finally:
        for worker in reversed(w.workers):  # the reader first: it finds the shared tier without them
            await worker.close()
    assert written == [3, 0]  # rank 0 writes the one shared copy; rank 1 writes nothing there
    await _reopened_has_all(tiers, 2, 3, replicated=True, write="back")


async def test_a_failing_persistent_write_is_counted_and_the_shutdown_returns(tmp_path: Path) -> None:
    w = await open_world(2, [cpu(8, 2), lmdb(tmp_path)], write="back")
    try:
        w.store(K[:4], [0, 1, 2, 3])

        def broken(keys: Any, blocks: Any) -> Any:
            raise BackendError("lmdb: disk gone")

        w.stores[1].backends[1].write_blocks = broken
    finally:
        await w.close()  # never raises
    assert w.engines[0].counters["blocks_flushed_at_close"] == 4
    assert w.engines[1].counters["blocks_flushed_at_close"] == 0
    assert w.engines[1].counters["blocks_flush_failed_at_close"] == 4
    assert all(s._closed for s in w.stores)
    # A fresh engine adopts only what every rank holds: nothing; rank 0's copies are orphans.
    w = await open_world(2, [cpu(8, 2), lmdb(tmp_path)], write="back")
    try:
        assert w.adopted == 0 and sorted(w.orphans[1]) == sorted(K[:4])
    finally:
        await w.close()


async def test_the_listed_flush_keeps_to_its_byte_budget_newest_first(tmp_path: Path) -> None:
    w = await open_world(1, [cpu(8, 1), lmdb(tmp_path)], write="back")
    try:
        w.store(K[:4], [0, 1, 2, 3])
        w.workers[0]._transfers.close()
        backends = w.stores[0].backends
        report = await flush_listed_to_persistent(backends, budget_bytes=2 * BB)
        assert (report.flushed, report.left, report.stopped_by) == (2, 2, "bytes")
        assert {r.key for r in backends[1].scan()} == set(K[2:4])  # the two stored last
        again = await flush_listed_to_persistent(backends)
        assert (again.already_there, again.flushed) == (2, 2)
    finally:
        await w.close()
