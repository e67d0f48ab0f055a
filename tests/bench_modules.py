"""A script of ``benchmarks/`` imported by a test under its module name, with its siblings
(``disk_common`` and the like) importable as the script itself finds them when it runs."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """The module of ``benchmarks/<name>.py`` (imported once per process, as any module)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def steps_printed(
    monkeypatch: Any, capsys: Any, name: str, sizes: list[int]
) -> tuple[ModuleType, list[dict[str, Any]]]:
    """A steps bench (``benchmarks/bench_<name>.py``) run with 2 rounds of 4 records at each of
    ``sizes``: the module and its JSON's figures per size, the fields every such bench prints
    checked (its name, the native build, the load, the sizes, records and rounds)."""
    bench = bench_module(f"bench_{name}")
    monkeypatch.setattr(
        sys, "argv", [f"bench_{name}.py", "--rounds", "2", "--blocks", "4", "--sizes", *map(str, sizes)]
    )
    bench.main()
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == name and out["native"] is True and out["load_at_start"] >= 0
    assert [s["block_bytes"] for s in out["sizes"]] == sizes
    assert all(s["blocks"] == 4 and s["rounds"] == 2 for s in out["sizes"])
    return bench, out["sizes"]


def assert_spent(size: dict[str, Any], names: Any) -> None:
    """Each of ``names`` has a spread of µs a record by both clocks, low to high, and a GB/s."""
    for name in names:
        for clock in ("cpu", "wall"):
            spent = size[f"{name}_{clock}_us"]
            assert 0 < spent["min"] <= spent["median"] <= spent["max"]
        assert size[f"{name}_gb_s"] > 0
