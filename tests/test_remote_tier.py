"""The machinery every remote tier shares (backends/remote_tier.py, remote_health.py,
remote_secrets.py), through its default hooks, on a real private redis-server.

``PlainRedisTier`` is the smallest remote tier there is: redis-py's plain commands (a pipeline
of ``SET``, one ``MGET``, ``UNLINK``, ``SCAN``) behind the hooks a new tier implements. The
``redis`` tier overrides the share exchanges with its own wire code, so these tests are what
runs the base class's default paths (whole records fetched, then checked and decoded into the
caller's block) the way an object-store or memory-pool tier uses them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
import torch
from kvtier.backends.remote_health import BACKOFF_FIRST_S, Health
from kvtier.backends.remote_secrets import HIDDEN, read_secret
from kvtier.backends.remote_tier import RemoteRecordBackend
from redis_servers import RedisServer

from kvtier.backend import BlockFormat
from kvtier.errors import ConfigError
from kvtier.testing import BackendTests, make_key, random_block

BLOCK = 4096


class PlainRedisTier(RemoteRecordBackend):
    """A remote tier on redis-py's own commands: only the hooks, nothing of the redis tier."""

    name: ClassVar[str] = "plain-redis"
    down_errors: ClassVar[tuple[type[BaseException], ...]] = (redis.ConnectionError, redis.TimeoutError, OSError)
    refused_errors: ClassVar[tuple[type[BaseException], ...]] = (redis.RedisError,)

    def __init__(self, *, capacity: int | str, url: str, **options: Any) -> None:
        super().__init__(capacity=capacity, where=url, **options)
        self.url = url
        self._client: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "url": self.url}

    def _connect(self) -> None:
        if self._client is None:
            self._client = redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=1)

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()

    def _read_meta(self) -> bytes | None:
        self._connect()
        return self._client.get(self._meta_key)

    def _write_meta(self, value: bytes, only_new: bool) -> None:
        self._connect()
        self._client.set(self._meta_key, value, nx=only_new)

    def _put_records(self, route: Any, rkeys: list[bytes], records: list[tuple[bytes, Any]]) -> list[bool]:
        self._connect()
        pipe = self._client.pipeline(transaction=False)
        for rkey, (head, payload) in zip(rkeys, records):
            pipe.set(rkey, head + bytes(payload))
        return [bool(ok) for ok in pipe.execute()]

    def _get_records(self, route: Any, rkeys: list[bytes]) -> list[Any]:
        self._connect()
        return list(self._client.mget(rkeys))

    def _delete_records(self, route: Any, rkeys: list[bytes]) -> int:
        self._connect()
        return int(self._client.unlink(*rkeys))

    def _list_keys(self) -> Any:
        self._connect()
        return self._client.scan_iter(match=self._prefix_bytes + b"*", count=1000)

    def probe(self, timeout_s: float) -> str | None:
        try:
            redis.Redis.from_url(self.url, socket_timeout=timeout_s).ping()
        except redis.RedisError as exc:
            return f"{self.url}: {exc}"
        return None


def _prefix(path: Path) -> str:
    return "p" + hashlib.sha256(str(path).encode()).hexdigest()[:12]


class TestPlainRemoteConformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def make_backend(self, path: Path, capacity: int) -> PlainRedisTier:
        return PlainRedisTier(capacity=capacity, url=self.server.url, prefix=_prefix(path))


class TestPlainRemoteKeyedZstdConformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.server = redis_server
        monkeypatch.setenv("REMOTE_TEST_MAC", "a-fleet-wide-secret-of-32-bytes!")

    def make_backend(self, path: Path, capacity: int) -> PlainRedisTier:
        return PlainRedisTier(capacity=capacity, url=self.server.url, prefix=_prefix(path), codec="zstd", mac_key_env="REMOTE_TEST_MAC")


def _fmt() -> BlockFormat:
    return BlockFormat(block_bytes=BLOCK, dtype="bfloat16", namespace_digest=hashlib.sha256(b"remote-tier-tests").digest())


def _opened(url: str, prefix: str, **options: Any) -> PlainRedisTier:
    tier = PlainRedisTier(capacity=64 * BLOCK, url=url, prefix=prefix, sync_interval_s=3600, **options)
    asyncio.run(tier.open(_fmt()))
    return tier


def test_a_record_written_by_one_host_is_listed_and_served_to_another(redis_server: RedisServer) -> None:
    a, b = _opened(redis_server.url, "share"), _opened(redis_server.url, "share")
    try:
        keys = [make_key(i) for i in range(5)]
        blocks = [random_block(BLOCK, seed=i) for i in range(5)]
        assert all(s is not None for s in a.write_blocks(keys, blocks))
        assert {info.key for info in b.scan()} == set(keys)
        out = [torch.empty(BLOCK, dtype=torch.uint8) for _ in keys]
        assert b.read_blocks(keys, out) == [True] * 5
        assert all(torch.equal(o, blk) for o, blk in zip(out, blocks))
        assert b.stats()["up"] and b.stats()["index"]["interval_s"] == 3600
    finally:
        asyncio.run(a.aclose())
        asyncio.run(b.aclose())


