"""A tier's index kept in step with the records its backend holds, outside the store and load
lifecycle: the manager's ``adopt``, ``adopt_live``, ``remove`` and ``take_stamps``.

* ``adopt``: at open, a persistent tier's records enter its index, oldest stamp first (so the
  eviction order survives a restart); what is beyond the tier's capacity is handed back for
  deletion.
* ``adopt_live``: records another engine stored in a shared tier, while this one runs (a
  follower's feed or sweep): ready at once, announced as ``stored`` events, making room by
  forgetting (never deleting) the tier's least recent unpinned keys.
* ``remove``: keys a read found gone or corrupt leave the index (``removed`` events).
* ``take_stamps``: the access stamps a persistent tier saves, so recency survives a restart.

:class:`RecordSync` holds the manager's tiers, lock and event log; every call holds the lock,
so it is one step between two lifecycle calls. The manager checks that it is open and that the
keys are well formed before it calls in. :func:`adopt_records` builds one tier's entries for a
listing of records, in bulk where the listing allows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import itemgetter

import numpy as np

from kvtier.bulk import RecordColumns
from kvtier.manager.eventlog import EventLog
from kvtier.manager.tenants import TenantBook
from kvtier.manager.tiers import READY, TierState

__all__ = ["RecordSync", "adopt_records"]

Record = tuple[bytes, int, float]


class RecordSync:
    """Adoption, removal and stamps over the manager's ``tiers``; see the module doc.

    ``book`` answers the manager's tenant book as it is (``None`` until a call names a tenant),
    ``tenant_book`` makes it on first use."""

    def __init__(
        self,
        tiers: Sequence[TierState],
        lock: threading.Lock,
        events: EventLog,
        book: Callable[[], TenantBook | None],
        tenant_book: Callable[[], TenantBook],
    ) -> None:
        self._tiers = tiers
        self._indexes = tuple(t.index for t in tiers)
        self._lock = lock
        self._events = events
        self._book = book
        self._tenant_book = tenant_book

    def adopt(self, tier: int, records: Iterable[Record], owners: Mapping[bytes, str] | None = None) -> list[bytes]:
        """``TierManager.adopt``: records into ``tier``'s index at open; the excess returned."""
        with self._lock:
            book = self._book()
            if owners:
                book = self._tenant_book()
                index = self._indexes[tier]
                book.owners.update((key, owner) for key, owner in owners.items() if key not in index)
            excess = adopt_records(self._tiers[tier], records)
            if book is not None:
                book.gone += excess
                book.sweep(self._indexes)
            return excess

    def adopt_live(self, tier: int, records: Iterable[Record]) -> list[bytes]:
        """``TierManager.adopt_live``: another engine's records, ready at once; the keys adopted."""
        with self._lock:
            t = self._tiers[tier]
            index = t.index
            new = [r for r in dict((r[0], r) for r in records).values() if r[0] not in index]
            if not new:
                return []
            need = sum(n for _, n, _ in new) if t.variable else len(new) * t.block
            over = t.used + need - t.capacity
            if over > 0:
                keep = frozenset(r[0] for r in new)
                victims = t.evict(over, keep)
                if victims is None:  # not all of it: forget what may go, adopt what then fits
                    room = t.blocks_that_fit(keep) * t.block - t.free()
                    victims = t.evict(room, keep) if room > 0 else None
                if victims:
                    self._events.add("removed", tuple(victims), t.name)
            excess = adopt_records(t, new)
            gone = set(excess)
            adopted = [r[0] for r in new if r[0] not in gone] if gone else [r[0] for r in new]
            self._events.add("stored", tuple(adopted), t.name)
            return adopted

    def remove(self, keys: Sequence[bytes], tier: int) -> list[bytes]:
        """``TierManager.remove``: forget the ready, unpinned ``keys`` of ``tier``; those removed."""
        with self._lock:
            t = self._tiers[tier]
            get, pins = t.index.get, t.pins
            removed = [key for key in dict.fromkeys(keys) if get(key) and key not in pins]
            t.forget(removed)
            self._events.add("removed", tuple(removed), t.name)  # the list is the caller's
            book = self._book()
            if book is not None:
                book.sweep(self._indexes)
        return removed

    def take_stamps(self, tier: int) -> list[tuple[bytes, float]]:
        """``TierManager.take_stamps``: the stamps recorded since the last call, of keys held."""
        t = self._tiers[tier]
        with self._lock:
            stamps, t.stamps = t.stamps, {}
        index = t.index
        return [(k, s) for k, s in stamps.items() if k in index]


