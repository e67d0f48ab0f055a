"""Transfer jobs: the byte movers that execute the manager's plans.

A job is one store (the engine's KV cache -> the first tier, after the plan's evictions and
demotions) or one load (tiers -> the engine's KV cache); its record is a
:class:`kvtier.jobs.StoreRecord` / :class:`kvtier.jobs.LoadRecord`. ``submit_*`` returns a job
id at once and never blocks: when ``max_queued_jobs`` jobs of that direction are already
waiting, the new job fails at once (counted in ``rejected_jobs``).

A store job has two phases (see :class:`kvtier.jobs.Phase`), each on its own thread:

1. the *device read*, on ``kvtier-store``: the engine blocks are copied into the first tier
   (a memory tier, when no earlier job still has tier work and the plan's evictions and
   demotions stay in memory tiers), or else into host staging that the job owns (bounded by
   ``max_staged_bytes``; past it the job fails at once, counted in ``staging_full``);
2. the *tier writes*, on ``kvtier-store-tiers``: evictions, write-back demotions, the write of
   staged blocks into the first tier, and write-through copies to byte tiers. Jobs pass both
   threads in submission order, so plans run in the order the manager built them.

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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.backend import Backend, MemoryBackend
from kvtier.errors import ClosedError, LayoutError, LifecycleError
from kvtier.jobs import JobRecord, JobResult, LoadRecord, Phase, StoreRecord, deadline_at
from kvtier.layout import KVLayout
from kvtier.manager import LoadPlan, StorePlan

__all__ = ["TransferEngine", "JobResult"]

log = logging.getLogger("kvtier.transfer")

_Failed = dict[int, list[bytes]]
_Sizes = dict[int, dict[bytes, int]]


@dataclass(slots=True, eq=False)
class _TierWork:
    """A store job's phase 2, handed from the device thread to the tiers thread."""

    rec: StoreRecord
    mode: str  # "staged" | "rest" (byte write-through after a direct device phase) | "degraded" | "cleanup"
    start: float
    staging: torch.Tensor | None = None
    staged_bytes: int = 0
    failed: _Failed = field(default_factory=dict)
    sizes: _Sizes = field(default_factory=dict)
    nbytes: int = 0
    error: str | None = None


