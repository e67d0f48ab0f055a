"""The ``file`` tier's listing at open (columns from one ``scandir`` per shard directory, no
``RecordInfo`` per record) against the record-by-record walk the offline tools use: the same
keys, sizes and stamps, whatever else lies in the tree; in both layouts."""

from __future__ import annotations

import asyncio
import os
import time
from array import array
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=8192, dtype="bfloat16", namespace={"model_id": "m"})
LAYOUTS = pytest.mark.parametrize("layout", ["flat", "sharded"])


def _place(root: Path, key: bytes, layout: str) -> Path:
    h = key.hex()
    return root / f"{h}.kvb" if layout == "flat" else root / h[:2] / h[2:4] / f"{h}.kvb"


def _open(path: Path, **options: object) -> Backend:
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(path), sync_mode="fast", **options)
    asyncio.run(backend.open(FMT))
    return backend


def _littered_store(root: Path, outside: Path, layout: str) -> list[bytes]:
    """Twelve records (two compressed, so of other sizes; stamps set apart), and beside them
    what the listing must skip: temp files (one stale), foreign names, a record name in the
    wrong shard, a record in the other layout's place, a symlinked record and a symlinked shard
    directory, a directory where a record should be. The keys of the records."""
    keys = [make_key(i) for i in range(12)]
    backend = _open(root, layout=layout)
    backend.write_blocks(keys[:10], [random_block(FMT.block_bytes, i) for i in range(10)])
    backend.touch_stamps([(k, 1_000_000.0 + 7 * i) for i, k in enumerate(keys[:10])])
    asyncio.run(backend.aclose())
    zstd = _open(root, codec={"name": "zstd", "level": 1})
    zstd.write_blocks(keys[10:], [torch.zeros(FMT.block_bytes, dtype=torch.uint8)] * 2)
    asyncio.run(zstd.aclose())
    h = keys[0].hex()
    shard = _place(root, keys[0], layout).parent
    (shard / f"{h}.kvb.1.2.tmp").write_bytes(b"young temp file")
    stale = shard / f"{h}.kvb.1.3.tmp"
    stale.write_bytes(b"stale temp file")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    (shard / "notes.txt").write_bytes(b"x")
    (shard / (h.upper() + ".kvb")).write_bytes(b"x")
    if layout == "sharded":
        other = make_key(99).hex()
        (shard / f"{other}.kvb").write_bytes((shard / f"{h}.kvb").read_bytes())  # not its shard
    elsewhere = _place(root, make_key(53), "sharded" if layout == "flat" else "flat")
    elsewhere.parent.mkdir(parents=True, exist_ok=True)
    elsewhere.write_bytes((shard / f"{h}.kvb").read_bytes())  # the other layout's place
    outside.mkdir()
    (outside / f"{make_key(50).hex()}.kvb").write_bytes(b"outside")
    linked = _place(root, make_key(50), layout)
    linked.parent.mkdir(parents=True, exist_ok=True)
    linked.symlink_to(outside / linked.name)
    lshard = make_key(51).hex()
    (root / lshard[:2]).mkdir(exist_ok=True)
    if not (root / lshard[:2] / lshard[2:4]).exists():
        (root / lshard[:2] / lshard[2:4]).symlink_to(outside, target_is_directory=True)
    _place(root, make_key(52), layout).mkdir(parents=True)
    (root / "zz").mkdir()
    (root / "zz" / f"{h}.kvb").write_bytes(b"x")
    return keys


@LAYOUTS
def test_the_listing_at_open_is_the_record_by_record_walk(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "store"
    keys = _littered_store(root, tmp_path / "outside", layout)
    walked = []
    for key, entry in registry.backends.get("file")._record_entries(str(root), layout=layout):  # type: ignore[attr-defined]
        st = entry.stat(follow_symlinks=False)
        walked.append((key, -(-st.st_size // 4096) * 4096, st.st_mtime))
    assert sorted(k for k, _, _ in walked) == sorted(keys)
    offline = [k for k, _ in registry.backends.get("file")._record_entries(str(root), layout=None)]  # type: ignore[attr-defined]
    assert sorted(offline) == sorted([*keys, make_key(53)])  # the offline tools see both layouts
    backend = _open(root)
    try:
        columns = backend.scan_columns()  # type: ignore[attr-defined]
        assert columns is not None and sorted(columns) == sorted(walked)
        assert backend.scan_columns() is None  # type: ignore[attr-defined]  # once
        assert sorted((r.key, r.stored_bytes, r.stamp) for r in backend.scan()) == sorted(walked)  # walked again
        assert backend.stats()["used_bytes"] == sum(n for _, n, _ in walked)
        assert backend.stats()["known_blocks"] == len(keys)
        assert not list(root.rglob("*.1.3.tmp")) and list(root.rglob("*.1.2.tmp"))  # the stale one swept
        oldest = [k for k, _, _ in columns.sorted()][:10]
        assert oldest == keys[:10]  # the stamps restore the order
        # The walk's sizes and stamps are arrays of machine numbers, not an object per record
        # (each of those kept the keys' memory resident after the open); the same values.
        listed, sizes, stamps = backend._record_columns(str(root), layout=layout)  # type: ignore[attr-defined]
        assert (type(sizes), sizes.typecode, type(stamps), stamps.typecode) == (array, "q", array, "d")
        stat_of = {k: os.stat(_place(root, k, layout), follow_symlinks=False) for k in listed}
        assert sorted(listed) == sorted(keys)
        assert list(sizes) == [stat_of[k].st_size for k in listed] and list(stamps) == [stat_of[k].st_mtime for k in listed]
    finally:
        asyncio.run(backend.aclose())
    assert (tmp_path / "outside" / f"{make_key(50).hex()}.kvb").read_bytes() == b"outside"


@LAYOUTS
def test_a_store_adopts_the_listing_as_columns(tmp_path: Path, layout: str) -> None:
    from kvtier.bulk import RecordColumns
    from kvtier.manager import TierManager, TierSpec
    from kvtier.manager.policies import LRUPolicy
    from kvtier.store import _scan_records

    root = tmp_path / "store"
    keys = _littered_store(root, tmp_path / "outside", layout)
    backend = _open(root)
    try:
        listed = _scan_records(backend)
        assert isinstance(listed, RecordColumns)
        manager = TierManager([TierSpec("disk", capacity_bytes=8 << 20, block_reserve=backend.reserve_bytes(), policy=LRUPolicy(64), persistent=True)])
        assert manager.adopt(0, listed) == []
        assert manager.stats()["tiers"][0]["ready"] == len(keys)
        assert manager.lookup(keys) == len(keys)
    finally:
        asyncio.run(backend.aclose())
