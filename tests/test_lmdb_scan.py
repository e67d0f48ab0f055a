"""The LMDB open's fast listing (``backends/lmdb_scan.py``) against the general path.

* the level-at-a-time page check accepts and refuses exactly the files the page-by-page walk
  (``lmdb_pages.check_trees``) does, on sound files and on copies damaged page by page;
* the records it lists (columns) are those a cursor read of the index gives: same keys, sizes,
  stamps, and the store's adoption of them ends in the same index and order as the tuple path.
"""

from __future__ import annotations

import asyncio
import mmap
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from kvtier.backends.lmdb_files import DamagedEnvironment, check_data_file
from kvtier.backends.lmdb_layout import ENTRY_SIZES
from kvtier.backends.lmdb_pages import check_file_trees
from kvtier.backends.lmdb_scan import _BATCH, _rows, list_trees, open_listing

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.bulk import RecordColumns, unpooled
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key, random_block

PAGE = 4096


def _store(path: Path, n: int, block_bytes: int, deleted: int = 0) -> list[bytes]:
    """An lmdb tier at ``path`` holding ``n`` records (``deleted`` of them deleted again)."""
    fmt = BlockFormat(block_bytes=block_bytes, dtype="bfloat16", namespace={"model_id": "m"})
    backend: Backend = registry.backends.get("lmdb")(capacity=max(8 << 20, n * block_bytes * 3), path=str(path), sync_mode="fast")
    asyncio.run(backend.open(fmt))
    keys = [make_key(i) for i in range(n)]
    for i in range(0, n, 64):
        assert None not in backend.write_blocks(keys[i : i + 64], [random_block(block_bytes, j) for j in range(i, min(n, i + 64))])
    backend.touch_stamps([(k, 1000.0 + (i * 7919) % n) for i, k in enumerate(keys)])  # stamps out of key order
    if deleted:
        backend.delete_blocks(keys[:deleted])
    asyncio.run(backend.aclose())
    return keys[deleted:]


def _verdict(check: object, path: str) -> str:
    try:
        check(path)  # type: ignore[operator]
    except DamagedEnvironment:
        return "refused"
    return "accepted"


@pytest.mark.parametrize("block_bytes", [1024, 65536], ids=["inline", "overflow"])
def test_the_fast_walk_lists_what_the_page_walk_lists(tmp_path: Path, block_bytes: int) -> None:
    keys = _store(tmp_path / "env", 300, block_bytes, deleted=5)
    path = str(tmp_path / "env")
    walked = list_trees(path)
    assert walked is not None
    leaves = walked[0]
    for name in (b"blocks", b"index"):
        rows = leaves[name].keys
        assert rows is not None
        assert [bytes(r) for r in rows] == sorted(check_file_trees(path, keys_of=name) or {})  # type: ignore[arg-type]
    assert sorted(bytes(r) for r in leaves[b"blocks"].keys) == sorted(keys)  # type: ignore[union-attr]


@pytest.mark.parametrize("block_bytes", [1024, 65536], ids=["inline", "overflow"])
def test_damaged_pages_are_refused_by_both_walks_alike(tmp_path: Path, block_bytes: int) -> None:
    """Every page of a small store damaged in turn (a flipped bit in its first 64 bytes, or the
    page zeroed): the fast walk refuses exactly when the page-by-page walk does, naming the
    same page, and neither ever refuses the sound file."""
    src = tmp_path / "src"
    _store(src, 40 if block_bytes < PAGE else 6, block_bytes)
    data = (src / "data.mdb").read_bytes()
    pages = check_data_file(str(src)) // PAGE
    rng = random.Random(block_bytes)
    refused = 0
    for page in range(2, pages):
        for mode in ("flip", "zero"):
            copy = bytearray(data)
            if mode == "zero":
                copy[page * PAGE : (page + 1) * PAGE] = bytes(PAGE)
            else:
                copy[page * PAGE + rng.randrange(64)] ^= 1 << rng.randrange(8)
            env = tmp_path / "copy"
            shutil.rmtree(env, ignore_errors=True)
            env.mkdir()
            (env / "data.mdb").write_bytes(bytes(copy))
            slow = fast = ""
            try:
                check_file_trees(str(env))
            except DamagedEnvironment as exc:
                slow = str(exc)
            try:
                list_trees(str(env))
            except DamagedEnvironment as exc:
                fast = str(exc)
            assert fast == slow, (page, mode)
            refused += bool(slow)
    assert refused >= 2  # the tree pages were damaged at least
    assert _verdict(list_trees, str(src)) == "accepted"


