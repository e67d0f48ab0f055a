"""What SGLang tells kvtier at attach, turned into kvtier's config, namespace and tier paths.

SGLang hands a dynamic storage backend its ``HiCacheStorageConfig`` (model name, TP / PP / CP
ranks and sizes, MLA or not) and the ``--hicache-storage-backend-extra-config`` dict. This
module reads them without importing SGLang:

* :func:`read_settings` takes the extra config's ``kvtier`` entry (an inline store config, or
  the path of a kvtier YAML / TOML file) and validates it as every kvtier config is validated,
  then refuses memory tiers: SGLang's host pool already is the memory tier, so only byte tiers
  (``compressed``, ``lmdb``, ``file``, ``redis``, byte plugins) sit behind it.
* :func:`page_namespace` builds the :class:`~kvtier.keys.Namespace` that SGLang's page hashes
  are folded with: model, KV dtype, page size, TP rank and size, PP rank and size, MLA or MHA,
  context-parallel shards, and the host pool's layout name. MLA pages are identical on every
  TP rank, so an MLA namespace has ``tp_rank`` 0 on every rank: the one rank SGLang lets write
  them stores them once, for all ranks, in a tier they share.
* :func:`shard_dir` names the directory each rank's local persistent tiers live in under the
  configured ``path`` (an LMDB environment has one process at a time, and a record of another
  layout or TP size must never be found there).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier import registry
from kvtier.config import StoreConfig, load_config, read_config_file
from kvtier.errors import ConfigError
from kvtier.keys import Namespace

__all__ = [
    "EXTRA_CONFIG_KEY", "SglangIdentity", "Settings", "engine_ranks", "page_namespace", "place_tiers", "read_settings", "shard_dir",
    "whole_copy_tiers",
]

#: The key of ``--hicache-storage-backend-extra-config`` that holds the kvtier store config.
EXTRA_CONFIG_KEY = "kvtier"
#: Namespace fields SGLang decides; a kvtier config may not set them.
_FROM_SGLANG = ("dtype", "kv_layout", "block_size", "tp_rank", "tp_size", "pp_rank", "pp_size")


@dataclass(frozen=True, slots=True)
class SglangIdentity:
    """The parts of SGLang's ``HiCacheStorageConfig`` that change a page's bytes or its owner."""

    model_name: str | None
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    is_mla: bool
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    dp_rank: int = 0
    split_heads: bool = False

    @classmethod
    def from_storage_config(cls, cfg: Any) -> SglangIdentity:
        def num(name: str, default: int) -> int:
            value = getattr(cfg, name, default)
            return default if value is None else int(value)

        return cls(
            model_name=getattr(cfg, "model_name", None) or None,
            tp_rank=num("tp_rank", 0),
            tp_size=num("tp_size", 1),
            pp_rank=num("pp_rank", 0),
            pp_size=num("pp_size", 1),
            is_mla=bool(getattr(cfg, "is_mla_model", False)),
            attn_cp_rank=num("attn_cp_rank", 0),
            attn_cp_size=num("attn_cp_size", 1),
            dcp_rank=num("dcp_rank", 0),
            dcp_size=num("dcp_size", 1),
            dp_rank=num("dp_rank", 0),
            split_heads=bool(getattr(cfg, "should_split_heads", False)),
        )


@dataclass(frozen=True, slots=True)
class Settings:
    """The validated kvtier side of the extra config."""

    store: StoreConfig
    #: namespace fields the operator adds (``revision``, ``lora_id``, ``tenant_salt``, ...)
    namespace: Mapping[str, Any]
    source: str


def read_settings(extra_config: Mapping[str, Any] | None) -> Settings:
    """The kvtier store config in SGLang's extra config; every problem is a :class:`ConfigError`."""
    where = "hicache-storage-backend-extra-config"
    extra = dict(extra_config or {})
    if not extra.get("interface_v1"):
        raise ConfigError(
            f"{where}: kvtier's SGLang backend moves pages with the zero-copy calls; add \"interface_v1\": 1"
        )
    raw = extra.get(EXTRA_CONFIG_KEY)
    if raw is None:
        raise ConfigError(
            f"{where}.{EXTRA_CONFIG_KEY}: expected a kvtier store config (a mapping with 'tiers', or a YAML/TOML file path)"
        )
    if isinstance(raw, (str, os.PathLike)):
        source = str(raw)
        data, env = read_config_file(raw), True
    elif isinstance(raw, Mapping):
        source, data, env = f"{where}.{EXTRA_CONFIG_KEY}", dict(raw), False
    else:
        raise ConfigError(f"{where}.{EXTRA_CONFIG_KEY}: expected a mapping or a file path, got {type(raw).__name__}")
    overrides = data.pop("namespace", None) or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"{source}: namespace: expected a mapping of namespace fields")
    fixed = sorted(set(overrides) & set(_FROM_SGLANG))
    if fixed:
        raise ConfigError(f"{source}: namespace.{fixed[0]}: set from SGLang's own settings; remove it from the kvtier config")
    store = load_config(data, source=source, env=env)
    for i, tier in enumerate(store.tiers):
        if getattr(registry.backends.get(tier.backend), "is_memory", False):
            raise ConfigError(
                f"{source}: tiers[{i}].backend: {tier.backend!r} is a memory tier; SGLang's host pool is the memory "
                "tier in front of kvtier, so use byte tiers here (compressed, lmdb, file, redis)"
            )
    return Settings(store=store, namespace=dict(overrides), source=source)


