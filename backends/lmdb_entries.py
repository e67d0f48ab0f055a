"""An ``lmdb`` tier's index entries (stamp, stored size and, split layout, the record's head:
see :mod:`kvtier.backends.lmdb_layout`), the size below which a record is written joined (one
value, no entry: :data:`JOIN_MAX`), and what reading a job found (:class:`ReadOutcome`)."""

from __future__ import annotations

import struct
from typing import Any

from kvtier.records.format import HEAD_MAX, HEADER_SIZE

__all__ = [
    "COLD_GET_S", "ENTRY_SIZES", "INDEX", "JOINED", "JOIN_MAX", "ReadOutcome", "entry_stamp", "head_in_value", "index_entry", "join_record", "restamp",
]

INDEX = struct.Struct("<dQ")
#: Records of at most this many bytes (head and payload) are written joined: the whole record in
#: ``blocks``, no index entry (see :mod:`kvtier.backends.lmdb_layout`); larger ones split.
#: 0: every record split (as the code before wrote them).
JOIN_MAX = 64 * 1024 + HEAD_MAX
#: The entry a joined record is read with: as long as a whole-layout entry (the head starts the
#: value), stamp and size zero (never written).
JOINED = bytes(INDEX.size)
#: A lookup slower than this read its value from disk: the rest of the job is read cold. A warm
#: ``get`` of a 2 MiB value takes 10-30 µs here (its pages are touched, not read); a cold one
#: several milliseconds.
COLD_GET_S = 1e-3
#: Index entry lengths: whole layout, split plain, split keyed.
ENTRY_SIZES = (INDEX.size, INDEX.size + HEADER_SIZE, INDEX.size + HEAD_MAX)


def index_entry(stamp: float, stored: int, head: bytes = b"") -> bytes:
    """The index entry of a record: its stamp and stored size, then (split layout) its head."""
    return INDEX.pack(stamp, stored) + head


def entry_stamp(entry: Any) -> tuple[float, int]:
    """``(stamp, stored bytes)`` of an index entry; ``ValueError`` if it has no valid length."""
    if len(entry) not in ENTRY_SIZES:
        raise ValueError(f"index entry of {len(entry)} bytes (expected one of {ENTRY_SIZES})")
    stamp, stored = INDEX.unpack_from(entry, 0)
    return stamp, stored


def restamp(entry: Any, stamp: float) -> bytes:
    """``entry`` with its stamp replaced (its size and head kept)."""
    _, stored = entry_stamp(entry)
    return INDEX.pack(stamp, stored) + bytes(entry[INDEX.size :])


def head_in_value(value: Any, block_bytes: int) -> bool:
    """Whether ``value`` (a ``blocks`` value of a store of ``block_bytes`` blocks) holds its
    record's head, told by its length alone: a split value is the payload, never longer than
    the raw block (a codec's output is kept only when shorter), so a longer one is a joined
    or whole record and its index entry need not be looked up."""
    return len(value) > block_bytes


def join_record(entry: Any, value: Any) -> bytes:
    """The whole record (head + payload) of a stored pair, whatever its layout; the value as it
    is when its entry is missing or unreadable (a checker then finds what is wrong with it)."""
    if entry is None or len(entry) not in ENTRY_SIZES or len(entry) == INDEX.size:
        return bytes(value)
    return bytes(entry[INDEX.size :]) + bytes(value)


class ReadOutcome:
    """What reading a job found: ``found`` per key, the keys to drop with the reason, the keys
    missed over an error that says nothing about their record (``transient``: kept), and how
    many were corrupt (of which ``auth`` refused by the keyed MAC); and, once a lookup midway
    found the job cold, how its rest is read (``cold_pick``: the way, when it was picked or
    ``None`` when taken with no pick, the bytes left), so the job decides that once and its
    reader times it."""

    __slots__ = ("auth", "bad", "cold_pick", "corrupt", "found", "transient")

    def __init__(self, n: int) -> None:
        self.found = [False] * n
        self.bad: dict[bytes, str] = {}
        self.transient: set[bytes] = set()
        self.corrupt = 0
        self.auth = 0
        self.cold_pick: tuple[int, float | None, int] | None = None

    def take(self, start: int, rest: ReadOutcome) -> None:
        """Add the outcome of reading the job's keys from ``start`` on."""
        self.found[start:] = rest.found
        self.bad.update(rest.bad)
        self.transient |= rest.transient
        self.corrupt += rest.corrupt
        self.auth += rest.auth
