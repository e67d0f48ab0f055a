"""benchmarks/bench_redis_server.py: its kvtier side moves and checks every case on a private
server and accounts the server's CPU and faults (the LMCache side needs the peer, not installed
here); the accounting itself charges a call's CPU to the process it watches; the host's CPU
steal share, which the benchmarks print beside their figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_modules import bench_module
from redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_redis_server.py"


def _bench():  # type: ignore[no-untyped-def]
    return bench_module("bench_redis_server")


def test_the_kvtier_side_accounts_the_server_for_every_cell(redis_server: RedisServer) -> None:
    assert redis_server.proc is not None
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--side", "kvtier", "--url", redis_server.url, "--server-pid", str(redis_server.proc.pid),
         "--cases", "64x64,8x1024", "--reps", "2"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    cells = json.loads(out.strip().splitlines()[-1])
    assert set(cells) == {"64x64", "8x1024"}
    for cell in cells.values():
        for op in ("put", "get"):
            acct = cell[op]
            assert acct["gbps"] > 0 and acct["server_bound_gbps"] > 0
            assert acct["server_s_per_gb"] > 0 and acct["client_s_per_gb"] >= 0
            assert acct["server_busy"] > 0
            assert acct["server_faults_per_mib"] >= 0


def test_accounting_charges_the_watched_process() -> None:
    bench = _bench()

    def spin() -> int:
        end = sum(os.times()[:2]) + 0.2  # 0.2 s of this process's CPU
        n = 0
        while sum(os.times()[:2]) < end:
            n += 1
        return n

    got, acct = bench.accounted(os.getpid(), 10**9, spin)
    assert got > 0
    assert acct["server_s_per_gb"] >= 0.15  # the watched process (this one) did the work
    assert acct["client_s_per_gb"] >= 0.15
    assert acct["server_bound_gbps"] <= 1 / 0.15
    assert acct["server_busy"] > 0  # a share of wall time: no bound on how much, that is the host's
    assert acct["server_busy"] == pytest.approx(acct["gbps"] / acct["server_bound_gbps"])  # the share of the bound reached


def test_cpu_steal_is_a_share_of_the_host_time_or_none_without_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.tools.bench import host

    with host.CpuSteal() as steal:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
    assert steal.share is not None and 0.0 <= steal.share <= 1.0
    monkeypatch.setattr(host.CpuSteal, "_read", staticmethod(lambda: None))
    with host.CpuSteal() as missing:
        pass
    assert missing.share is None
