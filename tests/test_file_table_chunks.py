"""The ``file`` tier's table of records taken a chunk at a time (``backends/file_table.py``): the
checks of a table, its records oldest first and the sums of the listed names, each done over
chunks and batches so that no temporary grows with the number of records, against the same
done over whole columns; and the columns handed to the manager in mappings of their own."""

from __future__ import annotations

import asyncio
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash
from kvtier.backends import file_table
from kvtier.backends.file_known import KnownRecords
from kvtier.backends.file_table import TABLE_NAME, key_sums, listed_sums, take_table
from kvtier.backends.file_tree import _RECORD_NAME, FileTree, _packed_keys

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.bulk import RecordColumns
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=4096, dtype="bfloat16", namespace={"model_id": "m"})
N = 10


def _table(keys: list[bytes], stored: list[int], stamps: list[float], order: list[int]) -> bytes:
    """A table's bytes as ``write_table`` lays them out, whatever the columns hold, with a
    true checksum (so only the checks of the columns can refuse it)."""
    body = b"".join((
        struct.pack("<8sQ", b"KVTTABL1", len(keys)), b"".join(keys), np.asarray(stored, dtype="<i8").tobytes(),
        np.asarray(stamps, dtype="<f8").tobytes(), np.asarray(order, dtype="<u4").tobytes(),
    ))
    return body + xxhash.xxh3_128_digest(body)


def _whole_columns_sound(keys: list[bytes], stored: list[int], stamps: list[float], order: list[int]) -> bool:
    """The checks over whole columns at once (the general path)."""
    k, s, t, o = np.array(keys, dtype="S32"), np.array(stored), np.array(stamps), np.array(order)
    return bool(
        (k[1:] > k[:-1]).all() and (s > 0).all() and np.isfinite(t).all() and o.max() < len(keys)
        and (np.bincount(o, minlength=len(keys)) == 1).all() and (np.diff(t[o]) >= 0).all()
    )


def _sound_columns() -> tuple[list[bytes], list[int], list[float], list[int]]:
    keys = sorted(make_key(i) for i in range(N))
    stamps = [1000.0 + (7 * i) % N for i in range(N)]  # some equal: a stable order
    order = sorted(range(N), key=lambda i: (stamps[i], i))
    return keys, [4096] * N, stamps, order


def _swap(values: list, i: int, j: int) -> list:
    out = list(values)
    out[i], out[j] = out[j], out[i]
    return out


DAMAGES: dict[str, Callable[[list[bytes], list[int], list[float], list[int]], tuple]] = {
    "sound": lambda k, s, t, o: (k, s, t, o),
    "keys swapped across a chunk's end": lambda k, s, t, o: (_swap(k, 2, 3), s, t, o),
    "keys swapped inside a chunk": lambda k, s, t, o: (_swap(k, 4, 5), s, t, o),
    "the last two keys swapped": lambda k, s, t, o: (_swap(k, N - 2, N - 1), s, t, o),
    "a key twice": lambda k, s, t, o: ([*k[:6], k[5], *k[7:]], s, t, o),
    "a size of 0 in the last chunk": lambda k, s, t, o: (k, [*s[:-1], 0], t, o),
    "a stamp not finite": lambda k, s, t, o: (k, s, [*t[:4], float("nan"), *t[5:]], o),
    "a stamp infinite": lambda k, s, t, o: (k, s, [*t[:7], float("inf"), *t[8:]], o),
    "a position twice, one missing": lambda k, s, t, o: (k, s, t, [*o[:8], o[2], o[9]]),
    "a position past the end": lambda k, s, t, o: (k, s, t, [*o[:-1], N]),
    "the order swapped across a chunk's end": lambda k, s, t, o: (k, s, t, _swap(o, 0, 9)),
    "the order swapped at a chunk's edge": lambda k, s, t, o: (k, s, t, _swap(o, 5, 6)),
}


