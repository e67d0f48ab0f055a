"""Records and stores this build cannot read are left for those that can.

* A record it cannot check (keyed, in a store keyed before meta records named the MAC, read by
  a tier without the secret) or cannot parse (a newer record format) is a miss, and stays: the
  ``lmdb`` and ``file`` tiers used to delete it, so an unkeyed reader emptied a keyed store.
* A store whose meta record is of a newer version than this build reads is refused at open
  with an error naming the version, and nothing in it is moved or deleted (the ``file`` tier
  used to move its meta record aside and then drop each record of the newer format it read).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import lmdb
import pytest
import torch
from kvtier.backends.lmdb_files import META_KEY
from lmdb_lookups import layouts
from test_lmdb_backend import _blocks_leaf_pages

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ConfigError
from kvtier.records.format import HEADER, RECORD_VERSION, decode_meta, encode_meta
from kvtier.records.meta import META_VERSION
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "unreadable"})
SECRET = "fleet-secret-for-tests-0123456789"
KEYS = [make_key(40 + i) for i in range(3)]
DATA = [random_block(FMT.block_bytes, 40 + i) for i in range(3)]


def _tier(name: str, path: Path, **options: object) -> Backend:
    backend = registry.backends.get(name)(capacity=64 << 20, path=str(path / name), **options)
    asyncio.run(backend.open(FMT))
    return backend


def _unopened(name: str, path: Path) -> Backend:
    return registry.backends.get(name)(capacity=64 << 20, path=str(path / name))


def _store(name: str, path: Path, **options: object) -> None:
    backend = _tier(name, path, **options)
    try:
        assert None not in backend.write_blocks(KEYS, DATA)
    finally:
        asyncio.run(backend.aclose())


def _read(backend: Backend) -> list[bool]:
    """A job of every key, then each key alone (a one-record read may take another path)."""
    found = backend.read_blocks(KEYS, [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in KEYS])
    for key in KEYS:
        found += backend.read_blocks([key], [torch.zeros(FMT.block_bytes, dtype=torch.uint8)])
    return found


def _all_served(name: str, path: Path, **options: object) -> None:
    backend = _tier(name, path, **options)
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in KEYS]
        assert backend.read_blocks(KEYS, out) == [True] * len(KEYS)
        assert all(torch.equal(o, d) for o, d in zip(out, DATA))
    finally:
        asyncio.run(backend.aclose())


def _all_missed_and_kept(name: str, path: Path) -> None:
    """Every record read twice is a miss, and none was deleted or counted as damage."""
    backend = _tier(name, path)
    try:
        assert _read(backend) == [False] * (2 * len(KEYS))
        stats = backend.stats()
        assert stats["deleted"] == 0 and stats["corrupt_records"] == 0
    finally:
        asyncio.run(backend.aclose())


def _meta(name: str, path: Path) -> bytes:
    if name == "file":
        return (path / "file" / "kvtier-meta.kvm").read_bytes()
    with lmdb.open(str(path / "lmdb"), max_dbs=3, readonly=True, lock=False) as env, env.begin(db=env.open_db(b"meta", create=False)) as txn:
        return bytes(txn.get(META_KEY))


def _set_meta(name: str, path: Path, data: bytes) -> None:
    if name == "file":
        (path / "file" / "kvtier-meta.kvm").write_bytes(data)
        return
    with lmdb.open(str(path / "lmdb"), max_dbs=3) as env, env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(META_KEY, data)


def _set_record_versions(name: str, path: Path, version: int, keys: list[bytes] = KEYS) -> None:
    """Rewrite the format version in every record's header (split lmdb records: the head is in
    the index entry, after the entry's own fields)."""

    def patched(head: bytes, at: int) -> bytes:
        fields = list(HEADER.unpack_from(head, at))
        fields[1] = version
        out = bytearray(head)
        HEADER.pack_into(out, at, *fields)
        return bytes(out)

    if name == "file":
        for record in (path / "file").rglob("*.kvb"):
            record.write_bytes(patched(record.read_bytes(), 0))
        return
    from kvtier.backends.lmdb_layout import INDEX

    with lmdb.open(str(path / "lmdb"), max_dbs=3) as env, env.begin(write=True, db=env.open_db(b"index")) as txn:
        for key in keys:
            txn.put(key, patched(bytes(txn.get(key)), INDEX.size))


@pytest.fixture(autouse=True)
def _split_lmdb_records(monkeypatch: pytest.MonkeyPatch) -> None:
    layouts(monkeypatch, "split")  # every record's head in its index entry, whatever its size


