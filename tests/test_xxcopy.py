"""The fused copy + XXH3 pass (kvtier.records.xxcopy): every path's digest equals xxhash's for
every length class, the copy lands, bad arguments are refused by name, and the extension is
built wherever a C compiler is."""

from __future__ import annotations

import os
import random
import shutil
import sysconfig

import numpy as np
import pytest
import xxhash

from kvtier.records import xxcopy

PATHS = ["python"]
if xxcopy.NATIVE:
    from kvtier.records import _xxcopy  # type: ignore[attr-defined]

    PATHS += list(_xxcopy.paths())


def _fn(path: str):
    if path == "python":
        return xxcopy.xxh3_copy_python
    return lambda *args: _xxcopy.xxh3_64_copy_with(path, *args)


DATA = np.random.default_rng(7).integers(0, 256, size=(6 << 20) + 300, dtype=np.uint8).tobytes()


def _check(fn, prefix: bytes, src: bytes) -> None:
    want = xxhash.xxh3_64(prefix + src).intdigest()
    assert fn(prefix, src) == want, (len(prefix), len(src))
    dst = bytearray(len(src))
    assert fn(prefix, src, dst) == want, (len(prefix), len(src))
    assert dst == src


def test_a_compiler_means_the_extension_is_built():
    """An install with a C compiler must build the native pass; a silent fallback would keep
    every tier on the slower path unnoticed."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if shutil.which(cc) is None or not os.path.exists(header):
        pytest.skip(f"NO C COMPILER ({cc}) OR NO Python.h: kvtier.records._xxcopy NOT BUILT, the Python path runs")
    assert xxcopy.NATIVE, "kvtier.records._xxcopy did not build although a C compiler exists (reinstall: pip install -e .)"
    assert xxcopy.xxh3_copy_native is _xxcopy.xxh3_64_copy
    # The default takes the native function where it has a vector path, else the Python one.
    vector = _xxcopy.path != "scalar"
    assert xxcopy.PATH == (_xxcopy.path if vector else "python")
    assert (xxcopy.xxh3_copy is _xxcopy.xxh3_64_copy) == vector == xxcopy.fused()
    assert (xxcopy.xxh3_joined is _xxcopy.xxh3_64_joined) == vector


@pytest.mark.parametrize("path", PATHS)
def test_every_length_to_2048_with_prefixes(path):
    """Every input length class (0, 1-3, 4-8, 9-16, 17-128, 129-240, stripes, blocks), with
    prefixes that end inside the first stripe, on a stripe edge and past it."""
    fn = _fn(path)
    for n in range(2049):
        for p in (0, 1, 24, 56, 63, 64, 65, 100):
            _check(fn, DATA[:p], DATA[1000 : 1000 + n])


@pytest.mark.parametrize("path", PATHS)
def test_random_lengths_to_a_few_mib(path):
    fn = _fn(path)
    rnd = random.Random(31)
    lengths = [rnd.randrange(2049, 6 << 20) for _ in range(40)] + [1 << k for k in range(11, 23)]
    lengths += [(1 << 20) + d for d in (-65, -64, -63, -1, 1, 63, 64, 65)]
    for n in lengths:
        p = rnd.randrange(0, 101)
        start = rnd.randrange(0, 300)  # unaligned sources too
        _check(fn, DATA[:p], DATA[start : start + n])


@pytest.mark.parametrize("path", PATHS)
def test_long_prefixes(path):
    """A prefix longer than a stripe or a block (not what records use, but right all the same)."""
    fn = _fn(path)
    for p in (200, 240, 241, 1023, 1024, 1025, 3000):
        for n in (0, 1, 16, 63, 64, 65, 1024, 5000):
            _check(fn, DATA[:p], DATA[7 : 7 + n])


@pytest.mark.parametrize("path", PATHS)
def test_buffers_of_any_kind(path):
    """numpy arrays of wider dtypes, memoryviews and bytearrays are read as their bytes."""
    fn = _fn(path)
    src = np.frombuffer(DATA[: 1 << 16], dtype=np.float16)
    dst = np.zeros_like(src)
    assert fn(memoryview(DATA[:56]), src, dst) == xxhash.xxh3_64(DATA[:56] + DATA[: 1 << 16]).intdigest()
    assert dst.tobytes() == DATA[: 1 << 16]
    assert fn(bytearray(b"ab"), memoryview(DATA)[:4096]) == xxhash.xxh3_64(b"ab" + DATA[:4096]).intdigest()


@pytest.mark.parametrize("path", PATHS)
def test_bad_arguments_are_refused_by_name(path):
    fn = _fn(path)
    src = np.arange(4096, dtype=np.uint8)
    with pytest.raises(ValueError, match="dst: holds 4095 bytes, src 4096"):
        fn(b"", src, bytearray(4095))
    with pytest.raises(TypeError, match="dst: expected a writable buffer"):
        fn(b"", src, bytes(4096))
    with pytest.raises(ValueError, match="dst: expected a contiguous buffer"):
        fn(b"", src, np.zeros(8192, dtype=np.uint8)[::2])
    with pytest.raises(ValueError, match="src: expected a contiguous buffer"):
        fn(b"", np.zeros(8192, dtype=np.uint8)[::2])
    with pytest.raises(TypeError, match="src: expected a bytes-like object"):
        fn(b"", "text")
    with pytest.raises(TypeError, match="prefix: expected a bytes-like object"):
        fn(123, src)
    with pytest.raises(TypeError, match="dst: expected a writable bytes-like object"):
        fn(b"", src, 5)
    both = np.zeros(8192, dtype=np.uint8)
    with pytest.raises(ValueError, match="dst: overlaps src"):
        fn(b"", both[:4096], both[100:4196])
    assert fn(b"", both[:4096], both[4096:]) == xxhash.xxh3_64(bytes(4096)).intdigest()


@pytest.mark.skipif(not xxcopy.NATIVE, reason="the native extension is not built")
def test_native_names_its_paths():
    with pytest.raises(ValueError, match="path: 'neon' is not one"):
        _xxcopy.xxh3_64_copy_with("neon", b"", b"x")
    with pytest.raises(TypeError, match="expected \\(prefix, src\\[, dst\\]\\), got 1"):
        _xxcopy.xxh3_64_copy(b"")
    assert "scalar" in _xxcopy.paths()


def test_the_default_function_takes_the_best_path():
    src = DATA[: 3 << 20]
    dst = bytearray(len(src))
    assert xxcopy.xxh3_copy(b"k" * 56, src, dst) == xxhash.xxh3_64(b"k" * 56 + src).intdigest()
    assert dst == src


def _joined(path: str):
    if path == "python":
        return xxcopy.xxh3_joined_python
    assert path == "native"
    return _xxcopy.xxh3_64_joined


JOINED_PATHS = ["python", *(["native"] if xxcopy.NATIVE else [])]


@pytest.mark.parametrize("path", JOINED_PATHS)
def test_joined_is_head_checksum_then_payload(path):
    """``xxh3_joined(head, key, src)``: a whole raw record, its checksum over head, key and
    payload, for every length class (the checksum is xxhash's, little-endian)."""
    fn = _joined(path)
    for n in [*range(0, 300), 1023, 1024, 1025, 4096, 65536, 65537, (1 << 20) + 3]:
        head, key, src = DATA[:24], DATA[100:132], memoryview(DATA)[500 : 500 + n]
        got = fn(head, key, src)
        assert type(got) is bytes
        assert got == head + xxhash.xxh3_64(head + key + bytes(src)).intdigest().to_bytes(8, "little") + bytes(src), n


@pytest.mark.parametrize("path", JOINED_PATHS)
def test_joined_refuses_bad_arguments_by_name(path):
    fn = _joined(path)
    with pytest.raises(TypeError, match="src: expected a bytes-like object"):
        fn(b"h", b"k", 7)
    with pytest.raises(TypeError, match="key: expected a bytes-like object"):
        fn(b"h", "k", b"s")
    with pytest.raises(ValueError, match="src: expected a contiguous buffer"):
        fn(b"h", b"k", np.zeros(64, dtype=np.uint8)[::2])


@pytest.mark.skipif(not xxcopy.NATIVE, reason="the native extension is not built")
def test_a_cpu_without_a_vector_path_takes_the_python_path(monkeypatch):
    """The portable scalar path ran slower than the Python one (xxhash's vector code): where it
    is all the extension has, the default functions are the Python ones."""
    import importlib

    try:
        monkeypatch.setattr(_xxcopy, "path", "scalar")
        importlib.reload(xxcopy)
        assert xxcopy.NATIVE and xxcopy.PATH == "python" and not xxcopy.fused()
        assert xxcopy.xxh3_copy is xxcopy.xxh3_copy_python and xxcopy.xxh3_joined is xxcopy.xxh3_joined_python
    finally:
        monkeypatch.undo()
        importlib.reload(xxcopy)
    assert xxcopy.xxh3_copy is (_xxcopy.xxh3_64_copy if _xxcopy.path != "scalar" else xxcopy.xxh3_copy_python)


def test_the_python_path_copies_a_read_only_overlapping_source_right():
    """Overlap is looked for only where the source is writable memory; a read-only view over
    the destination's memory is copied as memmove copies it, and hashed as it was."""
    buf = bytearray(DATA[:8192])
    src = memoryview(buf)[:4096].toreadonly()
    before = bytes(src)
    assert xxcopy.xxh3_copy_python(b"k", src, memoryview(buf)[100:4196]) == xxhash.xxh3_64(b"k" + before).intdigest()
    assert bytes(buf[100:4196]) == before


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("plen", "slen"), [(300, 1), (300, 10), (300, 63), (300, 64), (400, 100), (100, 10)])
def test_a_row_over_the_prefix_gives_the_digest_of_the_prefix_as_it_was(path, plen, slen):
    """``dst`` may overlap ``prefix`` (not ``src``): the digest is of the prefix as it was given,
    on every path, whatever part of the pass reads it (the last stripe of a long input whose
    ``src`` is under a stripe long is made of prefix bytes)."""
    fn = _fn(path)
    buf = bytearray(range(256)) * 2
    view = memoryview(buf)
    prefix, src = view[:plen], bytes(range(7, 7 + slen))
    want = xxhash.xxh3_64(bytes(prefix) + src).intdigest()
    assert fn(prefix, src, view[plen - slen : plen]) == want
    assert bytes(view[plen - slen : plen]) == src
