"""The statistics a shared tier's feed, follower and transfer engine keep lose no add when
several threads add at once: a feed publishes from every thread a job runs on, a follower counts
the shared hits of every load and is told of changes by its feed thread and its sweep thread at
once, and a store job on any worker may forget evicted keys of a shared tier.

Each count's reads here let other threads run (as a build without the GIL may anywhere): an add
that reads, then stores, loses the adds the others made in between."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from kvtier.backends.change_feed import ChangeFeed, FeedCursor, FeedOp, FeedRead
from kvtier.backends.feed_follower import TierFollower
from kvtier.backends.redis_feed import RedisFeed
from test_rows_moved_count import JOBS, THREADS, _race, busy_switches  # noqa: F401  (busy_switches: a fixture)

from kvtier.testing import make_key
from kvtier.transfer.plan_writes import delete_from

pytestmark = pytest.mark.usefixtures("busy_switches")

_COUNTED = frozenset({"published", "publish_failures", "commands"})


class YieldingReads:
    """An object whose counters' every read lets other threads run."""

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if name in _COUNTED:
            time.sleep(0)
        return value


class YieldingDict(dict):  # type: ignore[type-arg]
    """Counters kept in a dict whose every read lets other threads run."""

    def __getitem__(self, name: Any) -> Any:
        value = super().__getitem__(name)
        time.sleep(0)
        return value


class MemoryFeed(YieldingReads, ChangeFeed):
    """A feed whose medium takes every append (``ok``) or none."""

    def __init__(self, ok: bool) -> None:
        super().__init__()
        self.ok = ok

    def append(self, values: Sequence[bytes]) -> bool:
        return self.ok

    def head(self) -> FeedCursor:
        return FeedCursor()

    def read(self, cursor: FeedCursor, wait_s: float) -> FeedRead:
        return FeedRead((), cursor)


def test_a_feed_counts_every_entry_published_from_many_threads() -> None:
    feed = MemoryFeed(ok=True)
    keys = [make_key(i) for i in range(3)]
    feed.max_keys_per_entry = 1  # three entries a call
    _race(lambda: feed.publish(FeedOp.STORED, keys))
    assert feed.published == THREADS * JOBS * 3
    assert feed.publish_failures == 0


def test_a_feed_counts_every_entry_it_failed_to_publish_from_many_threads() -> None:
    feed = MemoryFeed(ok=False)
    keys = [make_key(i) for i in range(2)]
    feed.max_keys_per_entry = 1
    _race(lambda: feed.publish(FeedOp.REMOVED, keys))
    assert feed.publish_failures == THREADS * JOBS * 2
    assert feed.published == 0


class Pipeline:
    def __init__(self) -> None:
        self.n = 0

    def xadd(self, *args: Any, **kwargs: Any) -> None:
        self.n += 1

    def execute(self) -> list[bool]:
        return [True] * self.n


class Client:
    """What a Redis feed's appends ask of its client (no server: only the count is looked at)."""

    def xadd(self, *args: Any, **kwargs: Any) -> bytes:
        return b"1-0"

    def pipeline(self, transaction: bool = True) -> Pipeline:
        return Pipeline()


class CountedRedisFeed(YieldingReads, RedisFeed):
    pass


def test_a_redis_feed_counts_every_command_its_appends_send_from_many_threads() -> None:
    feed = CountedRedisFeed(b"feed-counts", Client)
    one, two = [b"a"], [b"a", b"b"]

    def both() -> None:
        assert feed.append(one) and feed.append(two)

    _race(both)
    assert feed.commands == THREADS * JOBS * 3


def _follower() -> TierFollower:
    follower = TierFollower("counts", sweep=lambda: set(), record_bytes=64)
    follower.counters = YieldingDict(follower.counters)
    return follower


def test_a_follower_counts_every_shared_hit_of_loads_on_many_threads() -> None:
    follower = _follower()
    keys = [make_key(i) for i in range(4)]
    follower._foreign.update(keys[:3])  # three of the four stored by another engine
    _race(lambda: follower.count_served(keys))
    assert follower.stats()["shared_hits"] == THREADS * JOBS * 3


def test_a_follower_counts_every_change_its_feed_and_sweep_threads_tell() -> None:
    follower = _follower()
    told: list[int] = []
    follower.listen(lambda change: told.append(len(change.adopted)))
    adopted, removed = [make_key(1), make_key(2)], [make_key(3)]
    _race(lambda: follower._swept(adopted, removed))
    stats = follower.stats()
    assert stats["adopted"] == THREADS * JOBS * 2
    assert stats["removed"] == THREADS * JOBS
    assert len(told) == THREADS * JOBS


class SharedTier:
    shared = True

    def __init__(self) -> None:
        self.forgotten = 0
        self._lock = threading.Lock()

    def forget_blocks(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self.forgotten += len(keys)


class Host:
    """What :func:`delete_from` uses of the transfer engine: one shared tier."""

    def __init__(self) -> None:
        self.backends: list[Any] = [SharedTier()]
        self.counters: dict[str, int] = YieldingDict(shared_forgotten=0)
        self._lock = threading.Lock()


def test_evictions_from_a_shared_tier_on_many_threads_count_every_key_forgotten() -> None:
    host = Host()
    keys = [make_key(i) for i in range(5)]
    _race(lambda: delete_from(host, 0, keys, "eviction"))  # type: ignore[arg-type]
    assert host.counters["shared_forgotten"] == THREADS * JOBS * 5
    assert host.backends[0].forgotten == THREADS * JOBS * 5
