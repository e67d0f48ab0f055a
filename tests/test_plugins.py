"""Third-party plugins, for real: the distribution under tests/plugin_fixture/ is built and
installed into a throwaway virtual environment, and everything runs in that interpreter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "plugin_fixture"


def _run(python: Path, code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=cwd, check=False
    )


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugin-venv")
    source = root / "src"
    shutil.copytree(FIXTURE, source)  # build outputs land in the copy, not in the repository
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root / "venv")], check=True)
    bindir = "Scripts" if os.name == "nt" else "bin"
    python = root / "venv" / bindir / "python"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"installing the plugin fixture failed:\n{proc.stdout}\n{proc.stderr}")
    return python


def test_plugin_names_are_listed_and_loaded(venv_python: Path) -> None:
    proc = _run(
        venv_python,
        """
        from kvtier import registry
        print(registry.backends.entries()["demo-dict"])
        print(registry.backends.get("demo-dict").__name__)
        print(registry.policies.get("demo-fifo").__name__)
        codec = registry.codecs.get("demo-flip")()
        print(type(codec).from_dict(codec.to_dict()) == codec)
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["['kvtier-demo-plugin']", "DictBackend", "FifoPolicy", "True"]


def test_plugin_selected_from_a_config_file(venv_python: Path, tmp_path: Path) -> None:
    config = tmp_path / "store.yaml"
    config.write_text(
        textwrap.dedent(
            """
            block_bytes: 4096
            tiers:
              - {backend: cpu, capacity: 64KiB}
              - {backend: demo-dict, capacity: 1MiB, label: remote, policy: demo-fifo}
              - {backend: "kvtier_demo_plugin:DictBackend", capacity: 1MiB}
            """
        )
    )
    proc = _run(
        venv_python,
        f"""
        import asyncio, kvtier
        async def main():
            async with kvtier.open({str(config)!r}) as store:
                print([type(b).__name__ for b in store.backends])
                print(store.backends[1].to_dict())
                print(store.manager.tier_spec(1).policy.name)
        asyncio.run(main())
        """,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "['CpuBackend', 'DictBackend', 'DictBackend']"
    assert lines[1] == "{'backend': 'demo-dict', 'capacity': 1048576, 'label': 'remote'}"
    assert lines[2] == "demo-fifo"


def test_plugin_option_errors_name_the_field(venv_python: Path, tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[[tiers]]\nbackend = "demo-dict"\ncapacity = "1MiB"\nlabel = ""\n')
    proc = subprocess.run(
        [str(venv_python), "-m", "kvtier.cli", "config", "check", str(config)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1
    assert str(config) in proc.stderr and "tiers[0].label" in proc.stderr


def test_plugin_passes_the_conformance_suite(venv_python: Path, tmp_path: Path) -> None:
    tests = tmp_path / "test_demo_conformance.py"
    tests.write_text(
        textwrap.dedent(
            """
            from kvtier import registry
            from kvtier.config import build_backend, load_config
            from kvtier.testing import BackendTests

            class TestDictBackend(BackendTests):
                def make_backend(self, path, capacity):
                    cfg = load_config({"tiers": [{"backend": "demo-dict", "capacity": capacity, "label": "t"}]})
                    return build_backend(cfg.tiers[0], 0)
            """
        )
    )
    proc = subprocess.run(
        [str(venv_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def _clash_distribution(root: Path, name: str) -> Path:
    """An installed distribution (a dist-info with entry points) claiming ``name``."""
    info = root / "kvtier_clash_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-clash-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[kvtier.backends]\n{name} = kvtier_clash_plugin:Other\n")
    return root


@pytest.mark.parametrize(("name", "other"), [("demo-dict", "kvtier-demo-plugin"), ("cpu", "kvtier")])
def test_two_distributions_claiming_one_name_fail_naming_both(venv_python: Path, tmp_path: Path, name: str, other: str) -> None:
    site = _clash_distribution(tmp_path / "site", name)
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = _run(
        venv_python,
        f"""
        from kvtier import registry
        from kvtier.errors import ConfigError
        try:
            registry.backends.get({name!r})
        except ConfigError as exc:
            print(exc)
        else:
            print("no error")
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kvtier-clash-plugin" in proc.stdout
    assert f"{other} (" in proc.stdout
    assert name in proc.stdout
