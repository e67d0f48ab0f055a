"""benchmarks/bench_file_steps.py: the arms and steps it times and the JSON it prints (no timing asserts)."""

from __future__ import annotations

import sys

import pytest
from bench_modules import assert_spent, bench_module, steps_printed

from kvtier.records import xxcopy

pytestmark = pytest.mark.skipif(not xxcopy.NATIVE, reason="built without the native extension")


def test_prints_each_arm_and_step_per_size(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bench, sizes = steps_printed(monkeypatch, capsys, "file_steps", [4096, 65536])
    for size in sizes:
        assert_spent(size, (*bench.ARMS, *bench.STEPS))
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


def test_a_slow_arm_still_prints_a_rate() -> None:
    """An arm slowed to a millisecond a 4 KiB record (a loaded machine) prints its GB/s as a
    positive figure, not one rounded to nothing."""
    bench = bench_module("bench_file_steps")
    out = bench.figures(["raw"], [], {"raw": [900.0, 1100.0]}, {"raw": [900.0, 1100.0]}, 4096, 4, 2)
    assert 0 < out["raw_gb_s"] < 0.005
    assert abs(out["raw_gb_s"] / (4096 / 1000.0 / 1e3) - 1) < 0.01  # (three figures)
