"""kvtier.integrations.vllm imports without vLLM; the vLLM classes fail with an install hint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.integrations import vllm as kv_vllm


def test_kv_transfer_config_selects_kvtier_connector() -> None:
    cfg = kv_vllm.kv_transfer_config({"tiers": [{"backend": "lmdb", "path": "/x", "capacity": "1GiB"}]})
    assert cfg["kv_connector"] == "KvtierConnector"
    assert cfg["kv_connector_module_path"] == "kvtier.integrations.vllm"
    assert cfg["kv_role"] == "kv_both"
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_extra_config"]["kvtier"]["tiers"][0]["backend"] == "lmdb"


def test_kv_transfer_config_refuses_the_stock_offloading_connector() -> None:
    # Its workers' results never reach kvtier's scheduler side in another process.
    with pytest.raises(ConfigError, match="KvtierConnector"):
        kv_vllm.kv_transfer_config({"tiers": []}, connector="OffloadingConnector")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_classes_need_vllm() -> None:
    with pytest.raises(MissingDependencyError, match="needs vLLM"):
        kv_vllm.KvtierConnector  # noqa: B018


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError):
        kv_vllm.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("field", ["tp_rank", "tp_size", "model_id"])
def test_namespace_fields_vllm_decides_are_refused_when_the_config_is_built(field: str) -> None:
    store = {"tiers": [{"backend": "lmdb", "path": "/x", "capacity": "1GiB"}], "namespace": {field: 0, "revision": "r1"}}
    with pytest.raises(ConfigError, match=rf"namespace\.{field}: set by vLLM for each rank"):
        kv_vllm.kv_transfer_config(store)
    assert kv_vllm.kv_transfer_config({**store, "namespace": {"revision": "r1"}})  # an operator's own field is fine


def test_namespace_fields_vllm_decides_are_refused_at_start_from_a_file(tmp_path: Path) -> None:
    """What the connector reads at start (the same check), here from a config file."""
    from kvtier.integrations.vllm.engines import store_config

    path = tmp_path / "kvtier.yaml"
    path.write_text(f"tiers:\n  - {{backend: lmdb, path: {tmp_path}/db, capacity: 1GiB}}\nnamespace:\n  tp_size: 4\n  tp_rank: 0\n")
    with pytest.raises(ConfigError, match=rf"{path}: namespace\.tp_rank: set by vLLM"):
        store_config({"kvtier": str(path)})
    with pytest.raises(ConfigError, match=r"namespace\.tp_rank"):
        kv_vllm.kv_transfer_config(str(path))
    assert kv_vllm.kv_transfer_config(str(tmp_path / "only-on-the-server.yaml"))  # not readable here: checked at start


PACKAGE = Path(kv_vllm.__file__).parent


def _top_level(module: str) -> tuple[set[str], set[str]]:
    """(classes defined at the top of ``module``, modules it imports at its top)."""
    import ast

    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    imported = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)}
    return classes, imported


def test_vllm_classes_are_module_level_in_modules_that_import_vllm_at_their_top() -> None:
    """Each vLLM class is a class of its module (not built inside a function), and only the
    modules that hold them import vLLM; the package loads them on first use."""
    import ast

    holders = {m.rpartition(".")[2] for m in kv_vllm.VLLM_CLASSES.values()}
    for name, module in kv_vllm.VLLM_CLASSES.items():
        classes, imported = _top_level(module.rpartition(".")[2])
        assert name in classes, f"{name} is not defined at the top of {module}"
        assert any(m == "vllm" or m.startswith("vllm.") for m in imported), f"{module} does not import vLLM at its top"
    for path in PACKAGE.glob("*.py"):
        if path.stem in holders:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not [n for n in names if n == "vllm" or n.startswith("vllm.")], f"{path.name} imports vLLM"


def test_no_underscore_name_crosses_the_package_s_modules() -> None:
    import ast

    for path in [*PACKAGE.glob("*.py"), *Path(__file__).parent.glob("*vllm*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtier.integrations.vllm"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
