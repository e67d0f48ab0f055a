"""One home for a job's life: job records, results, and applying a finished job to the manager.

A *job* executes one plan of the :class:`~kvtier.manager.TierManager`: a store job (engine
blocks -> tiers) or a load job (tiers -> engine blocks). Everything that drives jobs (the store
facade :class:`kvtier.KVStore`, the connector, the vLLM adapter) shares what is here, and keeps
no bookkeeping of its own that duplicates it.

API (stable; other modules build on it):

* :class:`JobResult` - how a job ended (also importable from :mod:`kvtier.transfer`).
* :class:`Phase` - where a job is: ``QUEUED`` -> ``DEVICE`` -> ``TIERS`` -> ``DONE``.
  A store job's ``DEVICE`` phase reads the engine blocks (into the first tier or into host
  staging that the job owns); its ``TIERS`` phase writes the tiers (write-back, write-through,
  byte tiers). Fence-before-reuse waits for the end of ``DEVICE`` and nothing else. A load job's
  ``DEVICE`` phase is its whole life (it writes engine blocks up to its end).
* :class:`StoreRecord` / :class:`LoadRecord` (base :class:`JobRecord`) - one job: id, plan,
  engine block ids, phase, deadline; plus the thread-safe signals the transfer engine sets
  (``device_done`` once the engine blocks are no longer touched, ``done`` at the end), each a
  :class:`Signal`.
* :func:`apply_result` ``(manager, plan, result) -> Applied`` - the *only* code that applies a
  finished job to the manager (``complete_store`` / ``complete_load`` / ``remove``). It runs on
  the manager's thread (the event loop, or the engine's scheduler thread).
* :func:`combine_results` - one :class:`JobResult` from the results of several ranks that ran
  the same plan (a key failed on any rank failed; sizes are the largest reported).
* :func:`deadline_at` - the monotonic deadline of a job given a budget in seconds (or ``None``).
* :func:`failed_result` - the result of a job reported failed before it ended;
  :func:`plan_failed` the same from a plan alone.

The fence index and the delete ledger of the connector also belong here (see
:mod:`kvtier.connector`).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.manager import LoadPlan, StorePlan, TierManager

__all__ = [
    "Applied",
    "JobRecord",
    "JobResult",
    "LoadRecord",
    "Phase",
    "QuietCondition",
    "Signal",
    "StoreRecord",
    "apply_result",
    "combine_results",
    "deadline_at",
    "failed_result",
    "plan_failed",
    "result_of",
]

JobKind = Literal["store", "load"]


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a job ended. ``failed[tier]`` lists keys whose write to that tier failed (or never
    happened); ``missed`` lists keys a load could not read (the engine recomputes them), with
    ``missed_tiers`` the tier each was read from; ``sizes[tier]`` gives stored bytes per key for
    the manager's accounting. ``error`` is set when the job as a whole failed (an exception,
    a full queue, a cancellation, a deadline); then no key of it counts as stored or loaded."""

    job_id: int
    kind: JobKind
    success: bool
    keys: tuple[bytes, ...]
    nbytes: int = 0
    seconds: float = 0.0
    failed: dict[int, tuple[bytes, ...]] = field(default_factory=dict)
    missed: tuple[bytes, ...] = ()
    missed_tiers: tuple[int, ...] = ()
    sizes: dict[int, dict[bytes, int]] = field(default_factory=dict)
    error: str | None = None


class _ResultSlots:
    """A :class:`JobResult`'s slots, set by plain attribute stores (the frozen dataclass's own
    ``__init__`` stores each of its eleven fields through ``object.__setattr__``: measured
    here about 6 µs a job right after its copy flushed the caches). :func:`result_of` turns
    one into a :class:`JobResult`, frozen from then on; the layouts are the same, slot for slot."""

    __slots__ = JobResult.__slots__


