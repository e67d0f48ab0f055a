"""One kvtier engine under vLLM: each worker rank's tiers and job outcomes, the scheduler side's
manager, and the helpers that turn vLLM's offloading config into kvtier's (per-rank store
config, namespace, page views). The two sides share nothing in memory: they may live in
different processes (vLLM's default layout), and talk only through vLLM's connector channels."""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from kvtier.config import load_config_file
from kvtier.config.tenants import tier_names
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.group_config import PREFIXED_BACKENDS
from kvtier.integrations.vllm.head_layout import TOGETHER_SUFFIX
from kvtier.keys import Namespace
from kvtier.manager import TierManager
from kvtier.store import KVStore
from kvtier.transfer import JobResult
from kvtier.units import parse_size

log = logging.getLogger("kvtier.vllm")

#: where vLLM's factories find the classes: this package, whose ``__getattr__`` imports them.
MODULE_PATH = __name__.rpartition(".")[0]


def _counters() -> dict[str, int]:
    return dict.fromkeys(
        (
            "lookup_hits",
            "lookup_misses",
            "blocks_loaded",
            "blocks_load_failed",
            "mid_chunk_loads",
            "null_chunks_not_stored",
            "blocks_stored",
            "blocks_store_failed",
            "store_rejected",
            "blocks_adopted",
            "blocks_announced",
            "keys_deleted",
            "submit_failed",
            "complete_load_unmatched",
            "results_missing",
            "results_expired",
            "jobs_abandoned",
            "blocks_flushed_at_close",
            "blocks_flush_failed_at_close",
        ),
        0,
    )


@dataclass(eq=False)
class RankEngine:
    """One worker rank's side: its own tiers (``store``, for its shard of every block) and the
    outcomes of its jobs, which travel to the scheduler in the connector's worker metadata."""

    engine_id: str
    store: KVStore
    rank: int = 0
    #: the vLLM KV-cache group whose blocks this store holds (see :mod:`.groups`)
    group: int = 0
    #: tiers this rank leaves to the writer rank (shared by every rank, see .replicated)
    skip_tiers: frozenset[int] = frozenset()
    #: (kind, plan or load id, JobResult) of jobs finished since the last metadata was built.
    outbox: deque[tuple[str, int, JobResult]] = field(default_factory=deque)
    reports_load_errors: bool = False
    counters: dict[str, int] = field(default_factory=_counters)


@dataclass(eq=False)
class SchedulerEngine:
    """The scheduler side of one engine: the manager (built once every rank has said which
    tiers it opened and which records they hold), the key namespace, and counters."""

    engine_id: str
    world_size: int
    #: the vLLM KV-cache group this manager decides for (see :mod:`.groups`)
    group: int = 0
    manager: TierManager | None = None
    namespace: Namespace | None = None
    #: per tier: whether it is a memory tier (vLLM's ``Medium`` of its events)
    memory_tiers: tuple[bool, ...] = ()
    counters: dict[str, int] = field(default_factory=_counters)


#: engines live in this process, by (engine id, side): read through :func:`live_engines`.
_ENGINES: dict[tuple[str, str], RankEngine | SchedulerEngine] = {}
_ENGINES_LOCK = threading.Lock()


def register_engine(engine: RankEngine | SchedulerEngine) -> None:
    side = "scheduler" if isinstance(engine, SchedulerEngine) else f"rank{engine.rank}"
    if engine.group:
        side += f"-group{engine.group}"
    with _ENGINES_LOCK:
        _ENGINES[(engine.engine_id, side)] = engine


def unregister_engine(engine: RankEngine | SchedulerEngine) -> None:
    with _ENGINES_LOCK:
        for key, value in list(_ENGINES.items()):
            if value is engine:
                del _ENGINES[key]


def live_engines() -> list[RankEngine | SchedulerEngine]:
    """The kvtier engines live in this process (worker ranks and scheduler sides), for tools
    that run inside vLLM's processes (``LLM.collective_rpc``)."""
    with _ENGINES_LOCK:
        return list(_ENGINES.values())


