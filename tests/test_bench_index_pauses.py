"""``benchmarks/bench_index_pauses.py``: the JSON shape and its sanity (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.manager import _probe, lookups  # type: ignore[attr-defined]

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")
def test_the_pause_benchmark_fills_each_arm_and_reports_its_calls() -> None:
    """Two builds' arms (here the same extension, loaded a second time under its file name), each
    kind of index, two rounds: every arm reports its longest calls, median and total, with a
    range, and the longest call of all is the longer of the two kinds of call it splits into."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_index_pauses.py"), "--keys", "5000", "--rounds", "2",
         "--old", _probe.__file__],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["keys"] == 5000 and result["rounds"] == 2 and len(result["loadavg"]) == 3
    for arm in ("disk_new", "disk_old", "memory_new", "memory_old"):
        figures = result[arm]
        low, high = figures["longest_ms_range"]
        assert 0 < low <= figures["longest_ms"] <= high, arm
        assert figures["longest_ms"] >= max(figures["longest_no_dict_resize_ms"], figures["dict_resize_ms"]) > 0, arm
        assert figures["dict_resize_ms"] > 0  # 5,000 keys: the dict's table grows several times
        assert 0 < figures["longest_no_dict_resize_at"] <= 5000
        assert figures["total_ms"] * 1000 >= figures["median_us"] * (5000 // 32) / 2, arm


def test_a_file_that_is_not_an_extension_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "nothing.txt"
    bad.write_text("")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_index_pauses.py"), "--keys", "100", "--old", str(bad)],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "not an extension module" in proc.stderr
