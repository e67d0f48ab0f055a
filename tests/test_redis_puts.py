"""A redis tier put streamed out batch by batch, each record checksummed right before its batch.

Against real private servers (tests/redis_servers.py): the order of checksums and sends, error
replies in the middle of a stream (``OOM`` under ``noeviction``), and a job whose encoding fails
half-way through, after some of its batches went out.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis
import torch
from kvtier.backends.redis_tier import RedisBackend
from kvtier.backends.redis_wire import SEND_BATCH_BYTES, Wire
from redis_servers import RedisServer, open_redis_tier

from kvtier.testing import make_key, random_block

BLOCK = 64 << 10


def _open(block: int = BLOCK, **options: Any) -> RedisBackend:
    backend: RedisBackend = open_redis_tier(b"redis-puts", block, **options)
    return backend


def _close(backend: RedisBackend) -> None:
    asyncio.run(backend.aclose())


class _Events:
    """What a put did, in order: ``("encode", position)`` and ``("send", bytes)``."""

    def __init__(self, backend: RedisBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, int]] = []
        self.keys: list[bytes] = []
        encode, send = backend._encode_one, Wire.send

        def encode_one(key: bytes, block: torch.Tensor) -> tuple[bytes, Any]:
            self.log.append(("encode", self.keys.index(key)))
            return encode(key, block)

        def send_buffers(wire: Wire, buffers: Any) -> None:
            self.log.append(("send", sum(memoryview(b).nbytes for b in buffers)))
            send(wire, buffers)

        monkeypatch.setattr(backend, "_encode_one", encode_one)
        monkeypatch.setattr(Wire, "send", send_buffers)


@pytest.mark.parametrize("block", [BLOCK, 3 * SEND_BATCH_BYTES // 2], ids=["64KiB", "1.5MiB"])
def test_a_put_sends_each_batch_right_after_checksumming_it(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    backend = _open(block, url=redis_server.url, prefix=f"puts-stream-{block}", job_connections=1)
    try:
        n = max(4, 4 * SEND_BATCH_BYTES // block)
        keys = [make_key(100 + i) for i in range(n)]
        data = [random_block(block, i) for i in range(n)]
        events = _Events(backend, monkeypatch)
        events.keys = keys
        sizes = backend.write_blocks(keys, data)
        assert sizes == [block + backend._head_bytes()] * n
        encoded = [i for what, i in events.log if what == "encode"]
        assert encoded == list(range(n))  # each record once, in order
        # Sends alternate with checksums: each batch goes out once its records are encoded,
        # before the next record is, and holds about SEND_BATCH_BYTES (a larger record alone).
        per_batch = max(1, -(-SEND_BATCH_BYTES // (block + backend._head_bytes())))
        sends = [k for k, (what, _) in enumerate(events.log) if what == "send"]
        assert len(sends) == -(-n // per_batch)
        for j, at in enumerate(sends):
            assert [i for what, i in events.log[:at] if what == "encode"] == list(range(min(n, (j + 1) * per_batch)))
            assert events.log[at][1] >= min(SEND_BATCH_BYTES, (n - j * per_batch) * block)
            assert events.log[at][1] < SEND_BATCH_BYTES + block + 4096
        out = [torch.zeros(block, dtype=torch.uint8) for _ in range(n)]
        assert backend.read_blocks(keys, out) == [True] * n
        assert all(torch.equal(a, b) for a, b in zip(out, data))
    finally:
        _close(backend)


def test_a_small_put_is_one_send_on_the_calling_thread(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(url=redis_server.url, prefix="puts-small", job_connections=4)
    try:
        n = 8  # 512 KiB: one batch, one share
        keys = [make_key(i) for i in range(n)]
        events = _Events(backend, monkeypatch)
        events.keys = keys
        threads: set[int] = set()
        send = Wire.send

        def send_here(wire: Wire, buffers: Any) -> None:
            threads.add(threading.get_ident())
            send(wire, buffers)

        monkeypatch.setattr(Wire, "send", send_here)
        assert all(s is not None for s in backend.write_blocks(keys, [random_block(BLOCK, i) for i in range(n)]))
        assert [what for what, _ in events.log] == ["encode"] * n + ["send"]
        assert threads == {threading.get_ident()}
    finally:
        _close(backend)


def test_oom_replies_in_the_middle_of_a_stream_fail_only_their_records(own_redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(own_redis_server.url)
    backend = _open(url=own_redis_server.url, prefix="puts-oom", job_connections=1)
    try:
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", str(used + 2 * SEND_BATCH_BYTES))
        n = 96  # 6 MiB of records into 2 MiB of room: the later batches are refused
        keys = [make_key(700 + i) for i in range(n)]
        data = [random_block(BLOCK, i) for i in range(n)]
        sizes = backend.write_blocks(keys, data)
        stored = [i for i, s in enumerate(sizes) if s is not None]
        assert sizes[0] is not None and sizes[-1] is None  # the first batch fits, the last does not
        stats = backend.stats()
        assert stats["write_failures"] == n - len(stored) and stats["blocks_written"] == len(stored)
        assert stats["up"] is True and stats["connection_errors"] == 0  # a refusal is not an outage
        # the connection came back with every reply read: the next exchange reuses it
        pool = backend._get_client().connection_pool
        assert len(pool._available_connections) == 1 and pool._available_connections[0]._sock is not None
        out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(n)]
        assert backend.read_blocks(keys, out) == [s is not None for s in sizes]
        assert all(torch.equal(out[i], data[i]) for i in stored)
    finally:
        _close(backend)
        client.close()


def test_an_encoding_failure_half_way_drops_the_connection_and_the_next_job_is_clean(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _open(url=redis_server.url, prefix="puts-broken", job_connections=1)
    try:
        n = 64  # 4 MiB: the first batches are on the wire when record 40 fails to encode
        keys = [make_key(900 + i) for i in range(n)]
        data = [random_block(BLOCK, i) for i in range(n)]
        encode = backend._encode_one

        def broken(key: bytes, block: torch.Tensor) -> tuple[bytes, Any]:
            if key == keys[40]:
                raise RuntimeError("the codec broke")
            return encode(key, block)

        monkeypatch.setattr(backend, "_encode_one", broken)
        with pytest.raises(RuntimeError, match="the codec broke"):
            backend.write_blocks(keys, data)
        # replies to the batches sent were never read: that connection is not handed out again
        pool = backend._get_client().connection_pool
        assert all(c._sock is None for c in pool._available_connections)
        assert backend.stats()["up"] is True
        monkeypatch.setattr(backend, "_encode_one", encode)
        assert backend.write_blocks(keys, data) == [BLOCK + backend._head_bytes()] * n
        out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(n)]
        assert backend.read_blocks(keys, out) == [True] * n
        assert all(torch.equal(a, b) for a, b in zip(out, data))
    finally:
        _close(backend)
