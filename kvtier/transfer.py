"""Transfer jobs: the byte movers that execute the manager's plans.

A job is one store (the engine's KV cache -> the first tier, after the plan's evictions and
demotions) or one load (tiers -> the engine's KV cache). ``submit_*`` returns a job id at once;
the work runs on a worker thread per direction (FIFO within a direction), so the engine's step
loop never blocks on it. On CUDA each direction also has its own stream: a store waits for the
compute stream through an event recorded at submit time, and a job is reported finished only
after the event recorded behind its copies has completed.

``wait(job_ids)`` is the fence (it blocks until those jobs have finished); ``poll_finished()``
reports finished jobs with their success, bytes and time. A job that fails is reported as a
failed result; nothing raises into the engine. Byte tiers are reached through a bounded staging
buffer (pinned when CUDA is available); a job larger than it is moved in chunks.
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
from typing import Any, Literal

import torch

from kvtier.backend import Backend, MemoryBackend
from kvtier.errors import ClosedError, LayoutError, LifecycleError
from kvtier.jobs import JobResult
from kvtier.layout import KVLayout
from kvtier.manager import LoadPlan, StorePlan

__all__ = ["TransferEngine", "JobResult"]

log = logging.getLogger("kvtier.transfer")


@dataclass(slots=True)
class _Job:
    job_id: int
    kind: Literal["store", "load"]
    plan: StorePlan | LoadPlan
    block_ids: list[int]
    event: Any = None  # CUDA event on the compute stream (stores)
    done: threading.Event = field(default_factory=threading.Event)
    result: JobResult | None = None
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[JobResult]]] = field(default_factory=list)


class TransferEngine:
    """Runs store and load jobs between ``layout``'s KV cache and ``backends`` (tier order)."""

    def __init__(
        self,
        layout: KVLayout,
        backends: Sequence[Backend],
        *,
        staging_blocks: int = 32,
        max_queued_jobs: int = 4096,
    ) -> None:
        if staging_blocks < 1:
            raise LayoutError(f"staging_blocks: expected >= 1, got {staging_blocks}")
        self.layout = layout
        self.backends = list(backends)
        self._cuda = layout.device.type == "cuda"
        self._staging_blocks = staging_blocks
        self._staging: dict[str, torch.Tensor] = {}
        self._ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._finished: list[JobResult] = []
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue[_Job | None]] = {
            "store": queue.Queue(max_queued_jobs),
            "load": queue.Queue(max_queued_jobs),
        }
        self._streams: dict[str, Any] = {}
        if self._cuda:
            self._streams = {d: torch.cuda.Stream(device=layout.device) for d in ("store", "load")}
        self._threads = [
            threading.Thread(target=self._run, args=(d,), name=f"kvtier-{d}", daemon=True) for d in ("store", "load")
        ]
        self._closed = False
        for t in self._threads:
            t.start()
        self.counters = {"jobs": 0, "failed_jobs": 0, "bytes_stored": 0, "bytes_loaded": 0}

    # -- submission ------------------------------------------------------------------------
    def submit_store(self, plan: StorePlan, block_ids: Sequence[int]) -> int:
        """Queue ``plan``; ``block_ids`` are the engine ids of ``plan.keys`` (``n`` per key)."""
        ids = self.layout.check_block_ids(block_ids, len(plan.keys))
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.layout.device))
        return self._submit(_Job(next(self._ids), "store", plan, ids, event))

    def submit_load(self, plan: LoadPlan, block_ids: Sequence[int]) -> int:
        """Queue ``plan``; ``block_ids`` are the engine ids to fill (``n`` per key)."""
        ids = self.layout.check_block_ids(block_ids, len(plan.keys))
        return self._submit(_Job(next(self._ids), "load", plan, ids))

    def _submit(self, job: _Job) -> int:
        if self._closed:
            raise ClosedError("the transfer engine is closed")
        with self._lock:
            self._jobs[job.job_id] = job
        self._queues[job.kind].put(job)
        return job.job_id

    # -- completion ------------------------------------------------------------------------
    def wait(self, job_ids: Sequence[int], timeout: float | None = None) -> list[JobResult]:
        """Block until every job in ``job_ids`` has finished; return their results.

        Results stay queued for ``poll_finished`` as well. Unknown ids are ignored (already
        reported and forgotten)."""
        results: list[JobResult] = []
        for jid in job_ids:
            with self._lock:
                job = self._jobs.get(jid)
            if job is None:
                continue
            if not job.done.wait(timeout):
                raise TimeoutError(f"transfer job {jid} did not finish within {timeout} s")
            assert job.result is not None
            results.append(job.result)
        return results

    async def wait_async(self, job_id: int) -> JobResult:
        """Await one job from a coroutine without blocking the event loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[JobResult] = loop.create_future()
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise LifecycleError(f"unknown transfer job {job_id}")
            if job.result is None:
                job.waiters.append((loop, fut))
            else:
                fut.set_result(job.result)
        return await fut

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
                job = self._jobs.get(jid)
                if job is not None and job.result is not None:
                    del self._jobs[jid]
            self._finished = [r for r in self._finished if r.job_id not in drop]

    def pending_jobs(self) -> int:
        with self._lock:
            return sum(1 for j in self._jobs.values() if j.result is None)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued jobs, then stop the worker threads."""
        if self._closed:
            return
        self._closed = True
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout)

    # -- workers ---------------------------------------------------------------------------
    def _run(self, direction: str) -> None:
        q = self._queues[direction]
        while True:
            job = q.get()
            if job is None:
                return
            start = time.perf_counter()
            try:
                if self._cuda:
                    with torch.cuda.stream(self._streams[direction]):
                        result = self._execute(job, start)
                else:
                    result = self._execute(job, start)
            except Exception as exc:  # a failed job is reported, never raised into the engine
                log.warning("transfer job %d (%s) failed: %s", job.job_id, job.kind, exc, exc_info=True)
                result = JobResult(
                    job.job_id, job.kind, False, tuple(job.plan.keys), seconds=time.perf_counter() - start, error=repr(exc)
                )
            self._finish(job, result)

    def _finish(self, job: _Job, result: JobResult) -> None:
        with self._lock:
            job.result = result
            self.counters["jobs"] += 1
            if not result.success:
                self.counters["failed_jobs"] += 1
            self.counters["bytes_stored" if job.kind == "store" else "bytes_loaded"] += result.nbytes
            self._finished.append(result)
            waiters, job.waiters = job.waiters, []
        job.done.set()
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut, result)

    def _execute(self, job: _Job, start: float) -> JobResult:
        if job.kind == "store":
            assert isinstance(job.plan, StorePlan)
            return self._store(job.job_id, job.plan, job.block_ids, job.event, start)
        assert isinstance(job.plan, LoadPlan)
        return self._load(job.job_id, job.plan, job.block_ids, start)

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self.layout.device).synchronize()

    def _staging_rows(self, direction: str) -> torch.Tensor:
        buf = self._staging.get(direction)
        if buf is None:
            buf = torch.empty(
                (self._staging_blocks, self.layout.block_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
            self._staging[direction] = buf
        return buf

    def _rows_of(self, backend: Backend, keys: Sequence[bytes], staging: torch.Tensor) -> tuple[list[torch.Tensor], list[bool]]:
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

    def _store(self, job_id: int, plan: StorePlan, ids: list[int], event: Any, start: float) -> JobResult:
        failed: dict[int, list[bytes]] = {}
        sizes: dict[int, dict[bytes, int]] = {}
        staging = self._staging_rows("store")
        chunk = staging.shape[0]
        demoted = {k for d in plan.demotions for k in d.keys}
        # 1. evicted keys that are not moving down: their room is needed now.
        for tier, keys in plan.drops:
            gone = [k for k in keys if k not in demoted]
            if gone:
                try:
                    self.backends[tier].delete_blocks(gone)
                except Exception as exc:  # an orphan costs room, never correctness: go on
                    log.warning("dropping %d evicted blocks from tier %d failed: %s", len(gone), tier, exc)
        # 2. write-back, deepest first: copy down, then free the source.
        for d in plan.demotions:
            src, dst = self.backends[d.src], self.backends[d.dst]
            for c in range(0, len(d.keys), chunk):
                keys = d.keys[c : c + chunk]
                try:
                    rows, found = self._rows_of(src, keys, staging)
                    move = [(k, r) for k, r, ok in zip(keys, rows, found) if ok]
                    failed.setdefault(d.dst, []).extend(k for k, ok in zip(keys, found) if not ok)
                    if move:
                        got = dst.write_blocks([k for k, _ in move], [r for _, r in move])
                        for (k, _), size in zip(move, got):
                            if size is None:
                                failed.setdefault(d.dst, []).append(k)
                            else:
                                sizes.setdefault(d.dst, {})[k] = size
                except Exception as exc:  # the victims are lost (a miss later), the job goes on
                    log.warning("demotion of %d blocks to tier %d failed: %s", len(keys), d.dst, exc)
                    failed.setdefault(d.dst, []).extend(keys)
                finally:
                    # The manager already counts these keys as gone from the source: free them
                    # whatever happened, or the source's slots would leak.
                    src.delete_blocks(keys)
        # 3. the new blocks.
        if self._cuda and event is not None:
            torch.cuda.current_stream(self.layout.device).wait_event(event)
        try:
            nbytes = self._store_new(plan, ids, staging, failed, sizes)
        except BaseException:
            # The manager releases this job's reservations; release the bytes to match.
            for tier, keys in ((plan.tier, plan.keys), *plan.write_through):
                try:
                    self.backends[tier].delete_blocks(keys)
                except Exception as exc:
                    log.warning("cleanup of a failed store in tier %d failed: %s", tier, exc)
            raise
        ok_all = not failed.get(plan.tier)
        return JobResult(
            job_id,
            "store",
            ok_all,
            plan.keys,
            nbytes=nbytes,
            seconds=time.perf_counter() - start,
            failed={t: tuple(ks) for t, ks in failed.items() if ks},
            sizes=sizes,
        )

    def _store_new(
        self,
        plan: StorePlan,
        ids: list[int],
        staging: torch.Tensor,
        failed: dict[int, list[bytes]],
        sizes: dict[int, dict[bytes, int]],
    ) -> int:
        """Write the plan's new blocks into its tier and its write-through tiers; return bytes."""
        chunk = staging.shape[0]
        n = self.layout.engine_blocks_per_block
        target = self.backends[plan.tier]
        nbytes = 0
        if isinstance(target, MemoryBackend):
            slots = target.reserve(plan.keys)
            if slots is None:
                raise LifecycleError(f"tier {plan.tier}: no free slots for {len(plan.keys)} blocks; the manager's accounting is off")
            self.layout.gather(ids, target.pool, slots, non_blocking=True)
            self._sync()
            nbytes = len(slots) * self.layout.block_bytes
            for tier, keys in plan.write_through:
                self._write_from(target, tier, keys, staging, failed, sizes)
        else:
            through = dict(plan.write_through)
            for c in range(0, len(plan.keys), chunk):
                keys = plan.keys[c : c + chunk]
                self.layout.gather(ids[c * n : (c + len(keys)) * n], staging, range(len(keys)), non_blocking=True)
                self._sync()
                rows = [staging[i] for i in range(len(keys))]
                for tier in (plan.tier, *through):
                    want = set(through.get(tier, keys)) if tier != plan.tier else None
                    pick = [(k, r) for k, r in zip(keys, rows) if want is None or k in want]
                    got = self.backends[tier].write_blocks([k for k, _ in pick], [r for _, r in pick])
                    for (k, _), size in zip(pick, got):
                        if size is None:
                            failed.setdefault(tier, []).append(k)
                        else:
                            sizes.setdefault(tier, {})[k] = size
                            if tier == plan.tier:
                                nbytes += self.layout.block_bytes
        return nbytes

    def _write_from(
        self,
        source: MemoryBackend,
        tier: int,
        keys: Sequence[bytes],
        staging: torch.Tensor,
        failed: dict[int, list[bytes]],
        sizes: dict[int, dict[bytes, int]],
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

    def _load(self, job_id: int, plan: LoadPlan, ids: list[int], start: float) -> JobResult:
        n = self.layout.engine_blocks_per_block
        by_tier: dict[int, list[int]] = {}
        for i, tier in enumerate(plan.tiers):
            by_tier.setdefault(tier, []).append(i)
        missed: list[int] = []
        failed: dict[int, list[bytes]] = {}
        promote = set(plan.promote)
        nbytes = 0
        staging = self._staging_rows("load")
        chunk = staging.shape[0]
        for tier, positions in by_tier.items():
            backend = self.backends[tier]
            if isinstance(backend, MemoryBackend):
                keys = [plan.keys[i] for i in positions]
                slot_of = {}
                for i, key in zip(positions, keys):
                    try:
                        slot_of[i] = backend.slots([key])[0]
                    except LifecycleError:
                        missed.append(i)
                good = [i for i in positions if i in slot_of]
                dst = [b for i in good for b in ids[i * n : (i + 1) * n]]
                self.layout.scatter(backend.pool, [slot_of[i] for i in good], dst, non_blocking=True)
                nbytes += len(good) * self.layout.block_bytes
                up = [i for i in good if plan.keys[i] in promote]
                if up:
                    self._sync()
                    self._promote([plan.keys[i] for i in up], [backend.pool[slot_of[i]] for i in up], failed)
                continue
            for c in range(0, len(positions), chunk):
                part = positions[c : c + chunk]
                out = [staging[j] for j in range(len(part))]
                found = backend.read_blocks([plan.keys[i] for i in part], out)
                rows = [j for j, ok in enumerate(found) if ok]
                missed.extend(i for i, ok in zip(part, found) if not ok)
                dst = [b for j in rows for b in ids[part[j] * n : (part[j] + 1) * n]]
                self.layout.scatter(staging, rows, dst, non_blocking=True)
                up = [j for j in rows if plan.keys[part[j]] in promote]
                if up:
                    self._promote([plan.keys[part[j]] for j in up], [staging[j] for j in up], failed)
                self._sync()  # the staging rows are reused by the next chunk
                nbytes += len(rows) * self.layout.block_bytes
        self._sync()
        missed.sort()
        return JobResult(
            job_id,
            "load",
            not missed,
            plan.keys,
            nbytes=nbytes,
            seconds=time.perf_counter() - start,
            missed=tuple(plan.keys[i] for i in missed),
            missed_tiers=tuple(plan.tiers[i] for i in missed),
            failed={0: tuple(set(failed.get(0, ())) | {plan.keys[i] for i in missed} & promote)} if promote else {},
        )

    def _promote(self, keys: list[bytes], rows: list[torch.Tensor], failed: dict[int, list[bytes]]) -> None:
        """Copy blocks just read from a lower tier into the first tier."""
        try:
            got = self.backends[0].write_blocks(keys, rows)
        except Exception as exc:  # a failed promotion is a miss in the first tier, nothing more
            log.warning("promotion of %d blocks failed: %s", len(keys), exc)
            got = [None] * len(keys)
        failed.setdefault(0, []).extend(k for k, size in zip(keys, got) if size is None)


def _resolve(fut: asyncio.Future[JobResult], result: JobResult) -> None:
    if not fut.done():
        fut.set_result(result)


Callback = Callable[[JobResult], None]
