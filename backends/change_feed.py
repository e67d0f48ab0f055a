"""A bounded change feed per namespace: what every engine of a fleet stored in a shared tier, and
what it removed, so each engine's local index follows the tier at a cost that grows with the
writes, not with keys × engines.

A shared tier (a Redis server or cluster, a directory on a shared filesystem) publishes one
:class:`FeedEntry` per job that changed it: the keys stored (``STORED``) or removed
(``REMOVED``), the writer's id (so a follower skips its own entries) and the wall-clock time of
the write (so a follower measures its lag). Entries are appended to a bounded log (a capped
Redis stream, an append-only file log with bounded rotation); a follower reads them in order
from its :class:`FeedCursor`.

The log is bounded, so a follower that falls behind far enough, or a log that was cut or lost
(a server restart, an evicted stream, a damaged file), loses entries. Every implementation
detects that and says so (``FeedRead.gap``); the follower then runs a full sweep of the tier,
which reconciles whatever the lost entries said (see :mod:`kvtier.backends.feed_follower`).
A gap is never silent: missing entries would leave a key the tier holds unknown (a recompute)
or a removed key claimed (a load miss), both safe, but the sweep puts the index right.

What a feed does not carry: records the server evicted by its own policy (``maxmemory``) or that
expired (``ttl_s``) were removed by nobody who could publish them. The rare sweep finds those,
and a load of such a key is a miss that makes the manager forget it at once.

Encoding (one binary value per entry, parsed with ``struct``, never pickle)::

    u8 version | u8 op | 16 bytes writer id | f64 wall time | u32 key count | 32 bytes per key

A value that does not parse (another version, a truncated write) is skipped and counted, and
the follower treats it as a gap.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from kvtier.keys import KEY_BYTES
from kvtier.records.counts import counts_add

__all__ = [
    "ChangeFeed",
    "FeedCursor",
    "FeedEntry",
    "FeedOp",
    "FeedRead",
    "decode_entry",
    "encode_entry",
    "new_writer_id",
]

_VERSION = 1
_HEAD = struct.Struct("<BB16sdI")
WRITER_ID_BYTES = 16


class FeedOp(IntEnum):
    """What an entry says happened to its keys."""

    STORED = 1
    REMOVED = 2


@dataclass(frozen=True, slots=True)
class FeedEntry:
    """One job's change to a shared tier, as published by its writer."""

    op: FeedOp
    keys: tuple[bytes, ...]
    writer: bytes
    #: ``time.time()`` of the writer when it published (the follower's lag is measured from it).
    written_at: float


@dataclass(frozen=True, slots=True, order=True)
class FeedCursor:
    """Where a follower stands in a feed: the position just after the last entry it read.

    The meaning of ``major`` and ``minor`` is the feed's own (a Redis stream id's milliseconds
    and sequence; a file log's segment number and byte offset); cursors of one feed order like
    the entries they follow. ``FeedCursor()`` is the start: before any entry."""

    major: int = 0
    minor: int = 0

    def __str__(self) -> str:
        return f"{self.major}-{self.minor}"


@dataclass(frozen=True, slots=True)
class FeedRead:
    """What one :meth:`ChangeFeed.read` found: entries after the cursor, in order, the cursor
    after the last of them, and whether entries between the old cursor and these were lost
    (trimmed, rotated away, damaged): the follower must then sweep."""

    entries: tuple[FeedEntry, ...]
    cursor: FeedCursor
    gap: bool = False
    #: Values that did not parse (counted; a gap as well).
    skipped: int = 0
    #: Bytes read from the feed's medium for these entries (the benchmark's network figure).
    nbytes: int = field(default=0, compare=False)


def new_writer_id() -> bytes:
    """A random 16-byte id for one writer (one backend instance)."""
    return os.urandom(WRITER_ID_BYTES)


def encode_entry(op: FeedOp, keys: Sequence[bytes], writer: bytes, written_at: float) -> bytes:
    """The binary value of one entry."""
    if len(writer) != WRITER_ID_BYTES:
        raise ValueError(f"writer: expected {WRITER_ID_BYTES} bytes, got {len(writer)}")
    return b"".join([_HEAD.pack(_VERSION, int(op), writer, written_at, len(keys)), *keys])


