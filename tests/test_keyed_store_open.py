"""A tier without the secret on a keyed store: refused at open with an error naming the key
setting, and the store's records left as they were (a local tier that opened would drop every
keyed record it read, since it can check none of them)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
import torch
from redis_servers import RedisServer

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ConfigError
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "keyed-open"})
SECRET = "fleet-secret-for-tests-0123456789"


def _tier(name: str, path: Path, **options: object) -> Backend:
    return registry.backends.get(name)(capacity=64 << 20, path=str(path), **options)


@pytest.mark.parametrize("name", ["lmdb", "file"])
def test_unkeyed_tier_is_refused_on_a_keyed_store_and_its_records_stay(name: str, tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(3)]
    data = [random_block(FMT.block_bytes, i) for i in range(3)]
    keyed = _tier(name, tmp_path, mac_key=SECRET)
    asyncio.run(keyed.open(FMT))
    try:
        assert None not in keyed.write_blocks(keys, data)
    finally:
        asyncio.run(keyed.aclose())
    plain = _tier(name, tmp_path)
    with pytest.raises(ConfigError, match=r"keyed with aes-gmac.*no mac_key.*mac_key_env"):
        asyncio.run(plain.open(FMT))
    asyncio.run(plain.aclose())
    keyed = _tier(name, tmp_path, mac_key=SECRET)
    asyncio.run(keyed.open(FMT))
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert keyed.read_blocks(keys, out) == [True, True, True]
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        assert keyed.stats()["deleted"] == 0
    finally:
        asyncio.run(keyed.aclose())


def _redis_tier(url: str, prefix: str, **options: object) -> Backend:
    backend = registry.backends.get("redis")(capacity=64 << 20, url=url, prefix=prefix, **options)
    asyncio.run(backend.open(FMT))
    return backend


def test_an_unkeyed_redis_tier_leaves_a_keyed_store_alone(redis_server: RedisServer) -> None:
    """On a shared server the tier is not refused (another engine's store never stops this one
    starting): it warns, serves nothing, writes nothing, and leaves the fleet's meta record."""
    prefix = "keyed-open"
    keyed = _redis_tier(redis_server.url, prefix, mac_key=SECRET)
    data = random_block(FMT.block_bytes, 1)
    try:
        assert keyed.write_blocks([make_key(1)], [data]) != [None]
    finally:
        asyncio.run(keyed.aclose())
    client = redis.Redis.from_url(redis_server.url)
    before = {k: client.dump(k) for k in client.keys(f"{prefix}:*")}
    with pytest.warns(RuntimeWarning, match="keyed store's meta record.*no mac_key"):
        plain = _redis_tier(redis_server.url, prefix)
    try:
        out = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        assert plain.read_blocks([make_key(1)], [out]) == [False]
        assert plain.write_blocks([make_key(2)], [data]) == [None]
    finally:
        asyncio.run(plain.aclose())
    assert {k: client.dump(k) for k in client.keys(f"{prefix}:*")} == before
    keyed = _redis_tier(redis_server.url, prefix, mac_key=SECRET)
    try:
        out = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        assert keyed.read_blocks([make_key(1)], [out]) == [True] and torch.equal(out, data)
        assert keyed.stats()["auth_failures"] == 0
    finally:
        asyncio.run(keyed.aclose())


@pytest.mark.parametrize("mac_key", [None, SECRET])
def test_a_meta_record_of_an_unknown_version_is_left_alone(redis_server: RedisServer, mac_key: str | None) -> None:
    """A meta record of a format this build does not read is another writer's: a warning, and
    the record stays (it was rewritten as if damaged)."""
    from kvtier.records.format import RecordMac, encode_meta

    prefix = f"newer-meta-{mac_key is not None}"
    options = {} if mac_key is None else {"mac_key": mac_key}
    asyncio.run(_redis_tier(redis_server.url, prefix, **options).aclose())
    client = redis.Redis.from_url(redis_server.url)
    (meta_key,) = client.keys(f"{prefix}:*:meta")
    body = bytearray(encode_meta(FMT))
    body[4] = 99  # the meta record's version
    newer = bytes(body) + (b"" if mac_key is None else RecordMac(mac_key).tag(b"kvtier-redis-meta", meta_key, bytes(body)))
    client.set(meta_key, newer)
    with pytest.warns(RuntimeWarning, match="meta record version 99 is not supported"):
        tier = _redis_tier(redis_server.url, prefix, **options)
    try:
        assert tier.write_blocks([make_key(3)], [random_block(FMT.block_bytes, 3)]) == [None]
    finally:
        asyncio.run(tier.aclose())
    assert client.get(meta_key) == newer
