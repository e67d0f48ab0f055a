"""``kvtier bench``: the picture an operator reads, and the scripts a wheel install ships."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvtier.tools.bench import available, last_json, script_dir
from kvtier.tools.bench.plot import bandwidth_rows, plot_results, rate

ROOT = Path(__file__).resolve().parent.parent

RESULTS = {
    "core": {"cpu_save_gbps": 2.6, "cpu_load_gbps": 2.7, "raw_save_gbps": 9.9, "raw_load_gbps": 9.9, "lookup_us_per_key": 0.2},
    "disk": {
        "lmdb_save_gbps": 0.265,
        "lmdb_load_gbps": 2.5,
        "raw_lmdb_put_gbps": 1.07,
        "raw_lmdb_get_gbps": 5.6,
        "file_save_gbps": 0.09,
        "raw_file_write_gbps": 0.19,
        "file_load_gbps": 3.1,
        "file_read_preadv_thread_gbps": 4.8,
        "cpu_blocks_per_gib": 512,
        "compressed_blocks_per_gib": 704,
        "block_bytes": 2 * 2**20,
    },
    # what bench_connector emits: hit_vs_oracle near 1 (a tier that holds everything), and the sweep
    "connector": {
        "hit_vs_oracle_chat": 0.99, "hit_vs_oracle_shared": 1.0, "hit_vs_oracle_docqa": 0.97, "hit_vs_oracle": 0.99,
        "step_ms_256": 0.44, "step_vs_raw": 3.2,
        "hits_by_tier_size": {
            "chat": {"footprint_bytes": 2 << 20, "points": [
                {"tier_fraction": 0.1, "hit_vs_oracle": 0.25}, {"tier_fraction": 0.5, "hit_vs_oracle": 0.46},
                {"tier_fraction": 0.25, "hit_vs_oracle": 0.28}, {"tier_fraction": 1.0, "hit_vs_oracle": 1.0}]},
            "docqa": {"footprint_bytes": 4 << 20, "points": [
                {"tier_fraction": 0.1, "hit_vs_oracle": 0.38}, {"tier_fraction": 1.0, "hit_vs_oracle": 0.99}]},
        },
    },
}


def test_each_tier_is_paired_with_its_raw_limit() -> None:
    rows = {(r["tier"], r["op"]): (r["gbps"], r["raw_gbps"], r["raw_label"]) for r in bandwidth_rows(RESULTS)}
    assert rows == {
        ("cpu", "save"): (2.6, 9.9, "raw copy"),
        ("cpu", "load"): (2.7, 9.9, "raw copy"),
        ("lmdb", "save"): (0.265, 1.07, "raw LMDB put"),
        ("lmdb", "load"): (2.5, 5.6, "raw LMDB get"),
        ("file", "save"): (0.09, 0.19, "raw write+fdatasync+rename"),
        ("file", "load"): (3.1, 4.8, "raw preadv"),
    }


def test_rates_are_readable() -> None:
    assert (rate(2.64), rate(0.265), rate(38.8)) == ("2.6 GB/s", "265 MB/s", "38.8 GB/s")


def test_the_hit_panel_draws_hits_against_the_tier_size(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from kvtier.tools.bench import plot

    assert plot.hit_curves(RESULTS) == {
        "chat": [(0.1, 0.25), (0.25, 0.28), (0.5, 0.46), (1.0, 1.0)],
        "docqa": [(0.1, 0.38), (1.0, 0.99)],
    }
    fig, ax = plt.subplots()
    try:
        assert plot._hits(ax, RESULTS)
        lines = {line.get_label(): [tuple(xy) for xy in line.get_xydata()] for line in ax.get_lines()}
        assert [round(y) for _, y in lines["chat"]] == [25, 28, 46, 100]  # not 100 % everywhere
        assert [round(x) for x, _ in lines["chat"]] == [10, 25, 50, 100]
        assert "tier size" in ax.get_xlabel()
    finally:
        plt.close(fig)
    fig, ax = plt.subplots()
    try:  # bare hit_vs_oracle figures (a tier that holds everything) no longer make a panel
        assert not plot._hits(ax, {"connector": {"hit_vs_oracle_chat": 1.0}})
    finally:
        plt.close(fig)
    target = tmp_path / "p.png"
    assert plot_results(RESULTS, target)
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_summary_gives_each_benchmark_s_headline_figures() -> None:
    from kvtier.tools.bench.plot import summary

    assert summary("core", RESULTS["core"]) == "cpu save 2.6 GB/s (0.26× raw); cpu load 2.7 GB/s (0.27× raw)"
    assert "file save 90 MB/s (0.47× raw)" in summary("disk", RESULTS["disk"])
    assert summary("connector", RESULTS["connector"]) == (
        "hits of an unbounded cache's with the tier at 25 % of the workload: chat 28 %; step 0.44 ms (3.2× raw)"
    )
    assert summary("connector", {"hit_vs_oracle": 0.99}) == "hits 99 % of an unbounded cache"
    assert summary("other", {"n": 1}) == "see results.json"


def test_last_json_takes_the_last_object_printed() -> None:
    assert last_json('warming up\n{"a": 1}\nnoise\n{"b": 2}\n') == {"b": 2}
    with pytest.raises(ValueError):
        last_json("no json here")


def test_a_source_checkout_finds_its_benchmarks() -> None:
    folder = script_dir()
    assert folder is not None and {"core", "disk", "connector"} <= set(available(folder))


@pytest.mark.slow
def test_a_wheel_ships_the_benchmarks_and_finds_them_without_the_source_tree(tmp_path: Path) -> None:
    """What a plain `pip install .` gets: build the wheel from a copy of the sources, unpack
    it elsewhere, and ask that copy of kvtier where its benchmark scripts are."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("kvtier", "backends", "benchmarks"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(tmp_path / "dist")],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("kvtier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for script in ("bench_core.py", "bench_disk.py", "bench_connector.py"):
        assert f"kvtier/tools/bench/scripts/{script}" in names
    assert "kvtier/tools/bench/plot.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import kvtier.tools.bench as b; d = b.script_dir(); print(d); print(' '.join(b.available(d)))"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(site)], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    where, names_line = out.strip().splitlines()
    assert Path(where) == site / "kvtier" / "tools" / "bench" / "scripts"
    assert {"core", "disk", "connector"} <= set(names_line.split())


