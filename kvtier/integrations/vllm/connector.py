"""``KvtierConnector``: vLLM's ``OffloadingConnector`` with kvtier's spec (imports vLLM).

The name users put in ``kv_connector`` (with ``kv_connector_module_path``
``kvtier.integrations.vllm``). Over vLLM's own channels it carries what kvtier's two sides
tell each other (see the package doc and :mod:`.ranks`): each rank's tiers at start (handshake
metadata), each rank's job results (worker metadata), the deletes and tenant tags the ranks owe and the notices
of jobs given up on (connector metadata); it reports blocks whose load failed to vLLM, and adds
kvtier's counters to vLLM's connector stats.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from kvtier.integrations.vllm.engines import MODULE_PATH
from kvtier.integrations.vllm.group_config import check_kv_cache_groups
from kvtier.integrations.vllm.groups import RankGroups
from kvtier.integrations.vllm.head_layout import head_shapes
from kvtier.integrations.vllm.idle_steps import is_idle_step
from kvtier.integrations.vllm.messages import KvtierWorkerMetadata
from kvtier.integrations.vllm.offloading import KvtierOffloadingManager, KvtierOffloadingWorker
from kvtier.integrations.vllm.spec import CHANNELS_KEY, HASH_ALGO_KEY, REPLICATED_KEY, KvtierOffloadingSpec
from kvtier.integrations.vllm.stats import PREFIX, CounterDeltas

__all__ = ["KvtierConnector", "replicated_kv"]

log = logging.getLogger("kvtier.vllm")


def replicated_kv(vllm_config: Any, kv_cache_config: Any) -> bool:
    """Whether every rank holds the same KV bytes: an MLA model (vLLM's ``use_mla``) whose
    KV-cache groups are all plain ``MLAAttentionSpec`` (not, say, MLA with a sharded indexer)."""
    if not getattr(getattr(vllm_config, "model_config", None), "use_mla", False):
        return False
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return all(type(g.kv_cache_spec) is MLAAttentionSpec for g in groups)


def _select_spec(vllm_config: Any) -> Any:
    """The extra config with kvtier's offloading spec chosen (unless one was named)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.setdefault("spec_name", "KvtierOffloadingSpec")
    extra.setdefault("spec_module_path", MODULE_PATH)
    return extra


class KvtierConnector(OffloadingConnector):
    """vLLM's OffloadingConnector with kvtier's spec. Over vLLM's own channels it carries
    what kvtier's two sides tell each other: each rank's tiers (handshake metadata, at
    start), each rank's job results (worker metadata) and the deletes the workers owe
    (connector metadata); and it reports blocks whose load failed to vLLM."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        check_kv_cache_groups(getattr(kv_cache_config, "kv_cache_groups", ()))
        extra = _select_spec(vllm_config)
        extra[CHANNELS_KEY] = True
        extra[REPLICATED_KEY] = replicated_kv(vllm_config, kv_cache_config)
        # the admin endpoint hashes prompts as the engine does (.admin)
        extra[HASH_ALGO_KEY] = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        self._kvtier_deltas = CounterDeltas()
        self._kvtier_vllm_config = vllm_config
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
        self._kvtier_head_shapes(kv_caches)  # before vLLM builds the worker from byte views
        super().register_kv_caches(kv_caches)
        worker = self._kvtier_worker()
        if worker is not None:
            worker.report_load_errors()

    def _kvtier_head_shapes(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Tell the spec where the KV heads are in each offloaded group's pages (.head_layout)."""
        cw = self.connector_worker
        spec = getattr(cw, "spec", None)
        kv_cache_config = getattr(cw, "kv_cache_config", None)
        if not isinstance(spec, KvtierOffloadingSpec) or kv_cache_config is None:
            return
        try:
            kv_heads = int(self._kvtier_vllm_config.model_config.get_total_num_kv_heads())
            groups = []
            for g in spec.config.groups:
                group = kv_cache_config.kv_cache_groups[g.group_id]
                tensors = [kv_caches[name] for name in group.layer_names if name in kv_caches]
                groups.append((int(g.group_id), group.kv_cache_spec, tensors))
            spec.head_shapes = head_shapes(groups, int(kv_cache_config.num_blocks), kv_heads)
        except Exception as exc:  # an unknown vLLM object: records stay per rank
            log.warning("kvtier: cannot tell where the KV heads are (%s); records stay per rank", exc)
            spec.head_shapes = {}
        log.info("kvtier: KV heads in vLLM's pages, per KV-cache group: %s", spec.head_shapes)

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
            worker.submit_deletes(getattr(kv_connector_metadata, "kvtier_deletes", ()), getattr(kv_connector_metadata, "kvtier_tags", ()))
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

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        manager = self._kvtier_manager()
        if manager is not None:  # the request's cache salt is the tenant of what it stores
            manager.tenants.note(request)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

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
        meta.kvtier_tags = manager.take_tags() if manager is not None else ()  # saved by the ranks with the deletes
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
