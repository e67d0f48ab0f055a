"""The ``mooncake`` tier against a real private Mooncake Store: ``mooncake_master`` and a
standalone ``mooncake_client`` on loopback (tests/mooncake_servers.py). Without the Mooncake
wheel every test here is skipped with a loud reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mooncake_servers import MooncakeServers, open_mooncake_tier
from two_hosts import CPU_TIER, run_host

import kvtier
import kvtier.config
from kvtier.errors import ConfigError
from kvtier.records.codec import NoneCodec
from kvtier.records.format import encode_record
from kvtier.testing import BackendTests, make_key, random_block

BLOCK = 4096
MAC = "a-fleet-wide-secret-of-32-bytes!"


def _prefix(path: Path) -> str:
    return "t" + hashlib.sha256(str(path).encode()).hexdigest()[:12]


def _tier_class() -> Any:
    from kvtier.backends.mooncake_tier import MooncakeBackend

    return MooncakeBackend


class TestMooncakeConformance(BackendTests):
    @pytest.fixture(autouse=True)
    def _store(self, mooncake_store: MooncakeServers) -> None:
        self.servers = mooncake_store

    def make_backend(self, path: Path, capacity: int) -> Any:
        return _tier_class()(capacity=capacity, prefix=_prefix(path), **self.servers.tier_options())


class TestMooncakeMacZstdConformance(BackendTests):
    """Keyed records behind a compressing codec: every read goes the whole-record way."""

    @pytest.fixture(autouse=True)
    def _store(self, mooncake_store: MooncakeServers, monkeypatch: pytest.MonkeyPatch) -> None:
        self.servers = mooncake_store
        monkeypatch.setenv("MOONCAKE_TEST_MAC", MAC)

    def make_backend(self, path: Path, capacity: int) -> Any:
        options = self.servers.tier_options()
        return _tier_class()(capacity=capacity, prefix=_prefix(path), mac_key_env="MOONCAKE_TEST_MAC", codec="zstd", **options)


# -- helpers ------------------------------------------------------------------------------------

def opened(servers: MooncakeServers, path: Path, **options: Any) -> Any:
    options.setdefault("prefix", _prefix(path))
    return open_mooncake_tier(servers, b"mooncake-tests", BLOCK, **options)


def close(backend: Any) -> None:
    asyncio.run(backend.aclose())


def blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    return [random_block(BLOCK, seed * 1000 + i) for i in range(n)]


def empty(n: int) -> list[torch.Tensor]:
    return [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(n)]


def plant(backend: Any, key: bytes, record: bytes) -> None:
    """Store ``record`` under ``key``'s name as another writer would (upsert: replaces it)."""
    buf = np.frombuffer(record, dtype=np.uint8)
    assert backend.session.upsert([backend.remote_key(key).decode()], [buf.ctypes.data], [len(record)]) == [0]


# -- configuration ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"master": "no-port"}, "master"),
        ({"master": "host:99999"}, "master"),
        ({"protocol": "udp"}, "protocol"),
        ({"metadata_server": ""}, "metadata_server"),
        ({"local_hostname": ""}, "local_hostname"),
        ({"global_segment_size": -1}, "global_segment_size"),
        ({"local_buffer_size": "lots"}, "local_buffer_size"),
        ({"admin_url": "ftp://127.0.0.1:9003"}, "admin_url"),
        ({"replica_num": 0}, "replica_num"),
        ({"soft_pin_ttl_s": 0}, "soft_pin_ttl_s"),
        ({"device_name": 3}, "device_name"),
        ({"mac_key_env": "MOONCAKE_TEST_UNSET_VARIABLE"}, "mac_key_env"),
        ({"prefix": "has space"}, "prefix"),
    ],
)
def test_bad_options_name_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        _tier_class()(capacity="1MiB", **options)


def test_options_round_trip_and_defaults() -> None:
    backend = _tier_class()(capacity="1GiB", master="10.0.0.5:50051", global_segment_size="0", soft_pin_ttl_s=30, replica_num=2, mac_key=MAC)
    data = backend.to_dict()
    assert data["admin_url"] == "http://10.0.0.5:9003"  # the master's default admin port
    assert data["global_segment_size"] == 0 and data["replica_num"] == 2 and data["soft_pin_ttl_s"] == 30
    assert MAC not in str(data) and MAC not in repr(backend)
    with pytest.raises(ConfigError, match="mac_key"):
        _tier_class().from_dict(data)  # a hidden secret must be given again
    assert _tier_class().from_dict({**data, "mac_key": MAC}).to_dict() == data


