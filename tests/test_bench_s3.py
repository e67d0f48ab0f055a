"""benchmarks/bench_s3.py and bench_s3_clients.py run on a private SeaweedFS server in --quick
mode and print the JSON shape the docs quote: GB/s per side and cell, the tier's ratio to its
raw client, each cell checked byte for byte (a mismatch would fail the run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from s3_servers import need_s3

ROOT = Path(__file__).resolve().parent.parent
CELLS = {f"{size}.{op}_gbps" for size in ("64KiB", "2MiB") for op in ("put", "get")}


def _run(script: str, tmp_path: Path) -> dict:  # type: ignore[type-arg]
    need_s3()
    out = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", str(out)],
        check=True, capture_output=True, text=True, timeout=600,
    )
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
    assert len(report["loadavg"]) == 3


def test_bench_s3_clients_measures_every_installed_candidate(tmp_path: Path) -> None:
    report = _run("bench_s3_clients.py", tmp_path)
    measured, skipped = set(report["gbps"]), set(report["skipped"])
    assert "obstore" in measured  # the tier's client is a dev dependency
    assert measured | skipped == {"boto3", "obstore", "nixl-obj"} and not measured & skipped
    for cells in report["gbps"].values():
        assert set(cells) == CELLS and all(v > 0 for v in cells.values())
    assert set(report["fastest"]) == CELLS and set(report["fastest"].values()) <= measured
