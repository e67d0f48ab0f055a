"""benchmarks/bench_feed.py: every mode runs on a private server, each follower sees every key
the writer stored, and the figures and ratios are there (their size is the benchmark's to
report, never a test's to bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from redis_servers import MISSING, REDIS_SERVER

ROOT = Path(__file__).resolve().parent.parent


def test_bench_feed_runs_every_mode_and_every_follower_sees_every_key(tmp_path: Path) -> None:
    if REDIS_SERVER is None:
        pytest.skip(MISSING)
    out = tmp_path / "feed.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_feed.py"), "--keys", "500", "--engines", "2", "--seconds", "1",
         "--rate", "10", "--drain-s", "20", "--json", str(out)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    result = json.loads(out.read_text())
    (case,) = result["cases"]
    assert case["keys"] == 500 and case["engines"] == 2
    for mode in ("sweep", "feed"):
        assert case[mode]["keys_written"] > 0
        assert case[mode]["unseen_share"] == 0.0, case[mode]  # every follower adopted every key
        assert set(case[mode]["staleness_s"]) == {"p50", "p99", "max"}
        assert case[mode]["server"]["commands"] > 0
    assert set(case["ratios"]["feed_over_sweep"]) == {"cpu_s", "bytes", "commands", "staleness_p99"}
    assert len(result["load_average"]) == 3
