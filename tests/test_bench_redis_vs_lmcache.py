"""benchmarks/bench_redis_vs_lmcache.py: its kvtier side runs end to end on a private server, and
LMCache's report is read as the best connector per cell (the peer itself is not installed here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_modules import bench_module
from redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_redis_vs_lmcache.py"


def test_the_kvtier_side_moves_and_checks_every_case(redis_server: RedisServer) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--kvtier-side", "--url", redis_server.url, "--cases", "4x64,2x128", "--reps", "2"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    cells = json.loads(out.strip().splitlines()[-1])
    assert set(cells) == {"4x64", "2x128"}
    for cell in cells.values():
        assert len(cell["put_reps"]) == len(cell["get_reps"]) == 2
        assert cell["put"] > 0 and cell["get"] > 0


def test_lmcache_cells_take_the_best_connector_and_get_call() -> None:
    bench = bench_module("bench_redis_vs_lmcache")
    report = {"cases": [{"chunks": 256, "chunk_bytes": 2 << 20, "GBps_median": {
        "lmc_resp_put": 1.0, "lmc_redis_put": 1.2, "lmc_resp_batched_get": 2.0, "lmc_resp_get_non_blocking": 2.5,
        "lmc_redis_batched_get": 0.5, "raw_pipe_get": 9.0, "raw_serial_put": 9.0}}]}
    cell = bench._lmcache_cells(report)["256x2048"]
    assert cell["put"] == 1.2 and cell["best_put"] == "lmc_redis_put"
    assert cell["get"] == 2.5 and cell["best_get"] == "lmc_resp_get_non_blocking"  # raw baselines never count
