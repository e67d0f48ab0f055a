"""``benchmarks/bench_head_groups.py --quick``: the JSON shape and its sanity (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_quick_head_group_benchmark_reports_every_tier_and_group_size(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_head_groups.py"), "--quick", "--rounds", "1",
         "--tiers", "lmdb,file,compressed", "--dir", str(tmp_path)],
        capture_output=True, text=True, check=False, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["tiers"]) == {"lmdb", "file", "compressed"}
    for tier, cells in result["tiers"].items():
        assert sorted({c["group_size"] for c in cells}) == [1, 2, 4, 8], tier
        for c in cells:
            assert c["record_bytes"] * (8 // c["group_size"]) == c["block_bytes"]
            for field in ("save_gbps", "save_whole_gbps", "load_gbps", "load_whole_gbps", "save_ratio", "load_ratio"):
                assert c[field] > 0, (tier, field, c)
            assert set(c["breakdown_gbps"]) == {"inner_save", "split", "inner_load", "join"}
        assert set(result["summary"][tier]) >= {"save_ratio_min_ge64k", "load_ratio_min_ge64k"}
    assert len(result["load_avg"]) == 3
    assert not list(tmp_path.glob("kvtier-hg-*")), "the tiers are removed afterwards"
