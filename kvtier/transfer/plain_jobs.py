"""Straight paths for the usual inline job (:mod:`kvtier.transfer.inline`).

An inline job of a few blocks costs, beside its copy, the calls it passes through: a store job
goes ``device_job`` -> ``_device_phase`` -> ``_store_direct`` -> ``_read_engine_blocks`` ->
``_finish_store`` (:class:`~kvtier.transfer.movers.StoreMover`), building a
:class:`~kvtier.transfer.plan_writes.TierWork` on the way; a load job goes ``load_job`` ->
``_load_one`` -> ``_load`` (:class:`~kvtier.transfer.load_mover.LoadMover`), grouping its keys
by tier and defining its write closure. Right after a copy has flushed the caches each such
step costs several microseconds. :class:`PlainJobs` runs the *plain* job in one function each:

* a plain store: new keys into the first tier, with evictions (``drops``) from memory tiers at
  most; no demotion, no write-through copy, no tags, and no earlier job left in the tiers
  thread (so the general path would copy straight into the tier too);
* a plain load: every key from one memory tier, every key there, nothing promoted.

Each does what the general path does for such a job, in the same order, with the same result,
counters, fence (``device_done``), cancellation check under the job's ``device_lock`` and
clean-up: evictions, room, the copy (:meth:`KVLayout.gather
<kvtier.transfer.layout.KVLayout.gather>` / ``scatter``, as the general path calls them), the
report. Anything else, or anything found unusual before a change was made (a job stopped before
it began, a load key no longer in its tier), is left to the general path (``False``): tests
compare the two (``tests/test_plain_jobs.py``).
"""

from __future__ import annotations

import logging
import time

from kvtier.backend import MemoryBackend
from kvtier.manager import LoadPlan, StorePlan
from kvtier.transfer.jobs import JobResult, LoadRecord, Phase, StoreRecord, result_of
from kvtier.transfer.movers import MoverHost, hand_to_tiers, reserve_slots
from kvtier.transfer.plan_writes import PlanWrites, TierWork, delete_from

__all__ = ["PlainJobs"]

log = logging.getLogger("kvtier.transfer")


class PlainJobs:
    """The plain store and load of an inline job (see the module doc); ``enabled`` off sends
    every job to the general path (tests compare the two)."""

    def __init__(self, engine: MoverHost) -> None:
        self.e = engine
        self._plans = PlanWrites(engine)
        self.enabled = True

    def store(self, rec: StoreRecord) -> bool:
        """Run ``rec`` if it is a plain store (then ``True``: it was reported and given back, or
        its clean-up handed to the tiers thread as the general path hands it); else ``False``,
        having changed nothing."""
        e = self.e
        plan: StorePlan = rec.plan  # type: ignore[assignment]
        if (
            not self.enabled
            or not plan.keys
            or plan.write_through
            or plan.demotions
            or plan.tags
            or rec.result is not None  # stopped before it began: the general path cleans up
            or e._tier_jobs  # an earlier job still in the tiers thread: the general path stages
        ):
            return False
        # (An inline job's tiers, its drops' too, are host memory tiers: InlineJobs.eligible.)
        target: MemoryBackend = e.backends[plan.tier]  # type: ignore[assignment]  # (no cast: a call)
        start = time.perf_counter()
        keys = plan.keys
        error: str | None = None
        nbytes = 0
        drops = plan.drops
        try:
            if not drops or (len(drops) == 1 and drops[0][0] == plan.tier and not getattr(target, "shared", False)):
                slots = reserve_slots(target, plan, drops[0][1] if drops else ())  # its room in one call
            else:
                for tier, dropped in drops:
                    delete_from(e, tier, dropped, "eviction")  # (a plan with keys evicts to make room)
                slots = reserve_slots(target, plan)
            with rec.device_lock:
                if rec.cancelled or rec.result is not None:
                    rec.device_done.set()  # it never reads an engine block now
                    hand_to_tiers(e, TierWork(rec, "cleanup", start))
                    return True
                rec.phase = Phase.DEVICE
                try:
                    e.layout.gather(list(rec.block_ids), target.pool, slots, non_blocking=True, kept=True, checked=True)
                finally:
                    rec.phase = Phase.TIERS
                    rec.device_done.set()
            nbytes = len(slots) * e.layout.block_bytes
        except Exception as exc:
            log.warning("store job %d failed: %s", rec.job_id, exc, exc_info=True)
            self._plans.delete_new(plan)
            error = repr(exc)
        ok = error is None
        result = result_of(rec.job_id, "store", ok, keys, nbytes, time.perf_counter() - start, {}, (), (), {}, error)
        if not e._finish(rec, result, retire=True):  # reported failed meanwhile: undo, in order
            hand_to_tiers(e, TierWork(rec, "cleanup", start))
        return True

    def load(self, rec: LoadRecord) -> bool:
        """Run ``rec`` if it is a plain load (then ``True``: reported and given back); else
        ``False``, having changed nothing."""
        e = self.e
        plan: LoadPlan = rec.plan  # type: ignore[assignment]
        tiers = plan.tiers
        if not self.enabled or not tiers or plan.promote or rec.result is not None or tiers.count(tiers[0]) != len(tiers):
            return False
        backend: MemoryBackend = e.backends[tiers[0]]  # type: ignore[assignment]  # (a host memory tier: InlineJobs.eligible)
        start = time.perf_counter()
        keys = plan.keys
        try:
            rows = backend.slots(keys)
        except Exception:  # a key gone (a miss to report) or a closed tier: the general path tells
            return False
        with rec.device_lock:
            if rec.cancelled or rec.result is not None:
                return False  # the general path finds it stopped and reports it so
            rec.phase = Phase.DEVICE
            try:
                e.layout.scatter(backend.pool, rows, list(rec.block_ids), non_blocking=True, kept=True, checked=True)
            except Exception as exc:  # a failed job is reported, never raised into the engine
                log.warning("transfer job %d (load) failed: %s", rec.job_id, exc, exc_info=True)
                failed = JobResult(rec.job_id, "load", False, keys, seconds=time.perf_counter() - start, error=repr(exc))
                error = True
            else:
                error = False
        if error:
            e._finish(rec, failed, retire=False)
            e._retire()
            return True
        nbytes = len(rows) * e.layout.block_bytes
        result = result_of(rec.job_id, "load", True, keys, nbytes, time.perf_counter() - start, {}, (), (), {}, None)
        if not e._finish(rec, result, retire=True):  # reported failed meanwhile (a close)
            e._retire()
        return True
