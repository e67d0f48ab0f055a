"""Worker side of the connector: executes :class:`StepMetadata` on one worker's KV cache.

Per step, in this order (the engine's model runner calls them):

1. ``handle_preemptions(meta)`` - before the step's compute. If ``meta.deletes`` is not empty,
   the deferred stores and then the deletes are submitted first (see below). Every job in
   ``meta.jobs_to_flush`` that is still unsubmitted (deferred from the previous step, or built
   in this very step) is submitted, then the worker waits until every flushed job has read
   its engine blocks (the device read, ``TransferEngine.wait_device``; its tier writes, such as
   write-back to disk, go on after the step's compute starts, so a stalled or failing tier never
   holds the engine's blocks). Stores are
   submitted in the order the scheduler built them, so flushing job ``j`` also submits the
   unsubmitted jobs built before it: the manager's plans (evictions, demotions) assume that
   order.
2. ``start_load_kv(meta)`` - submits the stores deferred from earlier steps (their blocks were
   computed by the previous step's compute) and this step's loads. This step's stores wait for
   the next step, so token generation is never slowed by them.
3. the step's compute.
4. ``get_finished()`` - a :class:`WorkerOutput` with every job that finished since the last call
   (store and load, with failed / missed keys and sizes), and the store jobs that finished
   reading the engine's blocks while their tier writes go on (``released``: the scheduler side
   lifts their fence), to send to the scheduler side.

An engine without a step loop (``docs/integrating.md``, section 6) calls instead:

- ``run_now(meta)`` with the metadata of ``build_immediate_meta``: submits every unsubmitted
  store (earlier ones first, in build order), then ``meta.deletes``, ``meta.stores`` and
  ``meta.loads``, waits for the loads (and for ``meta.jobs_to_flush``), and returns
  :meth:`get_finished`'s output.
  Its stores are in flight when it returns: the engine fences their blocks until the scheduler
  side reports them ``unfenced``.
- ``wait_for(job_ids)``: submits the given jobs if still unsubmitted (with those built before
  them), waits for them to finish (tier writes included: their keys are then stored), and
  returns :meth:`get_finished`'s output.

Deletes (``meta.deletes``: keys the scheduler side released after a job that did not succeed on
every worker) run on the transfer engine's store queue as a store job with nothing but drops,
submitted when the worker first sees the metadata, after every store built in an earlier step
(submitted then if still deferred: their blocks were computed by an earlier step's compute) and
before this metadata's stores. The store queue is FIFO, so deletes and stores run in the order
the scheduler built them. The scheduler ships a delete only for keys its manager does not hold
(pending or ready) in that tier, so no earlier job still writes them there, and a later
re-store of a key always runs after its delete. With a step loop, promotions of lower-tier hits
are store jobs like any other (``docs/integrating.md``, section 5a). Only the in-load
promotions of a connector without a step loop write outside the store queue (the load thread
writes them into the first tier, in room the manager reserved assuming earlier deletes already
ran): a load with promotions waits for the first tier's queued deletes before it is submitted.
Delete jobs are not reported to the scheduler side.

Built with :meth:`WorkerConnector.from_store`, the worker also records every finished job in
the store's I/O metrics (per-tier bytes, latency), as the store's own ``save`` / ``load`` do.

Nothing raises into the engine's step loop for a job: a job that cannot even be submitted is
reported as failed, and a failed load is reported as missed keys (the engine recomputes them).
The worker connector owns the completions of its :class:`~kvtier.transfer.TransferEngine`: it
drains ``poll_finished`` and ignores results of jobs it did not submit.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Container, Iterable
from typing import Any, Literal

from kvtier.connector.types import JobReport, LoadJob, StepMetadata, StoreJob, WorkerOutput
from kvtier.errors import LifecycleError
from kvtier.manager import StorePlan
from kvtier.transfer import JobResult, TransferEngine

__all__ = ["WorkerConnector"]

log = logging.getLogger("kvtier.connector")


class WorkerConnector:
    """The worker half for rank ``rank``; see the module docstring for the call order."""

    def __init__(self, transfers: TransferEngine, *, rank: int = 0, metrics: Any = None, block_bytes: int = 0) -> None:
        self.transfers = transfers
        self.rank = rank
        self._metrics = metrics  # a kvtier.metrics.StoreMetrics, or None
        self._block_bytes = block_bytes
        # Unsubmitted stores in build order, with the step that built them.
        self._queue: OrderedDict[int, tuple[StoreJob, int]] = OrderedDict()
        # transfer id -> (job id, kind, engine blocks, plan)
        self._inflight: dict[int, tuple[int, Literal["store", "load"], tuple[int, ...], Any]] = {}
        self._transfer_of: dict[int, int] = {}  # connector job id -> transfer id, until reported
        self._failed: list[JobReport] = []
        self._waited: set[int] = set()  # store transfer ids known past their device read
        self._released: set[int] = set()  # of those, the ones reported in WorkerOutput.released
        self._last_step: int | None = None
        # delete transfer id -> whether it deletes from the first tier (promotions wait for it)
        self._deleting: dict[int, bool] = {}
        self.counters: dict[str, int] = {"delete_jobs": 0, "deleted_keys": 0, "failed_delete_jobs": 0}

    @classmethod
    def from_store(cls, store: Any, *, rank: int = 0) -> WorkerConnector:
        """The worker half over an open :class:`kvtier.KVStore`, recording into its metrics."""
        transfers = store.transfers
        if transfers is None:
            raise LifecycleError("the store is not open; use 'await kvtier.open(...)' first")
        return cls(transfers, rank=rank, metrics=store.metrics, block_bytes=store.format.block_bytes)

    # -- introspection ---------------------------------------------------------------------
    @property
    def num_unsubmitted(self) -> int:
        return len(self._queue)

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    @property
    def num_deletes_in_flight(self) -> int:
        return len(self._deleting)

    def unfinished_store_blocks(
        self, *, exclude_step: int | None = None, exclude_requests: Container[str] = ()
    ) -> set[int]:
        """Engine blocks read by store jobs that are unsubmitted or not yet known finished.

        Jobs built in step ``exclude_step`` for a request in ``exclude_requests`` are left out:
        they read blocks that this step's compute is about to fill, by design."""
        blocks: set[int] = set()
        for job, built in self._queue.values():
            if built == exclude_step and job.request_id in exclude_requests:
                continue
            blocks.update(job.block_ids)
        for tid, (_, kind, ids, _) in self._inflight.items():
            if kind == "store" and tid not in self._waited:
                blocks.update(ids)
        return blocks

    # -- step calls ------------------------------------------------------------------------
    def _accept(self, meta: StepMetadata | bytes) -> StepMetadata:
        if not isinstance(meta, StepMetadata):
            meta = StepMetadata.from_bytes(bytes(meta))
        if meta.step != self._last_step:
            self._last_step = meta.step
            if meta.deletes:
                # Every store built before this metadata goes first (their compute is done),
                # then the deletes, then this metadata's stores: build order (module docstring).
                self.flush()
                self._submit_deletes(meta.deletes)
            for job in meta.stores:
                self._queue[job.job_id] = (job, meta.step)
        return meta

    def _submit_deletes(self, deletes: tuple[tuple[int, tuple[bytes, ...]], ...]) -> None:
        if not deletes:
            return
        plan = StorePlan(plan_id=0, keys=(), positions=(), drops=deletes)
        try:
            tid = self.transfers.submit_store(plan, ())
        except Exception as exc:  # the bytes stay behind (capacity, not correctness)
            log.warning("delete of %d keys could not be submitted: %s", sum(len(k) for _, k in deletes), exc)
            self.counters["failed_delete_jobs"] += 1
            return
        self._deleting[tid] = any(t == 0 for t, _ in deletes)
        self.counters["delete_jobs"] += 1
        self.counters["deleted_keys"] += sum(len(ks) for _, ks in deletes)

    def _submit_store(self, job: StoreJob) -> None:
        try:
            tid = self.transfers.submit_store(job.plan, job.block_ids)
        except Exception as exc:  # reported as a failed job; the scheduler releases the keys
            log.warning("store job %d could not be submitted: %s", job.job_id, exc)
            self._failed.append(JobReport(job.job_id, "store", False, error=repr(exc)))
            return
        self._inflight[tid] = (job.job_id, "store", job.block_ids, job.plan)
        self._transfer_of[job.job_id] = tid

    def _submit_load(self, load: LoadJob) -> int | None:
        if self._deleting and load.plan.promote:
            # Promotions are written into the first tier by the load thread, outside the store
            # queue's order. The manager reserved them assuming the queued deletes already ran:
            # they may free the very room a promotion needs, and a delete of a key must not
            # drop its fresh promoted copy. Rare (deletes follow failures): wait for them.
            before = [tid for tid, first_tier in self._deleting.items() if first_tier]
            if before:
                self.transfers.wait(before)
        try:
            tid = self.transfers.submit_load(load.plan, load.block_ids)
        except Exception as exc:
            log.warning("load job %d could not be submitted: %s", load.job_id, exc)
            self._failed.append(JobReport(load.job_id, "load", False, error=repr(exc)))
            return None
        self._inflight[tid] = (load.job_id, "load", load.block_ids, load.plan)
        self._transfer_of[load.job_id] = tid
        return tid

    def _flush_jobs(self, job_ids: Iterable[int], *, whole: bool = False) -> None:
        """Submit ``job_ids`` still unsubmitted (and the stores built before them), then wait
        until they no longer read engine blocks (the device read; ``whole``: the whole job)."""
        flush = set(job_ids)
        if not flush:
            return
        last = None
        for jid in self._queue:
            if jid in flush:
                last = jid
        if last is not None:
            while self._queue:
                jid, (job, _) = self._queue.popitem(last=False)
                self._submit_store(job)
                if jid == last:
                    break
        waiting = [self._transfer_of[j] for j in sorted(flush) if j in self._transfer_of]
        if waiting:
            if whole:
                self.transfers.wait(waiting)
            else:
                # The fence: a store's tier writes (write-back, disk) go on after this; a
                # stalled or failing tier never holds the engine's blocks.
                self.transfers.wait_device(waiting)
            self._waited.update(waiting)

    def handle_preemptions(self, meta: StepMetadata | bytes) -> None:
        """Submit every flushed job still unsubmitted (and those built before it), then wait."""
        meta = self._accept(meta)
        self._flush_jobs(meta.jobs_to_flush)

    def start_load_kv(self, meta: StepMetadata | bytes) -> None:
        """Submit the stores deferred from earlier steps, then this step's loads."""
        meta = self._accept(meta)
        while self._queue:
            jid = next(iter(self._queue))
            job, built = self._queue[jid]
            if built >= meta.step:
                break
            del self._queue[jid]
            self._submit_store(job)
        for load in meta.loads:
            self._submit_load(load)

    def flush(self) -> None:
        """Submit every unsubmitted store now (an idle engine has no compute to protect)."""
        while self._queue:
            _, (job, _) = self._queue.popitem(last=False)
            self._submit_store(job)

    # -- engines without a step loop -------------------------------------------------------
    def run_now(self, meta: StepMetadata | bytes) -> WorkerOutput:
        """Run ``meta`` (from ``build_immediate_meta``) at once: submit every unsubmitted store,
        then its deletes, stores and loads; wait for its loads and ``jobs_to_flush``; return the
        output for the scheduler side. Its stores are still in flight when this returns."""
        if not isinstance(meta, StepMetadata):
            meta = StepMetadata.from_bytes(bytes(meta))
        # Earlier stores first: the manager's plans (evictions, demotions) assume build order.
        self.flush()
        self._submit_deletes(meta.deletes)
        for job in meta.stores:
            if job.job_id not in self._transfer_of:
                self._submit_store(job)
        loads = [tid for tid in map(self._submit_load, meta.loads) if tid is not None]
        if loads:
            self.transfers.wait(loads)
        self._flush_jobs(meta.jobs_to_flush)
        return self.get_finished()

    def wait_for(self, job_ids: Iterable[int]) -> WorkerOutput:
        """Submit ``job_ids`` if still unsubmitted (with the stores built before them), wait for
        them to finish (their keys are then stored), and return the output for the scheduler side."""
        self._flush_jobs(job_ids, whole=True)
        return self.get_finished()

    def get_finished(self, *, block: bool = False, device_only: bool = False) -> WorkerOutput:
        """Jobs finished since the last call, and store jobs that stopped reading engine blocks
        (``WorkerOutput.released``). ``block`` first waits for every submitted job, deletes
        included (deterministic runs and shutdown); with ``device_only`` it waits only until
        every submitted job is done with the engine's blocks (an engine out of blocks that
        fences by reference count). Engines normally poll."""
        if block and (self._inflight or self._deleting):
            if device_only:
                self.transfers.wait_device(list(self._inflight))
            else:
                self.transfers.wait([*self._inflight, *self._deleting])
        reports, self._failed = self._failed, []
        for result in self.transfers.poll_finished():
            entry = self._inflight.pop(result.job_id, None)
            if entry is None:
                if self._deleting.pop(result.job_id, None) is not None and not result.success:
                    log.warning("delete job %d failed: %s", result.job_id, result.error)
                    self.counters["failed_delete_jobs"] += 1
                continue
            jid, kind, _, plan = entry
            self._transfer_of.pop(jid, None)
            self._waited.discard(result.job_id)
            self._released.discard(result.job_id)
            if self._metrics is not None:
                try:
                    if kind == "store":
                        self._metrics.record_store(plan, result, self._block_bytes)
                    else:
                        self._metrics.record_load(plan, result, self._block_bytes)
                except Exception as exc:  # accounting must never fail a job
                    log.debug("metrics: job %d not recorded: %s", jid, exc)
            reports.append(_report(jid, result))
        return WorkerOutput(self.rank, tuple(reports), self._newly_released())

    def _newly_released(self) -> tuple[int, ...]:
        """Store jobs still running whose device read has ended, not reported so far."""
        released: list[int] = []
        for tid, (jid, kind, _, _) in self._inflight.items():
            if kind != "store" or tid in self._released:
                continue
            try:
                self.transfers.wait_device([tid], timeout=0)
            except TimeoutError:
                continue
            self._released.add(tid)
            self._waited.add(tid)
            released.append(jid)
        return tuple(released)


def _report(job_id: int, result: JobResult) -> JobReport:
    return JobReport(
        job_id=job_id,
        kind=result.kind,
        success=result.success,
        nbytes=result.nbytes,
        failed=dict(result.failed),
        missed=result.missed,
        missed_tiers=result.missed_tiers,
        sizes={t: dict(per) for t, per in result.sizes.items()},
        error=result.error,
    )
