"""The key log of a ``redis`` tier: the names of the records its writers stored, kept in one
string value next to them, so that a store's open reads its index in a few large reads instead
of walking the server's keyspace with ``SCAN``.

Why: ``SCAN`` costs the server about a second of its one thread's CPU per million keys (it walks
its whole table, every namespace's keys included, and builds a reply element per key); reading
the same million keys packed 32 bytes apart is a memory copy (measured here, 10^6 records on a
private redis-server 7.0 at load 2.9: ``SCAN`` 1.5-2.7 s of wall time and 1.04-1.10 s of server
CPU; ``GETRANGE`` of the 32 MB log in 4 MiB pieces 0.47-0.56 s and 0.01-0.02 s, nearly all of it
the client making the keys; ``LRANGE`` of a list of the same keys 0.5-0.8 s and 0.08-0.11 s).

The value ``<prefix>:<namespace digest, 16 hex>:keys`` is a 32-byte header (:data:`MAGIC` and a
random generation) followed by one 33-byte entry per record stored or deleted, in that order:
:data:`STORED` (``+``) or :data:`DELETED` (``-``), then the 32-byte block key:

* **writing**: each put share ends with one ``APPEND`` of the entries of the records the server
  stored (after their ``SET`` replies, on the share's connection: the log never names a key
  before its record exists); a delete (a bad record, an operator's) sends one after its
  ``UNLINK`` commands, as ``kvtier clear --tenant`` does. A refused ``APPEND`` (an ACL without it)
  fails nothing: the key is only missing from the log until it is rewritten.
* **reading** (a store's open): ``STRLEN`` and the header, then a sample of the entries, whose
  records are looked up with one ``EXISTS``, then the entries in :data:`READ_CHUNK` pieces,
  pipelined, replayed in order (a key's last entry decides). The log is not used, and the open
  lists the server with ``SCAN`` as before, when it is missing (an older store, a new
  namespace), headerless (evicted, then recreated by an ``APPEND``), not a whole number of
  entries, not a string, holds an entry that is neither stored nor deleted, or when fewer than
  half the sampled stored records exist. A
  key the log names whose record is gone (the server evicted it) is adopted all the same, and is
  a miss when loaded; the sweeps (``SCAN``, every ``sync_interval_s``) forget it. The log only
  names keys: every record keeps its own check.
* **rewriting** (bounded): a sweep that finds the log holding more than twice the keys it listed
  (plus :data:`REWRITE_SLACK`), or the log missing or untrusted, writes a new one from its
  listing: the entries under a temporary name with an expiry, then, under ``WATCH`` of the log,
  the entries appended to the log since the sweep began copied after them and the temporary
  value renamed over the log (``MULTI``/``EXEC``). A log changed meanwhile by another rewrite
  (its header differs) is left alone; an ``APPEND`` that lands between the copy and the rename
  makes ``EXEC`` fail, and the rewrite tries again. Keys appended before the sweep began were
  stored before it began, so the sweep lists them, unless they are gone.

A Redis Cluster keeps a log per hash slot instead, read the same way and trusted on the same
terms, primary by primary: :mod:`kvtier.backends.redis_slotlogs`.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any, Protocol, TypeVar

import numpy as np
from kvtier.backends.redis_wire import ErrorReply, Wire
from kvtier.backends.remote_listing import Dropped, Listed

__all__ = [
    "DELETED", "KEYLOG_SUFFIX", "MAGIC", "STORED", "KeyLog", "KeyLogChanged", "LogBook", "LogState", "TierKeyLog", "command", "entries_of",
    "new_header", "replay",
]

T = TypeVar("T")
Table = dict[bytes, int]

log = logging.getLogger("kvtier")

KEYLOG_SUFFIX = b"keys"
#: An entry's first byte: the record was stored, or deleted by a kvtier host.
STORED = b"+"
DELETED = b"-"
#: The first half of the 32-byte header (the second is the generation).
MAGIC = b"kvtier-keylog-1\n"
HEADER_BYTES = 32
#: Bytes of the log one ``GETRANGE`` returns at open (131072 keys).
READ_CHUNK = 4 << 20
#: Entries made into one list of keys at a store's open. The list of a whole piece's keys (1 MiB
#: at 131,072 keys) would come from the heap of the open's thread, whose free top outlives the
#: open (``malloc_trim`` leaves a thread's heap top; see ``docs/tiers.md``, "How many records").
REPLAY_ENTRIES = 4096
#: Entries whose records one ``EXISTS`` looks up at open.
SAMPLE = 64
#: A log this many entries over twice the listed keys is rewritten.
REWRITE_SLACK = 1024
#: Keys per ``APPEND`` of a rewrite (1 MiB), and the temporary value's expiry.
_REWRITE_KEYS = 32768
_TMP_TTL_MS = 600_000
_REWRITE_TRIES = 5


class KeyLogChanged(Exception):
    """The log was rewritten while a store's open read it, or holds an entry of another form:
    the open lists with ``SCAN``."""


class TierKeyLog(Protocol):
    """What the tier asks of its key log: this module's (one server) or a cluster's slot logs."""

    def append_commands(self, keys: Iterable[bytes], op: bytes = b"") -> tuple[bytes, int]: ...
    def appended(self, wire: Wire, count: int = 1) -> None: ...
    def open_table(self, listing: Callable[[Callable[[], Iterable[list[bytes]]] | None], Listed | None]) -> Listed | None: ...
    def sweep_state(self) -> Any: ...
    def after_sweep(self, state: Any, found: Table) -> None: ...
    def stats(self) -> dict[str, Any]: ...


class KeyLogHost(Protocol):
    """What :class:`KeyLog` uses of the tier."""

    cluster: bool
    follower: Any
    _foreign: bool
    _prefix_bytes: bytes

    def _get_client(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class LogState:
    """The log as a reader or a sweep found it: its length and its first 32 bytes."""

    length: int
    head: bytes

    def problem(self, entry_bytes: int) -> str | None:
        """Why the log cannot be trusted (``None``: its header and length are right)."""
        if self.length == 0:
            return "no key log"
        if len(self.head) < HEADER_BYTES or not self.head.startswith(MAGIC):
            return "the key log has no header (evicted and begun again, or not ours)"
        if (self.length - HEADER_BYTES) % entry_bytes:
            return f"the key log's length {self.length} is not a whole number of entries"
        return None

    def entries(self, entry_bytes: int) -> int:
        return max(0, self.length - HEADER_BYTES) // entry_bytes


def entries_of(keys: Iterable[bytes], op: bytes) -> bytes:
    """The log entries of ``keys``, each ``op`` followed by the key."""
    joined = op.join(keys)
    return op + joined if joined else b""


def command(*parts: bytes) -> bytes:
    """One command in RESP."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%b\r\n" % (len(p), p) for p in parts)


