"""Small host-memory jobs run on the caller's thread (``submit_*(..., inline=True)``).

A job handed to a transfer thread pays two thread hand-offs (the submit wakes the thread, the
thread's report wakes the waiter): measured here about 0.2 ms each, the whole fixed cost of a
job in the ``cpu`` tier. A caller that waits for the job at once anyway (the store facade's
``save`` and ``load``) may ask for the job to run inline instead. It runs inline only when all
of this holds, and is queued as usual otherwise:

* the engine's KV cache is in host memory (no device: nothing to wait for on a stream);
* every tier the job touches is a memory tier in host memory (the first tier, the tiers it
  evicts from, demotes between or writes through to, the tiers a load reads): a copy in
  memory, never a disk, a server or a lock held by a slow tier;
* the job moves at most ``inline_max_bytes`` (:data:`DEFAULT_INLINE_MAX_BYTES`), so the
  caller's thread is held for a bounded copy;
* no job of any kind is queued or running (so the inline job cannot overtake an earlier one),
  and the transfer threads start no job while it runs (a job queued meanwhile waits for it,
  and so keeps submission order).

An inline job is the same job: its record, its result (reported, kept for ``poll_finished``),
its counters; ``inline_jobs`` counts them. It has ended when ``submit_*`` returns, so a later
``cancel`` finds it finished, as it would a fast threaded job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.backend import MemoryBackend
from kvtier.devices import tensor_device
from kvtier.manager import LoadPlan, StorePlan
from kvtier.transfer.jobs import JobRecord, LoadRecord, StoreRecord, failed_result
from kvtier.transfer.plain_jobs import PlainJobs
from kvtier.transfer.plan_writes import PlanWrites, delete_from

if TYPE_CHECKING:
    from kvtier.transfer.load_mover import LoadMover
    from kvtier.transfer.movers import MoverHost, StoreMover

__all__ = ["DEFAULT_INLINE_MAX_BYTES", "InlineJobs"]

#: The most bytes a job run inline moves (a 2 MiB-block job of 16 blocks: 32 MiB).
DEFAULT_INLINE_MAX_BYTES = 32 << 20


class InlineJobs:
    """Decides whether a job may run inline and runs it (see the module doc)."""

    def __init__(self, engine: MoverHost, stores: StoreMover, loads: LoadMover, max_bytes: int) -> None:
        self.e = engine
        self.stores = stores
        self.loads = loads
        self.max_bytes = max_bytes
        self._host: dict[int, bool] = {}  # per tier, once known: its pool is in host memory
        self._all_host: bool | None = None  # once known: whether every tier's pool is in host memory
        #: the usual job's straight path (kvtier.transfer.plain_jobs)
        self.plain = PlainJobs(engine)
        self.plans = PlanWrites(engine)  # the undo of an interrupted store

    def _host_memory(self, tier: int) -> bool:
        known = self._host.get(tier)
        if known is None:  # asked at a job's submit, so the tier is open: its pool stays put
            backend = self.e.backends[tier]
            known = self._host[tier] = isinstance(backend, MemoryBackend) and tensor_device(backend.pool).type == "cpu"
        return known

    def _every_tier_host(self) -> bool | None:
        """Whether every tier's pool is in host memory, found once every tier is open (``None``
        while one is not: then the job's own tiers are asked)."""
        try:
            self._all_host = all([self._host_memory(t) for t in range(len(self.e.backends))])
        except Exception:  # a memory tier not open yet, or closed
            return None
        return self._all_host

    def eligible(self, rec: JobRecord) -> bool:
        """Whether ``rec`` may run inline, by its tiers and size (not by what else runs)."""
        if self.e._cuda or self.max_bytes <= 0:
            return False
        block = self.e.layout.block_bytes
        plan = rec.plan
        if self._all_host or (self._all_host is None and self._every_tier_host()):  # no tier to look at
            if type(plan) is LoadPlan:
                return (len(plan.keys) + len(plan.promote)) * block <= self.max_bytes
            if type(plan) is StorePlan and not (plan.write_through or plan.demotions):  # (the usual store)
                return len(plan.keys) * block <= self.max_bytes
        if isinstance(rec, StoreRecord):
            plan = rec.store_plan
            tiers = [plan.tier, *[t for t, _ in plan.drops]]
            blocks = len(plan.keys)
            if plan.write_through or plan.demotions or plan.tags:  # (a store into the first tier alone has none)
                tiers += [t for t, _ in plan.write_through]
                tiers += [t for d in plan.demotions for t in (d.src, d.dst)]
                tiers += [t for t, _, _ in plan.tags]
                blocks += sum(len(ks) for _, ks in plan.write_through)
                blocks += sum(len(d.keys) for d in plan.demotions)
        else:
            assert isinstance(rec, LoadRecord)
            tiers = list(dict.fromkeys(rec.load_plan.tiers))
            if rec.load_plan.promote:
                tiers.append(0)
            blocks = len(rec.load_plan.keys) + len(rec.load_plan.promote)
        return blocks * block <= self.max_bytes and all(self._host_memory(t) for t in tiers)

    def run(self, rec: JobRecord) -> None:
        """Run ``rec`` on this thread, as its transfer thread would (the caller counted it in
        the engine's active jobs; it is given back here, or by the tiers thread when a store
        failed and its clean-up goes there to keep its order).

        An interrupt (a ``BaseException`` that is not an ``Exception``: ``KeyboardInterrupt``,
        ``SystemExit``, a cancellation raised into the thread) goes on up once the job is
        settled (:meth:`_interrupted`): every ``Exception`` is the job's reported failure, but
        an interrupt must stop the caller, and must not leave the engine counting a job that no
        thread will end."""
        ended = False  # the job was reported and given back, or handed on to the tiers thread
        try:
            # the engine's own thread and OpenMP team (or the thread alone: copies.TeamPace)
            with self.e.layout.copies.on_callers_team(len(rec.plan.keys) * self.e.layout.block_bytes):
                if isinstance(rec, StoreRecord):
                    if not self.plain.store(rec):
                        self.stores.device_job(rec, inline=True)
                else:
                    assert isinstance(rec, LoadRecord)
                    if not self.plain.load(rec):
                        self.loads.load_job(rec, inline=True)
                ended = True
        except BaseException:
            self._interrupted(rec, ended)
            raise

    def _interrupted(self, rec: JobRecord, ended: bool) -> None:
        """Settle ``rec``, stopped by an interrupt, in the order its thread would: what it may
        have written undone (a store's evictions run, its new blocks, copies and demoted blocks
        deleted; a load's promotions deleted), then reported failed (its fence and ``done``
        set), then given back (unless it ``ended`` already), then forgotten: ``submit_*``
        raises, so nobody learns its id. The caller releases the plan in the manager with
        :func:`~kvtier.transfer.jobs.plan_failed`, which matches what is left in the tiers.
        The transfer threads start nothing until the caller's claim ends, so this is in order."""
        e = self.e
        if ended and rec.result is None:
            return  # handed on to the tiers thread, which ends it (an interrupt at the very end)
        try:
            if isinstance(rec, StoreRecord):
                self.plans.cleanup(rec.store_plan)
            else:
                assert isinstance(rec, LoadRecord)
                delete_from(e, 0, rec.load_plan.promote, "cleanup of an interrupted load's promotions")
        finally:  # (a tier that raises an interrupt in the undo too: the engine is given back all the same)
            if not ended and not e._finish(rec, failed_result(rec, "interrupted"), retire=True):
                e._retire()  # reported failed meanwhile (a close): given back all the same
            e.take(rec.job_id)
