"""One raw record read from a file and checked in one call (``kvtier.records.xxcopy.xxh3_read_check``):
the native function and the Python one give the same outcome, the same row and the same errors
for sound records and every kind of damage, read whole or a piece at a time, whichever piece
holds the damage; and the native one is what the ``file`` tier calls wherever it is built."""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash
from xxcopy_forms import forms_of, head_and_key

from kvtier.records import xxcopy
from kvtier.records.xxcopy import CHECK_GOOD, CHECK_HEAD, CHECK_SHAPE, CHECK_SUM

FNS = forms_of("xxh3_read_check")
RNG = np.random.default_rng(12)
HEAD, KEY = head_and_key(RNG)
#: Payload lengths around XXH3's forms (prefix 56 bytes: 184 is the last short input) and pieces.
LENGTHS = [0, 1, 63, 64, 65, 184, 185, 186, 1000, 4096, 5000, 65536 + 3]
PIECES = [0, 1, 7, 64, 100, 4096, 65536]


def _write(path: Path, n: int, *, damage: str | None = None) -> bytes:
    """A record of ``n`` payload bytes at ``path``, damaged as asked; its sound payload."""
    payload = RNG.integers(0, 256, n, dtype=np.uint8).tobytes()
    record = bytearray(HEAD + struct.pack("<Q", xxhash.xxh3_64(HEAD + KEY + payload).intdigest()) + payload)
    if damage == "flip_head":
        record[2] ^= 1
    elif damage == "flip_sum":
        record[27] ^= 1
    elif damage == "flip_first":
        record[32] ^= 1
    elif damage == "flip_last":
        record[-1] ^= 0x80
    elif damage == "short":
        del record[-1]
    elif damage == "long":
        record += b"\x00"
    path.write_bytes(bytes(record))
    return payload


def _read_both(path: Path, n: int, piece: int, key: bytes = KEY) -> tuple[int, bytes]:
    """Each function's outcome and row for the record at ``path``, asserted equal; rows start as 0x5A."""
    results = []
    for fn in FNS.values():
        row, stored = bytearray(b"\x5a" * n), bytearray(40)
        fd = os.open(path, os.O_RDONLY)
        try:
            results.append((fn(fd, HEAD, key, memoryview(stored)[:32], row, piece), bytes(row)))
        finally:
            os.close(fd)
    assert all(r[0] == results[0][0] for r in results), [r[0] for r in results]
    if results[0][0] in (CHECK_GOOD, CHECK_SUM):  # a row read whole: the same bytes on every path
        assert all(r[1] == results[0][1] for r in results)
    return results[0]


def test_the_native_read_check_is_the_one_called_where_the_fused_pass_is():
    assert (xxcopy.xxh3_read_check is xxcopy.xxh3_read_check_native) == xxcopy.fused()
    if xxcopy.fused():
        assert FNS.keys() == {"python", "native"}


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("piece", PIECES)
def test_a_sound_record_is_read_whole_and_good_in_any_pieces(tmp_path: Path, n: int, piece: int):
    payload = _write(tmp_path / "r", n)
    assert _read_both(tmp_path / "r", n, piece) == (CHECK_GOOD, payload)


@pytest.mark.parametrize("n", [65, 186, 5000, 65539])
@pytest.mark.parametrize("piece", [0, 64, 100, 4096])
@pytest.mark.parametrize(
    "damage, outcome",
    [("flip_head", CHECK_HEAD), ("flip_sum", CHECK_SUM), ("flip_first", CHECK_SUM), ("flip_last", CHECK_SUM), ("short", CHECK_SHAPE), ("long", CHECK_SHAPE)],
)
def test_each_kind_of_damage_is_told_alike_whatever_piece_holds_it(tmp_path: Path, n: int, piece: int, damage: str, outcome: int):
    _write(tmp_path / "r", n, damage=damage)
    assert _read_both(tmp_path / "r", n, piece)[0] == outcome


