"""benchmarks/bench_pool_rows.py: the arms it alternates and the JSON it prints (no timing asserts)."""

from __future__ import annotations

import json
import sys

import pytest
from bench_modules import bench_module
from kvtier.backends.lmdb_tier import LmdbBackend


def test_prints_both_arms_and_the_raw_baseline_per_size(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bench = bench_module("bench_pool_rows")
    flags: list[bool] = []
    inner = LmdbBackend.read_blocks

    def spy(self, keys, out):  # type: ignore[no-untyped-def]
        flags.append(type(self).takes_pool_rows)
        return inner(self, keys, out)

    monkeypatch.setattr(LmdbBackend, "read_blocks", spy)
    monkeypatch.setattr(sys, "argv", ["bench_pool_rows.py", "--rounds", "2", "--sizes", "4096", "8192", "--blocks", "4"])
    bench.main()
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "pool_rows" and out["durable"] is False and out["load_at_start"] >= 0
    assert [s["block_bytes"] for s in out["sizes"]] == [4096, 8192]
    for size in out["sizes"]:
        assert size["blocks_per_job"] == 4 and size["rounds"] == 2
        for kind in ("save", "load"):
            for arm in ("pool_rows", "views", "raw"):
                cpu = size[f"{kind}_{arm}_cpu_us"]
                assert cpu["min"] <= cpu["median"] <= cpu["max"] and size[f"{kind}_{arm}_wall_us"]["median"] > 0
            assert size[f"{kind}_views_over_pool_rows"]["median"] > 0
            assert size[f"{kind}_pool_rows_raw_ratio"] > 0 and size[f"{kind}_views_raw_ratio"] > 0
    assert flags.count(True) == flags.count(False) == 2 * 3  # per size: a warm-up and 2 rounds of each arm
    assert LmdbBackend.takes_pool_rows is True  # put back
