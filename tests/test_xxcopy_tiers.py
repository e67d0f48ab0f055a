"""The fused copy + XXH3 pass (``kvtier.records.xxcopy.xxh3_copy``) through the tiers, native and
Python alike: the same bytes, the same misses and the same counters, a flipped payload bit still
a counted corrupt record, and every raw, unkeyed load read through the one pass."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvtier.backends import lmdb_layout, lmdb_one
from lmdb_lookups import damaged_store, layouts, read_as_damaged, reads_all_but_one, record_check_calls

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import CorruptBlockError
from kvtier.records import checks, xxcopy
from kvtier.records.checks import RawPayload, copy_and_check
from kvtier.records.codec import NoneCodec
from kvtier.records.format import decode_record, encode_record, parse_header
from kvtier.testing import make_key, random_block

PATHS = ["python", *(["native"] if xxcopy.NATIVE else [])]
FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


@pytest.fixture(params=PATHS)
def calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``xxcopy.xxh3_copy`` (and ``xxh3_check_copy``) on one path, counting the payload bytes
    each copies."""
    fn = xxcopy.xxh3_copy_python if request.param == "python" else xxcopy.xxh3_copy_native
    seen: list[int] = []

    def counting(prefix: Any, src: Any, dst: Any = None) -> int:
        seen.append(memoryview(src).nbytes)
        return fn(prefix, src, dst)  # type: ignore[misc]

    check = xxcopy.xxh3_check_copy_python if request.param == "python" else xxcopy.xxh3_check_copy_native

    def counting_checks(head: Any, key: Any, stored: Any, dst: Any, payload: Any = None) -> int:
        if dst is not None:
            seen.append(memoryview(dst).nbytes)
        return check(head, key, stored, dst, payload)  # type: ignore[misc]

    monkeypatch.setattr(xxcopy, "xxh3_copy", counting)
    monkeypatch.setattr(xxcopy, "xxh3_check_copy", counting_checks)  # one record's check and copy, on the same path
    if request.param == "native":  # fused() asks whether the native function is in place
        monkeypatch.setattr(xxcopy, "xxh3_copy_native", counting)
    return seen


def test_decode_record_checks_and_copies_on_either_path(calls: list[int]) -> None:
    key = make_key(3)
    block = random_block(65536, 3)
    head, payload = encode_record(key, memoryview(block.numpy()), NoneCodec(), 1)
    record = bytearray(head + bytes(payload))
    out = bytearray(65536)
    decode_record(key, record, memoryview(out))
    assert out == block.numpy().tobytes() and calls == [65536]
    record[40000] ^= 0x10
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        decode_record(key, record, memoryview(out))
    record[40000] ^= 0x10
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        decode_record(make_key(4), record, memoryview(out))  # the key is part of the sum


def test_a_large_unkeyed_job_is_one_pass_on_this_thread_when_native(calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """At least ``SIDE_MIN_BYTES``: the native pass copies and checks on the calling thread, no
    side thread; the Python path still hands the checks to one. Same errors either way."""
    size, n = 262144, 8
    keys = [make_key(i) for i in range(n)]
    blocks = [random_block(size, 40 + i) for i in range(n)]
    records = [encode_record(k, memoryview(b.numpy()), NoneCodec(), 1) for k, b in zip(keys, blocks)]
    payloads = [bytearray(p) for _, p in records]
    payloads[5][1234] ^= 0x01
    outs = [np.zeros(size, dtype=np.uint8) for _ in keys]
    items = [
        RawPayload(k, h, parse_header(h, raw_length=size), p, memoryview(o)) for k, (h, _), p, o in zip(keys, records, payloads, outs)
    ]
    submitted: list[object] = []
    real = checks._submit
    monkeypatch.setattr(checks, "_submit", lambda fn, *args: submitted.append(fn) or real(fn, *args))
    errors = copy_and_check(items, None)
    assert [e is None for e in errors] == [i != 5 for i in range(n)]
    assert all(np.array_equal(o, b.numpy()) for i, (o, b) in enumerate(zip(outs, blocks)) if i != 5)
    assert (submitted == []) == xxcopy.fused()
    assert sum(calls) == n * size if xxcopy.fused() else calls == []


def _lmdb(path: Path, **options: Any) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path), **options)
    asyncio.run(backend.open(FMT))
    return backend


@pytest.mark.parametrize("layout", ["joined", "split"])
@pytest.mark.parametrize("way", ["straight", "one_pass", "general"])
def test_lmdb_loads_give_the_same_outcome_on_either_path(
    tmp_path: Path, calls: list[int], monkeypatch: pytest.MonkeyPatch, layout: str, way: str
) -> None:
    """Sound records read, a flipped payload bit a counted corrupt record (deleted), through the
    straight read, the tight pass and the general read alike."""
    layouts(monkeypatch, layout)
    keys, data = damaged_store(tmp_path, FMT, head_at=12)
    monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", way == "straight")
    monkeypatch.setattr(lmdb_layout, "ONE_PASS_READS", way != "general")
    backend = _lmdb(tmp_path)
    try:
        out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
        backend.read_blocks(keys, out)  # a first job makes the rows' views known
        found = backend.read_blocks(keys, out)
        stats = backend.stats()
    finally:
        asyncio.run(backend.aclose())
    read_as_damaged(found, out, data, stats)
    assert sum(n == FMT.block_bytes for n in calls) >= 3  # 0, 4, 7: raw and sound, through the one pass


