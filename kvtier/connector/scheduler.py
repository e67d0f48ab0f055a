"""Scheduler side of the connector: turns engine scheduler steps into load and store jobs.

:class:`SchedulerConnector` answers the calls engine authors know from vLLM's KV connector
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``, ``update_connector_output``), plus ``build_immediate_meta`` and
``pending_prefix_stores`` for engines without a step loop (``ConnectorConfig(step_loop=False)``).
``docs/integrating.md`` gives the contract of every call, the fence, deletes and promotions.

Its collaborators: :class:`~kvtier.connector.jobtable.JobTable` (jobs in flight, with the
:class:`~kvtier.connector.fence.FenceIndex`), :class:`~kvtier.connector.stores.StoreBuilder`
(store and promotion jobs) and :class:`~kvtier.connector.ledger.DeleteLedger`. A request's state
is freed as soon as it is finished and has no jobs: the tables are empty whenever the engine is
idle. All calls are plain dictionary work on the scheduler thread; none blocks or awaits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.connector.config import ConnectorConfig
from kvtier.connector.jobtable import JobTable, TrackedJob
from kvtier.connector.ledger import DeleteLedger, Deletes
from kvtier.connector.loads import LoadBuilder
from kvtier.connector.state import KeyChain, RequestState
from kvtier.connector.stores import StoreBuilder
from kvtier.connector.types import (
    ConnectorError,
    ConnectorUpdate,
    Request,
    SchedulerStep,
    StepMetadata,
    StoreJob,
    WorkerOutput,
)
from kvtier.errors import LifecycleError
from kvtier.keys import Namespace
from kvtier.manager import LoadPlan, TierManager
from kvtier.transfer.jobs import JobResult, apply_result

__all__ = ["ConnectorConfig", "SchedulerConnector"]

log = logging.getLogger("kvtier.connector")

_COUNTERS = (
    "store_jobs",
    "store_blocks",
    "store_rejected_blocks",
    "store_failed_blocks",
    "stored_blocks",
    "load_jobs",
    "load_blocks",
    "load_missed_blocks",
    "load_failed_jobs",
    "flushed_jobs",
    "deferred_lookups",
    "last_block_jobs",
    "unknown_reports",
    "expired_jobs",
    "late_reports",
    "unknown_finished_requests",
    "deleted_blocks",
    "promotion_jobs",
    "promotion_blocks",
    "promotion_rejected_jobs",
    "promoted_blocks",
    "promotion_failed_blocks",
    "bytes_stored",
    "bytes_loaded",
)


class SchedulerConnector:
    """The scheduler half; see ``docs/integrating.md`` for the contract."""

    def __init__(self, manager: TierManager, namespace: Namespace, config: ConnectorConfig) -> None:
        self.manager = manager
        if config.block_size != namespace.block_size:
            # Checked here, never in the step: keys are cut every block_size * n tokens, and a
            # namespace built for another engine block would refuse them mid-request.
            raise ConnectorError(
                f"connector.block_size: the engine's blocks hold {config.block_size} tokens but "
                f"namespace.block_size is {namespace.block_size}; build the Namespace with "
                f"block_size={config.block_size} (tokens per engine block, whatever engine_blocks_per_block is)"
            )
        self.namespace = namespace
        self.config = config
        self._n = config.engine_blocks_per_block
        self._block_tokens = config.block_tokens
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._states: dict[str, RequestState] = {}
        self._keys = KeyChain(namespace, config)
        self._jobs = JobTable(config.world_size, config.ack_deadline_s)
        self._stores = StoreBuilder(manager, self._keys, self._jobs, self.counters, self._n, self._block_tokens)
        self._ledger = DeleteLedger()
        self._last_step = 0
        self._walk: list[RequestState] = []  # finished requests whose last blocks the next build stores
        self._loads = LoadBuilder(manager, self._keys, self._jobs, self.counters, config)
        self._warned_unknown = False

    @classmethod
    def from_store(cls, store: Any, *, block_size: int, world_size: int = 1, **options: Any) -> SchedulerConnector:
        """Build the scheduler half over an open :class:`kvtier.KVStore`."""
        if store.manager is None:
            raise LifecycleError("the store is not open; use 'await kvtier.open(...)' first")
        config = ConnectorConfig(
            block_size=block_size,
            engine_blocks_per_block=store.config.engine_blocks_per_block,
            world_size=world_size,
            **options,
        )
        return cls(store.manager, store.namespace, config)

    # -- introspection ---------------------------------------------------------------------
    @property
    def num_request_states(self) -> int:
        return len(self._states)

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    @property
    def num_fenced_blocks(self) -> int:
        return len(self._jobs.fence)

    def fenced_blocks(self) -> set[int]:
        """Engine blocks that pending store jobs still read."""
        return self._jobs.fence.blocks()

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping (jobs outstanding or a finish walk due)."""
        return bool(
            self._jobs
            or self._walk
            or self._loads.new_loads
            or self._loads.ready
            or self._ledger
            or self._stores.promotions
        )

    @property
    def num_pending_deletes(self) -> int:
        """Keys waiting for the next build to be shipped as deletes."""
        return len(self._ledger)

    def _state(self, request: Request) -> RequestState:
        rid = request.request_id
        st = self._states.get(rid)
        if st is None:
            st = self._states[rid] = RequestState(request)
        else:
            st.request = request
        return st

    # -- loads (see LoadBuilder) -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can load, and whether asynchronously
        (``(None, False)``: ask again next step)."""
        return self._loads.offer(self._state(request), num_computed_tokens)

    def pending_prefix_stores(self, request: Request, num_computed_tokens: int) -> tuple[int, ...]:
        """Unacknowledged store jobs writing the blocks right after the prefix kvtier holds for
        ``request`` now (past ``num_computed_tokens``); empty when there is nothing to wait for."""
        return self._loads.prefix_stores(self._state(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Record the allocation; build the load job promised by ``get_num_new_matched_tokens``."""
        self._loads.build(self._state(request), block_ids, num_external_tokens)

    # -- steps -----------------------------------------------------------------------------
    def build_connector_meta(self, step: SchedulerStep) -> StepMetadata:
        """Turn one scheduler step into the metadata every worker executes."""
        states, jobs = self._states, self._jobs
        flush: set[int] = set()
        allocated = set(step.allocated_block_ids)
        for rid in step.preempted_request_ids:
            st = states.get(rid)
            if st is None:
                continue
            flush.update(j for j in st.jobs if jobs.kind(j) == "store")
            # Its blocks are gone; after re-admission it starts over (present keys are skipped).
            st.stored = 0
            st.refused_at = -1
            st.scheduled = False
        # Jobs built in earlier steps whose source blocks are handed out again now.
        flush.update(jobs.fence.readers(allocated))
        for rid in step.finished_request_ids:
            st = states.get(rid)
            if st is not None and not st.finished:
                self._mark_finished(st, None)
                self._maybe_free(st)
        self._last_step = step.step
        deletes = self._take_deletes()  # before any prepare_store of this build (see DeleteLedger)
        # Finished requests first: workers submit stores in build order, and flushing one of
        # these must not drag along a job that reads blocks this step's compute still fills.
        stores = self._run_walk()
        for walked in stores:
            # Its blocks were freed at finish; handed out in this very step, the job must run
            # before this step's compute overwrites them.
            if not allocated.isdisjoint(walked.block_ids):
                flush.add(walked.job_id)
        if self._stores.promotions:
            # Their blocks are complete (loaded): built before this step's stores, like the walk.
            stores.extend(self._stores.run_promotions(states, allocated, step.preempted_request_ids, flush))
        bt = self._block_tokens
        build = self._stores.build
        for rid, count in step.num_scheduled_tokens.items():
            st = states.get(rid)
            if st is None or st.finished:
                continue  # never announced through update_state_after_alloc: nothing to store
            st.scheduled = True
            req = st.request
            computed = req.num_computed_tokens + count
            if computed // bt <= st.stored:
                continue  # the common decode step: no block completed (kept inline: hot path)
            job = build(st, computed, req.block_ids)
            if job is not None:
                stores.append(job)
        loads, self._loads.new_loads = self._loads.new_loads, []
        self.counters["flushed_jobs"] += len(flush)
        return StepMetadata(step.step, tuple(stores), tuple(loads), tuple(sorted(flush)), deletes)

    def build_immediate_meta(self) -> StepMetadata:
        """Everything due now, for an engine without a step loop: the loads queued by
        ``update_state_after_alloc`` and the finish walk's stores. Run it with
        :meth:`WorkerConnector.run_now`; its stores are submitted at once (not deferred), so
        the engine must fence their blocks (``docs/integrating.md``)."""
        deletes = self._take_deletes()
        stores = self._run_walk()
        if self._stores.promotions:
            stores.extend(self._stores.run_promotions(self._states, (), (), set()))
        loads, self._loads.new_loads = self._loads.new_loads, []
        return StepMetadata(self._last_step, tuple(stores), tuple(loads), (), deletes)

    def _take_deletes(self) -> Deletes:
        deletes = self._ledger.take(self.manager)
        self.counters["deleted_blocks"] += sum(len(ks) for _, ks in deletes)
        return deletes

    # -- finish ----------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, None]:
        """The request finished (or was aborted); returns ``(delay_free, None)``.

        ``delay_free`` is true while a load still writes into the request's blocks: keep them
        until ``ConnectorUpdate.freed`` names the request. The second value is always ``None``
        (in vLLM's API it carries transfer parameters for a remote decode instance)."""
        st = self._states.get(request.request_id)
        if st is None:
            if self.config.step_loop:
                self._unknown_finished(request)
                return False, None
            # A synchronous engine reports the computed slots itself: store them.
            st = self._state(request)
        st.request = request
        if not st.finished:
            self._mark_finished(st, block_ids)
        st.delay_free = st.load_job is not None
        self._maybe_free(st)
        return st.delay_free, None

    def _unknown_finished(self, request: Request) -> None:
        self.counters["unknown_finished_requests"] += 1
        if not self._warned_unknown:
            self._warned_unknown = True
            log.warning(
                "request_finished(%r): the connector never saw this request (or it was finished already), so "
                "none of its blocks is stored; call get_num_new_matched_tokens and update_state_after_alloc for "
                "every request the engine admits (counted in counters['unknown_finished_requests']; warned once)",
                request.request_id,
            )

    def _mark_finished(self, st: RequestState, block_ids: Sequence[int] | None) -> None:
        st.finished = True
        st.intent = None
        if self.config.store_last_block_at_finish and (st.scheduled or not self.config.step_loop):
            req = st.request
            st.final_block_ids = tuple(int(b) for b in (req.block_ids if block_ids is None else block_ids))
            # The final sampled token's slot is never written, whatever the engine counts.
            st.final_computed = max(0, min(int(req.num_computed_tokens), len(req.token_ids) - 1))
            # Refresh now: the tokens that completed the last block are known only at finish.
            self._keys.extend(st, st.final_computed // self._block_tokens)
            if st.final_computed // self._block_tokens > st.stored:
                self._walk.append(st)

    def _run_walk(self) -> list[StoreJob]:
        """Build the stores of the requests finished since the last walk (their last blocks)."""
        if not self._walk:
            return []
        stores: list[StoreJob] = []
        walk, self._walk = self._walk, []
        for st in walk:
            job = self._stores.build(st, st.final_computed, st.final_block_ids, final=True)
            if job is not None:
                stores.append(job)
                self.counters["last_block_jobs"] += 1
            self._maybe_free(st)
        return stores

    def _maybe_free(self, st: RequestState) -> None:
        if st.finished and not st.jobs and st not in self._walk:
            rid = st.request.request_id
            if self._states.get(rid) is st:
                del self._states[rid]

    # -- completions -----------------------------------------------------------------------
    def update_connector_output(
        self, worker_output: WorkerOutput | bytes | Iterable[WorkerOutput | bytes]
    ) -> ConnectorUpdate:
        """Apply worker reports; a job completes once every one of ``world_size`` workers reported it."""
        outputs: Iterable[WorkerOutput | bytes | bytearray | memoryview]
        if isinstance(worker_output, (WorkerOutput, bytes, bytearray, memoryview)):
            outputs = (worker_output,)
        else:
            outputs = worker_output
        loaded: dict[str, int] = {}
        freed: list[str] = []
        unfenced: list[int] = []
        world, jobs = self.config.world_size, self._jobs
        for out in outputs:
            if not isinstance(out, WorkerOutput):
                out = WorkerOutput.from_bytes(bytes(out))
            if not 0 <= out.rank < world:
                raise ConnectorError(f"worker output: rank {out.rank} is outside world_size {world}")
            for report in out.finished:
                job = jobs.get(report.job_id)
                if job is None or job.kind != report.kind:
                    self._late(report.job_id, out.rank, unfenced)
                elif jobs.acknowledge(job, out.rank, report, unfenced):
                    self._complete(job, jobs.settle(job, unfenced), loaded, freed)
            for job_id in out.released:  # still running, done with the engine's blocks
                job = jobs.get(job_id) or jobs.lingering(job_id)
                if job is not None and job.kind == "store":
                    jobs.release(job, out.rank, unfenced)
        if jobs.waiting:
            for job, result in jobs.expire(time.monotonic(), unfenced):
                self.counters["expired_jobs"] += 1
                log.warning("store job %d: %s; its keys are released", job.job_id, result.error)
                self._complete(job, result, loaded, freed)
        if self._loads.ready:
            loaded.update(self._loads.ready)
            self._loads.ready.clear()
        return ConnectorUpdate(loaded, tuple(freed), tuple(unfenced))

    def _late(self, job_id: int, rank: int, unfenced: list[int]) -> None:
        """A report of a job given up past the ack deadline lifts its fence; any other is unknown."""
        job = self._jobs.lingering(job_id)
        if job is None:
            self.counters["unknown_reports"] += 1
        else:
            self.counters["late_reports"] += 1
            self._jobs.release(job, rank, unfenced)

    def _complete(self, job: TrackedJob, result: JobResult, loaded: dict[str, int], freed: list[str]) -> None:
        """Apply a job every worker reported (``apply_result``), then the connector's own part:
        the delete ledger, promotions, the request's valid tokens, counters."""
        applied = apply_result(self.manager, job.plan, result)
        c, ledger = self.counters, self._ledger
        st = self._states.get(job.request_id)
        if job.kind == "store":
            for tier, failed_keys in result.failed.items():
                ledger.remember(tier, failed_keys)
            if result.error is not None:
                ledger.remember_plan(job.plan)  # type: ignore[arg-type]
            if job.promotion:
                c["promotion_failed_blocks"] += applied.lost
                c["promoted_blocks"] += applied.done
            else:
                c["store_failed_blocks"] += applied.lost
                c["stored_blocks"] += applied.done
            c["bytes_stored"] += result.nbytes
        else:
            plan = job.plan
            assert isinstance(plan, LoadPlan)
            # A promotion that failed on one worker may have been written on another; a key
            # missing or corrupt in a tier is dropped from the other workers' shards too.
            ledger.remember(0, applied.failed_promotions)
            if result.error is None:
                for key, tier in zip(result.missed, result.missed_tiers):
                    ledger.remember(tier, (key,))
            else:
                c["load_failed_jobs"] += 1
            c["load_missed_blocks"] += applied.lost
            c["bytes_loaded"] += result.nbytes
            valid = applied.done
            if (
                valid
                and self.config.promote
                and self.config.step_loop
                and st is not None
                and not st.finished  # aborted while loading: its blocks are freed now
                and any(tier > 0 for tier in plan.tiers[:valid])
            ):
                self._stores.promotions.append((job.request_id, plan.keys[:valid], job.block_ids[: valid * self._n]))
            loaded[job.request_id] = self._loads.valid_tokens(job, applied)
            if st is not None:
                st.load_job = None
                if st.delay_free:
                    st.delay_free = False
                    freed.append(job.request_id)
        if st is not None:
            st.jobs.discard(job.job_id)
            self._maybe_free(st)