def engine_stats(engine_id: str | None = None, worker: Any = None) -> dict[str, Any]:
    """Counters of the kvtier engines live in this process (one engine: its dict; else keyed
    by engine id): the sums of its scheduler side's and its worker ranks' counters, the tier
    manager's counters and tiers (scheduler side) and the transfer engines' counters (summed
    over the ranks in this process), and ``ranks``: the worker ranks counted here.

    With vLLM's default process layout the scheduler side lives in the engine-core process and
    each rank in its own worker process; ``LLM.collective_rpc(engine_stats)`` gathers the
    workers' (``worker`` is the vLLM worker that ``collective_rpc`` passes; unused)."""
    with _ENGINES_LOCK:
        engines = dict(_ENGINES)
    out: dict[str, Any] = {}
    for (eid, _side), eng in sorted(engines.items(), key=lambda kv: kv[0]):
        if engine_id is not None and eid != engine_id:
            continue
        data = out.setdefault(eid, {"ranks": []})
        for name, value in eng.counters.items():
            data[name] = data.get(name, 0) + value
        if isinstance(eng, SchedulerEngine):
            mgr = eng.manager
            if mgr is not None:  # several KV-cache groups: counters summed, tiers listed per group
                counters = data.setdefault("manager", {})
                for name, value in mgr.counters.items():
                    counters[name] = counters.get(name, 0) + value
                data.setdefault("tiers", []).extend(
                    {"group": eng.group, **{k: t[k] for k in ("name", "blocks", "ready", "pinned", "used_bytes")}}
                    for t in mgr.stats()["tiers"]
                )
            continue
        if eng.rank not in data["ranks"]:
            data["ranks"].append(eng.rank)
        data["corrupt_records"] = data.get("corrupt_records", 0) + sum(
            b.counters.corrupt_records for b in eng.store.backends
        )
        if eng.store.transfers is not None:
            transfers = data.setdefault("transfers", {})
            for name, value in eng.store.transfers.counters.items():
                transfers[name] = transfers.get(name, 0) + value
    if engine_id is not None or len(out) != 1:
        return out.get(engine_id, {}) if engine_id is not None else out
    return next(iter(out.values()))


