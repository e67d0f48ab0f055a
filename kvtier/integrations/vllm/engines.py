"""One kvtier engine under vLLM: the store its worker side builds and its scheduler side uses, and the
helpers that turn vLLM's offloading config into kvtier's (store config, namespace, page views)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.config import load_config_file
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.store import KVStore
from kvtier.transfer import JobResult

log = logging.getLogger("kvtier.vllm")

#: where vLLM's factories find the classes: this package, whose ``__getattr__`` builds them.
MODULE_PATH = __name__.rpartition(".")[0]


@dataclass(eq=False)
class _Engine:
    """What the worker side builds and the scheduler side of the same engine uses."""

    engine_id: str
    store: KVStore
    #: (plan key, JobResult) pairs the worker has seen finish; drained by the manager's thread.
    results: deque[tuple[tuple[str, int], JobResult]] = field(default_factory=deque)
    reports_load_errors: bool = False
    #: load ids the worker has submitted (a load never submitted can be completed at any time).
    submitted_loads: set[int] = field(default_factory=set)
    counters: dict[str, int] = field(
        default_factory=lambda: {
            "lookup_hits": 0,
            "lookup_misses": 0,
            "blocks_loaded": 0,
            "blocks_load_failed": 0,
            "blocks_stored": 0,
            "blocks_store_failed": 0,
            "store_rejected": 0,
            "blocks_adopted": 0,
            "submit_failed": 0,
            "complete_load_unmatched": 0,
        }
    )


_ENGINES: dict[str, _Engine] = {}
_ENGINES_LOCK = threading.Lock()


def engine_stats(engine_id: str | None = None) -> dict[str, Any]:
    """Counters of the kvtier engines live in this process (one engine: its dict; else keyed
    by engine id). Includes the tier manager's and the transfer engine's counters."""
    with _ENGINES_LOCK:
        engines = dict(_ENGINES)
    out: dict[str, Any] = {}
    for eid, eng in engines.items():
        if engine_id is not None and eid != engine_id:
            continue
        data: dict[str, Any] = dict(eng.counters)
        mgr = eng.store.manager
        if mgr is not None:
            data["manager"] = dict(mgr.counters)
            data["tiers"] = [
                {
                    **{k: t[k] for k in ("name", "blocks", "ready", "pinned", "used_bytes")},
                    "corrupt_records": backend.counters.corrupt_records,
                }
                for t, backend in zip(mgr.stats()["tiers"], eng.store.backends)
            ]
        if eng.store.transfers is not None:
            data["transfers"] = dict(eng.store.transfers.counters)
        out[eid] = data
    if engine_id is not None or len(out) != 1:
        return out.get(engine_id, {}) if engine_id is not None else out
    return next(iter(out.values()))


def _store_config(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    raw = extra_config.get("kvtier")
    if raw is None:
        raise ConfigError(
            "kv_connector_extra_config.kvtier: expected a kvtier store config (a dict with 'tiers', or a config file path)"
        )
    if isinstance(raw, str):
        return load_config_file(raw).to_dict()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"kv_connector_extra_config.kvtier: expected a mapping or a path, got {type(raw).__name__}")
    return dict(raw)


def _check_supported(config: Any, blocks_per_chunk: int) -> None:
    """Raise ConfigError for the setups this version does not handle (see the module doc)."""
    if config.parallel.world_size != 1:
        raise ConfigError(
            f"kvtier's vLLM integration supports one worker (world_size 1); got world_size {config.parallel.world_size}"
        )
    if len(config.groups) != 1:
        raise ConfigError(f"kvtier's vLLM integration supports one offloaded KV-cache group; got {len(config.groups)}")
    if blocks_per_chunk != 1:
        raise ConfigError(
            f"kvtier's vLLM integration needs blocks_per_chunk 1 (one kvtier block per vLLM block); got {blocks_per_chunk}"
        )


def _namespace(config: Any, tokens_per_block: int, layout_fingerprint: str, overrides: Mapping[str, Any]) -> Namespace:
    fields: dict[str, Any] = {
        "model_id": str(config.model.name),
        "dtype": str(config.model.dtype),
        "block_size": int(tokens_per_block),
        "kv_layout": f"vllm:{config.kv_cache_layout};{layout_fingerprint}",
        "tp_rank": 0,
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


def _page_views(kv_caches: Any, dtype: str) -> list[torch.Tensor]:
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


# -- the bookkeeping of both sides, without vLLM (the vLLM classes below delegate to it) -----