def test_device_and_redis_results_join_the_picture_on_a_log_axis(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = {
        **RESULTS,
        "gpu": {"cpu_save_GBps": 48.1, "d2h_GBps": 55.0, "gpu_save_GBps": 1800.0, "d2d_GBps": 2100.0},
        "redis": {"2MiB": {"kvtier_put_gbps": 1.1, "raw_best_put_gbps": 1.4}},
    }
    rows = {(r["tier"], r["op"]): (r["gbps"], r["raw_gbps"]) for r in bandwidth_rows(results)}
    assert rows[("cpu", "save from GPU")] == (48.1, 55.0)
    assert rows[("gpu", "save")] == (1800.0, 2100.0)
    assert rows[("redis", "save")] == (1.1, 1.4)
    assert plot_results(results, tmp_path / "p.png")


def test_a_failed_benchmark_is_named_in_the_picture() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from kvtier.tools.bench.plot import build_figure

    error = "exit 1: Traceback (most recent call last):\nModuleNotFoundError: No module named 'pytest'"
    fig = build_figure({"core": RESULTS["core"]}, failures={"disk": error})
    try:
        title = fig._suptitle.get_text()
        assert "FAILED: disk: ModuleNotFoundError: No module named 'pytest' (see disk.log)" in title
        legend = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        assert "raw limit (no kvtier)" not in legend and any(t.startswith("raw baseline") for t in legend), legend
    finally:
        plt.close(fig)
    fig = build_figure({"core": RESULTS["core"]})
    try:
        assert "FAILED" not in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_every_shipped_benchmark_imports_without_pytest_or_the_tests_folder() -> None:
    """After the README's plain install there is no pytest and no tests/ folder; each script
    ``kvtier bench`` offers must still import (what it needs from kvtier ships with kvtier)."""
    folder = script_dir()
    assert folder is not None
    names = available(folder)
    assert {"core", "disk", "connector", "redis"} <= set(names)
    probe = (
        "import importlib.util, sys\n"
        "sys.modules['pytest'] = None; sys.modules['hypothesis'] = None; sys.modules['redis_servers'] = None\n"
        "sys.path = [p for p in sys.path if not p.rstrip('/').endswith('tests')]\n"
        "for path in sys.argv[1:]:\n"
        "    name = 'bench_probe_' + path.rsplit('/', 1)[-1][:-3]\n"
        "    spec = importlib.util.spec_from_file_location(name, path)\n"
        "    sys.modules[name] = module = importlib.util.module_from_spec(spec)\n"
        "    try:\n"
        "        spec.loader.exec_module(module)\n"
        "    except SystemExit as exc:  # a script's own refusal: an optional engine it measures is missing\n"
        "        print('refused', path, exc)\n"
        "print('imported', len(sys.argv) - 1)\n"
    )
    paths = [str(folder / f"bench_{n}.py") for n in names]
    proc = subprocess.run([sys.executable, "-c", probe, *paths], capture_output=True, text=True, check=False, cwd=folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == f"imported {len(paths)}"
    refused = [line for line in lines if line.startswith("refused")]
    assert all("needs" in line and "pytest" not in line for line in refused), refused


def test_the_redis_benchmark_runs_quick_on_a_server_it_starts(tmp_path: Path) -> None:
    """``kvtier bench --only redis --quick``: the script takes --quick and starts its own server
    with the launcher kvtier ships (kvtier.tools.servers), not one from the tests folder."""
    from kvtier.tools.servers import REDIS_CLI, REDIS_SERVER

    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("REDIS-SERVER NOT INSTALLED")
    from kvtier.tools.bench import run_benchmarks

    run = run_benchmarks(["redis"], quick=True, output=tmp_path / "out")
    assert run.failures == {}, run.failures
    assert run.results["redis"]["redis_save_ratio"] > 0 and "cluster" not in run.results["redis"]


def test_bench_ends_with_one_recommendation_per_tier_measured() -> None:
    from kvtier.tools.bench.advice import recommendations

    lines = recommendations(RESULTS)
    assert lines[0] == "cpu: the first tier (after gpu, if any): loads 2.7 GB/s, saves 2.6 GB/s here"
    assert lines[1] == "compressed: holds 1.38× the blocks per GiB of cpu on this KV; put it after cpu when host memory is short"
    assert lines[2].startswith("file: the persistent tier for a local disk here: loads 3.1 GB/s (vs lmdb 2.5 GB/s)")
    assert lines[3].startswith("file: the tier for a filesystem several hosts share")
    poor = {**RESULTS, "disk": {**RESULTS["disk"], "compressed_blocks_per_gib": 530}}
    assert "not worth its CPU time" in recommendations(poor)[1]
    redis = recommendations({"redis": {"2MiB": {"kvtier_put_gbps": 1.1, "kvtier_get_gbps": 1.4}}})
    assert redis == ["redis: shares blocks between engines and hosts: loads 1.4 GB/s, saves 1.1 GB/s (2 MiB blocks, a local server); put it last"]
    assert recommendations({}) == []


def test_rounds_run_interleaved_and_keep_each_figures_median(tmp_path: Path) -> None:
    from kvtier.tools.bench import median_of, run_benchmarks

    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    order = tmp_path / "order.txt"
    for name, values in (("a", [1.0, 5.0, 3.0]), ("b", [10, 30, 20])):
        (scripts / f"bench_{name}.py").write_text(
            "import json, pathlib\n"
            f"log = pathlib.Path({str(order)!r})\n"
            "runs = log.read_text().split() if log.exists() else []\n"
            f"log.write_text(' '.join([*runs, {name!r}]))\n"
            f"values = {values!r}\n"
            f"n = runs.count({name!r})\n"
            "print(json.dumps({'gbps': values[n], 'nested': {'x': values[n] * 2}, 'label': 'run' + str(n)}))\n"
        )
    run = run_benchmarks(["a", "b"], output=tmp_path / "out", scripts=scripts, rounds=3)
    assert order.read_text().split() == ["a", "b", "a", "b", "a", "b"]  # interleaved, not a a a b b b
    assert run.results == {"a": {"gbps": 3.0, "nested": {"x": 6.0}, "label": "run0"},
                           "b": {"gbps": 20, "nested": {"x": 40}, "label": "run0"}}
    assert sorted(p.name for p in (tmp_path / "out").glob("a.*.log")) == ["a.1.log", "a.2.log", "a.3.log"]
    assert median_of([{"v": True}, {"v": False}]) == {"v": True}  # flags are not averaged


def test_the_compressed_tier_has_bandwidth_rows_and_its_speed_in_its_line() -> None:
    from kvtier.tools.bench.advice import recommendations

    results = {"disk": {**RESULTS["disk"], "compressed_save_gbps": 0.7, "compressed_load_gbps": 0.787}}
    rows = {(r["tier"], r["op"]): (r["gbps"], r["raw_gbps"]) for r in bandwidth_rows(results)}
    assert rows[("compressed", "save")] == (0.7, None) and rows[("compressed", "load")] == (0.787, None)
    assert "compressed: holds 1.38× the blocks per GiB of cpu on this KV, loads 787 MB/s;" in recommendations(results)[0]


def test_cold_lmdb_part_reads_every_value_inside_the_timed_loads(tmp_path: Path) -> None:
    """The cold part evicts the file again after each side's open, and says how much of the
    file each open read: a raw open's read-around had loaded a quarter of the file before its
    clock started."""
    pytest.importorskip("lmdb")
    pytest.importorskip("xxhash")
    import torch
    from kvtier.tools.bench.scripts.disk_cold import bench_lmdb_cold
    from kvtier.tools.bench.scripts.disk_common import BLOCK

    blocks = [torch.full((BLOCK,), i, dtype=torch.uint8) for i in range(3)]
    res = bench_lmdb_cold(str(tmp_path), blocks, 1, drop_caches=False)  # asserts the data read back
    for name in ("lmdb_cold_open_read_fraction", "raw_lmdb_cold_open_read_fraction", "raw_lmdb_cold_open_read_fraction_max"):
        assert 0.0 <= res[name] <= 1.0, (name, res[name])
    assert res["raw_lmdb_cold_open_read_fraction"] <= res["raw_lmdb_cold_open_read_fraction_max"]
    assert res["lmdb_cold_load_gbps"] > 0 and res["raw_lmdb_cold_get_gbps"] > 0



def test_cold_lmdb_unchecked_side_makes_no_record_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cold part's ``lmdb_cold_unchecked`` side says what the tier costs without its record
    checks: a store opened and read inside ``unchecked_reads`` hashes nothing (the tight pass's
    and the one-record loop's XXH3 had been left in: only the general path's check was patched
    out), neither through xxhash nor through the fused copy and XXH3 (``xxcopy.xxh3_copy``), and
    still returns the stored bytes; the same reads outside hash every record."""
    pytest.importorskip("lmdb")
    xxhash = pytest.importorskip("xxhash")
    import asyncio

    import torch
    from kvtier.tools.bench.scripts.disk_cold import unchecked_reads
    from kvtier.tools.bench.scripts.disk_common import BLOCK, lmdb_job, open_backend, tier_read, tier_write

    blocks = [torch.full((BLOCK,), i, dtype=torch.uint8) for i in range(3)]
    _, _, keys, outs, fmt, capacity = lmdb_job(blocks)
    writer = open_backend("lmdb", fmt, capacity=capacity, path=str(tmp_path))
    tier_write(writer, keys, blocks)
    asyncio.run(writer.aclose())
    hashed: list[int] = []
    real = xxhash.xxh3_64

    class Counting:  # a hash state that counts the bytes it is given
        def __init__(self, state: object) -> None:
            self.state = state

        def update(self, data: object) -> None:
            hashed.append(memoryview(data).nbytes)  # type: ignore[arg-type]
            self.state.update(data)  # type: ignore[attr-defined]

        def copy(self) -> Counting:
            return Counting(self.state.copy())  # type: ignore[attr-defined]

        def intdigest(self) -> int:
            return self.state.intdigest()  # type: ignore[attr-defined,no-any-return]

    monkeypatch.setattr(xxhash, "xxh3_64", lambda *args: Counting(real(*args)))
    from kvtier.records import xxcopy

    fused = xxcopy.xxh3_copy

    def counting_copy(prefix: object, src: object, dst: object = None) -> int:  # the one-pass copy and XXH3
        hashed.append(memoryview(src).nbytes)  # type: ignore[arg-type]
        return fused(prefix, src, dst)

    monkeypatch.setattr(xxcopy, "xxh3_copy", counting_copy)
    checked = xxcopy.xxh3_check_copy

    def counting_check(head: object, key: object, stored: object, dst: object, payload: object = None) -> int:
        given = dst if dst is not None else payload
        hashed.append(0 if given is None else memoryview(given).nbytes)  # type: ignore[arg-type]
        return checked(head, key, stored, dst, payload)

    monkeypatch.setattr(xxcopy, "xxh3_check_copy", counting_check)

    def read_all() -> None:
        for out in outs:
            out.zero_()
        tier = open_backend("lmdb", fmt, capacity=capacity, path=str(tmp_path))
        try:
            tier_read(tier, keys, outs)
        finally:
            asyncio.run(tier.aclose())
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks))

    read_all()
    assert sum(n for n in hashed if n == BLOCK) // BLOCK >= len(keys)  # every record checked
    hashed.clear()
    with unchecked_reads():
        read_all()
    assert [n for n in hashed if n == BLOCK] == []


def test_raw_copies_pool_is_advised_huge_pages_as_the_tier_pool_is() -> None:
    """bench_core's raw baseline copies into a pool backed as the tier's own host pool is
    (transparent huge pages, advised before the first touch): a 4 KiB-page pool made the raw
    copy slower than the best raw shape and flattered the tier's ratio."""
    import torch
    from kvtier.tools.bench.scripts.bench_core import RawCopies

    from kvtier.testing import mapping_flags

    caches = [torch.zeros((8, 2, 1 << 18), dtype=torch.uint8) for _ in range(2)]  # 512 KiB a block per layer
    raw = RawCopies(caches, 4, 1, regions=2)  # a 4 MiB pool
    start = -(-raw.pool.data_ptr() // (2 << 20)) * (2 << 20)
    flags = mapping_flags(start)
    if flags is None:
        pytest.skip("no /proc/self/smaps here")
    assert "hg" in flags
