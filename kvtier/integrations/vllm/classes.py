"""The vLLM classes (spec, manager, worker, connector), built on first access because they subclass vLLM's."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integrations._sync import run_sync
from kvtier.integrations.vllm.announce import OffloadKeyLog, adopted_announcements, offload_key_log_path
from kvtier.integrations.vllm.deadlines import ResultDeadlines
from kvtier.integrations.vllm.engines import (
    MODULE_PATH,
    _check_supported,
    _Engine,
    _namespace,
    _page_views,
    _register,
    _SchedulerEngine,
    _store_config,
    _unregister,
    rank_tiers,
)
from kvtier.integrations.vllm.ranks import RankTiers, build_manager, describe_rank
from kvtier.integrations.vllm.replicated import WRITER_RANK, namespace_rank, shared_tiers
from kvtier.integrations.vllm.scheduler_side import DEFAULT_RESULT_DEADLINE_S, _SchedulerSide
from kvtier.integrations.vllm.stats import METRICS, PREFIX, CounterDeltas, scheduler_counters, worker_counters
from kvtier.integrations.vllm.worker_side import _WorkerSide
from kvtier.keys import fold_block_hashes
from kvtier.manager import LoadPlan, StorePlan
from kvtier.store import KVStore
from kvtier.transfer import JobResult

log = logging.getLogger("kvtier.vllm")
_T = TypeVar("_T")


#: set by KvtierConnector in the extra config: the spec may rely on its channels
_CHANNELS_KEY = "kvtier_connector_channels"
#: set by KvtierConnector in the extra config: the KV is the same on every rank (MLA)
_REPLICATED_KEY = "kvtier_replicated_kv"


def _replicated_kv(vllm_config: Any, kv_cache_config: Any) -> bool:
    """Whether every rank holds the same KV bytes: an MLA model (vLLM's ``use_mla``) whose
    KV-cache groups are all plain ``MLAAttentionSpec`` (not, say, MLA with a sharded indexer)."""
    if not getattr(getattr(vllm_config, "model_config", None), "use_mla", False):
        return False
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return all(type(g.kv_cache_spec) is MLAAttentionSpec for g in groups)


def _public(cls: type) -> type:
    """Name a class built here as an attribute of the package, so that pickle (vLLM's
    transport between processes) finds it there; the package's ``__getattr__`` builds it."""
    cls.__module__ = MODULE_PATH
    cls.__qualname__ = cls.__name__
    return cls


def _result_deadline(value: Any) -> float | None:
    """``kv_connector_extra_config.result_deadline_s``: seconds the scheduler side waits for
    every rank's result of a job before the silent ranks are told to settle it as failed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(
            f"kv_connector_extra_config.result_deadline_s: expected a positive number of seconds, got {value!r}"
        )
    return float(value)


def _select_spec(vllm_config: Any) -> Any:
    """The extra config with kvtier's offloading spec chosen (unless one was named)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.setdefault("spec_name", "KvtierOffloadingSpec")
    extra.setdefault("spec_module_path", MODULE_PATH)
    return extra


def build_classes() -> dict[str, type]:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.base import (
        GPULoadStoreSpec,
        LoadStoreSpec,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        RequestOffloadingContext,
        TransferResult,
    )

    @_public
    class KvtierStoreSpec(LoadStoreSpec):
        """Where a store goes: a kvtier store plan (drops, demotions, new keys)."""

        def __init__(self, plan: StorePlan) -> None:
            self.plan = plan

        def __repr__(self) -> str:
            return f"KvtierStoreSpec(plan={self.plan.plan_id}, keys={len(self.plan.keys)})"

    @_public
    class KvtierLoadSpec(LoadStoreSpec):
        """Where a load comes from: a kvtier load plan (the tier of each key)."""

        def __init__(self, load_id: int, plan: LoadPlan) -> None:
            self.load_id = load_id
            self.plan = plan

        def __repr__(self) -> str:
            return f"KvtierLoadSpec(load={self.load_id}, keys={len(self.plan.keys)})"

    @_public
    @dataclass
    class KvtierWorkerMetadata(OffloadingWorkerMetadata):
        """vLLM's worker metadata plus each rank's kvtier results: (rank, kind, id, JobResult)."""

        kvtier_results: list[tuple[int, str, int, JobResult]] = field(default_factory=list)

        def aggregate(self, other: Any) -> Any:
            merged = super().aggregate(other)
            return KvtierWorkerMetadata(
                completed_jobs=merged.completed_jobs,
                transfer_stats=merged.transfer_stats,
                kvtier_results=[*self.kvtier_results, *getattr(other, "kvtier_results", ())],
            )

    class KvtierOffloadingManager(OffloadingManager):
        """vLLM's OffloadingManager over kvtier's :class:`TierManager`, in the scheduler's process.

        The manager is built when every worker rank has described its tiers
        (:meth:`adopt_ranks`, before vLLM's first step); until then every lookup misses and
        nothing is stored."""

        def __init__(
            self,
            engine: _SchedulerEngine,
            spec: Any,
            store_cfg: Any,
            overrides: Mapping[str, Any],
            key_log: OffloadKeyLog,
            result_deadline_s: float,
        ) -> None:
            self._engine = engine
            self._result_deadline_s = result_deadline_s
            self._key_log = key_log
            self._announce: list[Any] = []  # events of adopted blocks, before the manager's own
            self._spec = spec
            self._store_cfg = store_cfg
            self._overrides = dict(overrides)
            self._side: _SchedulerSide | None = None
            self._ns: Any = None
            self._key_cache: OrderedDict[bytes, bytes] = OrderedDict()  # offload key -> kvtier key
            self._offload_key: OrderedDict[bytes, bytes] = OrderedDict()  # kvtier key -> offload key
            self._cap = 1024
            self._media: list[Any] = []
            self._tier_index: dict[str, int] = {}

        def adopt_ranks(self, ranks: Mapping[int, RankTiers]) -> None:
            """Build the manager from what every rank opened (see :mod:`.ranks`)."""
            manager, orphans, adopted_keys = build_manager(ranks, self._store_cfg)
            adopted = sum(len(keys) for keys in adopted_keys.values())
            rank0 = ranks[0]
            self._ns = _namespace(self._spec.config, self._spec.tokens_per_block[0], rank0.layout, self._overrides)
            side = _SchedulerSide(self._engine, manager, ResultDeadlines(self._engine.world_size, self._result_deadline_s))
            for tier, keys in orphans.items():
                side.ledger.remember(tier, keys)
            engine = self._engine
            engine.manager, engine.namespace = manager, self._ns
            engine.memory_tiers = tuple(t.memory for t in rank0.tiers)
            engine.counters["blocks_adopted"] = adopted
            self._media = [Medium.CPU if memory else Medium.STORAGE for memory in engine.memory_tiers]
            self._tier_index = {manager.tier_spec(i).name: i for i in range(manager.num_tiers)}
            self._cap = max(
                1024,
                4
                * sum(
                    manager.tier_spec(i).capacity_bytes // manager.tier_spec(i).block_reserve
                    for i in range(manager.num_tiers)
                ),
            )
            self._key_cache.clear()
            self._side = side
            # Tell routers which blocks this process already holds (vLLM named them in an
            # earlier process; the log next to the persistent tier remembers their hashes).
            events, keep = adopted_announcements(adopted_keys, self._key_log.load())
            self._announce = [OffloadingEvent(keys=[v], medium=self._media[t], removed=False) for t, v in events]
            self._remember(keep.keys(), keep.values())
            self._key_log.rewrite(keep)
            engine.counters["blocks_announced"] = len(keep)
            log.info(
                "kvtier: scheduler side of engine %s over %d ranks: %d blocks adopted, %d orphan records to delete",
                engine.engine_id,
                len(ranks),
                adopted,
                sum(len(k) for k in orphans.values()),
            )

        def worker_output(
            self, results: Collection[tuple[int, str, int, JobResult]], counts: Mapping[int, int]
        ) -> dict[int, int]:
            """The ranks' results and vLLM's completion counts of one step: the counts vLLM may
            apply (:meth:`_SchedulerSide.worker_output`)."""
            return self._side.worker_output(results, counts) if self._side is not None else dict(counts)

        def issued(self, meta: Any) -> None:
            """Start the result deadline of every job in this step's connector metadata, and
            add the notices of jobs given up on (``kvtier_abandoned``) to it."""
            side = self._side
            if side is None:
                meta.kvtier_abandoned = ()
                return
            for job_id, job in meta.store_jobs.items():
                if isinstance(job.dst_spec, KvtierStoreSpec):
                    side.deadlines.issued(job_id, "store", job.dst_spec.plan.plan_id)
            for job_id, job in meta.load_jobs.items():
                if isinstance(job.src_spec, KvtierLoadSpec):
                    side.deadlines.issued(job_id, "load", job.src_spec.load_id, tuple(job.dst_spec.block_ids))
            meta.kvtier_abandoned = side.take_notices()

        def take_deletes(self) -> Any:
            return self._side.take_deletes() if self._side is not None else ()

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
            mgr = self._engine.manager
            if mgr is not None and mgr.lookup([self._k(key)]) == 1:
                self._engine.counters["lookup_hits"] += 1
                return LookupResult.HIT
            self._engine.counters["lookup_misses"] += 1
            return LookupResult.MISS

        def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
            assert self._side is not None  # vLLM loads only what a lookup found
            keys = list(keys)
            kkeys = [self._k(k) for k in keys]
            load_id, plan = self._side.prepare_load(kkeys)
            self._remember(kkeys, keys)
            return KvtierLoadSpec(load_id, plan)

        def touch(self, keys: Collection[Any], req_context: Any) -> None:
            if self._engine.manager is not None:
                self._engine.manager.touch([self._k(k) for k in keys])

        def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
            if self._side is not None:
                self._side.complete_load([self._k(k) for k in keys])

        def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
            if self._side is None:
                return None
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
            if self._side is None:
                return
            stored = self._side.complete_store([self._k(k) for k in keys], success)
            pairs = [(k, self._offload_key[k]) for k in stored if k in self._offload_key]
            if pairs:
                self._key_log.append(pairs)

        def on_new_request(self, req_context: Any) -> Any:
            return RequestOffloadingContext()

        def take_events(self) -> Any:
            mgr = self._engine.manager
            if mgr is None:
                return
            announce, self._announce = self._announce, []
            yield from announce
            for event in mgr.take_events():
                vkey = self._offload_key.get(event.key)
                if vkey is None:
                    continue  # adopted, and not in the offload key log: vLLM's hash is unknown
                if event.kind == "removed" and mgr.status(event.key).tier is None:
                    self._offload_key.pop(event.key, None)
                medium = self._media[self._tier_index.get(event.tier, 0)]
                yield OffloadingEvent(keys=[vkey], medium=medium, removed=event.kind == "removed")

        def shutdown(self) -> None:
            _unregister(self._engine)

    class KvtierOffloadingWorker(OffloadingWorker):
        """Executes kvtier plans between this rank's paged KV cache and its own tiers."""

        def __init__(self, engine: _Engine, description: RankTiers) -> None:
            self._engine = engine
            self._side = _WorkerSide(engine)
            #: what this rank opened; vLLM hands it to the scheduler side (handshake metadata)
            self.description = description

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
            indices = getattr(dst_spec, "block_indices", None) or (0,)
            self._side.submit_load(job_id, src_spec.load_id, src_spec.plan, dst_spec.block_ids, int(indices[0]))
            return True

        def get_finished(self) -> list[Any]:
            return [
                TransferResult(job_id, success, transfer_size=nbytes, transfer_time=seconds)
                for job_id, success, nbytes, seconds in self._side.finished()
            ]

        def take_results(self) -> list[tuple[int, str, int, JobResult]]:
            rank = self._engine.rank
            return [(rank, kind, plan_id, result) for kind, plan_id, result in self._side.take_outbox()]

        def submit_deletes(self, deletes: Any) -> None:
            self._side.submit_deletes(deletes)

        def abandon(self, notices: Any) -> None:
            self._side.abandon(notices)

        def take_failed_block_ids(self) -> set[int]:
            return self._side.take_failed_block_ids()

        def wait(self, job_ids: set[int]) -> None:
            self._side.wait(job_ids)

        def shutdown(self) -> None:
            _unregister(self._engine)
            run_sync(self._side.close())  # writes back what only this rank's memory tiers hold

    class KvtierOffloadingSpec(OffloadingSpec):
        """The offloading spec vLLM's OffloadingConnector loads: kvtier's manager and worker."""

        @classmethod
        def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
            """kvtier's counters (:mod:`.stats`), registered by vLLM's Prometheus logger."""
            return {PREFIX + name: OffloadingCounterMetadata(documentation=doc) for name, doc in METRICS.items()}

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            _check_supported(config)
            if not self.extra_config.get(_CHANNELS_KEY):
                raise ConfigError(
                    "kvtier needs its own connector: set kv_connector 'KvtierConnector' with kv_connector_module_path "
                    f"{MODULE_PATH!r} (kv_transfer_config() does); vLLM's stock OffloadingConnector has no channel for "
                    "each worker's job results, which kvtier's scheduler side needs"
                )
            cfg_dict = dict(_store_config(self.extra_config))
            self._overrides = dict(cfg_dict.pop("namespace", None) or {})
            cfg_dict["engine_blocks_per_block"] = self.blocks_per_chunk  # one record per offloaded chunk
            cfg_dict.pop("block_bytes", None)
            self._store_dict = cfg_dict
            self._result_deadline_s = _result_deadline(self.extra_config.get("result_deadline_s"))
            #: KV the same on every rank: the tiers all ranks share hold one copy (.replicated)
            self._replicated = bool(self.extra_config.get(_REPLICATED_KEY)) and config.parallel.world_size > 1
            self._shared = shared_tiers(cfg_dict) if self._replicated else frozenset()

        def get_manager(self) -> Any:
            parallel = self.config.parallel
            # One block's size is only known on the workers; 1 passes the config's checks here.
            store_cfg = load_config(
                rank_tiers(self._store_dict, 0, parallel.world_size, shared=self._shared),
                source="kv_connector_extra_config.kvtier",
                block_bytes=1,
            )
            engine = _SchedulerEngine(self.config.engine_id, parallel.world_size)
            _register(engine)
            key_log = OffloadKeyLog(offload_key_log_path(self._store_dict, parallel.world_size))
            deadline = self._result_deadline_s
            if deadline is None:  # past the ranks' own job deadline, so a live rank reports first
                job_deadline = store_cfg.job_deadline_s
                deadline = DEFAULT_RESULT_DEADLINE_S if job_deadline is None else job_deadline + 60.0
            return KvtierOffloadingManager(engine, self, store_cfg, self._overrides, key_log, deadline)

        def get_worker(self, kv_caches: Any) -> Any:
            if len(kv_caches.group_data_refs) != 1:
                raise ConfigError(
                    f"kvtier's vLLM integration supports one offloaded KV-cache group; got {len(kv_caches.group_data_refs)}"
                )
            parallel = self.config.parallel
            rank, world = int(parallel.rank), int(parallel.world_size)
            views = _page_views(kv_caches, str(self.config.model.dtype))
            from kvtier.transfer.layout import KVLayout

            layout = KVLayout(views, engine_blocks_per_block=self.blocks_per_chunk)
            fingerprint = layout.fingerprint()
            # Replicated KV: every rank's bytes are rank 0's, and so is the namespace of its records.
            ns_rank = namespace_rank(rank, self._replicated)
            namespace = _namespace(self.config, self.tokens_per_block[0], fingerprint, self._overrides, rank=ns_rank)
            cfg = load_config(
                rank_tiers(self._store_dict, rank, world, shared=self._shared),
                source="kv_connector_extra_config.kvtier",
                block_bytes=layout.block_bytes,
            )
            store = run_sync(KVStore(cfg, kv_caches=views, namespace=namespace).start())
            skip = self._shared if rank != WRITER_RANK else frozenset()
            engine = _Engine(self.config.engine_id, store, rank=rank, skip_tiers=skip)
            description = describe_rank(self.config.engine_id, rank, world, store, fingerprint)
            _register(engine)
            log.info(
                "kvtier: rank %d of %d: %d tiers under vLLM engine %s, %d-byte blocks, %d records found",
                rank,
                world,
                len(store.backends),
                self.config.engine_id,
                layout.block_bytes,
                sum(len(t.records) for t in description.tiers),
            )
            return KvtierOffloadingWorker(engine, description)

    class KvtierConnector(OffloadingConnector):
        """vLLM's OffloadingConnector with kvtier's spec. Over vLLM's own channels it carries
        what kvtier's two sides tell each other: each rank's tiers (handshake metadata, at
        start), each rank's job results (worker metadata) and the deletes the workers owe
        (connector metadata); and it reports blocks whose load failed to vLLM."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            extra = _select_spec(vllm_config)
            extra[_CHANNELS_KEY] = True
            extra[_REPLICATED_KEY] = _replicated_kv(vllm_config, kv_cache_config)
            self._kvtier_deltas = CounterDeltas()
            super().__init__(vllm_config, role, kv_cache_config)

        @classmethod
        def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
            # In the front-end process too vLLM looks the spec up in the extra config, for
            # the metric definitions of kvtier's counters.
            _select_spec(vllm_config)
            return super().build_prom_metrics(vllm_config, *args, **kwargs)

        def get_kv_connector_stats(self) -> Any:
            """vLLM's offload stats plus the growth of kvtier's counters since the last call
            (each worker rank its own, the scheduler side its own; vLLM adds them up)."""
            stats = super().get_kv_connector_stats()
            worker, manager = self._kvtier_worker(), self._kvtier_manager()
            if worker is not None:
                grown = self._kvtier_deltas.take(worker_counters(worker._engine))
            elif manager is not None:
                grown = self._kvtier_deltas.take(scheduler_counters(manager._engine))
            else:
                grown = {}
            if not grown:
                return stats
            if stats is None:
                stats = OffloadingConnectorStats()
            for name, value in grown.items():
                stats.increase_counter(PREFIX + name, value)
            return stats

        def _kvtier_worker(self) -> Any:
            cw = self.connector_worker
            worker = getattr(cw, "worker", None) if cw is not None else None
            return worker if isinstance(worker, KvtierOffloadingWorker) else None

        def _kvtier_manager(self) -> Any:
            cs = self.connector_scheduler
            manager = getattr(cs, "manager", None) if cs is not None else None
            return manager if isinstance(manager, KvtierOffloadingManager) else None

        # -- worker side ------------------------------------------------------------------
        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            super().register_kv_caches(kv_caches)
            worker = self._kvtier_worker()
            if worker is not None:
                worker._engine.reports_load_errors = True

        def get_handshake_metadata(self) -> Any:
            worker = self._kvtier_worker()
            return worker.description if worker is not None else None

        def handle_preemptions(self, kv_connector_metadata: Any) -> None:
            worker = self._kvtier_worker()
            if worker is not None:
                worker.abandon(getattr(kv_connector_metadata, "kvtier_abandoned", ()))
                # Before the stores of earlier steps are submitted (module doc of .scheduler_side).
                worker.submit_deletes(getattr(kv_connector_metadata, "kvtier_deletes", ()))
            super().handle_preemptions(kv_connector_metadata)

        def build_connector_worker_meta(self) -> Any:
            meta = super().build_connector_worker_meta()
            worker = self._kvtier_worker()
            results = worker.take_results() if worker is not None else []
            if not results:
                return meta
            base = meta if meta is not None else OffloadingWorkerMetadata()
            return KvtierWorkerMetadata(
                completed_jobs=base.completed_jobs, transfer_stats=base.transfer_stats, kvtier_results=results
            )

        def get_block_ids_with_load_errors(self) -> set[int]:
            worker = self._kvtier_worker()
            return worker.take_failed_block_ids() if worker is not None else set()

        # -- scheduler side ---------------------------------------------------------------
        def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
            manager = self._kvtier_manager()
            ranks = {r: m for r, m in metadata.items() if isinstance(m, RankTiers)}
            if manager is not None and ranks:
                manager.adopt_ranks(ranks)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            manager = self._kvtier_manager()
            deletes = manager.take_deletes() if manager is not None else ()  # before any store is prepared
            meta = super().build_connector_meta(scheduler_output)
            meta.kvtier_deletes = deletes
            if manager is not None:
                manager.issued(meta)
            return meta

        def update_connector_output(self, connector_output: Any) -> None:
            meta = connector_output.kv_connector_worker_meta
            manager = self._kvtier_manager()
            if manager is not None:
                # Only counts of jobs still open reach vLLM (a late or doubled report of a job
                # settled after a deadline would make it look up a job it no longer has).
                results = meta.kvtier_results if isinstance(meta, KvtierWorkerMetadata) else ()
                counts = meta.completed_jobs if isinstance(meta, OffloadingWorkerMetadata) else {}
                allowed = manager.worker_output(results, counts)
                if isinstance(meta, OffloadingWorkerMetadata):
                    meta.completed_jobs = allowed
            super().update_connector_output(connector_output)

    return {
        "KvtierOffloadingSpec": KvtierOffloadingSpec,
        "KvtierConnector": KvtierConnector,
        "KvtierOffloadingManager": KvtierOffloadingManager,
        "KvtierOffloadingWorker": KvtierOffloadingWorker,
        "KvtierStoreSpec": KvtierStoreSpec,
        "KvtierLoadSpec": KvtierLoadSpec,
        "KvtierWorkerMetadata": KvtierWorkerMetadata,
    }

