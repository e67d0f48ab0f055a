"""The byte movers behind :class:`kvtier.transfer.TransferEngine` (see that module for the
contract): :class:`StoreMover` runs a store job's two phases, the device read on
``kvtier-store`` and the tier writes on ``kvtier-store-tiers`` (taking the jobs waiting as one
group, :mod:`kvtier.transfer.write_group`); :class:`~kvtier.transfer.load_mover.LoadMover` runs
load jobs on ``kvtier-load``. They share the engine's locks, counters and queues. A store plan's
work between tiers (evictions, demotions, tags, copies, undo) is
:class:`~kvtier.transfer.plan_writes.PlanWrites`'s, in either phase."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvtier.backend import Backend, MemoryBackend
from kvtier.devices import tensor_device, wait_for_copies
from kvtier.errors import LifecycleError
from kvtier.manager import StorePlan
from kvtier.transfer.jobs import JobRecord, JobResult, LoadRecord, Phase, StoreRecord, failed_result, result_of
from kvtier.transfer.plan_writes import Expired, Failed, PlanWrites, TierWork, check_alive, note_sizes, rows_of
from kvtier.transfer.tier_rows import rows_at, rows_for
from kvtier.transfer.write_group import MAX_GROUP_JOBS, WriteGroup, host_rows

if TYPE_CHECKING:
    import contextlib
    import threading

    from kvtier.transfer.layout import KVLayout

log = logging.getLogger("kvtier.transfer")


class MoverHost(Protocol):
    """What the movers use of the engine that runs them (``TransferEngine``), passed in at
    construction so this module never imports the engine's."""

    layout: KVLayout
    backends: list[Backend]
    counters: dict[str, int]
    write_through_backlog: int
    _cuda: bool
    _lock: threading.Lock
    _max_staged: int
    _staged_bytes: int
    _tier_jobs: int
    _store_q: queue.SimpleQueue[StoreRecord | None]
    _tiers_q: queue.SimpleQueue[TierWork | None]
    _load_q: queue.SimpleQueue[LoadRecord | None]

    def _retire(self) -> None: ...
    def take(self, job_id: int) -> JobResult | None: ...
    def _finish(self, rec: JobRecord, result: JobResult, counter: str | None = None, *, retire: bool = False) -> bool: ...
    def _take(self, kind: str) -> None: ...
    def _after_inline(self) -> None: ...
    def _on_stream(self, direction: str) -> contextlib.AbstractContextManager[Any]: ...
    def _is_memory(self, tier: int) -> bool: ...
    def _wait_compute(self, rec: JobRecord) -> None: ...
    def _sync(self) -> None: ...
    def _staging_rows(self, direction: str) -> torch.Tensor: ...


def reserve_slots(target: MemoryBackend, plan: StorePlan, victims: Sequence[bytes] | None = None) -> list[int]:
    """Slots of ``target`` for the plan's new blocks (the manager reserved the room already);
    ``victims``: the plan's evictions from ``target``, deleted first in the same call."""
    slots = target.reserve(plan.keys) if victims is None else target.evict_and_reserve(victims, plan.keys)
    if slots is None:
        raise no_free_slots(plan)
    return slots


def no_free_slots(plan: StorePlan) -> LifecycleError:
    """The error of a tier with no free slots for ``plan``'s new blocks, room the manager had
    reserved: its accounting is off."""
    return LifecycleError(f"tier {plan.tier}: no free slots for {len(plan.keys)} blocks; the manager's accounting is off")


def hand_to_tiers(engine: MoverHost, work: TierWork) -> None:
    """The tiers thread takes a store job from here (after its device phase), counted as one
    of the jobs in that thread."""
    with engine._lock:
        engine._tier_jobs += 1
    engine._tiers_q.put(work)