def adopt_records(t: TierState, records: Iterable[Record]) -> list[bytes]:
    """Ready entries of ``t`` for stored records ``(key, stored_bytes, stamp)``, oldest stamp first;
    those beyond the capacity (the oldest) or already present are returned, not adopted."""
    ordered: Sequence[tuple[bytes, int, float]] | RecordColumns
    if isinstance(records, RecordColumns):  # a tier's listing as columns: no tuple per record
        ordered = records.sorted().distinct()
        bulk = _adopt_columns(t, ordered)
        if bulk is not None:
            return bulk
    else:
        ordered = sorted(records, key=itemgetter(2))
    if not t.variable and t.used + len(ordered) * t.block <= t.capacity:
        # A store's open: every record fits. When none is held yet or listed twice, the
        # loop below would adopt them all, in this order; built in C instead (a test
        # compares the two).
        keys = [record[0] for record in ordered]
        fresh = dict.fromkeys(keys, READY)
        if len(fresh) == len(keys) and (not t.index or t.index.keys().isdisjoint(fresh)):
            t.index.update(fresh)
            t.used += len(keys) * t.block
            t.policy.adopt(keys, t.index)
            if t.tenancy is not None:
                t.tenancy.add(keys, t.block)
            return []
    sizes = [n if t.variable else t.block for _, n, _ in ordered]
    total = t.used + sum(sizes)
    excess: list[bytes] = []
    adopted: list[bytes] = []
    for (key, _, _), size in zip(ordered, sizes):
        if total > t.capacity or key in t.index:
            excess.append(key)
            total -= size
            continue
        t.index[key] = READY
        t.used += size
        if t.variable and size != t.block:
            t.sizes[key] = size
        adopted.append(key)
    t.policy.adopt(adopted, t.index)
    if t.tenancy is not None:
        t.tenancy.add_sized((key, t.size_of(key)) for key in adopted)
    return excess

def _adopt_columns(t: TierState, columns: RecordColumns) -> list[bytes] | None:
    """``adopt`` of records listed as columns (oldest first), built in bulk: the same index,
    sizes, order and excess as the record-by-record loop (a test compares the two), or
    ``None`` and no change when a key is listed twice or held already (then the loop runs).
    A listing's ``table`` (its keys, distinct, each mapped to ``READY``) is taken as it is."""
    keys = columns.keys
    fresh = columns.table if columns.table is not None else dict.fromkeys(keys, READY)
    if len(fresh) != len(keys) or (t.index and not t.index.keys().isdisjoint(fresh)):
        return None
    sizes = columns.stored if t.variable else np.full(len(keys), t.block, dtype=np.int64)
    ends = np.cumsum(sizes)
    total = t.used + (int(ends[-1]) if len(keys) else 0)
    drop = 0  # the oldest records beyond the capacity, as the loop drops them
    if total > t.capacity:
        drop = min(len(keys), int(np.searchsorted(ends, total - t.capacity, side="left")) + 1)
        fresh = dict.fromkeys(keys[drop:], READY)
    kept = keys[drop:] if drop else keys
    t.index.update(fresh)
    t.used += int(sizes[drop:].sum())
    if t.variable:  # only the sizes that are not the common one; one int object per distinct size
        odd = np.flatnonzero(sizes[drop:] != t.block)
        if len(odd):
            distinct, which = np.unique(sizes[drop:][odd], return_inverse=True)
            t.sizes.update(zip(map(kept.__getitem__, odd.tolist()), map(distinct.tolist().__getitem__, which.tolist())))
    t.policy.adopt(kept, t.index)
    if t.tenancy is not None:
        t.tenancy.add_sized((key, t.size_of(key)) for key in kept)
    return keys[:drop]