@pytest.mark.parametrize("chunk", [1, 3, 4, 8192])
def test_the_checks_a_chunk_at_a_time_refuse_what_the_whole_column_checks_refuse(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(file_table, "_CHUNK", chunk)
    verdicts = set()
    for case, damage in DAMAGES.items():
        columns = damage(*_sound_columns())
        expected = _whole_columns_sound(*columns)
        verdicts.add(expected)
        assert (file_table._parse(_table(*columns)) is not None) == expected, case
    assert verdicts == {True, False}


@pytest.mark.parametrize("chunk", [1, 3, 8192])
def test_the_records_oldest_first_are_the_whole_column_gather_in_pages_of_their_own(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(file_table, "_CHUNK", chunk)
    keys, _, stamps, order = _sound_columns()
    stored = [4096 * (1 + i % 3) for i in range(N)]  # sizes apart: the gather of each is seen
    table = file_table._parse(_table(keys, stored, stamps, order))
    assert table is not None
    known = KnownRecords()
    try:
        columns = table.adopt(known)
    finally:
        table.close()
    assert columns.oldest_first
    assert columns.keys == [keys[i] for i in order]
    assert columns.stored.tolist() == [stored[i] for i in order]
    assert columns.stamps.tolist() == [stamps[i] for i in order]
    assert all(a is b for a, b in zip(sorted(columns.keys), sorted(known._listed.keys or known._fresh)))  # the same objects
    assert [known.get(k) for k in keys] == stored
    # The columns the manager drops after adopting them are not the allocator's: their own pages.
    assert all(isinstance(getattr(c.base, "obj", c.base), mmap.mmap) for c in (columns.stored, columns.stamps))


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_the_listed_sums_folded_batch_by_batch_are_the_sums_of_every_key(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "store"
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(root), sync_mode="fast", layout=layout)
    asyncio.run(backend.open(FMT))
    keys = [make_key(i) for i in range(N)]
    backend.write_blocks(keys, [random_block(FMT.block_bytes, i) for i in range(N)])
    asyncio.run(backend.aclose())
    (root / TABLE_NAME).unlink()
    (root / "notes.txt").write_bytes(b"x")
    foreign = make_key(70).hex()
    shard = root if layout == "flat" else root / foreign[:2] / foreign[2:4]
    shard.mkdir(parents=True, exist_ok=True)
    (shard / f"{foreign.upper()}.kvb").write_bytes(b"x")  # not a record's name: left out of its batch
    (shard / f"{foreign[:-1]} .kvb").write_bytes(b"x")
    batches = [bytes(b) for b in FileTree._record_key_batches(str(root), layout=layout, batch=3)]
    assert batches and all(len(b) <= 3 * 32 and len(b) % 32 == 0 for b in batches)  # a batch of foreign names only: empty
    listed = b"".join(batches)
    assert sorted(listed[i : i + 32] for i in range(0, len(listed), 32)) == sorted(keys)
    whole = (N, key_sums(b"".join(keys)))
    assert listed_sums(batches) == whole
    assert listed_sums(FileTree._record_key_batches(str(root), layout=layout, batch=3)) == whole
    assert listed_sums(FileTree._record_key_batches(str(root), layout=layout, batch=3)) != (N, key_sums(b"".join(keys[1:])))
    assert listed_sums([]) == (0, bytes(32))


def test_a_sound_table_taken_leaves_its_columns_to_the_table_not_copies(tmp_path: Path) -> None:
    """The table's columns are read in place (views of the mapped table), not copied out whole."""
    root = tmp_path / "store"
    root.mkdir()
    (root / TABLE_NAME).write_bytes(_table(*_sound_columns()))
    table = take_table(str(root))
    assert table is not None and not (root / TABLE_NAME).exists()
    try:
        assert all(not column.flags.owndata for column in (table.stored, table.stamps, table.order))
        assert table.stamps.tolist() == _sound_columns()[2]
    finally:
        table.close()


def test_a_batch_of_names_decoded_together_is_the_name_by_name_match() -> None:
    good = [make_key(i).hex() for i in range(6)]
    cases = [good, [*good[:2], good[2].upper(), *good[3:]], [good[0][:-1] + " ", *good[1:]], [good[0][:-1] + "g"], []]
    for hexes in cases:
        by_name = b"".join(bytes.fromhex(h) for h in hexes if _RECORD_NAME(h + ".kvb") is not None)
        assert _packed_keys(hexes) == by_name, hexes


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_the_walk_at_open_hands_its_records_oldest_first_as_the_managers_sort_orders_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    monkeypatch.setattr(file_table, "_CHUNK", 3)
    root = tmp_path / "store"
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(root), sync_mode="fast", layout=layout)
    asyncio.run(backend.open(FMT))
    keys = [make_key(i) for i in range(N)]
    backend.write_blocks(keys, [random_block(FMT.block_bytes, i) for i in range(N)])
    backend.touch_stamps([(k, 5000.0 - 10 * (i % 4)) for i, k in enumerate(keys)])  # equal stamps: kept in key order
    asyncio.run(backend.aclose())
    (root / TABLE_NAME).unlink()  # no table: the stat walk
    reopened = registry.backends.get("file")(capacity=8 << 20, path=str(root), sync_mode="fast")
    asyncio.run(reopened.open(FMT))
    try:
        columns = reopened.scan_columns()  # type: ignore[attr-defined]
        walked = RecordColumns(*reopened._record_columns(str(root), layout=layout))  # type: ignore[attr-defined]
        assert walked.keys == sorted(keys)  # the walk lists in key order
        general = RecordColumns(walked.keys, reopened._stored(np.asarray(walked.stored)), np.asarray(walked.stamps)).sorted()  # type: ignore[attr-defined]
        assert columns.oldest_first and columns.keys == general.keys
        assert columns.stored.tolist() == general.stored.tolist() and columns.stamps.tolist() == general.stamps.tolist()
        assert all(isinstance(getattr(c.base, "obj", c.base), mmap.mmap) for c in (columns.stored, columns.stamps))
        assert reopened._sizes._listed.packed_keys().tobytes() == b"".join(sorted(keys))  # type: ignore[attr-defined]
    finally:
        asyncio.run(reopened.aclose())
