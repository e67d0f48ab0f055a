"""The ``file`` tier's table of records: what the open would learn from a ``stat`` per record.

The open lists every record with its stored size and access stamp (the file's mtime). Listing
the names is cheap; the ``stat`` of each file is not (3.3-3.6 s of a 6.6-7.7 s open at 10^6
records). A clean close of a tier that is not shared writes what it knows instead, in
``<root>/kvtier-table.kvt``: every known record's key (in key order), stored size and stamp, the
order of the stamps (oldest first, for the manager's adoption), and an XXH3-128 of all that.

The next open takes the table and unlinks it before anything else, lists the names without a
``stat`` (folding their keys' sums as it goes), and trusts
the table only if it is sound (its length, sum, key order and stamp order check) and names
exactly the records the directory holds (the same count, and the same sum of the keys' four
64-bit words: keys are digests, so a set that differs meets the same sums by chance once in
2^256). Anything else (no table, a damaged one, a record added, removed or renamed behind it: a
crash after an open, another build's or a tool's writes, a copy) is the ``stat`` walk, as
before. What the table cannot see is a record rewritten in place under its own name while the
tier was closed: its size and stamp are then the table's (accounting and eviction order), never
its bytes: every read checks the record it reads. The unlink at open is not synced (a reopen
syncs nothing): should a power loss bring the table back, every record added or removed since
that open makes it differ from the directory, and a record rewritten or touched since is the
case above. Where every record has one stored size, the open keeps a descriptor of the
unlinked table and leaves the listed keys and stamps there (:mod:`kvtier.backends.file_listed`).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter
from stat import S_ISREG

import numpy as np
import xxhash
from kvtier.backends.file_known import KnownRecords, in_key_order
from kvtier.backends.file_listed import RUN, ListedOnDisk, scratch_listing
from kvtier.backends.file_tree import FileTree, Layout

from kvtier.bulk import RecordColumns
from kvtier.bulk import unpooled as _unpooled

__all__ = ["TABLE_NAME", "Table", "key_sums", "listed_sums", "open_listing", "save_table", "take_table", "write_table"]

log = logging.getLogger("kvtier.backends.file_tier")

TABLE_NAME = "kvtier-table.kvt"
_MAGIC = b"KVTTABL1"
_HEAD = struct.Struct("<8sQ")  # magic, record count
_PER_RECORD = 32 + 8 + 8 + 4  # key, stored size, stamp, place in the stamp order
_SUM_SIZE = 16


def key_sums(packed: bytes | bytearray | memoryview) -> bytes:
    """The sums (mod 2^64) of the four 64-bit words of every 32-byte key in ``packed``: the
    same for any order of the same keys."""
    return _word_sums(packed).astype("<u8").tobytes()


def _word_sums(packed: bytes | bytearray | memoryview) -> np.ndarray:
    return np.frombuffer(packed, dtype="<u8").reshape(-1, 4).sum(axis=0, dtype=np.uint64)


def listed_sums(batches: Iterable[bytes | bytearray | memoryview]) -> tuple[int, bytes]:
    """How many 32-byte keys ``batches`` hold together, and their :func:`key_sums`, folded
    batch by batch (no buffer of every key)."""
    count, sums = 0, np.zeros(4, dtype=np.uint64)
    for batch in batches:
        count += len(batch) // 32
        sums += _word_sums(batch)
    return count, sums.astype("<u8").tobytes()


def write_table(root: str, keys: Sequence[bytes] | np.ndarray, stored: np.ndarray, stamps: np.ndarray, *, durable: bool, temp: str) -> None:
    """Write the table of ``keys`` (in key order: ``bytes``, or one ``S32`` column), their
    stored sizes and stamps under ``root`` (temp file ``temp``, synced in ``durable`` mode,
    renamed over the table's name). ``OSError`` if it cannot be written (the temp file is
    removed)."""
    n = len(keys)
    order = np.argsort(stamps, kind="stable").astype("<u4")
    packed = keys.tobytes() if isinstance(keys, np.ndarray) else b"".join(keys)
    if len(packed) != 32 * n:
        raise ValueError(f"keys: expected {n} keys of 32 bytes, got {len(packed)} bytes")
    body = b"".join((
        _HEAD.pack(_MAGIC, n), packed, np.asarray(stored, dtype="<i8").tobytes(),
        np.asarray(stamps, dtype="<f8").tobytes(), order.tobytes(),
    ))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(body + xxhash.xxh3_128_digest(body))
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(temp, os.path.join(root, TABLE_NAME))
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    if durable:
        dir_fd = os.open(root, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _read(root: str) -> tuple[mmap.mmap | bytes, int] | None:
    """The table, mapped (a read into memory of its size, freed, raised glibc's threshold for
    mapping allocations, and the memory the open went on to allocate stayed resident: 50 B a
    key at 10^5; its columns are read in place), and a descriptor of it (the listed keys stay
    there: :class:`~kvtier.backends.file_listed.ListedOnDisk`), the table unlinked; ``None``
    when there is none, or it cannot be read or unlinked (then it must not be trusted)."""
    path = os.path.join(root, TABLE_NAME)
    data: mmap.mmap | bytes | None = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # (no wait on a FIFO)
    except FileNotFoundError:
        return None
    except OSError as exc:
        fd = -1
        log.warning("file: the table of records %s cannot be opened (%s); listing every record", path, exc)
    else:
        try:
            size = os.fstat(fd).st_size
            data = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
        except (OSError, ValueError) as exc:
            log.warning("file: the table of records %s cannot be read (%s); listing every record", path, exc)
    try:
        os.unlink(path)
    except OSError as exc:
        log.warning("file: the table of records %s cannot be removed (%s); listing every record", path, exc)
        data = None
    if data is None:
        _close(data)
        if fd >= 0:
            os.close(fd)
        return None
    return data, fd


def _close(data: mmap.mmap | bytes | None) -> None:
    if isinstance(data, mmap.mmap):
        try:
            data.close()
        except BufferError:  # a view still open: the mapping goes with it
            pass


_CHUNK = 8192  # records per step of the checks and copies below (their temporaries stay small)
#: A sound table of records of one stored size leaves the listed keys in its file, and a walk's
#: records of one size go to a scratch file (:class:`ListedOnDisk`); ``False``: they are held
#: in memory (for tests and measurement).
LISTED_ON_DISK = True


class Table:
    """A sound table's records: their keys in key order, one after the other, at ``at`` in
    ``data`` (the table's bytes); each one's ``stored`` size and ``stamp``; ``order`` (the
    positions oldest stamp first) and ``sums`` (:func:`key_sums` of the keys). The columns are
    views of ``data``; ``fd``: a descriptor of the table's file (owned; -1: none)."""

    __slots__ = ("at", "data", "fd", "order", "stamps", "stored", "sums")

    def __init__(
        self, data: mmap.mmap | bytes, at: int, stored: np.ndarray, stamps: np.ndarray, order: np.ndarray, sums: bytes, fd: int = -1
    ) -> None:
        self.data, self.at, self.stored, self.stamps, self.order, self.sums = data, at, stored, stamps, order, sums
        self.fd = fd

    def __len__(self) -> int:
        return len(self.stored)

    def adopt(self, known: KnownRecords) -> RecordColumns:
        """Hand the records to ``known`` (in key order) and return them oldest first (the
        manager's adoption takes them without a sort), the same key objects in both. The keys'
        objects are made here, once the listing's names are gone (as the walk makes them); the
        columns oldest first are gathered a chunk at a time into arrays of their own pages (see
        :func:`_unpooled`), with no temporary the size of a column; the list of the keys oldest
        first is allocated before the tier's, so that, freed after the manager's adoption, it
        is not at the top of the open thread's arena (which ``malloc_trim`` leaves).

        Where every record has the same stored size and the table's file is open, ``known``
        keeps the keys and stamps in that file (:class:`ListedOnDisk`, which takes the
        descriptor) and the key objects are made for the manager's columns only."""
        data, at, n = self.data, self.at, len(self)
        if LISTED_ON_DISK and n and self.fd >= 0 and self.stored.min() == self.stored.max():
            by_age: list[bytes] = [b""] * n
            packed = np.frombuffer(data, dtype="V32", count=n, offset=at)
            firsts = packed[::RUN].tolist()
            columns = _gather(by_age, packed, self.stored, self.stamps, self.order)
            known.adopt_listed(ListedOnDisk(self.fd, n, at, at + 40 * n, firsts), int(self.stored[0]))
            self.fd = -1
            return columns
        by_age = [b""] * n  # before the lists that stay: not at the top of the arena once freed
        keys = np.frombuffer(data, dtype="V32", count=n, offset=at).tolist()  # a bytes object each, in C
        known.adopt(keys, self.stored, self.stamps, own=True, in_order=True)  # the order checked by _parse
        return _gather(by_age, keys, self.stored, self.stamps, self.order)

    def close(self) -> None:
        self.stored = self.stamps = self.order = np.empty(0)  # the views of data, before it closes
        _close(self.data)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _gather(by_age: list[bytes], keys: list[bytes] | np.ndarray, stored: np.ndarray, stamps: np.ndarray, order: np.ndarray) -> RecordColumns:
    """The records ``keys`` (``bytes``, or a ``V32`` column: a ``bytes`` object is made of each
    key here), ``stored``, ``stamps`` in the ``order`` of their stamps (oldest first), gathered
    a chunk at a time into ``by_age`` (a list of their length, allocated by the caller before
    the lists that stay) and arrays of their own pages (:func:`_unpooled`)."""
    n = len(keys)
    stored_by_age, stamps_by_age = _unpooled(n, "i8"), _unpooled(n, "f8")
    for start in range(0, n, _CHUNK):
        rows = order[start : start + _CHUNK].astype(np.intp)
        np.take(stored, rows, out=stored_by_age[start : start + _CHUNK])
        np.take(stamps, rows, out=stamps_by_age[start : start + _CHUNK])
        if isinstance(keys, np.ndarray):
            by_age[start : start + len(rows)] = keys[rows].tolist()
            continue
        got = itemgetter(*rows.tolist())(keys)
        by_age[start : start + len(rows)] = got if len(rows) > 1 else (got,)
    return RecordColumns(by_age, stored_by_age, stamps_by_age, oldest_first=True)


def _walked(columns: RecordColumns, known: KnownRecords, root: str | None = None) -> RecordColumns:
    """The walk's ``columns`` adopted into ``known`` and returned oldest first (stable by
    stamp: the order the manager's sort gives), allocated as :meth:`Table.adopt` does: the
    temporaries before the lists that stay. With ``root``, where the records have one stored
    size and the walk listed them in key order, ``known`` keeps them in a scratch file there
    (:func:`scratch_listing`), as an open from a table does in the table's file."""
    n = len(columns)
    order = _unpooled(n, "i8")
    order[:] = np.argsort(columns.stamps, kind="stable")
    by_age: list[bytes] = [b""] * n
    keys, stored = columns.keys, columns.stored
    in_order = bool(n) and stored.min() == stored.max() and in_key_order(keys)  # (checked once: adopt is told)
    listed = scratch_listing(root, keys, columns.stamps) if LISTED_ON_DISK and root is not None and in_order else None
    if listed is not None:
        known.adopt_listed(listed, int(stored[0]))
    else:
        known.adopt(keys, stored, columns.stamps, in_order=in_order)
    return _gather(by_age, keys, stored, columns.stamps, order)


def _parse(data: mmap.mmap | bytes, fd: int = -1) -> Table | None:
    """The table's records (their columns views of ``data``; ``fd``: the table's file, handed
    to the table), or ``None`` if it is not sound. Checked a chunk at a time: no temporary the
    size of a column."""
    size = len(data)
    if size < _HEAD.size + _SUM_SIZE or data[-_SUM_SIZE:] != _digest(data, size - _SUM_SIZE):
        return None
    magic, n = _HEAD.unpack_from(data)
    if magic != _MAGIC or size != _HEAD.size + n * _PER_RECORD + _SUM_SIZE:
        return None
    at = _HEAD.size
    keys = np.frombuffer(data, dtype="S32", count=n, offset=at)
    stored = np.frombuffer(data, dtype="<i8", count=n, offset=at + 32 * n)
    stamps = np.frombuffer(data, dtype="<f8", count=n, offset=at + 40 * n)
    order = np.frombuffer(data, dtype="<u4", count=n, offset=at + 48 * n)
    if n and not _sound(keys, stored, stamps, order):
        return None
    with memoryview(data) as view:
        sums = key_sums(view[at : at + 32 * n])
    return Table(data, at, stored, stamps, order, sums, fd)


def _sound(keys: np.ndarray, stored: np.ndarray, stamps: np.ndarray, order: np.ndarray) -> bool:
    """Whether the columns of ``n >= 1`` records are: keys in strictly increasing order, sizes
    above 0, finite stamps, and ``order`` every position once, oldest stamp first."""
    n = len(keys)
    if int(order.max()) >= n:
        return False
    seen = _unpooled(n, "?")
    seen[:] = False
    last_stamp = -np.inf
    for start in range(0, n, _CHUNK):
        end = min(n, start + _CHUNK)
        last = min(end, n - 1)  # the pairs (i, i + 1) from here
        if not (keys[start:last] < keys[start + 1 : last + 1]).all():
            return False
        if not (stored[start:end] > 0).all() or not np.isfinite(stamps[start:end]).all():
            return False
        rows = order[start:end].astype(np.intp)
        seen[rows] = True
        aged = stamps[rows]
        if aged[0] < last_stamp or not (aged[1:] >= aged[:-1]).all():
            return False
        last_stamp = aged[-1]
    return int(np.count_nonzero(seen)) == n


def _digest(data: mmap.mmap | bytes, end: int) -> bytes:
    with memoryview(data) as view:
        return xxhash.xxh3_128_digest(view[:end])  # type: ignore[no-any-return]


def take_table(root: str) -> Table | None:
    """Take the table under ``root`` (it is unlinked whatever it holds): its records, or
    ``None`` when there was none or it is not sound (logged; the caller closes a table it
    gets)."""
    read = _read(root)
    if read is None:
        return None
    data, fd = read
    table = _parse(data, fd)
    if table is None:
        _close(data)
        if fd >= 0:
            os.close(fd)
        log.warning("file: the table of records under %s is damaged; listing every record", root)
    return table


def open_listing(
    root: str, known: KnownRecords, *, walk: Callable[[], RecordColumns], names: Callable[[], Iterable[bytes | bytearray]], table: bool = True
) -> RecordColumns:
    """The records under ``root`` at open, adopted into ``known``: the table's when it is
    sound and names exactly the keys of ``names()`` (every record name's key, listed without a
    ``stat``, in batches of packed 32-byte keys: :func:`listed_sums`), else ``walk()``'s (a
    ``stat`` per record). ``table=False`` (a shared tier, whose records others write): the
    walk's, and no table is taken. Both listings sweep the stale temp files of ``root``'s
    directories, its own included (:meth:`FileTree._leaf_fds`)."""
    found = take_table(root) if table else None
    if found is not None:
        try:
            if listed_sums(names()) == (len(found), found.sums):
                return found.adopt(known)
        finally:
            found.close()
        log.warning("file: the table of records under %s does not name the records there; listing every record", root)
    return _walked(walk(), known, root)


def save_table(root: str, known: KnownRecords, lock: threading.Lock, *, layout: Layout, durable: bool, temp: str) -> None:
    """Write the table of the records ``known`` holds (taken under ``lock``; a record written
    since the open has its file's stamp, and is left out if it is not there) for the next open;
    a table that cannot be written is logged (that open lists every record)."""
    try:
        with lock:
            keys, stored, stamps = known.columns(functools.partial(_stamp, root, layout))
        write_table(root, keys, stored, stamps, durable=durable, temp=temp)
    except OSError as exc:
        log.warning("file: the table of records under %s cannot be written (%s); the next open lists every record", root, exc)


def _stamp(root: str, layout: Layout, key: bytes) -> float | None:
    """The mtime of ``key``'s record under ``root``, reached without following a symlink;
    ``None`` if it is not a regular file there."""
    try:
        leaf = FileTree._leaf_at(root, key, layout=layout)
        if leaf is None:
            return None
        try:
            st = os.stat(leaf[1], dir_fd=leaf[0], follow_symlinks=False)
        finally:
            os.close(leaf[0])
    except OSError:
        return None
    return st.st_mtime if S_ISREG(st.st_mode) else None
