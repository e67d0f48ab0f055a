"""benchmarks/bench_lmdb_steps.py: the arms and steps it times and the JSON it prints (no timing asserts)."""

from __future__ import annotations

import sys

import pytest
from bench_modules import assert_spent, bench_module, steps_printed
from kvtier.backends import lmdb_plain

from kvtier.records import xxcopy

pytestmark = pytest.mark.skipif(
    not xxcopy.NATIVE or lmdb_plain.straight_read is None, reason="built without the native extensions"
)


def test_prints_each_arm_and_step_per_size(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bench, sizes = steps_printed(monkeypatch, capsys, "lmdb_steps", [4096, 65536])
    for size in sizes:
        arms = [name for name in bench.ARMS if f"{name}_cpu_us" in size]
        assert set(bench.ARMS) - set(arms) <= {"raw_cget"}  # (only where LMDB's own get is probed)
        assert_spent(size, (*arms, *bench.STEPS))
        for name in arms[1:]:
            assert size[f"{name}_raw_ratio"]["median"] > 0
        gap = size["gap_us"]
        assert set(gap) == {"frame", "frame_alone", "frame_loads", "native_over_raw", "steps", "checks_sum"}
        assert set(gap["steps"]) == set(bench.STEPS) and gap["checks_sum"] > 0


@pytest.mark.parametrize("arm", ["tier", "native", "native_framed"])
def test_refuses_a_read_of_other_bytes(monkeypatch: pytest.MonkeyPatch, arm: str) -> None:
    """An arm that reads back other bytes than were saved stops the run (the check is not a no-op)."""
    bench = bench_module("bench_lmdb_steps")
    real = bench._arms

    def spoiled(backend, raw_env, raw_db, size, keys, staging):  # type: ignore[no-untyped-def]
        arms = real(backend, raw_env, raw_db, size, keys, staging)
        read = arms[arm]

        def read_then_spoil() -> None:
            read()
            staging[0, 0] ^= 1

        arms[arm] = read_then_spoil
        return arms

    monkeypatch.setattr(bench, "_arms", spoiled)
    monkeypatch.setattr(sys, "argv", ["bench_lmdb_steps.py", "--rounds", "1", "--blocks", "2", "--sizes", "4096"])
    with pytest.raises(AssertionError, match=f"{arm} read back other bytes"):
        bench.main()


@pytest.mark.parametrize("arm", ["native", "native_framed"])
def test_refuses_a_native_read_that_hands_the_job_over(monkeypatch: pytest.MonkeyPatch, arm: str) -> None:
    """The native arms time the native read itself: a job it hands to the general path stops the run."""
    bench = bench_module("bench_lmdb_steps")
    real = bench._arms

    def only(backend, raw_env, raw_db, size, keys, staging):  # type: ignore[no-untyped-def]
        arms = real(backend, raw_env, raw_db, size, keys, staging)
        return {name: read for name, read in arms.items() if name not in ("native", "native_framed") or name == arm}

    monkeypatch.setattr(bench, "_arms", only)
    monkeypatch.setattr(lmdb_plain, "straight_read", lambda *args: None)
    monkeypatch.setattr(sys, "argv", ["bench_lmdb_steps.py", "--rounds", "1", "--blocks", "2", "--sizes", "4096"])
    with pytest.raises(AssertionError, match="handed the job over"):
        bench.main()
