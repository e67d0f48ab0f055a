"""A job of flat records read by key in one call (``kvtier.records.xxcopy.xxh3_read_check_keys``):
each record reads as ``xxh3_read_check_key`` reads it alone (the same rows, the same sound,
absent and refused records, for every kind of damage and things that are not records), on the
native and the Python form; once the directory's descriptor reads negative no record is opened;
bad arguments are refused by name; and the native form is the one called where it is built."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from xxcopy_forms import forms_of, head_and_key

from kvtier.records import xxcopy
from kvtier.records.xxcopy import CHECK_GOOD

FNS = forms_of("xxh3_read_check_keys")
RNG = np.random.default_rng(31)
HEAD, _ = head_and_key(RNG)
#: What each key's place in the directory holds.
KINDS = ["good", "flip_head", "flip_sum", "flip_last", "short", "long", "absent", "good", "symlink", "directory", "fifo", "good"]


def _keys() -> list[bytes]:
    return [RNG.integers(0, 256, 32, dtype=np.uint8).tobytes() for _ in KINDS]


def _store(root: Path, keys: list[bytes], n: int) -> list[bytes]:
    """A record of ``n`` payload bytes for each key, made as its kind says; the sound payloads."""
    payloads = []
    for key, kind in zip(keys, KINDS):
        payload = RNG.integers(0, 256, n, dtype=np.uint8).tobytes()
        payloads.append(payload)
        path = root / f"{key.hex()}.kvb"
        record = bytearray(HEAD + struct.pack("<Q", xxhash.xxh3_64(HEAD + key + payload).intdigest()) + payload)
        if kind == "flip_head":
            record[3] ^= 1
        elif kind == "flip_sum":
            record[26] ^= 1
        elif kind == "flip_last":
            record[-1] ^= 0x40
        elif kind == "short":
            del record[-1]
        elif kind == "long":
            record += b"\x00"
        if kind == "absent":
            continue
        if kind == "symlink":  # a sound record elsewhere: never followed (O_NOFOLLOW)
            (root / "elsewhere").write_bytes(bytes(record))
            path.symlink_to(root / "elsewhere")
        elif kind == "directory":
            path.mkdir()
        elif kind == "fifo":  # opened without waiting for a writer (O_NONBLOCK): reads empty
            os.mkfifo(path)
        else:
            path.write_bytes(bytes(record))
    return payloads


def _one_by_one(dir_fd: int, keys: list[bytes], n: int, piece: int) -> tuple[list[int], list[int], list[bytes]]:
    """What ``xxh3_read_check_key`` (Python form) says record by record: the sound positions,
    those a general read must take, and each row it left (0x5A where nothing was read)."""
    good, rest, rows = [], [], []
    for i, key in enumerate(keys):
        row = bytearray(b"\x5a" * n)
        try:
            status = xxcopy.xxh3_read_check_key_python(dir_fd, HEAD, key, row, piece)
        except FileNotFoundError:
            status = None
        except OSError:
            status = -1
        if status == CHECK_GOOD:
            good.append(i)
        elif status is not None:
            rest.append(i)
        rows.append(bytes(row))
    return good, rest, rows


def test_the_native_job_read_is_the_one_called_where_the_fused_pass_is() -> None:
    assert (xxcopy.xxh3_read_check_keys is xxcopy.xxh3_read_check_keys_native) == xxcopy.fused()
    if xxcopy.fused():
        assert FNS.keys() == {"python", "native"}


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("n", [100, 5000, 65536 + 7])
@pytest.mark.parametrize("piece", [0, 4096])
def test_a_job_reads_each_record_as_a_read_by_its_key_does(tmp_path: Path, name: str, n: int, piece: int) -> None:
    keys = _keys()
    payloads = _store(tmp_path, keys, n)
    dir_fd = os.open(tmp_path, os.O_RDONLY)
    try:
        good, rest, alone = _one_by_one(dir_fd, keys, n, piece)
        assert good == [i for i, kind in enumerate(KINDS) if kind == "good"]
        assert rest == [i for i, kind in enumerate(KINDS) if kind not in ("good", "absent")]
        rows = [bytearray(b"\x5a" * n) for _ in keys]
        found = [False] * len(keys)
        got = FNS[name](ctypes.c_int(dir_fd), HEAD, keys, [memoryview(r) for r in rows], piece, found)
        assert got == rest
        assert [i for i, hit in enumerate(found) if hit] == good
        for i in good:
            assert bytes(rows[i]) == payloads[i] == alone[i]
        for i, kind in enumerate(KINDS):  # what a refused or absent record left in its row: as alone
            if kind in ("flip_sum", "flip_last", "absent", "symlink", "directory"):
                assert bytes(rows[i]) == alone[i], kind
    finally:
        os.close(dir_fd)


@pytest.mark.parametrize("name", list(FNS))
def test_a_job_opens_no_record_once_the_directory_reads_negative(tmp_path: Path, name: str) -> None:
    keys = _keys()
    _store(tmp_path, keys, 5000)
    rows = [bytearray(b"\x5a" * 5000) for _ in keys]
    found = [False] * len(keys)
    assert FNS[name](ctypes.c_int(-1), HEAD, keys, rows, 0, found) == list(range(len(keys)))
    assert found == [False] * len(keys) and all(r == b"\x5a" * 5000 for r in rows)
    assert FNS[name](ctypes.c_int(-1), HEAD, [], [], 0, []) == []


@pytest.mark.parametrize("name", list(FNS))
def test_bad_arguments_of_a_job_read_are_refused_by_name(tmp_path: Path, name: str) -> None:
    fn = FNS[name]
    keys = _keys()[:2]
    dir_fd = os.open(tmp_path, os.O_RDONLY)
    dir_at = ctypes.c_int(dir_fd)
    try:
        rows = [bytearray(10), bytearray(10)]
        with pytest.raises(ValueError, match=r"rows, found: expected 2 each \(one per key\), got 1 and 2"):
            fn(dir_at, HEAD, keys, rows[:1], 0, [False, False])
        with pytest.raises(ValueError, match=r"rows, found: expected 2 each \(one per key\), got 2 and 1"):
            fn(dir_at, HEAD, keys, rows, 0, [False])
        with pytest.raises(TypeError, match=r"found: expected a list, got tuple"):
            fn(dir_at, HEAD, keys, rows, 0, (False, False))
        with pytest.raises(ValueError, match=r"piece: expected a count of bytes >= 0, got -1"):
            fn(dir_at, HEAD, keys, rows, -1, [False, False])
        with pytest.raises(ValueError, match=r"dir_at: expected an aligned C int holding the directory's descriptor, got 8 bytes"):
            fn(ctypes.c_int64(dir_fd), HEAD, keys, rows, 0, [False, False])
        with pytest.raises(TypeError, match="key"):
            fn(dir_at, HEAD, [keys[0], "0" * 32], rows, 0, [False, False])
        with pytest.raises(TypeError, match="writable"):
            fn(dir_at, HEAD, keys, [rows[0], bytes(10)], 0, [False, False])
        if name == "native":
            with pytest.raises(ValueError, match=r"keys\[1\]: holds 65 bytes, at most 64 here"):
                fn(dir_at, HEAD, [keys[0], bytes(65)], rows, 0, [False, False])
            with pytest.raises(TypeError, match=r"keys\[1\]: expected a bytes-like object"):  # (named only once raised)
                fn(dir_at, HEAD, [keys[0], "0" * 32], rows, 0, [False, False])
            with pytest.raises(TypeError, match=r"rows\[1\]: expected a writable, contiguous bytes-like object"):
                fn(dir_at, HEAD, keys, [rows[0], bytes(10)], 0, [False, False])
            with pytest.raises(TypeError, match=r"expected \(dir_at, head, keys, rows, piece, found\), got 5 arguments"):
                fn(dir_at, HEAD, keys, rows, 0)
        found = [False, False]
        assert fn(dir_at, HEAD, keys, rows, 0, found) == [] and found == [False, False]  # both absent: misses
    finally:
        os.close(dir_fd)


ONE_FNS = forms_of("xxh3_read_one")


def test_the_native_read_of_one_is_the_one_called_where_the_fused_pass_is() -> None:
    assert (xxcopy.xxh3_read_one is xxcopy.xxh3_read_one_native) == xxcopy.fused()


@pytest.mark.parametrize("name", list(ONE_FNS))
@pytest.mark.parametrize("piece", [0, 4096])
def test_a_read_of_one_says_what_a_job_of_it_says_and_leaves_the_count_as_it_was(tmp_path: Path, name: str, piece: int) -> None:
    """Each kind of record read alone by ``xxh3_read_one``: read and checked where a job of it
    finds it, absent where the job calls it a miss, else left to the general read; the row as the
    job leaves it; ``under_way`` as it was after each call; nothing opened once the directory
    reads negative; bad arguments refused by name before anything is counted."""
    n = 5000
    keys = _keys()
    _store(tmp_path, keys, n)
    dir_fd = os.open(tmp_path, os.O_RDONLY)
    under_way: list[None] = [None]  # another job's entry, left as it is
    try:
        for i, key in enumerate(keys):
            job_row, row = bytearray(b"\x5a" * n), bytearray(b"\x5a" * n)
            found = [False]
            rest = xxcopy.xxh3_read_check_keys_python(ctypes.c_int(dir_fd), HEAD, [key], [job_row], piece, found)
            expected = xxcopy.ONE_READ if found[0] else xxcopy.ONE_ELSE if rest else xxcopy.ONE_ABSENT
            assert ONE_FNS[name](under_way, ctypes.c_int(dir_fd), HEAD, key, row, piece) == expected, KINDS[i]
            assert row == job_row and under_way == [None], KINDS[i]
        assert ONE_FNS[name](under_way, ctypes.c_int(-1), HEAD, keys[0], bytearray(b"\x5a" * n), piece) == xxcopy.ONE_ELSE
        assert under_way == [None]
    finally:
        os.close(dir_fd)
    with pytest.raises(TypeError, match="under_way: expected a list, got tuple"):
        ONE_FNS[name]((), ctypes.c_int(-1), HEAD, keys[0], bytearray(n), piece)
    with pytest.raises(ValueError, match=r"piece: expected a count of bytes >= 0, got -1"):
        ONE_FNS[name](under_way, ctypes.c_int(-1), HEAD, keys[0], bytearray(n), -1)
    assert under_way == [None]
