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


@pytest.mark.parametrize("tier", ["lmdb", "file"])
def test_a_cell_reports_its_ratios_and_the_checked_ceiling(tier: str, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_disk_sizes as bench
    finally:
        sys.path.pop(0)
    cell = bench._cell(str(tmp_path), tier, 4096, 2, 1, 1, 4)
    assert cell["blocks"] == 4 and "raw_checked_load_gbps" in cell
    assert cell["best_raw_save"] != "raw_checked" and cell["best_raw_load"] != "raw_checked"  # informational, never the baseline
    for name in ("save_ratio_paired", "save_ratio_paired_shape", "load_ratio_paired", "load_ratio_paired_shape", "load_ceiling_ratio_paired"):
        assert cell[name] > 0, name
    # Against one shape, never above the best of every shape round by round.
    assert cell["save_ratio_paired_shape"] >= cell["save_ratio_paired"]
    assert cell["load_ratio_paired_shape"] >= cell["load_ratio_paired"]
