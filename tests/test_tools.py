"""``kvtier.tools`` in-process: inspect / verify over lmdb and file tiers, through the backends'
public offline classmethods only (read-only, nothing created, nothing swept)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ConfigError
from kvtier.records.format import HEADER_SIZE
from kvtier.testing import make_key, random_block
from kvtier.tools import detect_tier, inspect_tier, verify_tier

BLOCK = 4096
FMT = BlockFormat(block_bytes=BLOCK, dtype="bfloat16", namespace_digest=b"\2" * 32, namespace={"model_id": "tools-test"})
KINDS = ("lmdb", "file")


def _backend(kind: str, path: Path, **options: object) -> Backend:
    if kind not in registry.backends.names():
        pytest.skip(f"the {kind} backend is not registered in this checkout")
    return registry.backends.get(kind)(capacity="16MiB", path=str(path), sync_mode="fast", **options)


def _fill(kind: str, path: Path, n: int, **options: object) -> list[torch.Tensor]:
    backend = _backend(kind, path, **options)
    blocks = [random_block(BLOCK, i) for i in range(n)]

    async def run() -> None:
        await backend.open(FMT)
        sizes = await backend.write([make_key(i) for i in range(n)], blocks)
        assert all(s is not None for s in sizes)
        await backend.aclose()

    asyncio.run(run())
    return blocks


def _read(kind: str, path: Path, keys: list[bytes]) -> tuple[list[bool], list[torch.Tensor]]:
    backend = _backend(kind, path)
    out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in keys]

    async def run() -> list[bool]:
        await backend.open(FMT)
        try:
            return await backend.read(keys, out)
        finally:
            await backend.aclose()

    return asyncio.run(run()), out


def _record_file(root: Path, key: bytes) -> Path:
    """``key``'s record in a file tier, in whichever layout the tier has."""
    h = key.hex()
    flat = root / f"{h}.kvb"
    return flat if flat.exists() else root / h[:2] / h[2:4] / f"{h}.kvb"


def _flip_payload_byte(kind: str, path: Path, key: bytes) -> None:
    """Flip the last payload byte of ``key``'s record on disk, behind the backend's back."""
    if kind == "file":
        record = _record_file(path, key)
        data = bytearray(record.read_bytes())
        data[-1] ^= 0xFF
        record.write_bytes(bytes(data))
        return
    import lmdb

    env = lmdb.open(str(path), max_dbs=3, subdir=True)
    db = env.open_db(b"blocks")
    with env.begin(write=True, db=db) as txn:
        value = txn.get(key)
        assert value is not None
        data = bytearray(value)
        data[-1] ^= 0xFF
        txn.put(key, bytes(data))
    env.close()