def _getrange(name: bytes, start: int, end: int) -> bytes:
    return command(b"GETRANGE", name, b"%d" % start, b"%d" % end)


def new_header() -> bytes:
    """A log's header: :data:`MAGIC` and a random generation (another rewrite's differs)."""
    return MAGIC + os.urandom(HEADER_BYTES - len(MAGIC))


def replay(raw: bytes | bytearray | memoryview, key_bytes: int, where: int = 0) -> Iterator[list[bytes]]:
    """The keys of ``raw`` (whole entries, no header) in order: runs of stored keys as lists, runs
    of deleted ones as :class:`Dropped`. An entry that is neither raises :class:`KeyLogChanged`
    (``where``: the offset of ``raw`` in its log, for the message) before any key of ``raw``."""
    e = key_bytes + 1
    rows = len(raw) // e
    ops = np.frombuffer(raw, dtype=np.uint8, count=rows * e)[::e]
    # The keys as one strided column of opaque items, made into ``bytes`` in one call.
    keys = np.ndarray((rows,), dtype=np.dtype((np.void, key_bytes)), buffer=raw, offset=1, strides=(e,)).tolist() if rows else []
    stored = ops == STORED[0]
    if stored.all():
        yield keys
        return
    if not (stored | (ops == DELETED[0])).all():
        raise KeyLogChanged(f"the key log has an entry of another form between bytes {where} and {where + len(raw)}")
    # Deletions are rare: the piece is replayed in runs of one operation, in order.
    cuts = [0, *(np.flatnonzero(stored[1:] != stored[:-1]) + 1).tolist(), rows]
    for a, b in pairwise(cuts):
        yield keys[a:b] if stored[a] else Dropped(keys[a:b])


