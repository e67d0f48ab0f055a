"""The redis tier with one dead primary of a cluster, and credentials given in the URL query.

Against private servers (tests/redis_servers.py): a 3-primary cluster of the test's own, one
primary killed with SIGKILL; a standalone server that requires a password."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends.redis_tier import RedisBackend
from redis_servers import RedisClusterServers, RedisServer

from kvtier.backend import BlockFormat
from kvtier.testing import make_key, random_block

BLOCK = 4096


def _open(**options: Any) -> RedisBackend:
    options.setdefault("capacity", 256 * BLOCK)
    backend = RedisBackend(sync_interval_s=3600, **options)
    digest = hashlib.sha256(b"redis-cluster-faults").digest()
    asyncio.run(backend.open(BlockFormat(block_bytes=BLOCK, namespace_digest=digest)))
    return backend


def _port_of_key(backend: RedisBackend, key: bytes) -> int:
    client = backend._get_client()
    node = client.nodes_manager.get_node_from_slot(client.keyslot(backend._rkey(key)))
    return int(node.port)


def _keys_by_node(backend: RedisBackend, dead: int, n: int = 24) -> list[bytes]:
    """``n`` keys spread over the primaries, the first one on the ``dead`` port."""
    keys = [make_key(7000 + i) for i in range(n * 4)]
    on_dead = [k for k in keys if _port_of_key(backend, k) == dead]
    others = [k for k in keys if _port_of_key(backend, k) != dead]
    return [on_dead[0], *others[: n // 2], *on_dead[1 : n // 2]]


def test_one_dead_primary_misses_its_own_slots_only_and_a_read_ends_before_it_returns(
    own_redis_cluster: RedisClusterServers, tmp_path: Path
) -> None:
    backend = _open(url=own_redis_cluster.url, cluster=True, prefix="dead-primary")
    try:
        dead = own_redis_cluster.nodes[1]
        keys = _keys_by_node(backend, dead.port)
        data = [random_block(BLOCK, i) for i in range(len(keys))]
        assert all(s is not None for s in backend.write_blocks(keys, data))
        dead.kill()
        on_dead = [_port_of_key(backend, k) == dead.port for k in keys]

        # The live primaries' replies are held back until the dead one's share has failed:
        # the call must still wait for them before it returns.
        failed = threading.Event()
        ends: list[float] = []
        real: Callable[..., None] = backend._exchange_many

        def exchange(pool: Any, count: int, body: Any) -> None:
            if pool.connection_kwargs["port"] == dead.port:
                try:
                    real(pool, count, body)
                finally:
                    failed.set()
                return
            assert failed.wait(30)
            time.sleep(0.2)
            try:
                real(pool, count, body)
            finally:
                ends.append(time.monotonic())

        backend._exchange_many = exchange  # type: ignore[method-assign]
        out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        returned = time.monotonic()
        assert len(ends) == 2 and max(ends) <= returned, "a primary still wrote rows after read_blocks returned"
        assert found == [not d for d in on_dead]
        for ok, row, want in zip(found, out, data):
            if ok:
                assert torch.equal(row, want)
        backend._exchange_many = real  # type: ignore[method-assign]

        # Only the dead node is down: the others store and load, its keys fail at once.
        stats = backend.stats()
        assert stats["up"] and stats["nodes_down"] == 1
        fresh = [random_block(BLOCK, 100 + i) for i in range(len(keys))]
        sizes = backend.write_blocks(keys, fresh)
        assert [s is not None for s in sizes] == [not d for d in on_dead]
        assert backend.stats()["outages"] == 1 and backend.stats()["up"]  # one node's outage, not the tier's
        out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [not d for d in on_dead]
        assert all(torch.equal(r, w) for r, w, d in zip(out, fresh, on_dead) if not d)
    finally:
        asyncio.run(backend.aclose())


def test_a_password_in_the_url_query_authenticates_and_is_never_shown(
    own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "hunter2-in-the-query"
    server = own_redis_server
    server.cli("CONFIG", "SET", "requirepass", secret)
    try:
        url = f"redis://127.0.0.1:{server.port}/0?password={secret}&socket_keepalive=true"
        backend = _open(url=url, prefix="query-password")
        try:
            assert backend.url == f"redis://127.0.0.1:{server.port}/0?socket_keepalive=true"
            for text in (repr(backend), str(backend.to_dict()), str(backend.stats())):
                assert secret not in text
            key, block = make_key(1), random_block(BLOCK, 1)
            assert backend.write_blocks([key], [block]) == [BLOCK + backend._head_bytes()]
            out = torch.zeros(BLOCK, dtype=torch.uint8)
            assert backend.read_blocks([key], [out]) == [True] and torch.equal(out, block)
            with caplog.at_level(logging.WARNING, logger="kvtier"):
                server.kill()
                assert backend.write_blocks([key], [block]) == [None]
            assert "unreachable" in caplog.text and secret not in caplog.text
        finally:
            asyncio.run(backend.aclose())
    finally:
        server.stop()
    with pytest.raises(Exception, match="password"):
        RedisBackend(capacity="1MiB", url=f"redis://:{secret}@127.0.0.1:1/0?password=other")


async def test_a_save_across_a_dead_primary_counts_and_keeps_the_leading_run_only(
    own_redis_cluster: RedisClusterServers,
) -> None:
    """With one primary down, a save's keys on the live primaries are written and the dead
    one's fail. What ``save`` returns is what ``lookup`` and ``load`` then reach: the leading
    run up to the first failed block. Blocks written behind it are released (forgotten and
    deleted from the server), not counted."""
    import kvtier

    caches = [torch.randint(0, 256, (16, 1024), dtype=torch.uint8) for _ in range(2)]
    config = {
        "tiers": [
            {"backend": "redis", "cluster": True, "url": own_redis_cluster.url, "capacity": "1MiB", "prefix": "save-hole", "sync_interval_s": 3600}
        ]
    }
    async with kvtier.open(config, kv_caches=caches) as store:
        backend = store.backends[0]
        assert isinstance(backend, RedisBackend)
        dead = own_redis_cluster.nodes[1]
        pool = [make_key(9000 + i) for i in range(64)]
        on_dead = [k for k in pool if _port_of_key(backend, k) == dead.port]
        live = [k for k in pool if _port_of_key(backend, k) != dead.port]
        # Two blocks, then one on the dead primary, then five more on live ones.
        keys = [*live[:2], on_dead[0], *live[2:7]]
        dead.kill()
        saved = await store.save(keys, list(range(len(keys))))
        assert saved == 2
        assert await store.lookup(keys) == 2
        assert [s.state.value for s in await store.lookup_detail(keys)] == ["ready"] * 2 + ["miss"] * 6
        assert await store.load(keys, list(range(8, 16))) == 2
        assert all(torch.equal(c[8 + i], c[i]) for c in caches for i in range(2))
        client = backend._get_client()
        assert [client.exists(backend._rkey(k)) for k in keys[3:]] == [0] * 5  # deleted, not left behind
        assert store.stats()["store_completed"] >= 2
