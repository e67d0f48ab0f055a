"""benchmarks/bench_gpu.py: says "no CUDA" without a device, and runs end to end on the stand-in."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from cuda_standin import CudaStandIn

pytest_plugins = ("cuda_standin",)

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpu.py"
KEYS = [
    "d2h_GBps", "h2d_GBps", "d2d_GBps", "cpu_save_ratio", "cpu_load_ratio", "gpu_save_ratio", "gpu_load_ratio",
    "lmdb_save_GBps", "lmdb_load_GBps", "store_ordering_wrong", "load_ordering_wrong", "fence_wait_ms",
]  # fmt: skip


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_without_cuda_it_says_so_and_fails() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "no CUDA" in proc.stderr and proc.stdout == ""


def test_smoke_run_on_the_stand_in_reports_every_figure(
    cuda_standin: CudaStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench()
    monkeypatch.setattr(bench, "STALL_S", 0.2)
    result = asyncio.run(bench.run(argparse.Namespace(quick=False, smoke=True)))
    for key in KEYS:
        assert isinstance(result[key], (int, float)), key
    assert result["store_ordering_wrong"] == 0 and result["load_ordering_wrong"] == 0
    assert result["staging"]["save_mode"] == "staged" and result["unstaged_mode"] in ("batched", "foreach")
    # The fence ends with the device read, not behind the stalled lower tier.
    assert result["fence_wait_ms"] < result["fence_job_ms"] and result["fence_job_ms"] >= 200


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the verdict without CUDA")
def test_gpu_check_script_stops_with_no_cuda(tmp_path: Path) -> None:
    script = SCRIPT.parent.parent / "scripts" / "gpu_check.sh"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PYTHON": sys.executable, "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "NO CUDA" in summary
    assert '"cuda_available": false' in (tmp_path / "env.json").read_text()
