"""Live following of a shared tier: the public object that keeps an engine's local index of one
shared tier current, and tells whoever listens what it adopted and what it forgot.

An engine's lookups never touch the network: they answer from the manager's local index. For a
shared tier (Redis, Redis Cluster, a ``file`` tier with ``shared: true``) other engines store
and remove records all the time, so a :class:`TierFollower` applies their changes to that index
off the step loop, on threads of its own:

* **the feed** (:mod:`kvtier.backends.change_feed`): every writer publishes one entry per job
  (the keys it stored or removed); the follower's thread reads the entries after its cursor
  (a blocking read of at most ``wait_s``), skips its own, and applies the rest through the
  manager's thread-safe calls (``adopt`` for stored keys it does not hold, ``remove`` for removed
  ones). Staleness is one read's latency: tens of milliseconds, not the sweep interval; the
  server's cost grows with the writes, not with keys × engines.
* **the sweep** (:class:`kvtier.backends.shared_index.SharedIndexView`): a full listing of the
  tier every ``sweep_interval_s``, the backstop. It reconciles what no feed carries (records the
  server evicted or expired) and what a feed lost: a follower that finds a gap in its feed
  (entries trimmed before it read them, a feed that was wiped) sweeps at once.

Both paths journal through the view, so a sweep that started before a feed entry was applied
neither forgets a key just adopted nor adopts a key just removed.

Public API (the store facade wires it for its shared tiers; an integration whose scheduler
holds a manager without the tier's bytes, like vLLM's scheduler side, opens the tier's backend
and calls the same methods)::

    backend = build_backend(tier_config)            # a RedisBackend, or FileBackend(shared=True)
    await backend.open(fmt)                         # connects, notes the feed's head
    follower = backend.follower                     # this object (None for unshared tiers)
    follower.listen(on_change)                      # TierChange(tier, adopted, removed, source)
    backend.bind_index(manager, tier)               # starts following into manager's tier
    ...
    follower.count_served(keys)                     # keys a load served: shared hits counted
    await backend.aclose()                          # stops the threads

``on_change`` is called on the follower's threads, after the manager's index changed, with keys
that are now ready in the tier (``adopted``: stored by another engine) or no longer held
(``removed``). It must be quick and thread-safe (queue the keys for the engine's own loop, e.g.
KV events for a router). A listener that raises is logged and kept.

The manager is reached duck-typed (``holds``, ``adopt``, ``remove``, ``ready_keys``), as by the view: this
module imports nothing from the manager.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.backends.change_feed import ChangeFeed, FeedCursor, FeedEntry, FeedOp
from kvtier.backends.shared_index import IndexTarget, SharedIndexView, adopt_records

from kvtier.errors import ClosedError

__all__ = ["FollowedTier", "Listener", "TierChange", "TierFollower"]

log = logging.getLogger("kvtier")

_APPLY_CHUNK = 2048
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0
_LAGS_KEPT = 4096


class ChangeListeners:
    """Callables told each change of a followed tier; registration is thread-safe, and a
    listener that raises is logged and kept (it never stops the following)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._listeners: tuple[Callable[[Any], None], ...] = ()
        self._lock = threading.Lock()

    def add(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``listener`` with every change; returns a function that stops it."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def remove() -> None:
            with self._lock:
                self._listeners = tuple(fn for fn in self._listeners if fn is not listener)

        return remove

    def tell(self, change: Any) -> None:
        for listener in self._listeners:
            try:
                listener(change)
            except Exception:
                log.exception("%s: a listener of the shared tier failed", self.name)


@dataclass(frozen=True, slots=True)
class TierChange:
    """What a follower changed in the local index of shared tier ``tier``."""

    tier: int
    #: Keys another engine stored, now ready in the local index.
    adopted: tuple[bytes, ...]
    #: Keys the tier no longer holds (removed by an engine, or missing at a sweep), now forgotten.
    removed: tuple[bytes, ...]
    source: Literal["feed", "sweep"]


Listener = Callable[[TierChange], None]


class TierFollower:
    """Follows one shared tier into tier ``tier`` of a manager: a feed (optional) and a sweep."""

    #: Seconds one feed read waits for an entry (``stop`` wakes it: a close never waits this long).
    wait_s_default: float = 0.5

    def __init__(
        self,
        name: str,
        *,
        sweep: Callable[[], AbstractSet[bytes] | None],
        record_bytes: int,
        feed: ChangeFeed | None = None,
        sweep_interval_s: float = 60.0,
        wait_s: float | None = None,
        on_recovered: Callable[[], None] | None = None,
    ) -> None:
        wait_s = self.wait_s_default if wait_s is None else wait_s
        if wait_s <= 0:
            raise ValueError(f"wait_s: expected a positive number of seconds, got {wait_s!r}")
        self.name = name
        self.feed = feed
        #: Called when the feed answers again after failing (the tier may end its outage).
        self.on_recovered = on_recovered
        self.wait_s = float(wait_s)
        self._record_bytes = int(record_bytes)
        self.view = SharedIndexView(
            name, sweep, record_bytes=record_bytes, interval_s=sweep_interval_s, on_change=self._swept
        )
        self._listeners = ChangeListeners(name)
        self._target: IndexTarget | None = None
        self._tier = 0
        self._cursor: FeedCursor | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: Keys this follower adopted from other engines and still holds (shared hits are theirs).
        self._foreign: set[bytes] = set()
        self._lags: deque[float] = deque(maxlen=_LAGS_KEPT)
        self.counters: dict[str, Any] = {
            "feed_entries": 0,
            "feed_own_entries": 0,
            "feed_bytes": 0,
            "feed_gaps": 0,
            "feed_skipped": 0,
            "feed_failures": 0,
            "adopted": 0,
            "removed": 0,
            "shared_hits": 0,
            "last_lag_s": 0.0,
        }

    # -- wiring --------------------------------------------------------------------------------
    def mark_start(self) -> None:
        """Note the feed's head now, before the tier is listed: entries after it are applied
        once following starts (again, harmlessly, for what the listing already had). Without a
        head (the feed is unreachable) the follower starts at the head it finds later and
        sweeps then."""
        if self.feed is None:
            return
        try:
            self._cursor = self.feed.head()
        except OSError as exc:
            log.debug("%s: feed head not readable at open: %s", self.name, exc)
            self._cursor = None

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every :class:`TierChange`; returns a function that stops it."""
        return self._listeners.add(listener)

    def bind(self, target: IndexTarget, tier: int, *, start: bool = True) -> None:
        """Follow into ``target``'s tier ``tier``; start the threads (feed and sweep)."""
        self._target, self._tier = target, tier
        self.view.bind(target, tier, start=start)
        if start and self.feed is not None and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"kvtier-{self.name}-feed", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop following: a feed read in progress is woken (:meth:`ChangeFeed.wake`), so this
        returns without waiting out ``wait_s`` (a sweep in progress is waited for). Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and self.feed is not None:
            self.feed.wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self.view.stop()
        self._target = None

    def sweep_now(self) -> None:
        """Ask for a full sweep now (the backstop) instead of at the end of its interval."""
        self.view.wake()

    # -- this engine's own changes ----------------------------------------------------------------
    def note_written(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        self.view.note_written(keys)
        if self._foreign:
            with self._lock:
                self._foreign.difference_update(keys)

    def note_deleted(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        self.view.note_deleted(keys)
        if self._foreign:
            with self._lock:
                self._foreign.difference_update(keys)

    def note_listed(self, count: int, seconds: float = 0.0) -> None:
        """The number of keys the store's listing at open found, and the seconds it took."""
        self.view.note_listed(count, seconds)

    def count_served(self, keys: Iterable[bytes]) -> int:
        """Count the keys of a load this tier served that another engine stored (shared hits);
        returns how many there were."""
        foreign = self._foreign
        n = sum(1 for k in keys if k in foreign) if foreign else 0
        if n:
            with self._lock:  # (the loads of several threads count at once)
                self.counters["shared_hits"] += n
        return n

    # -- following -----------------------------------------------------------------------------
    def _run(self) -> None:
        feed = self.feed
        assert feed is not None
        backoff = _BACKOFF_FIRST_S
        failing = False
        while not self._stop.is_set() and self._target is not None:
            try:
                if self._cursor is None:  # never had a head: start there, and sweep what came before
                    self._cursor = feed.head()
                    self.view.wake()
                read = feed.read(self._cursor, self.wait_s)
            except OSError as exc:
                self.counters["feed_failures"] += 1
                failing = True
                log.debug("%s: feed read failed: %s", self.name, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            except Exception:  # a bug: log it, keep the engine alive, try again later
                log.exception("%s: feed read failed", self.name)
                self._stop.wait(_BACKOFF_MAX_S)
                continue
            backoff = _BACKOFF_FIRST_S
            if failing:
                failing = False
                if self.on_recovered is not None:  # before adopting: loads of these keys may go out
                    self.on_recovered()
            self.counters["feed_bytes"] += read.nbytes
            if read.gap or read.skipped:
                self.counters["feed_gaps"] += 1
                self.counters["feed_skipped"] += read.skipped
                log.info("%s: the feed lost entries; sweeping the tier to reconcile", self.name)
                self.view.wake()
            try:
                self.apply(read.entries)
            except ClosedError:  # the store closed its manager; the backend stops us next
                break
            except Exception:
                log.exception("%s: applying feed entries failed; sweeping", self.name)
                self.view.wake()
            self._cursor = read.cursor

    def apply(self, entries: Sequence[FeedEntry]) -> TierChange | None:
        """Apply feed entries (others' only) to the bound manager, in order; tell listeners."""
        target, tier = self._target, self._tier
        if target is None or not entries:
            return None
        own = self.feed.writer if self.feed is not None else b""
        now = time.time()
        adopted: list[bytes] = []
        removed: list[bytes] = []
        run_op: FeedOp | None = None
        run: list[bytes] = []
        for entry in entries:
            if entry.writer == own:
                self.counters["feed_own_entries"] += 1
                continue
            self.counters["feed_entries"] += 1
            lag = max(0.0, now - entry.written_at)
            self._lags.append(lag)
            self.counters["last_lag_s"] = lag
            if entry.op is not run_op and run:
                self._apply_run(target, tier, run_op, run, adopted, removed)
                run = []
            run_op = entry.op
            run.extend(entry.keys)
        if run:
            self._apply_run(target, tier, run_op, run, adopted, removed)
        if not adopted and not removed:
            return None
        change = TierChange(tier, tuple(adopted), tuple(removed), "feed")
        self._tell(change)
        return change

    def _apply_run(
        self, target: IndexTarget, tier: int, op: FeedOp | None, keys: list[bytes], adopted: list[bytes], removed: list[bytes]
    ) -> None:
        keys = list(dict.fromkeys(keys))
        if op is FeedOp.STORED:
            self.view.note_written(keys)
            holds = target.holds
            got = adopt_records(target, tier, [k for k in keys if not holds(k, tier)], self._record_bytes)
            adopted += got
            with self._lock:
                self._foreign.update(got)
        else:
            self.view.note_deleted(keys)
            gone: list[bytes] = []
            for i in range(0, len(keys), _APPLY_CHUNK):
                gone += target.remove(keys[i : i + _APPLY_CHUNK], tier)
            removed += gone
            with self._lock:
                self._foreign.difference_update(keys)

    def _swept(self, adopted: list[bytes], forgotten: list[bytes]) -> None:
        with self._lock:
            self._foreign.update(adopted)
            self._foreign.difference_update(forgotten)
        self._tell(TierChange(self._tier, tuple(adopted), tuple(forgotten), "sweep"))

    def _tell(self, change: TierChange) -> None:
        with self._lock:  # (the feed's thread and the sweep's both tell)
            self.counters["adopted"] += len(change.adopted)
            self.counters["removed"] += len(change.removed)
        self._listeners.tell(change)

    # -- figures -------------------------------------------------------------------------------
    def lag_quantiles(self) -> dict[str, float]:
        """Seconds from a foreign entry's write to its application here (recent entries)."""
        lags = sorted(self._lags)
        if not lags:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        pick = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))]  # noqa: E731
        return {"p50": pick(0.5), "p99": pick(0.99), "max": lags[-1]}

    def stats(self) -> dict[str, Any]:
        data = dict(self.counters)
        data["feed"] = self.feed is not None
        data["foreign_blocks"] = len(self._foreign)
        data["lag_s"] = self.lag_quantiles()
        data["cursor"] = str(self._cursor) if self._cursor is not None else None
        data["index"] = self.view.stats()
        data["tier_keys"] = self.view.known_count()
        if self.feed is not None:
            data["feed_published"] = self.feed.published
            data["feed_publish_failures"] = self.feed.publish_failures
        return data


class FollowedTier:
    """The hooks a shared tier's backend needs, in one place (the ``file`` tier with
    ``shared: true`` and the remote tiers mix this in): build the follower at open, publish and
    journal each job's changes, count shared hits, bind, stop.

    A subclass calls :meth:`_start_following` in ``open`` (before it lists the tier),
    :meth:`_followed_writes` / :meth:`_followed_deletes` after each job's writes / deletes,
    :meth:`_followed_reads` with the keys a read found, and :meth:`_stop_following` in ``aclose``."""

    follower: TierFollower | None = None

    def _start_following(
        self,
        name: str,
        *,
        sweep: Callable[[], AbstractSet[bytes] | None],
        record_bytes: int,
        feed: ChangeFeed | None,
        sweep_interval_s: float,
        mark: bool = True,
    ) -> TierFollower:
        """Build the follower; with ``mark``, note the feed's head now (I/O: off the event loop;
        a tier that connects later calls ``follower.mark_start()`` itself, before listing)."""
        follower = TierFollower(
            name, sweep=sweep, record_bytes=record_bytes, feed=feed, sweep_interval_s=sweep_interval_s,
            on_recovered=self._feed_recovered,
        )
        if mark:
            follower.mark_start()
        self.follower = follower
        return follower

    def _feed_recovered(self) -> None:
        """The feed answers again after failing: a tier with an outage state may end it."""

    def _followed_writes(self, keys: Sequence[bytes]) -> None:
        follower = self.follower
        if follower is not None and keys:
            follower.note_written(keys)
            if follower.feed is not None:
                follower.feed.publish(FeedOp.STORED, keys)

    def _followed_deletes(self, keys: Sequence[bytes]) -> None:
        follower = self.follower
        if follower is not None and keys:
            follower.note_deleted(keys)
            if follower.feed is not None:
                follower.feed.publish(FeedOp.REMOVED, keys)

    def _followed_reads(self, keys: Sequence[bytes], found: Sequence[bool]) -> None:
        follower = self.follower
        if follower is not None and follower._foreign:
            follower.count_served([k for k, ok in zip(keys, found) if ok])

    def bind_index(self, manager: Any, tier: int) -> None:
        """Keep ``manager``'s index of ``tier`` in step with the shared tier (the store calls
        this after adopting the tier's records at open)."""
        if self.follower is not None:
            self.follower.bind(manager, tier)

    def _stop_following(self) -> None:
        follower, self.follower = self.follower, None
        if follower is not None:
            follower.stop()
            if follower.feed is not None:
                follower.feed.close()
