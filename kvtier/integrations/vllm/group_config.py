"""What each offloaded KV-cache group of a vLLM engine is made of: which groups kvtier can
offload, and each group's layout string, share of a tier's capacity and tiers (see
:mod:`.groups` for how the groups are offloaded). Nothing here imports vLLM."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.units import parse_size

#: Shared tiers that keep apart the records of different writers by a key ``prefix`` (a rank's,
#: a KV-cache group's): a server or bucket holds every writer's records side by side.
PREFIXED_BACKENDS = frozenset({"redis", "s3", "mooncake"})

__all__ = ["check_kv_cache_groups", "group_layout", "group_shares", "group_tiers"]


def check_kv_cache_groups(groups: Sequence[Any]) -> None:
    """Refuse KV-cache groups kvtier cannot offload (``groups``: vLLM's
    ``KVCacheConfig.kv_cache_groups``): Mamba state, named by group index and layers."""
    for i, group in enumerate(groups):
        spec = getattr(group, "kv_cache_spec", None)
        if any(cls.__name__ == "MambaSpec" for cls in type(spec).__mro__):
            layers = list(getattr(group, "layer_names", ()))
            shown = ", ".join(layers[:4]) + (f", ... ({len(layers)} layers)" if len(layers) > 4 else "")
            raise ConfigError(
                f"kvtier's vLLM integration does not offload Mamba state: KV-cache group {i} "
                f"({type(spec).__name__}, layers {shown}) holds one state per request that is overwritten in place, "
                "not a prefix of blocks; run this model without kvtier's connector"
            )


def group_layout(layout: str, group_id: int, num_groups: int) -> str:
    """The layout string of group ``group_id`` in keys and records (one group: ``layout`` as is)."""
    return layout if num_groups == 1 else f"group{group_id};{layout}"


def group_shares(block_bytes: Sequence[int]) -> list[float]:
    """Each group's share of a tier's capacity: its bytes per block over all groups' (so every
    group holds as many blocks)."""
    total = sum(block_bytes)
    if total <= 0:
        raise ConfigError(f"kvtier: KV-cache groups with {list(block_bytes)} bytes per block")
    return [b / total for b in block_bytes]


def group_tiers(cfg: Mapping[str, Any], group_id: int, share: float, num_groups: int) -> dict[str, Any]:
    """A rank's store config (see ``rank_tiers``) for group ``group_id``: ``share`` of each
    tier's capacity and its own records (``<path>-g<group>``, Redis ``<prefix>.g<group>``).
    One group: the config as is."""
    if num_groups == 1:
        return dict(cfg)
    out = dict(cfg)
    tiers = []
    for i, tier in enumerate(cfg.get("tiers") or ()):
        t = dict(tier)
        if "capacity" in t:
            t["capacity"] = max(1, int(parse_size(t["capacity"], field=f"tiers[{i}].capacity") * share))
        if t.get("path") is not None:
            t["path"] = f"{t['path']}-g{group_id}"
        if t.get("backend") in PREFIXED_BACKENDS:
            t["prefix"] = f"{t.get('prefix', 'kvtier')}.g{group_id}"  # a prefix allows [A-Za-z0-9_.-] only
        tiers.append(t)
    out["tiers"] = tiers
    return out