def page_namespace(identity: SglangIdentity, *, dtype: str, page_size: int, layout: str,
                   overrides: Mapping[str, Any]) -> Namespace:
    """The namespace SGLang's page hashes are folded with (see the module doc)."""
    model = overrides.get("model_id") or identity.model_name
    if not model:
        raise ConfigError("namespace.model_id: SGLang passed no model name; set namespace.model_id in the kvtier config")
    parts = ["sglang-page-hash", "mla" if identity.is_mla else "mha"]
    if identity.attn_cp_size > 1:  # each context-parallel rank holds its own slice of every page
        parts.append(f"cp{identity.attn_cp_rank}of{identity.attn_cp_size}")
    if identity.dcp_size > 1:
        parts.append(f"dcp{identity.dcp_rank}of{identity.dcp_size}")
    if identity.split_heads:
        parts.append("split-heads")
    extra = overrides.get("config_fingerprint")
    if extra:
        parts.append(str(extra))
    fields: dict[str, Any] = {
        **overrides,
        "model_id": str(model),
        "dtype": dtype,
        "block_size": int(page_size),
        "kv_layout": f"sglang:{layout}",
        "tp_rank": 0 if identity.is_mla else identity.tp_rank,
        "tp_size": identity.tp_size,
        "pp_rank": identity.pp_rank,
        "pp_size": identity.pp_size,
        "config_fingerprint": ";".join(parts),
    }
    return Namespace.from_dict(fields)


def shard_dir(identity: SglangIdentity, layout: str) -> str:
    """The subdirectory of a path tier for this rank: ``<layout>-tp<r>of<n>`` (+ PP, CP, DP)."""
    name = f"{layout}-tp{identity.tp_rank}of{identity.tp_size}"
    if identity.pp_size > 1:
        name += f"-pp{identity.pp_rank}of{identity.pp_size}"
    if identity.attn_cp_size > 1:
        name += f"-cp{identity.attn_cp_rank}of{identity.attn_cp_size}"
    if identity.dp_rank:
        name += f"-dp{identity.dp_rank}"
    return name


def engine_ranks(identity: SglangIdentity) -> int:
    """The ranks one SGLang engine's KV is split over (TP × PP), each with a store of its own."""
    return max(1, identity.tp_size) * max(1, identity.pp_size)


def whole_copy_tiers(identity: SglangIdentity, store: StoreConfig) -> frozenset[int]:
    """The tiers that hold one copy for every rank, so keep their whole capacity: with MLA
    (pages the same on every rank), a tier every rank reaches as one store (Redis)."""
    if not identity.is_mla:
        return frozenset()
    return frozenset(i for i, t in enumerate(store.tiers) if getattr(registry.backends.get(t.backend), "shared", False))


def place_tiers(store: StoreConfig, subdir: str, *, ranks: int = 1, whole: frozenset[int] = frozenset()) -> StoreConfig:
    """``store`` as one rank's: every tier's ``path`` moved one directory down, into ``subdir``,
    and its ``capacity`` divided by ``ranks`` (but for the tiers in ``whole``). A tier's capacity
    in the config is the engine's, over all its ranks, as in the vLLM integration: a TP=8 engine
    with ``capacity: 512GiB`` reserves 512 GiB in all, 64 GiB per rank."""
    data = store.to_dict()
    for i, tier in enumerate(data["tiers"]):
        if tier.get("path"):
            tier["path"] = os.path.join(os.fspath(tier["path"]), subdir)
        if ranks > 1 and i not in whole:
            tier["capacity"] = max(1, int(tier["capacity"]) // ranks)
    return load_config(data)
