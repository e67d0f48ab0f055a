"""Bulk work on millions of objects, with the cyclic garbage collector paused meanwhile.

Opening a tier of 10^6 records builds millions of short-lived container objects (the records
listed, the tuples the manager adopts, the page walk's keys). Every 700 allocations start a young
collection, and each growth of the old generation by a quarter a full one that visits every
tracked object: at 10^6 LMDB records that was a fifth of a store's open
(``benchmarks/bench_scale.py``). Nothing built there forms a reference cycle, so a pause loses
nothing: the collector runs again as soon as the outermost pause ends.

The pause is process-wide and nests across threads (a counter under a lock): the first to enter
disables the collector, the last to leave re-enables it, and only if it was enabled before.
"""

from __future__ import annotations

import gc
import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

__all__ = ["READY", "RecordColumns", "paused_gc", "unpooled"]

#: The mark of a ready key in the manager's index (``kvtier.manager.tiers``), and so the value of
#: every key in a :class:`RecordColumns` ``table``.
READY = 1

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off (see the module doc)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


@dataclass(frozen=True, slots=True)
class RecordColumns:
    """Records a persistent tier lists at open, as columns: ``keys`` (``bytes``), ``stored``
    (stored bytes) and ``stamps`` (last access), one row per record, oldest stamp first when
    ``oldest_first``. Iterating gives the ``(key, stored_bytes, stamp)`` tuples of the general
    listing; the manager's adoption takes the key column as it is (no tuple per record), and
    keeps it: ``keys`` is handed over to the tier's eviction order, which changes it as keys
    are used (a lister builds it for the adoption and keeps no use of it).

    ``table``, where the lister built one anyway (the ``redis`` tier gathers its ``SCAN`` replies
    into a dict, which drops the keys a server lists twice): the same keys, distinct, in the same
    order, each mapped to :data:`READY`. The manager's index then takes it in one C-level copy
    instead of hashing every key into a table of its own after the listing.

    ``repeats``: the listing may name a key more than once (the ``redis`` tier's key log names a
    key at each write; its listing thread gathers the keys into one list and builds no table,
    whose outgrown tables would stay free on that thread's heap). :meth:`distinct` keeps each
    key's first row, on the thread that adopts; the manager's adoption calls it."""

    keys: list[bytes]
    stored: np.ndarray
    stamps: np.ndarray
    oldest_first: bool = False
    table: dict[bytes, int] | None = None
    repeats: bool = False

    def __post_init__(self) -> None:
        if not len(self.keys) == len(self.stored) == len(self.stamps):
            raise ValueError(f"record columns of {len(self.keys)} keys, {len(self.stored)} sizes and {len(self.stamps)} stamps")
        if self.table is not None and len(self.table) != len(self.keys):
            raise ValueError(f"record columns of {len(self.keys)} keys and a table of {len(self.table)}")
        if self.table is not None and self.repeats:
            raise ValueError("record columns with a table name each key once: repeats must be false")

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[tuple[bytes, int, float]]:
        return zip(self.keys, self.stored.tolist(), self.stamps.tolist())

    def sorted(self) -> RecordColumns:
        """Oldest stamp first; records of equal stamps keep their order (as ``sorted`` does)."""
        if self.oldest_first:
            return self
        order = np.argsort(self.stamps, kind="stable")
        keys = self.keys
        # The table's order is the listing's: dropped, the adopter builds its own.
        return RecordColumns([keys[i] for i in order.tolist()], self.stored[order], self.stamps[order], oldest_first=True, repeats=self.repeats)

    def distinct(self) -> RecordColumns:
        """The records with each key's first row only, and their ``table``; ``self`` unless
        ``repeats``. Where no key repeats, the key column is the same list."""
        if not self.repeats:
            return self
        keys = self.keys
        table = dict.fromkeys(keys, READY)
        if len(table) == len(keys):
            return RecordColumns(keys, self.stored, self.stamps, self.oldest_first, table=table)
        first: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        rows = np.fromiter(first.values(), dtype=np.intp, count=len(first))
        return RecordColumns(list(first), self.stored[rows], self.stamps[rows], self.oldest_first, table=dict.fromkeys(first, READY))


def unpooled(n: int, dtype: str | np.dtype) -> np.ndarray:
    """An uninitialised array of ``n`` ``dtype`` in pages of its own (an anonymous mapping),
    handed back to the system when the array is dropped, whatever the allocator's thresholds
    are by then. For the columns a tier's open lists: allocated by the open's thread and freed
    by another once the manager has adopted them, from malloc (whose mmap threshold the open's
    freed temporaries have raised) they stayed resident at the top of that thread's arena
    (about 25 B a key at 10^5, see ``docs/tiers.md``)."""
    size = n * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, size), dtype=dtype) if size else np.empty(0, dtype=dtype)