@pytest.mark.parametrize("name", ["lmdb", "file"])
def test_an_unkeyed_tier_leaves_the_records_of_a_store_keyed_before_meta_records_named_the_mac(name: str, tmp_path: Path) -> None:
    _store(name, tmp_path, mac_key=SECRET, mac_algorithm="hmac-sha256")
    older = decode_meta(_meta(name, tmp_path))
    assert older.mac == "hmac-sha256"
    _set_meta(name, tmp_path, encode_meta(FMT, None, layout=older.layout))  # what the first keyed stores wrote
    _all_missed_and_kept(name, tmp_path)  # opened without the key
    _all_served(name, tmp_path, mac_key=SECRET, mac_algorithm="hmac-sha256")


@pytest.mark.parametrize("name", ["lmdb", "file"])
def test_a_record_of_a_newer_format_is_a_miss_and_stays(name: str, tmp_path: Path) -> None:
    _store(name, tmp_path)
    _set_record_versions(name, tmp_path, RECORD_VERSION + 1)
    _all_missed_and_kept(name, tmp_path)
    _set_record_versions(name, tmp_path, RECORD_VERSION)  # as a build that reads them sees them
    _all_served(name, tmp_path)


@pytest.mark.parametrize("name", ["lmdb", "file"])
def test_a_store_whose_meta_record_is_newer_is_refused_at_open_and_left_as_it_is(name: str, tmp_path: Path) -> None:
    _store(name, tmp_path)
    ours = _meta(name, tmp_path)
    newer = bytearray(ours)
    newer[4] = META_VERSION + 1  # the meta record's version; its body (and the body's CRC) as written
    _set_meta(name, tmp_path, bytes(newer))
    _set_record_versions(name, tmp_path, RECORD_VERSION + 1)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != "lock.mdb")
    backend = _unopened(name, tmp_path)
    with pytest.raises(ConfigError, match=rf"meta record version {META_VERSION + 1}.*newer kvtier.*new path"):
        asyncio.run(backend.open(FMT))
    asyncio.run(backend.aclose())
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != "lock.mdb") == before
    assert _meta(name, tmp_path) == bytes(newer)
    # What the newer build wrote is all still there: with its meta record and record format
    # back to ours (as a build that reads them sees them), every record is served.
    _set_meta(name, tmp_path, ours)
    _set_record_versions(name, tmp_path, RECORD_VERSION)
    _all_served(name, tmp_path)


@pytest.mark.parametrize("name", ["lmdb", "file"])
def test_verify_delete_without_the_secret_keeps_the_keyed_records(name: str, tmp_path: Path) -> None:
    """``kvtier verify --delete`` without ``--mac-key-env`` on a store keyed before meta records
    named the MAC: its records are reported unsupported, and kept (a damaged one is deleted)."""
    from kvtier.tools import verify_tier

    _store(name, tmp_path, mac_key=SECRET, mac_algorithm="hmac-sha256")
    _set_meta(name, tmp_path, encode_meta(FMT, None, layout=decode_meta(_meta(name, tmp_path)).layout))
    report = verify_tier(tmp_path / name, delete=True)
    assert report.checked == len(KEYS) and len(report.bad) == len(KEYS) and report.deleted == 0
    assert all(b["reason"].startswith("unsupported") for b in report.bad)
    _all_served(name, tmp_path, mac_key=SECRET, mac_algorithm="hmac-sha256")


SMALL = BlockFormat(block_bytes=1024, dtype="bfloat16", namespace={"model_id": "unreadable"})  # values inside leaf pages
SMALL_KEYS = [make_key(100 + i) for i in range(240)]
SMALL_DATA = [random_block(SMALL.block_bytes, 100 + i) for i in range(240)]


def _store_lmdb(path: Path, fmt: BlockFormat, **options: object) -> None:
    """An ``lmdb`` store of ``SMALL_KEYS`` over several leaf pages, written by a tier of ``fmt``."""
    backend = registry.backends.get("lmdb")(capacity=32 << 20, path=str(path / "lmdb"), **options)
    asyncio.run(backend.open(fmt))
    try:
        for i in range(0, len(SMALL_KEYS), 16):
            assert None not in backend.write_blocks(SMALL_KEYS[i : i + 16], SMALL_DATA[i : i + 16])
    finally:
        asyncio.run(backend.aclose())


def _zero_a_leaf_page(path: Path) -> None:
    """Damage the environment: one of its blocks database's leaf pages zeroed (its records lost)."""
    data_file = path / "lmdb" / "data.mdb"
    leaves = _blocks_leaf_pages(data_file)
    assert len(leaves) >= 3
    raw = bytearray(data_file.read_bytes())
    raw[leaves[1] * 4096 : (leaves[1] + 1) * 4096] = bytes(4096)
    data_file.write_bytes(bytes(raw))


