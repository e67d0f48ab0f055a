"""benchmarks/bench_s3.py and bench_s3_clients.py run on a private SeaweedFS server in --quick
mode and print the JSON shape the docs quote: GB/s per side and cell, the tier's ratio to its
raw client, each cell checked byte for byte (a mismatch would fail the run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from s3_servers import need_s3

ROOT = Path(__file__).resolve().parent.parent
CELLS = {f"{size}.{op}_gbps" for size in ("64KiB", "2MiB") for op in ("put", "get")}


def _run(script: str, tmp_path: Path) -> dict:  # type: ignore[type-arg]
    need_s3()
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_bench_s3_reports_the_tier_against_its_raw_client(tmp_path: Path) -> None:
    report = _run("bench_s3.py", tmp_path)
    assert report["bench"] == "s3" and report["client"] == "obstore"
    assert set(report["gbps"]) == {"raw", "tier"}
    for side in ("raw", "tier"):
        assert set(report["gbps"][side]) == CELLS and all(v > 0 for v in report["gbps"][side].values())
    assert set(report["ratio"]) == CELLS
    for cell, ratio in report["ratio"].items():
        assert abs(ratio - report["gbps"]["tier"][cell] / report["gbps"]["raw"][cell]) < 0.05 * ratio + 0.01
    assert len(report["loadavg"]) == 3 and isinstance(report["retried"], list)


def test_bench_s3_clients_measures_every_installed_candidate(tmp_path: Path) -> None:
    report = _run("bench_s3_clients.py", tmp_path)
    measured, skipped = set(report["gbps"]), set(report["skipped"])
    assert "obstore" in measured  # the tier's client is a dev dependency
    assert measured | skipped == {"boto3", "obstore", "nixl-obj"} and not measured & skipped
    for cells in report["gbps"].values():
        assert set(cells) == CELLS and all(v > 0 for v in cells.values())
    assert set(report["fastest"]) == CELLS and set(report["fastest"].values()) <= measured


def test_a_cell_the_tier_missed_is_measured_again_and_named_but_wrong_bytes_are_not() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_s3_under_test", ROOT / "benchmarks" / "bench_s3.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    labels: list[str] = []

    def shed_once(server: object, label: str, size: int, n: int, concurrency: int) -> dict[str, float]:
        labels.append(label)
        if len(labels) == 1:
            raise bench._Missed(f"tier {label}: 1 writes failed, 0 reads missed")
        return {"put_gbps": 1.0, "get_gbps": 2.0}

    retried: list[str] = []
    assert bench._measured(shed_once, None, "64KiB-r0-tier", 1, 4, 2, retried) == {"put_gbps": 1.0, "get_gbps": 2.0}
    assert labels == ["64KiB-r0-tier", "64KiB-r0-tier-again1"] and retried == ["tier 64KiB-r0-tier: 1 writes failed, 0 reads missed"]

    def always_sheds(server: object, label: str, size: int, n: int, concurrency: int) -> dict[str, float]:
        raise bench._Missed("down")

    def wrong_bytes(server: object, label: str, size: int, n: int, concurrency: int) -> dict[str, float]:
        labels.append(label)
        raise RuntimeError("a block read back differs from what was written")

    with pytest.raises(bench._Missed):
        bench._measured(always_sheds, None, "x", 1, 4, 2, [])
    labels.clear()
    with pytest.raises(RuntimeError, match="differs"):
        bench._measured(wrong_bytes, None, "y", 1, 4, 2, [])
    assert labels == ["y"]