def test_the_open_lists_the_records_a_cursor_read_lists(tmp_path: Path) -> None:
    keys = _store(tmp_path / "env", 500, 1024, deleted=3)
    path = str(tmp_path / "env")
    columns, _, _ = open_listing(path, ENTRY_SIZES)
    assert isinstance(columns, RecordColumns) and columns.oldest_first
    fmt = BlockFormat(block_bytes=1024, dtype="bfloat16", namespace={"model_id": "m"})
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=path, sync_mode="fast")
    asyncio.run(backend.open(fmt))
    try:
        fast = backend.scan_columns()
        assert fast is not None and backend.scan_columns() is None  # used once
        general = [(r.key, r.stored_bytes, r.stamp) for r in backend.scan()]  # a cursor read
    finally:
        asyncio.run(backend.aclose())
    assert sorted(general) == sorted(fast) and sorted(k for k, _, _ in general) == sorted(keys)
    assert list(fast) == sorted(general, key=lambda r: r[2])  # oldest first, ties in key order
    assert list(fast.sorted()) == list(fast)


@pytest.mark.parametrize("variable", [False, True], ids=["fixed", "variable"])
def test_adopting_columns_equals_adopting_tuples(variable: bool) -> None:
    """The manager adopts columns (no tuple per record) into the same index, sizes, order and
    usage as the same records listed as tuples: all fitting, some beyond the capacity, or some
    held already (then the columns take the record-by-record loop too)."""
    keys = [make_key(i) for i in range(50)]
    stamps = [float((i * 37) % 11) for i in range(50)]  # ties: kept in listing order
    sizes = [7 + i % 4 for i in range(50)] if variable else [10] * 50
    tuples = [(k, n, s) for k, n, s in zip(keys, sizes, stamps)]
    columns = RecordColumns(list(keys), torch.tensor(sizes).numpy(), torch.tensor(stamps, dtype=torch.float64).numpy())
    for capacity, held in ((100, 0), (40, 0), (33, 0), (100, 3)):
        managers = [
            TierManager([TierSpec("disk", capacity_bytes=capacity * 10, block_reserve=10, policy=LRUPolicy(), persistent=True, variable_size=variable)])
            for _ in range(2)
        ]
        for m in managers:
            for key in keys[:held]:
                plan = m.prepare_store([key])
                assert plan is not None
                m.complete_store([key], sizes={0: {key: 9}} if variable else None)
        excess = [managers[0].adopt(0, tuples), managers[1].adopt(0, columns)]
        assert excess[0] == excess[1]
        assert managers[0].tier_keys(0) == managers[1].tier_keys(0)
        assert managers[0].stats()["tiers"] == managers[1].stats()["tiers"]
        states = [m._tiers[0] for m in managers]
        assert states[0].sizes == states[1].sizes and states[0].index == states[1].index
        if not held:
            assert len(excess[0]) == (0 if capacity == 100 else len(excess[0])) and (capacity == 100 or excess[0])


def test_record_columns_refuse_columns_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 keys, 1 sizes"):
        RecordColumns([b"a", b"b"], torch.zeros(1).numpy(), torch.zeros(2).numpy())