@pytest.fixture(params=PATHS)
def joined_calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``xxcopy.xxh3_joined`` on one path, counting the payload bytes it is given."""
    fn = xxcopy.xxh3_joined_python if request.param == "python" else xxcopy.xxh3_joined_native
    seen: list[int] = []

    def counting(head: Any, key: Any, src: Any) -> bytes:
        seen.append(memoryview(src).nbytes)
        return fn(head, key, src)  # type: ignore[misc]

    monkeypatch.setattr(xxcopy, "xxh3_joined", counting)
    return seen


def test_lmdb_joined_saves_store_what_the_general_encoder_makes(tmp_path: Path, joined_calls: list[int]) -> None:
    """A plain job of joined records is built whole, the block copied in its checksum's pass:
    the stored values are byte for byte ``encode_record``'s head and payload, they read back,
    and a flipped payload bit is a counted corrupt record."""
    import lmdb

    keys = [make_key(i) for i in range(5)]
    data = [random_block(FMT.block_bytes, 60 + i) for i in range(5)]
    backend = _lmdb(tmp_path)
    try:
        assert all(s is not None for s in backend.write_blocks(keys, data))
    finally:
        asyncio.run(backend.aclose())
    assert joined_calls == [FMT.block_bytes] * 5
    env = lmdb.open(str(tmp_path), max_dbs=8, readonly=False, lock=True)
    try:
        blocks = env.open_db(b"blocks")
        with env.begin(write=True) as txn:
            for key, block in zip(keys, data):
                head, payload = encode_record(key, memoryview(block.numpy()), NoneCodec(), 1)
                assert txn.get(key, db=blocks) == head + bytes(payload)
            value = bytearray(txn.get(keys[3], db=blocks))
            value[-7] ^= 0x02
            txn.put(keys[3], bytes(value), db=blocks)
    finally:
        env.close()
    reads_all_but_one(_lmdb(tmp_path), keys, data, bad=3)


@pytest.fixture(params=PATHS)
def check_calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``xxcopy.xxh3_check_copy`` on one path, recording each outcome it gives."""
    return record_check_calls(request.param, monkeypatch)


@pytest.mark.parametrize("layout", ["joined", "split"])
@pytest.mark.parametrize("jobs", ["one_by_one", "whole"])
def test_the_straight_read_checks_each_record_in_one_call_on_either_path(
    tmp_path: Path, check_calls: list[int], monkeypatch: pytest.MonkeyPatch, layout: str, jobs: str
) -> None:
    """The straight read's and the tight pass's one call per record (head, lengths, copy and checksum), native or
    Python: sound records read, absent ones missed, a flipped payload or head bit a counted
    corrupt record (deleted) as the general path finds it, never bytes other than stored."""
    layouts(monkeypatch, layout)
    keys, data = damaged_store(tmp_path, FMT, head_at=12)
    monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", True)
    backend = _lmdb(tmp_path)
    try:
        out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
        for row in out:  # each row's first job (key 0, sound) makes its view known
            assert backend.read_blocks([keys[0]], [row]) == [True]
            row.fill_(7)
        check_calls.clear()
        if jobs == "whole":
            found = backend.read_blocks(keys, out)
        else:
            found = [backend.read_blocks([key], [row])[0] for key, row in zip(keys, out)]
        stats = backend.stats()
    finally:
        asyncio.run(backend.aclose())
    read_as_damaged(found, out, data, stats)
    good, bad_sum, bad_head, shape = xxcopy.CHECK_GOOD, xxcopy.CHECK_SUM, xxcopy.CHECK_HEAD, xxcopy.CHECK_SHAPE
    # 6 (compressed: a value shorter than a raw record's) is told not plain by the call where
    # its layout has an entry with a head (split), else before it (joined: no entry)
    not_plain = [shape] if layout == "split" else []
    if jobs == "one_by_one":
        # 0, 4, 5 (its head in an entry of the old whole layout) and 7 good in one call each; 2
        # (payload) and 3 (head) told apart by the straight line's call, then by the job
        # reader's tight pass it hands them to (the same call), then read by the general path,
        # as 6 is; 1 (absent) makes no call
        assert check_calls == [good, bad_sum, bad_sum, bad_head, bad_head, good, good, shape, *not_plain, good]
    else:  # the first record that is not good (2) hands the whole job to the job reader's tight pass
        assert check_calls == [good, bad_sum, good, bad_sum, bad_head, good, good, *not_plain, good]
