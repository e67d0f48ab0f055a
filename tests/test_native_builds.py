"""Every optional C extension the package declares (``pyproject.toml``'s ``ext-modules``) is
built wherever a C compiler is, and built from its current sources: an editable install whose
sources moved on (a pull or a merge without ``pip install -e .``) keeps the old ``.so``, which
may lack a call the Python side now asks for or carry a bug fixed since. And a stale
``kvtier.backends._rowguard`` lacking one of its calls leaves the lmdb tier on the Python forms
rather than failing its import."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]


def _compiler() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


def test_the_declared_extensions_are_the_known_ones() -> None:
    assert {e["name"] for e in EXTENSIONS} >= {
        "kvtier.records._xxcopy", "kvtier.backends._rowguard", "kvtier.manager._probe", "kvtier.transfer._blockcopy"
    }


@pytest.mark.parametrize("ext", EXTENSIONS, ids=[e["name"] for e in EXTENSIONS])
def test_every_extension_is_built_from_its_current_sources(ext: dict) -> None:
    if not _compiler():
        pytest.skip(f"NO C COMPILER OR NO Python.h: {ext['name']} NOT BUILT, its Python path runs")
    spec = importlib.util.find_spec(ext["name"])
    assert spec is not None and spec.origin, f"{ext['name']} did not build although a C compiler exists (reinstall: pip install -e .)"
    sources = [ROOT / p for p in (*ext["sources"], *ext.get("depends", ()))]
    newest = max(sources, key=lambda p: p.stat().st_mtime)
    assert os.path.getmtime(spec.origin) >= newest.stat().st_mtime, (
        f"{ext['name']} is stale: {spec.origin} is older than {newest.relative_to(ROOT)} (reinstall: pip install -e .)"
    )


def test_the_row_guard_is_native_where_built() -> None:
    from kvtier.backends import lmdb_plain

    if importlib.util.find_spec("kvtier.backends._rowguard") is None:
        pytest.skip("kvtier.backends._rowguard NOT BUILT: the Python forms run")
    assert lmdb_plain.NATIVE_GUARD, "kvtier.backends._rowguard is built but lacks a call (stale: reinstall: pip install -e .)"
    assert lmdb_plain.one_row is not lmdb_plain.one_row_python and lmdb_plain.host_view is not lmdb_plain.host_view_python


_STALE = """
import sys, types
stale = types.ModuleType("kvtier.backends._rowguard")
stale.host_view = lambda *a: None  # a build from before one_row: host_view and same_size only
stale.same_size = lambda *a: False
sys.modules["kvtier.backends._rowguard"] = stale
from kvtier.backends import lmdb_plain
print("native", lmdb_plain.NATIVE_GUARD)
print("python", lmdb_plain.one_row is lmdb_plain.one_row_python and lmdb_plain.host_view is lmdb_plain.host_view_python
      and lmdb_plain.same_size is lmdb_plain.same_size_python)
"""


def test_a_stale_row_guard_leaves_the_python_forms() -> None:
    child = subprocess.run([sys.executable, "-c", _STALE], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "native False" in child.stdout and "python True" in child.stdout
