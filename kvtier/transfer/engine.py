"""Transfer jobs: the byte movers that execute the manager's plans.

A job is one store (the engine's KV cache -> the first tier, after the plan's evictions and
demotions) or one load (tiers -> the engine's KV cache); its record is a
:class:`kvtier.transfer.jobs.StoreRecord` / :class:`kvtier.transfer.jobs.LoadRecord`. ``submit_*`` returns a job
id at once and never blocks: when ``max_queued_jobs`` jobs of that direction are already
waiting, the new job fails at once (counted in ``rejected_jobs``).

A store job has two phases (see :class:`kvtier.transfer.jobs.Phase`), each on its own thread:

1. the *device read*, on ``kvtier-store``: the engine blocks are copied into the first tier
   (a memory tier, when no earlier job still has tier work and the plan's evictions and
   demotions stay in memory tiers), or else into host staging that the job owns (bounded by
   ``max_staged_bytes``; past it the job fails at once, counted in ``staging_full``);
2. the *tier writes*, on ``kvtier-store-tiers``: evictions, write-back demotions, the write of
   staged blocks into the first tier, and write-through copies to byte tiers. Jobs pass both
   threads in submission order, so plans run in the order the manager built them. The tiers
   thread takes the jobs waiting for it as one group and writes their write-through copies
   together (:mod:`kvtier.transfer.write_group`: one commit for the group). When more than
   ``write_through_backlog`` jobs wait behind that group, a job's write-through copies to
   byte tiers are skipped and reported failed for those tiers (``write_through_deferred``
   counts the blocks): the manager keeps them in the first tier only, and demotes them when
   it evicts them (write-back), so a slow disk sheds copies instead of delaying every store.

``submit_*(..., inline=True)`` (the store facade's ``save`` and ``load``, which wait at once) runs
a job of at most ``inline_max_bytes`` that touches only host memory tiers on the calling thread
when nothing else is queued or running, without the two thread hand-offs
(:mod:`kvtier.transfer.inline`; ``inline_jobs`` counts them).

``wait_device(job_ids)`` is the fence before the engine reuses blocks: it returns once those
jobs no longer read engine blocks, whatever their tier writes are doing. ``wait(job_ids)``
waits for the whole job. A load job (on ``kvtier-load``) touches engine blocks until its end.

On CUDA each job records an event on the engine's compute stream at submit, and its transfer
stream waits for that event before it touches an engine block: a store must not read bytes
still being written, a load must not overwrite a block that queued kernels still read. A job
is reported finished only after an event recorded behind its copies has completed.

``cancel(job_id)`` stops a job: after it returns, the job never reads (store) or writes (load)
an engine block again (a device copy under way is waited for). A store whose device read
already ended is left to finish. ``deadline_s`` bounds a job's life the same way: past it the
job is reported failed (``expired_jobs``, a log line) and its keys are released, but a store
is never reported before its device read ended (or was cancelled before it began). A job that
is reported failed early still runs its evictions and deletes what it wrote, in order, when
its thread reaches it, so the tiers end up matching the manager.

``poll_finished()`` reports finished jobs with their success, bytes and time. A job that
fails is reported as a failed result; nothing raises into the engine.

``close()`` finishes the queued jobs within ``close_timeout_s``; a job still running then (a
tier call that has not returned) is stopped through its cancellation, and the tiers it uses
stay with its thread (``when_stopped``, :mod:`kvtier.transfer.handover`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.backend import Backend, MemoryBackend
from kvtier.devices import one_intra_op_thread
from kvtier.errors import ClosedError, LayoutError, LifecycleError
from kvtier.manager import LoadPlan, StorePlan
from kvtier.transfer.deadlines import DeadlineWatch
from kvtier.transfer.handover import LastOut
from kvtier.transfer.inline import DEFAULT_INLINE_MAX_BYTES, InlineJobs
from kvtier.transfer.jobs import (
    JobRecord,
    JobResult,
    LoadRecord,
    Phase,
    QuietCondition,
    StoreRecord,
    deadline_at,
    failed_result,
)
from kvtier.transfer.jobs_now import JobsNow
from kvtier.transfer.layout import KVLayout
from kvtier.transfer.load_mover import LoadMover
from kvtier.transfer.movers import StoreMover
from kvtier.transfer.plan_writes import TierWork

__all__ = ["TransferEngine", "JobResult"]

log = logging.getLogger("kvtier.transfer")


class TransferEngine:
    """Runs store and load jobs between ``layout``'s KV cache and ``backends`` (tier order)."""

    def __init__(
        self,
        layout: KVLayout,
        backends: Sequence[Backend],
        *,
        staging_blocks: int = 32,
        max_queued_jobs: int = 4096,
        deadline_s: float | None = None,
        max_staged_bytes: int | None = None,
        write_through_backlog: int = 16,
        close_timeout_s: float = 30.0,
        inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES,
    ) -> None:
        if staging_blocks < 1:
            raise LayoutError(f"staging_blocks: expected >= 1, got {staging_blocks}")
        if not isinstance(inline_max_bytes, int) or inline_max_bytes < 0:
            raise LayoutError(f"inline_max_bytes: expected an integer >= 0, got {inline_max_bytes!r}")
        if deadline_s is not None and deadline_s <= 0:
            raise LayoutError(f"deadline_s: expected a positive number of seconds or None, got {deadline_s}")
        self.layout = layout
        self.backends = list(backends)
        self.deadline_s = deadline_s
        #: Store jobs waiting for the tiers thread (behind the one it writes) past which a job's
        #: write-through copies to byte tiers are skipped (counted in ``write_through_deferred``): those blocks fall back to
        #: write-back demotion when the first tier evicts them, so a slow disk never backs up
        #: the stores behind it.
        self.write_through_backlog = write_through_backlog
        #: Seconds ``close()`` waits for the queued jobs before it stops the ones still running.
        self.close_timeout_s = close_timeout_s
        self._cuda = layout.device.type == "cuda"
        self._staging_blocks = staging_blocks
        self._max_queued = max_queued_jobs
        self._max_staged = max_staged_bytes if max_staged_bytes is not None else 4 * staging_blocks * layout.block_bytes
        self._staging: dict[str, torch.Tensor] = {}
        self._ids = itertools.count(1)
        self._jobs: dict[int, JobRecord] = {}
        self._finished: list[JobResult] = []
        self._lock = threading.Lock()
        self._active = 0  # jobs queued or on a thread, late clean-ups included
        self._idle = QuietCondition(self._lock)
        self._inline_running = False  # a job runs on a submitting thread (kvtier.transfer.inline)
        self._inline_done = QuietCondition(self._lock)
        self._queued = {"store": 0, "load": 0}
        self._tier_jobs = 0  # store jobs handed to the tiers thread and not through it yet
        self._staged_bytes = 0
        self._store_q: queue.SimpleQueue[StoreRecord | None] = queue.SimpleQueue()
        self._tiers_q: queue.SimpleQueue[TierWork | None] = queue.SimpleQueue()
        self._load_q: queue.SimpleQueue[LoadRecord | None] = queue.SimpleQueue()
        self._streams: dict[str, Any] = {}
        if self._cuda:
            self._streams = {d: torch.cuda.Stream(device=layout.device) for d in ("store", "tiers", "load")}
        self._wake = threading.Event()  # set at close
        self._kick = threading.Event()  # set at submit, and at close
        self._closed = False
        self.counters = {
            "jobs": 0,
            "failed_jobs": 0,
            "bytes_stored": 0,
            "bytes_loaded": 0,
            "rejected_jobs": 0,
            "staging_full": 0,
            "staged_jobs": 0,
            "cancelled_jobs": 0,
            "expired_jobs": 0,
            "read_errors": 0,  # a tier's read_blocks raised in a load: its keys were misses
            "write_through_deferred": 0,
            "inline_jobs": 0,
            # blocks a shared tier's eviction forgot here without deleting (the server evicts)
            "shared_forgotten": 0,
        }
        self._stores = StoreMover(self)
        self._loads = LoadMover(self)
        self._inline = InlineJobs(self, self._stores, self._loads, inline_max_bytes)
        self._now = JobsNow(self, self._inline)
        self._deadlines = DeadlineWatch(self)
        targets = [
            (self._stores.run_device, "kvtier-store"),
            (self._stores.run_tiers, "kvtier-store-tiers"),
            (self._loads.run, "kvtier-load"),
        ]
        if deadline_s is not None:
            targets.append((self._deadlines.run, "kvtier-deadline"))
        # Each on one intra-op thread: a torch op there never starts an OpenMP team of its own
        # (see kvtier.transfer.copies); a job's host copy is split over the copy threads instead.
        self._last_out = LastOut(3)  # the job threads (targets[:3]): what a close leaves them
        self._threads = [
            threading.Thread(
                target=_on_one_intra_op_thread, args=(fn, self._last_out if i < 3 else None), name=name, daemon=True
            )
            for i, (fn, name) in enumerate(targets)
        ]
        for t in self._threads:
            t.start()

    # -- submission ------------------------------------------------------------------------
    def submit_store(
        self, plan: StorePlan, block_ids: Sequence[int], *, durable: bool = False, inline: bool = False, checked: bool = False
    ) -> int:
        """Queue ``plan``; ``block_ids`` are the engine ids of ``plan.keys`` (``n`` per key).
        ``durable``: the job's write-through copies are never deferred, however far behind the
        tier writes are. ``inline``: a small job in host memory runs on this thread, and has
        ended when this returns (:mod:`kvtier.transfer.inline`); for a caller about to wait.
        ``checked``: ``block_ids`` is a list the caller took from ``layout.check_block_ids``
        (the store facade's own jobs), so it is not checked again."""
        ids = block_ids if checked else self.layout.check_block_ids(block_ids, len(plan.keys))
        rec = StoreRecord(next(self._ids), plan, tuple(ids), deadline=deadline_at(self.deadline_s), durable=durable)
        return self._submit(rec, inline)

    def store_now(self, plan: StorePlan, block_ids: Sequence[int]) -> JobResult | None:
        """A plain store run here and now, as ``submit_store(..., inline=True, checked=True)``
        then ``take`` would, with no job record; ``None``, having changed nothing, for any other
        job (:mod:`kvtier.transfer.jobs_now`)."""
        return self._now.store(plan, block_ids)

    def load_now(self, plan: LoadPlan, block_ids: Sequence[int]) -> JobResult | None:
        """:meth:`store_now` for a plain load."""
        return self._now.load(plan, block_ids)

    def submit_load(self, plan: LoadPlan, block_ids: Sequence[int], *, inline: bool = False, checked: bool = False) -> int:
        """Queue ``plan``; ``block_ids`` are the engine ids to fill (``n`` per key); ``inline``
        and ``checked`` as for :meth:`submit_store`."""
        ids = block_ids if checked else self.layout.check_block_ids(block_ids, len(plan.keys))
        rec = LoadRecord(next(self._ids), plan, tuple(ids), deadline=deadline_at(self.deadline_s))
        return self._submit(rec, inline)

    def _submit(self, rec: JobRecord, inline: bool = False) -> int:
        if self._closed:
            raise ClosedError("the transfer engine is closed")
        if self._cuda:
            # The engine's compute stream as it is now: the job's copies wait for it.
            rec.compute_event = torch.cuda.Event()
            rec.compute_event.record(torch.cuda.current_stream(self.layout.device))
        kind = rec.kind
        with self._lock:
            self._jobs[rec.job_id] = rec
            # Inline only when nothing else is queued or running: it cannot overtake a job.
            inline = inline and self._active == 0 and not self._inline_running and self._inline.eligible(rec)
            full = not inline and self._queued[kind] >= self._max_queued
            if inline:
                self._inline_running = True
                self._active += 1  # given back by the job's end, as a thread would
                self.counters["inline_jobs"] += 1
            elif not (full and kind == "load"):
                self._queued[kind] += 1  # given back when a thread takes the job (see _take)
                self._active += 1  # given back when a thread is done with it (see _retire)
        if full:
            log.warning("transfer job %d (%s) rejected: %d jobs already queued", rec.job_id, kind, self._max_queued)
            self._fail_early(rec, "the transfer queue is full", "rejected_jobs")
            if isinstance(rec, LoadRecord):
                return rec.job_id  # nothing to undo: it never ran
        if inline:
            try:
                self._inline.run(rec)
            finally:
                with self._lock:
                    self._inline_running = False
                    self._inline_done.notify_all()
            return rec.job_id
        if rec.deadline is not None and self._deadlines.needs_kick(rec.deadline):
            self._kick.set()  # the watchdog learns of a deadline before its next check
        if isinstance(rec, StoreRecord):
            self._store_q.put(rec)  # a rejected store still runs its evictions, in order
        else:
            assert isinstance(rec, LoadRecord)
            self._load_q.put(rec)
        return rec.job_id

    # -- completion ------------------------------------------------------------------------
    def _records(self, job_ids: Sequence[int]) -> list[JobRecord]:
        with self._lock:
            return [r for r in (self._jobs.get(j) for j in job_ids) if r is not None]

    def wait(self, job_ids: Sequence[int], timeout: float | None = None) -> list[JobResult]:
        """Block until every job in ``job_ids`` has finished; return their results.

        Results stay queued for ``poll_finished`` as well. Unknown ids are ignored (already
        reported and forgotten)."""
        results: list[JobResult] = []
        for rec in self._records(job_ids):
            if not rec.done.wait(timeout):
                raise TimeoutError(f"transfer job {rec.job_id} did not finish within {timeout} s")
            assert rec.result is not None
            results.append(rec.result)
        return results

    def wait_device(self, job_ids: Sequence[int], timeout: float | None = None) -> None:
        """The fence: block until no job in ``job_ids`` reads or writes engine blocks any more
        (a store's device read has ended; its tier writes may go on). Unknown ids are ignored."""
        for rec in self._records(job_ids):
            if not rec.device_done.wait(timeout):
                raise TimeoutError(f"transfer job {rec.job_id} still used engine blocks after {timeout} s")

    async def wait_async(self, job_id: int) -> JobResult:
        """Await one job from a coroutine without blocking the event loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[JobResult] = loop.create_future()
        with self._lock:
            rec = self._jobs.get(job_id)
            if rec is None:
                raise LifecycleError(f"unknown transfer job {job_id}")
            if rec.result is None:
                rec.waiters.append((loop, fut))
            else:
                fut.set_result(rec.result)
        return await fut

    def result(self, job_id: int) -> JobResult | None:
        """The result of a known job if it has finished, else ``None`` (never blocks)."""
        with self._lock:
            rec = self._jobs.get(job_id)
            return rec.result if rec is not None else None

    def poll_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call; their ids are then forgotten."""
        with self._lock:
            done, self._finished = self._finished, []
            for r in done:
                self._jobs.pop(r.job_id, None)
        return done

    def take(self, job_id: int) -> JobResult | None:
        """Job ``job_id``'s result once it has finished (an inline job, at submit), then forgotten; else ``None``."""
        with self._lock:
            rec = self._jobs.get(job_id)
            if rec is None or rec.result is None:
                return None
            del self._jobs[job_id]
            done = self._finished
            if done and done[-1] is rec.result:  # (the job just reported: an inline one)
                done.pop()
            else:
                self._finished = [r for r in done if r is not rec.result]
            return rec.result

    def forget(self, job_ids: Sequence[int]) -> None:
        """Drop finished jobs whose results the caller already has (from ``wait`` or
        ``wait_async``), so ``poll_finished`` does not report them to anyone else."""
        for job_id in job_ids:
            self.take(job_id)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until no job is queued or running on any thread, including the clean-up of
        jobs already reported (a stopped job deletes what it wrote when its thread gets to it)."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._active == 0, timeout):
                raise TimeoutError(f"{self._active} transfer jobs still running after {timeout} s")

    def _retire(self) -> None:
        with self._idle:
            self._active -= 1
            if self._active == 0:
                self._idle.notify_all()

    def pending_jobs(self) -> int:
        with self._lock:
            return sum(1 for j in self._jobs.values() if j.result is None)

    def cancel(self, job_id: int) -> bool:
        """Stop job ``job_id``; return whether it was stopped (``False``: unknown, finished, or
        a store whose device read already ended, which is left to finish).

        After this returns the job never touches an engine block again; a copy under way is
        waited for. A stopped job is reported failed at once (``error`` names the cause)."""
        with self._lock:
            rec = self._jobs.get(job_id)
        return rec is not None and self._stop(rec, "cancelled", allow_tier_phase=False, counter="cancelled_jobs")

    def _stop(self, rec: JobRecord, reason: str, *, allow_tier_phase: bool, counter: str) -> bool:
        with rec.device_lock:  # waits for a device copy under way
            if rec.result is not None:
                return False
            if isinstance(rec, StoreRecord) and rec.phase >= Phase.TIERS and not allow_tier_phase:
                return False
            rec.cancelled = True
            if rec.phase == Phase.QUEUED or isinstance(rec, LoadRecord):
                rec.device_done.set()  # it never touches an engine block again
        return self._fail_early(rec, reason, counter)

    def _fail_early(self, rec: JobRecord, reason: str, counter: str | None = None) -> bool:
        """Report ``rec`` failed now; its thread cleans up when it gets to it."""
        return self._finish(rec, failed_result(rec, reason), counter)

    def close(self, timeout: float | None = None) -> None:
        """Finish queued jobs, then stop the worker threads; within ``timeout`` seconds
        (``close_timeout_s`` unless given). A job still running then is stopped (reported
        failed, never touching an engine block again) and its thread left to end on its own;
        see :meth:`when_stopped` for what it holds."""
        if self._closed:
            return
        self._closed = True
        self._store_q.put(None)  # the store thread passes it on to the tiers thread
        self._load_q.put(None)
        limit = self.close_timeout_s if timeout is None else timeout
        end = time.monotonic() + limit
        for t in self._threads[:3]:
            t.join(max(0.0, end - time.monotonic()))
        self._wake.set()
        self._kick.set()
        for t in self._threads[3:]:  # the deadline watchdog: it ends once woken, between checks
            t.join(max(0.1, end - time.monotonic()))
        if not self.stopped:
            with self._lock:
                running = [r for r in self._jobs.values() if r.result is None]
            for rec in running:
                self._stop(rec, "closed while it ran", allow_tier_phase=True, counter="cancelled_jobs")
            alive = [t.name for t in self._threads[:3] if t.is_alive()]
            log.warning(
                "transfer threads %s still run after %.3g s at close (a tier call has not returned); %d jobs stopped, "
                "the tiers are left to those threads",
                alive,
                limit,
                len(running),
            )

    def when_stopped(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` (free what the jobs use: tiers, staging) once every job thread has ended:
        now if they have (returns ``True``), else on the last one to end (``False``)."""
        return self._last_out.when_all_ended(fn)

    @property
    def stopped(self) -> bool:
        """Closed, and the threads that run jobs have ended (nothing writes the tiers any more)."""
        return self._closed and not any(t.is_alive() for t in self._threads[:3])

    # -- the end of a job ------------------------------------------------------------------
    def _finish(self, rec: JobRecord, result: JobResult, counter: str | None = None, *, retire: bool = False) -> bool:
        """Record ``result`` unless the job already has one (then return ``False``); count it
        in ``counter`` too, before anyone waiting on the job is woken. ``retire``: nothing is
        left to clean up, so the job is given back (:meth:`_retire`) with its result: a waiter
        it wakes finds the engine idle and may run its next job inline."""
        with self._lock:
            if rec.result is not None:
                return False
            if retire:
                self._active -= 1
                if self._active == 0:
                    self._idle.notify_all()
            if counter is not None:
                self.counters[counter] += 1
            rec.result = result
            rec.phase = Phase.DONE
            self.counters["jobs"] += 1
            if not result.success:
                self.counters["failed_jobs"] += 1
            self.counters["bytes_stored" if rec.kind == "store" else "bytes_loaded"] += result.nbytes
            self._finished.append(result)
            waiters, rec.waiters = rec.waiters, []
        rec.device_done.set()
        rec.done.set()
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut, result)
            except RuntimeError:  # the waiter's loop is closed: nobody is left to tell
                log.debug("transfer job %d: the waiting event loop is closed", rec.job_id)
        return True

    def _take(self, kind: str) -> None:
        with self._lock:
            self._queued[kind] -= 1

    def _after_inline(self) -> None:
        """A transfer thread about to run a job waits for the inline job running, if any."""
        with self._lock:
            while self._inline_running:
                self._inline_done.wait()

    def expire_overdue(self, now: float | None = None) -> int:
        """Fail the jobs whose deadline has passed (the watchdog thread calls this); return how
        many. A store still reading engine blocks is waited for, never reported before."""
        return self._deadlines.expire_overdue(now)

    def _on_stream(self, direction: str) -> contextlib.AbstractContextManager[Any]:
        """Where a mover thread queues its copies: its own CUDA stream, or nothing on CPU."""
        return torch.cuda.stream(self._streams[direction]) if self._cuda else contextlib.nullcontext()

    def _is_memory(self, tier: int) -> bool:
        return isinstance(self.backends[tier], MemoryBackend)

    def _wait_compute(self, rec: JobRecord) -> None:
        if self._cuda and rec.compute_event is not None:
            torch.cuda.current_stream(self.layout.device).wait_event(rec.compute_event)

    def _sync(self) -> None:
        """Block until the copies queued on this thread's stream have completed."""
        if self._cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.layout.device))
            done.synchronize()

    def _staging_rows(self, direction: str) -> torch.Tensor:
        buf = self._staging.get(direction)
        if buf is None:
            buf = torch.empty(
                (self._staging_blocks, self.layout.block_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
            self._staging[direction] = buf
        return buf


def _on_one_intra_op_thread(fn: Callable[[], None], last_out: LastOut | None) -> None:
    try:
        with one_intra_op_thread():
            fn()
    finally:
        if last_out is not None:
            last_out.ended()


def _resolve(fut: asyncio.Future[JobResult], result: JobResult) -> None:
    if not fut.done():
        fut.set_result(result)
