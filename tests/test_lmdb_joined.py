"""The ``lmdb`` tier's joined layout (records of up to ``JOIN_MAX`` bytes: head and payload in
one ``blocks`` value, no index entry) beside the split and whole layouts: what a save writes,
what an open lists, what stamps do to it, and the fast reads against the general read on
random jobs over a store that holds every layout."""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_entries, lmdb_layout, lmdb_one
from kvtier.backends.lmdb_entries import INDEX
from lmdb_lookups import flip_head_bit

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records.codec import NoneCodec
from kvtier.records.format import HEAD_MAX, HEADER_SIZE, encode_record
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "joined"})
SECRET = "a-test-secret-of-32-bytes-012345"


def _open(path: Path, **options: Any) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=16 << 20, path=str(path), **options)
    asyncio.run(backend.open(FMT))
    return backend


def _close(backend: Backend) -> None:
    asyncio.run(backend.aclose())


def _raw(path: Path) -> dict[bytes, tuple[bytes, bytes | None]]:
    """key -> (blocks value, index entry or ``None``) of a closed store."""
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=False)
    blocks, index = env.open_db(b"blocks", create=False), env.open_db(b"index", create=False)
    with env.begin() as txn:
        got = {bytes(k): (bytes(v), txn.get(k, db=index)) for k, v in txn.cursor(db=blocks)}
    env.close()
    return got


def _entries(path: Path) -> int:
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=False)
    index = env.open_db(b"index", create=False)
    with env.begin() as txn:
        n = int(txn.stat(index)["entries"])
    env.close()
    return n


@pytest.mark.parametrize("keyed", [False, True])
def test_a_small_record_is_one_value_and_a_large_one_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyed: bool) -> None:
    options = {"mac_key": SECRET} if keyed else {}
    data = [random_block(FMT.block_bytes, i) for i in range(2)]
    keys = [make_key(i) for i in range(2)]
    backend = _open(tmp_path / "s", **options)
    sizes = backend.write_blocks(keys[:1], data[:1])
    monkeypatch.setattr(lmdb_entries, "JOIN_MAX", FMT.block_bytes)  # this block's record is larger: split
    sizes += backend.write_blocks(keys[1:], data[1:])
    _close(backend)
    raw = _raw(tmp_path / "s")
    head = HEAD_MAX if keyed else HEADER_SIZE
    value, entry = raw[keys[0]]
    assert entry is None and len(value) == head + FMT.block_bytes and value[head:] == data[0].numpy().tobytes()
    value, entry = raw[keys[1]]
    assert entry is not None and len(entry) == INDEX.size + head and value == data[1].numpy().tobytes()
    assert sizes[0] == sizes[1]  # the same pages counted either way
    backend = _open(tmp_path / "s", **options)
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True, True]
        assert all(torch.equal(o, d) for o, d in zip(out, data))
    finally:
        _close(backend)


