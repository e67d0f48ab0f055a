"""Run from a checkout: the packages that an install maps from other folders of the source tree.

An install maps ``kvtier.backends`` from the checkout's top-level ``backends/`` folder and
``kvtier.tools.bench.scripts`` from ``benchmarks/`` (``pyproject.toml``, ``package-dir``). When a
script or ``python -m pytest`` runs in the checkout's root, Python imports ``kvtier`` from the
checkout's own ``kvtier/`` folder, ahead of any installed copy, and those two packages would then
come from the installed copy (another version) or from nowhere. ``install()`` binds them to the
checkout's own folders, so the checkout is importable as it stands, whatever is installed.

It does nothing where ``kvtier`` was imported from an install (a wheel's ``kvtier/backends/``
exists beside this file).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent

#: package name -> folder of the source tree, relative to the checkout's root.
MAPPED: dict[str, str] = {
    "kvtier.backends": "backends",
    "kvtier.tools.bench.scripts": "benchmarks",
}


def source_root() -> Path | None:
    """The checkout's root when ``kvtier`` runs from a source tree, else ``None``."""
    root = _HERE.parent
    if (_HERE / "backends").is_dir():
        return None  # an installed copy: its backends are inside the package
    if (root / "pyproject.toml").is_file() and (root / "backends" / "__init__.py").is_file():
        return root
    return None


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds the mapped packages in the checkout's folders (their submodules follow ``__path__``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        folder = MAPPED.get(fullname)
        if folder is None:
            return None
        base = self.root / folder
        init = base / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(base)])


def install() -> None:
    root = source_root()
    if root is None:
        return
    if any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SourceTreeFinder(root))


def installed_copy() -> Path | None:
    """The folder of the installed ``kvtier`` distribution's package (an editable install: its
    project's ``kvtier/``), or ``None`` when no distribution named kvtier is installed."""
    import json
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("kvtier")
    except PackageNotFoundError:
        return None
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        direct = {}
    url = str(direct.get("url", ""))
    if direct.get("dir_info", {}).get("editable") and url.startswith("file://"):
        return Path(url.removeprefix("file://")) / "kvtier"
    return Path(str(dist.locate_file("kvtier")))


def import_problem(missing: str | None) -> str:
    """Why kvtier's own module ``missing`` cannot be imported, in words an operator can act on:
    a copy of ``kvtier/`` that shadows the installed one (the usual cause: running from a
    checkout's root, whose ``kvtier/`` folder comes first on ``sys.path``), or an incomplete install."""
    here = _HERE
    installed = installed_copy()
    what = f"kvtier's own module {missing!r}" if missing else "a module of kvtier's own"
    if installed is not None and installed.resolve() != here:
        return (
            f"{what} is not found: kvtier is imported from {here}, which shadows the installed kvtier at {installed} "
            f"(a folder named kvtier/ comes first on sys.path, e.g. the current directory is a kvtier checkout or holds "
            f"a copy). Run from another folder, or install that checkout (pip install -e ROOT)."
        )
    if installed is None:
        return f"{what} is not found in {here}, and no kvtier distribution is installed: pip install kvtier (or pip install -e ROOT from a checkout)."
    return f"{what} is not found in the installed kvtier at {here}: the install is incomplete; reinstall kvtier."
