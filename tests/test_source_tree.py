"""Running from a checkout: kvtier imports as it stands, and where a copy of ``kvtier/`` shadows
the installed package, the error says so instead of asking to install a dependency.

Each test runs ``python -S`` in a temp folder holding a copy of the sources, with only that folder
and the environment's site-packages on ``sys.path``: the installed distribution's metadata (its
entry points) is visible, but no editable-install finder maps ``kvtier.backends`` elsewhere, as
after a plain (non-editable) ``pip install .``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from kvtier._source_tree import installed_copy

ROOT = Path(__file__).resolve().parent.parent
PROBE = (
    "from kvtier import registry\n"
    "try:\n"
    "    cls = registry.backends.get('lmdb')\n"
    "except Exception as exc:\n"
    "    print('ERROR', type(exc).__name__, exc)\n"
    "else:\n"
    "    import sys; print('OK', sys.modules[cls.__module__].__file__)\n"
)


def _copy(dest: Path, names: tuple[str, ...]) -> None:
    for name in names:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / name)


def _run_in(folder: Path) -> str:
    site = sysconfig.get_paths()["purelib"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), site])
    proc = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=folder, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_a_checkout_imports_its_own_backends_folder(tmp_path: Path) -> None:
    _copy(tmp_path, ("kvtier", "backends", "pyproject.toml"))
    out = _run_in(tmp_path)
    assert out.startswith("OK "), out
    assert Path(out.split(" ", 1)[1]).resolve().parent == (tmp_path / "backends").resolve()


def test_a_copy_of_kvtier_that_shadows_the_installed_one_is_named_in_the_error(tmp_path: Path) -> None:
    _copy(tmp_path, ("kvtier",))  # no backends/ beside it: kvtier.backends is nowhere
    out = _run_in(tmp_path)
    assert out.startswith("ERROR MissingDependencyError"), out
    assert "Install its dependencies" not in out
    assert str(tmp_path / "kvtier") in out
    if installed_copy() is not None:
        assert "shadows the installed kvtier" in out and "Run from another folder" in out
    else:
        assert "no kvtier distribution is installed" in out
