"""Third-party plugins, for real: the example plugin distribution under
examples/kvtier-dict-backend/ (the one docs/plugins.md shows) is built into a wheel, installed
into a throwaway virtual environment, and everything runs in that interpreter.

The wheel is built by the running interpreter (its own setuptools, offline, no build isolation),
so the test needs nothing the test extra does not install. The throwaway environment is made
without ``--system-site-packages`` (that would expose the *base* interpreter's packages, not the
ones this interpreter runs with); a ``.pth`` file adds this interpreter's site directories
after its own, so kvtier, torch and pytest come from here and the plugin only from the wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parent.parent / "examples" / "kvtier-dict-backend"


def _run(python: Path, code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=cwd, check=False
    )


def _checked(cmd: list[str], what: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({' '.join(cmd)}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _site_dirs() -> list[str]:
    """Where this interpreter finds its packages (kvtier itself, torch, pytest)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def build_plugin_wheel(source: Path, out: Path) -> Path:
    """Build ``source`` into a wheel in ``out`` with this interpreter's setuptools."""
    work = out / "src"
    shutil.copytree(source, work, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    _checked(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(work)],
        "building the plugin wheel with this interpreter's setuptools (>=70.1, in kvtier's dev extra)",
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def make_venv_with(wheel: Path, root: Path) -> Path:
    """A fresh virtual environment that sees this interpreter's packages and has ``wheel`` installed."""
    _checked([sys.executable, "-m", "venv", "--without-pip", str(root)], "creating a virtual environment")
    python = root / ("Scripts" if os.name == "nt" else "bin") / ("python.exe" if os.name == "nt" else "python")
    purelib = _checked(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "asking the venv for its site directory"
    ).stdout.strip()
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in _site_dirs())
    (Path(purelib) / "zz_outer_site.pth").write_text(lines)  # after the venv's own packages
    _checked(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        "installing the plugin wheel into the throwaway venv",
    )
    return python


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugin")
    wheel = build_plugin_wheel(PLUGIN, root / "dist")
    return make_venv_with(wheel, root / "venv")


def test_plugin_is_not_visible_outside_its_venv() -> None:
    """The plugin reaches kvtier only through the wheel installed in the throwaway venv."""
    proc = _run(Path(sys.executable), "import importlib.util; print(importlib.util.find_spec('kvtier_dict_backend'))")
    assert proc.stdout.strip() == "None", "kvtier_dict_backend must not be installed in the test interpreter"


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
    assert proc.stdout.split() == ["['kvtier-dict-backend']", "DictBackend", "FifoPolicy", "True"]


