"""benchmarks/bench_disk_sizes.py: the grid it measures (no timing asserts)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest
from bench_modules import bench_module


@pytest.mark.parametrize("quick", [True, False])
def test_every_cell_of_a_size_moves_the_same_blocks(quick: bool) -> None:
    bench = bench_module("bench_disk_sizes")
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
    bench = bench_module("bench_disk_sizes")
    cell = bench._cell(str(tmp_path), tier, 4096, 2, 1, 1, 4)
    assert cell["blocks"] == 4 and "raw_checked_load_gbps" in cell
    assert cell["best_raw_save"] != "raw_checked" and cell["best_raw_load"] != "raw_checked"  # informational, never the baseline
    if "raw_cget_load_gbps" in cell:  # lmdb, where the direct lookups are built: the reference load, never the baseline
        assert cell["best_raw_load"] != "raw_cget" and cell["load_ratio_cget_paired"] > 0 and cell["cget_over_best_raw_load_paired"] > 0
        assert cell["load_cpu_ratio_cget_paired"] > 0
    for name in ("save_ratio_paired", "save_ratio_paired_shape", "load_ratio_paired", "load_ratio_paired_shape", "load_ceiling_ratio_paired"):
        assert cell[name] > 0, name
    # Against one shape, never above the best of every shape round by round.
    assert cell["save_ratio_paired_shape"] >= cell["save_ratio_paired"]
    assert cell["load_ratio_paired_shape"] >= cell["load_ratio_paired"]
    # One caller: the loads in thread CPU too; several: none (their threads are not this one).
    low, high = cell["load_cpu_ratio_paired_spread"]
    assert 0 < low <= cell["load_cpu_ratio_paired"] <= high and cell["load_cpu_ceiling_ratio_paired"] > 0
    low, high = cell["save_cpu_ratio_paired_spread"]  # the counted saves likewise
    assert 0 < low <= cell["save_cpu_ratio_paired"] <= high
    several = bench._cell(str(tmp_path), tier, 4096, 2, 2, 1, 8)
    assert "load_cpu_ratio_paired" not in several and "save_cpu_ratio_paired" not in several


@pytest.mark.parametrize("tier", ["lmdb", "file"])
def test_each_operation_is_timed_by_one_arm_a_round_after_the_filesystem_settled(tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Arms that make the same calls are not all timed (the luckier of two draws of one
    operation was each round's baseline); every arm starts after one untimed settle."""
    bench = bench_module("bench_disk_sizes")
    settled: list[str] = []
    monkeypatch.setattr(bench, "_settle", settled.append)
    lmdb = tier == "lmdb"
    same_save, loader = ("raw_value", "raw_job") if lmdb else ("raw_each", "raw_batch")
    one = bench._cell(str(tmp_path), tier, 4096, 1, 1, 1, 4)  # jobs of one: the twin save does not run
    arms = 1 + (len(bench.LMDB_SHAPES) + 1 if lmdb else len(bench.FILE_SHAPES)) - 1  # lmdb: raw_cget too
    assert len(settled) == 2 * arms  # a warm-up round and a counted one
    assert f"{same_save}_save_blocks_s" not in one and f"{loader}_save_blocks_s" in one
    loads = {k[: -len("_load_gbps")] for k in one if k.endswith("_load_gbps")}
    cget = {"raw_cget"} if lmdb and "raw_cget_load_gbps" in one else set()  # where the direct lookups are built
    assert loads == ({"tier", "raw_job", "raw_checked"} | cget if lmdb else {"tier", "raw_batch", "raw_sharded", "raw_checked"})
    assert one["best_raw_load"] == loader
    several = bench._cell(str(tmp_path), tier, 4096, 2, 1, 1, 4)
    assert f"{same_save}_save_blocks_s" in several and f"{same_save}_load_gbps" not in several