class StoreMover:
    """A store job's device read, then its tier writes (evictions, demotions, the staged
    blocks, write-through), each phase on its own thread, jobs in submission order."""

    def __init__(self, engine: MoverHost) -> None:
        self.e = engine
        self._plans = PlanWrites(engine)
        self._group_size = 1  # store jobs in the group the tiers thread runs

    def run_device(self) -> None:
        while True:
            rec = self.e._store_q.get()
            if rec is None:
                self.e._tiers_q.put(None)
                return
            self.e._take("store")
            self.e._after_inline()
            self.device_job(rec)

    def device_job(self, rec: StoreRecord, *, inline: bool = False) -> None:
        """Run ``rec``'s device phase; hand the tier work left to the tiers thread. ``inline``
        (a job on its caller's thread): an interrupt goes up at once, nothing handed on, for
        the caller to settle (:meth:`InlineJobs.run <kvtier.transfer.inline.InlineJobs.run>`)."""
        try:
            if self.e._cuda:
                with self.e._on_stream("store"):
                    work = self._device_phase(rec)
            else:  # no stream on the host: no context manager made per job
                work = self._device_phase(rec)
        except BaseException as exc:  # never reached in practice but by an interrupt; the thread must survive
            if inline and not isinstance(exc, Exception):
                raise
            log.warning("store job %d: device phase failed: %s", rec.job_id, exc, exc_info=True)
            rec.device_done.set()
            # Stopped anywhere (a demotion done, a copy half written): reported failed with every
            # write of its plan, and all of them deleted by the tiers thread, in order.
            self.e._finish(rec, failed_result(rec, repr(exc)))
            work = TierWork(rec, "cleanup", time.perf_counter())
        if work is None:
            pass  # reported and given back at once (_finish_store(retire=True))
        else:
            hand_to_tiers(self.e, work)

    def _device_phase(self, rec: StoreRecord) -> TierWork | None:
        """Read the engine blocks; return the tier work left, or ``None`` when the job is done."""
        plan = rec.store_plan
        start = time.perf_counter()
        try:
            if rec.result is not None:
                raise Expired  # stopped before it began
            with self.e._lock:
                tiers_idle = self.e._tier_jobs == 0
            memory = self.e._is_memory
            direct = (
                tiers_idle
                and not plan.tags  # saved by the tiers thread, never on the device's
                and memory(plan.tier)
                and (not plan.drops or all(memory(t) for t, _ in plan.drops))
                and (not plan.demotions or all(memory(d.src) and memory(d.dst) for d in plan.demotions))
            )
            work = self._store_direct(rec, start) if direct else self._store_staged(rec, start)
        except Expired:
            work = TierWork(rec, "cleanup", start)
        finally:
            rec.device_done.set()  # the engine blocks were read, or never will be
        if work.mode == "done":
            if self._finish_store(work, retire=True):
                return None
            return TierWork(rec, "cleanup", start)  # reported failed meanwhile: undo, in order
        return work

    def _read_engine_blocks(self, rec: StoreRecord, read: Callable[[], object]) -> None:
        """Run ``read`` (the copy out of the engine blocks) after the compute stream as it was at
        submit, and wait for it; raise ``Expired`` instead if the job was stopped."""
        with rec.device_lock:
            if rec.cancelled or rec.result is not None:
                raise Expired
            rec.phase = Phase.DEVICE
            cuda = self.e._cuda  # (on the host, neither a stream to wait on nor one to sync)
            try:
                if cuda:
                    self.e._wait_compute(rec)
                read()
            finally:
                try:
                    # Also after a failure between two chunks: the chunks already queued
                    # still read engine blocks and write the job's rows, which are freed next.
                    if cuda:
                        self.e._sync()
                finally:
                    rec.phase = Phase.TIERS
                    rec.device_done.set()

    def _store_direct(self, rec: StoreRecord, start: float) -> TierWork:
        """Everything in memory tiers, on this thread; byte write-through is left to phase 2."""
        plan = rec.store_plan
        work = TierWork(rec, "done", start)
        staging = self.e._staging_rows("store")
        self._plans.drops_and_demotions(plan, staging, work, check=True)
        target = self.e.backends[plan.tier]
        assert isinstance(target, MemoryBackend)
        try:
            if plan.keys:
                slots = reserve_slots(target, plan)
                ids = list(rec.block_ids)
                self._read_engine_blocks(
                    rec, lambda: self.e.layout.gather(ids, target.pool, slots, non_blocking=True, kept=True, checked=True)
                )
                work.nbytes = len(slots) * self.e.layout.block_bytes
            byte_tiers = []
            for tier, keys in plan.write_through:
                if self.e._is_memory(tier):
                    check_alive(rec)
                    self._plans.write_from(target, tier, keys, staging, work.failed, work.sizes)
                else:
                    byte_tiers.append(tier)
        except Expired:
            raise
        except Exception as exc:
            log.warning("store job %d failed: %s", rec.job_id, exc, exc_info=True)
            self._plans.delete_new(plan)
            work.error = repr(exc)
            return work
        if byte_tiers:
            work.mode = "rest"
        return work

    def _store_staged(self, rec: StoreRecord, start: float) -> TierWork:
        """Copy the engine blocks into staging the job owns; the tiers thread does the rest."""
        plan = rec.store_plan
        if not plan.keys:
            return TierWork(rec, "staged", start)
        need = len(plan.keys) * self.e.layout.block_bytes
        with self.e._lock:
            room = self.e._staged_bytes == 0 or self.e._staged_bytes + need <= self.e._max_staged
            if room:
                self.e._staged_bytes += need
                self.e.counters["staged_jobs"] += 1
            else:
                self.e.counters["staging_full"] += 1
        if not room:
            log.warning(
                "store job %d: %d bytes of staging in use, its %d keys are not stored",
                rec.job_id,
                self.e._staged_bytes,
                len(plan.keys),
            )
            return TierWork(rec, "degraded", start, error="the store staging is full")
        work = TierWork(rec, "staged", start, staged_bytes=need)
        try:
            target = self.e.backends[plan.tier]
            device = tensor_device(target.pool) if isinstance(target, MemoryBackend) else torch.device("cpu")
            pin = device.type == "cpu" and self.e._cuda
            staging = work.staging = torch.empty(
                (len(plan.keys), self.e.layout.block_bytes), dtype=torch.uint8, device=device, pin_memory=pin
            )
            ids = list(rec.block_ids)
            self._read_engine_blocks(
                rec, lambda: self.e.layout.gather(ids, staging, range(len(plan.keys)), non_blocking=True)
            )
        except Expired:
            work.mode, work.staging = "cleanup", None  # the tiers thread gives the staging budget back
        except BaseException as exc:
            if not isinstance(exc, Exception):  # an interrupt goes up: its staging budget given back first
                with self.e._lock:
                    self.e._staged_bytes -= need
                raise
            log.warning("store job %d: reading its blocks failed: %s", rec.job_id, exc, exc_info=True)
            work.mode, work.error, work.staging = "degraded", repr(exc), None
        return work

    def run_tiers(self) -> None:
        """Take every store job waiting (up to ``MAX_GROUP_JOBS``) as one group: their tier
        phases in order, their write-through copies written together, then each reported
        (:mod:`kvtier.transfer.write_group`)."""
        while True:
            work = self.e._tiers_q.get()
            if work is None:
                return
            group = [work]
            last = False
            while len(group) < MAX_GROUP_JOBS:
                try:
                    more = self.e._tiers_q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    last = True
                    break
                group.append(more)
            self.e._after_inline()
            self._run_group(group)
            if last:
                return

    def _run_group(self, group: list[TierWork]) -> None:
        copies = WriteGroup()
        ending: list[TierWork] = []
        self._group_size = len(group)
        try:
            for work in group:
                try:
                    with self.e._on_stream("tiers"):
                        if self._tier_phase(work, copies):
                            ending.append(work)
                except BaseException as exc:  # the thread must survive anything
                    copies.discard(work.rec.job_id)
                    self._failed_phase(work, exc)
            try:
                with self.e._on_stream("tiers"):
                    copies.write(self.e.backends)
            except BaseException as exc:  # (write() fails the jobs of a tier that raised itself)
                log.warning("store jobs %s: group write failed: %s", [w.rec.job_id for w in ending], exc, exc_info=True)
            for work in ending:
                try:
                    self._end_phase(work)
                except BaseException as exc:
                    self._failed_phase(work, exc)
        finally:
            self._group_size = 1
            for work in group:
                self.e._retire()
                with self.e._lock:
                    self.e._tier_jobs -= 1
                    self.e._staged_bytes -= work.staged_bytes
                work.staging = None

    def _failed_phase(self, work: TierWork, exc: BaseException) -> None:
        """A tier phase that raised (an interrupt: it handles each ``Exception`` itself), stopped
        anywhere: reported failed with every write of its plan, then all of them deleted (before
        the group's end gives it back), unless it was reported already."""
        rec = work.rec
        log.warning("store job %d: tier phase failed: %s", rec.job_id, exc, exc_info=True)
        if self.e._finish(rec, failed_result(rec, repr(exc))):
            try:
                self._plans.cleanup(rec.store_plan)
            except BaseException as again:  # the thread must survive anything
                log.warning("store job %d: its clean-up failed: %s", rec.job_id, again, exc_info=True)

    def _tier_phase(self, work: TierWork, copies: WriteGroup) -> bool:
        """The job's tier writes, its write-through copies collected into ``copies`` where their
        rows stay put; ``True`` when the job is to be reported (:meth:`_end_phase`) after the
        group's write."""
        rec, plan = work.rec, work.rec.store_plan
        staging = self.e._staging_rows("tiers")
        try:
            if work.mode == "cleanup" or rec.result is not None:
                raise Expired
            if work.mode in ("staged", "degraded"):
                self._plans.drops_and_demotions(plan, staging, work, check=True)
            if work.mode == "staged" and plan.keys:
                assert work.staging is not None
                self._write_staged(work, copies)
            elif work.mode == "rest":
                source = self.e.backends[plan.tier]
                assert isinstance(source, MemoryBackend)
                for tier, keys in plan.write_through:
                    if not self.e._is_memory(tier) and not self._deferred(rec, tier, keys, work.failed):
                        check_alive(rec)
                        if tensor_device(source.pool).type == "cpu":  # pool rows stay put: write with the group
                            rows, found = rows_of(source, keys, staging, self.e.backends[tier])
                            copies.add(rec.job_id, tier, keys, rows, found, work.failed, work.sizes, self._failer(work))
                        else:
                            self._plans.write_from(source, tier, keys, staging, work.failed, work.sizes)
            check_alive(rec)
        except Expired:
            copies.discard(rec.job_id)
            self._plans.cleanup(plan)
            return False
        except Exception as exc:
            copies.discard(rec.job_id)
            log.warning("store job %d failed: %s", rec.job_id, exc, exc_info=True)
            self._plans.delete_new(plan)
            work.error = repr(exc)
        return True

    def _failer(self, work: TierWork) -> Callable[[str], None]:
        """What a failed group write does to ``work``: what a failed direct write did."""

        def fail(error: str) -> None:
            self._plans.delete_new(work.rec.store_plan)
            work.error = error

        return fail

    def _end_phase(self, work: TierWork) -> None:
        """Report ``work`` after its group's write (undo it if it was reported failed meanwhile)."""
        plan = work.rec.store_plan
        if work.mode == "degraded":
            self._plans.delete_new(plan)
        if not self._finish_store(work):
            self._plans.cleanup(plan)  # reported failed while it ran: undo what it wrote

    def _write_staged(self, work: TierWork, copies: WriteGroup) -> None:
        rec, plan = work.rec, work.rec.store_plan
        assert work.staging is not None
        staging = work.staging
        target = self.e.backends[plan.tier]
        if isinstance(target, MemoryBackend):
            slots = reserve_slots(target, plan)
            pool = target.pool
            pool.index_copy_(0, torch.tensor(slots, dtype=torch.long, device=tensor_device(pool)), work.staging)
            wait_for_copies((pool, work.staging))
            work.nbytes = len(slots) * self.e.layout.block_bytes
        else:
            got = target.write_blocks(list(plan.keys), rows_for(target, staging, len(plan.keys)))
            note_sizes(plan.tier, plan.keys, got, work.failed, work.sizes)
            work.nbytes = sum(self.e.layout.block_bytes for s in got if s is not None)
        writes = []
        for tier, keys in plan.write_through:
            check_alive(rec)
            if self.e._is_memory(tier) or not self._deferred(rec, tier, keys, work.failed):
                writes.append((tier, self.e._is_memory(tier), keys))
        pos = {k: i for i, k in enumerate(plan.keys)}  # the job's own staging: stays put
        host: dict[int, torch.Tensor] = {}
        if tensor_device(work.staging).type != "cpu":  # byte tiers read host rows: one DMA per job
            host = host_rows(work.staging, [pos[k] for _, memory, keys in writes if not memory for k in keys])
        for tier, memory, keys in writes:
            if host and not memory:
                src: Sequence[torch.Tensor] = [host[pos[k]] for k in keys]
            else:  # rows of the job's staging: one PoolRows where the tier takes it
                src = rows_at(self.e.backends[tier], staging, [pos[k] for k in keys])
            copies.add(rec.job_id, tier, keys, src, [True] * len(keys), work.failed, work.sizes, self._failer(work))

    def _deferred(self, rec: StoreRecord, tier: int, keys: Sequence[bytes], failed: Failed) -> bool:
        """Skip this write-through copy when the tiers thread is behind: more than the engine's
        ``write_through_backlog`` jobs wait behind this one; the keys are reported failed for
        ``tier``, so the manager keeps them in the first tier only and demotes them at eviction.
        A durable job's copies are never skipped."""
        if rec.durable:
            return False
        with self.e._lock:
            # _tier_jobs counts this job's group too, until it ends: those share its write.
            waiting = self.e._tier_jobs - self._group_size
            behind = waiting > self.e.write_through_backlog
            if behind:
                self.e.counters["write_through_deferred"] += len(keys)
        if behind:
            failed.setdefault(tier, []).extend(keys)
            log.debug("write-through of %d blocks to tier %d deferred: the tier writes are behind", len(keys), tier)
        return behind

    def _finish_store(self, work: TierWork, *, retire: bool = False) -> bool:
        rec, failed, error = work.rec, work.failed, work.error
        plan = rec.store_plan
        ok = error is None and not failed.get(plan.tier)
        seconds = time.perf_counter() - work.start
        lost = {t: tuple(ks) for t, ks in failed.items() if ks} if failed else {}
        result = result_of(rec.job_id, "store", ok, plan.keys, work.nbytes if error is None else 0, seconds, lost, (), (), work.sizes, error)
        return self.e._finish(rec, result, retire=retire)


