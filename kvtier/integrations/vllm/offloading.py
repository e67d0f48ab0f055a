"""vLLM's ``OffloadingManager`` and ``OffloadingWorker`` over kvtier (imports vLLM).

* :class:`KvtierOffloadingManager` (the scheduler side, in the engine-core process) answers
  vLLM's lookups and plans stores and loads with one kvtier :class:`~kvtier.manager.TierManager`
  per offloaded KV-cache group (:class:`~.groups.SchedulerGroups`);
* :class:`KvtierOffloadingWorker` (one per worker rank) carries those plans out between the
  rank's paged KV cache and its own tiers (:class:`~.groups.WorkerGroups`).

Both only translate between vLLM's types and kvtier's; the bookkeeping lives in
:mod:`.groups`, :mod:`.scheduler_side` and :mod:`.worker_side`, which do not import vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingWorker,
    PrepareStoreOutput,
    RequestOffloadingContext,
    TransferResult,
)

from kvtier.integrations._sync import run_sync
from kvtier.integrations.vllm.admin import AdminServer
from kvtier.integrations.vllm.announce import OffloadKeyLog
from kvtier.integrations.vllm.engines import RankEngine, SchedulerEngine, unregister_engine
from kvtier.integrations.vllm.groups import RankGroups, SchedulerGroups, WorkerGroups, summed
from kvtier.integrations.vllm.idle_steps import wait_for_loads
from kvtier.integrations.vllm.messages import KvtierLoadSpec, KvtierStoreSpec, RankResult
from kvtier.integrations.vllm.stats import scheduler_counters, worker_counters
from kvtier.integrations.vllm.tenants import RequestTenants
from kvtier.integrations.vllm.worker_side import WorkerSide, close_sides

__all__ = ["KvtierOffloadingManager", "KvtierOffloadingWorker"]

log = logging.getLogger("kvtier.vllm")


class KvtierOffloadingManager(OffloadingManager):
    """vLLM's OffloadingManager over kvtier's :class:`TierManager` (one per offloaded
    KV-cache group, see :mod:`.groups`), in the scheduler's process.

    The managers are built when every worker rank has described its tiers
    (:meth:`adopt_ranks`, before vLLM's first step); until then every lookup misses and
    nothing is stored."""

    def __init__(self, engines: list[SchedulerEngine], groups: SchedulerGroups, key_log: OffloadKeyLog) -> None:
        self._engines = engines
        self._groups = groups
        self._key_log = key_log
        self._announce: list[Any] = []  # events of adopted blocks, before the managers' own
        self._media: list[Any] = []
        #: the tenant (cache salt) of each running request, noted by the connector
        self.tenants = RequestTenants()
        #: the operator's endpoint, when the config turns it on (:mod:`.admin`)
        self.admin: AdminServer | None = None

    def adopt_ranks(self, ranks: Mapping[int, RankGroups]) -> None:
        """Build the managers from what every rank opened (see :mod:`.ranks`)."""
        events = self._groups.adopt(ranks)
        self._media = [Medium.CPU if memory else Medium.STORAGE for memory in self._groups.memory_tiers]
        self._announce = [self._event(v, t, removed=False) for t, v in events]

    def worker_output(
        self, results: Collection[RankResult], counts: Mapping[int, int]
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
        if self.admin is not None and self._groups.ready:  # the endpoint's deletes, on this (the step) thread
            self.admin.ops.to_ledgers()
        return self._groups.take_deletes()

    def take_tags(self) -> Any:
        """Tenant tags and pin changes (the endpoint's pins too) for the ranks to save."""
        return self._groups.take_tags()

    # lifecycle
    def lookup(self, key: Any, req_context: Any) -> Any:
        return LookupResult.HIT if self._groups.lookup(key) else LookupResult.MISS

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
        assert self._groups.ready  # vLLM loads only what a lookup found
        return KvtierLoadSpec(self._groups.prepare_load(list(keys), getattr(req_context, "req_id", None)))

    def request_finished(self, request_id: str) -> None:
        """The request ended (finished or aborted): its loads are settled once done."""
        self.tenants.forget(request_id)
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
        prepared = self._groups.prepare_store(list(keys), self.tenants.tenant(getattr(req_context, "req_id", None)))
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
            yield self._event(vkey, tier, removed=removed)

    def _event(self, key: bytes, tier: int, *, removed: bool) -> Any:
        """A KV event of ``key`` in ``tier``: its medium (CPU for memory tiers, STORAGE for
        the others), its locality (REMOTE for a tier other engines write too) and, as its
        ownership, the kvtier tier's name (``kvtier:<name>``)."""
        names, shared = self._groups.tier_names, self._groups.shared_tiers
        return OffloadingEvent(
            keys=[key],
            medium=self._media[tier],
            removed=removed,
            locality=Locality.REMOTE if tier < len(shared) and shared[tier] else Locality.LOCAL,
            ownership=f"kvtier:{names[tier]}" if tier < len(names) else None,
        )

    def counters(self) -> dict[str, int]:
        return summed(scheduler_counters(e) for e in self._engines)

    def shutdown(self) -> None:
        if self.admin is not None:
            self.admin.close()
        self._groups.close()
        for engine in self._engines:
            unregister_engine(engine)


class KvtierOffloadingWorker(OffloadingWorker):
    """Executes kvtier plans between this rank's paged KV cache and its own tiers (one store
    per offloaded KV-cache group)."""

    def __init__(self, engines: list[RankEngine], description: RankGroups, idle_load_wait_s: float = 0.0) -> None:
        self._engines = engines
        self._rank = engines[0].rank
        self._groups = WorkerGroups([WorkerSide(e) for e in engines])
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

    def take_results(self) -> list[RankResult]:
        return self._groups.take_results(self._rank)

    def submit_deletes(self, deletes: Any, tags: Any = ()) -> None:
        self._groups.submit_deletes(deletes, tags)

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
            unregister_engine(engine)
        # writes back what only this rank's memory tiers hold, one budget for all groups
        run_sync(close_sides(self._groups.sides))
