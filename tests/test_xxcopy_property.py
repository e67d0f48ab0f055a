"""A property test of the fused copy + XXH3 pass (kvtier.records.xxcopy) on every path: for any
prefix, payload length and alignment of the source and of the destination (each a view at an
offset into a larger buffer), the digest is ``xxhash.xxh3_64(prefix + src)``, the destination
holds exactly the source, and not one byte around the destination is written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.records import xxcopy

PATHS = ["python"]
if xxcopy.NATIVE:
    from kvtier.records import _xxcopy  # type: ignore[attr-defined]

    PATHS += list(_xxcopy.paths())

GUARD = 128  # bytes on each side of a destination that must stay as they were
DATA = np.random.default_rng(11).integers(0, 256, size=(1 << 20) + 4096, dtype=np.uint8).tobytes()

# Lengths around every edge of the algorithm: the short classes, 240, stripes (64), blocks (1024).
EDGES = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025]
lengths = st.one_of(
    st.integers(0, 300),
    st.sampled_from(EDGES).flatmap(lambda e: st.integers(max(0, e - 65), e + 65)),
    st.integers(0, 64).map(lambda k: k * 1024 + 1).flatmap(lambda e: st.integers(max(0, e - 70), e + 70)),
    st.integers(300, 1 << 20),
)


def _fn(path: str) -> Callable[..., int]:
    if path == "python":
        return xxcopy.xxh3_copy_python
    return lambda *args: _xxcopy.xxh3_64_copy_with(path, *args)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    prefix_len=st.one_of(st.integers(0, 80), st.integers(81, 1100)),
    n=lengths,
    src_at=st.integers(0, 63),
    dst_at=st.integers(0, 63),
    start=st.integers(0, 4000),
)
def test_any_prefix_length_and_alignment_gives_xxhashs_digest_and_an_exact_copy(
    path: str, prefix_len: int, n: int, src_at: int, dst_at: int, start: int
) -> None:
    fn = _fn(path)
    prefix = DATA[start : start + prefix_len]
    # The source: a view at ``src_at`` bytes into a buffer (not a fresh, aligned object).
    source_buf = bytearray(src_at + n)
    source_buf[src_at:] = DATA[start : start + n] if start + n <= len(DATA) else DATA[:n]
    src = memoryview(source_buf)[src_at:]
    want = xxhash.xxh3_64(prefix + bytes(src)).intdigest()
    assert fn(prefix, src) == want
    # The destination: a view at ``dst_at`` into a buffer with guard bytes on both sides.
    fill = 0xA5
    dst_buf = np.full(GUARD + dst_at + n + GUARD, fill, dtype=np.uint8)
    dst: Any = dst_buf[GUARD + dst_at : GUARD + dst_at + n]
    assert fn(prefix, src, dst) == want
    assert dst.tobytes() == bytes(src)
    assert not np.any(dst_buf[: GUARD + dst_at] != fill) and not np.any(dst_buf[GUARD + dst_at + n :] != fill)
    # The source is only read.
    assert bytes(src) == bytes(source_buf[src_at:])