def test_a_joined_save_over_a_split_record_drops_its_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index entry is always the current record's: a split record saved again joined (other
    bytes, another codec) loses its entry in the same transaction, and reads the new bytes;
    without the delete, the old head would be read with the new value (a miss, deleted)."""
    key, new, old = make_key(1), random_block(FMT.block_bytes, 1), torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    monkeypatch.setattr(lmdb_entries, "JOIN_MAX", 0)
    backend = _open(tmp_path / "s")
    backend.write_blocks([key], [old])
    monkeypatch.setattr(lmdb_entries, "JOIN_MAX", 64 << 10)
    for codec in ({"name": "zstd", "level": 1}, "none"):
        _close(backend)
        backend = _open(tmp_path / "s", codec=codec)
        backend.write_blocks([key], [new if codec == "none" else old])
        out = torch.full((FMT.block_bytes,), 7, dtype=torch.uint8)
        assert backend.read_blocks([key], [out]) == [True]
        assert torch.equal(out, new if codec == "none" else old)
        assert backend.stats()["corrupt_records"] == 0
        if codec != "none":  # compressed: shorter than a block, so its entry would be looked up
            with backend._env.begin() as txn:  # type: ignore[attr-defined]
                assert txn.get(key, db=backend._index) is None  # type: ignore[attr-defined]
    _close(backend)
    assert _entries(tmp_path / "s") == 0
    value, entry = _raw(tmp_path / "s")[key]
    assert entry is None and value[HEADER_SIZE:] == new.numpy().tobytes()


def test_stamps_make_joined_records_whole_and_a_save_joins_them_again(tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(3)]
    data = [random_block(FMT.block_bytes, 30 + i) for i in range(3)]
    backend = _open(tmp_path / "s")
    backend.write_blocks(keys, data)
    backend.touch_stamps([(keys[0], 111.0), (keys[1], 222.0), (make_key(99), 333.0)])  # 99: never stored
    _close(backend)
    raw = _raw(tmp_path / "s")
    assert raw[keys[2]][1] is None and make_key(99) not in raw
    for i, stamp in ((0, 111.0), (1, 222.0)):
        value, entry = raw[keys[i]]
        assert entry is not None and len(entry) == INDEX.size
        assert INDEX.unpack(entry)[0] == stamp and INDEX.unpack(entry)[1] > len(value)  # its pages
    before = time.time()
    backend = _open(tmp_path / "s")
    after = time.time()
    try:
        listed = {r.key: r for r in backend.scan()}
        assert listed[keys[0]].stamp == 111.0 and listed[keys[1]].stamp == 222.0
        assert before <= listed[keys[2]].stamp <= after  # no entry: the open's time
        assert {r.stored_bytes for r in listed.values()} == {backend._pages(HEADER_SIZE + FMT.block_bytes)}  # type: ignore[attr-defined]
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 3 and all(torch.equal(o, d) for o, d in zip(out, data))
    finally:
        _close(backend)


def test_a_whole_entry_left_by_a_joined_save_gives_the_stamp_and_the_value_the_size(tmp_path: Path) -> None:
    """With no split entry in the store, a joined save puts one value and deletes nothing: a
    stamped record saved again keeps its 16-byte entry, which still gives its stamp, while its
    size (and its bytes) come from the new value, here compressed (shorter than a block, so its
    entry is looked up on a read)."""
    keys = [make_key(i) for i in range(2)]
    data = [random_block(FMT.block_bytes, 70), torch.zeros(FMT.block_bytes, dtype=torch.uint8)]
    backend = _open(tmp_path / "s")
    backend.write_blocks(keys, [data[0], random_block(FMT.block_bytes, 71)])
    backend.touch_stamps([(keys[0], 111.0), (keys[1], 222.0)])
    _close(backend)
    zstd = _open(tmp_path / "s", codec={"name": "zstd", "level": 1})
    assert not zstd._splits  # type: ignore[attr-defined]
    sizes = zstd.write_blocks(keys[1:], data[1:])
    _close(zstd)
    raw = _raw(tmp_path / "s")
    assert raw[keys[1]][1] is not None and len(raw[keys[1]][0]) < FMT.block_bytes  # the old entry, the new value
    for straight in (True, False):
        lmdb_one.STRAIGHT_READS, was = straight, lmdb_one.STRAIGHT_READS
        backend = _open(tmp_path / "s")
        try:
            listed = {r.key: r for r in backend.scan()}
            assert listed[keys[1]].stamp == 222.0 and listed[keys[1]].stored_bytes == sizes[0] < listed[keys[0]].stored_bytes
            assert listed[keys[0]].stamp == 111.0
            out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
            assert backend.read_blocks(keys, out) == [True, True] and all(torch.equal(o, d) for o, d in zip(out, data))
            assert backend.stats()["corrupt_records"] == 0
        finally:
            lmdb_one.STRAIGHT_READS = was
            _close(backend)


def test_the_open_lists_joined_records_as_a_cursor_read_lists_them(tmp_path: Path) -> None:
    """The listing from the page walk (columns) and the cursor read (``_read_index``) agree on a
    store of joined, whole-by-stamp and split records, with an entry whose value is gone."""
    keys = [make_key(i) for i in range(300)]  # several leaf pages of each tree
    backend = _open(tmp_path / "s")
    backend.write_blocks(keys[:200], [random_block(FMT.block_bytes, i) for i in range(200)])
    backend.touch_stamps([(k, 500.0 + i) for i, k in enumerate(keys[:200:3])])
    _close(backend)
    lmdb_entries_max = lmdb_entries.JOIN_MAX
    try:
        lmdb_entries.JOIN_MAX = 0
        backend = _open(tmp_path / "s")
        backend.write_blocks(keys[200:], [random_block(FMT.block_bytes, i) for i in range(200, 300)])
        _close(backend)
    finally:
        lmdb_entries.JOIN_MAX = lmdb_entries_max
    env = lmdb.open(str(tmp_path / "s"), max_dbs=3)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        txn.delete(keys[250], db=blocks)  # its entry stays: not listed
    env.close()
    backend = _open(tmp_path / "s")
    try:
        columns = backend.scan_columns()
        assert columns is not None
        walked = {key: (stored, stamp) for key, stored, stamp in columns}
        cursor = {r.key: (r.stored_bytes, r.stamp) for r in backend._read_index(backend._env)}  # type: ignore[attr-defined]
    finally:
        _close(backend)
    assert len(walked) == 299 and keys[250] not in walked
    joined = [k for k in keys[:200] if k not in keys[:200:3]]
    assert {walked[k][1] for k in joined} and all(walked[k][1] > 1e9 for k in joined)  # the open's time
    assert all(walked[k][1] == 500.0 + i for i, k in enumerate(keys[:200:3]))
    # The cursor read ran later: the joined records' stamp is its time; all else is the same.
    assert {k: v[0] for k, v in walked.items()} == {k: v[0] for k, v in cursor.items()}
    assert {k: v[1] for k, v in walked.items() if k not in joined} == {k: v[1] for k, v in cursor.items() if k not in joined}


@pytest.mark.parametrize("damage", ["payload", "magic", "checksum", "cut"])
def test_a_damaged_joined_record_is_a_miss_counted_and_deleted(tmp_path: Path, damage: str) -> None:
    keys = [make_key(i) for i in range(3)]
    data = [random_block(FMT.block_bytes, 60 + i) for i in range(3)]
    backend = _open(tmp_path / "s")
    backend.write_blocks(keys, data)
    _close(backend)
    env = lmdb.open(str(tmp_path / "s"), max_dbs=3)
    blocks, index = env.open_db(b"blocks"), env.open_db(b"index")
    with env.begin(write=True) as txn:
        if damage == "payload":
            value = bytearray(txn.get(keys[1], db=blocks))
            value[HEADER_SIZE + 999] ^= 0x40
            txn.put(keys[1], bytes(value), db=blocks)
        elif damage == "cut":
            txn.put(keys[1], txn.get(keys[1], db=blocks)[:-1], db=blocks)
        else:
            flip_head_bit(txn, keys[1], blocks, index, 0 if damage == "magic" else 30, 0x08)
    env.close()
    for straight in (True, False):
        path = tmp_path / f"copy-{straight}"
        shutil.copytree(tmp_path / "s", path)
        lmdb_one.STRAIGHT_READS, was = straight, lmdb_one.STRAIGHT_READS
        backend = _open(path)
        try:
            for job in ([keys[1]], keys):  # a job of one key, then the whole job
                out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in job]
                found = backend.read_blocks(job, out)
                assert found == ([False] if len(job) == 1 else [True, False, True])
            stats = backend.stats()
            assert stats["corrupt_records"] == 1 and stats["deleted"] == 1
            assert keys[1] not in {r.key for r in backend.scan()}
        finally:
            lmdb_one.STRAIGHT_READS = was
            _close(backend)


def _mixed_store(path: Path, n: int, rng: random.Random, monkeypatch: pytest.MonkeyPatch, **options: Any) -> tuple[list[bytes], dict[bytes, torch.Tensor]]:
    """``n`` keys in every layout: joined, split, whole (by a stamp, or as earlier code wrote
    it), compressed joined, absent, and a few damaged (a flipped payload or head bit)."""
    keys = [make_key(1000 + i) for i in range(n)]
    data = {k: random_block(FMT.block_bytes, 2000 + i) if i % 7 else torch.zeros(FMT.block_bytes, dtype=torch.uint8) for i, k in enumerate(keys)}
    kinds = [rng.choice(("joined", "split", "stamped", "earlier", "zstd", "absent")) for _ in keys]
    for kind in ("joined", "split", "stamped", "zstd"):
        picked = [k for k, c in zip(keys, kinds) if c == kind]
        if not picked:
            continue
        with monkeypatch.context() as m:
            if kind == "split":
                m.setattr(lmdb_entries, "JOIN_MAX", 0)
            backend = _open(path, **options, **({"codec": {"name": "zstd", "level": 1}} if kind == "zstd" else {}))
            assert None not in backend.write_blocks(picked, [data[k] for k in picked])
            if kind == "stamped":
                backend.touch_stamps([(k, 42.0) for k in picked])
            _close(backend)
    env = lmdb.open(str(path), max_dbs=3)
    blocks, index = env.open_db(b"blocks"), env.open_db(b"index")
    mac = None
    if options:
        from kvtier.records.format import RecordMac

        mac = RecordMac(SECRET)
    with env.begin(write=True) as txn:
        for k, c in zip(keys, kinds):
            if c == "earlier":
                head, payload = encode_record(k, data[k].numpy().data, NoneCodec(), 1, mac)
                txn.put(k, head + bytes(payload), db=blocks)
                txn.put(k, INDEX.pack(1.0, len(head) + len(payload)), db=index)
        for k in rng.sample([k for k, c in zip(keys, kinds) if c != "absent"], 3):
            if rng.random() < 0.5:
                flip_head_bit(txn, k, blocks, index, rng.randrange(24), 1 << rng.randrange(8))
            else:
                value = bytearray(txn.get(k, db=blocks))
                value[-rng.randrange(1, 100)] ^= 1 << rng.randrange(8)
                txn.put(k, bytes(value), db=blocks)
    env.close()
    return keys, data


@pytest.mark.parametrize("keyed", [False, True])
def test_fast_reads_of_random_jobs_over_every_layout_match_the_general_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyed: bool) -> None:
    """The straight line, the one-pass read and the tight pass (joined and split records) against
    the general read alone: the same finds, bytes, deletions and counters, job after job."""
    rng = random.Random(7 + keyed)
    options = {"mac_key": SECRET} if keyed else {}
    keys, data = _mixed_store(tmp_path / "s", 60, rng, monkeypatch, **options)
    shutil.copytree(tmp_path / "s", tmp_path / "general")
    jobs = [rng.sample(keys, rng.choice((1, 1, 2, 5, 16))) for _ in range(40)]
    results = {}
    for way in ("fast", "general"):
        with monkeypatch.context() as m:
            if way == "general":
                m.setattr(lmdb_one, "STRAIGHT_READS", False)
                m.setattr(lmdb_layout, "ONE_PASS_READS", False)
            backend = _open(tmp_path / ("s" if way == "fast" else "general"), **options)
            try:
                found, rows = [], []
                for job in jobs:
                    out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in job]
                    found.append(backend.read_blocks(job, out))
                    rows.append([o.clone() for o, hit in zip(out, found[-1]) if hit])
                    for key, o, hit in zip(job, out, found[-1]):
                        if hit:
                            assert torch.equal(o, data[key])
                stats = {k: v for k, v in backend.stats().items() if k in ("blocks_read", "read_misses", "corrupt_records", "deleted", "bytes_read", "auth_failures")}
                listed = {r.key for r in backend.scan()}
            finally:
                _close(backend)
        results[way] = (found, stats, listed)
    print(f"fast {results['fast'][1]}; general {results['general'][1]}")
    assert results["fast"] == results["general"]
    assert results["fast"][1]["corrupt_records"] >= 1 and results["fast"][1]["blocks_read"] > 0


def test_a_store_holding_a_split_entry_makes_joined_saves_delete_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a joined save deletes the key's entry follows what the store may hold: nothing
    split (a fresh store, or stamped joined records alone), no delete; a split entry found by the
    open's listing, by a cursor read of the index, or written by a split save, deletes."""
    backend = _open(tmp_path / "s")
    try:
        assert not backend._splits  # type: ignore[attr-defined]
        backend.write_blocks([make_key(1)], [random_block(FMT.block_bytes, 1)])
        backend.touch_stamps([(make_key(1), 5.0)])
        assert not backend._splits  # type: ignore[attr-defined]
        monkeypatch.setattr(lmdb_entries, "JOIN_MAX", 0)
        backend.write_blocks([make_key(2)], [random_block(FMT.block_bytes, 2)])
        assert backend._splits  # type: ignore[attr-defined]
        backend._splits = False  # type: ignore[attr-defined]
        backend._read_index(backend._env)  # type: ignore[attr-defined]
        assert backend._splits  # type: ignore[attr-defined]
    finally:
        _close(backend)
    monkeypatch.setattr(lmdb_entries, "JOIN_MAX", 64 << 10)
    backend = _open(tmp_path / "s")
    try:
        assert backend._splits  # type: ignore[attr-defined]
    finally:
        _close(backend)