def result_of(
    job_id: int,
    kind: JobKind,
    success: bool,
    keys: tuple[bytes, ...],
    nbytes: int,
    seconds: float,
    failed: dict[int, tuple[bytes, ...]],
    missed: tuple[bytes, ...],
    missed_tiers: tuple[int, ...],
    sizes: dict[int, dict[bytes, int]],
    error: str | None,
) -> JobResult:
    """``JobResult(...)`` of every field, in field order, for the movers' hot path (a test
    compares the two, and checks the result is as frozen as the dataclass's own)."""
    r = _ResultSlots()
    r.job_id, r.kind, r.success, r.keys, r.nbytes, r.seconds = job_id, kind, success, keys, nbytes, seconds  # type: ignore[attr-defined]
    r.failed, r.missed, r.missed_tiers, r.sizes, r.error = failed, missed, missed_tiers, sizes, error  # type: ignore[attr-defined]
    r.__class__ = JobResult  # type: ignore[assignment]
    return r  # type: ignore[return-value]


class Phase(enum.IntEnum):
    """A job's phase; it only moves forward."""

    QUEUED = 0  #: submitted, the engine blocks not touched yet
    DEVICE = 1  #: reading (store) or writing (load) the engine blocks
    TIERS = 2  #: store only: the engine blocks are released, the tiers are being written
    DONE = 3  #: the result is known


_signals = threading.Lock()  # guards every Signal's flag and the making of its condition


def _after_fork_in_child() -> None:
    global _signals
    _signals = threading.Lock()  # it may have been held by a thread that does not exist here


os.register_at_fork(after_in_child=_after_fork_in_child)


class Signal:
    """A flag set once, with :class:`threading.Event`'s ``set``, ``is_set`` and ``wait``, whose
    condition is made only when a thread waits before the flag is set. Every job has two, and
    most are set before anyone waits (an inline job's always): two events made per job cost
    about 50 µs right after a job's copy had flushed the caches, two of these about 14."""

    __slots__ = ("_cond", "_flag")

    def __init__(self) -> None:
        self._flag = False
        self._cond: threading.Condition | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with _signals:
            self._flag = True
            cond = self._cond
        if cond is not None:  # a waiter made it before the flag was set: wake it
            with cond:
                cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or ``timeout`` seconds have passed; return the flag."""
        if self._flag:
            return True
        with _signals:
            if self._flag:
                return True
            cond = self._cond
            if cond is None:
                cond = self._cond = threading.Condition(threading.Lock())
        with cond:  # a set() from here on takes this lock to notify: no wake-up is lost
            return cond.wait_for(self.is_set, timeout)


class QuietCondition(threading.Condition):
    """A :class:`threading.Condition` whose ``notify_all`` does nothing while no thread waits
    (``waiting``, counted under its lock). The engine notifies two conditions at the end of
    every inline job (``_idle``: nothing runs; ``_inline_done``), where almost never a thread
    waits: right after a 64 MB copy, the two locks with a plain condition's ``notify_all``
    took 30 µs here, with this one's 24 (medians of 380, alternated)."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.waiting = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1  # (the caller holds the lock, as for any wait)
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1  # (the lock is held again here)

    def notify_all(self) -> None:
        if self.waiting:
            super().notify_all()


@dataclass(slots=True, eq=False)
class JobRecord:
    """One job. ``block_ids`` are the engine blocks it reads (store) or writes (load).

    ``deadline`` (``time.monotonic()`` seconds, or ``None``) bounds the job's tier work: past
    it the job is reported failed and its keys released, but never before its device phase has
    ended (a store's engine blocks stay fenced until they have been read; a load is stopped
    before its next write into engine blocks, and waited for if a write is under way)."""

    job_id: int
    plan: StorePlan | LoadPlan
    block_ids: tuple[int, ...]
    deadline: float | None = None
    submitted: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.QUEUED
    #: set by ``cancel`` or a passed deadline: the job stops at its next check.
    cancelled: bool = False
    #: the job's result, once known (``phase`` is then ``DONE``).
    result: JobResult | None = None
    #: engine blocks are no longer read or written by this job (the fence waits for this).
    device_done: Signal = field(default_factory=Signal)
    #: the result is known.
    done: Signal = field(default_factory=Signal)
    #: held while the job touches engine blocks; ``cancel`` takes it to wait for such a copy.
    device_lock: threading.Lock = field(default_factory=threading.Lock)
    #: CUDA event recorded on the engine's compute stream at submit (``None`` on CPU).
    compute_event: Any = None
    #: (loop, future) pairs resolved with the result (``TransferEngine.wait_async``).
    waiters: list[tuple[Any, Any]] = field(default_factory=list)

    @property
    def kind(self) -> JobKind:
        raise NotImplementedError

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (time.monotonic() if now is None else now) >= self.deadline


