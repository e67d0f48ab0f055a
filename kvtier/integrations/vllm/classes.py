"""The vLLM classes (spec, manager, worker, connector), built on first access because they subclass vLLM's."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integrations._sync import run_sync
from kvtier.integrations.vllm.announce import OffloadKeyLog, offload_key_log_path
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
from kvtier.integrations.vllm.groups import (
    RankGroups,
    SchedulerGroups,
    WorkerGroups,
    check_kv_cache_groups,
    group_layout,
    group_shares,
    group_tiers,
    summed,
)
from kvtier.integrations.vllm.idle_steps import idle_load_wait, is_idle_step, wait_for_loads
from kvtier.integrations.vllm.ranks import describe_rank
from kvtier.integrations.vllm.replicated import WRITER_RANK, namespace_rank, shared_tiers
from kvtier.integrations.vllm.scheduler_side import DEFAULT_RESULT_DEADLINE_S
from kvtier.integrations.vllm.stats import METRICS, PREFIX, CounterDeltas, scheduler_counters, worker_counters
from kvtier.integrations.vllm.worker_side import _WorkerSide, close_sides
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
        """Where a store goes: a kvtier store plan (drops, demotions, new keys) per KV-cache
        group with keys to store, as (group position, plan)."""

        def __init__(self, plans: tuple[tuple[int, StorePlan], ...]) -> None:
            self.plans = plans

        def __repr__(self) -> str:
            parts = ", ".join(f"g{g}: plan {p.plan_id}, {len(p.keys)} keys" for g, p in self.plans)
            return f"KvtierStoreSpec({parts})"

    @_public
    class KvtierLoadSpec(LoadStoreSpec):
        """Where a load comes from: a kvtier load plan (the tier of each key) per KV-cache
        group with keys to load, as (group position, load id, plan)."""

        def __init__(self, loads: tuple[tuple[int, int, LoadPlan], ...]) -> None:
            self.loads = loads

        def __repr__(self) -> str:
            parts = ", ".join(f"g{g}: load {i}, {len(p.keys)} keys" for g, i, p in self.loads)
            return f"KvtierLoadSpec({parts})"

    @_public
    @dataclass
    class KvtierWorkerMetadata(OffloadingWorkerMetadata):
        """vLLM's worker metadata plus each rank's kvtier results: (rank, group position, kind,
        id, JobResult)."""

        kvtier_results: list[tuple[int, int, str, int, JobResult]] = field(default_factory=list)

        def aggregate(self, other: Any) -> Any:
            merged = super().aggregate(other)
            return KvtierWorkerMetadata(
                completed_jobs=merged.completed_jobs,
                transfer_stats=merged.transfer_stats,
                kvtier_results=[*self.kvtier_results, *getattr(other, "kvtier_results", ())],
            )

    class KvtierOffloadingManager(OffloadingManager):
        """vLLM's OffloadingManager over kvtier's :class:`TierManager` (one per offloaded
        KV-cache group, see :mod:`.groups`), in the scheduler's process.

        The managers are built when every worker rank has described its tiers
        (:meth:`adopt_ranks`, before vLLM's first step); until then every lookup misses and
        nothing is stored."""

        def __init__(self, engines: list[_SchedulerEngine], groups: SchedulerGroups, key_log: OffloadKeyLog) -> None:
            self._engines = engines
            self._groups = groups
            self._key_log = key_log
            self._announce: list[Any] = []  # events of adopted blocks, before the managers' own
            self._media: list[Any] = []

        def adopt_ranks(self, ranks: Mapping[int, RankGroups]) -> None:
            """Build the managers from what every rank opened (see :mod:`.ranks`)."""
            events = self._groups.adopt(ranks)
            self._media = [Medium.CPU if memory else Medium.STORAGE for memory in self._groups.memory_tiers]
            self._announce = [OffloadingEvent(keys=[v], medium=self._media[t], removed=False) for t, v in events]

        def worker_output(
            self, results: Collection[tuple[int, int, str, int, JobResult]], counts: Mapping[int, int]
        ) -> dict[int, int]:
            """The ranks' results and vLLM's completion counts of one step: the counts vLLM may
            apply (:meth:`SchedulerGroups.worker_output`)."""
            return self._groups.worker_output(results, counts)

        def issued(self, meta: Any) -> None:
            """Start the result deadline of every job in this step's connector metadata, and
            add the notices of jobs given up on (``kvtier_abandoned``, per group) to it."""
            if not self._groups.ready:
                meta.kvtier_abandoned = ()
                return
            for job_id, job in meta.store_jobs.items():
                if isinstance(job.dst_spec, KvtierStoreSpec):
                    self._groups.issued(job_id, "store", [(g, p.plan_id) for g, p in job.dst_spec.plans])
            for job_id, job in meta.load_jobs.items():
                if isinstance(job.src_spec, KvtierLoadSpec):
                    self._groups.issued(
                        job_id,
                        "load",
                        [(g, load_id) for g, load_id, _ in job.src_spec.loads],
                        job.dst_spec.block_ids,
                        job.dst_spec.group_sizes,
                        getattr(job, "req_id", None),
                    )
            meta.kvtier_abandoned = self._groups.take_notices()

        def take_deletes(self) -> Any:
            return self._groups.take_deletes()

        # lifecycle
        def lookup(self, key: Any, req_context: Any) -> Any:
            return LookupResult.HIT if self._groups.lookup(key) else LookupResult.MISS

        def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
            assert self._groups.ready  # vLLM loads only what a lookup found
            return KvtierLoadSpec(self._groups.prepare_load(list(keys), getattr(req_context, "req_id", None)))

        def request_finished(self, request_id: str) -> None:
            """The request ended (finished or aborted): its loads are settled once done."""
            if self._groups.ready:
                self._groups.request_finished(request_id)

        def touch(self, keys: Collection[Any], req_context: Any) -> None:
            if self._groups.ready:
                self._groups.touch(list(keys))

        def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
            if self._groups.ready:
                self._groups.complete_load(list(keys))

        def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
            if not self._groups.ready:
                return None
            prepared = self._groups.prepare_store(list(keys))
            if prepared is None:
                return None
            chosen, plans = prepared
            return PrepareStoreOutput(keys_to_store=chosen, store_spec=KvtierStoreSpec(plans), evicted_keys=[])

        def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
            if not self._groups.ready:
                return
            pairs = self._groups.complete_store(list(keys), success)
            if pairs:
                self._key_log.append(pairs)

        def on_new_request(self, req_context: Any) -> Any:
            return RequestOffloadingContext()

        def take_events(self) -> Any:
            if not self._groups.ready:
                return
            announce, self._announce = self._announce, []
            yield from announce
            for vkey, tier, removed in self._groups.take_events():
                yield OffloadingEvent(keys=[vkey], medium=self._media[tier], removed=removed)

        def counters(self) -> dict[str, int]:
            return summed(scheduler_counters(e) for e in self._engines)

        def shutdown(self) -> None:
            for engine in self._engines:
                _unregister(engine)

    class KvtierOffloadingWorker(OffloadingWorker):
        """Executes kvtier plans between this rank's paged KV cache and its own tiers (one store
        per offloaded KV-cache group)."""

        def __init__(self, engines: list[_Engine], description: RankGroups, idle_load_wait_s: float = 0.0) -> None:
            self._engines = engines
            self._rank = engines[0].rank
            self._groups = WorkerGroups([_WorkerSide(e) for e in engines])
            self._idle_load_wait_s = idle_load_wait_s
            #: this step runs no forward pass (set by the connector's start_load_kv; .idle_steps)
            self.idle_step = False
            #: what this rank opened; vLLM hands it to the scheduler side (handshake metadata)
            self.description = description

        @property
        def num_groups(self) -> int:
            return len(self._engines)

        def report_load_errors(self) -> None:
            for engine in self._engines:
                engine.reports_load_errors = True

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            if not (isinstance(src_spec, GPULoadStoreSpec) and isinstance(dst_spec, KvtierStoreSpec)):
                log.warning("kvtier: store job %d with unexpected specs %r -> %r; ignored", job_id, src_spec, dst_spec)
                return False
            self._groups.submit_store(
                job_id, dst_spec.plans, src_spec.block_ids, src_spec.group_sizes, src_spec.block_indices
            )
            return True

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            if not (isinstance(src_spec, KvtierLoadSpec) and isinstance(dst_spec, GPULoadStoreSpec)):
                log.warning("kvtier: load job %d with unexpected specs %r -> %r; ignored", job_id, src_spec, dst_spec)
                return False
            self._groups.submit_load(
                job_id, src_spec.loads, dst_spec.block_ids, dst_spec.group_sizes, dst_spec.block_indices
            )
            return True

        def get_finished(self) -> list[Any]:
            if self.idle_step and self._idle_load_wait_s:
                wait_for_loads(self._groups.sides, self._idle_load_wait_s)
            return [
                TransferResult(job_id, success, transfer_size=nbytes, transfer_time=seconds)
                for job_id, success, nbytes, seconds in self._groups.finished()
            ]

        def take_results(self) -> list[tuple[int, int, str, int, JobResult]]:
            return self._groups.take_results(self._rank)

        def submit_deletes(self, deletes: Any) -> None:
            self._groups.submit_deletes(deletes)

        def abandon(self, notices: Any) -> None:
            self._groups.abandon(notices)

        def counters(self) -> dict[str, int]:
            return summed(worker_counters(e) for e in self._engines)

        def take_failed_block_ids(self) -> set[int]:
            return self._groups.take_failed_block_ids()

        def take_failed_loads(self) -> set[int]:
            return self._groups.take_failed_loads()

        def wait(self, job_ids: set[int]) -> None:
            self._groups.wait(job_ids)

        def shutdown(self) -> None:
            for engine in self._engines:
                _unregister(engine)
            # writes back what only this rank's memory tiers hold, one budget for all groups
            run_sync(close_sides(self._groups.sides))

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
            self._idle_load_wait_s = idle_load_wait(self.extra_config.get("idle_load_wait_s"))
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
            deadline = self._result_deadline_s
            if deadline is None:  # past the ranks' own job deadline, so a live rank reports first
                job_deadline = store_cfg.job_deadline_s
                deadline = DEFAULT_RESULT_DEADLINE_S if job_deadline is None else job_deadline + 60.0
            engines = [
                _SchedulerEngine(self.config.engine_id, parallel.world_size, group=g.group_id) for g in self.config.groups
            ]
            for engine in engines:
                _register(engine)
            key_log = OffloadKeyLog(offload_key_log_path(self._store_dict, parallel.world_size))

            def namespace_of(gpos: int, layout: str) -> Any:
                return _namespace(self.config, self.tokens_per_block[gpos], layout, self._overrides)

            groups = SchedulerGroups(engines, store_cfg, key_log, namespace_of, result_deadline_s=deadline)
            return KvtierOffloadingManager(engines, groups, key_log)

        def get_worker(self, kv_caches: Any) -> Any:
            group_ids = tuple(int(g.group_id) for g in self.config.groups)
            if len(kv_caches.group_data_refs) != len(group_ids):
                raise ConfigError(
                    f"kvtier: vLLM registered {len(kv_caches.group_data_refs)} KV-cache groups, its offloading config "
                    f"names {len(group_ids)}"
                )
            parallel = self.config.parallel
            rank, world = int(parallel.rank), int(parallel.world_size)
            views = _page_views(kv_caches, str(self.config.model.dtype))
            from kvtier.transfer.layout import KVLayout

            # One group: every tensor, as before (its records stay valid). Several: each
            # group's own tensors (groups may share a tensor, each with its own block ids).
            group_views = [views] if len(group_ids) == 1 else [
                [views[i] for i in dict.fromkeys(ref.tensor_idx for ref in refs)] for refs in kv_caches.group_data_refs
            ]
            layouts = [KVLayout(v, engine_blocks_per_block=self.blocks_per_chunk) for v in group_views]
            shares = group_shares([layout.block_bytes for layout in layouts])
            per_rank = rank_tiers(self._store_dict, rank, world, shared=self._shared)
            # Replicated KV: every rank's bytes are rank 0's, and so is the namespace of its records.
            ns_rank = namespace_rank(rank, self._replicated)
            skip = self._shared if rank != WRITER_RANK else frozenset()
            engines, descriptions = [], []
            for gpos, (gid, layout, v) in enumerate(zip(group_ids, layouts, group_views)):
                fingerprint = group_layout(layout.fingerprint(), gid, len(group_ids))
                namespace = _namespace(self.config, self.tokens_per_block[gpos], fingerprint, self._overrides, rank=ns_rank)
                cfg = load_config(
                    group_tiers(per_rank, gid, shares[gpos], len(group_ids)),
                    source="kv_connector_extra_config.kvtier",
                    block_bytes=layout.block_bytes,
                )
                store = run_sync(KVStore(cfg, kv_caches=v, namespace=namespace).start())
                engine = _Engine(self.config.engine_id, store, rank=rank, group=gid, skip_tiers=skip)
                descriptions.append(describe_rank(self.config.engine_id, rank, world, store, fingerprint))
                _register(engine)
                engines.append(engine)
                log.info(
                    "kvtier: rank %d of %d, KV-cache group %d: %d tiers under vLLM engine %s, %d-byte blocks, %d records found",
                    rank,
                    world,
                    gid,
                    len(store.backends),
                    self.config.engine_id,
                    layout.block_bytes,
                    sum(len(t.records) for t in descriptions[-1].tiers),
                )
            description = RankGroups(rank, world, group_ids, tuple(descriptions))
            return KvtierOffloadingWorker(engines, description, idle_load_wait_s=self._idle_load_wait_s)

    class KvtierConnector(OffloadingConnector):
        """vLLM's OffloadingConnector with kvtier's spec. Over vLLM's own channels it carries
        what kvtier's two sides tell each other: each rank's tiers (handshake metadata, at
        start), each rank's job results (worker metadata) and the deletes the workers owe
        (connector metadata); and it reports blocks whose load failed to vLLM."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            check_kv_cache_groups(getattr(kv_cache_config, "kv_cache_groups", ()))
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
                grown = self._kvtier_deltas.take(worker.counters())
            elif manager is not None:
                grown = self._kvtier_deltas.take(manager.counters())
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
                worker.report_load_errors()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            super().start_load_kv(forward_context, **kwargs)
            worker = self._kvtier_worker()
            if worker is not None:
                worker.idle_step = is_idle_step(forward_context)

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

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            """vLLM's results, plus the requests whose load failed as failed receives (several
            KV-cache groups: vLLM 0.32 takes no failed block ids then; see :mod:`.groups`)."""
            cw = self.connector_worker
            load_jobs = dict(getattr(cw, "_load_jobs", {})) if cw is not None else {}  # popped as loads finish
            results = super().get_transfer_results(finished_req_ids)
            worker = self._kvtier_worker()
            if worker is not None:
                failed = {load_jobs[j] for j in worker.take_failed_loads() if j in load_jobs}
                if failed:
                    log.warning("kvtier: %d request(s) recompute after a failed load: %s", len(failed), sorted(failed))
                    results.failed_recving |= failed
            return results

        # -- scheduler side ---------------------------------------------------------------
        def request_finished(self, request: Any, block_ids: Any) -> Any:
            out = super().request_finished(request, block_ids)
            self._kvtier_request_ended(request)
            return out

        def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
            out = super().request_finished_all_groups(request, block_ids)
            self._kvtier_request_ended(request)
            return out

        def _kvtier_request_ended(self, request: Any) -> None:
            manager = self._kvtier_manager()
            if manager is not None:  # an aborted request's loads are never completed by vLLM
                manager.request_finished(request.request_id)

        def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
            manager = self._kvtier_manager()
            ranks = {r: m for r, m in metadata.items() if isinstance(m, RankGroups)}
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

