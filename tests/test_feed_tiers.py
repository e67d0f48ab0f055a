"""Shared tiers followed live through their change feed: two stores (engines) on one shared
``file`` directory, and on one Redis server or cluster."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends.feed_follower import TierChange, TierFollower
from redis_servers import redis_clients

import kvtier
from kvtier.store import KVStore
from kvtier.testing import make_key

NUM_BLOCKS = 16
K = [make_key(i) for i in range(4096)]


def make_caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (NUM_BLOCKS, 2, 4, 64), generator=g, dtype=torch.uint8).view(torch.bfloat16) for _ in range(2)]


def block_bytes(caches: list[torch.Tensor]) -> int:
    return sum(c[0].numel() * c.element_size() for c in caches)


def rows(caches: list[torch.Tensor], i: int) -> list[torch.Tensor]:
    return [c[i].view(torch.uint8).clone() for c in caches]


def file_config(path: Path, caches: list[torch.Tensor], blocks: int = 64, **extra: Any) -> dict[str, Any]:
    tier = {"backend": "file", "path": str(path), "capacity": blocks * (block_bytes(caches) + 4096), "shared": True,
            "sync_mode": "fast", "sweep_interval_s": 3600, **extra}
    return {"tiers": [tier], "namespace": {"model_id": "feed-test"}}


async def until(what: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await what():
        assert time.monotonic() < deadline, "not within the time limit"
        await asyncio.sleep(0.01)


async def test_b_follows_what_a_stores_and_removes_in_a_shared_directory(tmp_path: Path) -> None:
    a_caches, b_caches = make_caches(1), make_caches(2)
    async with kvtier.open(file_config(tmp_path, b_caches), kv_caches=b_caches) as b:
        changes: list[TierChange] = []
        b.on_shared_change(changes.append)
        async with kvtier.open(file_config(tmp_path, a_caches), kv_caches=a_caches) as a:
            want = [rows(a_caches, i) for i in (3, 5)]
            assert await a.save(K[:2], [3, 5]) == 2
            await until(lambda: _looked(b, K[:2], 2))
            assert await b.load(K[:2], [0, 1]) == 2
            assert all(torch.equal(x, y) for x, y in zip(rows(b_caches, 0), want[0]))
            assert all(torch.equal(x, y) for x, y in zip(rows(b_caches, 1), want[1]))
            follow = b.stats()["backends"][0]["follow"]
            assert follow["adopted"] >= 2 and follow["shared_hits"] == 2 and follow["feed_entries"] >= 1
            assert [k for c in changes for k in c.adopted][:2] == K[:2]
            assert {(e.kind, e.key) for e in b.take_events()} >= {("stored", K[0]), ("stored", K[1])}
            # a removal (an operator's delete in A) reaches B through the feed
            await asyncio.to_thread(a.backends[0].delete_blocks, [K[0]])
            await until(lambda: _looked(b, K[:1], 0))
            assert ("removed", K[0]) in {(e.kind, e.key) for e in b.take_events()}
            # the lookups never touched the directory: they are the manager's
            assert b.stats()["backends"][0]["follow"]["index"]["sweeps"] == 0


async def _looked(store: KVStore, keys: list[bytes], want: int) -> bool:
    return await store.lookup(keys) == want


async def test_an_eviction_in_a_shared_tier_forgets_and_never_deletes(tmp_path: Path) -> None:
    caches = make_caches(3)
    cfg = file_config(tmp_path, caches, blocks=4)
    async with kvtier.open(cfg, kv_caches=caches) as a:
        for i in range(12):  # twice the tier's capacity: the oldest are evicted here
            assert await a.save(K[i : i + 1], [i]) == 1
        held = a.stats()["tiers"][0]["blocks"]
        assert held < 12 and await a.lookup(K[:1]) == 0
        assert a.stats()["transfers"]["shared_forgotten"] == 12 - held
        assert a.stats()["backends"][0]["used_bytes"] <= cfg["tiers"][0]["capacity"]
    records = list(tmp_path.rglob("*.kvb"))
    assert len(records) == 12  # every record stays for the other engines
    async with kvtier.open(cfg, kv_caches=caches) as again:  # a restart adopts what fits, deletes nothing
        assert again.stats()["tiers"][0]["blocks"] == held
    assert len(list(tmp_path.rglob("*.kvb"))) == 12


async def test_the_file_feed_carries_stores_across_two_processes(tmp_path: Path) -> None:
    caches = make_caches(4)
    async with kvtier.open(file_config(tmp_path, caches), kv_caches=caches) as b:
        child = textwrap.dedent(f"""
            import asyncio, sys, torch, kvtier
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from test_feed_tiers import make_caches, file_config, K
            from pathlib import Path
            async def main():
                caches = make_caches(5)
                async with kvtier.open(file_config(Path({str(tmp_path)!r}), caches), kv_caches=caches) as a:
                    assert await a.save(K[100:110], list(range(10))) == 10
            asyncio.run(main())
        """)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", child, stderr=subprocess.PIPE)
        _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        await until(lambda: _looked(b, K[100:110], 10))
        assert await b.load(K[100:110], list(range(10))) == 10
        want = make_caches(5)
        for i in range(10):
            assert all(torch.equal(x, y) for x, y in zip(rows(caches, i), rows(want, i)))


async def test_head_group_records_of_another_tp_size_are_adopted_live_once_every_group_is_in(tmp_path: Path) -> None:
    # B (TP=1) follows a shared directory; A (TP=2) stores a prompt rank by rank. B adopts the
    # blocks once both ranks' groups are in (not after rank 0's), and loads them byte-exact.
    from test_head_groups import PROMPT, TOKENS, config, full_cache, shard

    from kvtier.keys import block_keys
    from kvtier.records.head_groups import HeadGroups

    tier = {"backend": "file", "capacity": "32MiB", "path": str(tmp_path / "file"), "sync_mode": "fast", "shared": True,
            "sweep_interval_s": 3600}
    full = full_cache(7)
    b_caches = [torch.zeros_like(t) for t in full]
    async with kvtier.open(config(tier, 1, 0), kv_caches=b_caches) as b:
        changes: list[TierChange] = []
        b.on_shared_change(changes.append)
        keys = block_keys(PROMPT, block_size=TOKENS, namespace=b.namespace)
        for rank in range(2):
            groups = HeadGroups.for_rank(8, 2, rank, 1)
            async with kvtier.open(config(tier, 2, rank), kv_caches=shard(full, groups)) as a:
                assert await a.save(keys, [0, 1, 2, 3]) == 4
            if rank == 0:
                await asyncio.sleep(0.5)  # rank 0's groups alone: the blocks are not whole
                assert await b.lookup(keys) == 0
        await until(lambda: _looked(b, keys, 4))
        assert sorted(k for c in changes for k in c.adopted) == sorted(keys)  # block keys, not records
        assert await b.load(keys, [2, 3, 4, 5]) == 4
        for have, want in zip(b_caches, full):
            assert torch.equal(have[2:6], want[0:4])


# -- redis: a server and a cluster ----------------------------------------------------------------
def redis_config(url: str, prefix: str, caches: list[torch.Tensor], *, cluster: bool = False, **extra: Any) -> dict[str, Any]:
    tier = {"backend": "redis", "url": url, "cluster": cluster, "prefix": prefix, "capacity": 64 * (block_bytes(caches) + 256),
            "sync_interval_s": 3600, **extra}
    return {"tiers": [tier], "namespace": {"model_id": "feed-test"}}


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
async def test_redis_b_follows_what_a_stores_and_removes(cluster: bool, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    prefix = f"feed-two-{cluster}"
    a_caches, b_caches = make_caches(11), make_caches(12)
    async with kvtier.open(redis_config(server.url, prefix, b_caches, cluster=cluster), kv_caches=b_caches) as b:
        changes: list[TierChange] = []
        b.on_shared_change(changes.append)
        async with kvtier.open(redis_config(server.url, prefix, a_caches, cluster=cluster), kv_caches=a_caches) as a:
            want = [rows(a_caches, i) for i in range(4)]
            assert await a.save(K[:4], [0, 1, 2, 3]) == 4
            await until(lambda: _looked(b, K[:4], 4))
            assert await b.load(K[:4], [4, 5, 6, 7]) == 4
            for i in range(4):
                assert all(torch.equal(x, y) for x, y in zip(rows(b_caches, 4 + i), want[i]))
            follow = b.stats()["backends"][0]["follow"]
            assert follow["shared_hits"] == 4 and follow["feed_entries"] >= 1 and follow["index"]["sweeps"] == 0
            assert 0 <= follow["lag_s"]["p99"] < 5
            await asyncio.to_thread(a.backends[0].delete_blocks, K[:1])  # an operator's delete in A
            await until(lambda: _looked(b, K[:1], 0))
            assert [k for c in changes for k in c.removed] == [K[0]]


async def test_redis_a_feed_that_lost_entries_is_reconciled_by_the_sweep(redis_server: Any) -> None:
    import redis

    prefix = "feed-lost"
    caches = make_caches(13)
    async with kvtier.open(redis_config(redis_server.url, prefix, caches), kv_caches=caches) as b:
        cfg = redis_config(redis_server.url, prefix, caches)
        async with kvtier.open(cfg, kv_caches=caches) as a:
            assert await a.save(K[:1], [0]) == 1
            await until(lambda: _looked(b, K[:1], 1))
            quiet = {**cfg, "tiers": [{**cfg["tiers"][0], "feed": False}]}
            async with kvtier.open(quiet, kv_caches=caches) as old:  # a writer that publishes nothing
                assert await old.save(K[1:3], [1, 2]) == 2
            stream = a.backends[0].follower.feed.stream
            redis.Redis.from_url(redis_server.url).xtrim(stream, maxlen=0)  # the feed loses its entries
            assert await a.save(K[3:4], [3]) == 1
            await until(lambda: _looked(b, K[:4], 4))  # K[1:3] through the sweep the gap started
            follow = b.stats()["backends"][0]["follow"]
            assert follow["feed_gaps"] >= 1 and follow["index"]["sweeps"] >= 1


async def test_redis_a_dead_server_is_misses_without_waiting_and_following_resumes_after_restart(own_redis_server: Any) -> None:
    prefix = "feed-dead"
    a_caches, b_caches = make_caches(14), make_caches(15)
    async with kvtier.open(redis_config(own_redis_server.url, prefix, b_caches), kv_caches=b_caches) as b:
        async with kvtier.open(redis_config(own_redis_server.url, prefix, a_caches), kv_caches=a_caches) as a:
            assert await a.save(K[:2], [0, 1]) == 2
            await until(lambda: _looked(b, K[:2], 2))
            own_redis_server.kill()
            started = time.perf_counter()
            for _ in range(1000):  # the lookups are the manager's: no network, no waiting
                assert await b.lookup(K[:2]) == 2
            assert time.perf_counter() - started < 5
            assert await b.load(K[:2], [2, 3]) == 0  # a miss: the engine recomputes
            own_redis_server.start()  # empty: what it held is gone
            deadline = time.monotonic() + 30
            while await a.save(K[5:6], [5]) == 0:  # A's backoff runs out and it reconnects
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            await until(lambda: _looked(b, K[5:6], 1), 30.0)
            assert b.stats()["backends"][0]["follow"]["feed_failures"] >= 1


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
async def test_redis_a_store_closes_without_waiting_out_its_feed_read(
    cluster: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TierFollower, "wait_s_default", 30.0)  # each feed read blocks 30 s on the server
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    urls = [n.url for n in server.nodes] if cluster else [server.url]
    caches = make_caches(16)
    known = set(await asyncio.to_thread(redis_clients, urls))  # before the store connects
    store = await kvtier.open(redis_config(server.url, f"feed-close-{cluster}", caches, cluster=cluster), kv_caches=caches)
    ours: set[str] = set()
    try:
        assert store.backends[0].follower.wait_s == 30.0

        async def blocked() -> bool:  # the follower's read waits on the server
            found = await asyncio.to_thread(redis_clients, urls)
            ours.update(a for a, blocked in found.items() if blocked and a not in known)
            return bool(ours)

        await until(blocked)
    finally:
        started = time.monotonic()
        await store.aclose()
    assert time.monotonic() - started < 10.0  # a third of the read's block time: it was woken

    async def let_go() -> bool:  # the read's connection closed: the server let the read go
        return not ours & set(await asyncio.to_thread(redis_clients, urls))

    await until(let_go)


async def test_a_file_store_closes_without_waiting_out_its_feed_poll(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.backends import file_tier
    from kvtier.backends.file_feed import FileFeed

    monkeypatch.setattr(TierFollower, "wait_s_default", 30.0)
    monkeypatch.setattr(file_tier, "FileFeed", functools.partial(FileFeed, poll_s=30.0))  # one poll outlasts the guard
    caches = make_caches(17)
    store = await kvtier.open(file_config(tmp_path, caches), kv_caches=caches)
    follower = store.backends[0].follower
    assert follower.wait_s == 30.0 and follower.feed.poll_s == 30.0
    started = time.monotonic()
    await store.aclose()
    assert time.monotonic() - started < 10.0