@pytest.mark.parametrize("piece", [0, 100, 4096])
def test_another_key_or_row_length_is_not_the_record(tmp_path: Path, piece: int):
    _write(tmp_path / "r", 5000)
    assert _read_both(tmp_path / "r", 5000, piece, key=bytes(32))[0] == CHECK_SUM
    for n in (4999, 5001, 0):
        assert _read_both(tmp_path / "r", n, piece)[0] == CHECK_SHAPE
    (tmp_path / "r").write_bytes(b"")
    assert _read_both(tmp_path / "r", 5000, piece)[0] == CHECK_SHAPE


@pytest.mark.parametrize("name", list(FNS))
def test_bad_arguments_and_failed_reads_are_refused_by_name(tmp_path: Path, name: str):
    fn = FNS[name]
    _write(tmp_path / "r", 100)
    fd = os.open(tmp_path / "r", os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match=r"stored: holds 31 bytes, expected len\(head\) \+ 8 = 32"):
            fn(fd, HEAD, KEY, bytearray(31), bytearray(100), 0)
        with pytest.raises(TypeError, match=r"stored: expected a writable buffer \(this bytes is read-only\)"):
            fn(fd, HEAD, KEY, bytes(32), bytearray(100), 0)
        with pytest.raises(TypeError, match=r"row: expected a writable buffer"):
            fn(fd, HEAD, KEY, bytearray(32), bytes(100), 0)
        with pytest.raises(ValueError, match=r"piece: expected a count of bytes >= 0, got -1"):
            fn(fd, HEAD, KEY, bytearray(32), bytearray(100), -1)
        shared = bytearray(200)
        with pytest.raises(ValueError, match="row: overlaps stored"):
            fn(fd, HEAD, KEY, memoryview(shared)[:32], memoryview(shared)[16:116], 0)
    finally:
        os.close(fd)
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(IsADirectoryError):
            fn(directory, HEAD, KEY, bytearray(32), bytearray(100), 0)
    finally:
        os.close(directory)


KEY_FNS: dict[str, Callable[..., int]] = {"python": xxcopy.xxh3_read_check_key_python}
if xxcopy.xxh3_read_check_key_native is not None:
    KEY_FNS["native"] = xxcopy.xxh3_read_check_key_native


def test_the_native_read_by_key_is_the_one_called_where_the_fused_pass_is():
    assert (xxcopy.xxh3_read_check_key is xxcopy.xxh3_read_check_key_native) == xxcopy.fused()
    if xxcopy.fused():
        assert KEY_FNS.keys() == {"python", "native"}


@pytest.mark.parametrize("n", [0, 185, 5000, 65539, (256 << 10) + 5])
@pytest.mark.parametrize("piece", [0, 4096, 256 << 10])
@pytest.mark.parametrize(
    "damage, outcome",
    [(None, CHECK_GOOD), ("flip_head", CHECK_HEAD), ("flip_sum", CHECK_SUM), ("flip_first", CHECK_SUM), ("flip_last", CHECK_SUM), ("short", CHECK_SHAPE), ("long", CHECK_SHAPE)],
)
def test_a_record_read_by_its_key_reads_as_by_its_name(tmp_path: Path, n: int, piece: int, damage: str | None, outcome: int):
    """``xxh3_read_check_key`` (the name made from the key, opened, read, checked and closed
    in one call, the stored head read into a buffer of the call's own) gives the outcome and row
    that ``xxh3_read_check`` gives for the file ``key.hex() + ".kvb"`` opened apart, on both
    paths, for sound records and every kind of damage."""
    if n == 0 and damage in ("flip_first", "flip_last"):
        pytest.skip("no payload byte to flip")
    payload = _write(tmp_path / f"{KEY.hex()}.kvb", n, damage=damage)
    root = os.open(tmp_path, os.O_RDONLY)
    try:
        rows = {}
        for name, fn in KEY_FNS.items():
            row = bytearray(b"\x5a" * n)
            assert fn(root, HEAD, KEY, row, piece) == outcome, name
            rows[name] = bytes(row)
        general = bytearray(b"\x5a" * n)
        fd = os.open(f"{KEY.hex()}.kvb", os.O_RDONLY, dir_fd=root)
        try:
            assert xxcopy.xxh3_read_check_python(fd, HEAD, KEY, bytearray(32), general, piece) == outcome
        finally:
            os.close(fd)
        if outcome in (CHECK_GOOD, CHECK_SUM):  # read whole: the same bytes on every path
            assert set(rows.values()) == {bytes(general)}
        if outcome == CHECK_GOOD:
            assert bytes(general) == payload
        # Another key names another file: absent here, whatever this one holds.
        for fn in KEY_FNS.values():
            with pytest.raises(FileNotFoundError) as absent:
                fn(root, HEAD, bytes(32), bytearray(n), piece)
            assert absent.value.filename == f"{bytes(32).hex()}.kvb".encode()
    finally:
        os.close(root)


