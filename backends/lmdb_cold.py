"""The cold rest of an ``lmdb`` job (:class:`ColdRead`): its keys looked up on a thread of their
own while the calling thread copies and checks what was found (see
:meth:`kvtier.backends.lmdb_layout.JobReader.read`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import lmdb
import torch
from kvtier.backends.lmdb_entries import ReadOutcome

from kvtier.records.format import RecordMac

__all__ = ["ColdRead", "JobReading"]


class _Temperature(Protocol):
    cold: bool

    def begin(self) -> None: ...

    def slow(self, start: float) -> bool: ...


class JobReading(Protocol):
    """What a cold read needs of the reader of its job (a ``JobReader``)."""

    @property
    def temperature(self) -> _Temperature: ...

    def pair(self, txn: lmdb.Transaction, key: bytes, bad: dict[bytes, str]) -> tuple[Any, Any] | None: ...

    def drop(self, outcome: ReadOutcome, key: bytes, exc: lmdb.Error) -> None: ...

    def copy_in(
        self,
        where: Iterable[int],
        keys: Sequence[bytes],
        out: Sequence[torch.Tensor],
        pairs: Sequence[Any],
        mac: RecordMac | None,
        outcome: ReadOutcome,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None: ...


class ColdRead:
    """The cold rest of a job (see :meth:`JobReader.read`): a thread of its own looks up the
    remaining keys one after the other, in the job's read transaction, and hands each pair over
    as it is found; the calling thread copies and checks what has been handed over meanwhile, in
    batches of whatever is ready. The calling thread makes no LMDB call while the thread runs, and waits
    for it before the transaction may end, so the transaction is never used by two threads at
    once and no buffer outlives it.

    An LMDB error on a key stops the lookups there: the key is bad, and :meth:`run` returns
    the position after it, for the caller to read the rest in a fresh transaction."""

    def __init__(
        self, reader: JobReading, txn: lmdb.Transaction, keys: Sequence[bytes], outcome: ReadOutcome, clock: Callable[[], float]
    ) -> None:
        self.reader = reader
        self.clock = clock
        self.txn = txn
        self.keys = keys
        self.outcome = outcome
        self.ready: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.failed_at: int | None = None
        self.slow = False  # a lookup of this job read from disk

    def run(self, first: list[Any], out: Sequence[torch.Tensor], mac: RecordMac | None, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> int | None:
        """Read the job whose first ``len(first)`` pairs were looked up (the last one slowly);
        the position to go on from in a fresh transaction, or ``None`` when every key was
        looked up."""
        self.slow = bool(first)  # the last of them was slow
        thread = threading.Thread(target=self._look_up, args=(len(first),), name="kvtier-lmdb-cold", daemon=True)
        thread.start()
        try:
            self.reader.copy_in(range(len(first)), self.keys, out, first, mac, self.outcome, copies)
            ended = False
            while not ended:
                batch = [self.ready.get()]
                while True:
                    try:
                        batch.append(self.ready.get_nowait())
                    except queue.Empty:
                        break
                ended = batch[-1] is None
                taken = [b for b in batch if b is not None]
                self.reader.copy_in([i for i, _ in taken], self.keys, out, [p for _, p in taken], mac, self.outcome, copies)
        finally:
            self.stop.set()
            thread.join()
        if not self.slow and self.failed_at is None:
            self.reader.temperature.cold = False  # every value was in memory: warm again
        return None if self.failed_at is None else self.failed_at + 1

    def _look_up(self, start: int) -> None:
        bad = self.outcome.bad
        self.reader.temperature.begin()
        try:
            for i in range(start, len(self.keys)):
                if self.stop.is_set():
                    return
                key = self.keys[i]
                try:
                    began = self.clock()
                    pair = None if key in bad or key in self.outcome.transient else self.reader.pair(self.txn, key, bad)
                    self.slow = self.slow or self.reader.temperature.slow(began)
                except lmdb.Error as exc:
                    self.reader.drop(self.outcome, key, exc)
                    self.failed_at = i
                    return
                self.ready.put((i, pair))
        finally:
            self.ready.put(None)
