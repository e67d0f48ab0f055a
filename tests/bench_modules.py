"""A script of ``benchmarks/`` imported by a test under its module name, with its siblings
(``disk_common`` and the like) importable as the script itself finds them when it runs."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """The module of ``benchmarks/<name>.py`` (imported once per process, as any module)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
