"""Modules stay small enough to read: none under kvtier/ or backends/ is over 600 lines.

A module that grows past it is split by concern (as ``kvtier/records/format.py`` and
``kvtier/sim/engine.py`` were), keeping its public names importable from where they were.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 600


def _too_long(folders: list[pathlib.Path]) -> list[str]:
    over = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                over.append(f"{path.relative_to(folder.parent)}: {lines} lines")
    return over


def test_no_module_is_over_600_lines() -> None:
    folders = [ROOT / "kvtier", ROOT / "backends"]
    assert sum(1 for f in folders for _ in f.rglob("*.py")) > 60  # the scan found the sources
    over = _too_long(folders)
    assert not over, "split these by concern: " + "; ".join(over)


def test_the_check_catches_a_long_module(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "short.py").write_text("x = 1\n" * MAX_LINES)
    (pkg / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert _too_long([pkg]) == [f"pkg/long.py: {MAX_LINES + 1} lines"]
