"""One raw record checked and copied in one call (``kvtier.records.xxcopy.xxh3_check_copy``):
the native function and the Python one give the same outcome, the same row and the same errors
for sound records and every kind of damage, joined or with the payload apart; and the native
one is what the tiers call wherever it is built."""

from __future__ import annotations

import os
import shutil
import struct
import sysconfig
from typing import Any

import numpy as np
import pytest
import xxhash
from xxcopy_forms import forms_of, head_and_key

from kvtier.records import xxcopy
from kvtier.records.xxcopy import CHECK_GOOD, CHECK_HEAD, CHECK_SHAPE, CHECK_SUM

FNS = forms_of("xxh3_check_copy")
RNG = np.random.default_rng(11)
HEAD, KEY = head_and_key(RNG)


def _record(n: int, head: bytes = HEAD, key: bytes = KEY) -> tuple[bytes, bytes]:
    """(stored head and checksum, payload) of a sound record of ``n`` payload bytes."""
    payload = RNG.integers(0, 256, n, dtype=np.uint8).tobytes()
    return head + struct.pack("<Q", xxhash.xxh3_64(head + key + payload).intdigest()), payload


def _both(*args: Any) -> tuple[int, bytes]:
    """Each function's outcome and row for the same record, asserted equal; the row starts as 0x5A."""
    results = []
    for fn in FNS.values():
        row = bytearray(b"\x5a" * len(args[3]))
        call = list(args)
        call[3] = row
        results.append((fn(*call), bytes(row)))
    assert all(r == results[0] for r in results), [r[0] for r in results]
    return results[0]


