"""The code in the README and the quick start runs as written and prints what it promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_readme_quick_start_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (code,) = python_blocks(ROOT / "README.md")
    assert "/tmp/kvtier-demo" in code
    exec(compile(code.replace("/tmp/kvtier-demo", str(tmp_path / "demo")), "README.md", "exec"), {})
    assert capsys.readouterr().out.split() == ["4", "4", "4"]


def test_quickstart_example_runs() -> None:
    first = python_blocks(ROOT / "docs" / "quickstart.md")[0]
    namespace: dict[str, object] = {}
    exec(compile(first, "docs/quickstart.md", "exec"), namespace)  # its asserts are the test
    assert "main" in namespace
