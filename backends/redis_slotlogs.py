"""The key logs of a ``redis`` tier on a Redis Cluster: one per hash slot, so that a store's open
reads every primary's index in one pipelined exchange instead of a ``SCAN`` of its keyspace.

A record's log entry must live in the record's hash slot: then its ``APPEND`` goes in the same
pipeline to the same primary as the record's ``SET``, and a slot that migrates (resharding)
carries its log with its records. Records carry no hash tag (the prefix holds no brace), so their
slots are spread over all 16384; hence a log per slot:

* **naming**: slot ``s``'s log is ``<prefix>:<namespace digest, 16 hex>:keys{<tag of s>}``, where
  the tag of ``s`` is the decimal form of the smallest integer whose CRC16 falls in slot ``s``
  (:func:`slot_tags`, 1 to 6 digits, computed once per process). The name is fixed by the slot
  alone, so every host and every build finds the same logs, and a roster is not needed: the
  open reads, on each primary, the logs of the slots the cluster's slot map gives it.
* **the value** is :mod:`kvtier.backends.redis_keylog`'s: a 32-byte header, then 33-byte entries
  (``+`` stored or ``-`` deleted, then the key), replayed in order. A key's entries are all in
  one slot's log, so the logs of a primary replayed one after the other keep each key's order.
* **writing**: each put share ends with one ``APPEND`` per slot it stored records in (after their
  ``SET`` replies, in one pipeline on the share's connection); a delete appends its keys as
  deleted after its ``UNLINK`` commands, one ``APPEND`` per slot.
* **reading** (a store's open), the primaries in turn: one pipeline of ``GET`` of every slot
  log of the primary (parsed by hiredis a receive buffer at a time where it is installed; each
  header checked and each log's entries copied, as its reply is read,
  into a :class:`~kvtier.backends.redis_wire.Scratch`, a mapping of their own: a buffer of that
  size from ``malloc`` on the open's thread stays resident in that thread's arena after the
  open), then one of ``EXISTS`` of a sample of :data:`SAMPLE` stored keys (one per key:
  a multi-key ``EXISTS`` is refused across slots). The primary's logs are trusted only when every
  one exists with a header, is a whole number of entries, holds only ``+`` and ``-`` entries,
  and at least half the sampled records exist. Every slot log is begun with a header whenever a
  primary's logs are written, empty slots included, so a missing log is one the server lost
  (evicted, a restarted node that kept no data), never a slot without records; it is not told
  apart from an older store that kept none, and both are listed with ``SCAN``. A primary whose
  logs are not trusted is listed with ``SCAN`` alone (the others still read their logs), and
  every slot log of it is then written again from that listing. A slot being migrated answers
  ``MOVED`` or ``ASK`` for its log: not trusted, so the primary is listed with ``SCAN`` (never a
  log read from the wrong node). A key a trusted log names whose record the server lost is
  adopted and is a miss when loaded (each record keeps its own check); the first sweep, run at
  once when the sample found any, forgets it.
* **rewriting**: a log is replaced by one ``EVAL`` on its slot's primary (:data:`REWRITE_SCRIPT`:
  a rewrite of many small values is one pipeline, where ``WATCH`` would take a round trip per
  slot): the script keeps what was appended after the state the rewrite was planned from, and
  drops the rewrite when another host's came first (the header differs) or the log got shorter.
  A sweep (``SCAN`` of every primary) reads every slot log's length and header first, and
  rewrites, from its listing, the slot logs that are untrusted, or, when all the logs together
  hold more than twice the keys listed (plus :data:`REWRITE_SLACK`), those over twice their own
  slot's. A refused ``EVAL`` (an ACL without it) is counted: the logs stay untrusted, and the
  open lists with ``SCAN``, as before there were logs.

Counters (:meth:`SlotLogs.stats`, the tier's ``key_log``): ``opens`` and ``fallbacks`` count
primaries (read from their logs, listed with ``SCAN``), ``rewrites`` and ``rewrite_failures``
count slot logs.
"""

from __future__ import annotations

import binascii
import functools
import logging
import random
import threading
from array import array
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from itertools import compress, pairwise
from operator import is_not
from typing import Any, Protocol, TypeVar

