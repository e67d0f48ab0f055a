"""A plain store or load run at once on the caller's thread, with no job record
(``store_now`` / ``load_now``).

The store facade's ``save`` and ``load`` submit a job inline and take its result at once: the
job runs on the calling thread, and nobody else can learn its id before ``submit_*`` returns.
For such a job the record's machinery is pure cost: the record itself (two signals, a lock, a
list), the job table, the eligibility walk, the straight path's checks, the fence and the
report that wake nobody, then ``take`` undoing the report. Right after an engine step has
flushed the CPU caches, that was several tens of microseconds of a 4-block job's fixed cost.
:class:`JobsNow` runs the same job without them: the same claim on the engine (nothing else
queued or running; the transfer threads start nothing meanwhile), the same evictions, room,
slots and copy (:meth:`KVLayout.gather <kvtier.transfer.layout.KVLayout.gather>` /
``scatter``), in the same order, on the same OpenMP team (:meth:`CopySplitter.on_callers_team
<kvtier.transfer.copies.CopySplitter.on_callers_team>`), the same result and counters, and a
failed copy handled the same way (a store's new blocks deleted; the result failed). An
interrupt (a ``BaseException``, ``KeyboardInterrupt`` say) goes on up to the caller once the job
is settled as the usual inline submit settles one (:meth:`InlineJobs.run
<kvtier.transfer.inline.InlineJobs.run>`): a store's evictions run and its new blocks deleted,
the job counted failed, the engine given back (the transfer threads start nothing while a job
runs here, so a claim never given back would stall them for good). The caller then releases
the plan in the manager (:func:`~kvtier.transfer.jobs.plan_failed`).

It takes only the jobs the straight path (:mod:`kvtier.transfer.plain_jobs`) would run inline:
every tier a host memory tier, at most ``inline_max_bytes``, no device, the engine idle and
open; a store of new keys into the first tier with no demotion, write-through copy or tags and
evictions from the target tier alone (not a shared one); a load of keys all in one tier, all
there, nothing to promote. Anything else returns ``None`` having changed nothing, and the
caller submits the job as usual: tests compare the two (``tests/test_jobs_now.py``). Such a
job has no deadline: it ends before the call returns, its copy bounded by ``inline_max_bytes``
in host memory, where a deadline bounds tier work that may stall.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvtier.backend import MemoryBackend
from kvtier.manager import LoadPlan, StorePlan
from kvtier.transfer.jobs import JobResult, QuietCondition, result_of
from kvtier.transfer.movers import MoverHost, no_free_slots
from kvtier.transfer.plan_writes import PlanWrites

if TYPE_CHECKING:
    from kvtier.transfer.inline import InlineJobs

__all__ = ["JobsNow", "NowHost"]

log = logging.getLogger("kvtier.transfer")


class NowHost(MoverHost, Protocol):
    """What :class:`JobsNow` uses of its engine (``TransferEngine``) beside the movers' share:
    the engine's own claim on a job run inline."""

    _closed: bool
    _active: int
    _inline_running: bool
    _idle: QuietCondition
    _inline_done: QuietCondition
    _ids: itertools.count[int]


