"""A redis tier put with one ``SET`` in flight on each of a few connections, each record
checksummed right before it goes out.

Against real private servers (tests/redis_servers.py): the order of checksums, sends and
replies on each connection, error replies in the middle of a put (``OOM`` under
``noeviction``), a job whose encoding fails half-way through, after some of its records went
out, and a pool with fewer connections to spare than a put would take.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis
import torch
from kvtier.backends.redis_tier import RedisBackend
from kvtier.backends.redis_wire import PUT_CONNECTIONS, Wire
from redis_servers import RedisServer, open_redis_tier

from kvtier.testing import make_key, random_block

BLOCK = 64 << 10


def _open(block: int = BLOCK, **options: Any) -> RedisBackend:
    backend: RedisBackend = open_redis_tier(b"redis-puts", block, **options)
    return backend


def _close(backend: RedisBackend) -> None:
    asyncio.run(backend.aclose())


class _Events:
    """What a put did, in order: ``("encode", position)``, ``("send", wire)`` and ``("reply", wire)``
    (``wire``: which connection, numbered as first seen)."""

    def __init__(self, backend: RedisBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, int]] = []
        self.keys: list[bytes] = []
        self.wires: dict[int, int] = {}
        encode, send, reply = backend._encode_one, Wire.send, Wire.reply

        def encode_one(key: bytes, block: torch.Tensor) -> tuple[bytes, Any]:
            self.log.append(("encode", self.keys.index(key)))
            return encode(key, block)

        def send_buffers(wire: Wire, buffers: Any) -> None:
            self.log.append(("send", self.wires.setdefault(id(wire), len(self.wires))))
            send(wire, buffers)

        def read_reply(wire: Wire) -> Any:
            got = reply(wire)
            self.log.append(("reply", self.wires.setdefault(id(wire), len(self.wires))))
            return got

        monkeypatch.setattr(backend, "_encode_one", encode_one)
        monkeypatch.setattr(Wire, "send", send_buffers)
        monkeypatch.setattr(Wire, "reply", read_reply)

    def per_wire(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for what, w in self.log:
            if what != "encode":
                out.setdefault(w, []).append(what)
        return out


@pytest.mark.parametrize("block", [BLOCK, 3 << 19], ids=["64KiB", "1.5MiB"])
def test_a_put_keeps_one_set_in_flight_on_each_connection(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    backend = _open(block, url=redis_server.url, prefix=f"puts-inflight-{block}", job_connections=1)
    try:
        n = 3 * PUT_CONNECTIONS + 1
        keys = [make_key(100 + i) for i in range(n)]
        data = [random_block(block, i) for i in range(n)]
        events = _Events(backend, monkeypatch)
        events.keys = keys
        sizes = backend.write_blocks(keys, data)
        assert sizes == [block + backend._head_bytes()] * n
        encoded = [i for what, i in events.log if what == "encode"]
        assert encoded == list(range(n))  # each record once, in order
        # Each record is encoded right before it is sent, and nothing else comes between.
        for k, (what, _) in enumerate(events.log):
            if what == "encode":
                assert events.log[k + 1][0] == "send"
        # PUT_CONNECTIONS connections, each alternating one send and its reply.
        wires = events.per_wire()
        assert len(wires) == PUT_CONNECTIONS
        for seq in wires.values():
            assert seq == ["send", "reply"] * (len(seq) // 2)
        # every SET's send and reply, and the key log's one APPEND after the last reply
        assert sum(len(seq) for seq in wires.values()) == 2 * n + 2
        # The first PUT_CONNECTIONS records go out before any reply is read.
        first_reply = next(k for k, (what, _) in enumerate(events.log) if what == "reply")
        assert [what for what, _ in events.log[:first_reply]] == ["encode", "send"] * PUT_CONNECTIONS
        out = [torch.zeros(block, dtype=torch.uint8) for _ in range(n)]
        assert backend.read_blocks(keys, out) == [True] * n
        assert all(torch.equal(a, b) for a, b in zip(out, data))
        # every connection came back with its replies read
        pool = backend._get_client().connection_pool
        assert sum(c._sock is not None for c in pool._available_connections) >= PUT_CONNECTIONS
    finally:
        _close(backend)


def test_a_small_put_runs_on_the_calling_thread(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(url=redis_server.url, prefix="puts-small", job_connections=4)
    try:
        n = 8  # 512 KiB: one share
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
        assert [i for what, i in events.log if what == "encode"] == list(range(n))
        assert threads == {threading.get_ident()}
    finally:
        _close(backend)


def test_a_put_makes_do_with_the_connections_the_pool_has_left(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(url=redis_server.url, prefix="puts-few", max_connections=8, job_connections=1)
    pool = backend._get_client().connection_pool
    held = [pool.get_connection() for _ in range(6)]  # two left of eight
    try:
        n = 16
        keys = [make_key(300 + i) for i in range(n)]
        data = [random_block(BLOCK, i) for i in range(n)]
        events = _Events(backend, monkeypatch)
        events.keys = keys
        assert backend.write_blocks(keys, data) == [BLOCK + backend._head_bytes()] * n
        assert len(events.per_wire()) == 2
        assert backend.stats()["up"] is True
        for conn in held:
            pool.release(conn)
        out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(n)]
        assert backend.read_blocks(keys, out) == [True] * n
        assert all(torch.equal(a, b) for a, b in zip(out, data))
    finally:
        _close(backend)


def test_oom_replies_in_the_middle_of_a_put_fail_only_their_records(own_redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(own_redis_server.url)
    backend = _open(url=own_redis_server.url, prefix="puts-oom", job_connections=1)
    try:
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", str(used + (2 << 20)))
        n = 96  # 6 MiB of records into 2 MiB of room: the later ones are refused
        keys = [make_key(700 + i) for i in range(n)]
        data = [random_block(BLOCK, i) for i in range(n)]
        sizes = backend.write_blocks(keys, data)
        stored = [i for i, s in enumerate(sizes) if s is not None]
        assert sizes[0] is not None and sizes[-1] is None  # the first records fit, the last do not
        stats = backend.stats()
        assert stats["write_failures"] == n - len(stored) and stats["blocks_written"] == len(stored)
        assert stats["up"] is True and stats["connection_errors"] == 0  # a refusal is not an outage
        # the connections came back with every reply read: the next exchange reuses them
        pool = backend._get_client().connection_pool
        assert len(pool._available_connections) == PUT_CONNECTIONS
        assert all(c._sock is not None for c in pool._available_connections)
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
        n = 64  # the first records are on the wire when record 40 fails to encode
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
        # replies to the records sent were never read: those connections are not handed out again
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
