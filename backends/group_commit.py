"""Group commit: callers that wait for a durable commit together share one.

A caller hands its batch to :meth:`GroupCommit.submit` and blocks until the batch is committed.
When no commit is running, the caller becomes the leader: it takes every batch waiting (its own
first, then those that arrived meanwhile, in arrival order) and commits them with one call of
``commit``. Callers that arrive while a commit runs queue up, and the first of them to wake
leads the next commit with all of them. No thread of its own: the callers do the work, so a
lone caller commits at once, with no hand-off.

``commit(batches)`` returns one result per batch, in order. An exception it raises is raised by
every caller of that group (each batch is reported failed; nothing is acknowledged that was not
committed). Durability is the committer's: a result means the batch is on stable storage.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["GroupCommit"]

B = TypeVar("B")
R = TypeVar("R")


class _Ticket(Generic[B, R]):
    __slots__ = ("batch", "done", "error", "result")

    def __init__(self, batch: B) -> None:
        self.batch = batch
        self.done = False
        self.result: R | None = None
        self.error: BaseException | None = None


class GroupCommit(Generic[B, R]):
    """Commits the batches of callers that wait together with one ``commit`` call (see the
    module doc). ``groups`` and ``batches`` count the commits made and the batches they held."""

    def __init__(self, commit: Callable[[list[B]], list[R]]) -> None:
        self._commit = commit
        self._cond = threading.Condition(threading.Lock())
        self._waiting: list[_Ticket[B, R]] = []
        self._busy = False
        self.groups = 0
        self.batches = 0

    def submit(self, batch: B) -> R:
        """Commit ``batch`` (with whatever else waits) and return its result."""
        ticket: _Ticket[B, R] = _Ticket(batch)
        with self._cond:
            self._waiting.append(ticket)
            while self._busy and not ticket.done:
                self._cond.wait()
            if not ticket.done:
                self._busy = True
                group, self._waiting = self._waiting, []
        if not ticket.done:
            self._lead(group)
        if ticket.error is not None:
            raise ticket.error
        return ticket.result  # type: ignore[return-value]

    def _lead(self, group: list[_Ticket[B, R]]) -> None:
        try:
            results = self._commit([t.batch for t in group])
            if len(results) != len(group):
                raise RuntimeError(f"group commit: {len(results)} results for {len(group)} batches")
            for t, result in zip(group, results):
                t.result = result
        except BaseException as exc:  # every batch of the group failed with it
            for t in group:
                t.error = exc
        finally:
            with self._cond:
                self.groups += 1
                self.batches += len(group)
                for t in group:
                    t.done = True
                self._busy = False
                self._cond.notify_all()
