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
keys are well formed before it calls in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvtier.manager.eventlog import EventLog
from kvtier.manager.tenants import TenantBook
from kvtier.manager.tiers import TierState

__all__ = ["RecordSync"]

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
            excess = self._tiers[tier].adopt(records)
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
            excess = t.adopt(new)
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
