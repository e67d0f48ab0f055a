"""benchmarks/bench_file_steps.py: the arms and steps it times and the JSON it prints (no timing asserts)."""

from __future__ import annotations

import json
import sys

import pytest
from bench_modules import bench_module

from kvtier.records import xxcopy

pytestmark = pytest.mark.skipif(not xxcopy.NATIVE, reason="built without the native extension")


def test_prints_each_arm_and_step_per_size(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bench = bench_module("bench_file_steps")
    monkeypatch.setattr(
        sys, "argv", ["bench_file_steps.py", "--rounds", "2", "--blocks", "4", "--sizes", "4096", "65536"]
    )
    bench.main()
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "file_steps" and out["native"] is True and out["load_at_start"] >= 0
    assert [s["block_bytes"] for s in out["sizes"]] == [4096, 65536]
    for size in out["sizes"]:
        assert size["blocks"] == 4 and size["rounds"] == 2
        for name in (*bench.ARMS, *bench.STEPS):
            for clock in ("cpu", "wall"):
                spent = size[f"{name}_{clock}_us"]
                assert 0 < spent["min"] <= spent["median"] <= spent["max"]
            assert size[f"{name}_gb_s"] > 0
        for name in bench.ARMS[1:]:
            assert size[f"{name}_raw_ratio"]["median"] > 0
        assert set(size["gap_us"]) == {"read_and_hash", "job", "hash_alone"} and size["gap_us"]["hash_alone"] > 0


def test_refuses_a_read_of_other_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An arm that reads back other bytes than were saved stops the run (the check is not a no-op)."""
    bench = bench_module("bench_file_steps")
    real = bench._arms

    def spoiled(backend, size, keys, staging):  # type: ignore[no-untyped-def]
        arms = real(backend, size, keys, staging)
        tier = arms["tier"]

        def tier_then_spoil() -> None:
            tier()
            staging[0, 0] ^= 1

        arms["tier"] = tier_then_spoil
        return arms

    monkeypatch.setattr(bench, "_arms", spoiled)
    monkeypatch.setattr(sys, "argv", ["bench_file_steps.py", "--rounds", "1", "--blocks", "2", "--sizes", "4096"])
    with pytest.raises(AssertionError, match="tier read back other bytes"):
        bench.main()
