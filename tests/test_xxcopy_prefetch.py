"""The vector passes: a copying one prefetches the destination ahead of its stores, for writing
(PREFETCHW) where the CPU has it, else for reading: either way the bytes copied and the digest
are xxhash's, on every vector path, and a prefetch past the end of a row (or of a source) that
ends at an inaccessible page never faults; one that only hashes takes AVX-512 from 64 KiB where
the CPU has it, with the same answers."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import xxhash

from kvtier.records import xxcopy

pytestmark = pytest.mark.skipif(not xxcopy.NATIVE, reason="the native extension is not built")

if xxcopy.NATIVE:
    from kvtier.records import _xxcopy  # type: ignore[attr-defined]

    VECTOR_PATHS = [p for p in _xxcopy.paths() if p != "scalar"]
else:
    VECTOR_PATHS = []

PAGE = mmap.PAGESIZE
DATA = np.random.default_rng(11).integers(0, 256, size=(3 << 20) + 500, dtype=np.uint8).tobytes()


def _settings() -> list[bool]:
    """The prefetch kinds this CPU can run: for reading always, for writing where it has it."""
    was = _xxcopy.prefetch_writes()
    try:
        _xxcopy.prefetch_writes(True)
    except ValueError:
        return [False]
    finally:
        _xxcopy.prefetch_writes(was)
    return [False, True]


@pytest.fixture(params=[False, True], ids=["prefetch-read", "prefetch-write"])
def setting(request):
    if request.param not in _settings():
        pytest.skip("this CPU has no PREFETCHW")
    was = _xxcopy.prefetch_writes(request.param)
    try:
        yield request.param
    finally:
        _xxcopy.prefetch_writes(was)


@pytest.mark.parametrize("path", VECTOR_PATHS)
def test_copies_and_digests_are_xxhash_whichever_prefetch(path, setting):
    assert _xxcopy.prefetch_writes() is setting
    for n in [0, 1, 63, 64, 65, 1023, 1024, 1025, 4096, 65536 + 7, 262144, (2 << 20) + 64, 3 << 20]:
        for p in (0, 56):
            src = DATA[300 : 300 + n]
            dst = bytearray(len(src))
            assert _xxcopy.xxh3_64_copy_with(path, DATA[:p], src, dst) == xxhash.xxh3_64(DATA[:p] + src).intdigest(), (n, p)
            assert dst == src, (n, p)


def test_a_check_copy_is_the_general_answer_whichever_prefetch(setting):
    """The one-call check of a record (good, and each kind of damage), on the default path,
    answers and copies as the Python path does with either prefetch."""
    head, key, n = DATA[:24], DATA[24:56], 262144
    payload = DATA[1000 : 1000 + n]
    stored = head + xxhash.xxh3_64(head + key + payload).intdigest().to_bytes(8, "little")
    damaged = bytearray(payload)
    damaged[n // 2] ^= 1
    cases = [
        (stored, payload),  # good
        (stored, bytes(damaged)),  # payload
        (stored[:-1] + bytes([stored[-1] ^ 1]), payload),  # checksum
        (bytes([head[0] ^ 1]) + stored[1:], payload),  # head
        (stored + b"x", payload),  # length
    ]
    for stored_, payload_ in cases:
        native, general = bytearray(n), bytearray(n)
        got = xxcopy.xxh3_check_copy_native(head, key, stored_, native, payload_)
        assert got == xxcopy.xxh3_check_copy_python(head, key, stored_, general, payload_)
        assert native == general


def _guarded(length: int):
    """A writable numpy view of ``length`` bytes that end where an inaccessible page begins, and
    the mapping to close."""
    span = (length + PAGE - 1) // PAGE * PAGE + PAGE
    m = mmap.mmap(-1, span)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + span - PAGE, PAGE, 0) == 0, ctypes.get_errno()  # PROT_NONE
    view = np.frombuffer(m, dtype=np.uint8, count=length, offset=span - PAGE - length)
    return view, m


@pytest.mark.parametrize("path", VECTOR_PATHS)
def test_a_row_and_a_source_that_end_at_an_inaccessible_page(path, setting):
    """The pass prefetches lines up to a KiB past the row's and the source's ends: those
    prefetches are dropped, never a fault."""
    for n in (4096, 65536, 262144 + 64):
        dst, dst_map = _guarded(n)
        src, src_map = _guarded(n)
        try:
            src[:] = np.frombuffer(DATA, dtype=np.uint8, count=n, offset=77)
            assert _xxcopy.xxh3_64_copy_with(path, b"k" * 56, src, dst) == xxhash.xxh3_64(b"k" * 56 + DATA[77 : 77 + n]).intdigest()
            assert dst.tobytes() == DATA[77 : 77 + n]
        finally:
            del dst, src
            dst_map.close()
            src_map.close()


def test_the_setting_is_named_and_refused_with_bad_arguments():
    was = _xxcopy.prefetch_writes()
    assert type(was) is bool
    assert was == (True in _settings())  # on at import wherever the CPU has it
    assert _xxcopy.prefetch_writes(False) is was
    assert _xxcopy.prefetch_writes(None) is False
    _xxcopy.prefetch_writes(was)
    with pytest.raises(TypeError, match=r"expected \(on=None\), got 2"):
        _xxcopy.prefetch_writes(True, False)


def test_a_pass_that_only_hashes_takes_the_widest_path_from_64_kib():
    """Without a row, a pass of 64 KiB or more runs on AVX-512 where the CPU has it (the
    ``file`` tier checks its rows where the read put them): the digest and the one-call check's
    answers are those of xxhash and of the Python path on either side of that size, for good
    records and each kind of damage."""
    assert _xxcopy.hash_path == ("avx512" if "avx512" in _xxcopy.paths() else _xxcopy.path)
    head, key = DATA[:24], DATA[24:56]
    for n in (4096, 65535, 65536, 65537, 262144, (2 << 20) + 1):
        payload = DATA[700 : 700 + n]
        assert _xxcopy.xxh3_64_copy(head + key, payload) == xxhash.xxh3_64(head + key + payload).intdigest(), n
        stored = head + xxhash.xxh3_64(head + key + payload).intdigest().to_bytes(8, "little")
        damaged = bytearray(payload)
        damaged[-1] ^= 0x80
        for stored_, payload_ in ((stored, payload), (stored, bytes(damaged)), (stored[:30] + b"\0\0", payload), (b"x" + stored[1:], payload)):
            got = xxcopy.xxh3_check_copy_native(head, key, stored_, None, payload_)
            assert got == xxcopy.xxh3_check_copy_python(head, key, stored_, None, payload_), n
        assert xxcopy.xxh3_check_copy_native(head, key, stored, None, payload) == xxcopy.CHECK_GOOD
        assert xxcopy.xxh3_check_copy_native(head, key, stored, None, bytes(damaged)) == xxcopy.CHECK_SUM
