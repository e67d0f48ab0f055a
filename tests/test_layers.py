"""The folders are the layers: a lower layer never imports a higher one, and no import circle.

Every ``import`` in every module counts, wherever it is written (inside a function or under
``TYPE_CHECKING`` too): a late import still ties the two modules together.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: (source folder, the package it is installed as)
SOURCES = [("kvtier", "kvtier"), ("backends", "kvtier.backends"), ("benchmarks", "kvtier.tools.bench.scripts")]

#: Lowest first. A module may import its own package's modules and anything of a lower layer;
#: packages in one layer are siblings and never import each other (the manager never imports a
#: backend, a backend never imports the manager).
LAYERS: list[tuple[str, list[str]]] = [
    ("errors, the source-tree finder, lazy exports", ["kvtier.errors", "kvtier._source_tree", "kvtier._lazy"]),
    ("keys, units, devices, plugin registry", ["kvtier.keys", "kvtier.units", "kvtier.devices", "kvtier.registry", "kvtier._moved", "kvtier.bulk", "kvtier.shares", "kvtier.pool_rows"]),
    ("backend protocol, metrics", ["kvtier.backend", "kvtier.metrics"]),
    ("records | conformance suite", ["kvtier.records", "kvtier.testing"]),
    ("manager | backends", ["kvtier.manager", "kvtier.backends"]),
    ("transfer", ["kvtier.transfer"]),
    ("config", ["kvtier.config"]),
    ("the store facade's tenant calls", ["kvtier.tenancy"]),
    ("store", ["kvtier.store"]),
    ("package root", ["kvtier"]),  # the facade: kvtier.open, kvtier.Namespace, ...
    ("connector", ["kvtier.connector"]),
    ("simulator", ["kvtier.sim"]),
    ("integrations", ["kvtier.integrations"]),
    ("tools", ["kvtier.tools"]),
]


def _modules() -> dict[str, pathlib.Path]:
    mods: dict[str, pathlib.Path] = {}
    for folder, package in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The kvtier modules ``name`` imports (a ``from package import module`` names the module)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer_of(module: str) -> tuple[int, str]:
    """(layer index, owning package) by the longest matching package prefix."""
    best: tuple[int, str] | None = None
    for i, (_, packages) in enumerate(LAYERS):
        for pkg in packages:
            if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > len(best[1])):
                best = (i, pkg)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best


def test_every_module_has_a_layer() -> None:
    assert len(MODULES) > 60  # the scan found the sources
    for module in MODULES:
        _layer_of(module)


def test_the_top_of_kvtier_holds_only_the_foundation_the_protocol_and_the_facade() -> None:
    flat = sorted(p.stem for p in (ROOT / "kvtier").glob("*.py"))
    assert flat == [
        "__init__", "_lazy", "_moved", "_source_tree", "backend", "bulk", "devices", "errors", "keys", "metrics", "pool_rows", "registry", "shares", "store",
        "tenancy", "testing", "units",
    ]


def test_no_lower_layer_imports_a_higher_one() -> None:
    wrong = []
    for module, deps in GRAPH.items():
        layer, pkg = _layer_of(module)
        for dep in deps:
            dep_layer, dep_pkg = _layer_of(dep)
            if dep_pkg == pkg:
                continue
            if dep_layer > layer or (dep_layer == layer and dep_pkg != pkg):
                wrong.append(f"{module} ({LAYERS[layer][0]}) imports {dep} ({LAYERS[dep_layer][0]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle() -> None:
    # Tarjan's strongly connected components: any component of two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, circles


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        ("import kvtier.store\nfrom kvtier.manager import TierManager\n", None),
        ("from kvtier.store import KVStore\n", "imports kvtier.store"),
        ("from kvtier.backends.memory import CpuBackend\n", "imports kvtier.backends.memory"),
    ],
)
def test_the_layer_check_catches_an_upward_import(tmp_path: pathlib.Path, source: str, expect: str | None) -> None:
    # The check itself can fail: a manager module that imports the store or a backend is caught.
    fake = tmp_path / "policies.py"
    fake.write_text(source.replace("import kvtier.store\n", ""))
    deps = _imports("kvtier.manager.policies", fake)
    layer, pkg = _layer_of("kvtier.manager.policies")
    found = [
        f"imports {d}"
        for d in deps
        if _layer_of(d)[1] != pkg and (_layer_of(d)[0] > layer or (_layer_of(d)[0] == layer and _layer_of(d)[1] != pkg))
    ]
    assert (expect in found) if expect else not found