@dataclass(slots=True, eq=False)
class StoreRecord(JobRecord):
    """A store job: ``plan`` is a :class:`StorePlan`; ``block_ids`` are read in its device phase.
    A ``durable`` job's write-through copies are never deferred (they wait their turn)."""

    durable: bool = False

    @property
    def kind(self) -> JobKind:
        return "store"

    @property
    def store_plan(self) -> StorePlan:
        assert isinstance(self.plan, StorePlan)
        return self.plan


@dataclass(slots=True, eq=False)
class LoadRecord(JobRecord):
    """A load job: ``plan`` is a :class:`LoadPlan`; ``block_ids`` are written."""

    @property
    def kind(self) -> JobKind:
        return "load"

    @property
    def load_plan(self) -> LoadPlan:
        assert isinstance(self.plan, LoadPlan)
        return self.plan


def failed_result(rec: JobRecord, reason: str) -> JobResult:
    """``rec`` reported failed before it ended (cancelled, expired, rejected, closed): every
    write of a store's plan counts as failed (its first tier, write-through and demotion
    targets), a load loaded nothing (:func:`plan_failed`)."""
    return plan_failed(rec.job_id, rec.plan, reason)


def plan_failed(job_id: int, plan: StorePlan | LoadPlan, reason: str) -> JobResult:
    """The result of job ``job_id`` of ``plan`` that failed as a whole: every write of a store
    failed (its first tier, write-through and demotion targets), a load loaded nothing. For
    a caller whose job went up as an interrupt, with no result to take (the engine undid its
    writes): applied to the manager, it releases what the plan holds there."""
    if isinstance(plan, StorePlan):
        failed: dict[int, list[bytes]] = {plan.tier: list(plan.keys)}
        for tier, keys in plan.write_through:
            failed.setdefault(tier, []).extend(keys)
        for d in plan.demotions:
            failed.setdefault(d.dst, []).extend(d.keys)
        return JobResult(
            job_id, "store", False, plan.keys, failed={t: tuple(ks) for t, ks in failed.items() if ks}, error=reason
        )
    return JobResult(job_id, "load", False, tuple(plan.keys), error=reason)


def deadline_at(seconds: float | None, now: float | None = None) -> float | None:
    """The monotonic deadline ``seconds`` from ``now`` (``None``: no deadline)."""
    if seconds is None:
        return None
    return (time.monotonic() if now is None else now) + seconds


@dataclass(frozen=True, slots=True)
class Applied:
    """What :func:`apply_result` did. ``done``: blocks newly stored (store), or the leading
    run of blocks loaded with the right bytes (load); ``lost`` the rest of the plan's keys.
    ``failed_promotions``: in-load promotions released; ``removed``: (key, tier) pairs the
    manager forgot because a load found them missing or corrupt."""

    kind: JobKind
    ok: bool
    done: int
    lost: int
    failed_promotions: tuple[bytes, ...] = ()
    removed: tuple[tuple[bytes, int], ...] = ()


