"""Plain records of an ``lmdb`` store: the tight pass that reads a warm job of them
(:class:`PlainReads`), how a save builds them (:func:`build_joined`, :data:`UNSUMMED`), and the
guard that keeps reads and write transactions off a ``data.mdb`` cut short under an open store
(:class:`FileGuard`).

A plain record is what an unkeyed ``lmdb`` tier writes for a block that did not compress: a
32-byte header whose first 24 bytes (the part the checksum covers: magic, version, codec,
dtype, flags and both lengths) are the same for every such record of the store, and the
payload. Joined (:mod:`kvtier.backends.lmdb_layout`), both are the value in ``blocks``: per
record the pass makes one lookup; split, the payload is the value and the header follows the
stamp and size in ``index``: two lookups. Then one native call
(:func:`kvtier.records.xxcopy.xxh3_check_copy`): the lengths, those 24 bytes against the bytes
the store writes, and one pass that copies the payload into the row and takes the XXH3 of the
head, the key and the payload from the same loads. The rows and their views are
:mod:`kvtier.backends.lmdb_plain`'s.

A keyed store's raw records of its own MAC take the same pass where their MAC is taken in the
copy's pass (``PlainReads(mac=...)``: the 32-byte head compared, then
:meth:`kvtier.records.mac.RecordMac.check_copy`, one native copy and AES-GMAC per record).

Whatever is not such a record (absent, another layout, compressed, a bad checksum) is handed
back to the caller key by key, in order (``odd``), and read by the general code: its bytes,
errors, deletions and counters are the general read's. A slow lookup or an LMDB error stops the
pass and is handed back too (:meth:`PlainReads.read`).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import lmdb
from kvtier.backends import lmdb_entries
from kvtier.backends.lmdb_entries import JOINED

from kvtier.errors import DiskError
from kvtier.records import xxcopy
from kvtier.records.checks import HeadChecksum
from kvtier.records.codec import NoneCodec
from kvtier.records.mac import RecordMac
from kvtier.records.record import HEAD_MAX, HEADER, MAGIC, RECORD_VERSION

__all__ = ["UNSUMMED", "FileGuard", "PlainReads", "all_built", "build_joined"]

_SUM = struct.Struct("<Q")
#: The head of a plain record that the write transaction makes: split, its checksum taken from
#: the copy its put just made (:meth:`PlainReads.summed`); joined, the whole record built just
#: before its put (:meth:`PlainReads.joined`). This very object (compared by identity), as long
#: as a real head, so that sizes count alike. Written by mistake it would be a record whose
#: check fails (a counted miss), never one served.
UNSUMMED = bytes(HEADER.size)

def build_joined(joined: Callable[..., bytes], head: bytes, key: bytes, view: Any) -> tuple[bytes, bytes, Any]:
    """``(key, b"", joined(head, key, view))``, or where that build raises an ``Exception``,
    ``(key, UNSUMMED, view)``: built in the write transaction, where it fails alone (counted)."""
    try:
        return (key, b"", joined(head, key, view))
    except Exception:
        return (key, UNSUMMED, view)


def all_built(records: Sequence[tuple[bytes, bytes, Any]]) -> bool:
    """Whether every record of a job (:func:`build_joined`'s) was built whole: none is left to
    the write transaction to build from its row's view (:data:`UNSUMMED`), so the rows' hold
    need not stay to the commit."""
    return not any(record[1] is UNSUMMED for record in records)


class PlainReads:
    """The tight pass over a warm job of plain records of one store (see the module doc)."""

    __slots__ = ("blocks", "check", "entry_size", "head", "head_at", "index", "joined_size", "prefix", "size")

    def __init__(self, *, blocks: Any, index: Any, block_bytes: int, dtype_code: int, head_at: int, mac: RecordMac | None = None) -> None:
        """``mac``: the pass reads the raw records keyed with ``mac``'s own algorithm instead
        (for reads only; :meth:`RecordMac.check_copy` checks them, as ``xxh3_check_copy`` checks
        plain ones)."""
        self.blocks = blocks
        self.index = index
        self.size = block_bytes
        #: The checked header bytes of every plain record of the store, and record_checksum's
        #: state after them (a save's sum goes on from it; reads check through xxh3_check_copy).
        sums = HeadChecksum.plain(block_bytes, dtype_code)
        self.head, self.prefix = sums.head, sums.prefix
        self.head_at = head_at  # where the head starts in an index entry
        self.entry_size = head_at + HEADER.size
        self.joined_size = HEADER.size + block_bytes
        #: A record's check and copy (``None``: xxcopy.xxh3_check_copy, looked up at each job).
        self.check: Callable[..., int] | None = None
        if mac is not None:
            # what encode_record writes for a raw record keyed with mac: the 24 bytes its tag
            # covers, then the unused checksum field (zero)
            self.head = HEADER.pack(MAGIC, RECORD_VERSION, NoneCodec.codec_id, dtype_code, mac.flag, block_bytes, block_bytes, 0)
            self.entry_size = head_at + HEAD_MAX
            self.joined_size = HEAD_MAX + block_bytes
            self.check = mac.check_copy

    def read(
        self,
        txn: lmdb.Transaction,
        keys: Sequence[bytes],
        rows: Sequence[memoryview],
        found: list[bool],
        clock: Callable[[], float],
        slow: Callable[[float], bool],
        odd: Callable[[int, Any, Any], None],
        slow_after: float,
    ) -> tuple[int, lmdb.Error | None, Any, Any] | None:
        """Read ``keys`` into ``rows`` in ``txn`` (``buffers=True``), setting ``found``; every
        record that is present but not plain and sound is handed to ``odd(i, entry, value)``
        (``entry`` may be ``None``) before the next key is looked up. ``None`` when every key
        was read; ``(i, None, entry, value)`` when the lookup of key ``i`` was slow (it took
        ``slow_after`` seconds or more of ``clock()`` and ``slow(start)`` says so): key ``i``
        was looked up (``value`` is ``None`` when absent) but not read, nor any key after it;
        ``(i, error, None, None)`` when an LMDB error stopped the pass at key ``i`` (``txn``
        may be unusable)."""
        get, blocks, index, entry_size = txn.get, self.blocks, self.index, self.entry_size
        head, head_at, check = self.head, self.head_at, self.check or xxcopy.xxh3_check_copy
        joined_size = self.joined_size
        i = 0
        try:
            for i, key in enumerate(keys):
                start = clock()
                value = get(key, None, blocks)
                # joined: no index lookup
                entry = JOINED if value is not None and len(value) == joined_size else None if value is None else get(key, None, index)
                if clock() - start >= slow_after and slow(start):
                    return i, None, entry, value
                if value is None:  # absent
                    continue
                # The lengths, the stored head against the store's, then the payload copied into
                # the row and hashed from the same loads: one call (xxcopy.xxh3_check_copy).
                if entry is JOINED:
                    status = check(head, key, value, rows[i])
                elif entry is not None and len(entry) == entry_size:
                    status = check(head, key, entry[head_at:], rows[i], value)
                else:
                    status = xxcopy.CHECK_SHAPE  # not plain: no entry, or one of another kind
                if status:
                    odd(i, entry, value)
                else:
                    found[i] = True
        except lmdb.Error as exc:
            return i, exc, None, None
        return None

    def records(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[tuple[bytes, bytes, Any]]:
        """``(key, head, payload)`` of each block (``views``: its bytes, as :func:`host_rows`
        gives them) as a plain record: the bytes ``encode_record`` makes for a block that is not
        compressed and not keyed, by the same state as :meth:`read` (one XXH3 over the key and
        the block per record, continued from the store's 24 head bytes). A record put joined (at
        most ``JOIN_MAX`` bytes) is built here, ``(key, b"", record)``, the whole record in one
        ``bytes`` (:func:`build_joined`: in a job of several, one that fails to build is left to
        the transaction, :data:`UNSUMMED`, where its failure is its own; a job of one raises). A
        split record's head is :data:`UNSUMMED`, made in the write transaction by :meth:`summed`."""
        if HEADER.size + self.size <= lmdb_entries.JOIN_MAX:
            joined, head = xxcopy.xxh3_joined, self.head
            if len(keys) == 1:
                return [(keys[0], b"", joined(head, keys[0], views[0]))]
            return [build_joined(joined, head, key, view) for key, view in zip(keys, views)]
        return [(key, UNSUMMED, view) for key, view in zip(keys, views)]

    def joined(self, key: bytes, view: Any) -> bytes:
        """The whole plain record (head, checksum, block) of ``key`` whose block is ``view``, in
        one new ``bytes``, the block copied into it in its checksum's pass
        (:func:`kvtier.records.xxcopy.xxh3_joined`), where the put would else copy head and
        block together after the hash had read the block. Built just before its put, in the
        write transaction: the put then copies it while it is in this core's cache, and the
        next record's is built in the memory it leaves free. Built for a whole job before its
        transaction, 16 records of 64 KiB took 110-124 µs more than raw puts, with the syncs
        off, against 27-33 built one by one (thread CPU, 9 alternated rounds, load 3.7-4.1)."""
        return xxcopy.xxh3_joined(self.head, key, view)

    def summed(self, key: bytes, stored: Any) -> bytes:
        """The head of the plain record of ``key`` whose payload is ``stored``: the same bytes
        as :meth:`records` made from the block before its put. Taken from the copy in the write
        transaction (``stored``: its ``get`` just after the put), the block is read once, by
        the put, and the checksum's pass reads a copy still in this core's cache: 3.3 ms
        against 1.4 of a 2 MiB job of 16 here, beside a 9-10 ms commit with the syncs off.
        One call of :data:`~kvtier.records.xxcopy.xxh3_copy` (its hash-only pass, native where
        built): in cache, 5.2-5.3 µs a 256 KiB copy and 43-44 a 2 MiB one, against 5.5 and
        49-51 for the ``xxhash`` state's copy and two updates (the Python path's)."""
        head = self.head
        return head + _SUM.pack(xxcopy.xxh3_copy(head + key, stored))


class FileGuard:
    """Refuses reads and write transactions once ``data.mdb`` is shorter than it was: LMDB never
    shrinks its file while it is open, so a shorter one was cut under the store, and a page past
    its end would fault the process (python-lmdb touches every page of a value inside ``get``,
    and a write transaction walks the map's pages as a lookup does, so no check after a lookup
    can prevent that; the open's page check covers files damaged while closed). One ``lseek`` to
    the end per job, on a descriptor of its own: it gives the size as ``fstat`` does at a quarter
    of the cost (0.6 µs against 2.2 here: no stat object built).

    The size it holds (``seen``) is the largest the file was measured at: by a check, and after
    every commit of the store (:meth:`wrote`), so that a cut below what a commit appended is seen
    by the next check even where the file stays longer than at the check before that commit."""

    __slots__ = ("fd", "growing", "path", "seen")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.seen = os.lseek(self.fd, 0, os.SEEK_END)
        self.growing = threading.Lock()  # taken only where the file grew: never on a job's common path

    def check(self) -> None:
        """``DiskError`` if the file is shorter than at the last check or commit."""
        seen = self.seen  # (read before the measure: another thread's check may record it grown in between)
        try:
            size = os.lseek(self.fd, 0, os.SEEK_END)
        except OSError as exc:  # closed meanwhile (the store is closing)
            raise DiskError(f"lmdb: {self.path!r} is closed: {exc}") from exc
        if size < seen:
            raise DiskError(f"lmdb: {self.path!r} is {size} bytes, shorter than the {seen} it held: cut under the open store; not read")
        if size > seen:
            self._grew(size)

    def wrote(self) -> int | None:
        """After a commit (under the store's write lock): the file's size now, taken as the least
        it holds from now on (the pages the commit appended are the map's), and returned; ``None``
        where it cannot be measured (closed meanwhile: the next check says so). Never raises: the
        commit is done, and a cut it missed is the next check's to refuse."""
        try:
            size = os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:
            return None
        if size > self.seen:
            self._grew(size)
        return size

    def _grew(self, size: int) -> None:
        with self.growing:  # (a measure of less must not store over a larger size another stored meanwhile)
            if size > self.seen:
                self.seen = size

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
