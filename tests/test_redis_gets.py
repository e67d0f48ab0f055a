"""A redis tier get of large records, striped over a few connections and received in order.

Against real private servers (tests/redis_servers.py): which connection each reply is read
from, small records staying on one connection, and misses, a value that is not a record and a
damaged record in the middle of a striped read, compared with the same read on one connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import torch
from kvtier.backends import redis_tier
from kvtier.backends.redis_tier import RedisBackend
from kvtier.backends.redis_wire import PUT_CONNECTIONS, Wire
from redis_servers import RedisServer, open_redis_tier

from kvtier.testing import make_key, random_block

LARGE = 512 << 10  # striped: at least redis_tier._STRIPE_MIN_BYTES
SMALL = 64 << 10


def _open(block: int, **options: Any) -> RedisBackend:
    backend: RedisBackend = open_redis_tier(b"redis-gets", block, job_connections=1, **options)
    return backend


def _wires_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The connection (numbered as first seen) each reply's length was read from, in order."""
    seen: dict[int, int] = {}
    order: list[int] = []
    length = Wire.bulk_length

    def bulk_length(wire: Wire) -> int:
        order.append(seen.setdefault(id(wire), len(seen)))
        return length(wire)

    monkeypatch.setattr(Wire, "bulk_length", bulk_length)
    return order


def _clean_connections(backend: RedisBackend) -> int:
    pool = backend._get_client().connection_pool
    return sum(c._sock is not None for c in pool._available_connections)


@pytest.mark.parametrize("block, stripes", [(LARGE, PUT_CONNECTIONS), (SMALL, 1)], ids=["512KiB", "64KiB"])
def test_large_records_are_read_striped_in_order_and_small_ones_on_one_connection(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, block: int, stripes: int
) -> None:
    backend = _open(block, url=redis_server.url, prefix=f"gets-striped-{block}")
    try:
        n = 3 * PUT_CONNECTIONS + 2
        keys = [make_key(i) for i in range(n)]
        data = [random_block(block, i) for i in range(n)]
        assert all(s is not None for s in backend.write_blocks(keys, data))
        order = _wires_read(monkeypatch)
        out = [torch.zeros(block, dtype=torch.uint8) for _ in range(n)]
        assert backend.read_blocks(keys, out) == [True] * n
        assert all(torch.equal(a, b) for a, b in zip(out, data))
        assert order == [j % stripes for j in range(n)]  # record j from connection j % stripes
        assert _clean_connections(backend) >= stripes  # every connection back with its replies read
    finally:
        asyncio.run(backend.aclose())


def test_a_striped_read_with_misses_and_bad_records_matches_a_read_on_one_connection(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Absent keys, a key holding a list (``WRONGTYPE``) and a damaged record, spread over the
    stripes: each is a miss for its key alone, the rest are the bytes stored, the damaged one is
    deleted, and the connections stay usable. The same read on one connection (the general
    path) finds the same."""
    backend = _open(LARGE, url=redis_server.url, prefix="gets-faults")
    client = redis.Redis.from_url(redis_server.url)
    try:
        n = 11
        keys = [make_key(50 + i) for i in range(n)]
        data = [random_block(LARGE, 7 + i) for i in range(n)]
        stored = [i for i in range(n) if i not in (1, 6)]  # 1 and 6 absent
        assert all(s is not None for s in backend.write_blocks([keys[i] for i in stored], [data[i] for i in stored]))
        client.delete(backend._rkey(keys[4]))
        client.rpush(backend._rkey(keys[4]), b"not a record")  # a GET of it is refused: WRONGTYPE
        damaged = backend._rkey(keys[9])
        value = bytearray(client.get(damaged) or b"")
        value[len(value) // 2] ^= 0x40
        client.set(damaged, bytes(value))
        want = [i in stored and i not in (4, 9) for i in range(n)]

        order = _wires_read(monkeypatch)
        out = [torch.zeros(LARGE, dtype=torch.uint8) for _ in range(n)]
        assert backend.read_blocks(keys, out) == want
        assert order == [j % PUT_CONNECTIONS for j in range(n)]
        assert all(torch.equal(out[i], data[i]) for i in range(n) if want[i])
        assert backend.stats()["corrupt_records"] == 1 and not client.exists(damaged)

        monkeypatch.setattr(redis_tier, "_STRIPE_MIN_BYTES", 1 << 40)  # the general path
        order.clear()
        again = [torch.zeros(LARGE, dtype=torch.uint8) for _ in range(n)]
        assert backend.read_blocks(keys, again) == want
        assert len(order) == n and len(set(order)) == 1  # one connection
        assert all(torch.equal(again[i], data[i]) for i in range(n) if want[i])
    finally:
        client.close()
        asyncio.run(backend.aclose())
