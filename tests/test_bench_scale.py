"""``benchmarks/bench_scale.py --quick``: the JSON shape and its sanity (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("rss_bytes_per_key", "lookup_us", "lookup_miss_us", "lookup64_us_per_key", "evict_us_per_block")


def test_the_quick_scale_benchmark_reports_every_tier_and_size(tmp_path: Path) -> None:
    from kvtier.tools.servers import server_version

    png = tmp_path / "scale.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--quick", "--index-sizes", "1000,10000",
         "--dir", str(tmp_path), "--png", str(png)],
        capture_output=True, text=True, check=False, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    from kvtier.tools.servers import REDIS_CLI

    redis = server_version() is not None
    expected = {"index", "lmdb", "file"} | ({"redis"} if redis else set()) | ({"redis-cluster"} if redis and REDIS_CLI else set())
    assert set(result["tiers"]) == expected, result.get("skipped")
    for tier, points in result["tiers"].items():
        assert [p["records"] for p in points] == [1000, 10_000], (tier, points)
        for p in points:
            assert "error" not in p, (tier, p)
            for field in FIELDS:
                if field == "rss_bytes_per_key" and tier == "index" and p["records"] < 10_000:
                    # 1,000 keys of the index alone are ~150 KB, which the interpreter's free
                    # arenas can hold without the process growing: the growth may read 0 or a
                    # little under. It is a number; the larger point must grow.
                    assert isinstance(p[field], float) and abs(p[field]) < 1000, (tier, field, p)
                    continue
                assert p[field] > 0, (tier, field, p)
                if field != "rss_bytes_per_key" or tier != "index":
                    assert p[f"{field}_vs_smallest"] > 0, (tier, field, p)
            if tier == "index":
                assert p["adopt_s"] > 0 and p["feed"] == "columns"
            else:
                assert p["open_s"] > 0 and p["open_s_per_million"] == pytest.approx(p["open_s"] / p["records"] * 1e6, rel=0.02)
                assert p["listed"] == p["records"]  # every record written is listed and adopted
                if tier in ("redis", "redis-cluster"):  # the open read the key log(s): no SCAN on the server
                    assert p["open_listing"] == "key log" and p["server_scan_s"] >= 0, p
                else:
                    assert "server_scan_s" not in p and "open_listing" not in p
        assert points[0]["lookup_us_vs_smallest"] == 1.0
    # Each tier's fixed point (a handful of records, its open's RSS alone) and the split of
    # every point's growth into that and a per-key rest.
    assert set(result["fixed"]) == expected, result["fixed"]
    for tier, fixed in result["fixed"].items():
        assert fixed["records"] == result["fixed_records"] and isinstance(fixed["rss_bytes"], int), (tier, fixed)
        assert "lookup_us" not in fixed, (tier, fixed)
        for p in result["tiers"][tier]:
            assert p["rss_fixed_bytes"] == fixed["rss_bytes"], (tier, p)
            assert p["rss_bytes_per_key_marginal"] == pytest.approx(
                (p["rss_bytes"] - fixed["rss_bytes"]) / (p["records"] - fixed["records"]), abs=0.1), (tier, p)
        if tier != "index":  # an open of a tier holds something (threads, buffers) whatever it lists
            assert fixed["rss_bytes"] > 0, (tier, fixed)
    assert "records" in proc.stderr and "lmdb" in proc.stderr  # the table
    assert result.get("png") != str(png) or png.stat().st_size > 0
    assert not list(tmp_path.glob("kvtier-scale-*")), "the filled tiers are removed afterwards"


def test_record_counts_below_one_are_refused_and_none_skips_the_points(tmp_path: Path) -> None:
    """``--index-sizes 0`` once ran a point of no records that never ended; a count below 1 is
    now an error naming the option, and ``none`` measures no point of that kind."""
    for option, value in (("--index-sizes", "0"), ("--sizes", "1000,-5"), ("--sizes", "ten")):
        proc = subprocess.run(
            [sys.executable, "benchmarks/bench_scale.py", option, value, "--tiers", "", "--dir", str(tmp_path)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 2 and f"{option}: " in proc.stderr and value in proc.stderr, proc.stderr
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_scale.py", "--index-sizes", "none", "--sizes", "none", "--tiers", "lmdb", "--dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tiers"]["index"] == [] and result["tiers"].get("lmdb", []) == []


def test_the_index_alone_takes_its_records_as_columns_or_as_tuples() -> None:
    """``--index-feed``: the same adoption of the same records either way (the tiers' columns
    by default; tuples, the general path the figures before the option measured)."""
    for feed in ("columns", "tuples"):
        proc = subprocess.run(
            [sys.executable, "benchmarks/bench_scale.py", "--measure-index", "2000", "--index-feed", feed],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        point = json.loads(proc.stdout.strip().splitlines()[-1])
        assert point["feed"] == feed and point["records"] == 2000 and point["lookup_us"] > 0, point
    proc = subprocess.run([sys.executable, "benchmarks/bench_scale.py", "--index-feed", "dicts"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--index-feed" in proc.stderr, proc.stderr
