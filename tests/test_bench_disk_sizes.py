"""benchmarks/bench_disk_sizes.py: the grid it measures (no timing asserts)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("quick", [True, False])
def test_every_cell_of_a_size_moves_the_same_blocks(quick: bool) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_disk_sizes as bench
    finally:
        sys.path.pop(0)
    cells = bench.plan(bench.SIZES, quick=quick)
    counts: dict[int, set[int]] = defaultdict(set)
    for size, job, callers, n in cells:
        counts[size].add(n)
        assert n % (job * callers) == 0 and n >= 2 * job * callers  # whole jobs, at least two per caller
    assert set(counts) == set(bench.SIZES)
    # At 2 MiB, jobs of 1 once read 4 blocks where jobs of 16 read 32: they measured the cache.
    assert all(len(n) == 1 for n in counts.values()), dict(counts)
    assert {(job, callers) for size, job, callers, _ in cells if size == 2 << 20} >= {(1, 1), (16, 1)}