@pytest.mark.parametrize("name", list(KEY_FNS))
def test_bad_arguments_of_a_read_by_key_are_refused_by_name(tmp_path: Path, name: str):
    fn = KEY_FNS[name]
    _write(tmp_path / f"{KEY.hex()}.kvb", 100)
    (tmp_path / f"{bytes(32).hex()}.kvb").symlink_to(tmp_path / f"{KEY.hex()}.kvb")
    root = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as link:  # O_NOFOLLOW: ELOOP, never the file it points to
            fn(root, HEAD, bytes(32), bytearray(100), 0)
        assert link.value.errno == errno.ELOOP
        with pytest.raises(TypeError, match="key: expected a bytes-like object"):
            fn(root, HEAD, "0" * 32, bytearray(100), 0)
        with pytest.raises(TypeError, match=r"row: expected a writable buffer"):
            fn(root, HEAD, KEY, bytes(100), 0)
        with pytest.raises(ValueError, match=r"piece: expected a count of bytes >= 0, got -1"):
            fn(root, HEAD, KEY, bytearray(100), -1)
        with pytest.raises(ValueError, match="dir_fd: expected an open file descriptor, got -1"):
            fn(-1, HEAD, KEY, bytearray(100), 0)
        if name == "native":
            with pytest.raises(TypeError, match=r"expected \(dir_fd, head, key, row, piece\), got 4 arguments"):
                fn(root, HEAD, KEY, bytearray(100))
        assert fn(root, HEAD, KEY, bytearray(100), 0) == CHECK_GOOD
    finally:
        os.close(root)


@pytest.mark.parametrize("name", list(KEY_FNS))
def test_an_absent_record_or_a_symlink_is_refused_at_its_open_by_key(tmp_path: Path, name: str):
    fn = KEY_FNS[name]
    _write(tmp_path / f"{KEY.hex()}.kvb", 100)
    other = bytes(range(32))
    (tmp_path / f"{other.hex()}.kvb").symlink_to(tmp_path / f"{KEY.hex()}.kvb")
    root = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(FileNotFoundError) as absent:
            fn(root, HEAD, bytes(32), bytearray(100), 0)
        assert absent.value.filename == f"{bytes(32).hex()}.kvb".encode()
        with pytest.raises(OSError) as link:  # O_NOFOLLOW: ELOOP, never the file it points to
            fn(root, HEAD, other, bytearray(100), 0)
        assert link.value.errno == errno.ELOOP and link.value.filename == f"{other.hex()}.kvb".encode()
        with pytest.raises(ValueError, match=r"piece: expected a count of bytes >= 0, got -1"):
            fn(root, HEAD, bytes(32), bytearray(100), -1)  # checked before the open
        assert fn(root, HEAD, KEY, bytearray(100), 0) == CHECK_GOOD
    finally:
        os.close(root)