def rank_tiers(
    cfg: Mapping[str, Any],
    rank: int,
    world_size: int,
    *,
    shared: frozenset[int] = frozenset(),
    together: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The store config of worker ``rank`` of ``world_size``: each tier's ``capacity`` divided
    by ``world_size`` (the config's capacity is the engine's, over all its ranks, so a tier holds
    as many blocks whatever the TP size), a tier's ``path`` made ``<path>/r<rank>-of-<world>``
    and a shared tier's ``prefix`` (``redis``, ``s3``, ``mooncake``) made ``<prefix>.r<rank>-of-<world>`` (each rank keeps its own
    records; a process with another world size finds none of them: a miss, never an error).

    The tiers in ``shared`` hold one copy for every rank (KV that is the same on every rank,
    see :mod:`.replicated`): their whole capacity, under ``all-of-<world>``.

    The tiers in ``together`` hold head-group records that every rank of every engine, of any
    TP size, reads and writes in one place (see :mod:`.head_layout`): ``<path>/head-groups``,
    ``<prefix>.hg``; each rank still counts ``capacity / world_size`` for the records it writes.

    ``metrics.port`` is the base of the ranks' ports: rank ``r`` serves its ``/metrics`` on
    ``port + r`` (ranks on one host cannot share a port; 0, any free port, stays 0)."""
    out = dict(cfg)
    metrics = cfg.get("metrics")
    if isinstance(metrics, Mapping) and isinstance(metrics.get("port"), int) and not isinstance(metrics["port"], bool) and metrics["port"] > 0:
        out["metrics"] = {**metrics, "port": metrics["port"] + rank}
    tiers = []
    for i, tier in enumerate(cfg.get("tiers") or ()):
        if not isinstance(tier, Mapping):
            raise ConfigError(f"kv_connector_extra_config.kvtier.tiers[{i}]: expected a mapping, got {type(tier).__name__}")
        t = dict(tier)
        one_copy = i in shared
        suffix = f"all-of-{world_size}" if one_copy else f"r{rank}-of-{world_size}"
        if i in together and not one_copy:
            suffix = TOGETHER_SUFFIX
        if "capacity" in t and not one_copy:
            t["capacity"] = max(1, parse_size(t["capacity"], field=f"tiers[{i}].capacity") // world_size)
        if t.get("path") is not None:
            t["path"] = os.path.join(str(t["path"]), suffix)
        if t.get("backend") in PREFIXED_BACKENDS:
            short = "hg" if suffix == TOGETHER_SUFFIX else suffix
            t["prefix"] = f"{t.get('prefix', 'kvtier')}.{short}"  # the prefix allows [A-Za-z0-9_.-] only
        tiers.append(t)
    out["tiers"] = tiers
    _tenants_per_rank(out, world_size, shared)
    return out


def _tenants_per_rank(out: dict[str, Any], world_size: int, shared: frozenset[int]) -> None:
    """Quotas and pin budgets are the engine's, like capacities: each rank's is its share."""
    names = tier_names([SimpleNamespace(name=t.get("name"), backend=t.get("backend")) for t in out["tiers"]])
    divided = {name for i, name in enumerate(names) if i not in shared}

    def share(sizes: Any, where: str) -> Any:
        if not isinstance(sizes, Mapping):
            return sizes  # the config check names it
        return {
            tier: max(0, parse_size(size, field=f"{where}.{tier}") // world_size) if tier in divided else size
            for tier, size in sizes.items()
        }

    tenants = out.get("tenants")
    if isinstance(tenants, Mapping):
        out["tenants"] = {u: share(caps, f"tenants.{u}") for u, caps in tenants.items()}
    tenancy = out.get("tenancy")
    if isinstance(tenancy, Mapping) and "pin_budget" in tenancy:
        out["tenancy"] = {**tenancy, "pin_budget": share(tenancy["pin_budget"], "tenancy.pin_budget")}


#: Namespace fields vLLM decides for every rank; a kvtier config that sets one is refused.
FROM_VLLM = ("model_id", "dtype", "block_size", "kv_layout", "tp_rank", "tp_size", "pp_rank", "pp_size")


def store_config(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    raw = extra_config.get("kvtier")
    if raw is None:
        raise ConfigError(
            "kv_connector_extra_config.kvtier: expected a kvtier store config (a dict with 'tiers', or a config file path)"
        )
    if isinstance(raw, str):
        source, out = raw, load_config_file(raw).to_dict()
    elif isinstance(raw, Mapping):
        source, out = "kv_connector_extra_config.kvtier", dict(raw)
    else:
        raise ConfigError(f"kv_connector_extra_config.kvtier: expected a mapping or a path, got {type(raw).__name__}")
    overrides = out.get("namespace") or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"{source}: namespace: expected a mapping of namespace fields")
    fixed = [name for name in FROM_VLLM if name in overrides]
    if fixed:
        # Each rank's own values come from vLLM: a config's tp_rank would make every rank the same one.
        raise ConfigError(
            f"{source}: namespace.{fixed[0]}: set by vLLM for each rank (its model, dtype, block size, layout, "
            f"TP and PP rank and size); remove it from the kvtier config (operators set revision, lora_id, "
            f"kv_quant, config_fingerprint, tenant_salt, hash)"
        )
    return out


def check_supported(config: Any) -> None:
    """Raise ConfigError for the setups this version does not handle (see the module doc)."""
    parallel = config.parallel
    if parallel.pp_size != 1:
        raise ConfigError(
            f"kvtier's vLLM integration does not support pipeline parallel (pp_size {parallel.pp_size}): the stages "
            "hold different layers, so a block's bytes differ per rank, and this layout is untested under vLLM"
        )
    if parallel.pcp_size != 1 or parallel.dcp_size != 1:
        raise ConfigError(
            f"kvtier's vLLM integration does not support context parallel (pcp_size {parallel.pcp_size}, "
            f"dcp_size {parallel.dcp_size}): a block's tokens are then spread over ranks"
        )


def vllm_namespace(
    config: Any, tokens_per_block: int, layout_fingerprint: str, overrides: Mapping[str, Any], *, rank: int = 0
) -> Namespace:
    """The namespace of kvtier keys (``rank`` 0, the scheduler side's) or of worker ``rank``'s
    records (what its persistent tiers check at open)."""
    fields: dict[str, Any] = {
        "model_id": str(config.model.name),
        "dtype": str(config.model.dtype),
        "block_size": int(tokens_per_block),
        "kv_layout": f"vllm:{config.kv_cache_layout};{layout_fingerprint}",
        "tp_rank": int(rank),
        "tp_size": int(config.parallel.tp_size),
        "pp_size": int(config.parallel.pp_size),
        "config_fingerprint": "vllm-offload-key",
    }
    for name, value in overrides.items():
        if name == "config_fingerprint":
            fields[name] = f"{fields[name]};{value}"
        else:
            fields[name] = value
    return Namespace.from_dict(fields)


def page_views(kv_caches: Any, dtype: str) -> list[torch.Tensor]:
    """vLLM's ``(num_blocks, page)`` int8 pages, viewed as the KV dtype when it divides them."""
    try:
        kv_dtype = getattr(torch, dtype)
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
    except (AttributeError, TypeError):
        kv_dtype, itemsize = torch.uint8, 1
    views: list[torch.Tensor] = []
    for i, ref in enumerate(kv_caches.tensors):
        t = ref.tensor
        if t.dim() != 2 or not t.is_contiguous():
            raise ConfigError(
                f"vLLM KV tensor {i}: expected contiguous (num_blocks, page) pages, got shape {tuple(t.shape)} "
                f"strides {t.stride()}; this KV layout is not supported"
            )
        if kv_dtype is not torch.uint8 and t.shape[1] % itemsize == 0:
            views.append(t.view(kv_dtype))
        else:
            views.append(t.view(torch.uint8))
    return views