def test_a_compiler_means_the_native_check_is_the_one_called():
    """A silent fallback would keep every small-record load on the slower Python path."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip(f"NO C COMPILER ({cc}) OR NO Python.h: kvtier.records._xxcopy NOT BUILT, the Python path runs")
    assert xxcopy.NATIVE and xxcopy.xxh3_check_copy_native is not None, "reinstall: pip install -e ."
    assert (xxcopy.xxh3_check_copy is xxcopy.xxh3_check_copy_native) == xxcopy.fused()


@pytest.mark.parametrize("n", [0, 1, 16, 200, 216, 217, 1000, 4096, 65536, 262147])
def test_a_sound_record_is_copied_and_good_joined_or_apart(n):
    stored, payload = _record(n)
    for args in ((HEAD, KEY, stored + payload, bytes(n)), (HEAD, KEY, stored, bytes(n), payload)):
        status, row = _both(*args)
        assert status == CHECK_GOOD and row == payload, n
    # any buffer kind: a read-only memoryview of the value, a numpy row
    for fn in FNS.values():
        out = np.zeros(n, dtype=np.uint8)
        assert fn(HEAD, KEY, memoryview(stored + payload), out) == CHECK_GOOD and out.tobytes() == payload


@pytest.mark.parametrize("n", [100, 4096, 65536])
def test_every_kind_of_damage_is_told_apart_alike(n):
    stored, payload = _record(n)
    value = bytearray(stored + payload)
    untouched = b"\x5a" * n

    def flipped(at: int) -> bytes:
        damaged = bytearray(value)
        damaged[at] ^= 0x04
        return bytes(damaged)

    # a flipped payload byte (first, middle, last), a flipped checksum byte: copied, checksum off
    for at in (32, 32 + n // 2, 32 + n - 1, 24, 31):
        assert _both(HEAD, KEY, flipped(at), bytes(n))[0] == CHECK_SUM, at
    # the key is part of the checksum
    assert _both(HEAD, bytes(32), bytes(value), bytes(n))[0] == CHECK_SUM
    # a flipped head byte (the magic, the version, a length): the row is not touched
    for at in (0, 4, 12, 23):
        assert _both(HEAD, KEY, flipped(at), bytes(n)) == (CHECK_HEAD, untouched), at
    # a record of another version: the store's head differs in that byte
    other = HEAD[:4] + bytes([HEAD[4] ^ 1]) + HEAD[5:]
    assert _both(other, KEY, bytes(value), bytes(n)) == (CHECK_HEAD, untouched)
    # short and long values, joined and apart: not a record for this row, the row untouched
    for bad in (bytes(value[:-1]), bytes(value) + b"\0", bytes(value[:31])):
        assert _both(HEAD, KEY, bad, bytes(n)) == (CHECK_SHAPE, untouched)
    assert _both(HEAD, KEY, stored, bytes(n), payload[:-1]) == (CHECK_SHAPE, untouched)
    assert _both(HEAD, KEY, stored, bytes(n), payload + b"\0") == (CHECK_SHAPE, untouched)
    assert _both(HEAD, KEY, stored + b"\0", bytes(n), payload) == (CHECK_SHAPE, untouched)
    assert _both(HEAD, KEY, stored[:-1], bytes(n), payload) == (CHECK_SHAPE, untouched)
    assert _both(HEAD, KEY, stored, bytes(n + 1), payload)[0] == CHECK_SHAPE


@pytest.mark.parametrize("path", list(FNS))
def test_bad_arguments_are_refused_by_name(path):
    fn = FNS[path]
    stored, payload = _record(64)
    value = stored + payload
    with pytest.raises(TypeError, match="head: expected a bytes-like object"):
        fn("head", KEY, value, bytearray(64))
    with pytest.raises(TypeError, match="key: expected a bytes-like object"):
        fn(HEAD, 7, value, bytearray(64))
    with pytest.raises(TypeError, match="stored: expected a bytes-like object"):
        fn(HEAD, KEY, None, bytearray(64))
    with pytest.raises(TypeError, match="dst: expected a writable buffer"):
        fn(HEAD, KEY, value, bytes(64))
    with pytest.raises(ValueError, match="dst: expected a contiguous buffer"):
        fn(HEAD, KEY, value, np.zeros(128, dtype=np.uint8)[::2])
    with pytest.raises(TypeError, match="payload: expected a bytes-like object"):
        fn(HEAD, KEY, stored, bytearray(64), 5)
    both = bytearray(value) + bytearray(64)
    view = memoryview(both)
    with pytest.raises(ValueError, match="dst: overlaps the payload"):
        fn(HEAD, KEY, view[: len(value)], view[len(value) - 64 + 1 : len(value) + 1])
    assert fn(HEAD, KEY, view[: len(value)], view[len(value) :]) == CHECK_GOOD and bytes(view[len(value) :]) == payload


@pytest.mark.parametrize("n", [0, 5, 216, 217, 4096, 65536])
def test_without_a_row_the_record_is_checked_where_it_is(n):
    """``dst`` ``None``: the same outcomes for a record checked in place (a row a read filled),
    on both paths, joined or apart, and nothing is written anywhere."""
    stored, payload = _record(n)
    for fn in FNS.values():
        value = bytearray(stored + payload)
        assert fn(HEAD, KEY, value, None) == CHECK_GOOD
        assert fn(HEAD, KEY, stored, None, payload) == CHECK_GOOD
        assert fn(HEAD, KEY, bytes(value[:31]), None) == CHECK_SHAPE
        assert fn(HEAD, KEY, stored + b"\0", None, payload) == CHECK_SHAPE
        assert fn(HEAD[:-1] + b"\0", KEY, value, None) == CHECK_HEAD
        assert fn(HEAD, bytes(32), stored, None, payload) == CHECK_SUM
        if n:
            value[-1] ^= 1
            assert fn(HEAD, KEY, value, None) == CHECK_SUM
            assert fn(HEAD, KEY, stored, None, bytes(value[32:])) == CHECK_SUM
        assert bytes(value[:32]) == stored


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("apart", [False, True])
def test_a_row_over_the_stored_head_or_checksum_is_refused(name, apart):
    """A ``dst`` that overlaps the stored head or checksum (not the payload) is refused as the
    payload's overlap is, on both paths, and nothing is written: copying into it would overwrite
    the checksum the copy is then compared with (a sound record read as damaged, the caller's
    stored bytes changed)."""
    fn = FNS[name]
    stored, payload = _record(16)
    record = bytearray(stored + payload) if not apart else bytearray(stored)
    view = memoryview(record)
    before = bytes(record)
    for at in (0, len(HEAD) - 16, len(HEAD) - 8):  # over the head, then head and checksum, up to the payload
        args = (HEAD, KEY, view, view[at : at + 16]) + ((payload,) if apart else ())
        with pytest.raises(ValueError, match="dst: overlaps stored"):
            fn(*args)
        assert bytes(record) == before
    # apart from the stored bytes the same record is sound
    assert fn(HEAD, KEY, bytes(record), bytearray(16), *((payload,) if apart else ())) == CHECK_GOOD
