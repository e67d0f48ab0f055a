"""The deadline watchdog of :class:`kvtier.transfer.TransferEngine` (``deadline_s``): jobs past
their deadline are stopped and reported failed (``expired_jobs``), a store never before its
device read ended. Runs on ``kvtier-deadline``; the engine is passed in as a
:class:`DeadlineHost`, so this module never imports the engine's."""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from kvtier.transfer.jobs import JobRecord

__all__ = ["DeadlineHost", "DeadlineWatch"]

log = logging.getLogger("kvtier.transfer")


class DeadlineHost(Protocol):
    """What the watchdog uses of the engine."""

    deadline_s: float | None
    _lock: threading.Lock
    _jobs: dict[int, JobRecord]
    _wake: threading.Event
    _kick: threading.Event

    def _stop(self, rec: JobRecord, reason: str, *, allow_tier_phase: bool, counter: str) -> bool: ...


class DeadlineWatch:
    """Finds and stops the overdue jobs of one engine."""

    def __init__(self, engine: DeadlineHost) -> None:
        self.e = engine
        #: When the watchdog checks next (monotonic; 0 while it checks). A job due later needs
        #: no wake-up call: waking the thread at every submit cost each job a thread switch.
        self.wake_at = 0.0

    def needs_kick(self, deadline: float) -> bool:
        """Whether a job just added with ``deadline`` is due before the next check."""
        return deadline < self.wake_at

    def expire_overdue(self, now: float | None = None) -> int:
        """Fail the jobs whose deadline has passed; return how many. A store still reading
        engine blocks is waited for, never reported before."""
        e = self.e
        now = time.monotonic() if now is None else now
        overdue: list[JobRecord] = []
        with e._lock:
            for rec in e._jobs.values():
                if rec.result is None and rec.deadline is not None:
                    if rec.deadline > now:
                        break  # deadlines follow submission order
                    overdue.append(rec)
        count = 0
        for rec in overdue:
            if e._stop(rec, f"deadline of {e.deadline_s} s passed", allow_tier_phase=True, counter="expired_jobs"):
                count += 1
                log.warning(
                    "transfer job %d (%s, %d keys) passed its %.3g s deadline: failed, its keys released",
                    rec.job_id,
                    rec.kind,
                    len(rec.plan.keys),
                    e.deadline_s,
                )
        return count

    def run(self) -> None:
        """The watchdog thread: check at the next deadline (at least once a second) until the
        engine closes."""
        e = self.e
        while not e._wake.is_set():
            self.wake_at = 0.0  # a job added from now on wakes the thread: it may be missed below
            try:
                self.expire_overdue()
            except Exception as exc:  # the watchdog must survive anything
                log.warning("deadline check failed: %s", exc, exc_info=True)
            with e._lock:
                pending = [r.deadline for r in e._jobs.values() if r.result is None and r.deadline is not None]
            now = time.monotonic()
            wait = min(1.0, max(0.001, 1.0 if not pending else min(pending) - now))
            self.wake_at = now + wait  # set after ``pending`` was read: a job added since is checked
            e._kick.wait(wait)
            e._kick.clear()
