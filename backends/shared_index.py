"""A local view of a shared tier's key set, kept current off the engine's step.

A shared tier (a Redis server or cluster that several hosts write to) has its index on the
server: another host may store or evict a key at any time. The engine's step never waits on
the network, so ``TierManager.lookup`` keeps answering from the manager's local index, and this
view keeps that index close to the server's truth:

* a background thread *sweeps* the server every ``interval_s`` seconds (``sweep()`` returns
  the full key set, e.g. by ``SCAN``), compares it with the keys the manager holds ready in the
  tier, and applies the difference through the manager's public calls: ``adopt`` for keys
  another host stored, ``remove`` for keys the server no longer holds (evicted, expired, deleted
  by a peer). Both take the manager's lock, so the lock-free lookups see whole updates.
* The staleness is bounded by ``max(interval_s, 10 sweeps)`` plus one sweep: sweeping never
  takes more than a tenth of the thread's time. Within it the view can be wrong in
  both directions, and both are safe: a key it claims that the server lost is a load miss (the
  backend reports it, the manager forgets it, the engine recomputes); a key it does not know yet
  is a store that is skipped by the server (``SET`` overwrites the same bytes) or a recompute.
* Writes and deletes made by this process are journalled with the sweep clock, so a sweep that
  started before them neither forgets a key just written nor adopts a key just deleted.
* The view keeps no key set of its own: what the server no longer holds is found among the keys
  the manager holds ready (``ready_keys``, a snapshot), so an index of 10^6 keys is held once.
* A sweep that fails (server down) changes nothing; the caller's ``sweep`` raises or returns
  ``None`` and the next attempt follows the backend's backoff.

The manager is reached duck-typed (``holds``, ``adopt``, ``remove``, ``ready_keys``: thread-safe
calls); this module
imports nothing from it, so layers still point one way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

from kvtier.errors import ClosedError

__all__ = ["IndexTarget", "SharedIndexView", "adopt_records"]

log = logging.getLogger("kvtier")

_APPLY_CHUNK = 2048  # keys per adopt/remove call, so one call never holds the manager long
_DUTY = 10  # wait at least this many sweep durations between sweeps


class IndexTarget(Protocol):
    """What the view needs of the manager (``kvtier.manager.TierManager`` answers it)."""

    def holds(self, key: bytes, tier: int) -> bool: ...
    def adopt(self, tier: int, records: Iterable[tuple[bytes, int, float]]) -> list[bytes]: ...
    def remove(self, keys: list[bytes], tier: int) -> list[bytes]: ...
    def ready_keys(self, tier: int) -> Iterable[bytes]: ...


def adopt_records(target: IndexTarget, tier: int, keys: list[bytes], record_bytes: int) -> list[bytes]:
    """Adopt ``keys`` (stored by other engines) into ``target``'s ``tier``, in chunks; the keys
    adopted. A manager with ``adopt_live`` (:class:`kvtier.manager.TierManager`) makes room by
    forgetting its least recent keys and announces the change as events; with ``adopt`` alone,
    keys beyond the room left stay on the server, unknown here."""
    live = getattr(target, "adopt_live", None)
    now = time.time()
    adopted: list[bytes] = []
    for i in range(0, len(keys), _APPLY_CHUNK):
        chunk = keys[i : i + _APPLY_CHUNK]
        records = [(k, record_bytes, now) for k in chunk]
        if live is not None:
            adopted += live(tier, records)
        else:
            excess = target.adopt(tier, records)
            adopted += [k for k in chunk if k not in set(excess)] if excess else chunk
    return adopted


class SharedIndexView:
    """Keeps tier ``tier`` of a manager in step with a shared server's key set."""

    def __init__(
        self,
        name: str,
        sweep: Callable[[], AbstractSet[bytes] | None],
        *,
        record_bytes: int,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[list[bytes], list[bytes]], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: expected a positive number of seconds, got {interval_s!r}")
        self.name = name
        self.interval_s = float(interval_s)
        self._sweep = sweep
        self._record_bytes = int(record_bytes)
        self._clock = clock
        #: Told ``(adopted, forgotten)`` after each sweep that changed the index (on the sweep's thread).
        self.on_change = on_change
        self._lock = threading.Lock()
        self._written: dict[bytes, float] = {}
        self._deleted: dict[bytes, float] = {}
        #: Keys the tier held at the last sweep (or the store's listing at open), with this
        #: process's writes of that sweep's time and less its deletes.
        self._known_count = 0
        self._target: IndexTarget | None = None
        self._tier = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters: dict[str, Any] = {
            "sweeps": 0,
            "sweep_failures": 0,
            "adopted": 0,
            "forgotten": 0,
            "last_sweep_keys": 0,
            "last_sweep_s": 0.0,
        }

    # -- wiring --------------------------------------------------------------------------------
    def bind(self, target: IndexTarget, tier: int, *, start: bool = True) -> None:
        """Attach the manager whose tier ``tier`` this view keeps current; start the thread."""
        missing = [name for name in ("holds", "adopt", "remove", "ready_keys") if not callable(getattr(target, name, None))]
        if missing:
            raise TypeError(f"{self.name}: an index target needs {missing} (see IndexTarget)")
        self._target, self._tier = target, tier
        if start and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"kvtier-{self.name}-index", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the background thread (waits for a sweep in progress). Idempotent."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._target = None

    def wake(self) -> None:
        """Sweep now instead of at the end of the current interval (e.g. after a reconnect)."""
        self._wake.set()

    # -- journal of this process's own changes -------------------------------------------------
    def note_written(self, keys: Iterable[bytes]) -> None:
        now = self._clock()
        with self._lock:
            for key in keys:
                self._written[key] = now
                self._deleted.pop(key, None)

    def note_deleted(self, keys: Iterable[bytes]) -> None:
        now = self._clock()
        with self._lock:
            for key in keys:
                self._deleted[key] = now
                self._written.pop(key, None)

    def note_listed(self, count: int, seconds: float = 0.0) -> None:
        """The number of keys the store's listing at open found (for ``known_count``; from a
        key log, its entries: a key written twice counts twice until the first sweep), and the
        seconds that listing took: it counts as the last sweep, so the first sweep comes no sooner
        than ten of its durations after it (a tier of 10^6 keys is not listed twice in a row)."""
        self._known_count = count
        if seconds > 0:
            self.counters["last_sweep_s"] = float(seconds)

    # -- sweeping ------------------------------------------------------------------------------
    def sweep_once(self) -> tuple[int, int] | None:
        """One sweep, applied to the bound manager; ``(adopted, forgotten)``, or ``None`` when
        the server could not be listed (nothing changes then)."""
        target, tier = self._target, self._tier
        started = self._clock()
        t0 = time.perf_counter()
        try:
            found = self._sweep()
        except Exception as exc:  # the backend translates and logs outages; never kill the thread
            log.debug("%s: index sweep failed: %s", self.name, exc)
            found = None
        if found is None:
            self.counters["sweep_failures"] += 1
            return None
        # The manager's keys first, the journal next: a key made ready after this snapshot is
        # not in it, and one made ready before it was journalled before that (a write is noted
        # before the manager completes it), so a key written since the sweep started is never
        # taken for gone.
        held = target.ready_keys(tier) if target is not None else ()
        with self._lock:
            # Journal entries older than this sweep's start are reflected in `found` already.
            recent_w = {k for k, t in self._written.items() if t >= started}
            recent_d = {k for k, t in self._deleted.items() if t >= started}
            self._written = {k: self._written[k] for k in recent_w}
            self._deleted = {k: self._deleted[k] for k in recent_d}
        gone = [k for k in held if k not in found and k not in recent_w]
        del held
        self._known_count = len(found) + sum(1 for k in recent_w if k not in found) - sum(1 for k in recent_d if k in found)
        adopted_keys: list[bytes] = []
        forgotten_keys: list[bytes] = []
        if target is not None:
            holds = target.holds
            new = [k for k in found if k not in recent_d and not holds(k, tier)]
            for i in range(0, len(gone), _APPLY_CHUNK):
                forgotten_keys += target.remove(gone[i : i + _APPLY_CHUNK], tier)
            adopted_keys = adopt_records(target, tier, new, self._record_bytes)
        adopted, forgotten = len(adopted_keys), len(forgotten_keys)
        if (adopted or forgotten) and self.on_change is not None:
            try:
                self.on_change(adopted_keys, forgotten_keys)
            except Exception:  # a listener's bug never stops the index from following
                log.exception("%s: a listener of the index sweep failed", self.name)
        self.counters["sweeps"] += 1
        self.counters["adopted"] += adopted
        self.counters["forgotten"] += forgotten
        self.counters["last_sweep_keys"] = len(found)
        self.counters["last_sweep_s"] = time.perf_counter() - t0
        return adopted, forgotten

    def _run(self) -> None:
        while not self._stop.is_set():
            # A sweep's cost grows with the keys held; never spend more than a tenth of the time
            # sweeping (the staleness bound grows instead: ``interval_s`` or ten sweeps).
            self._wake.wait(max(self.interval_s, _DUTY * self.counters["last_sweep_s"]))
            self._wake.clear()
            if self._stop.is_set() or self._target is None:
                break
            try:
                self.sweep_once()
            except ClosedError:  # the store closed its manager; the backend stops us next
                break
            except Exception:  # a manager that closed under us, or a bug: log, keep the engine alive
                log.exception("%s: applying an index sweep failed", self.name)
                if self._target is None:
                    break

    def known_count(self) -> int:
        """Keys the tier held for this namespace at the last sweep (or the store's listing at
        open), with this process's changes journalled during that sweep."""
        return self._known_count

    def stats(self) -> dict[str, Any]:
        return dict(self.counters, interval_s=self.interval_s, known_keys=self._known_count)