import numpy as np
from kvtier.backends.redis_keylog import (
    HEADER_BYTES,
    MAGIC,
    SAMPLE,
    STORED,
    LogBook,
    LogState,
    Table,
    command,
    entries_of,
    new_header,
    replay_pieces,
)
from kvtier.backends.redis_scan import SCAN_COUNT, scan_block_keys
from kvtier.backends.redis_wire import ErrorReply, Scratch, Wire
from kvtier.backends.remote_listing import Listed

from kvtier.errors import MissingDependencyError

try:
    from redis.crc import key_slot
    from redis.exceptions import ResponseError
except ImportError as exc:  # pragma: no cover - redis is a dependency; a broken install says so
    raise MissingDependencyError(f"the redis backend needs redis-py: pip install 'redis[hiredis]' ({exc})") from exc

__all__ = ["REWRITE_SCRIPT", "SLOTS", "SlotLogs", "append_commands", "slot_entries", "slot_log_name", "slot_tags", "slots_of"]

log = logging.getLogger("kvtier")
T = TypeVar("T")

SLOTS = 16384
#: Integers searched for the slots' tags (every slot's smallest is under 110,000).
_TAG_SEARCH = 131072
#: Integers whose CRCs are computed together while searching (columns of 32 KiB).
_TAG_CHUNK = 8192
#: ``GET`` commands joined into one buffer of the open's pipeline (about 30 KB): one buffer
#: for a primary's 5,461 slots (330 KB) stayed resident at the top of the open's thread's heap.
_GETS_PER_PIECE = 512
#: All slot logs together this many entries over twice the listed keys are rewritten.
REWRITE_SLACK = 1024
#: Replace the log ``KEYS[1]`` by ``ARGV[4]`` (a header and entries) followed by what was appended
#: to it after the state the rewrite was planned from (``ARGV[1]`` bytes long, beginning with the
#: 32 bytes ``ARGV[2]``); 0 when another rewrite came first (another header, or a log that was
#: missing then and has a header now) or the log is shorter. A value of another type is replaced.
REWRITE_SCRIPT = b"""\
local cur = ''
if redis.call('TYPE', KEYS[1])['ok'] == 'string' then cur = redis.call('GET', KEYS[1]) end
local was = tonumber(ARGV[1])
local ours
if was > 0 then ours = string.sub(cur, 1, 32) == ARGV[2] else ours = string.sub(cur, 1, 16) ~= ARGV[3] end
if (not ours) or #cur < was then return 0 end
redis.call('SET', KEYS[1], ARGV[4] .. string.sub(cur, was + 1))
return 1
"""


class SlotTags:
    """The hash tags of the slots' logs, ``tags[slot]`` (``bytes``), kept as one 32-bit number a
    slot (64 KiB) and formatted when asked: a ``bytes`` object a slot kept for the process took
    about 0.9 MB, which a store's open added to its RSS."""

    __slots__ = ("_numbers",)

    def __init__(self, numbers: Iterable[int] | bytes) -> None:
        self._numbers = array("I", numbers)  # bytes: the numbers' native 32-bit form

    def __len__(self) -> int:
        return len(self._numbers)

    def __getitem__(self, slot: int) -> bytes:
        return b"%d" % self._numbers[slot]

    def __iter__(self) -> Iterator[bytes]:
        return (b"%d" % n for n in self._numbers)


