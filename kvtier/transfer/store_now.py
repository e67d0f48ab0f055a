"""A plain store run at once on the caller's thread, with no job record (``store_now``).

The store facade's ``save`` submits a job inline and takes its result at once: the job runs on
the calling thread, and nobody else can learn its id before ``submit_store`` returns. For such
a job the record's machinery is pure cost: the record itself (two signals, a lock, a list),
the job table, the eligibility walk, the straight path's checks, the fence and the report that
wake nobody, then ``take`` undoing the report. Right after an engine step has flushed the CPU
caches, that was several tens of microseconds of a 4-block job's fixed cost.
:class:`StoreNow` runs the same job without them: the same claim on the engine (nothing else
queued or running; the transfer threads start nothing meanwhile), the same evictions, room and
copy (:meth:`KVLayout.gather <kvtier.transfer.layout.KVLayout.gather>`), in the same order,
on the same OpenMP team (:meth:`CopySplitter.on_callers_team
<kvtier.transfer.copies.CopySplitter.on_callers_team>`), the same result and counters, and a
failed copy undone the same way (the plan's new blocks deleted, the result failed).

It takes only the job the straight path (:mod:`kvtier.transfer.plain_jobs`) would run inline:
new keys into the first tier, every tier a host memory tier, at most ``inline_max_bytes``, no
device, no demotion, no write-through copy, no tags, evictions from the target tier alone (not
a shared one), the engine idle and open. Anything else returns ``None`` having changed nothing,
and the caller submits the job as usual: tests compare the two (``tests/test_store_now.py``).
The job has no deadline: it ends before the call returns, its copy bounded by
``inline_max_bytes`` in host memory, where a deadline bounds tier work that may stall.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvtier.backend import MemoryBackend
from kvtier.manager import StorePlan
from kvtier.transfer.jobs import JobResult, QuietCondition, result_of
from kvtier.transfer.movers import MoverHost, reserve_slots
from kvtier.transfer.plan_writes import PlanWrites

if TYPE_CHECKING:
    from kvtier.transfer.inline import InlineJobs

__all__ = ["NowHost", "StoreNow"]

log = logging.getLogger("kvtier.transfer")


class NowHost(MoverHost, Protocol):
    """What :class:`StoreNow` uses of its engine (``TransferEngine``) beside the movers' share:
    the engine's own claim on a job run inline."""

    _closed: bool
    _active: int
    _inline_running: bool
    _idle: QuietCondition
    _inline_done: QuietCondition
    _ids: itertools.count[int]


class StoreNow:
    """Runs a plain store at once (see the module doc); ``enabled`` off sends every job to the
    usual submit (tests compare the two)."""

    def __init__(self, engine: NowHost, inline: InlineJobs) -> None:
        self.e = engine
        self.inline = inline
        self._plans = PlanWrites(engine)
        self.enabled = True

    def _plain(self, plan: StorePlan, target: object) -> bool:
        """Whether ``plan`` is a job the straight path would run inline, by its plan and tiers."""
        inline = self.inline
        drops = plan.drops
        return (
            self.enabled
            and inline.plain.enabled
            and bool(plan.keys)
            and not (plan.write_through or plan.demotions or plan.tags or self.e._cuda)
            and (not drops or (len(drops) == 1 and drops[0][0] == plan.tier and not getattr(target, "shared", False)))
            and 0 < len(plan.keys) * self.e.layout.block_bytes <= inline.max_bytes
            and bool(inline._all_host or (inline._all_host is None and inline._every_tier_host()))
        )

    def run(self, plan: StorePlan, block_ids: Sequence[int]) -> JobResult | None:
        """Store ``plan`` into its tier now, from engine ``block_ids`` (checked by the caller,
        ``n`` per key), and return the job's result; ``None``, having changed nothing, for a job
        that is not plain or an engine that is not idle (submit it as usual)."""
        e = self.e
        target = e.backends[plan.tier]
        if not (isinstance(target, MemoryBackend) and self._plain(plan, target)):
            return None
        with e._lock:
            if e._closed or e._active or e._inline_running or e._tier_jobs:
                return None
            e._inline_running = True  # the transfer threads start nothing until it ends
            e._active += 1
            e.counters["inline_jobs"] += 1
            job_id = next(e._ids)
        keys = plan.keys
        layout = e.layout
        nbytes = 0
        error: str | None = None
        start = time.perf_counter()
        try:
            with layout.copies.on_callers_team(len(keys) * layout.block_bytes):
                drops = plan.drops
                slots = reserve_slots(target, plan, drops[0][1] if drops else ())  # its room in one call
                layout.gather(block_ids, target.pool, slots, non_blocking=True, kept=True, checked=True)
            nbytes = len(slots) * layout.block_bytes
        except Exception as exc:  # reported, never raised into the engine
            log.warning("store job %d failed: %s", job_id, exc, exc_info=True)
            self._plans.delete_new(plan)
            error = repr(exc)
        result = result_of(job_id, "store", error is None, keys, nbytes, time.perf_counter() - start, {}, (), (), {}, error)
        with e._lock:
            counters = e.counters
            counters["jobs"] += 1
            if error is not None:
                counters["failed_jobs"] += 1
            counters["bytes_stored"] += nbytes
            e._active -= 1
            if e._active == 0:
                e._idle.notify_all()
            e._inline_running = False
            e._inline_done.notify_all()
        return result