def test_a_staging_too_small_for_one_record_is_refused_at_open(mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="local_buffer_size"):
        opened(mooncake_store, tmp_path, local_buffer_size=BLOCK)


def test_config_builds_the_tier_through_the_registry(mooncake_store: MooncakeServers) -> None:
    tier = {"backend": "mooncake", "capacity": "1MiB", **mooncake_store.tier_options()}
    cfg = kvtier.config.load_config({"block_bytes": BLOCK, "tiers": [tier]})
    backend = kvtier.config.build_backend(cfg.tiers[0], 0)
    assert type(backend).__name__ == "MooncakeBackend" and backend.master == mooncake_store.master


# -- records in a shared store ----------------------------------------------------------------------

def test_keys_carry_the_namespace_prefix(mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    backend = opened(mooncake_store, tmp_path)
    try:
        backend.write_blocks([make_key(1)], blocks(1))
        prefix = _prefix(tmp_path)
        digest = hashlib.sha256(b"mooncake-tests").digest()[:8].hex()
        ours = sorted(k for k in mooncake_store.keys() if k.startswith(prefix + ":"))
        assert ours == [f"{prefix}:{digest}:{make_key(1).hex()}", f"{prefix}:{digest}:meta"]
    finally:
        close(backend)


def test_forged_damaged_and_swapped_records_are_misses_and_deleted(mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    backend = opened(mooncake_store, tmp_path, mac_key=MAC)
    try:
        keys = [make_key(i) for i in range(4)]
        data = blocks(4)
        assert None not in backend.write_blocks(keys, data)
        # A forger without the secret writes a well-formed record with a valid plain checksum.
        head, payload = encode_record(keys[0], data[1].numpy().data, NoneCodec(), 1)
        plant(backend, keys[0], head + bytes(payload))
        # Bit rot: a keyed record of the right length with one payload byte flipped.
        good = bytearray(encode_record(keys[1], data[1].numpy().data, NoneCodec(), 1, backend.mac)[0] + bytes(data[1].numpy()))
        good[-1] ^= 0xFF
        plant(backend, keys[1], bytes(good))
        # Another key's valid record copied under this key (the MAC binds the key).
        right = encode_record(keys[3], data[3].numpy().data, NoneCodec(), 1, backend.mac)
        plant(backend, keys[2], right[0] + bytes(right[1]))
        out = empty(4)
        assert backend.read_blocks(keys, out) == [False, False, False, True]
        assert torch.equal(out[3], data[3])
        stats = backend.stats()
        assert stats["corrupt_records"] == 3 and stats["auth_failures"] == 3
        # Deleted at once, a reader's lease notwithstanding.
        assert backend.read_blocks(keys[:3], out[:3]) == [False] * 3
        assert backend.stats()["corrupt_records"] == 3  # gone: plain misses now
    finally:
        close(backend)


def test_junk_and_foreign_records_are_misses(mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    backend = opened(mooncake_store, tmp_path)
    try:
        keys = [make_key(i) for i in range(3)]
        assert None not in backend.write_blocks(keys, blocks(3))
        plant(backend, keys[0], b"not a record at all")  # shorter: read whole, refused
        plant(backend, keys[1], bytes(3 * BLOCK))  # longer than any record of this store
        out = empty(3)
        assert backend.read_blocks(keys, out) == [False, False, True]
        assert backend.stats()["odd_lengths"] == 1
    finally:
        close(backend)


def test_a_compressed_record_is_read_by_a_tier_without_the_codec(mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    writer = opened(mooncake_store, tmp_path, codec="zstd")
    reader = opened(mooncake_store, tmp_path)
    try:
        data = [torch.zeros(BLOCK, dtype=torch.uint8), random_block(BLOCK, 5)]  # one shrinks, one does not
        keys = [make_key(1), make_key(2)]
        sizes = writer.write_blocks(keys, data)
        assert sizes[0] is not None and sizes[0] < BLOCK  # compressed: another length than a raw record
        out = empty(2)
        assert reader.read_blocks(keys, out) == [True, True]
        assert torch.equal(out[0], data[0]) and torch.equal(out[1], data[1])
    finally:
        close(writer)
        close(reader)


def test_a_job_larger_than_the_staging_moves_in_chunks(mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    # 2 records' worth of staging each way; 9 records, and keyed: 64-byte heads.
    backend = opened(mooncake_store, tmp_path, local_buffer_size=4 * (BLOCK + 64), mac_key=MAC, codec="zstd")
    try:
        keys = [make_key(i) for i in range(9)]
        data = blocks(9)
        assert None not in backend.write_blocks(keys, data)
        out = empty(9)
        assert backend.read_blocks(keys, out) == [True] * 9
        assert all(torch.equal(o, d) for o, d in zip(out, data))
    finally:
        close(backend)


def test_the_index_follows_the_master(mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    class Target:
        def __init__(self) -> None:
            self.held: set[bytes] = set()

        def holds(self, key: bytes, tier: int) -> bool:
            return key in self.held

        def adopt(self, tier: int, records: Any) -> list[bytes]:
            self.held.update(k for k, _, _ in records)
            return []

        def remove(self, keys: list[bytes], tier: int) -> list[bytes]:
            self.held.difference_update(keys)
            return keys

        def ready_keys(self, tier: int) -> list[bytes]:
            return list(self.held)

    mine, other = opened(mooncake_store, tmp_path), opened(mooncake_store, tmp_path)
    try:
        target = Target()
        mine.view.bind(target, 0, start=False)
        other.write_blocks([make_key(1), make_key(2)], blocks(2))
        assert mine.view.sweep_once() == (2, 0)
        assert target.held == {make_key(1), make_key(2)}
        other.delete_blocks([make_key(1)])
        assert mine.view.sweep_once() == (0, 1)  # gone from the master: forgotten
        assert target.held == {make_key(2)}
    finally:
        close(mine)
        close(other)


# -- faults -------------------------------------------------------------------------------------------

class _CallsSeen:
    """A Mooncake client that notes the name of everything asked of it, then passes it on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.seen.append(name)
        return getattr(self.inner, name)


def test_a_killed_master_is_a_miss_then_the_tier_recovers(own_mooncake_store: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    servers = own_mooncake_store
    backend = opened(servers, tmp_path)
    try:
        keys = [make_key(i) for i in range(4)]
        assert None not in backend.write_blocks(keys, blocks(4))
        servers.kill_master()
        out = empty(4)
        assert backend.read_blocks(keys, out) == [False] * 4  # no exception: misses
        assert backend.write_blocks(keys, blocks(4)) == [None] * 4
        stats = backend.stats()
        assert stats["up"] is False and stats["outages"] == 1
        asked: list[bool] = []
        answers = backend.session.master_answers

        def ask(timeout_s: float) -> bool:
            asked.append(answers(timeout_s))
            return asked[-1]

        store = _CallsSeen(backend.session.store)
        monkeypatch.setattr(backend.session, "master_answers", ask)
        monkeypatch.setattr(backend.session, "store", store)
        backend._health._retry_at = 0.0  # the backoff ran out: the next call tries the master again
        assert backend.read_blocks(keys, out) == [False] * 4
        # A TCP connect refused, and no Mooncake call (one to a dead master waits about 4.3 s).
        assert asked == [False] and store.seen == []
        monkeypatch.undo()
        # The master comes back empty (its metadata was in memory); the client mounts again.
        servers.start_master()
        deadline = time.monotonic() + 60
        data = blocks(4, seed=7)
        while True:
            backend._health._retry_at = 0.0
            if None not in backend.write_blocks(keys, data):
                break
            assert time.monotonic() < deadline, f"never recovered: {backend.stats()}"
            time.sleep(0.2)
        assert backend.read_blocks(keys, out) == [True] * 4
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        assert backend.stats()["up"] is True
    finally:
        close(backend)


def test_a_dead_client_host_is_a_miss(own_mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    servers = own_mooncake_store
    backend = opened(servers, tmp_path)
    try:
        keys = [make_key(i) for i in range(4)]
        assert None not in backend.write_blocks(keys, blocks(4))
        servers.kill_client()  # the records lived in its segment
        out = empty(4)
        assert backend.read_blocks(keys, out) == [False] * 4
        deadline = time.monotonic() + 60
        while any(k.endswith(keys[0].hex()) for k in servers.keys()):  # the master drops them after client_ttl
            assert time.monotonic() < deadline, "the master never dropped the dead client's objects"
            time.sleep(0.2)
        assert backend.read_blocks(keys, out) == [False] * 4
        assert backend.write_blocks(keys, blocks(4)) == [None] * 4  # no segment left: a full store
        assert backend.stats()["up"] is True  # the master is fine
    finally:
        close(backend)


# -- two hosts, for real: separate processes -----------------------------------------------------------

def test_two_processes_share_blocks_that_outlive_the_writer(mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    tiers = [CPU_TIER, {"backend": "mooncake", "capacity": "8MiB", **mooncake_store.tier_options(), "prefix": _prefix(tmp_path)}]
    assert run_host("A", tiers) == {"saved": 12}  # the writer has exited when the reader starts
    assert run_host("B", tiers) == {"hits": 12, "loaded": 12, "byte_exact": True}


def test_large_blocks_go_as_head_and_row_slices_and_odd_records_are_read_whole(mooncake_store: MooncakeServers, tmp_path: Path) -> None:
    from kvtier.backends.mooncake_tier import ZERO_COPY_MIN_BYTES

    big = ZERO_COPY_MIN_BYTES
    writer = open_mooncake_tier(mooncake_store, b"big", big, prefix=_prefix(tmp_path), codec="zstd")
    backend = open_mooncake_tier(mooncake_store, b"big", big, prefix=_prefix(tmp_path))
    try:
        keys = [make_key(i) for i in range(5)]
        data = [random_block(big, i) for i in range(5)]
        data[4] = torch.zeros(big, dtype=torch.uint8)
        assert backend.write_blocks(keys[:4], data[:4]) == [big + 32] * 4  # head and row: no copy
        assert writer.write_blocks(keys[4:], data[4:])[0] < big  # compressed: another length
        plant(backend, keys[3], b"junk")
        out = [torch.zeros(big, dtype=torch.uint8) for _ in range(5)]
        assert backend.read_blocks(keys, out) == [True, True, True, False, True]
        assert all(torch.equal(out[i], data[i]) for i in (0, 1, 2, 4))
        assert backend.stats()["corrupt_records"] == 1  # the junk, read whole and refused
    finally:
        close(writer)
        close(backend)


@pytest.mark.parametrize("given", [None, "INFO"])
def test_mooncake_logs_errors_only_unless_the_operator_set_a_level(
    mooncake_store: MooncakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str | None
) -> None:
    if given is None:
        monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("MC_LOG_LEVEL", given)
    close(opened(mooncake_store, tmp_path))
    assert os.environ["MC_LOG_LEVEL"] == (given or "ERROR")


def test_probe_says_whether_the_master_and_its_admin_port_answer(mooncake_store: MooncakeServers, dead_port: int) -> None:
    options = mooncake_store.tier_options()
    assert _tier_class()(capacity="1MiB", **options).probe(2.0) is None
    dead = _tier_class()(capacity="1MiB", **{**options, "master": f"127.0.0.1:{dead_port}"})
    assert "does not accept connections" in str(dead.probe(0.5))
    no_admin = _tier_class()(capacity="1MiB", **{**options, "admin_url": f"http://127.0.0.1:{dead_port}"})
    assert "admin_url" in str(no_admin.probe(0.5))


def test_a_dead_admin_port_skips_sweeps_and_the_tier_stays_up(
    mooncake_store: MooncakeServers, tmp_path: Path, caplog: pytest.LogCaptureFixture, dead_port: int
) -> None:
    backend = opened(mooncake_store, tmp_path, admin_url=f"http://127.0.0.1:{dead_port}")
    try:
        assert backend.view.sweep_once() is None and backend.view.sweep_once() is None
        assert sum("admin_url" in r.getMessage() for r in caplog.records) == 1  # one warning, not one per sweep
        assert backend.stats()["up"] is True
        assert None not in backend.write_blocks([make_key(1)], blocks(1))  # the data path is fine
    finally:
        close(backend)