def replay_pieces(raw: bytes | bytearray | memoryview, key_bytes: int, where: int = 0) -> Iterator[list[bytes]]:
    """:func:`replay` of ``raw`` :data:`REPLAY_ENTRIES` entries at a time: the same keys in the
    same order, in lists of at most that many. An entry of another form raises before any key
    of its piece."""
    view = memoryview(raw)
    step = REPLAY_ENTRIES * (key_bytes + 1)
    for start in range(0, len(view), step):
        yield from replay(view[start : start + step], key_bytes, where + start)


class LogBook:
    """What a key log keeps and checks alike, the server's one (:class:`KeyLog`) or a cluster's
    per slot (:class:`~kvtier.backends.redis_slotlogs.SlotLogs`): the entries' size, the
    counters (under a lock: a cluster's primaries may be read on several threads) and the last
    problem, the replies of its ``APPEND`` commands, and the trust rules of an open: every entry
    stored or deleted, and at least half of a sample of the stored keys' records found."""

    COUNTERS = ("opens", "fallbacks", "rewrites", "rewrite_failures", "append_failures", "sampled_gone")

    def __init__(self, key_bytes: int, what: str) -> None:
        self.key_bytes = key_bytes
        #: an entry: its operation (:data:`STORED` or :data:`DELETED`), then the key
        self.entry_bytes = key_bytes + 1
        #: the log(s) in messages: "the key log", "a primary's slot logs"
        self.what = what
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.last_problem: str | None = None
        self._lock = threading.Lock()

    def count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self.counters[counter] += n

    def appended(self, wire: Wire, count: int = 1) -> None:
        """Read ``count`` ``APPEND`` replies; a refusal (an ACL without it, ``MOVED`` mid-migration)
        is counted, never raised: the records are stored, only missing from their log."""
        for _ in range(count):
            try:
                wire.reply()
            except ErrorReply as exc:
                self.count("append_failures")
                log.debug("redis: %s: APPEND refused: %s", self.what, exc)

    def foreign(self, raw: bytes | bytearray | memoryview) -> str | None:
        """Why whole entries ``raw`` are not to be replayed: one that is neither stored nor deleted."""
        ops = np.frombuffer(raw, dtype=np.uint8)[:: self.entry_bytes]
        if ((ops == STORED[0]) | (ops == DELETED[0])).all():
            return None
        return f"entries of another form in {self.what}"

    def sampled(self, wire: Wire, prefix: bytes, stored: Sequence[bytes], *, one_command: bool) -> str | None:
        """Look the records of the sampled ``stored`` keys up (one ``EXISTS`` of them all, or,
        where they span slots, one each): why the log is not to be trusted (fewer than half of
        them found), or ``None``. The keys found gone are counted."""
        if not stored:
            return None
        if one_command:
            wire.send([command(b"EXISTS", *(prefix + key for key in stored))])
            live = int(wire.reply())
        else:
            wire.send([b"".join(command(b"EXISTS", prefix + key) for key in stored)])
            live = 0
            for _ in stored:
                try:
                    live += int(wire.reply())
                except ErrorReply:  # moved meanwhile: not found here
                    pass
        self.count("sampled_gone", len(stored) - live)
        if 2 * live < len(stored):
            return f"{len(stored) - live} of {len(stored)} sampled keys of {self.what} have no record"
        return None

    def stats(self, enabled: bool, **more: Any) -> dict[str, Any]:
        return dict(self.counters, enabled=enabled, **more, last_problem=self.last_problem)


