"""The plugin registries: built-ins, unknown names, ``module:Object`` names, duplicate claims."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier.backends.memory import CpuBackend, GpuBackend

from kvtier import registry
from kvtier.errors import ConfigError, MissingDependencyError, UnknownNameError
from kvtier.manager.policies import ARCPolicy, LRUPolicy


def test_builtins_are_listed_by_name() -> None:
    assert {"cpu", "gpu"} <= set(registry.backends.names())
    assert {"lru", "arc"} <= set(registry.policies.names())
    assert registry.backends.get("cpu") is CpuBackend
    assert registry.backends.get("gpu") is GpuBackend
    assert registry.policies.get("lru") is LRUPolicy
    assert registry.policies.get("arc") is ARCPolicy
    assert "kvtier" in registry.policies.entries()["lru"]
    assert "lru" in registry.policies and "nope" not in registry.policies


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match="unknown policy 'fifo'") as info:
        registry.policies.get("fifo")
    assert "lru" in str(info.value) and "arc" in str(info.value)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, LookupError)
    with pytest.raises(UnknownNameError, match="cpu"):
        registry.backends.get("tape")
    with pytest.raises(UnknownNameError):
        registry.backends.get("")


def test_module_colon_object_names() -> None:
    assert registry.policies.get("kvtier.manager.policies:LRUPolicy") is LRUPolicy
    assert registry.load_object("kvtier.manager.policies.ARCPolicy") is ARCPolicy
    with pytest.raises(ConfigError, match="no attribute"):
        registry.policies.get("kvtier.manager.policies:NoSuchPolicy")
    with pytest.raises(MissingDependencyError, match="no_such_module_xyz"):
        registry.policies.get("no_such_module_xyz:Thing")
    with pytest.raises(ConfigError, match="form"):
        registry.load_object("nodots")


def test_register_and_unregister() -> None:
    class FifoPolicy(LRUPolicy):
        name = "fifo-test"

    registry.policies.register("fifo-test", FifoPolicy)
    try:
        assert registry.policies.get("fifo-test") is FifoPolicy
        assert "fifo-test" in registry.policies.names()
        assert registry.policies.entries()["fifo-test"] == ["<registered in process>"]
    finally:
        registry.policies.unregister("fifo-test")
    assert "fifo-test" not in registry.policies.names()
    with pytest.raises(UnknownNameError):
        registry.policies.get("fifo-test")


def _entry(name: str, value: str, group: str, dist: str) -> EntryPoint:
    ep = EntryPoint(name=name, value=value, group=group)
    return ep._for(SimpleNamespace(name=dist))  # type: ignore[no-any-return]


def test_two_distributions_claiming_one_name(monkeypatch: pytest.MonkeyPatch) -> None:
    group = "kvtier.policies"
    fake = [
        _entry("lru", "kvtier.manager.policies:LRUPolicy", group, "kvtier"),
        _entry("shared", "kvtier.manager.policies:LRUPolicy", group, "plugin-alpha"),
        _entry("shared", "kvtier.manager.policies:ARCPolicy", group, "plugin-beta"),
    ]

    def entry_points(**kwargs: Any) -> list[EntryPoint]:
        return [ep for ep in fake if ep.group == kwargs.get("group")]

    monkeypatch.setattr(registry, "entry_points", entry_points)
    fresh = registry.Registry(group, "policy")
    assert fresh.names() == ["lru", "shared"]
    assert fresh.get("lru") is LRUPolicy
    with pytest.raises(ConfigError, match="shared") as info:
        fresh.get("shared")
    message = str(info.value)
    assert "plugin-alpha" in message and "plugin-beta" in message


def test_two_distributions_claiming_one_name_with_the_same_target(monkeypatch: pytest.MonkeyPatch) -> None:
    group = "kvtier.policies"
    fake = [
        _entry("lru", "kvtier.manager.policies:LRUPolicy", group, "kvtier"),
        _entry("lru", "kvtier.manager.policies:LRUPolicy", group, "kvtier-fork"),
    ]
    monkeypatch.setattr(registry, "entry_points", lambda **kw: fake)
    fresh = registry.Registry(group, "policy")
    with pytest.raises(ConfigError, match="kvtier-fork"):
        fresh.get("lru")


def test_same_distribution_listed_twice_is_not_a_conflict(monkeypatch: pytest.MonkeyPatch) -> None:
    group = "kvtier.policies"
    fake = [_entry("lru", "kvtier.manager.policies:LRUPolicy", group, "kvtier")] * 2
    monkeypatch.setattr(registry, "entry_points", lambda **kw: fake)
    fresh = registry.Registry(group, "policy")
    assert fresh.get("lru") is LRUPolicy
    assert fresh.entries() == {"lru": ["kvtier"]}


def test_an_entry_that_cannot_be_imported_names_its_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    group = "kvtier.backends"
    fake = [_entry("s3", "kvtier_s3_plugin_missing:S3Backend", group, "kvtier-s3")]
    monkeypatch.setattr(registry, "entry_points", lambda **kw: fake)
    fresh = registry.Registry(group, "backend")
    with pytest.raises(MissingDependencyError, match="kvtier-s3"):
        fresh.get("s3")