def _listing(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_reports_blocks_bytes_and_namespace(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "tier"
    _fill(kind, path, 5, codec="zstd-shuffle")
    assert detect_tier(path) == kind
    calls: list[tuple[int, int]] = []
    report = inspect_tier(path, progress=lambda done, total: calls.append((done, total)))
    assert report.kind == kind and report.path == str(path)
    assert report.blocks == 5 and report.unreadable == 0
    assert report.block_bytes == BLOCK and report.dtype == "bfloat16" and report.format_version == 1
    assert report.raw_bytes == 5 * BLOCK
    assert sum(report.codecs.values()) == 5 and report.record_versions == {"1": 5}
    assert report.codec_ratio is not None and report.codec_ratio > 1.0
    (ns,) = report.namespaces
    assert ns["model_id"] == "tools-test" and ns["digest"] == (b"\2" * 32).hex()
    assert calls[-1] == (5, 5) and [d for d, _ in calls] == [1, 2, 3, 4, 5]
    data = report.to_dict()
    assert set(data) == {
        "path", "kind", "format_version", "block_bytes", "dtype", "namespaces", "blocks", "stored_bytes",
        "raw_bytes", "unreadable", "codecs", "record_versions", "codec_ratio", "tenants",
    }
    # no tenant tags saved: every record is the default tenant's
    assert data["tenants"] == {"default": {"blocks": 5, "bytes": report.stored_bytes, "pinned": 0}}


def test_inspect_counts_the_bytes_of_file_records(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    _fill("file", path, 3)
    report = inspect_tier(path)
    files = sorted(path.rglob("*.kvb"))
    assert len(files) == 3
    assert report.stored_bytes == sum(f.stat().st_size for f in files) == 3 * (HEADER_SIZE + BLOCK)
    assert report.codecs == {"none": 3} and report.codec_ratio is not None and report.codec_ratio < 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_verify_finds_and_deletes_a_flipped_payload_byte(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "tier"
    blocks = _fill(kind, path, 6)
    keys = [make_key(i) for i in range(6)]
    clean = verify_tier(path)
    assert clean.ok and clean.checked == 6 and clean.kind == kind
    _flip_payload_byte(kind, path, keys[2])

    report = verify_tier(path)
    assert not report.ok and report.checked == 6 and report.deleted == 0
    assert [b["key"] for b in report.bad] == [keys[2].hex()] and "checksum" in report.bad[0]["reason"]
    assert inspect_tier(path).blocks == 6  # the header is intact; inspect does not read payloads

    report = verify_tier(path, delete=True)
    assert [b["key"] for b in report.bad] == [keys[2].hex()] and report.deleted == 1
    again = verify_tier(path)
    assert again.ok and again.checked == 5 and again.to_dict()["ok"] is True

    good = [k for k in keys if k != keys[2]]
    found, out = _read(kind, path, good)
    assert found == [True] * 5
    assert all(torch.equal(o, blocks[keys.index(k)]) for k, o in zip(good, out))
    assert _read(kind, path, [keys[2]])[0] == [False]


def test_verify_delete_keeps_the_lmdb_index_consistent(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    _fill("lmdb", path, 4)
    _flip_payload_byte("lmdb", path, make_key(1))
    assert verify_tier(path, delete=True).deleted == 1
    backend = _backend("lmdb", path)

    async def listed() -> set[bytes]:
        await backend.open(FMT)
        try:
            return {r.key for r in backend.scan()}
        finally:
            await backend.aclose()

    assert asyncio.run(listed()) == {make_key(i) for i in (0, 2, 3)}


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_verify_reports_truncated_and_foreign_layout_files(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "tier"
    _fill("file", path, 3, layout=layout)
    record = _record_file(path, make_key(0))
    record.write_bytes(record.read_bytes()[:100])
    # names the tier would never write are not records, and are left alone
    (path / "notes.txt").write_text("hello")
    (record.parent / "not-hex.kvb").write_bytes(b"x")
    link = record.parent / f"{make_key(0).hex()[:4]}{'f' * 60}.kvb"  # a record's name, but a symlink
    os.symlink(_record_file(path, make_key(1)), link)

    report = verify_tier(path, delete=True)
    assert report.checked == 3 and [b["key"] for b in report.bad] == [make_key(0).hex()] and report.deleted == 1
    assert "bytes" in report.bad[0]["reason"]
    assert (path / "notes.txt").exists() and (record.parent / "not-hex.kvb").exists() and link.is_symlink()
    assert verify_tier(path).ok


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_and_verify_change_nothing_on_disk(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "tier"
    _fill(kind, path, 3)
    if kind == "file":  # an old temp file the backend would sweep at open
        stale = path / "ab" / "cd" / f"{'ab' + 'cd' + '0' * 60}.kvb.1.0.tmp"
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_bytes(b"partial")
        os.utime(stale, (time.time() - 3600, time.time() - 3600))
    else:  # without a lock file, the environment is opened with lock=False and none is created
        (path / "lock.mdb").unlink()
    before = _listing(path)
    inspect_tier(path)
    assert verify_tier(path).ok
    assert _listing(path) == before


def test_a_directory_that_is_not_a_tier_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("not a tier")
    (tmp_path / "ab" / "cd").mkdir(parents=True)
    before = _listing(tmp_path)
    for call in (detect_tier, inspect_tier, verify_tier):
        with pytest.raises(ConfigError, match="not a kvtier tier directory") as info:
            call(tmp_path)
        assert "data.mdb" in str(info.value) and "kvtier-meta.kvm" in str(info.value)
    with pytest.raises(ConfigError, match="no such directory"):
        inspect_tier(tmp_path / "missing")
    with pytest.raises(ConfigError, match="no such directory"):
        inspect_tier(tmp_path / "readme.txt")
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("kind", KINDS)
def test_offline_classmethods_refuse_other_directories_without_creating_files(kind: str, tmp_path: Path) -> None:
    cls = registry.backends.get(kind)
    assert not cls.is_store_dir(tmp_path)
    for call in (cls.read_store_meta, cls.count_raw_records, lambda p: list(cls.iter_raw_records(p))):
        with pytest.raises(ConfigError):
            call(tmp_path)
    with pytest.raises(ConfigError):
        cls.delete_raw_records(tmp_path, [make_key(0)])
    assert list(tmp_path.iterdir()) == []


def test_an_lmdb_environment_of_another_program_is_refused(tmp_path: Path) -> None:
    import lmdb

    env = lmdb.open(str(tmp_path), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    with pytest.raises(ConfigError, match="not a kvtier tier"):
        inspect_tier(tmp_path)


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_offline_classmethods_match_the_backend(tmp_path: Path, layout: str) -> None:
    for kind in KINDS:
        path = tmp_path / kind
        _fill(kind, path, 4, **({"layout": layout} if kind == "file" else {}))
        cls = registry.backends.get(kind)
        meta = cls.read_store_meta(path)
        assert meta is not None and meta.block_bytes == BLOCK and meta.namespace == {"model_id": "tools-test"}
        assert cls.count_raw_records(path) == 4
        records = dict(cls.iter_raw_records(path))
        assert set(records) == {make_key(i) for i in range(4)}
        assert all(len(r) == HEADER_SIZE + BLOCK for r in records.values())
        assert cls.delete_raw_records(path, [make_key(0), make_key(0), make_key(99)]) == 1
        assert cls.count_raw_records(path) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_verify_checks_keyed_records_with_the_secret(kind: str, tmp_path: Path) -> None:
    from kvtier.records.format import RecordMac

    secret = "tools-test-secret-0123456789"
    _fill(kind, tmp_path / kind, 3, mac_key=secret)
    inspected = inspect_tier(tmp_path / kind)
    with_mac = verify_tier(tmp_path / kind, mac=RecordMac(secret))
    without = verify_tier(tmp_path / kind)
    other = verify_tier(tmp_path / kind, mac=RecordMac("another-secret-0123456789"))
    print(f"{kind}: inspect {inspected.blocks} blocks ({inspected.unreadable} unreadable); verify keyed "
          f"{len(with_mac.bad)} bad, unkeyed {len(without.bad)} bad, other secret {len(other.bad)} bad")
    assert inspected.blocks == 3 and inspected.unreadable == 0
    assert with_mac.ok and with_mac.checked == 3
    assert len(without.bad) == 3 and all("unsupported" in b["reason"] for b in without.bad)
    assert len(other.bad) == 3 and all("MAC" in b["reason"] for b in other.bad)
