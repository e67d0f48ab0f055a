"""Where an ``lmdb`` tier keeps a record's parts, and how a job of records is read back.

Two layouts are read; the first is written:

* **split** (what this code writes): ``blocks[key]`` holds the payload alone and
  ``index[key]`` holds ``<d Q`` (last-access stamp, stored bytes) followed by the record's head
  (the :mod:`kvtier.records.format` header and, keyed, its tag). The payload is put straight from the
  caller's block: python-lmdb has no ``MDB_RESERVE``, so a record whose head had to precede its
  payload in one value cost a staging copy of every block (a save ran at 0.84 of a raw put,
  0.92 without the copy; ``benchmarks/bench_disk.py``).
* **whole** (written by earlier code): ``blocks[key]`` holds the whole record and ``index[key]`` the 16
  bytes of stamp and size.

The length of the index entry tells them apart, so a store written by earlier code is read
as it is and its records are replaced by split ones as they are rewritten. Both parts are
written in one transaction; a value without its index entry is treated as corrupt.

:class:`JobReader` reads a job: one read transaction, every record's head parsed and its extent
checked before a byte of its payload is touched, then :func:`~kvtier.records.checks.copy_and_check`.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lmdb
import numpy as np
import torch

from kvtier.errors import CorruptBlockError
from kvtier.records.checks import RawPayload, copy_and_check
from kvtier.records.codec import UnsupportedRecordError
from kvtier.records.format import HEAD_MAX, HEADER_SIZE, RecordAuthError, RecordBackend, RecordMac, parse_header

__all__ = ["INDEX", "JobReader", "ReadOutcome", "entry_stamp", "index_entry", "join_record", "restamp"]

log = logging.getLogger("kvtier.backends.lmdb_tier")

INDEX = struct.Struct("<dQ")
#: Index entry lengths: whole layout, split plain, split keyed.
_ENTRY_SIZES = (INDEX.size, INDEX.size + HEADER_SIZE, INDEX.size + HEAD_MAX)


def index_entry(stamp: float, stored: int, head: bytes = b"") -> bytes:
    """The index entry of a record: its stamp and stored size, then (split layout) its head."""
    return INDEX.pack(stamp, stored) + head


def entry_stamp(entry: Any) -> tuple[float, int]:
    """``(stamp, stored bytes)`` of an index entry; ``ValueError`` if it has no valid length."""
    if len(entry) not in _ENTRY_SIZES:
        raise ValueError(f"index entry of {len(entry)} bytes (expected one of {_ENTRY_SIZES})")
    stamp, stored = INDEX.unpack_from(entry, 0)
    return stamp, stored


def restamp(entry: Any, stamp: float) -> bytes:
    """``entry`` with its stamp replaced (its size and head kept)."""
    _, stored = entry_stamp(entry)
    return INDEX.pack(stamp, stored) + bytes(entry[INDEX.size :])


def join_record(entry: Any, value: Any) -> bytes:
    """The whole record (head + payload) of a stored pair, whatever its layout; the value as it
    is when its entry is missing or unreadable (a checker then finds what is wrong with it)."""
    if entry is None or len(entry) not in _ENTRY_SIZES or len(entry) == INDEX.size:
        return bytes(value)
    return bytes(entry[INDEX.size :]) + bytes(value)


class ReadOutcome:
    """What reading a job found: ``found`` per key, the keys to drop with the reason, and how
    many were corrupt (of which ``auth`` refused by the keyed MAC)."""

    __slots__ = ("auth", "bad", "corrupt", "found")

    def __init__(self, n: int) -> None:
        self.found = [False] * n
        self.bad: dict[bytes, str] = {}
        self.corrupt = 0
        self.auth = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class JobReader:
    """Reads jobs of records of one open environment into caller rows (see the module doc)."""

    blocks: Any  # the environment's databases
    index: Any
    psize: int
    map_base: int | None  # where data.mdb is mapped (None: unknown, not Linux)
    path: str
    block_bytes: int

    def read(self, env: lmdb.Environment, keys: Sequence[bytes], out: Sequence[torch.Tensor], mac: RecordMac | None) -> ReadOutcome:
        """Every failure is confined to its key: an absent, corrupt or unsupported record, and
        an LMDB error while looking one up (a damaged page), are a miss for that key alone and
        (except absent ones) listed in ``bad``. A value that would lie past the end of the
        file is never touched (that read would fault). LMDB errors beginning a transaction
        propagate."""
        outcome = ReadOutcome(len(keys))
        txn, pairs = self._lookup(env, keys, outcome.bad)
        try:
            items: list[RawPayload] = []
            where: list[int] = []
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            for i, (key, dst, pair) in enumerate(zip(keys, out, pairs)):
                if pair is None:
                    outcome.corrupt += key in outcome.bad
                    continue
                try:
                    head, header, payload = self._parse(pair, mac)
                except CorruptBlockError as exc:
                    self._refuse(outcome, key, exc)
                    continue
                view, staging = RecordBackend._host_view(dst)
                if staging is not None:
                    copies.append((dst, staging))
                items.append(RawPayload(key, head, header, payload, view))
                where.append(i)
            for i, item, error in zip(where, items, copy_and_check(items, mac)):
                if error is None:
                    outcome.found[i] = True
                else:
                    self._refuse(outcome, item.key, error)
        finally:
            txn.abort()
        for dst, staging in copies:
            dst.copy_(staging)  # a row whose record was refused holds garbage either way
        return outcome

    def _parse(self, pair: tuple[Any, Any], mac: RecordMac | None) -> tuple[Any, Any, Any]:
        entry, value = pair
        if len(entry) == INDEX.size:  # whole layout: the head starts the value
            header = parse_header(value, raw_length=self.block_bytes, available=len(value), mac=mac)
            start = header.payload_offset
            return value, header, memoryview(value)[start : start + header.stored_length]
        head = memoryview(entry)[INDEX.size :]
        header = parse_header(head, raw_length=self.block_bytes, available=len(head) + len(value), mac=mac)
        return head, header, value

    def _refuse(self, outcome: ReadOutcome, key: bytes, exc: CorruptBlockError) -> None:
        if isinstance(exc, UnsupportedRecordError):
            log.warning("lmdb: record %s… cannot be read by this build (%s); dropping it", key.hex()[:16], exc)
        else:
            log.warning("lmdb: corrupt record %s… in %s (%s); deleting it", key.hex()[:16], self.path, exc)
            outcome.corrupt += 1
            outcome.auth += isinstance(exc, RecordAuthError)
        outcome.bad[key] = str(exc)

    def _lookup(self, env: lmdb.Environment, keys: Sequence[bytes], bad: dict[bytes, str]) -> tuple[lmdb.Transaction, list[Any]]:
        """One read transaction and each key's ``(index entry, value)`` buffers (``None``: absent
        or bad, with the reason in ``bad``). An LMDB error on a key marks it bad and starts over
        in a fresh transaction (a failed lookup may leave one unusable, and its buffers with it)."""
        while True:
            txn = env.begin(buffers=True)
            # After the transaction began: a writer may have grown the file just before, and
            # the newest meta page covers every page this snapshot can see.
            limit = (int(env.info()["last_pgno"]) + 1) * self.psize
            pairs: list[Any] = []
            try:
                for key in keys:
                    pairs.append(None if key in bad else self._pair(txn, key, limit, bad))
                return txn, pairs
            except lmdb.Error as exc:
                txn.abort()
                key = keys[len(pairs)]
                log.warning("lmdb: reading %s… from %s failed (%s); a miss, dropping the key", key.hex()[:16], self.path, exc)
                bad[key] = str(exc)

    def _pair(self, txn: lmdb.Transaction, key: bytes, limit: int, bad: dict[bytes, str]) -> tuple[Any, Any] | None:
        value = txn.get(key, db=self.blocks)
        if value is None:
            return None
        entry = txn.get(key, db=self.index)
        if entry is None or len(entry) not in _ENTRY_SIZES:
            log.warning("lmdb: record %s… in %s has no readable index entry; a miss, dropping it", key.hex()[:16], self.path)
            bad[key] = "no readable index entry"
        elif not self._inside(value, limit):  # (the entry lies in a leaf page LMDB just read)
            log.warning("lmdb: record %s… in %s lies past the end of the file; a miss, dropping it", key.hex()[:16], self.path)
            bad[key] = "past the end of the file"
        else:
            return entry, value
        return None

    def _inside(self, buf: Any, limit: int) -> bool:
        """Whether ``buf`` (a view into the map) lies inside the first ``limit`` bytes of the
        file; ``True`` when the map's base is unknown (not Linux)."""
        if self.map_base is None or not len(buf):
            return True
        start = int(np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data) - self.map_base
        return 0 <= start and start + len(buf) <= limit
