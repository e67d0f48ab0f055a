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
checked before a byte of its payload is copied, then :func:`~kvtier.records.checks.copy_and_check`;
a large job group by group, with its values faulted in ahead by a side thread (see ``read``).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lmdb
import numpy as np
import torch

from kvtier.errors import CorruptBlockError
from kvtier.records.checks import SIDE_MIN_BYTES, RawPayload, copy_and_check, submit_side
from kvtier.records.codec import UnsupportedRecordError
from kvtier.records.format import HEAD_MAX, HEADER_SIZE, RecordAuthError, RecordBackend, RecordMac, parse_header

__all__ = ["INDEX", "JobReader", "ReadOutcome", "entry_stamp", "index_entry", "join_record", "restamp"]

log = logging.getLogger("kvtier.backends.lmdb_tier")

INDEX = struct.Struct("<dQ")
#: A large job is looked up and copied in groups of at least this many raw bytes (one side-thread
#: check each: see :func:`~kvtier.records.checks.copy_and_check`).
GROUP_BYTES = SIDE_MIN_BYTES
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
        propagate.

        A job of at least two groups of :data:`GROUP_BYTES` is looked up and copied group by
        group, while a side thread faults the job's values in ahead of the lookups: a cold job
        then reads the device while it copies. python-lmdb's ``get`` touches every page of a
        value, so looking the whole job up first read it all before the first copy (0.65-0.78
        of a raw cold get and copy, against 0.84-0.95 by groups; ``benchmarks/bench_disk.py``)."""
        outcome = ReadOutcome(len(keys))
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        step = max(1, -(-GROUP_BYTES // max(1, self.block_bytes)))
        if len(keys) < 2 * step:
            step = len(keys)
        txn, limit = self._begin(env)  # before the side thread takes a reader slot of its own
        try:
            with self._faulted_ahead(env, keys if step < len(keys) else ()):
                for start in range(0, len(keys), step):
                    group = keys[start : start + step]
                    txn, limit, pairs = self._lookup(env, txn, limit, group, outcome.bad)
                    self._copy(outcome, start, group, out[start : start + step], pairs, mac, copies)
        finally:
            txn.abort()
        for dst, staging in copies:
            dst.copy_(staging)  # a row whose record was refused holds garbage either way
        return outcome

    def _copy(
        self,
        outcome: ReadOutcome,
        start: int,
        keys: Sequence[bytes],
        out: Sequence[torch.Tensor],
        pairs: list[Any],
        mac: RecordMac | None,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Parse, copy and check one group of looked-up records (``outcome`` indexed from ``start``)."""
        items: list[RawPayload] = []
        where: list[int] = []
        for i, (key, dst, pair) in enumerate(zip(keys, out, pairs), start):
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

    @contextlib.contextmanager
    def _faulted_ahead(self, env: lmdb.Environment, keys: Sequence[bytes]) -> Iterator[None]:
        """Inside, a side thread gets ``keys`` in order in its own read transaction, which
        faults their values in (python-lmdb touches every page of a value it returns) ahead of
        the caller's lookups. It only reads what the caller's own lookups read next, and any
        error just stops it: the caller's lookup of that key meets the error and handles it.
        Stopped and waited for on leaving."""
        stop = threading.Event()

        def fault_in() -> None:
            txn = env.begin(buffers=True)
            try:
                for key in keys:
                    if stop.is_set():
                        return
                    txn.get(key, db=self.blocks)
            finally:
                txn.abort()

        future = submit_side(fault_in) if keys else None
        try:
            yield
        finally:
            stop.set()
            if future is not None:
                try:
                    future.result()
                except lmdb.Error:
                    pass  # the caller's own lookups met (and handled) whatever stopped it

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

    def _begin(self, env: lmdb.Environment) -> tuple[lmdb.Transaction, int]:
        """A read transaction, and how many bytes of the file its snapshot can see."""
        txn = env.begin(buffers=True)
        try:
            # After the transaction began: a writer may have grown the file just before, and
            # the newest meta page covers every page this snapshot can see.
            return txn, (int(env.info()["last_pgno"]) + 1) * self.psize
        except BaseException:
            txn.abort()
            raise

    def _lookup(
        self, env: lmdb.Environment, txn: lmdb.Transaction, limit: int, keys: Sequence[bytes], bad: dict[bytes, str]
    ) -> tuple[lmdb.Transaction, int, list[Any]]:
        """Each key's ``(index entry, value)`` buffers in ``txn`` (``None``: absent or bad, with
        the reason in ``bad``), and the transaction they were read in. An LMDB error on a key
        marks it bad and starts the keys over in a fresh transaction (a failed lookup may leave
        one unusable, and its buffers with it); buffers of earlier groups are no longer used."""
        while True:
            pairs: list[Any] = []
            try:
                for key in keys:
                    pairs.append(None if key in bad else self._pair(txn, key, limit, bad))
                return txn, limit, pairs
            except lmdb.Error as exc:
                txn.abort()
                key = keys[len(pairs)]
                log.warning("lmdb: reading %s… from %s failed (%s); a miss, dropping the key", key.hex()[:16], self.path, exc)
                bad[key] = str(exc)
                txn, limit = self._begin(env)

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