def test_plugins_md_shows_what_config_show_prints(venv_python: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(venv_python), "-m", "kvtier.tools.cli", "config", "show"], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr
    installed = [line for line in proc.stdout.splitlines() if line.startswith("# installed")]
    assert len(installed) == 3 and all("(kvtier-dict-backend)" in line for line in installed), proc.stdout
    doc = (Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    shown = [line.removesuffix(", ...") for line in doc.splitlines() if line.startswith("# installed")]
    assert len(shown) == 3, shown
    for want, got in zip(shown, installed):
        assert got.startswith(want), f"docs/plugins.md shows {want!r}, kvtier config show prints {got!r}"


def test_plugin_selected_from_a_config_file(venv_python: Path, tmp_path: Path) -> None:
    config = tmp_path / "store.yaml"
    config.write_text(
        textwrap.dedent(
            """
            block_bytes: 4096
            tiers:
              - {backend: cpu, capacity: 64KiB}
              - {backend: demo-dict, capacity: 1MiB, label: remote, policy: demo-fifo}
              - {backend: "kvtier_dict_backend:DictBackend", capacity: 1MiB}
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


def test_plugins_md_config_checks_with_the_plugin_installed(venv_python: Path, tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if "demo-dict" in b]
    config = tmp_path / "store.yaml"
    config.write_text(block)
    proc = subprocess.run(
        [str(venv_python), "-m", "kvtier.tools.cli", "config", "check", str(config)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo-dict" in proc.stdout and "demo-fifo" in proc.stdout, proc.stdout


def test_plugin_option_errors_name_the_field(venv_python: Path, tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[[tiers]]\nbackend = "demo-dict"\ncapacity = "1MiB"\nlabel = ""\n')
    proc = subprocess.run(
        [str(venv_python), "-m", "kvtier.tools.cli", "config", "check", str(config)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1
    assert str(config) in proc.stderr and "tiers[0].label" in proc.stderr


def test_plugin_passes_the_conformance_suite(venv_python: Path, tmp_path: Path) -> None:
    """The example's own tests (shown in docs/plugins.md), plus the backend built from a config."""
    tests = tmp_path / "tests"
    shutil.copytree(PLUGIN / "tests", tests)  # away from the source, so the wheel is what is imported
    (tests / "test_from_config.py").write_text(
        textwrap.dedent(
            """
            from kvtier.config import build_backend, load_config
            from kvtier.testing import BackendTests

            class TestDictBackendFromConfig(BackendTests):
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
    summary = proc.stdout.strip().splitlines()[-1]
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 2 * 11 + 1 and "failed" not in summary, summary


def _clash_distribution(root: Path, name: str) -> Path:
    """An installed distribution (a dist-info with entry points) claiming ``name``."""
    info = root / "kvtier_clash_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-clash-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[kvtier.backends]\n{name} = kvtier_clash_plugin:Other\n")
    return root


@pytest.mark.parametrize(("name", "other"), [("demo-dict", "kvtier-dict-backend"), ("cpu", "kvtier")])
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


def _broken_distribution(root: Path) -> Path:
    """An installed distribution whose entry points fail to load in three different ways."""
    info = root / "kvtier_broken_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-broken-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[kvtier.policies]\n"
        "no-such-class = kvtier_broken_plugin:FifoPolicy\n"
        "raises = kvtier_broken_raises:Policy\n"
        "needs-missing = kvtier_broken_needs:Policy\n"
    )
    (root / "kvtier_broken_plugin.py").write_text("class LruPolicy: ...\n")
    (root / "kvtier_broken_raises.py").write_text("raise RuntimeError('plugin bug at import')\n")
    (root / "kvtier_broken_needs.py").write_text("import kvtier_dependency_not_installed_xyz\n")
    return root


@pytest.mark.parametrize(
    ("name", "error", "cause"),
    [
        ("no-such-class", "PluginLoadError", "AttributeError"),
        ("raises", "PluginLoadError", "RuntimeError: plugin bug at import"),
        ("needs-missing", "MissingDependencyError", "kvtier_dependency_not_installed_xyz"),
    ],
)
def test_a_plugin_that_fails_to_load_is_a_kvtier_error_naming_it(tmp_path: Path, name: str, error: str, cause: str) -> None:
    site_dir = _broken_distribution(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(site_dir)}
    proc = _run(
        Path(sys.executable),
        f"""
        import asyncio, torch, kvtier
        from kvtier import registry
        for attempt in ("get", "open"):
            try:
                if attempt == "get":
                    registry.policies.get({name!r})
                else:
                    config = {{"tiers": [{{"backend": "cpu", "capacity": "1MiB", "policy": {name!r}}}]}}
                    async def main():
                        async with kvtier.open(config, kv_caches=[torch.zeros(4, 4096, dtype=torch.uint8)]):
                            pass
                    asyncio.run(main())
            except kvtier.KVTierError as exc:
                print(type(exc).__name__, "|", exc)
            else:
                print("no error")
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert line.startswith(f"{error} |"), line
        assert "kvtier-broken-plugin" in line and name in line and cause in line, line


def test_a_module_colon_name_whose_import_raises_is_a_kvtier_error(tmp_path: Path) -> None:
    site_dir = _broken_distribution(tmp_path / "site")
    proc = _run(
        Path(sys.executable),
        """
        from kvtier import registry
        from kvtier.errors import PluginLoadError
        try:
            registry.policies.get("kvtier_broken_raises:Policy")
        except PluginLoadError as exc:
            print(exc)
        """,
        env={**os.environ, "PYTHONPATH": str(site_dir)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "'kvtier_broken_raises:Policy' raised RuntimeError: plugin bug at import" in proc.stdout


def _extra_requirements(dist: str, extra: str) -> set[str]:
    """Names of what ``pip install "dist[extra]"`` adds, from the installed metadata."""
    from importlib.metadata import requires

    out = set()
    for req in requires(dist) or []:
        name, _, marker = req.partition(";")
        if re.search(rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]", marker):
            out.add(re.split(r"[\s<>=!~\[]", name.strip(), maxsplit=1)[0].lower())
    return out


def test_the_testing_extra_installs_what_kvtier_testing_needs() -> None:
    """``pip install "kvtier[testing]"`` gives a plugin author's environment everything the
    conformance suite imports, and the docs run it with that environment's pytest."""
    import ast
    from importlib.metadata import requires

    testing = _extra_requirements("kvtier", "testing")
    assert testing == {"pytest", "hypothesis"}, testing  # no pytest-asyncio: the suite uses asyncio.run
    base = {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower() for r in requires("kvtier") or [] if "extra ==" not in r}
    source = (Path(__file__).resolve().parent.parent / "kvtier" / "testing.py").read_text()
    imported = {
        (n.names[0].name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.Import, ast.ImportFrom)) and not (isinstance(n, ast.ImportFrom) and n.level)
    }
    third_party = {m for m in imported if m and m not in sys.stdlib_module_names and m != "kvtier"}
    assert third_party <= base | testing, f"kvtier.testing imports {sorted(third_party - base - testing)}, installed by nothing"
    assert "pytest" in third_party  # the reason the extra exists
    plugins_md = (Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    assert 'pip install -e "examples/kvtier-dict-backend[test]" && python -m pytest -q examples/kvtier-dict-backend/tests' in plugins_md
    assert "&& pytest" not in plugins_md and '"kvtier[testing]"' in plugins_md


def test_the_example_plugin_s_test_extra_pulls_in_kvtier_testing(tmp_path: Path) -> None:
    wheel = build_plugin_wheel(PLUGIN, tmp_path / "dist")
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        meta = next(zf.read(n).decode() for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    assert re.search(r"^Requires-Dist: kvtier\[testing\]; extra == \"test\"$", meta, re.M), meta
