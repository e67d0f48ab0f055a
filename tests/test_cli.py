"""The installed ``kvtier`` command, run in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvtier import registry

KVTIER = shutil.which("kvtier")
pytestmark = pytest.mark.skipif(KVTIER is None, reason="the kvtier command is not installed (pip install -e .)")


def kvtier(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    full_env.update(env or {})
    return subprocess.run([KVTIER or "kvtier", *args], capture_output=True, text=True, env=full_env, cwd=cwd, check=False)


def test_help_lists_every_command() -> None:
    proc = kvtier("--help")
    assert proc.returncode == 0
    for command in ("config", "cache", "inspect", "verify", "bench", "sim"):
        assert command in proc.stdout
    assert kvtier().returncode == 2


def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    import kvtier as package

    proc = kvtier("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"kvtier {package.__version__}"
    assert package.__version__ == version("kvtier") == "0.2.0"  # pyproject.toml and kvtier/__init__.py agree


def test_config_check_prints_tiers_and_slots(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - {backend: cpu, capacity: 8MiB, name: host}\n  - {backend: cpu, capacity: 64MiB}\n")
    proc = kvtier("config", "check", str(path), "--block-bytes", "2MiB")
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout and "host" in proc.stdout
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert ["0", "host", "cpu", "8.0MiB", "4", "lru"] in lines
    data = json.loads(kvtier("config", "check", str(path), "--block-bytes", "2MiB", "--json").stdout)
    assert [t["slots"] for t in data["tiers"]] == [4, 32]


def test_config_check_applies_environment_overrides(tmp_path: Path) -> None:
    path = tmp_path / "store.toml"
    path.write_text('block_bytes = "1MiB"\n[[tiers]]\nbackend = "cpu"\ncapacity = "8MiB"\n')
    data = json.loads(kvtier("config", "check", str(path), "--json", env={"KVTIER_TIERS__0__CAPACITY": "16MiB"}).stdout)
    assert data["tiers"][0]["slots"] == 16
    data = json.loads(kvtier("config", "check", str(path), "--json", "--no-env", env={"KVTIER_TIERS__0__CAPACITY": "16MiB"}).stdout)
    assert data["tiers"][0]["slots"] == 8


def test_config_check_reports_errors_with_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("tiers:\n  - {backend: cpu, capacity: 1MiB}\n  - {backend: tape, capacity: 1MiB}\n")
    proc = kvtier("config", "check", str(path))
    assert proc.returncode == 1
    assert str(path) in proc.stderr and "tiers[1].backend" in proc.stderr and "cpu" in proc.stderr


def test_config_check_fails_a_deployment_this_machine_cannot_run(tmp_path: Path) -> None:
    st = __import__("os").statvfs(tmp_path)
    path = tmp_path / "impossible.yaml"
    path.write_text(
        "tiers:\n"
        "  - {backend: cpu, capacity: 1MiB}\n"
        f"  - {{backend: lmdb, capacity: {st.f_blocks * st.f_frsize * 4}, path: {tmp_path / 'db'}}}\n"
        "  - {backend: file, capacity: 1MiB, path: /etc/passwd}\n"
    )
    proc = kvtier("config", "check", str(path))
    assert proc.returncode == 1
    assert "cannot run on this machine (2 problems)" in proc.stdout
    assert "error: tiers[1].capacity:" in proc.stdout and "whole filesystem" in proc.stdout
    assert "error: tiers[2].path: '/etc/passwd' exists and is not a directory" in proc.stdout
    data = json.loads(kvtier("config", "check", str(path), "--json").stdout)
    assert data["valid"] is False and [f["field"] for f in data["findings"]] == ["tiers[2].path", "tiers[1].capacity"]
    # --no-deploy-check checks the file alone, and says so
    proc = kvtier("config", "check", str(path), "--no-deploy-check")
    assert proc.returncode == 0 and "not checked against this machine" in proc.stdout


def test_config_check_reports_every_typo_at_once(tmp_path: Path) -> None:
    path = tmp_path / "typos.yaml"
    path.write_text("polcy: lru\ntiers:\n  - {backend: cpu, capacty: 1MiB}\n")
    proc = kvtier("config", "check", str(path))
    assert proc.returncode == 1
    assert "unknown key 'polcy' — did you mean 'policy'?" in proc.stderr
    assert "tiers[0]: unknown key 'capacty' — did you mean 'capacity'?" in proc.stderr
    assert "required setting is missing" not in proc.stderr


def test_config_check_connects_to_a_redis_tier_and_sim_says_it_was_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, dead_port: int
) -> None:
    from kvtier.tools.cli import main

    url = f"redis://127.0.0.1:{dead_port}/0"  # nothing listens there
    path = tmp_path / "remote.yaml"
    path.write_text(f"tiers:\n  - {{backend: cpu, capacity: 8MiB}}\n  - {{backend: redis, capacity: 64MiB, url: '{url}'}}\n")
    proc = kvtier("config", "check", str(path), "--block-bytes", "64KiB")
    assert proc.returncode == 1, proc.stdout
    assert "cannot run on this machine (1 problem)" in proc.stdout
    assert f"error: tiers[1]: the redis server does not answer: {url}: not reachable" in proc.stdout
    assert main(["config", "check", str(path), "--probe-timeout", "0"]) == 0  # 0: no connection tried
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    capsys.readouterr()
    assert main(["sim", "--config", str(path), "--requests", "4", "--no-progress"]) == 0  # the run goes on without it
    out = capsys.readouterr()
    assert f"warning: redis: {url} unreachable" in out.err  # kvtier's logged warnings are shown
    assert "redis (tiers[1]) DOWN" in out.out and "down at the end of the run" in out.out
    assert main(["sim", "--config", str(path), "--requests", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tiers"][1]["outages"] >= 1 and data["tiers"][1]["up_at_end"] is False


def test_config_check_shows_the_slots_an_lmdb_tier_really_holds(tmp_path: Path) -> None:
    path = tmp_path / "lmdb.yaml"
    path.write_text(f"tiers:\n  - {{backend: lmdb, capacity: 256MiB, path: {tmp_path / 'db'}}}\n")
    data = json.loads(kvtier("config", "check", str(path), "--block-bytes", "32KiB", "--json").stdout)

    async def opened_slots() -> int:
        import kvtier as kv

        async with kv.open({**data["config"], "block_bytes": 32 << 10}) as store:
            return int(store.backends[0].max_blocks)

    slots = data["tiers"][0]["slots"]
    assert slots == asyncio.run(opened_slots()) and slots < (256 << 20) // (32 << 10)  # not capacity / block
    proc = kvtier("config", "check", str(path), "--block-bytes", "32KiB")
    assert ["0", "lmdb", "lmdb", "256.0MiB", str(slots), "lru"] == proc.stdout.splitlines()[5].split()[:6]


def test_a_namespace_override_names_its_field_and_config_check_shows_the_namespace(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.tools.cli import main

    example = str(Path(__file__).resolve().parent.parent / "examples" / "kvtier.yaml")
    proc = kvtier("config", "check", example, env={"KVTIER_NAMESPACE__TP_RANK": "3"})
    assert proc.returncode == 1
    assert "namespace.tp_rank (set by KVTIER_NAMESPACE__TP_RANK): expected 0 <= tp_rank < tp_size, got 3" in proc.stderr
    assert "KVTIER_NAMESPACE__TP_SIZE" in proc.stderr and "__init__" not in proc.stderr and "positional" not in proc.stderr
    for name in [v for v in os.environ if v.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIER_NAMESPACE__TP_RANK", "3")
    monkeypatch.setenv("KVTIER_NAMESPACE__TP_SIZE", "4")
    assert main(["config", "check", example]) == 0
    assert "namespace: model_id=default, tp_rank=3, tp_size=4" in capsys.readouterr().out
    monkeypatch.setenv("KVTIER_NAMESPACE__MODEL_ID", "m")
    assert main(["config", "check", example, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["namespace"]["model_id"] == "m" and data["namespace"]["tp_size"] == 4


def test_config_show_prints_the_defaults() -> None:
    proc = kvtier("config", "show", "--json")
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    assert [t["backend"] for t in data["tiers"]] == ["cpu", "lmdb"]
    text = kvtier("config", "show").stdout
    assert "installed backends" in text and "lmdb" in text


def test_config_show_says_what_kvtier_sim_uses(tmp_path: Path) -> None:
    text = kvtier("config", "show", env={"KVTIER_CACHE_DIR": str(tmp_path)}).stdout
    assert "`kvtier sim` does not use it" in text and "config show --sim" in text
    data = json.loads(kvtier("config", "show", "--sim", "--json", env={"KVTIER_CACHE_DIR": str(tmp_path)}).stdout)
    assert [(t["backend"], t["capacity"]) for t in data["tiers"]] == [("cpu", "2MiB"), ("lmdb", "256MiB")]
    assert data["tiers"][1]["path"] == str(tmp_path / "sim" / "lmdb")


def test_cache_show_and_clear_remove_only_the_cache_dir(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {"KVTIER_CACHE_DIR": str(cache)}
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    proc = kvtier("sim", "--requests", "8", "--no-progress", env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"{cache / 'sim' / 'lmdb'}: " in proc.stdout and "kvtier cache clear removes it" in proc.stdout
    (cache / "lmdb").mkdir()
    (cache / "lmdb" / "data.mdb").write_bytes(b"\0" * 8192)
    shown = json.loads(kvtier("cache", "show", "--json", env=env).stdout)
    assert shown["cache_dir"] == str(cache)
    assert {Path(e["path"]).name: e["kind"] for e in shown["entries"]} == {"lmdb": "lmdb tier", "sim": "simulator tiers"}
    dry = kvtier("cache", "clear", "--sim", "--dry-run", env=env)
    assert f"would remove {cache / 'sim'}" in dry.stdout and (cache / "sim").is_dir()
    proc = kvtier("cache", "clear", "--sim", env=env)
    assert proc.returncode == 0 and f"removed {cache / 'sim'}" in proc.stdout
    assert not (cache / "sim").exists() and (cache / "lmdb" / "data.mdb").exists()
    proc = kvtier("cache", "clear", env=env)
    assert f"removed {cache / 'lmdb'} (lmdb tier" in proc.stdout
    assert list(cache.iterdir()) == [] and outside.read_text() == "keep me"
    assert "nothing to remove" in kvtier("cache", "clear", env=env).stdout


def _lmdb_store(path: Path, blocks: int) -> None:
    from kvtier.backend import BlockFormat
    from kvtier.testing import make_key, random_block

    backend = registry.backends.get("lmdb")(capacity="16MiB", path=str(path), codec="zstd-shuffle", sync_mode="fast")
    fmt = BlockFormat(block_bytes=4096, dtype="bfloat16", namespace_digest=b"\1" * 32, namespace={"model_id": "cli-test"})

    async def fill() -> None:
        await backend.open(fmt)
        await backend.write([make_key(i) for i in range(blocks)], [random_block(4096, i) for i in range(blocks)])
        await backend.aclose()

    asyncio.run(fill())


def _corrupt_one(path: Path) -> str:
    """Flip one payload byte of one record, in place, through LMDB itself."""
    import lmdb

    env = lmdb.open(str(path), max_dbs=3, subdir=True)
    db = env.open_db(b"blocks")
    with env.begin(write=True, db=db) as txn:
        key, value = next(iter(txn.cursor()))
        broken = bytearray(value)
        broken[-1] ^= 0xFF
        txn.put(key, bytes(broken))
    env.close()
    return bytes(key).hex()


@pytest.fixture
def lmdb_dir(tmp_path: Path) -> Path:
    if "lmdb" not in registry.backends.names():
        pytest.skip("the lmdb backend is not registered in this checkout")
    path = tmp_path / "tier"
    _lmdb_store(path, 6)
    return path


def test_inspect_an_lmdb_tier(lmdb_dir: Path) -> None:
    proc = kvtier("inspect", str(lmdb_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["kind"] == "lmdb" and data["blocks"] == 6 and data["block_bytes"] == 4096
    assert data["raw_bytes"] == 6 * 4096 and data["format_version"] == 1
    assert data["namespaces"][0]["model_id"] == "cli-test"
    assert sum(data["codecs"].values()) == 6 and data["codec_ratio"] > 1.0
    table = kvtier("inspect", str(lmdb_dir)).stdout
    assert "codec ratio" in table and "cli-test" in table


def test_verify_finds_and_deletes_a_corrupt_record(lmdb_dir: Path) -> None:
    assert kvtier("verify", str(lmdb_dir)).returncode == 0
    bad_key = _corrupt_one(lmdb_dir)
    proc = kvtier("verify", str(lmdb_dir), "--json")
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    assert data["checked"] == 6 and [b["key"] for b in data["bad"]] == [bad_key] and data["deleted"] == 0
    assert "checksum" in data["bad"][0]["reason"]
    proc = kvtier("verify", str(lmdb_dir), "--delete")
    assert proc.returncode == 0 and "1 deleted" in proc.stdout
    data = json.loads(kvtier("verify", str(lmdb_dir), "--json").stdout)
    assert data["checked"] == 5 and data["ok"] is True


def _file_store(path: Path, blocks: int) -> None:
    from kvtier.backend import BlockFormat
    from kvtier.testing import make_key, random_block

    backend = registry.backends.get("file")(capacity="16MiB", path=str(path), codec="zstd-shuffle", sync_mode="fast")
    fmt = BlockFormat(block_bytes=4096, dtype="bfloat16", namespace_digest=b"\3" * 32, namespace={"model_id": "cli-file"})

    async def fill() -> None:
        await backend.open(fmt)
        await backend.write([make_key(i) for i in range(blocks)], [random_block(4096, i) for i in range(blocks)])
        await backend.aclose()

    asyncio.run(fill())


def test_inspect_and_verify_a_file_tier(tmp_path: Path) -> None:
    if "file" not in registry.backends.names():
        pytest.skip("the file backend is not registered in this checkout")
    from kvtier.testing import make_key

    path = tmp_path / "tier"
    _file_store(path, 4)
    proc = kvtier("inspect", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["kind"] == "file" and data["blocks"] == 4 and data["raw_bytes"] == 4 * 4096
    assert data["namespaces"][0]["model_id"] == "cli-file" and data["codec_ratio"] > 1.0
    table = kvtier("inspect", str(path)).stdout
    assert "file" in table and "cli-file" in table

    h = make_key(3).hex()
    record = path / f"{h}.kvb"  # the flat layout, a new store's
    broken = bytearray(record.read_bytes())
    broken[-1] ^= 0xFF
    record.write_bytes(bytes(broken))
    proc = kvtier("verify", str(path))
    assert proc.returncode == 1 and "1 bad" in proc.stdout and "--delete" in proc.stdout
    proc = kvtier("verify", str(path), "--delete", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["kind"] == "file" and [b["key"] for b in data["bad"]] == [h] and data["deleted"] == 1
    assert not record.exists()
    proc = kvtier("verify", str(path))
    assert proc.returncode == 0 and "checked 3 records, 0 bad" in proc.stdout


def test_inspect_rejects_a_directory_that_is_not_a_tier(tmp_path: Path) -> None:
    proc = kvtier("inspect", str(tmp_path))
    assert proc.returncode == 1 and "not a kvtier tier directory" in proc.stderr
    assert "data.mdb" in proc.stderr and "kvtier-meta.kvm" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_bench_collects_json_from_each_script_into_the_output_folder(tmp_path: Path) -> None:
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "bench_core.py").write_text(
        textwrap.dedent(
            """
            import json, sys
            print("warming up")
            print("progress", file=sys.stderr)
            print(json.dumps({"quick": "--quick" in sys.argv, "cpu_save_gbps": 2.5, "raw_save_gbps": 10.0}))
            """
        )
    )
    (scripts / "bench_disk.py").write_text("import sys\nprint('args', sys.argv[1:], file=sys.stderr)\nsys.exit(3)\n")
    out = tmp_path / "out"
    disk = tmp_path / "nvme"
    disk.mkdir()
    proc = kvtier("bench", "--quick", "--bench-dir", str(scripts), "--out", str(out), "--dir", str(disk), cwd=tmp_path)
    assert proc.returncode == 1  # bench_disk failed, and says so
    data = json.loads((out / "results.json").read_text())
    assert data["results"]["core"] == {"quick": True, "cpu_save_gbps": 2.5, "raw_save_gbps": 10.0}
    assert "exit 3" in data["failures"]["disk"] and data["missing"] == ["connector"]
    assert data["disk_dir"] == str(disk.resolve())
    core_log = (out / "core.log").read_text()
    assert "bench_core.py --quick\nexit status 0 after" in core_log  # a log says what ran, even when it printed little
    assert "-- stderr --\nprogress\n-- stdout --\nwarming up\n" in core_log
    disk_log = (out / "disk.log").read_text()
    assert f"--quick --dir {disk.resolve()}" in disk_log and "exit status 3" in disk_log  # --dir reaches the disk script
    assert ["core", "ok"] == proc.stdout.splitlines()[2].split()[:2] and "cpu save 2.5 GB/s (0.25× raw)" in proc.stdout
    assert f"disk benchmarks measured: {disk.resolve()}" in proc.stdout
    assert "bench_connector.py not found" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["benchmarks", "nvme", "out"]  # nothing in the current folder
    assert list(disk.iterdir()) == []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in proc.stdout and "kvtier[plot]" in proc.stdout
    else:
        assert (out / "kvtier-bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_matplotlib_writes_the_rest_and_says_how_to_get_the_picture(tmp_path: Path) -> None:
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "bench_core.py").write_text('import json\nprint(json.dumps({"cpu_save_gbps": 1.0}))\n')
    hide = tmp_path / "hide"  # a matplotlib that cannot be imported, as after a plain install
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    out = tmp_path / "out"
    proc = kvtier("bench", "--only", "core", "--bench-dir", str(scripts), "--out", str(out), env={"PYTHONPATH": str(hide)})
    assert proc.returncode == 0, proc.stderr
    note = "plot: not written: matplotlib is not installed (pip install 'kvtier[plot]')"
    assert note in proc.stdout and not (out / "kvtier-bench.png").exists() and (out / "results.json").exists()
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert note.removeprefix("plot: ") in readme and "$ pip install 'kvtier[plot]'" in readme  # the README says the same


def test_bench_dir_must_be_a_writable_folder(tmp_path: Path) -> None:
    proc = kvtier("bench", "--dir", str(tmp_path / "absent"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 1 and "--dir:" in proc.stderr and "is not a directory" in proc.stderr


def test_bench_default_output_folder_is_ignored_by_git() -> None:
    root = Path(__file__).resolve().parent.parent
    assert "/kvtier-bench/" in (root / ".gitignore").read_text().splitlines()


def test_bench_without_scripts_says_where_it_looked(tmp_path: Path) -> None:
    proc = kvtier("bench", "--bench-dir", str(tmp_path), "--out", str(tmp_path / "o"))
    assert proc.returncode == 1 and "no benchmark scripts" in proc.stderr and str(tmp_path) in proc.stderr



def test_verify_with_a_mac_algorithm(tmp_path: Path) -> None:
    """``--mac-algorithm hmac-sha256`` checks that a keyed store holds only HMAC-SHA256 records:
    BLAKE3 ones (the default MAC's) are reported unsupported; ``blake3`` (the default) checks both."""
    from kvtier.backend import BlockFormat
    from kvtier.testing import make_key, random_block

    secret = "cli-test-mac-secret-0123456789"
    fmt = BlockFormat(block_bytes=4096, dtype="bfloat16", namespace_digest=b"\1" * 32, namespace={"model_id": "cli-test"})
    paths = {}
    for algorithm in ("blake3", "hmac-sha256"):
        path = paths[algorithm] = tmp_path / algorithm
        backend = registry.backends.get("lmdb")(
            capacity="16MiB", path=str(path), sync_mode="fast", mac_key=secret, mac_algorithm=algorithm
        )

        async def fill(backend: Any = backend) -> None:
            await backend.open(fmt)
            await backend.write([make_key(i) for i in range(3)], [random_block(4096, i) for i in range(3)])
            await backend.aclose()

        asyncio.run(fill())
    env = {"CLI_TEST_MAC": secret}
    for store, algorithm, bad in (
        ("blake3", "blake3", 0),
        ("hmac-sha256", "blake3", 0),
        ("hmac-sha256", "hmac-sha256", 0),
        ("blake3", "hmac-sha256", 3),
    ):
        proc = kvtier("verify", str(paths[store]), "--mac-key-env", "CLI_TEST_MAC", "--mac-algorithm", algorithm, "--json", env=env)
        data = json.loads(proc.stdout)
        assert (store, algorithm, proc.returncode, data["checked"], len(data["bad"])) == (store, algorithm, int(bad > 0), 3, bad)
        assert all("unsupported" in b["reason"] for b in data["bad"])
    proc = kvtier("verify", str(paths["blake3"]), "--mac-algorithm", "hmac-sha256")
    assert proc.returncode == 1 and "--mac-algorithm: give the MAC secret too" in proc.stderr
    proc = kvtier("verify", str(paths["blake3"]), "--mac-algorithm", "md5")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
