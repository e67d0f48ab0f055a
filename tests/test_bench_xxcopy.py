"""benchmarks/bench_xxcopy.py: the arms it measures and the JSON it prints (no timing asserts)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from bench_modules import bench_module

from kvtier.records import xxcopy


def test_prints_every_arm_against_the_raw_copy(monkeypatch, capsys):
    bench = bench_module("bench_xxcopy")
    monkeypatch.setattr(sys, "argv", ["bench_xxcopy.py", "--quick", "--rounds", "2", "--sizes", "4096", "300000", "--spread", "600000"])
    bench.main()
    out = json.loads(capsys.readouterr().out)
    assert out["path"] == xxcopy.PATH and out["native"] == xxcopy.NATIVE
    assert [c["block_bytes"] for c in out["cells"]] == [4096, 300000]
    assert [c["blocks"] for c in out["cells"]] == [146, 2]
    for cell in out["cells"]:
        for arm in ("fused", "python", "copy_then_hash", "hash_only", "xxhash_only"):
            assert cell[f"{arm}_GBps"] > 0 and cell[f"{arm}_ratio"] > 0
        assert cell["raw_copy_GBps"] > 0 and "raw_copy_ratio" not in cell
        assert not any(name.startswith(("fused_scalar", "hash_scalar")) for name in cell)


def test_paths_adds_each_native_path(monkeypatch, capsys):
    bench = bench_module("bench_xxcopy")
    if not xxcopy.NATIVE:
        pytest.skip("the native extension is not built: no paths to add")
    from kvtier.records import _xxcopy

    monkeypatch.setattr(sys, "argv", ["bench_xxcopy.py", "--paths", "--rounds", "1", "--sizes", "5000", "--spread", "5000"])
    bench.main()
    (cell,) = json.loads(capsys.readouterr().out)["cells"]
    for path in _xxcopy.paths():
        assert cell[f"fused_{path}_ratio"] > 0 and cell[f"hash_{path}_GBps"] > 0


def test_every_copying_arm_lands_the_bytes():
    bench = bench_module("bench_xxcopy")
    srcs = [np.full(5000, i + 1, dtype=np.uint8) for i in range(3)]
    for name in bench._arms(srcs, srcs):
        dsts = [np.zeros(5000, dtype=np.uint8) for _ in srcs]
        bench._arms(srcs, dsts)[name]()
        copies = name not in ("hash_only", "xxhash_only")
        assert all(np.array_equal(d, s) == copies for s, d in zip(srcs, dsts)), name
