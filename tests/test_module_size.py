"""Modules and classes stay small enough to read: no module under kvtier/ or backends/ is over
600 lines, and no class there over 400. The C sources of the native extensions (``*.c`` and
``*.h`` under kvtier/) are held to the same 600 lines.

A module that grows past it is split by concern (as ``kvtier/records/format.py`` and
``kvtier/sim/engine.py`` were), keeping its public names importable from where they were. A
class that grows past it hands a concern to a collaborator of its own (as ``TierManager`` did
with ``RecordSync`` and ``Readout``, ``KVStore`` with ``JobRuns``), keeping its public methods
where they were.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = [ROOT / "kvtier", ROOT / "backends"]
MAX_LINES = 600
MAX_CLASS_LINES = 400
#: classes over MAX_CLASS_LINES today, "folder/module.py:Class" -> the most lines they may keep
#: until they are split (each one's own task); a class listed here may only shrink.
CLASS_EXCEPTIONS: dict[str, int] = {}


#: what the line limit reads under each folder: Python modules, and the extensions' C sources
PATTERNS = ("*.py", "*.c", "*.h")


def _too_long(folders: list[pathlib.Path], patterns: tuple[str, ...] = PATTERNS) -> list[str]:
    over = []
    for folder in folders:
        for path in sorted(p for pattern in patterns for p in folder.rglob(pattern)):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                over.append(f"{path.relative_to(folder.parent)}: {lines} lines")
    return over


def _class_sizes(folders: list[pathlib.Path]) -> dict[str, int]:
    """Lines of every class (its ``class`` line to its last line, nested ones apart), by
    ``folder/module.py:Class``."""
    sizes: dict[str, int] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    assert node.end_lineno is not None
                    sizes[f"{path.relative_to(folder.parent)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def _classes_too_long(folders: list[pathlib.Path], exceptions: dict[str, int]) -> list[str]:
    return [
        f"{name}: {lines} lines"
        for name, lines in _class_sizes(folders).items()
        if lines > max(MAX_CLASS_LINES, exceptions.get(name, 0))
    ]


def test_no_module_is_over_600_lines() -> None:
    assert sum(1 for f in FOLDERS for _ in f.rglob("*.py")) > 60  # the scan found the sources
    over = _too_long(FOLDERS, ("*.py",))
    assert not over, "split these by concern: " + "; ".join(over)


def test_no_c_source_is_over_600_lines() -> None:
    c_sources = [p.name for p in (ROOT / "kvtier").rglob("*.c")]
    assert {"_xxcopy.c", "_probe.c"} <= set(c_sources)  # the scan found the extensions' sources
    over = _too_long(FOLDERS, ("*.c", "*.h"))
    assert not over, "split these by concern (one extension, several sources): " + "; ".join(over)


def test_no_class_is_over_400_lines() -> None:
    sizes = _class_sizes(FOLDERS)
    assert "kvtier/manager/tier_manager.py:TierManager" in sizes  # the scan found the classes
    over = _classes_too_long(FOLDERS, CLASS_EXCEPTIONS)
    assert not over, "hand a concern of these to a collaborator: " + "; ".join(over)


def test_every_class_exception_is_still_needed() -> None:
    # An exception whose class shrank under the limit (or is gone) is dropped from the list.
    sizes = _class_sizes(FOLDERS)
    stale = [name for name in CLASS_EXCEPTIONS if sizes.get(name, 0) <= MAX_CLASS_LINES]
    assert not stale, "drop these from CLASS_EXCEPTIONS: " + "; ".join(stale)


def test_the_check_catches_a_long_module(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "short.py").write_text("x = 1\n" * MAX_LINES)
    (pkg / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert _too_long([pkg]) == [f"pkg/long.py: {MAX_LINES + 1} lines"]


def test_the_check_catches_a_long_c_source(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "short.c").write_text("int x;\n" * MAX_LINES)
    (pkg / "long.c").write_text("int x;\n" * (MAX_LINES + 1))
    (pkg / "long.h").write_text("int x;\n" * (MAX_LINES + 1))
    (pkg / "other.txt").write_text("x\n" * (MAX_LINES + 1))
    assert _too_long([pkg]) == [f"pkg/long.c: {MAX_LINES + 1} lines", f"pkg/long.h: {MAX_LINES + 1} lines"]


def test_the_check_catches_a_long_class(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "    x = 1\n"
    (pkg / "m.py").write_text(
        "class Short:\n" + body * (MAX_CLASS_LINES - 1) + "\n\nclass Long:\n" + body * MAX_CLASS_LINES + "\n\nclass Kept:\n" + body * 450
    )
    assert _classes_too_long([pkg], {"pkg/m.py:Kept": 451}) == [f"pkg/m.py:Long: {MAX_CLASS_LINES + 1} lines"]
    assert _classes_too_long([pkg], {}) == [f"pkg/m.py:Long: {MAX_CLASS_LINES + 1} lines", "pkg/m.py:Kept: 451 lines"]