@functools.cache
def slot_tags() -> SlotTags:
    """The hash tag of each slot's log: the decimal form of the smallest integer whose CRC16 (the
    cluster's key hash) falls in that slot; every slot has one under :data:`_TAG_SEARCH`. The
    integers are taken in increasing order, :data:`_TAG_CHUNK` at a time (never across a digit
    count), their CRCs computed as columns a digit position at a time, and each slot not yet
    tagged takes the first of the chunk that falls in it. Small columns: the work arrays of
    all 131,072 integers at once (about 2 MB, freed after) stayed resident at the top of the
    heap of the thread of a store's open, 1.8 MB of its RSS."""
    table = np.array([binascii.crc_hqx(bytes([i]), 0) for i in range(256)], dtype=np.uint32)
    tags = np.zeros(SLOTS, dtype=np.uint32)
    tagged = np.zeros(SLOTS, dtype=bool)
    left, lo = SLOTS, 0
    while left and lo < _TAG_SEARCH:
        digits = len(str(lo))
        hi = min(lo + _TAG_CHUNK, 10**digits, _TAG_SEARCH)
        numbers = np.arange(lo, hi, dtype=np.uint32)
        crc = np.zeros(hi - lo, dtype=np.uint32)
        for power in range(digits - 1, -1, -1):
            digit = (numbers // 10**power) % 10 + ord("0")
            crc = ((crc << 8) & 0xFF00) ^ table[((crc >> 8) ^ digit) & 0xFF]
        slots, first = np.unique(crc % SLOTS, return_index=True)  # each slot's first in the chunk
        new = ~tagged[slots]
        tags[slots[new]] = numbers[first[new]]
        tagged[slots[new]] = True
        left -= int(new.sum())
        lo = hi
    if left:  # pragma: no cover - fixed by the CRC: checked by the tests
        raise RuntimeError("a hash slot has no tag under the search bound")
    return SlotTags(tags.tobytes())


def slot_log_name(prefix: bytes, slot: int) -> bytes:
    """The log of ``slot`` in the namespace at ``prefix`` (it hashes to that slot)."""
    return prefix + b"keys{" + slot_tags()[slot] + b"}"


def slots_of(prefix: bytes, keys: Iterable[bytes]) -> dict[int, list[bytes]]:
    """``keys`` grouped by the hash slot of their records (``prefix`` + key), in order. The CRC
    of the prefix is taken once and each key's continues from it (``crc_hqx`` chains), unless a
    brace makes a hash tag possible: then the cluster's own rule (``key_slot``) decides."""
    groups: dict[int, list[bytes]] = {}
    if b"{" in prefix:
        for key in keys:
            groups.setdefault(key_slot(prefix + key), []).append(key)
        return groups
    base, crc = binascii.crc_hqx(prefix, 0), binascii.crc_hqx
    for key in keys:
        slot = key_slot(prefix + key) if b"{" in key else crc(key, base) % SLOTS
        part = groups.get(slot)
        if part is None:
            groups[slot] = [key]
        else:
            part.append(key)
    return groups


def slot_entries(prefix: bytes, keys: Iterable[bytes], op: bytes) -> list[tuple[bytes, bytes]]:
    """``(slot log, entries)`` of ``keys`` under ``op``, one per slot they fall in (what a writer
    outside the tier, ``kvtier clear --tenant``, appends for the keys it deleted)."""
    return [(slot_log_name(prefix, slot), entries_of(part, op)) for slot, part in slots_of(prefix, keys).items()]


def append_commands(prefix: bytes, keys: Iterable[bytes], op: bytes) -> tuple[bytes, int]:
    """``APPEND <slot log> <entries>`` of ``keys`` under ``op`` (one byte), one per slot they
    fall in, as one buffer, and how many: what :func:`slot_entries` gives, made into commands
    with one format each (the tier's put shares send one per slot they stored in)."""
    tags = slot_tags()
    groups = slots_of(prefix, keys)
    size = len(prefix) + 6  # the name: prefix, "keys{", the tag, "}"
    return b"".join([
        b"*3\r\n$6\r\nAPPEND\r\n$%d\r\n%bkeys{%b}\r\n$%d\r\n%b%b\r\n"
        % (size + len(tag), prefix, tag, sum(map(len, part)) + len(part), op, op.join(part))
        for slot, part in groups.items()
        for tag in (tags[slot],)
    ]), len(groups)


class SlotLogHost(Protocol):
    """What :class:`SlotLogs` uses of the tier."""

    follower: Any
    _foreign: bool
    _prefix_bytes: bytes
    _nodes: Any

    def _get_client(self) -> Any: ...


class SlotLogs:
    """The slot logs of ``tier``'s namespace on a cluster (see the module doc)."""

    def __init__(self, tier: SlotLogHost, key_bytes: int) -> None:
        self.t = tier
        self.book = LogBook(key_bytes, "a primary's slot logs")
        self._lock = threading.Lock()
        #: (the client's slot map, its slots by primary's name, the map's size)
        self._slot_owners: tuple[Any, dict[str, list[int]], int] = (None, {}, 0)

    @property
    def enabled(self) -> bool:
        return not self.t._foreign

    def name(self, slot: int) -> bytes:
        """Slot ``slot``'s log (it hashes to that slot)."""
        return slot_log_name(self.t._prefix_bytes, slot)

    # -- writing -------------------------------------------------------------------------------
    def append_commands(self, keys: Iterable[bytes], op: bytes = b"") -> tuple[bytes, int]:
        """One ``APPEND`` per slot of ``keys`` (stored, or ``op``), and how many."""
        if not self.enabled:
            return b"", 0
        return append_commands(self.t._prefix_bytes, keys, op or STORED)

    def appended(self, wire: Wire, count: int = 1) -> None:
        self.book.appended(wire, count)

    # -- reading (a store's open) --------------------------------------------------------------
    def open_table(self, listing: Callable[[Callable[[], Iterable[list[bytes]]] | None], Listed | None]) -> Listed | None:
        """The open's table: ``listing`` given each primary's batches, from its logs where they
        are trusted, else from its ``SCAN`` (after which its logs are written again)."""
        if not self.enabled:
            return listing(None)
        self.book.counters["sampled_gone"] = 0
        self._slot_owners = (None, {}, 0)  # sorted again from the client's slot map
        slot_tags()  # made before the threads start
        table = listing(self._open_batches)
        if self.book.counters["sampled_gone"] and self.t.follower is not None:
            self.t.follower.sweep_now()  # forget the records the server lost, at once
        return table

    def _slots_of(self, node: Any) -> list[int]:
        """The slots the cluster's slot map gives the primary behind ``node`` (a node's client);
        the map is sorted by primary once per open or sweep (redis-py updates it in place)."""
        cache = self.t._get_client().nodes_manager.slots_cache
        with self._lock:
            if self._slot_owners[0] is not cache or self._slot_owners[2] != len(cache):
                owners: dict[str, list[int]] = {}
                # redis-py keeps one list of nodes for each range of slots: walked a range at a
                # time (the ranges' ends found in C), not a slot at a time.
                slots, nodes = list(cache), list(cache.values())
                cuts = [0, *compress(range(1, len(nodes)), map(is_not, nodes[1:], nodes[:-1])), len(nodes)]
                for lo, hi in pairwise(cuts):
                    if nodes[lo]:
                        owners.setdefault(nodes[lo][0].name, []).extend(slots[lo:hi])
                self._slot_owners = (cache, {name: sorted(slots) for name, slots in owners.items()}, len(cache))
            return self._slot_owners[1].get(self._node_name(node), [])

    def _on_node(self, node: Any, body: Callable[[Wire], Iterable[T]]) -> Iterator[T]:
        """``body(wire)``'s items on a pooled connection of ``node`` (disconnected unless drained)."""
        pool = node.connection_pool
        conn = pool.get_connection()
        wire = Wire(conn._sock)
        try:
            yield from body(wire)
        finally:
            if not wire.drained:
                conn.disconnect()
            pool.release(conn)

    def _open_batches(self) -> Iterator[list[bytes]]:
        """The open's batches: every primary's logs read in turn (reading is quick: on one thread
        the replies are not held up by the other threads' hold on the interpreter; measured
        0.6 s against 1.1 s at 10^6 records on three primaries), then the primaries whose logs
        are not trusted listed with ``SCAN`` at once, a thread each."""
        untrusted: dict[str, dict[int, LogState]] = {}
        yield from self.t._nodes.each(partial(self._node_logs, untrusted))
        if untrusted:
            yield from self.t._nodes.each(partial(self._node_scan, untrusted), parallel=True)

    @staticmethod
    def _node_name(node: Any) -> str:
        kwargs = node.connection_pool.connection_kwargs
        return f"{kwargs['host']}:{kwargs['port']}"

    def _node_logs(self, untrusted: dict[str, dict[int, LogState]], node: Any) -> Iterator[list[bytes]]:
        """The keys of ``node``'s slot logs where they are trusted; else nothing, and the node is
        noted in ``untrusted`` with its logs' states."""
        slots = self._slots_of(node)

        def body(wire: Wire) -> Iterator[list[bytes]]:
            entries = Scratch()
            try:
                problem = self._read_logs(wire, slots, entries)
                if problem is None:
                    with entries.view() as raw:
                        problem = self._sample(wire, raw)
                        if problem is None:
                            self.book.count("opens")
                            # In pieces: the lists of keys stay small (one of a primary's keys at
                            # once would be a large block on the heap of the open's thread).
                            yield from replay_pieces(raw, self.book.key_bytes)
                            return
            finally:
                entries.close()
            self.book.count("fallbacks")
            self.book.last_problem = problem
            log.info("redis: %s; listing that primary with SCAN and writing its slot logs again", problem)
            # The logs' states now, before the listing: a rewrite keeps what is appended after them.
            states = dict(self._states_body(slots)(wire))
            untrusted[self._node_name(node)] = states

        return self._on_node(node, body)

    def _node_scan(self, untrusted: dict[str, dict[int, LogState]], node: Any) -> Iterator[list[bytes]]:
        """``node``'s records listed with ``SCAN``, then its slot logs written again from that
        listing; nothing for a node whose logs were trusted."""
        states = untrusted.get(self._node_name(node))
        if states is None:
            return iter(())

        def body(wire: Wire) -> Iterator[list[bytes]]:
            listed: dict[bytes, None] = {}
            try:
                for batch in scan_block_keys(wire, self.t._prefix_bytes, self.book.key_bytes, SCAN_COUNT):
                    listed.update(dict.fromkeys(batch))
                    yield batch
            except ErrorReply as exc:  # refused (an ACL without SCAN): as redis-py reports it
                raise ResponseError(str(exc)) from exc
            if self.enabled:
                self._rewrite(wire, states, self._by_slot(listed, states))

        return self._on_node(node, body)

    def _read_logs(self, wire: Wire, slots: list[int], entries: Scratch) -> str | None:
        """Every slot log of ``slots`` (one pipeline of ``GET``), their entries appended to
        ``entries`` in slot order as they are read (each header checked then, not kept); the
        first problem found (``None``: ``entries`` holds them all). The lengths are checked as
        a column: most logs hold a few entries, so the work per slot is all that counts."""
        wire.send(self._gets(slots))
        lengths, errors, unmarked = wire.bulk_bodies(len(slots), MAGIC, HEADER_BYTES, entries)
        lens = np.array(lengths, dtype=np.int64)
        bad = np.flatnonzero((lens < HEADER_BYTES) | ((lens - HEADER_BYTES) % self.book.entry_bytes != 0))
        first = min(int(bad[0]) if len(bad) else len(slots), unmarked if unmarked >= 0 else len(slots))
        if first == len(slots):
            return None
        if first in errors:  # WRONGTYPE, or MOVED/ASK: the slot is elsewhere now
            return f"slot {slots[first]}'s key log not read ({errors[first]})"
        n = lens[first]
        if n < 0:
            return f"slot {slots[first]}: no key log"
        if first == unmarked:
            return f"slot {slots[first]}: the key log has no header (evicted and begun again, or not ours)"
        return f"slot {slots[first]}: the key log's length {n} is not a whole number of entries"

    def _gets(self, slots: list[int]) -> list[bytes]:
        """``GET`` of each slot log of ``slots``, as one pipeline (made at each open, one format
        a slot: 16,384 commands kept for the process took 1.5 MB), in pieces of
        :data:`_GETS_PER_PIECE` commands."""
        prefix, tags = self.t._prefix_bytes, slot_tags()
        size = len(prefix) + 6  # the name: prefix, "keys{", the tag, "}"
        one = b"*2\r\n$3\r\nGET\r\n$%d\r\n%bkeys{%b}\r\n"
        return [
            b"".join([one % (size + len(tags[s]), prefix, tags[s]) for s in slots[i : i + _GETS_PER_PIECE]])
            for i in range(0, len(slots), _GETS_PER_PIECE)
        ]

    def _sample(self, wire: Wire, raw: memoryview) -> str | None:
        """Why a primary's logs are not to be read (``None``: read them): an entry of another
        form, or fewer than half of a sample of their stored keys' records exist."""
        problem = self.book.foreign(raw)
        if problem is not None:
            return problem
        e = self.book.entry_bytes
        picks = random.sample(range(len(raw) // e), min(len(raw) // e, SAMPLE))
        stored = [bytes(raw[i * e + 1 : (i + 1) * e]) for i in picks if raw[i * e] == STORED[0]]
        return self.book.sampled(wire, self.t._prefix_bytes, stored, one_command=False)  # one per key: slots differ

    # -- sweeps ------------------------------------------------------------------------------------
    def sweep_state(self) -> dict[int, LogState] | None:
        """Every live primary's slot logs' lengths and headers, before a sweep lists the cluster
        (``None``: no logs, or not read)."""
        if not self.enabled:
            return None
        self._slot_owners = (None, {}, 0)
        try:
            return dict(self.t._nodes.each(lambda node: self._on_node(node, self._states_body(self._slots_of(node)))))
        except Exception as exc:  # the sweep meets the failure itself
            log.debug("redis: slot logs' state not read: %s", exc)
            return None

    def after_sweep(self, states: dict[int, LogState] | None, found: Table) -> None:
        """Rewrite, from a sweep's listing, the untrusted slot logs, or those over twice their
        slot's keys when all of them together hold over twice the keys listed."""
        if not states or not self.enabled:
            return
        e = self.book.entry_bytes
        bad = {slot for slot, state in states.items() if state.problem(e) is not None}
        if not bad and sum(state.entries(e) for state in states.values()) <= 2 * len(found) + REWRITE_SLACK:
            return
        by_slot = self._by_slot(found, states)
        redo = {slot for slot in states if slot in bad or states[slot].entries(e) > 2 * len(by_slot[slot])}
        client = self.t._get_client()
        per_node: dict[str, tuple[Any, dict[int, LogState]]] = {}
        for slot in redo:
            owner = client.nodes_manager.get_node_from_slot(slot)
            per_node.setdefault(owner.name, (client.get_redis_connection(owner), {}))[1][slot] = states[slot]
        for node, mine in per_node.values():
            try:
                for _ in self._on_node(node, partial(self._rewrite, states=mine, by_slot=by_slot)):
                    pass
            except Exception as exc:  # the primary failed: its logs stay as they are
                self.book.count("rewrite_failures", len(mine))
                log.debug("redis: slot logs not rewritten: %s", exc)

    # -- rewriting -----------------------------------------------------------------------------
    def _by_slot(self, keys: Iterable[bytes], states: dict[int, LogState]) -> dict[int, list[bytes]]:
        """``keys`` grouped by slot, for the slots of ``states`` (others' keys left out)."""
        prefix = self.t._prefix_bytes
        groups: dict[int, list[bytes]] = {slot: [] for slot in states}
        for key in keys:
            part = groups.get(key_slot(prefix + key))
            if part is not None:
                part.append(key)
        return groups

    def _rewrite(self, wire: Wire, states: dict[int, LogState], by_slot: dict[int, list[bytes]]) -> tuple[()]:
        """Each slot log of ``states`` replaced (one pipelined ``EVAL`` each, on its primary's
        ``wire``) by a header and its slot's keys, keeping what was appended since its state.
        Returns no items (it runs as a body of :meth:`_on_node`)."""
        if not states:
            return ()
        wire.send([
            b"".join(
                command(
                    b"EVAL", REWRITE_SCRIPT, b"1", self.name(slot), b"%d" % state.length, state.head, MAGIC,
                    new_header() + entries_of(by_slot[slot], STORED),
                )
                for slot, state in states.items()
            )
        ])
        for _ in states:
            try:
                done = wire.reply()
            except ErrorReply as exc:
                self.book.count("rewrite_failures")
                log.debug("redis: slot log rewrite refused: %s", exc)
                continue
            if done == 1:
                self.book.count("rewrites")
        return ()

    def _states_body(self, slots: list[int]) -> Callable[[Wire], list[tuple[int, LogState]]]:
        """The states (``STRLEN`` and the header) of ``slots``' logs, read on a primary's wire."""

        def body(wire: Wire) -> list[tuple[int, LogState]]:
            wire.send([
                b"".join(
                    command(b"STRLEN", self.name(slot)) + command(b"GETRANGE", self.name(slot), b"0", b"%d" % (HEADER_BYTES - 1))
                    for slot in slots
                )
            ])
            states = []
            for slot in slots:
                try:
                    length = int(wire.reply())
                except ErrorReply:  # WRONGTYPE (not a log), or the slot moved: untrusted
                    length = 0
                try:
                    head = wire.reply() or b""
                except ErrorReply:
                    head = b""
                states.append((slot, LogState(length, bytes(head))))
            return states

        return body

    def stats(self) -> dict[str, Any]:
        return self.book.stats(self.enabled, per_slot=True)