class KeyLog:
    """The key log of ``tier``'s namespace (see the module doc); counters in :meth:`stats`."""

    def __init__(self, tier: KeyLogHost, key_bytes: int) -> None:
        self.t = tier
        self.book = LogBook(key_bytes, "the key log")

    @property
    def name(self) -> bytes:
        return self.t._prefix_bytes + KEYLOG_SUFFIX

    @property
    def enabled(self) -> bool:
        return not self.t.cluster and not self.t._foreign

    # -- writing -------------------------------------------------------------------------------
    def append_commands(self, keys: Iterable[bytes], op: bytes = b"") -> tuple[bytes, int]:
        """``APPEND <log> <entries>`` of ``keys`` (stored, or ``op``) and the count of commands
        (one), or ``(b"", 0)`` where the tier keeps no log or there are no keys."""
        if not self.enabled:
            return b"", 0
        joined = entries_of(keys, op or STORED)
        return (command(b"APPEND", self.name, joined), 1) if joined else (b"", 0)

    def appended(self, wire: Wire, count: int = 1) -> None:
        self.book.appended(wire, count)

    # -- reading (a store's open) --------------------------------------------------------------
    def open_table(self, listing: Callable[[Callable[[], Iterable[list[bytes]]] | None], Listed | None]) -> Listed | None:
        """The open's table of keys: ``listing`` (the tier's, which gathers batches into a table
        and filters it) given the log's batches where the log is trusted, else ``listing(None)``
        (``SCAN``), after which the log is rewritten from that listing."""
        if not self.enabled:
            return listing(None)
        self.book.counters["sampled_gone"] = 0
        try:
            state, problem = self._on_wire(self.plan)
        except Exception as exc:  # the server failed: the listing meets it too, and marks it down
            log.debug("redis: key log not read: %s", exc)
            return listing(None)
        if problem is None:
            try:
                table = listing(partial(self._batches_on_wire, state))
            except KeyLogChanged as exc:
                problem = self.book.last_problem = str(exc)
            else:
                self.book.count("opens")
                if self.book.counters["sampled_gone"] and self.t.follower is not None:
                    # The log names records the server no longer holds: the first sweep (SCAN)
                    # runs as soon as the index is bound, not ten listings later, to forget them.
                    self.t.follower.sweep_now()
                return table
        self.book.count("fallbacks")
        log.info("redis: %s; listing the namespace with SCAN and writing the key log again", problem)
        table = listing(None)
        if table is not None and self.enabled:
            self.rewrite(state, table)
        return table

    def _on_wire(self, body: Callable[[Wire], T]) -> T:
        """``body(wire)`` on a pooled connection of the server (disconnected unless drained)."""
        pool = self.t._get_client().connection_pool
        conn = pool.get_connection()
        wire = Wire(conn._sock)
        try:
            return body(wire)
        finally:
            if not wire.drained:
                conn.disconnect()
            pool.release(conn)

    def _batches_on_wire(self, state: LogState) -> Iterator[list[bytes]]:
        pool = self.t._get_client().connection_pool
        conn = pool.get_connection()
        wire = Wire(conn._sock)
        try:
            yield from self.batches(wire, state)
        finally:
            if not wire.drained:
                conn.disconnect()
            pool.release(conn)

    def state(self, wire: Wire) -> LogState:
        """The log's length and header (``STRLEN`` and ``GETRANGE``, one round trip); a value of
        another type reads as length 0."""
        wire.send([command(b"STRLEN", self.name) + _getrange(self.name, 0, HEADER_BYTES - 1)])
        try:
            length = int(wire.reply())
        except ErrorReply:  # WRONGTYPE: not a log
            length = 0
        try:
            head = wire.reply() or b""
        except ErrorReply:
            head = b""
        return LogState(length, bytes(head))

    def plan(self, wire: Wire) -> tuple[LogState, str | None]:
        """The log's state, and why it is not to be read (``None``: read it): its header and
        length, then a sample of its keys' records looked up on the server."""
        state = self.state(wire)
        e = self.book.entry_bytes
        problem = state.problem(e)
        n = state.entries(e)
        if problem is None and n:
            picks = random.sample(range(n), min(n, SAMPLE))
            wire.send([b"".join(_getrange(self.name, HEADER_BYTES + i * e, HEADER_BYTES + (i + 1) * e - 1) for i in picks)])
            sample = [wire.reply() for _ in picks]
            if any(not isinstance(entry, bytes) or len(entry) != e for entry in sample):
                problem = f"entries of another form in {self.book.what}"
            else:
                problem = self.book.foreign(b"".join(sample)) or self.book.sampled(
                    wire, self.t._prefix_bytes, [entry[1:] for entry in sample if entry[:1] == STORED], one_command=True
                )
        self.book.last_problem = problem
        return state, problem

    def batches(self, wire: Wire, state: LogState) -> Iterator[list[bytes]]:
        """The keys the log held when ``state`` was read, :data:`READ_CHUNK` bytes a batch (a key
        may come more than once: written again). Every reply has been read when the iteration
        ends; a log found shorter (rewritten meanwhile) raises :class:`KeyLogChanged`."""
        e = self.book.entry_bytes
        end = HEADER_BYTES + state.entries(e) * e
        chunk = max(1, READ_CHUNK // e) * e
        starts = range(HEADER_BYTES, end, chunk)
        wire.send([b"".join(_getrange(self.name, s, min(end, s + chunk) - 1) for s in starts)])
        for s in starts:
            want = min(end, s + chunk) - s
            n = wire.bulk_length()
            if n != want:
                raise KeyLogChanged(f"the key log was rewritten while read ({n} bytes at {s}, not {want})")
            raw = bytearray(n)
            wire.read_into(memoryview(raw))
            wire.skip(2)
            yield from replay_pieces(raw, self.book.key_bytes, s)

    # -- sweeps ------------------------------------------------------------------------------------
    def sweep_state(self) -> LogState | None:
        """The log's state before a sweep lists the server (``None``: no log, or not read)."""
        if not self.enabled:
            return None
        try:
            return self._on_wire(self.state)
        except Exception as exc:  # the sweep meets the failure itself
            log.debug("redis: key log state not read: %s", exc)
            return None

    def after_sweep(self, state: LogState | None, found: Table) -> None:
        """Rewrite the log from a sweep's listing when it is untrusted or over twice as long."""
        if self.needs_rewrite(state, len(found)) and state is not None:
            self.rewrite(state, found)

    # -- rewriting -----------------------------------------------------------------------------
    def needs_rewrite(self, state: LogState | None, listed: int) -> bool:
        if state is None or not self.enabled:
            return False
        if state.problem(self.book.entry_bytes) is not None:
            return True
        return state.entries(self.book.entry_bytes) > 2 * listed + REWRITE_SLACK

    def rewrite(self, state: LogState, keys: Sequence[bytes] | Iterable[bytes]) -> bool:
        """Replace the log by a header and ``keys`` (a listing begun after ``state`` was read),
        keeping what was appended to it since; ``False`` when another rewrite came first or the
        server failed (the log is then as it was). Runs on the sweep's thread."""
        from redis.exceptions import RedisError, WatchError

        client = self.t._get_client()
        name = self.name
        tmp = name + b".new." + os.urandom(6).hex().encode()
        started = time.perf_counter()
        try:
            pipe = client.pipeline(transaction=False)
            pipe.set(tmp, new_header(), px=_TMP_TTL_MS)
            batch: list[bytes] = []
            for key in keys:
                batch.append(key)
                if len(batch) == _REWRITE_KEYS:
                    pipe.append(tmp, entries_of(batch, STORED))
                    batch = []
            if batch:
                pipe.append(tmp, entries_of(batch, STORED))
            pipe.execute()
            for _ in range(_REWRITE_TRIES):
                with client.pipeline(transaction=True) as tx:
                    try:
                        tx.watch(name)
                        if tx.type(name) in (b"string", "string"):
                            length = int(tx.strlen(name))
                            head = bytes(tx.getrange(name, 0, HEADER_BYTES - 1) or b"")
                        else:  # none, or a value of another type under the log's name: replaced
                            length, head = 0, b""
                        # Another rewrite came first (or the log was lost): keep what is there.
                        # A log that was missing may have been begun by APPENDs since: all tail.
                        ours = head == state.head if state.length else not head.startswith(MAGIC)
                        if not ours or length < state.length:
                            log.debug("redis: key log rewritten or lost meanwhile; this rewrite is dropped")
                            client.unlink(tmp)
                            return False
                        tail = bytes(tx.getrange(name, state.length, -1) or b"") if length > state.length else b""
                        tx.multi()
                        if tail:
                            tx.append(tmp, tail)
                        tx.rename(tmp, name)
                        tx.persist(name)
                        tx.execute()
                    except WatchError:  # an APPEND landed meanwhile: copy the tail again
                        continue
                self.book.count("rewrites")
                log.debug("redis: key log rewritten in %.3f s", time.perf_counter() - started)
                return True
            client.unlink(tmp)
        except (RedisError, OSError) as exc:
            log.debug("redis: key log rewrite failed: %s", exc)
        self.book.count("rewrite_failures")
        return False

    def stats(self) -> dict[str, Any]:
        return self.book.stats(self.enabled)