@pytest.mark.parametrize("unreadable", ["keyed", "newer format"])
def test_salvage_keeps_the_records_the_tier_cannot_check(unreadable: str, tmp_path: Path) -> None:
    """A damaged environment whose records this tier cannot check (keyed, in a store keyed
    before meta records named the MAC, opened without the secret; or of a newer record format):
    salvage copies them into the fresh environment as they are (misses there, none deleted), so
    a tier that can check them serves them next. Before, all were refused as damaged and left
    behind in the moved-aside environment."""
    able = {"mac_key": SECRET, "mac_algorithm": "hmac-sha256"} if unreadable == "keyed" else {}
    _store_lmdb(tmp_path, SMALL, **able)
    if unreadable == "keyed":
        _set_meta("lmdb", tmp_path, encode_meta(SMALL, None, layout=decode_meta(_meta("lmdb", tmp_path)).layout))
    else:
        _set_record_versions("lmdb", tmp_path, RECORD_VERSION + 1, SMALL_KEYS)
    _zero_a_leaf_page(tmp_path)
    fmt, n, keys, data = SMALL, len(SMALL_KEYS), SMALL_KEYS, SMALL_DATA

    def tier(**options: object) -> Backend:
        backend = registry.backends.get("lmdb")(capacity=32 << 20, path=str(tmp_path / "lmdb"), **options)
        asyncio.run(backend.open(fmt))
        return backend

    backend = registry.backends.get("lmdb")(capacity=32 << 20, path=str(tmp_path / "lmdb"))
    with pytest.warns(RuntimeWarning, match=r"salvaged 0 sound records .*; [0-9]+ this tier cannot check .* copied as they are"):
        asyncio.run(backend.open(fmt))
    try:
        assert len(list((tmp_path / "lmdb").glob("damaged-*/data.mdb"))) == 1
        kept = [i for i, key in enumerate(keys) if key in {r.key for r in backend.scan()}]
        assert n // 2 < len(kept) < n  # one page's records lost, not the store
        out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in kept]
        assert backend.read_blocks([keys[i] for i in kept], out) == [False] * len(kept)  # misses here
        stats = backend.stats()
        assert stats["deleted"] == 0 and stats["corrupt_records"] == 0
    finally:
        asyncio.run(backend.aclose())
    if unreadable == "newer format":  # as a build that reads them sees them
        _set_record_versions("lmdb", tmp_path, RECORD_VERSION, [keys[i] for i in kept])
    backend = tier(**able)
    try:
        out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in kept]
        assert backend.read_blocks([keys[i] for i in kept], out) == [True] * len(kept)
        assert all(torch.equal(o, data[i]) for o, i in zip(out, kept))
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.parametrize("store", ["keyed", "another model's"])
def test_a_damaged_store_that_refuses_a_tier_at_open_is_refused_and_left_for_one_it_accepts(store: str, tmp_path: Path) -> None:
    """A damaged environment whose meta record refuses the tier opening it (keyed, and the tier
    has no mac_key; another model's) refuses it as the undamaged store would, with the same
    ConfigError, and stays where it is: the tier it accepts then moves it aside and salvages its
    records. Before, the refused tier moved it aside and started a fresh store of its own in
    its place: every record of it left only in damaged-*/."""
    writer = {"mac_key": SECRET} if store == "keyed" else {}
    fmt = SMALL if store == "keyed" else BlockFormat(block_bytes=SMALL.block_bytes, dtype="bfloat16", namespace_digest=b"\1" * 32, namespace={"model_id": "another"})
    _store_lmdb(tmp_path, fmt, **writer)
    _zero_a_leaf_page(tmp_path)
    before = sorted(p.name for p in (tmp_path / "lmdb").iterdir())
    refused = registry.backends.get("lmdb")(capacity=32 << 20, path=str(tmp_path / "lmdb"))
    with pytest.raises(ConfigError, match="mac_key" if store == "keyed" else "namespace digest"):
        asyncio.run(refused.open(SMALL))
    asyncio.run(refused.aclose())
    assert sorted(p.name for p in (tmp_path / "lmdb").iterdir()) == before  # nothing moved aside

    backend = registry.backends.get("lmdb")(capacity=32 << 20, path=str(tmp_path / "lmdb"), **writer)
    with pytest.warns(RuntimeWarning, match=r"salvaged [0-9]+ sound records"):
        asyncio.run(backend.open(fmt))
    try:
        kept = [i for i, key in enumerate(SMALL_KEYS) if key in {r.key for r in backend.scan()}]
        assert len(SMALL_KEYS) // 2 < len(kept) < len(SMALL_KEYS)  # one page's records lost, not the store
        out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in kept]
        assert backend.read_blocks([SMALL_KEYS[i] for i in kept], out) == [True] * len(kept)
        assert all(torch.equal(o, SMALL_DATA[i]) for o, i in zip(out, kept))
    finally:
        asyncio.run(backend.aclose())