def test_a_damaged_or_planted_record_is_a_miss_deleted_and_counted(redis_server: RedisServer) -> None:
    tier = _opened(redis_server.url, "damaged")
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = [make_key(i) for i in range(3)]
        tier.write_blocks(keys, [random_block(BLOCK, seed=i) for i in range(3)])
        rkey = tier.remote_key(keys[1])
        value = bytearray(client.get(rkey))
        value[-1] ^= 0xFF  # one flipped bit of payload
        client.set(rkey, bytes(value))
        out = [torch.empty(BLOCK, dtype=torch.uint8) for _ in keys]
        assert tier.read_blocks(keys, out) == [True, False, True]
        assert tier.counters.corrupt_records == 1 and tier.counters.deleted == 1
        assert client.exists(rkey) == 0
        client.set(tier.remote_key(keys[2]), b"not a record at all")
        assert tier.read_blocks(keys[2:], out[2:]) == [False]
        assert tier.counters.corrupt_records == 2
    finally:
        asyncio.run(tier.aclose())


def test_another_writers_format_is_a_miss_left_alone_and_not_offered_again(redis_server: RedisServer) -> None:
    keyed = _opened(redis_server.url, "foreign", mac_key="a-fleet-wide-secret-of-32-bytes!")
    plain = PlainRedisTier(capacity=64 * BLOCK, url=redis_server.url, prefix="foreign2", sync_interval_s=3600)
    asyncio.run(plain.open(_fmt()))
    try:
        key = make_key(7)
        keyed.write_blocks([key], [random_block(BLOCK, seed=7)])
        # the same record under the plain tier's prefix: keyed, so unsupported there
        client = redis.Redis.from_url(redis_server.url)
        client.set(plain.remote_key(key), client.get(keyed.remote_key(key)))
        assert plain.read_blocks([key], [torch.empty(BLOCK, dtype=torch.uint8)]) == [False]
        assert client.exists(plain.remote_key(key)) == 1  # theirs to keep
        assert key not in {info.key for info in plain.scan()}
        plain.write_blocks([key], [random_block(BLOCK, seed=8)])  # written by this tier: offered again
        assert key in {info.key for info in plain.scan()}
    finally:
        asyncio.run(keyed.aclose())
        asyncio.run(plain.aclose())


def test_a_dead_server_fails_fast_is_counted_and_recovers(own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    tier = _opened(own_redis_server.url, "dead")
    try:
        key, block = make_key(1), random_block(BLOCK, seed=1)
        assert tier.write_blocks([key], [block]) != [None]
        own_redis_server.kill()
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            assert tier.write_blocks([key], [block]) == [None]
        assert "plain-redis" in caplog.text and "unreachable" in caplog.text
        out = torch.empty(BLOCK, dtype=torch.uint8)
        assert tier.read_blocks([key], [out]) == [False]  # within the backoff: no network wait
        stats = tier.stats()
        assert not stats["up"] and stats["outages"] == 1 and stats["fast_failures"] >= 1
        assert tier._sweep() is None
        own_redis_server.start()
        tier._health._retry_at = 0.0  # the backoff ran out
        assert tier.write_blocks([key], [block]) != [None]
        assert tier.read_blocks([key], [out]) == [True] and torch.equal(out, block)
        assert tier.stats()["up"]
    finally:
        asyncio.run(tier.aclose())


def test_a_server_down_at_open_is_an_outage_not_an_error(tmp_path: Path, dead_port: int) -> None:
    tier = _opened(f"redis://127.0.0.1:{dead_port}/0", "nobody")
    try:
        assert not tier.stats()["up"]
        assert list(tier.scan()) == []
        assert tier.write_blocks([make_key(1)], [random_block(BLOCK, seed=1)]) == [None]
    finally:
        asyncio.run(tier.aclose())


def test_health_backs_off_doubling_and_an_outage_is_counted_once() -> None:
    health = Health("somewhere", kind="test")
    assert health.allow() and health.up
    health.failed(OSError("refused"))
    assert not health.up and not health.allow() and health.outages == 1
    first = health._retry_at
    health.failed(OSError("refused"))
    assert health.outages == 1 and health.connection_errors == 2
    assert health._retry_at - first >= BACKOFF_FIRST_S  # the second wait is twice the first
    assert health.succeeded() and health.up and not health.succeeded()


def test_a_secret_comes_one_way_only_and_never_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_SECRET", "s3cr3t-value")
    from_env = read_secret("password", None, "password_env", "KVTIER_TEST_SECRET")
    assert from_env.value == "s3cr3t-value" and from_env.describe() == {"password_env": "KVTIER_TEST_SECRET"}
    assert "s3cr3t" not in repr(from_env)
    inline = read_secret("password", "s3cr3t-value", "password_env", None)
    assert inline.describe() == {"password": HIDDEN} and "s3cr3t" not in repr(inline)
    with pytest.raises(ConfigError, match="password: give it one way only, got password and password_env"):
        read_secret("password", "x", "password_env", "KVTIER_TEST_SECRET")
    with pytest.raises(ConfigError, match="password: give it one way only, got password_env and url"):
        read_secret("password", None, "password_env", "KVTIER_TEST_SECRET", also={"url": "x"})
    with pytest.raises(ConfigError, match="password: secrets are not serialised"):
        read_secret("password", HIDDEN, "password_env", None)
    with pytest.raises(ConfigError, match="password_env: the environment variable 'KVTIER_NOT_SET' is not set"):
        read_secret("password", None, "password_env", "KVTIER_NOT_SET")
    monkeypatch.setenv("KVTIER_TEST_DEFAULT", "from-default")
    found = read_secret("access_key_id", None, "access_key_id_env", None, default_env="KVTIER_TEST_DEFAULT")
    assert found.value == "from-default" and found.describe() == {}
    assert read_secret("access_key_id", None, "access_key_id_env", None, default_env="KVTIER_NOT_SET").value is None
