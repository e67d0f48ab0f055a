"""kvtier.integrations.vllm imports without vLLM; the vLLM classes fail with an install hint."""

from __future__ import annotations

import importlib.util

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
