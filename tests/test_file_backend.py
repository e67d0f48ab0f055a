"""The file tier: conformance suite plus layout, sharing, corruption, sweeping and path safety.

Every test runs in both layouts (``flat``, the default for a new store, and ``sharded``)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ConfigError, InvalidKeyError
from kvtier.records.format import HEADER_SIZE
from kvtier.testing import BackendTests, make_key, random_block

LAYOUT = "flat"  # set for each test by the ``layout`` fixture


@pytest.fixture(autouse=True, params=["flat", "sharded"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(f"{__name__}.LAYOUT", request.param)
    return str(request.param)


def file_backend(path: Path, capacity: int, **options: object) -> Backend:
    options.setdefault("layout", LAYOUT)
    return registry.backends.get("file")(capacity=capacity, path=str(path / "store"), **options)


class TestFileBackend(BackendTests):
    def make_backend(self, path: Path, capacity: int) -> Backend:
        return file_backend(path, capacity)


class TestFileBackendZstdFast(BackendTests):
    def make_backend(self, path: Path, capacity: int) -> Backend:
        return file_backend(path, capacity, codec={"name": "zstd", "level": 1}, sync_mode="fast")


FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


def _open(backend: Backend, fmt: BlockFormat = FMT) -> Backend:
    asyncio.run(backend.open(fmt))
    return backend


def _close(*backends: Backend) -> None:
    for b in backends:
        asyncio.run(b.aclose())


def _blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    return [random_block(FMT.block_bytes, seed * 1000 + i) for i in range(n)]


def _empty(n: int) -> list[torch.Tensor]:
    return [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(n)]


def _record_path(root: Path, key: bytes) -> Path:
    h = key.hex()
    if LAYOUT == "flat":
        return root / "store" / f"{h}.kvb"
    return root / "store" / h[:2] / h[2:4] / f"{h}.kvb"


def test_records_are_placed_by_the_store_layout(tmp_path: Path) -> None:
    backend = _open(file_backend(tmp_path, 1 << 20))
    try:
        key = make_key(3)
        size = backend.write_blocks([key], _blocks(1))[0]
        path = _record_path(tmp_path, key)
        assert [str(p.relative_to(tmp_path / "store")) for p in (tmp_path / "store").rglob("*.kvb")] == [
            str(path.relative_to(tmp_path / "store"))
        ]
        assert path.is_file() and path.stat().st_size == FMT.block_bytes + HEADER_SIZE
        assert size == backend.reserve_bytes() and size % 4096 == 0
        assert not list(path.parent.glob("*.tmp"))
    finally:
        _close(backend)


def test_missing_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="path"):
        registry.backends.get("file")(capacity="1MiB")


def test_two_instances_share_one_directory(tmp_path: Path) -> None:
    a = _open(file_backend(tmp_path, 1 << 20))
    b = _open(file_backend(tmp_path, 1 << 20))
    try:
        assert list(b.scan()) == []
        data = _blocks(2, seed=2)
        keys = [make_key(1), make_key(2)]
        a.write_blocks(keys, data)
        out = _empty(2)
        assert b.read_blocks(keys, out) == [True, True]
        assert all(torch.equal(x, y) for x, y in zip(out, data))
        b.delete_blocks(keys[:1])
        assert a.read_blocks(keys, _empty(2)) == [False, True]
    finally:
        _close(a, b)


def test_capacity_is_enforced_over_known_blocks(tmp_path: Path) -> None:
    backend = _open(file_backend(tmp_path, 2 * 20480))
    try:
        sizes = backend.write_blocks([make_key(i) for i in range(3)], _blocks(3))
        assert sizes[0] is not None and sizes[1] is not None and sizes[2] is None
        assert backend.stats()["write_failures"] == 1
        backend.write_blocks([make_key(0)], _blocks(1))  # overwriting does not grow usage
        backend.delete_blocks([make_key(1)])
        assert backend.write_blocks([make_key(2)], _blocks(1))[0] is not None
    finally:
        _close(backend)


def test_enospc_fails_the_write_and_keeps_earlier_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(file_backend(tmp_path, 1 << 20))
    try:
        data = _blocks(3, seed=6)
        keys = [make_key(i) for i in range(3)]
        assert None not in backend.write_blocks(keys[:1], data[:1])
        real = os.pwritev

        def full(fd: int, buffers: object, offset: int) -> int:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "pwritev", full)
        assert backend.write_blocks(keys[1:], data[1:]) == [None, None]
        monkeypatch.setattr(os, "pwritev", real)
        assert backend.stats()["write_failures"] == 2
        out = _empty(3)
        assert backend.read_blocks(keys, out) == [True, False, False]
        assert torch.equal(out[0], data[0])
        assert not list((tmp_path / "store").rglob("*.tmp"))
        assert backend.write_blocks(keys[1:2], data[1:2])[0] is not None  # usage was given back
    finally:
        _close(backend)


def test_flipped_byte_is_detected_deleted_counted_and_a_miss(tmp_path: Path) -> None:
    backend = _open(file_backend(tmp_path, 1 << 20))
    try:
        keys = [make_key(i) for i in range(2)]
        data = _blocks(2, seed=1)
        backend.write_blocks(keys, data)
        path = _record_path(tmp_path, keys[0])
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE + 77] ^= 0x01
        path.write_bytes(bytes(raw))
        out = _empty(2)
        assert backend.read_blocks(keys, out) == [False, True]
        assert backend.stats()["corrupt_records"] == 1 and not path.exists()
        assert torch.equal(out[1], data[1])
    finally:
        _close(backend)


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE, HEADER_SIZE + 100])
def test_truncated_record_is_corrupt(tmp_path: Path, cut: int) -> None:
    backend = _open(file_backend(tmp_path, 1 << 20))
    try:
        backend.write_blocks([make_key(1)], _blocks(1))
        path = _record_path(tmp_path, make_key(1))
        with open(path, "r+b") as f:
            f.truncate(cut)
        assert backend.read_blocks([make_key(1)], _empty(1)) == [False]
        assert backend.stats()["corrupt_records"] == 1 and not path.exists()
    finally:
        _close(backend)


def test_stale_temp_files_are_swept_and_fresh_ones_kept(tmp_path: Path) -> None:
    backend = _open(file_backend(tmp_path, 1 << 20))
    backend.write_blocks([make_key(1)], _blocks(1))
    _close(backend)
    shard = _record_path(tmp_path, make_key(1)).parent
    stale = shard / f"{make_key(1).hex()}.kvb.123.0.tmp"
    fresh = shard / f"{make_key(1).hex()}.kvb.124.0.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    backend = _open(file_backend(tmp_path, 1 << 20))
    try:
        assert not stale.exists() and fresh.exists()
        assert [r.key for r in backend.scan()] == [make_key(1)]
    finally:
        _close(backend)


def test_stamps_survive_reopen(tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(3)]
    backend = _open(file_backend(tmp_path, 1 << 20))
    backend.write_blocks(keys, _blocks(3))
    backend.touch_stamps([(keys[0], 3000.0), (keys[1], 1000.0), (keys[2], 2000.0), (make_key(9), 1.0)])
    _close(backend)
    backend = _open(file_backend(tmp_path, 1 << 20))
    try:
        stamps = {r.key: r.stamp for r in backend.scan()}
        assert stamps == {keys[0]: 3000.0, keys[1]: 1000.0, keys[2]: 2000.0}
    finally:
        _close(backend)


def test_scan_ignores_foreign_files_and_symlinks(tmp_path: Path) -> None:
    backend = _open(file_backend(tmp_path, 1 << 20))
    backend.write_blocks([make_key(1)], _blocks(1))
    _close(backend)
    root = tmp_path / "store"
    (root / "zz").mkdir()
    (root / "zz" / "notes.kvb").write_bytes(b"x")
    (root / "notes.kvb").write_bytes(b"x")
    h = make_key(2).hex()
    shard = _record_path(tmp_path, make_key(2)).parent
    shard.mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "outside.kvb"
    outside.write_bytes(b"secret")
    (shard / f"{h}.kvb").symlink_to(outside)
    backend = _open(file_backend(tmp_path, 1 << 20))
    try:
        assert [r.key for r in backend.scan()] == [make_key(1)]
        assert backend.read_blocks([make_key(2)], _empty(1)) == [False]  # O_NOFOLLOW
        assert outside.read_bytes() == b"secret"
    finally:
        _close(backend)


def test_keys_that_are_not_32_bytes_are_rejected(tmp_path: Path) -> None:
    backend = _open(file_backend(tmp_path, 1 << 20))
    try:
        for bad in (b"../../etc/passwd", b"\x00" * 31, "a" * 32):
            with pytest.raises(InvalidKeyError):
                backend.write_blocks([bad], _blocks(1))  # type: ignore[list-item]
            with pytest.raises(InvalidKeyError):
                backend.read_blocks([bad], _empty(1))  # type: ignore[list-item]
        # nothing but the meta record and (sharded) the empty first-level shard directories made at open
        assert sorted(str(p.relative_to(tmp_path / "store")) for p in (tmp_path / "store").rglob("*") if not p.is_dir()) == ["kvtier-meta.kvm"]
        made = [f"{i:02x}" for i in range(256)] if LAYOUT == "sharded" else []
        assert sorted(p.name for p in (tmp_path / "store").iterdir() if p.is_dir()) == made
    finally:
        _close(backend)


def test_other_namespace_is_refused_and_corrupt_meta_is_replaced(tmp_path: Path) -> None:
    _close(_open(file_backend(tmp_path, 1 << 20)))
    other = BlockFormat(block_bytes=FMT.block_bytes, dtype="bfloat16", namespace_digest=b"\2" * 32)
    with pytest.raises(ConfigError, match="namespace"):
        asyncio.run(file_backend(tmp_path, 1 << 20).open(other))
    (tmp_path / "store" / "kvtier-meta.kvm").write_bytes(b"garbage")
    backend = file_backend(tmp_path, 1 << 20)
    with pytest.warns(RuntimeWarning, match="meta"):
        _open(backend)
    _close(backend)
    assert list((tmp_path / "store").glob("kvtier-meta.kvm.corrupt-*"))
    _close(_open(file_backend(tmp_path, 1 << 20)))  # the rewritten meta record is accepted


@pytest.mark.parametrize("bit", range(8))
def test_a_flipped_bit_in_the_meta_version_is_damage_or_a_newer_store(tmp_path: Path, bit: int) -> None:
    """The meta record's version byte (offset 4) after one flipped bit. Version 0 (no build
    wrote it) is damage: the meta record is moved aside and rewritten, never a refusal to start,
    and the records, checked one by one, still serve their bytes. A higher version whose body's
    CRC holds reads as a newer kvtier's store: refused at open with an error naming the version,
    and left as it is (an older build must not take over a newer one's store)."""
    from kvtier.records.meta import META_VERSION

    backend = _open(file_backend(tmp_path, 1 << 20))
    keys, blocks = [make_key(i) for i in range(3)], _blocks(3)
    assert all(backend.write_blocks(keys, blocks))
    _close(backend)
    meta = tmp_path / "store" / "kvtier-meta.kvm"
    data = bytearray(meta.read_bytes())
    data[4] ^= 1 << bit
    meta.write_bytes(bytes(data))
    backend = file_backend(tmp_path, 1 << 20)
    if data[4] > META_VERSION:
        with pytest.raises(ConfigError, match=rf"meta record version {data[4]} .*newer kvtier"):
            _open(backend)
        _close(backend)
        assert meta.read_bytes() == bytes(data) and not list((tmp_path / "store").glob("kvtier-meta.kvm.corrupt-*"))
        data[4] ^= 1 << bit  # the store as it was: all of it is still there
        meta.write_bytes(bytes(data))
        backend = _open(file_backend(tmp_path, 1 << 20))
    else:
        with pytest.warns(RuntimeWarning, match="meta record"):
            _open(backend)
        assert list((tmp_path / "store").glob("kvtier-meta.kvm.corrupt-*"))
    try:
        out = _empty(3)
        found = backend.read_blocks(keys, out)
        for ok, got, want in zip(found, out, blocks):
            assert not ok or torch.equal(got, want)  # never wrong bytes
        assert all(found)
    finally:
        _close(backend)
    _close(_open(file_backend(tmp_path, 1 << 20)))  # the meta record in place is accepted


def test_a_higher_meta_version_with_a_damaged_body_is_damage(tmp_path: Path) -> None:
    """A higher version byte and a body whose CRC fails: damage in the meta record (a newer
    meta record keeps the prefix and its CRC), moved aside and rewritten."""
    from kvtier.records.meta import META_VERSION

    _close(_open(file_backend(tmp_path, 1 << 20)))
    meta = tmp_path / "store" / "kvtier-meta.kvm"
    data = bytearray(meta.read_bytes())
    data[4] = META_VERSION + 1
    data[-1] ^= 0x10
    meta.write_bytes(bytes(data))
    backend = file_backend(tmp_path, 1 << 20)
    with pytest.warns(RuntimeWarning, match="meta record"):
        _open(backend)
    _close(backend)
    assert list((tmp_path / "store").glob("kvtier-meta.kvm.corrupt-*"))


BIG = BlockFormat(block_bytes=512 << 10, dtype="bfloat16", namespace={"model_id": "m"})


@pytest.mark.parametrize("keyed", [False, True])
def test_a_large_job_is_read_while_a_side_thread_checks_and_each_bad_record_is_its_own_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyed: bool
) -> None:
    """Rows read one after the other while a side thread checks those already read: a flipped
    byte, a truncated file and a read error each cost only their own key."""
    from kvtier.backends import file_tier

    from kvtier import record_jobs

    options = {"mac_key": "a-test-secret-of-32-bytes-012345"} if keyed else {}
    keys = [make_key(i) for i in range(6)]
    data = [random_block(BIG.block_bytes, 90 + i) for i in range(6)]
    backend = _open(file_backend(tmp_path, 64 << 20, **options), BIG)
    backend.write_blocks(keys, data)
    flipped = _record_path(tmp_path, keys[1])
    raw = bytearray(flipped.read_bytes())
    raw[-1000] ^= 0x08
    flipped.write_bytes(bytes(raw))
    truncated = _record_path(tmp_path, keys[3])
    os.truncate(truncated, truncated.stat().st_size - 4096)
    hops: list[str] = []
    real_submit = record_jobs._submit
    monkeypatch.setattr(record_jobs, "_submit", lambda fn, *a: hops.append(fn.__name__) or real_submit(fn, *a))
    real_read = file_tier._read_exact
    calls = {"n": 0}

    def flaky_read(fd: int, view: memoryview, offset: int) -> None:
        calls["n"] += 1
        if calls["n"] == 4:  # the fourth payload read: key 4 (key 3 fails at its header)
            raise OSError(5, "injected EIO")
        real_read(fd, view, offset)

    monkeypatch.setattr(file_tier, "_read_exact", flaky_read)
    # The general read (plain records are read in one pass by default: tests/test_file_plain_reads.py).
    monkeypatch.setattr(file_tier, "PLAIN_READS", False)
    try:
        out = [torch.zeros(BIG.block_bytes, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        stats = backend.stats()
        print(f"file job ({'keyed' if keyed else 'plain'}): found {found}, hops {hops}, corrupt {stats['corrupt_records']}")
        assert found == [True, False, True, False, False, True]
        assert all(torch.equal(out[i], data[i]) for i in (0, 2, 5))
        assert stats["corrupt_records"] == 2 and stats["deleted"] == 2  # the read error is a plain miss
        assert not flipped.exists() and not truncated.exists() and _record_path(tmp_path, keys[4]).exists()
        assert hops == ["_side"]
    finally:
        _close(backend)


# -- the store's layout --------------------------------------------------------------------------


def test_an_unknown_layout_is_a_config_error_naming_the_field(tmp_path: Path) -> None:
    for bad in ("flatter", "", 2, True):
        with pytest.raises(ConfigError, match=r"^layout: expected one of flat, sharded"):
            file_backend(tmp_path, 1 << 20, layout=bad)


def test_a_store_of_the_original_layout_opens_reads_and_verifies_as_it_was_written(tmp_path: Path) -> None:
    """A store written before layouts were named: records in ``ab/cd/``, a meta record with no
    ``layout`` field (the bytes ``encode_meta`` wrote then). It opens in its own layout whatever
    the default for new stores, serves its records, takes new ones beside them, and the offline
    tools verify it."""
    from kvtier.records.format import encode_meta
    from kvtier.tools.offline import verify_tier

    old = _open(file_backend(tmp_path, 1 << 20, layout="sharded"))
    keys = [make_key(i) for i in range(4)]
    blocks = _blocks(4)
    old.write_blocks(keys[:3], blocks[:3])
    _close(old)
    root = tmp_path / "store"
    assert (root / "kvtier-meta.kvm").read_bytes() == encode_meta(FMT)  # no layout field
    assert sorted(p.relative_to(root).parts[:2] for p in root.rglob("*.kvb")) == sorted((k.hex()[:2], k.hex()[2:4]) for k in keys[:3])
    backend = _open(registry.backends.get("file")(capacity=1 << 20, path=str(root)))  # no layout: the store's
    try:
        assert backend.store_layout == "sharded"  # type: ignore[attr-defined]
        assert sorted(r.key for r in backend.scan()) == sorted(keys[:3])
        out = _empty(3)
        assert backend.read_blocks(keys[:3], out) == [True] * 3
        assert all(torch.equal(o, b) for o, b in zip(out, blocks[:3]))
        backend.write_blocks(keys[3:], blocks[3:])
        h = keys[3].hex()
        assert (root / h[:2] / h[2:4] / f"{h}.kvb").is_file()  # new records go where the store's are
    finally:
        _close(backend)
    report = verify_tier(root)
    assert report.ok and report.checked == 4


def test_a_store_keeps_its_layout_and_refuses_another_by_name(tmp_path: Path, layout: str) -> None:
    other = "sharded" if layout == "flat" else "flat"
    _close(_open(file_backend(tmp_path, 1 << 20)))
    with pytest.raises(ConfigError, match=f"^layout: the store at .* was made with layout '{layout}', the tier asks for '{other}'"):
        _open(file_backend(tmp_path, 1 << 20, layout=other))
    backend = _open(registry.backends.get("file")(capacity=1 << 20, path=str(tmp_path / "store")))
    try:
        assert backend.store_layout == layout  # type: ignore[attr-defined]
        assert "layout" not in backend.to_dict()  # none asked for: the store's own
    finally:
        _close(backend)
    assert file_backend(tmp_path, 1 << 20).to_dict()["layout"] == layout


def test_a_store_made_without_a_layout_is_flat(tmp_path: Path) -> None:
    backend = _open(registry.backends.get("file")(capacity=1 << 20, path=str(tmp_path / "store")))
    try:
        assert backend.store_layout == "flat"  # type: ignore[attr-defined]
        backend.write_blocks([make_key(1)], _blocks(1))
        assert (tmp_path / "store" / f"{make_key(1).hex()}.kvb").is_file()
    finally:
        _close(backend)


def test_a_layout_this_build_does_not_know_is_refused_and_the_store_left_alone(tmp_path: Path) -> None:
    from kvtier.records.format import encode_meta

    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    meta = encode_meta(FMT, layout="zigzag")
    (root / "kvtier-meta.kvm").write_bytes(meta)
    with pytest.raises(ConfigError, match="layout is 'zigzag', which this kvtier does not know"):
        _open(file_backend(tmp_path, 1 << 20))
    assert (root / "kvtier-meta.kvm").read_bytes() == meta


def test_a_damaged_meta_record_keeps_the_layout_its_records_are_in(tmp_path: Path, layout: str) -> None:
    """A meta record found damaged (or gone) is rewritten; the store keeps the layout its
    records are in, whatever the default for new stores, so none of them is orphaned (never
    listed, served or evicted again)."""
    backend = _open(file_backend(tmp_path, 1 << 20))
    keys, blocks = [make_key(i) for i in range(3)], _blocks(3)
    assert all(backend.write_blocks(keys, blocks))
    _close(backend)
    (tmp_path / "store" / "kvtier-meta.kvm").write_bytes(b"garbage")
    backend = registry.backends.get("file")(capacity=1 << 20, path=str(tmp_path / "store"))  # no layout: the store's
    with pytest.warns(RuntimeWarning, match="meta record"):
        _open(backend)
    try:
        assert backend.store_layout == layout  # type: ignore[attr-defined]
        assert sorted(r.key for r in backend.scan()) == sorted(keys)
        out = _empty(3)
        assert backend.read_blocks(keys, out) == [True] * 3
        assert all(torch.equal(o, b) for o, b in zip(out, blocks))
    finally:
        _close(backend)
    (tmp_path / "store" / "kvtier-meta.kvm").unlink()
    backend = _open(registry.backends.get("file")(capacity=1 << 20, path=str(tmp_path / "store")))
    try:
        assert backend.store_layout == layout  # type: ignore[attr-defined]
        assert sorted(r.key for r in backend.scan()) == sorted(keys)
    finally:
        _close(backend)
    other = "sharded" if layout == "flat" else "flat"
    (tmp_path / "store" / "kvtier-meta.kvm").unlink()
    with pytest.raises(ConfigError, match=f"^layout: the store at .* holds records in layout '{layout}', the tier asks for '{other}'"):
        _open(file_backend(tmp_path, 1 << 20, layout=other))
