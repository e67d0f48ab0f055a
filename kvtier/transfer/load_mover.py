"""Load jobs of :class:`kvtier.transfer.TransferEngine` (see that module for the contract):
:class:`LoadMover` runs them on ``kvtier-load``, tiers -> engine blocks, sharing the engine's
locks, counters and queues (:class:`~kvtier.transfer.movers.MoverHost`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kvtier.backend import MemoryBackend
from kvtier.errors import BackendError, LifecycleError
from kvtier.transfer.jobs import JobResult, LoadRecord, Phase, result_of
from kvtier.transfer.movers import MoverHost
from kvtier.transfer.plan_writes import Failed, delete_from
from kvtier.transfer.tier_rows import rows_at, rows_for

__all__ = ["LoadMover"]

log = logging.getLogger("kvtier.transfer")


class LoadMover:
    """Load jobs: tiers -> engine blocks, each write after the compute stream as it was at
    submit and stopped by ``cancel`` before any later write."""

    def __init__(self, engine: MoverHost) -> None:
        self.e = engine

    def run(self) -> None:
        while True:
            rec = self.e._load_q.get()
            if rec is None:
                return
            self.e._take("load")
            self.e._after_inline()
            self.load_job(rec)

    def load_job(self, rec: LoadRecord, *, inline: bool = False) -> None:
        """Run ``rec`` (unless it was stopped before it began) and give it back to the engine.
        ``inline`` (a job on its caller's thread): an interrupt goes up at once, the job neither
        reported nor given back, for the caller to settle (:meth:`InlineJobs.run
        <kvtier.transfer.inline.InlineJobs.run>`); on a thread it is the job's failure."""
        retired = False
        try:
            if rec.result is None:  # else stopped before it began: it never touched anything
                retired = self._load_one(rec, inline)
        except BaseException as exc:  # the thread must survive anything
            if inline and not isinstance(exc, Exception):
                raise
            log.warning("load job %d: %s", rec.job_id, exc, exc_info=True)
        if not retired:
            self.e._retire()

    def _load_one(self, rec: LoadRecord, inline: bool = False) -> bool:
        """Run ``rec``; ``True`` when it was given back to the engine with its result (nothing
        was left to clean up)."""
        start = time.perf_counter()
        promoted: list[bytes] = []
        try:
            if self.e._cuda:
                with self.e._on_stream("load"):
                    result = self._load(rec, start, promoted)
            else:  # no stream on the host: no context manager made per job
                result = self._load(rec, start, promoted)
        except BaseException as exc:  # a failed job is reported, never raised into the engine
            if inline and not isinstance(exc, Exception):
                raise  # an interrupt of a job on its caller's thread: the caller settles it
            # (On a thread an interrupt fails the job too: reported, its promotions freed.)
            log.warning("transfer job %d (load) failed: %s", rec.job_id, exc, exc_info=True)
            result = JobResult(
                rec.job_id, "load", False, rec.plan.keys, seconds=time.perf_counter() - start, error=repr(exc)
            )
        clean = result.error is None
        try:
            # Report first, whatever the result: a failed job is reported like any other.
            reported = self.e._finish(rec, result, retire=clean)
            if not clean or not reported:
                # Failed, or stopped while it ran: its promotions are released, free them.
                delete_from(self.e, 0, promoted, "cleanup of a stopped load's promotions")
        except BaseException as exc:  # the thread must survive anything
            log.warning("load job %d: finishing failed: %s", rec.job_id, exc, exc_info=True)
            return False
        return clean and reported

    def _load(self, rec: LoadRecord, start: float, promoted: list[bytes]) -> JobResult:
        plan = rec.load_plan
        ids = rec.block_ids
        n = self.e.layout.engine_blocks_per_block
        by_tier: dict[int, list[int]] = {}
        tiers = plan.tiers
        if tiers and tiers.count(tiers[0]) == len(tiers):  # every key from one tier (the usual load)
            by_tier[tiers[0]] = list(range(len(tiers)))
        else:
            for i, tier in enumerate(tiers):
                by_tier.setdefault(tier, []).append(i)
        missed: list[int] = []
        failed: Failed = {}
        promote = set(plan.promote)
        nbytes = 0
        cuda = self.e._cuda  # (on the host, neither a stream to wait on nor one to sync)
        waited = not cuda

        def write(src: torch.Tensor, rows: Sequence[int], dst: list[int]) -> bool:  # src: a pool or the staging, both kept
            """Scatter into engine blocks unless the job was stopped; ``False`` if stopped."""
            nonlocal waited
            with rec.device_lock:
                if rec.cancelled or rec.result is not None:
                    return False
                rec.phase = Phase.DEVICE
                try:
                    if not waited:
                        self.e._wait_compute(rec)
                        waited = True
                    self.e.layout.scatter(src, rows, dst, non_blocking=True, kept=True, checked=True)
                finally:
                    # Done means done (the engine may read these blocks at once), and a failed
                    # scatter's queued chunks are waited for too, before the job is reported.
                    if cuda:
                        self.e._sync()
            return True

        stopped = False
        for tier, positions in by_tier.items():
            backend = self.e.backends[tier]
            if isinstance(backend, MemoryBackend):
                keys = plan.keys
                whole = len(positions) == len(keys)  # the job's every key, in order
                good: Sequence[int] = positions
                try:  # every key there (the usual load): one call
                    rows = backend.slots(keys if whole else [keys[i] for i in positions])
                except LifecycleError:  # one by one, to tell the missing ones
                    slot_of: dict[int, int] = {}
                    for i in positions:
                        try:
                            slot_of[i] = backend.slots([keys[i]])[0]
                        except LifecycleError:
                            missed.append(i)
                    good = [i for i in positions if i in slot_of]
                    rows = [slot_of[i] for i in good]
                    whole = False
                dst = list(ids) if whole else [b for i in good for b in ids[i * n : (i + 1) * n]]
                if not write(backend.pool, rows, dst):
                    stopped = True
                    break
                nbytes += len(good) * self.e.layout.block_bytes
                up = [j for j, i in enumerate(good) if keys[i] in promote] if promote else None
                if up:
                    self._promote([keys[good[j]] for j in up], rows_at(self.e.backends[0], backend.pool, [rows[j] for j in up]), failed, promoted)
                continue
            staging = self.e._staging_rows("load")  # (a byte tier's: read into host rows first)
            chunk = staging.shape[0]
            for c in range(0, len(positions), chunk):
                part = positions[c : c + chunk]
                out = rows_for(backend, staging, len(part))  # one PoolRows where the tier takes it
                found = self._read(tier, [plan.keys[i] for i in part], out)
                rows = [j for j, ok in enumerate(found) if ok]
                missed.extend(i for i, ok in zip(part, found) if not ok)
                dst = [b for j in rows for b in ids[part[j] * n : (part[j] + 1) * n]]
                if not write(staging, rows, dst):
                    stopped = True
                    break
                up = [j for j in rows if plan.keys[part[j]] in promote]
                if up:
                    self._promote([plan.keys[part[j]] for j in up], rows_at(self.e.backends[0], staging, up), failed, promoted)
                nbytes += len(rows) * self.e.layout.block_bytes
            if stopped:
                break
        if stopped:
            return JobResult(rec.job_id, "load", False, plan.keys, error="stopped")
        if not missed and not promote:  # every block loaded, nothing promoted: no lists to build
            return result_of(rec.job_id, "load", True, plan.keys, nbytes, time.perf_counter() - start, {}, (), (), {}, None)
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

    def _read(self, tier: int, keys: list[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        """``read_blocks`` of tier ``tier``, where a failure of the whole call (any exception,
        whatever the backend) is a miss of each of its keys: the job goes on, the manager then
        forgets the keys in that tier (so they are not offered again), the engine recomputes."""
        try:
            found = [bool(f) for f in self.e.backends[tier].read_blocks(keys, out)]
            if len(found) != len(keys):
                raise BackendError(f"read_blocks answered {len(found)} found flags for {len(keys)} keys")
        except Exception as exc:
            log.warning("load: reading %d blocks from tier %d failed, each is a miss: %s", len(keys), tier, exc)
            with self.e._lock:
                self.e.counters["read_errors"] += 1
            return [False] * len(keys)
        return found

    def _promote(self, keys: list[bytes], rows: Sequence[torch.Tensor], failed: Failed, promoted: list[bytes]) -> None:
        """Copy blocks just read from a lower tier into the first tier."""
        try:
            got = self.e.backends[0].write_blocks(keys, rows)
        except Exception as exc:  # a failed promotion is a miss in the first tier, nothing more
            log.warning("promotion of %d blocks failed: %s", len(keys), exc)
            got = [None] * len(keys)
        failed.setdefault(0, []).extend(k for k, size in zip(keys, got) if size is None)
        promoted.extend(k for k, size in zip(keys, got) if size is not None)