def apply_result(manager: TierManager, plan: StorePlan | LoadPlan, result: JobResult) -> Applied:
    """Apply the finished job ``result`` of ``plan`` to ``manager``; see the module doc.

    Store: pending keys become ready, or are released when the job failed (``result.error``)
    or their write failed (``result.failed``); demoted and written-through copies named in
    ``result.failed`` are dropped. Load: the keys are unpinned, in-load promotions settled, and
    keys the load found missing or corrupt are forgotten in the tier they were read from, but
    for the plan's ``vanished`` keys (already forgotten before the pin: an entry held now is a
    later store or adoption, which the miss says nothing about)."""
    ok = result.error is None
    if isinstance(plan, StorePlan):
        if not plan.keys:
            return Applied("store", ok, 0, 0)
        if not result.failed:  # (the usual job: no comprehension, no set)
            manager.complete_store(plan.keys, ok, sizes=result.sizes)
            stored = len(plan.keys) if ok else 0
            return _applied("store", ok, stored, len(plan.keys) - stored)
        failed = {t: list(ks) for t, ks in result.failed.items()}
        manager.complete_store(plan.keys, ok, sizes=result.sizes, failed=failed)
        stored = len(plan.keys) - len(set(result.failed.get(plan.tier, ()))) if ok else 0
        return Applied("store", ok, stored, len(plan.keys) - stored)
    bad: tuple[bytes, ...] = tuple(plan.promote) if not ok else tuple(result.failed.get(0, ()))
    manager.complete_load(plan.keys, failed_promotions=bad)
    removed: list[tuple[bytes, int]] = []
    valid = 0
    if ok:
        valid = len(plan.keys)
        if not result.missed:  # (the usual load)
            return _applied("load", ok, valid, 0, bad, ())
        gone = plan.vanished  # forgotten before the pin: what is held now is a later copy
        for key, tier in zip(result.missed, result.missed_tiers):
            if key not in gone and manager.remove([key], tier):
                removed.append((key, tier))
        missed = set(result.missed)
        valid = next(i for i, key in enumerate(plan.keys) if key in missed)
    return Applied("load", ok, valid, len(plan.keys) - valid, bad, tuple(removed))


class _AppliedSlots:
    """An :class:`Applied`'s slots, set by plain attribute stores (as :class:`_ResultSlots`)."""

    __slots__ = Applied.__slots__


def _applied(
    kind: JobKind, ok: bool, done: int, lost: int, failed_promotions: tuple[bytes, ...] = (), removed: tuple[tuple[bytes, int], ...] = ()
) -> Applied:
    """``Applied(...)`` made as :class:`_AppliedSlots` (a test compares the two)."""
    a = _AppliedSlots()
    a.kind, a.ok, a.done, a.lost, a.failed_promotions, a.removed = kind, ok, done, lost, failed_promotions, removed  # type: ignore[attr-defined]
    a.__class__ = Applied  # type: ignore[assignment]
    return a  # type: ignore[return-value]


def combine_results(results: Sequence[JobResult]) -> JobResult:
    """One result for a plan that several ranks executed (each its own shard of the blocks)."""
    if not results:
        raise ValueError("results: expected at least one JobResult")
    first = results[0]
    failed: dict[int, set[bytes]] = {}
    sizes: dict[int, dict[bytes, int]] = {}
    missed: dict[bytes, int] = {}
    error = None
    for r in results:
        if r.kind != first.kind:
            raise ValueError(f"results: mixed kinds {first.kind!r} and {r.kind!r}")
        error = error or r.error
        for tier, keys in r.failed.items():
            failed.setdefault(tier, set()).update(keys)
        for tier, per in r.sizes.items():
            mine = sizes.setdefault(tier, {})
            for key, size in per.items():
                mine[key] = max(size, mine.get(key, 0))
        for key, tier in zip(r.missed, r.missed_tiers):
            missed.setdefault(key, tier)
    order = {k: i for i, k in enumerate(first.keys)}
    missed_keys = sorted(missed, key=lambda k: order.get(k, len(order)))
    return JobResult(
        job_id=first.job_id,
        kind=first.kind,
        success=all(r.success for r in results),
        keys=first.keys,
        nbytes=sum(r.nbytes for r in results),
        seconds=max(r.seconds for r in results),
        failed={t: tuple(ks) for t, ks in failed.items() if ks},
        missed=tuple(missed_keys),
        missed_tiers=tuple(missed[k] for k in missed_keys),
        sizes=sizes,
        error=error,
    )