def decode_entry(value: bytes | bytearray | memoryview) -> FeedEntry | None:
    """Parse one value; ``None`` if it is not a whole entry of this version."""
    data = bytes(value)
    if len(data) < _HEAD.size:
        return None
    version, op, writer, written_at, count = _HEAD.unpack_from(data)
    if version != _VERSION or op not in (FeedOp.STORED, FeedOp.REMOVED) or len(data) != _HEAD.size + count * KEY_BYTES:
        return None
    base = _HEAD.size
    keys = tuple(data[base + i * KEY_BYTES : base + (i + 1) * KEY_BYTES] for i in range(count))
    return FeedEntry(FeedOp(op), keys, writer, written_at)


class ChangeFeed(ABC):
    """One namespace's feed in one shared tier. ``publish`` runs on the tier's I/O threads (once
    per job, after its writes); ``head`` and ``read`` on the follower's thread. Every call is
    blocking, bounded by the feed's own timeouts, and never raises for an outage: ``publish``
    returns ``False`` (the entry is lost: followers reconcile at their next sweep), ``read``
    raises :class:`OSError` (the follower backs off and sweeps once the feed answers again).

    :meth:`wake`, from any thread, ends a read's wait at once (the follower is stopping): a
    store's close never waits for ``wait_s``."""

    #: Published entries hold at most this many keys (a larger job is cut into several).
    max_keys_per_entry: int = 4096

    def __init__(self, writer: bytes | None = None) -> None:
        #: This writer's id: a follower of the same backend skips the entries it published.
        self.writer = writer if writer is not None else new_writer_id()
        if len(self.writer) != WRITER_ID_BYTES:
            raise ValueError(f"writer: expected {WRITER_ID_BYTES} bytes, got {len(self.writer)}")
        self.published = 0
        self.publish_failures = 0
        self._retry_at = 0.0
        self._backoff = 0.0
        self._woken = threading.Event()

    def publish(self, op: FeedOp, keys: Sequence[bytes]) -> bool:
        """Announce that this writer stored (or removed) ``keys``: one job, one call, cut into
        entries of at most :attr:`max_keys_per_entry` keys. ``False`` (counted) if it failed."""
        if not keys:
            return True
        now = time.time()
        values = [encode_entry(op, run, self.writer, now) for run in self.chunks(keys, self.max_keys_per_entry)]
        # After a failure the feed is left alone for a backoff (0.5 s doubling to 5 s): a dead
        # medium must not make every job wait for its timeout. What is not published reaches
        # the followers at their next sweep.
        ok = time.monotonic() >= self._retry_at and self.append(values)
        if ok:
            counts_add(self, "published", len(values))
            self._backoff = 0.0
        else:
            counts_add(self, "publish_failures", len(values))
            if time.monotonic() >= self._retry_at:
                self._backoff = min(max(0.5, self._backoff * 2), 5.0)
                self._retry_at = time.monotonic() + self._backoff
        return ok

    @abstractmethod
    def append(self, values: Sequence[bytes]) -> bool:
        """Append encoded entries in one exchange with the medium; ``False`` if it failed."""

    @abstractmethod
    def head(self) -> FeedCursor:
        """The cursor just after the newest entry now (where a follower that has just listed
        the whole tier starts). Raises :class:`OSError` when the feed cannot be reached."""

    @abstractmethod
    def read(self, cursor: FeedCursor, wait_s: float) -> FeedRead:
        """Entries after ``cursor``, waiting up to ``wait_s`` for the first one, or less when
        :meth:`wake` is called (then it may return no entries, the cursor unchanged)."""

    def wake(self) -> None:
        """End the wait of the read in progress now, or of the next read if none is waiting (a
        wake is kept until a read takes it, so one that comes just before the read starts is
        not lost). Thread-safe; the follower calls it when it stops."""
        self._woken.set()

    def _take_wake(self) -> bool:
        """Whether :meth:`wake` was called since the last read that took it (and take it)."""
        if not self._woken.is_set():
            return False
        self._woken.clear()
        return True

    def close(self) -> None:  # noqa: B027 - feeds without resources close nothing
        """Release what the feed holds (connections, descriptors). Idempotent."""

    @staticmethod
    def chunks(keys: Sequence[bytes], size: int) -> list[Sequence[bytes]]:
        """``keys`` cut into runs of at most ``size``."""
        return [keys[i : i + size] for i in range(0, len(keys), size)] if keys else []
