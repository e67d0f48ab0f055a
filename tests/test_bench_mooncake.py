"""benchmarks/bench_mooncake.py: it runs end to end on private servers and reports both sides of
each shape with their ratios (no timing asserts); without Mooncake it says so and skips."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bench_modules import bench_module

from kvtier.tools.mooncake_servers import mooncake_missing

ROOT = Path(__file__).resolve().parent.parent


def test_the_benchmark_moves_and_checks_both_shapes_and_reports_ratios() -> None:
    if mooncake_missing() is not None:
        pytest.skip(str(mooncake_missing()))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_mooncake.py"), "--quick"],
        check=False, capture_output=True, text=True, timeout=600,
    )
    # check=True would raise CalledProcessError, whose message carries neither stream: a failure
    # read as "exit 1, nothing on stderr". Show both.
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-6000:]}\nstdout:\n{proc.stdout[-2000:]}"
    report = json.loads(proc.stdout)
    for shape in ("2MiB", "64KiB"):
        cell = report[shape]
        for name in ("raw_put_gbps", "raw_get_gbps", "kvtier_put_gbps", "kvtier_get_gbps", "put_ratio", "get_ratio"):
            assert cell[name] > 0, (shape, name, cell)
        assert len(cell["put_ratios"]) == len(cell["get_ratios"]) == 2
    assert len(report["load_average_before"]) == 3


def test_a_failed_run_says_why_and_how_each_server_is_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The servers' logs live in the run's temporary directory, gone once the bench exits: a run
    that fails prints the error and each server's state and log tail first."""
    if mooncake_missing() is not None:
        pytest.skip(str(mooncake_missing()))
    from kvtier.tools.mooncake_servers import MooncakeServers

    bench = bench_module("bench_mooncake")
    servers = MooncakeServers(tmp_path, segment_size="64MB").start()
    try:
        servers.kill_client()
        bench._report_servers(servers, RuntimeError("the raw put was refused"))
    finally:
        servers.stop()
    err = capsys.readouterr().err
    assert "bench_mooncake: failed: RuntimeError: the raw put was refused" in err
    assert "--- mooncake_master (running)" in err
    assert "--- mooncake_client (stopped)" in err and "client.log" in err


def test_the_servers_take_four_distinct_ports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each port is probed free on its own, so two probes can return the same port; the master
    (or the client) would then fail to bind its second listener and the run exit 1. Here every
    probe returns each free port twice in a row: the four ports must still be distinct."""
    from kvtier.tools import servers as server_tools
    from kvtier.tools.mooncake_servers import MooncakeServers, mooncake_binaries

    if mooncake_binaries() is None:
        pytest.skip(str(mooncake_missing()))
    free = [server_tools.free_port() for _ in range(6)]
    picks = iter([p for p in free for _ in range(2)])
    monkeypatch.setattr(server_tools.random, "randint", lambda low, high: next(picks))
    store = MooncakeServers(tmp_path)
    ports = [store.rpc_port, store.metadata_port, store.admin_port, store.client_port]
    assert len(set(ports)) == 4, ports


def test_the_bench_starts_its_servers_again_when_a_port_was_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Something else listens on the first try's metadata port (taken between the probe and the
    master's bind): the bench starts a second master and client on new ports and runs on them."""
    if mooncake_missing() is not None:
        pytest.skip(str(mooncake_missing()))
    from kvtier.tools.mooncake_servers import MooncakeServers

    bench = bench_module("bench_mooncake")
    made: list[MooncakeServers] = []
    held: list[socket.socket] = []
    init = MooncakeServers.__init__

    def taken_first(self: MooncakeServers, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)
        if len(made) == 1:
            other = socket.socket()
            other.bind(("127.0.0.1", self.metadata_port))
            other.listen()
            held.append(other)

    monkeypatch.setattr(MooncakeServers, "__init__", taken_first)
    try:
        servers = bench.start_servers(tmp_path, segment_size="64MB")
        try:
            assert len(made) == 2 and servers is made[1]
            assert servers.segments(), "the second try's client did not register"
        finally:
            servers.stop()
    finally:
        for other in held:
            other.close()


def test_the_peer_side_is_importable_without_lmcache() -> None:
    """The LMCache side runs in the peer's Python; here it must at least parse and import (its
    LMCache imports are inside the functions that need them)."""
    side = bench_module("lmcache_mooncake_side")
    assert side.UNIT == 64 << 10 and callable(side.run_case)