class JobsNow:
    """Runs a plain store or load at once (see the module doc); ``enabled`` off sends every job
    to the usual submit (tests compare the two)."""

    def __init__(self, engine: NowHost, inline: InlineJobs) -> None:
        self.e = engine
        self.inline = inline
        self._plans = PlanWrites(engine)
        self.enabled = True

    def _may(self, blocks: int) -> bool:
        """Whether a job of ``blocks`` blocks may run now, by its size and the tiers: ``True``
        only where every tier is a memory tier with its pool in host memory
        (:meth:`InlineJobs._every_tier_host <kvtier.transfer.inline.InlineJobs._every_tier_host>`),
        so the job's own tiers are not asked again."""
        inline = self.inline
        return (
            self.enabled
            and inline.plain.enabled
            and not self.e._cuda
            and 0 < blocks * self.e.layout.block_bytes <= inline.max_bytes
            and bool(inline._all_host or (inline._all_host is None and inline._every_tier_host()))
        )

    def _claim(self) -> bool:
        """Take the engine for a job on this thread, as an inline submit does; ``False`` when it
        is closed or not idle."""
        e = self.e
        with e._lock:
            if e._closed or e._active or e._inline_running or e._tier_jobs:
                return False
            e._inline_running = True  # the transfer threads start nothing until it ends
            e._active += 1
            return True

    def _end(self, kind: str, ok: bool, nbytes: int) -> None:
        """Count the job, ``nbytes`` moved, and give the engine back (``nbytes`` < 0: the job
        did not run, nothing is counted)."""
        e = self.e
        with e._lock:
            if nbytes >= 0:
                counters = e.counters
                counters["inline_jobs"] += 1
                counters["jobs"] += 1
                if not ok:
                    counters["failed_jobs"] += 1
                counters["bytes_stored" if kind == "store" else "bytes_loaded"] += nbytes
            e._active -= 1
            e._inline_running = False  # (with the count, no call between: see _give_back)
            # (QuietCondition.notify_all's own test, here: no call where nobody waits)
            if e._active == 0 and e._idle.waiting:
                e._idle.notify_all()
            if e._inline_done.waiting:
                e._inline_done.notify_all()

    def _give_back(self, kind: str) -> None:
        """For a job an interrupt stops: give the engine back, counting the job failed, unless
        :meth:`_end` already has (the claim is this thread's alone while ``_inline_running``)."""
        if self.e._inline_running:
            self._end(kind, False, 0)

    def store(self, plan: StorePlan, block_ids: Sequence[int]) -> JobResult | None:
        """Store ``plan`` into its tier now, from engine ``block_ids`` (checked by the caller,
        ``n`` per key), and return the job's result; ``None``, having changed nothing, for a job
        that is not plain or an engine that is not idle (submit it as usual)."""
        e = self.e
        keys = plan.keys
        target = e.backends[plan.tier]
        drops = plan.drops
        if (
            plan.write_through
            or plan.demotions
            or plan.tags
            or (drops and (len(drops) != 1 or drops[0][0] != plan.tier or getattr(target, "shared", False)))
            or not self._may(len(keys))
            or not self._claim()
        ):
            return None
        if TYPE_CHECKING:  # _may: every tier is a host memory tier (no isinstance per job)
            assert isinstance(target, MemoryBackend)
        layout = e.layout
        nbytes = 0
        error: str | None = None
        try:  # (from the claim on: an interrupt anywhere gives the engine back)
            job_id = next(e._ids)
            start = time.perf_counter()
            try:
                with layout.copies.on_callers_team(len(keys) * layout.block_bytes):
                    slots = target.evict_and_reserve(drops[0][1] if drops else (), keys)  # (reserve_slots, inline)
                    if slots is None:
                        raise no_free_slots(plan)
                    layout.gather(block_ids, target.pool, slots, non_blocking=True, kept=True, checked=True)
                nbytes = len(slots) * layout.block_bytes
            except Exception as exc:  # reported, never raised into the engine
                log.warning("store job %d failed: %s", job_id, exc, exc_info=True)
                self._plans.delete_new(plan)
                error = repr(exc)
            seconds = time.perf_counter() - start
            result = result_of(job_id, "store", error is None, keys, nbytes, seconds, {}, (), (), {}, error)
            self._end("store", error is None, nbytes)
        except BaseException:  # an interrupt, in the copy or after it: undone, given back, raised
            try:
                self._plans.cleanup(plan)  # (after the copy too: the caller releases the plan)
            finally:  # (an interrupt in the undo too: given back all the same)
                self._give_back("store")
            raise
        return result

    def load(self, plan: LoadPlan, block_ids: Sequence[int]) -> JobResult | None:
        """Load ``plan`` into engine ``block_ids`` now (as for :meth:`store`) and return the
        job's result; ``None``, having changed nothing, for a job that is not plain (a key no
        longer in its tier included: the usual path reports the miss) or an engine not idle."""
        e = self.e
        keys = plan.keys
        tiers = plan.tiers
        if not tiers or plan.promote or tiers.count(tiers[0]) != len(tiers) or not self._may(len(keys)):
            return None
        backend = e.backends[tiers[0]]
        if TYPE_CHECKING:  # _may: every tier is a host memory tier
            assert isinstance(backend, MemoryBackend)
        if not self._claim():
            return None
        try:
            rows = backend.slots(keys)  # under the claim: no other job moves them meanwhile
        except BaseException as exc:  # a key gone, or a closed tier: the usual path tells
            if not isinstance(exc, Exception):  # an interrupt: counted failed, given back, raised
                self._end("load", False, 0)
                raise
            self._end("load", False, -1)
            return None
        layout = e.layout
        error: str | None = None
        try:
            job_id = next(e._ids)
            start = time.perf_counter()
            try:
                with layout.copies.on_callers_team(len(keys) * layout.block_bytes):
                    layout.scatter(backend.pool, rows, block_ids, non_blocking=True, kept=True, checked=True)
            except Exception as exc:  # a failed job is reported, never raised into the engine
                log.warning("transfer job %d (load) failed: %s", job_id, exc, exc_info=True)
                error = repr(exc)
            seconds = time.perf_counter() - start
            if error is not None:
                result = JobResult(job_id, "load", False, keys, seconds=seconds, error=error)
                self._end("load", False, 0)
                return result
            nbytes = len(rows) * layout.block_bytes
            result = result_of(job_id, "load", True, keys, nbytes, seconds, {}, (), (), {}, None)
            self._end("load", True, nbytes)
        except BaseException:  # an interrupt, in the copy or after it: given back (counted failed), raised
            self._give_back("load")
            raise
        return result
