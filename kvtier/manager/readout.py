"""The manager's counters and stats, as a metrics scrape reads them from any thread.

:class:`Readout` copies under the manager's lock, which every call that changes state holds,
so a snapshot is one consistent moment; it costs the same however many keys the tiers hold.
Lookups take no lock: their counters are read by :func:`~kvtier.manager.lookups.read_counters`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sized
from typing import Any

from kvtier.manager.eventlog import EventLog
from kvtier.manager.lookups import read_counters
from kvtier.manager.tenant_ops import TenantControl
from kvtier.manager.tenants import TenantBook
from kvtier.manager.tiers import TierState

__all__ = ["COUNTERS", "Readout"]

#: the manager's own counters (after the lookup counters, and before ``events_dropped``)
COUNTERS = (
    "store_prepared",
    "store_skipped",
    "store_rejected",
    "store_partial",
    "store_completed",
    "store_failed",
    "load_prepared",
    "promotions",
    "promotions_failed",
    "promotions_prepared",
    "promotions_rejected",
)


class Readout:
    """``counters`` and ``stats`` of a manager: ``counts`` (its counters, changed in place),
    ``lookups`` (the batched lookups' packed counts), ``single`` (single-key hits and misses),
    ``plans`` (the open plans), ``book`` (its tenant book, ``None`` until a tenant is named)."""

    def __init__(
        self,
        tiers: list[TierState],
        lock: threading.Lock,
        counts: dict[str, int],
        events: EventLog,
        *,
        lookups: Callable[[], int],
        single: Callable[[], tuple[int, int]],
        plans: Sized,
        book: Callable[[], TenantBook | None],
        tenants: TenantControl,
    ) -> None:
        self._tiers = tiers
        self._lock = lock
        self._counts = counts
        self._events = events
        self._lookups = lookups
        self._single = single
        self._plans = plans
        self._book = book
        self._tenants = tenants

    def _counters(self) -> dict[str, int]:
        calls, asked, found = read_counters(self._lookups, self._single)
        return {"lookups": calls, "lookup_keys": asked, "lookup_hits": found, **self._counts, "events_dropped": self._events.dropped}

    def counters(self) -> dict[str, int]:
        """The manager's counters, copied at one moment."""
        with self._lock:
            return self._counters()

    def stats(self) -> dict[str, Any]:
        """Counters and per-tier figures, copied at one moment."""
        with self._lock:
            data = {**self._counters(), "open_plans": len(self._plans), "tiers": [t.row() for t in self._tiers]}
            if self._book() is not None:
                data["tenants"] = self._tenants.usage_rows()
            return data
