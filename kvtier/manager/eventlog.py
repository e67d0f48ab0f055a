"""Cache events for KV-aware routers: a key became ready in, or left, a tier.

The manager records them in batches, one ``(kind, keys, tier)`` entry per plan step, so a store
pays one append per batch instead of one object per key; :meth:`EventLog.take` builds the
:class:`CacheEvent` objects when a consumer asks. The log is bounded in events (keys): past the
limit the oldest are dropped and counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["CacheEvent", "EventBatch", "EventLog"]

Kind = Literal["stored", "removed"]
#: ``(kind, keys, tier name)``; the keys sequence is never modified once recorded.
EventBatch = tuple[Kind, Sequence[bytes], str]


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """A key became ready in (``stored``) or left (``removed``) the tier named ``tier``."""

    kind: Kind
    key: bytes
    tier: str


class EventLog:
    """At most ``limit`` events, oldest first; ``dropped`` counts those pushed out.

    A log at its bound (nobody takes the events) would trim at every add, about 0.2 µs of
    Python a store; it keeps up to ``limit // 16`` events more and trims them all at once, and
    every reader (``take``, ``len``, ``dropped``) trims to the bound first, so what it sees is
    what a trim at every add would have left."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._slack = limit // 16  # events past the bound that wait for one trim of them all
        self._dropped = 0
        self._batches: deque[EventBatch] = deque()
        self._skip = 0  # keys of the head batch already dropped
        self._count = 0

    @property
    def dropped(self) -> int:
        """Events pushed out past the bound so far."""
        if self._count > self.limit:
            self._trim()
        return self._dropped

    def add(self, kind: Kind, keys: Sequence[bytes], tier: str) -> None:
        if keys:
            self._batches.append((kind, keys, tier))
            self._count += len(keys)
            if self._count > self.limit + self._slack:
                self._trim()

    def extend(self, batches: Iterable[EventBatch]) -> None:
        for kind, keys, tier in batches:
            self.add(kind, keys, tier)

    def _trim(self) -> None:
        batches = self._batches
        over = self._count - self.limit
        self._count -= over
        self._dropped += over
        while over:
            left = len(batches[0][1]) - self._skip
            if left > over:
                # Skip the head batch's oldest keys rather than copy the rest: with a big batch
                # at the head (an open's or a flush's), a copy at every store made each store
                # cost the batch's length (benchmarks/bench_scale.py, evict_us_per_block).
                self._skip += over
                return
            batches.popleft()
            self._skip = 0
            over -= left

    def take(self) -> list[CacheEvent]:
        """The events since the last call, oldest first."""
        if self._count > self.limit:
            self._trim()
        batches, self._batches, self._count = self._batches, deque(), 0
        skip, self._skip = self._skip, 0
        if skip:
            kind, keys, tier = batches[0]
            batches[0] = (kind, keys[skip:], tier)
        return [CacheEvent(kind, key, tier) for kind, keys, tier in batches for key in keys]

    def __len__(self) -> int:
        if self._count > self.limit:
            self._trim()
        return self._count
