"""``kvtier bench --config FILE``: an operator's tiers measured where they are configured, with
nothing of theirs touched and nothing of the benchmark's left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis_servers import started_server

from kvtier.tools.bench.advice import tier_line
from kvtier.tools.cli import main
from kvtier.tools.servers import REDIS_CLI, REDIS_SERVER


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _advice(stdout: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if line.startswith("  tiers[")]


def test_disk_tiers_are_measured_at_their_paths_and_left_as_they_were(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    operator = tmp_path / "operator"
    (operator / "kv-lmdb").mkdir(parents=True)
    (operator / "kv-lmdb" / "notes.txt").write_text("the operator's own file")
    config = operator / "kvtier.yaml"
    # the file tier's path does not exist yet: it is measured in its nearest existing folder
    config.write_text(
        "tiers:\n"
        f"  - {{backend: lmdb, capacity: 1GiB, path: '{operator / 'kv-lmdb'}', sync_mode: fast}}\n"
        f"  - {{backend: file, capacity: 1GiB, path: '{operator / 'not-yet' / 'kv-files'}'}}\n"
    )
    before = _tree(operator)
    out = tmp_path / "bench-out"
    status = main(["bench", "--config", str(config), "--quick", "--no-plot", "--out", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    assert _tree(operator) == before  # no temporary folder left, nothing of the operator's changed

    advice = _advice(captured.out)
    assert len(advice) == 2, captured.out
    assert advice[0].startswith(f"tiers[0] lmdb ({operator / 'kv-lmdb'}): loads ")
    assert advice[1].startswith(f"tiers[1] file ({operator / 'not-yet' / 'kv-files'} (not there yet: measured in {operator})): loads ")
    for line in advice:
        assert "on its filesystem" in line and ("keep it" in line or "faster here" in line), line
    results = json.loads((out / "results.json").read_text())
    assert [t["label"] for t in results["tiers"]] == ["tier0-lmdb", "tier1-file"]
    measured = (out / "tier0-lmdb.log").read_text().splitlines()[0]
    assert f"--dir {operator / 'kv-lmdb'}/.kvtier-bench-" in measured  # on the tier's own filesystem
    assert results["results"]["tier0-lmdb"]["lmdb_load_gbps"] > 0 and results["failures"] == {}
    # as configured: the lmdb tier's sync_mode reaches the benchmark; the file tier sets none
    assert results["results"]["tier0-lmdb"]["sync_mode"] == "fast" and results["results"]["tier1-file"]["sync_mode"] == "durable"


def test_a_redis_tier_is_measured_on_its_server_and_leaves_no_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("REDIS-SERVER NOT INSTALLED")
    secret = "bench-config-secret-7f3a"
    server = started_server(tmp_path / "redis")
    try:
        server.cli("config", "set", "requirepass", secret)  # after start: the launcher's readiness ping has no password

        def keys() -> list[str]:
            return sorted(server.cli("-a", secret, "--no-auth-warning", "--scan").split())

        server.cli("-a", secret, "--no-auth-warning", "set", "prod:operator-key", "kept")
        monkeypatch.setenv("BENCH_CONFIG_REDIS_PASSWORD", secret)
        config = tmp_path / "kvtier.yaml"
        config.write_text(
            "tiers:\n"
            f"  - {{backend: redis, capacity: 1GiB, url: '{server.url}', prefix: prod, password_env: BENCH_CONFIG_REDIS_PASSWORD}}\n"
        )
        out = tmp_path / "bench-out"
        status = main(["bench", "--config", str(config), "--quick", "--no-plot", "--out", str(out)])
        captured = capsys.readouterr()
        assert status == 0, captured.out + captured.err
        assert keys() == ["prod:operator-key"]
    finally:
        server.stop()
    advice = _advice(captured.out)
    assert advice == [line for line in advice if line.startswith(f"tiers[0] redis ({server.url}): shares blocks")] and advice
    assert secret not in (out / "tier0-redis.log").read_text() and secret not in captured.err


def test_bad_input_names_the_problem_and_the_other_tiers_are_still_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dead_port: int
) -> None:
    not_config = tmp_path / "notes.yaml"
    not_config.write_text("just a line of text\n")
    assert main(["bench", "--config", str(not_config), "--quick", "--no-plot", "--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert f"--config: {not_config}: expected a mapping of settings" in err

    dead = f"redis://127.0.0.1:{dead_port}/0"
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "tiers:\n"
        "  - {backend: compressed, capacity: 64MiB}\n"
        f"  - {{backend: redis, capacity: 1GiB, url: '{dead}'}}\n"
    )
    out = tmp_path / "b"
    status = main(["bench", "--config", str(config), "--quick", "--no-plot", "--out", str(out)])
    captured = capsys.readouterr()
    assert status == 1  # a tier not measured is a failure
    advice = _advice(captured.out)
    assert advice[0].startswith("tiers[0] compressed (memory): holds "), captured.out
    assert advice[1].startswith(f"tiers[1] redis ({dead}): not measured: the redis server does not answer: {dead}: not reachable")
    results = json.loads((out / "results.json").read_text())
    assert set(results["results"]) == {"tier0-compressed"} and set(results["failures"]) == {"tier1-redis"}


def test_config_does_not_mix_with_only_or_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text("tiers:\n  - {backend: cpu, capacity: 64MiB}\n")
    assert main(["bench", "--config", str(config), "--only", "core", "--out", str(tmp_path / "o")]) == 1
    assert "--config measures the config's tiers where they are" in capsys.readouterr().err


def test_a_configured_disk_tier_is_told_when_the_other_loads_clearly_faster_on_its_filesystem() -> None:
    figures = {"lmdb_load_gbps": 1.0, "lmdb_save_gbps": 0.3, "file_load_gbps": 3.0, "file_save_gbps": 0.2}
    assert tier_line("lmdb", "disk", figures) == (
        "loads 1.0 GB/s, saves 300 MB/s on its filesystem (file there loads 3.0 GB/s): file loads faster here; "
        "consider backend: file")
    assert tier_line("file", "disk", figures) == (
        "loads 3.0 GB/s, saves 200 MB/s on its filesystem (lmdb there loads 1.0 GB/s): keep it")
    close = {**figures, "file_load_gbps": 1.1}  # within the noise of a quick run: no switch advised
    assert (tier_line("lmdb", "disk", close) or "").endswith(": keep it")
    assert tier_line("file", "disk", {**figures, "lmdb_load_gbps": 9.0}) == (
        "loads 3.0 GB/s, saves 200 MB/s on its filesystem (lmdb there loads 9.0 GB/s): lmdb loads faster here; "
        "use lmdb unless several hosts share this filesystem")
    assert tier_line("lmdb", "disk", {"lmdb_load_gbps": 1.0}) is None  # too little measured: no advice
    # bench_gpu's figures (GB/s with a capital B) and bench_core's
    assert tier_line("gpu", "gpu", {"gpu_save_GBps": 40.0, "gpu_load_GBps": 45.0}) == (
        "spare GPU memory, ahead of cpu: loads 45.0 GB/s, saves 40.0 GB/s here")
    assert tier_line("cpu", "core", {"cpu_save_gbps": 4.0, "cpu_load_gbps": 3.0}) == (
        "the first tier (after gpu, if any): loads 3.0 GB/s, saves 4.0 GB/s here")
    assert tier_line("s3", "disk", figures) is None


def test_the_picture_shows_each_disk_tier_s_figures_from_its_own_path(tmp_path: Path) -> None:
    from kvtier.tools.bench import BenchJob, BenchRun
    from kvtier.tools.bench.configured import ConfiguredTier, picture_results

    lmdb = ConfiguredTier(0, "lmdb", "/nvme", BenchJob("tier0-lmdb", "disk"))
    files = ConfiguredTier(1, "file", "/nfs", BenchJob("tier1-file", "disk"))
    run = BenchRun(output=tmp_path, quick=True, scripts=None, results={
        "tier0-lmdb": {"lmdb_load_gbps": 3.0, "raw_lmdb_get_gbps": 4.0, "file_load_gbps": 2.5, "blocks": 16},
        "tier1-file": {"lmdb_load_gbps": 0.5, "raw_lmdb_get_gbps": 0.6, "file_load_gbps": 0.4, "blocks": 16},
    })
    assert picture_results([lmdb, files], run) == {"disk": {
        "lmdb_load_gbps": 3.0, "raw_lmdb_get_gbps": 4.0, "file_load_gbps": 0.4, "blocks": 16}}