def test_a_tier_save_is_handed_lists_built_before_the_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier's timed saves are handed each job's key and block lists built before its clock
    starts, as its loads are (a raw arm indexes its lists and builds none): an ``lmdb`` arm
    saves each job twice a round (into a fresh store, then the counted save), and both get the
    very same list objects."""
    from kvtier import registry

    bench = bench_module("bench_disk_sizes")
    kind = registry.backends.get("lmdb")
    handed: dict[bytes, list[tuple[list[bytes], list[object]]]] = defaultdict(list)
    real = kind.write_blocks

    def hand(self: object, keys: list[bytes], blocks: list[object]) -> object:
        if len(keys) == 2:  # a job's (the spare record is saved alone)
            handed[keys[0]].append((keys, blocks))
        return real(self, keys, blocks)

    monkeypatch.setattr(kind, "write_blocks", hand)
    bench._cell(str(tmp_path), "lmdb", 4096, 2, 1, 1, 4)  # two rounds (one warm-up), two jobs of two
    assert len(handed) == 2
    for calls in handed.values():
        assert len(calls) == 4  # two rounds of a fresh and a counted save
        for fresh, counted in (calls[:2], calls[2:]):
            assert fresh[0] is counted[0] and fresh[1] is counted[1]


def test_quick_runs_count_an_odd_number_of_rounds_and_fewer_blocks(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--quick`` counts an odd number of rounds (more than the 2 it counted, whose median was
    their mean), so each paired median is one round's ratio, and caps a cell's blocks lower."""
    import json

    bench = bench_module("bench_disk_sizes")
    counted: list[tuple[int, int]] = []

    def cell(root: str, tier: str, size: int, job: int, callers: int, rounds: int, n: int, rows: str = "pool") -> dict[str, object]:
        counted.append((rounds, n))
        return {"tier": tier, "record_bytes": size, "save_ratio": 1.0, "load_ratio": 1.0}

    monkeypatch.setattr(bench, "_cell", cell)
    for quick, want in ((True, bench.QUICK_ROUNDS), (False, bench.ROUNDS)):
        counted.clear()
        monkeypatch.setattr(sys, "argv", ["bench_disk_sizes.py", *(["--quick"] if quick else []), "--tiers", "lmdb", "--sizes", "4096"])
        bench.main()
        assert json.loads(capsys.readouterr().out)["rounds"] == want
        assert {r for r, _ in counted} == {want} and want % 2 == 1
    assert bench.QUICK_ROUNDS > 2
    quick_blocks = {n for size, _, _, n in bench.plan([4096], quick=True)}
    assert quick_blocks == {bench.QUICK_MOST_BLOCKS} and bench.QUICK_MOST_BLOCKS < bench.MOST_BLOCKS


def test_bench_disk_quick_counts_an_odd_number_of_save_rounds(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench_disk.py --quick`` hands its parts an odd round count (its medians are one round's)."""
    import torch
    from kvtier.tools.bench.scripts import bench_disk

    handed: list[int] = []

    def part(root: str, blocks: list[torch.Tensor], repeat: int, sync_mode: str = "durable") -> dict[str, int]:
        handed.append(repeat)
        return {}

    monkeypatch.setattr(bench_disk, "kv_like_blocks", lambda n: [])
    monkeypatch.setattr(bench_disk, "bench_lmdb", part)
    monkeypatch.setattr(bench_disk, "bench_file", part)
    monkeypatch.setattr(sys, "argv", ["bench_disk.py", "--quick", "--only", "lmdb", "file"])
    bench_disk.main()
    capsys.readouterr()
    assert handed == [bench_disk.QUICK_REPEAT] * 2 and bench_disk.QUICK_REPEAT % 2 == 1 and bench_disk.QUICK_REPEAT > 3


def test_a_raw_arm_converts_no_tensor_in_its_timed_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its rows' views are made before the clock, as the tier keeps its own: ``Tensor.numpy()``
    per row (1.5 us) in the timed loop cost a 4 KiB raw get 3.6-4.3 us a record against 1.4-1.7."""
    import torch

    bench = bench_module("bench_disk_sizes")
    keys = [bytes([i]) * 32 for i in range(3)]
    blocks = [torch.full((4096,), i + 1, dtype=torch.uint8) for i in range(3)]
    outs = [torch.zeros(4096, dtype=torch.uint8) for _ in range(3)]
    env, db = bench._raw_lmdb(str(tmp_path / "lmdb"), 1 << 24)
    (tmp_path / "files").mkdir()
    arms = [
        bench._raw_lmdb_put(env, db, keys, blocks, per_job=True),
        bench._raw_lmdb_get(env, db, keys, outs, checked=True),
        bench._raw_file_write(str(tmp_path / "files"), blocks, "batch"),
    ]

    def refused(self: torch.Tensor) -> None:
        raise AssertionError("a tensor converted in a timed call")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "numpy", refused)
        for arm in arms:
            arm(range(3))
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    read = bench._raw_file_read(str(tmp_path / "files"), [torch.zeros(4096, dtype=torch.uint8) for _ in range(3)], False)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "numpy", refused)
        read(range(3))
    arms[2].close()
    env.close()


@pytest.mark.parametrize("tier", ["lmdb", "file"])
def test_the_tier_arms_take_pool_rows_by_default_and_lists_of_views_when_asked(tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rows="pool"`` (the default): each job's blocks and rows are PoolRows of one pool (the
    engine's path), ``"views"``: lists of views of the same rows; the cell says which."""
    from kvtier import registry
    from kvtier.pool_rows import PoolRows

    bench = bench_module("bench_disk_sizes")
    kind = registry.backends.get(tier)
    handed: list[type] = []
    real_write, real_read = kind.write_blocks, kind.read_blocks
    monkeypatch.setattr(kind, "write_blocks", lambda self, keys, blocks: (len(keys) == 2 and handed.append(type(blocks))) or real_write(self, keys, blocks))
    monkeypatch.setattr(kind, "read_blocks", lambda self, keys, out: (len(keys) == 2 and handed.append(type(out))) or real_read(self, keys, out))
    for rows, want in (("pool", PoolRows), ("views", list)):
        handed.clear()
        cell = bench._cell(str(tmp_path), tier, 4096, 2, 1, 1, 4, rows)
        assert cell["rows"] == rows
        assert handed and all(t is want for t in handed)  # (jobs of two: the lmdb arm's emptying saves a spare record alone)