def test_row_gathers_equal_byte_gathers_at_any_offset() -> None:
    """``_rows`` (one gather per row over an overlapping view) reads exactly the bytes a gather
    of each byte reads, at odd and even offsets, as opaque rows and as a structured header; an
    offset whose row runs past the end raises ``IndexError`` as the byte gather does."""
    import numpy as np
    from kvtier.backends.lmdb_scan import _NODE_HEAD, _rows

    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    at = rng.integers(0, 4096 - 40, 500)
    for width in (1, 8, 16, 32, 33):
        assert np.array_equal(_rows(data, at, width).view(np.uint8).reshape(-1, width), data[at[:, None] + np.arange(width)])
    head = _rows(data, at, _NODE_HEAD)
    for i, field in enumerate(("lo", "hi", "flags", "ksize")):
        word = data[at + 2 * i].astype(np.int64) | data[at + 2 * i + 1].astype(np.int64) << 8
        assert np.array_equal(head[field].astype(np.int64), word)
    with pytest.raises(IndexError):
        _rows(data, np.array([4096 - 7]), 8)
    with pytest.raises(IndexError):
        data[np.array([4096 - 7]) + np.arange(8)]


def test_keys_with_zero_bytes_are_listed_whole(tmp_path: Path) -> None:
    """Keys that end (or start) with zero bytes come out of the open's listing whole, as the
    cursor read gives them (an ``S<width>`` array would strip the trailing zeros)."""
    fmt = BlockFormat(block_bytes=1024, dtype="bfloat16", namespace={"model_id": "m"})
    path = str(tmp_path / "env")
    backend: Backend = registry.backends.get("lmdb")(capacity=8 << 20, path=path, sync_mode="fast")
    asyncio.run(backend.open(fmt))
    keys = [bytes([i + 1]) + bytes(31) for i in range(20)] + [bytes(31) + bytes([i + 1]) for i in range(20)] + [bytes(32)]
    assert None not in backend.write_blocks(keys, [random_block(1024, i) for i in range(len(keys))])
    asyncio.run(backend.aclose())
    columns, _, _ = open_listing(path, ENTRY_SIZES)
    assert columns is not None and sorted(columns.keys) == sorted(keys)
    assert all(type(k) is bytes and len(k) == 32 for k in columns.keys)


def test_a_gather_in_batches_into_a_mapped_column_equals_the_whole_gather() -> None:
    """The keys' column is gathered a batch at a time into an array on a map of its own: the
    same rows as one gather, for counts below, at and past a batch."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    for count in (0, 1, _BATCH - 1, _BATCH, 3 * _BATCH + 5):
        at = rng.integers(0, len(data) - 32, count)
        whole = _rows(data, at, 32)
        column = _rows(data, at, 32, out=unpooled(count, np.dtype("V32")))
        assert column.tobytes() == whole.tobytes() and len(column) == count
        assert _on_a_map(column) or not count


def test_the_listed_columns_are_on_maps_of_their_own(tmp_path: Path) -> None:
    """The columns the open hands the manager (sizes, stamps) and the blocks' keys, value sizes
    and offsets the walk lists live on anonymous maps, not in the opening thread's malloc arena
    (whose top a trim leaves resident once the columns are freed by the adopting thread)."""
    _store(tmp_path / "env", 3 * _BATCH + 1, 1024)
    path = str(tmp_path / "env")
    walked = list_trees(path)
    assert walked is not None
    blocks = walked[0][b"blocks"]
    assert blocks.keys is not None and _on_a_map(blocks.keys)
    # and the values' sizes and offsets: from malloc, freed just before LMDB opens, they were
    # where its 1 MB free-page list then went, resident (8 B a record at 10^5)
    assert _on_a_map(blocks.values) and _on_a_map(blocks.at)
    del walked, blocks
    columns, _, _ = open_listing(path, ENTRY_SIZES)
    assert isinstance(columns, RecordColumns) and len(columns) == 3 * _BATCH + 1
    assert _on_a_map(columns.stored) and _on_a_map(columns.stamps)
    assert not _on_a_map(np.zeros(len(columns)))  # (the check tells malloc's memory apart)


def _on_a_map(array: np.ndarray) -> bool:
    """Whether ``array``'s memory is an anonymous map of its own (``mmap``), through views."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)