class _Expired(Exception):
    """The job was reported failed while its tier work ran: stop and clean up."""


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
    ) -> None:
        if staging_blocks < 1:
            raise LayoutError(f"staging_blocks: expected >= 1, got {staging_blocks}")
        if deadline_s is not None and deadline_s <= 0:
            raise LayoutError(f"deadline_s: expected a positive number of seconds or None, got {deadline_s}")
        self.layout = layout
        self.backends = list(backends)
        self.deadline_s = deadline_s
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
        self._idle = threading.Condition(self._lock)
        self._queued = {"store": 0, "load": 0}
        self._tier_jobs = 0  # store jobs handed to the tiers thread and not through it yet
        self._staged_bytes = 0
        self._store_q: queue.SimpleQueue[StoreRecord | None] = queue.SimpleQueue()
        self._tiers_q: queue.SimpleQueue[_TierWork | None] = queue.SimpleQueue()
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
        }
        targets = [
            (self._run_store, "kvtier-store"),
            (self._run_tiers, "kvtier-store-tiers"),
            (self._run_load, "kvtier-load"),
        ]
        if deadline_s is not None:
            targets.append((self._watch_deadlines, "kvtier-deadline"))
        self._threads = [threading.Thread(target=fn, name=name, daemon=True) for fn, name in targets]
        for t in self._threads:
            t.start()

    # -- submission ------------------------------------------------------------------------
    def submit_store(self, plan: StorePlan, block_ids: Sequence[int]) -> int:
        """Queue ``plan``; ``block_ids`` are the engine ids of ``plan.keys`` (``n`` per key)."""
        ids = self.layout.check_block_ids(block_ids, len(plan.keys))
        rec = StoreRecord(next(self._ids), plan, tuple(ids), deadline=deadline_at(self.deadline_s))
        return self._submit(rec)

    def submit_load(self, plan: LoadPlan, block_ids: Sequence[int]) -> int:
        """Queue ``plan``; ``block_ids`` are the engine ids to fill (``n`` per key)."""
        ids = self.layout.check_block_ids(block_ids, len(plan.keys))
        rec = LoadRecord(next(self._ids), plan, tuple(ids), deadline=deadline_at(self.deadline_s))
        return self._submit(rec)

    def _submit(self, rec: JobRecord) -> int:
        if self._closed:
            raise ClosedError("the transfer engine is closed")
        if self._cuda:
            # The engine's compute stream as it is now: the job's copies wait for it.
            rec.compute_event = torch.cuda.Event()
            rec.compute_event.record(torch.cuda.current_stream(self.layout.device))
        kind = rec.kind
        with self._lock:
            self._jobs[rec.job_id] = rec
            full = self._queued[kind] >= self._max_queued
            if not (full and kind == "load"):
                self._queued[kind] += 1  # given back when a thread takes the job (see _take)
                self._active += 1  # given back when a thread is done with it (see _retire)
        if full:
            log.warning("transfer job %d (%s) rejected: %d jobs already queued", rec.job_id, kind, self._max_queued)
            self._fail_early(rec, "the transfer queue is full", "rejected_jobs")
            if isinstance(rec, LoadRecord):
                return rec.job_id  # nothing to undo: it never ran
        if rec.deadline is not None:
            self._kick.set()  # the watchdog learns of the new deadline
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

    def forget(self, job_ids: Sequence[int]) -> None:
        """Drop finished jobs whose results the caller already has (from ``wait`` or
        ``wait_async``), so ``poll_finished`` does not report them to anyone else."""
        drop = set(job_ids)
        with self._lock:
            for jid in drop:
                rec = self._jobs.get(jid)
                if rec is not None and rec.result is not None:
                    del self._jobs[jid]
            self._finished = [r for r in self._finished if r.job_id not in drop]

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
        if isinstance(rec, StoreRecord):
            plan = rec.store_plan
            failed: _Failed = {plan.tier: list(plan.keys)}
            for tier, keys in plan.write_through:
                failed.setdefault(tier, []).extend(keys)
            for d in plan.demotions:
                failed.setdefault(d.dst, []).extend(d.keys)
            result = JobResult(
                rec.job_id,
                "store",
                False,
                plan.keys,
                failed={t: tuple(ks) for t, ks in failed.items() if ks},
                error=reason,
            )
        else:
            result = JobResult(rec.job_id, rec.kind, False, tuple(rec.plan.keys), error=reason)
        return self._finish(rec, result, counter)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued jobs, then stop the worker threads."""
        if self._closed:
            return
        self._closed = True
        self._store_q.put(None)  # the store thread passes it on to the tiers thread
        self._load_q.put(None)
        for t in self._threads[:3]:
            t.join(timeout)
        self._wake.set()
        self._kick.set()

    # -- the end of a job ------------------------------------------------------------------
    def _finish(self, rec: JobRecord, result: JobResult, counter: str | None = None) -> bool:
        """Record ``result`` unless the job already has one (then return ``False``); count it
        in ``counter`` too, before anyone waiting on the job is woken."""
        with self._lock:
            if rec.result is not None:
                return False
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

    def expire_overdue(self, now: float | None = None) -> int:
        """Fail the jobs whose deadline has passed (the watchdog thread calls this); return how
        many. A store still reading engine blocks is waited for, never reported before."""
        now = time.monotonic() if now is None else now
        overdue: list[JobRecord] = []
        with self._lock:
            for rec in self._jobs.values():
                if rec.result is None and rec.deadline is not None:
                    if rec.deadline > now:
                        break  # deadlines follow submission order
                    overdue.append(rec)
        count = 0
        for rec in overdue:
            if self._stop(
                rec, f"deadline of {self.deadline_s} s passed", allow_tier_phase=True, counter="expired_jobs"
            ):
                count += 1
                log.warning(
                    "transfer job %d (%s, %d keys) passed its %.3g s deadline: failed, its keys released",
                    rec.job_id,
                    rec.kind,
                    len(rec.plan.keys),
                    self.deadline_s,
                )
        return count

    def _watch_deadlines(self) -> None:
        while not self._wake.is_set():
            try:
                self.expire_overdue()
            except Exception as exc:  # the watchdog must survive anything
                log.warning("deadline check failed: %s", exc, exc_info=True)
            with self._lock:
                pending = [r.deadline for r in self._jobs.values() if r.result is None and r.deadline is not None]
            wait = 1.0 if not pending else min(pending) - time.monotonic()
            self._kick.wait(min(1.0, max(0.001, wait)))
            self._kick.clear()

    # -- store: the device phase -----------------------------------------------------------
    def _run_store(self) -> None:
        while True:
            rec = self._store_q.get()
            if rec is None:
                self._tiers_q.put(None)
                return
            self._take("store")
            try:
                if self._cuda:
                    with torch.cuda.stream(self._streams["store"]):
                        work = self._device_phase(rec)
                else:
                    work = self._device_phase(rec)
            except BaseException as exc:  # never reached in practice; the thread must survive
                log.warning("store job %d: device phase failed: %s", rec.job_id, exc, exc_info=True)
                rec.device_done.set()
                work = _TierWork(rec, "degraded", time.perf_counter(), error=repr(exc))
            if work is None:
                self._retire()
            else:
                with self._lock:
                    self._tier_jobs += 1
                self._tiers_q.put(work)

    def _is_memory(self, tier: int) -> bool:
        return isinstance(self.backends[tier], MemoryBackend)

    def _device_phase(self, rec: StoreRecord) -> _TierWork | None:
        """Read the engine blocks; return the tier work left, or ``None`` when the job is done."""
        plan = rec.store_plan
        start = time.perf_counter()
        try:
            if rec.result is not None:
                raise _Expired  # stopped before it began
            with self._lock:
                tiers_idle = self._tier_jobs == 0
            direct = (
                tiers_idle
                and self._is_memory(plan.tier)
                and all(self._is_memory(t) for t, _ in plan.drops)
                and all(self._is_memory(d.src) and self._is_memory(d.dst) for d in plan.demotions)
            )
            work = self._store_direct(rec, start) if direct else self._store_staged(rec, start)
        except _Expired:
            work = _TierWork(rec, "cleanup", start)
        finally:
            rec.device_done.set()  # the engine blocks were read, or never will be
        if work.mode == "done":
            if self._finish_store(work):
                return None
            return _TierWork(rec, "cleanup", start)  # reported failed meanwhile: undo, in order
        return work

    def _read_engine_blocks(self, rec: StoreRecord, read: Callable[[], object]) -> None:
        """Run ``read`` (the copy out of the engine blocks) after the compute stream as it was at
        submit, and wait for it; raise ``_Expired`` instead if the job was stopped."""
        with rec.device_lock:
            if rec.cancelled or rec.result is not None:
                raise _Expired
            rec.phase = Phase.DEVICE
            try:
                self._wait_compute(rec)
                read()
                self._sync()
            finally:
                rec.phase = Phase.TIERS
                rec.device_done.set()

    def _wait_compute(self, rec: JobRecord) -> None:
        if self._cuda and rec.compute_event is not None:
            torch.cuda.current_stream(self.layout.device).wait_event(rec.compute_event)

    def _sync(self) -> None:
        """Block until the copies queued on this thread's stream have completed."""
        if self._cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.layout.device))
            done.synchronize()

    def _store_direct(self, rec: StoreRecord, start: float) -> _TierWork:
        """Everything in memory tiers, on this thread; byte write-through is left to phase 2."""
        plan = rec.store_plan
        work = _TierWork(rec, "done", start)
        staging = self._staging_rows("store")
        self._drops_and_demotions(plan, staging, work, check=True)
        target = self.backends[plan.tier]
        assert isinstance(target, MemoryBackend)
        try:
            if plan.keys:
                slots = target.reserve(plan.keys)
                if slots is None:
                    raise LifecycleError(
                        f"tier {plan.tier}: no free slots for {len(plan.keys)} blocks; the manager's accounting is off"
                    )
                ids = list(rec.block_ids)
                self._read_engine_blocks(rec, lambda: self.layout.gather(ids, target.pool, slots, non_blocking=True))
                work.nbytes = len(slots) * self.layout.block_bytes
            byte_tiers = []
            for tier, keys in plan.write_through:
                if self._is_memory(tier):
                    self._check_alive(rec)
                    self._write_from(target, tier, keys, staging, work.failed, work.sizes)
                else:
                    byte_tiers.append(tier)
        except _Expired:
            raise
        except Exception as exc:
            log.warning("store job %d failed: %s", rec.job_id, exc, exc_info=True)
            self._delete_new(plan)
            work.error = repr(exc)
            return work
        if byte_tiers:
            work.mode = "rest"
        return work

    def _store_staged(self, rec: StoreRecord, start: float) -> _TierWork:
        """Copy the engine blocks into staging the job owns; the tiers thread does the rest."""
        plan = rec.store_plan
        if not plan.keys:
            return _TierWork(rec, "staged", start)
        need = len(plan.keys) * self.layout.block_bytes
        with self._lock:
            room = self._staged_bytes == 0 or self._staged_bytes + need <= self._max_staged
            if room:
                self._staged_bytes += need
                self.counters["staged_jobs"] += 1
            else:
                self.counters["staging_full"] += 1
        if not room:
            log.warning(
                "store job %d: %d bytes of staging in use, its %d keys are not stored",
                rec.job_id,
                self._staged_bytes,
                len(plan.keys),
            )
            return _TierWork(rec, "degraded", start, error="the store staging is full")
        work = _TierWork(rec, "staged", start, staged_bytes=need)
        try:
            target = self.backends[plan.tier]
            device = target.pool.device if isinstance(target, MemoryBackend) else torch.device("cpu")
            pin = device.type == "cpu" and self._cuda
            staging = work.staging = torch.empty(
                (len(plan.keys), self.layout.block_bytes), dtype=torch.uint8, device=device, pin_memory=pin
            )
            ids = list(rec.block_ids)
            self._read_engine_blocks(
                rec, lambda: self.layout.gather(ids, staging, range(len(plan.keys)), non_blocking=True)
            )
        except _Expired:
            work.mode, work.staging = "cleanup", None  # the tiers thread gives the staging budget back
        except Exception as exc:
            log.warning("store job %d: reading its blocks failed: %s", rec.job_id, exc, exc_info=True)
            work.mode, work.error, work.staging = "degraded", repr(exc), None
        return work

    # -- store: the tier phase -------------------------------------------------------------
    def _run_tiers(self) -> None:
        while True:
            work = self._tiers_q.get()
            if work is None:
                return
            try:
                if self._cuda:
                    with torch.cuda.stream(self._streams["tiers"]):
                        self._tier_phase(work)
                else:
                    self._tier_phase(work)
            except BaseException as exc:  # the thread must survive anything
                log.warning("store job %d: tier phase failed: %s", work.rec.job_id, exc, exc_info=True)
                self._finish(
                    work.rec, JobResult(work.rec.job_id, "store", False, work.rec.store_plan.keys, error=repr(exc))
                )
            finally:
                self._retire()
                with self._lock:
                    self._tier_jobs -= 1
                    self._staged_bytes -= work.staged_bytes
                work.staging = None

    def _tier_phase(self, work: _TierWork) -> None:
        rec, plan = work.rec, work.rec.store_plan
        staging = self._staging_rows("tiers")
        try:
            if work.mode == "cleanup" or rec.result is not None:
                raise _Expired
            if work.mode in ("staged", "degraded"):
                self._drops_and_demotions(plan, staging, work, check=True)
            if work.mode == "staged" and plan.keys:
                assert work.staging is not None
                self._write_staged(work)
            elif work.mode == "rest":
                source = self.backends[plan.tier]
                assert isinstance(source, MemoryBackend)
                for tier, keys in plan.write_through:
                    if not self._is_memory(tier):
                        self._check_alive(rec)
                        self._write_from(source, tier, keys, staging, work.failed, work.sizes)
            self._check_alive(rec)
        except _Expired:
            self._cleanup(plan)
            return
        except Exception as exc:
            log.warning("store job %d failed: %s", rec.job_id, exc, exc_info=True)
            self._delete_new(plan)
            work.error = repr(exc)
        if work.mode == "degraded":
            self._delete_new(plan)
        if not self._finish_store(work):
            self._cleanup(plan)  # reported failed while it ran: undo what it wrote

    @staticmethod
    def _check_alive(rec: JobRecord) -> None:
        if rec.result is not None:
            raise _Expired

    def _write_staged(self, work: _TierWork) -> None:
        rec, plan = work.rec, work.rec.store_plan
        assert work.staging is not None
        rows = [work.staging[i] for i in range(len(plan.keys))]
        target = self.backends[plan.tier]
        if isinstance(target, MemoryBackend):
            slots = target.reserve(plan.keys)
            if slots is None:
                raise LifecycleError(
                    f"tier {plan.tier}: no free slots for {len(plan.keys)} blocks; the manager's accounting is off"
                )
            target.pool.index_copy_(0, torch.tensor(slots, dtype=torch.long, device=target.pool.device), work.staging)
            self._sync()
            work.nbytes = len(slots) * self.layout.block_bytes
        else:
            got = target.write_blocks(list(plan.keys), rows)
            self._note_sizes(plan.tier, plan.keys, got, work.failed, work.sizes)
            work.nbytes = sum(self.layout.block_bytes for s in got if s is not None)
        for tier, keys in plan.write_through:
            self._check_alive(rec)
            pos = {k: i for i, k in enumerate(plan.keys)}
            got = self.backends[tier].write_blocks(list(keys), [rows[pos[k]] for k in keys])
            self._note_sizes(tier, keys, got, work.failed, work.sizes)

    @staticmethod
    def _note_sizes(
        tier: int, keys: Sequence[bytes], got: Sequence[int | None], failed: _Failed, sizes: _Sizes
    ) -> None:
        for k, size in zip(keys, got):
            if size is None:
                failed.setdefault(tier, []).append(k)
            else:
                sizes.setdefault(tier, {})[k] = size

    def _finish_store(self, work: _TierWork) -> bool:
        plan = work.rec.store_plan
        ok = work.error is None and not work.failed.get(plan.tier)
        return self._finish(
            work.rec,
            JobResult(
                work.rec.job_id,
                "store",
                ok,
                plan.keys,
                nbytes=work.nbytes if work.error is None else 0,
                seconds=time.perf_counter() - work.start,
                failed={t: tuple(ks) for t, ks in work.failed.items() if ks},
                sizes=work.sizes,
                error=work.error,
            ),
        )

    def _delete(self, tier: int, keys: Sequence[bytes], what: str) -> None:
        if not keys:
            return
        try:
            self.backends[tier].delete_blocks(keys)
        except Exception as exc:  # an orphan costs room, never correctness: go on
            log.warning("%s: deleting %d blocks from tier %d failed: %s", what, len(keys), tier, exc)

    def _delete_new(self, plan: StorePlan) -> None:
        """Release the plan's new blocks (the manager releases their reservations to match)."""
        for tier, keys in ((plan.tier, plan.keys), *plan.write_through):
            self._delete(tier, keys, "cleanup of a failed store")

    def _cleanup(self, plan: StorePlan) -> None:
        """A job reported failed before it ended: run its evictions, and delete everything it
        may have written (the manager released all of it)."""
        for tier, keys in plan.drops:
            self._delete(tier, keys, "eviction")
        for d in plan.demotions:
            self._delete(d.src, d.keys, "eviction")
            self._delete(d.dst, d.keys, "cleanup of a stopped demotion")
        self._delete_new(plan)

    def _drops_and_demotions(self, plan: StorePlan, staging: torch.Tensor, work: _TierWork, *, check: bool) -> None:
        # 1. evicted keys that are not moving down from that very tier: their room is needed now.
        moving = {(d.src, k) for d in plan.demotions for k in d.keys}
        for tier, keys in plan.drops:
            self._delete(tier, [k for k in keys if (tier, k) not in moving], "eviction")
        # 2. write-back, deepest first: copy down, then free the source.
        chunk = staging.shape[0]
        for d in plan.demotions:
            src, dst = self.backends[d.src], self.backends[d.dst]
            for c in range(0, len(d.keys), chunk):
                keys = d.keys[c : c + chunk]
                try:
                    if check:
                        self._check_alive(work.rec)
                    rows, found = self._rows_of(src, keys, staging)
                    move = [(k, r) for k, r, ok in zip(keys, rows, found) if ok]
                    work.failed.setdefault(d.dst, []).extend(k for k, ok in zip(keys, found) if not ok)
                    if move:
                        got = dst.write_blocks([k for k, _ in move], [r for _, r in move])
                        self._note_sizes(d.dst, [k for k, _ in move], got, work.failed, work.sizes)
                except _Expired:
                    raise
                except Exception as exc:  # the victims are lost (a miss later), the job goes on
                    log.warning("demotion of %d blocks to tier %d failed: %s", len(keys), d.dst, exc)
                    work.failed.setdefault(d.dst, []).extend(keys)
                finally:
                    # The manager already counts these keys as gone from the source: free them
                    # whatever happened, or the source's slots would leak.
                    self._delete(d.src, keys, "demotion")

    # -- helpers ---------------------------------------------------------------------------
    def _staging_rows(self, direction: str) -> torch.Tensor:
        buf = self._staging.get(direction)
        if buf is None:
            buf = torch.empty(
                (self._staging_blocks, self.layout.block_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
            self._staging[direction] = buf
        return buf

    def _rows_of(
        self, backend: Backend, keys: Sequence[bytes], staging: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Blocks of ``keys`` as CPU-readable rows: pool rows of a host pool, else read into staging."""
        if isinstance(backend, MemoryBackend) and backend.pool.device.type == "cpu":
            found = []
            rows = []
            pool = backend.pool
            for key in keys:
                try:
                    rows.append(pool[backend.slots([key])[0]])
                    found.append(True)
                except LifecycleError:
                    rows.append(staging[0])
                    found.append(False)
            return rows, found
        out = [staging[i] for i in range(len(keys))]
        return out, backend.read_blocks(keys, out)

    def _write_from(
        self,
        source: MemoryBackend,
        tier: int,
        keys: Sequence[bytes],
        staging: torch.Tensor,
        failed: _Failed,
        sizes: _Sizes,
    ) -> None:
        chunk = staging.shape[0]
        for c in range(0, len(keys), chunk):
            part = keys[c : c + chunk]
            rows, found = self._rows_of(source, part, staging)
            got = self.backends[tier].write_blocks(list(part), rows)
            for k, size, ok in zip(part, got, found):
                if size is None or not ok:
                    failed.setdefault(tier, []).append(k)
                else:
                    sizes.setdefault(tier, {})[k] = size

    # -- load ------------------------------------------------------------------------------
    def _run_load(self) -> None:
        while True:
            rec = self._load_q.get()
            if rec is None:
                return
            self._take("load")
            try:
                if rec.result is None:  # else stopped before it began: it never touched anything
                    self._load_one(rec)
            except BaseException as exc:  # the thread must survive anything
                log.warning("load job %d: %s", rec.job_id, exc, exc_info=True)
            finally:
                self._retire()

    def _load_one(self, rec: LoadRecord) -> None:
        start = time.perf_counter()
        promoted: list[bytes] = []
        try:
            if self._cuda:
                with torch.cuda.stream(self._streams["load"]):
                    result = self._load(rec, start, promoted)
            else:
                result = self._load(rec, start, promoted)
        except Exception as exc:  # a failed job is reported, never raised into the engine
            log.warning("transfer job %d (load) failed: %s", rec.job_id, exc, exc_info=True)
            result = JobResult(
                rec.job_id, "load", False, rec.plan.keys, seconds=time.perf_counter() - start, error=repr(exc)
            )
        try:
            if result.error is not None or not self._finish(rec, result):
                # Failed, or stopped while it ran: its promotions are released, free them.
                self._delete(0, promoted, "cleanup of a stopped load's promotions")
        except BaseException as exc:  # the thread must survive anything
            log.warning("load job %d: finishing failed: %s", rec.job_id, exc, exc_info=True)

    def _load(self, rec: LoadRecord, start: float, promoted: list[bytes]) -> JobResult:
        plan = rec.load_plan
        ids = rec.block_ids
        n = self.layout.engine_blocks_per_block
        by_tier: dict[int, list[int]] = {}
        for i, tier in enumerate(plan.tiers):
            by_tier.setdefault(tier, []).append(i)
        missed: list[int] = []
        failed: _Failed = {}
        promote = set(plan.promote)
        nbytes = 0
        staging = self._staging_rows("load")
        chunk = staging.shape[0]
        waited = False

        def write(src: torch.Tensor, rows: Sequence[int], dst: list[int]) -> bool:
            """Scatter into engine blocks unless the job was stopped; ``False`` if stopped."""
            nonlocal waited
            with rec.device_lock:
                if rec.cancelled or rec.result is not None:
                    return False
                rec.phase = Phase.DEVICE
                if not waited:
                    self._wait_compute(rec)
                    waited = True
                self.layout.scatter(src, rows, dst, non_blocking=True)
                self._sync()  # done means done: the engine may read these blocks at once
            return True

        stopped = False
        for tier, positions in by_tier.items():
            backend = self.backends[tier]
            if isinstance(backend, MemoryBackend):
                slot_of = {}
                for i in positions:
                    try:
                        slot_of[i] = backend.slots([plan.keys[i]])[0]
                    except LifecycleError:
                        missed.append(i)
                good = [i for i in positions if i in slot_of]
                dst = [b for i in good for b in ids[i * n : (i + 1) * n]]
                if not write(backend.pool, [slot_of[i] for i in good], dst):
                    stopped = True
                    break
                nbytes += len(good) * self.layout.block_bytes
                up = [i for i in good if plan.keys[i] in promote]
                if up:
                    self._promote([plan.keys[i] for i in up], [backend.pool[slot_of[i]] for i in up], failed, promoted)
                continue
            for c in range(0, len(positions), chunk):
                part = positions[c : c + chunk]
                out = [staging[j] for j in range(len(part))]
                found = backend.read_blocks([plan.keys[i] for i in part], out)
                rows = [j for j, ok in enumerate(found) if ok]
                missed.extend(i for i, ok in zip(part, found) if not ok)
                dst = [b for j in rows for b in ids[part[j] * n : (part[j] + 1) * n]]
                if not write(staging, rows, dst):
                    stopped = True
                    break
                up = [j for j in rows if plan.keys[part[j]] in promote]
                if up:
                    self._promote([plan.keys[part[j]] for j in up], [staging[j] for j in up], failed, promoted)
                nbytes += len(rows) * self.layout.block_bytes
            if stopped:
                break
        if stopped:
            return JobResult(rec.job_id, "load", False, plan.keys, error="stopped")
        missed.sort()
        return JobResult(
            rec.job_id,
            "load",
            not missed,
            plan.keys,
            nbytes=nbytes,
            seconds=time.perf_counter() - start,
            missed=tuple(plan.keys[i] for i in missed),
            missed_tiers=tuple(plan.tiers[i] for i in missed),
            failed={0: tuple(set(failed.get(0, ())) | {plan.keys[i] for i in missed} & promote)} if promote else {},
        )

    def _promote(self, keys: list[bytes], rows: list[torch.Tensor], failed: _Failed, promoted: list[bytes]) -> None:
        """Copy blocks just read from a lower tier into the first tier."""
        try:
            got = self.backends[0].write_blocks(keys, rows)
        except Exception as exc:  # a failed promotion is a miss in the first tier, nothing more
            log.warning("promotion of %d blocks failed: %s", len(keys), exc)
            got = [None] * len(keys)
        failed.setdefault(0, []).extend(k for k, size in zip(keys, got) if size is None)
        promoted.extend(k for k, size in zip(keys, got) if size is not None)


def _resolve(fut: asyncio.Future[JobResult], result: JobResult) -> None:
    if not fut.done():
        fut.set_result(result)
