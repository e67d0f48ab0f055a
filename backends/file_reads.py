"""The ``file`` tier's one-pass read of plain records.

A general read of a record (:meth:`~kvtier.backends.file_tier.FileBackend.read_blocks`) reaches
its shard directory from the root one level at a time (three ``open`` calls with
``O_NOFOLLOW``), opens the file, ``fstat``s it, reads its head, checks it, then reads the
payload: nine system calls where a plain read makes three, which is most of the time a small
record takes. :class:`PlainReads` does the common case in three:

* in the flat layout, ``openat`` of ``<name>.kvb`` from a descriptor of the root held open,
  with ``O_NOFOLLOW``: the name is one component of hex digits, so no path leaves the root and
  a symlink in the record's place is refused (measured: 4.0 µs a record against 5.5 µs through
  ``openat2`` by ``ctypes``; a read of 4 KiB takes about 12). The name made from the key, the
  open, the read and check below and the ``close`` are one native call
  (:func:`~kvtier.records.xxcopy.xxh3_read_check_key`, whose buffer for the stored head is its
  own: no ``key.hex()``, f-string or ``bytearray`` a record, 0.4 µs of Python):
  an absent record is its open's ``FileNotFoundError`` (a miss), any other error of the call
  leaves the record to the general read. A job's records whose rows were viewed by the
  caller are one native call together
  (:func:`~kvtier.records.xxcopy.xxh3_read_check_keys`: the GIL handed over once a job, not
  once a record), which reads the root's descriptor before each open from the C ``int`` that
  :meth:`BeneathRoot.close` sets to -1 as it begins (:attr:`BeneathRoot.dir_at`);
* in the sharded layout, ``openat2`` of ``ab/cd/<name>.kvb`` from that descriptor, with
  ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``: the kernel refuses any symlink on the way and any
  path out of the root, the guarantee the level-by-level walk gives;
* the head's first 24 bytes compared with what every raw, unkeyed record of the store's
  block size and dtype holds there, the row filled and its checksum (the XXH3 of those bytes,
  the key and the row) compared with the head's, in one native call without the GIL
  (:func:`~kvtier.records.xxcopy.xxh3_read_check`): one ``preadv`` into the head's buffer, the
  row and one spare byte (a record of the right length fills the first two exactly and leaves
  the spare byte unread), the row hashed where the read put it; then ``close``. The row is
  viewed by address: the tier hands over the views its
  :class:`~kvtier.backends.lmdb_plain.RowViews` checked and kept, else a ``ctypes`` view of
  its memory is taken here (0.6 µs, where ``Tensor.numpy()`` took 1.8).

A job of one record (:meth:`PlainReads.read_one`) is the same read as one straight line from
the call: the row's checks and its view kept by address from an earlier job in one native call
(``lmdb_plain.host_view``), then, in the flat layout, the root's count of the job, the read
and the count let go in one more (:func:`~kvtier.records.xxcopy.xxh3_read_one`), the counters
bumped in place. A 4 KiB record took 9.5 µs through the job's loop, against 8.4 for a raw
``open``/``preadv``/``close`` by path; then 7.4; 0.1 µs less again with the two calls.

Where the native extension is built, a flat store's job (of one record or several) is one call
from the tier's ``read_blocks`` (:func:`~kvtier.records.xxcopy.xxh3_read_job`, taking
:attr:`PlainReads.job_parts`): the checks that no Python can run in a row's getters (no stand-in
device map, no torch function or dispatch mode), each key's and row's checks and its kept view,
the job's count among the root's, the reads, and the counters where every record was read or
absent; records it leaves go to the general read, uncounted, and a job it does not take (a row
not seen yet, a mode on) to :meth:`PlainReads.read_one` and :meth:`PlainReads.read_rows`, which
ask the same questions (a torch function or dispatch mode: :func:`~kvtier.backends.lmdb_plain.modes_on`).
A job's rows given as one pool (a :class:`~kvtier.pool_rows.PoolRows`) are checked once a job,
the pool's checks, each row's kept view then found by its address (``host_job_views``,
``kvtier/records/_hostrow.h``; :func:`~kvtier.backends.lmdb_plain.pool_addresses` in Python).

A record larger than :data:`PIECE_BYTES` (2 MiB, say) is read in pieces of that size by the
same call, the head with the first, each piece hashed just after its ``pread`` while it is still
in this core's cache, with no Python between the pieces. Hashed after one ``preadv`` of the
whole record, the row was partly out of a 2 MiB L2 (the copy streamed the page cache's lines
through it too), and its hash added 0.43 of the read's time, against about 0.2 a piece at a
time (2 MiB records, 256 KiB pieces, one thread: 0.84 of a raw ``preadv`` against 0.68 whole in
jobs of 1, 0.79-0.83 against 0.71 in jobs of 16; ``docs/tiers.md``). The pieces' lengths are
checked as the whole read's is: the last one's ``pread`` also offers the spare byte, so a record
of another length is refused at its first short or long piece.

Whatever is not that case (an ``openat2`` error other than an absent file, a length or a head
that differs, a checksum that fails, a row that is not one run of host memory) is left to the general
read, which reads it again and decides: its outcome, errors and deletions are the general
read's. Where ``openat2`` is missing (Linux before 5.6, or a sandbox that refuses it), every
record of a sharded store takes the general read.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from kvtier.backends import lmdb_plain

from kvtier import devices
from kvtier.backend import BackendCounters
from kvtier.keys import KEY_BYTES
from kvtier.records import xxcopy
from kvtier.records.checks import HeadChecksum
from kvtier.records.counts import counts_add
from kvtier.records.format import HEADER_SIZE
from kvtier.records.xxcopy import ONE_ABSENT, ONE_READ

__all__ = ["CLOSE_WAIT_S", "PIECE_BYTES", "BeneathRoot", "PlainReads"]

_SYS_OPENAT2 = 437  # the same number on every Linux architecture (added in 5.6)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC
_U8 = torch.uint8
_TENSOR = torch.Tensor
#: Records larger than this are read and hashed a piece of this size at a time (see the module
#: doc): small enough that a piece and the page cache's lines it was copied from stay in a
#: core's 1-2 MiB of L2 cache, large enough that the ``preadv`` calls cost little (8 for 2 MiB).
PIECE_BYTES = 256 << 10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _libc_syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn  # type: ignore[no-any-return]


_syscall = _libc_syscall() if os.uname().sysname == "Linux" else None
log = logging.getLogger(__name__)
#: How long a close waits for the jobs under way beneath its root (a read stuck on a hung
#: filesystem): after it the root's descriptor is left open, so its number is never handed to
#: another directory under such a job (as the ``lmdb`` tier leaves its environment open).
CLOSE_WAIT_S = 30.0
#: The open roots, whose counts a child of fork starts again (:meth:`BeneathRoot._after_fork`).
_ROOTS: weakref.WeakSet[BeneathRoot] = weakref.WeakSet()


def _roots_after_fork() -> None:
    for root in list(_ROOTS):
        root._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_roots_after_fork)


class BeneathRoot:
    """A descriptor of the tier's root, and ``openat2`` of records beneath it (see the module
    doc). :attr:`usable` turns false for good once the kernel refuses ``openat2`` itself."""

    def __init__(self, root: str) -> None:
        self.fd = os.open(root, _DIR_FLAGS)
        self.usable = _syscall is not None
        resolve = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
        self._how = _OpenHow(os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | os.O_NONBLOCK, 0, resolve)  # (no wait on a FIFO)
        self._how_ref = ctypes.byref(self._how)
        self._dir_how = _OpenHow(_DIR_FLAGS, 0, resolve)
        self._dir_how_ref = ctypes.byref(self._dir_how)
        self._how_size = ctypes.c_size_t(ctypes.sizeof(_OpenHow))
        self._sys = ctypes.c_long(_SYS_OPENAT2)
        self._dir = ctypes.c_int(self.fd)
        #: The descriptor as a C int that :meth:`close` sets to -1 as it begins: a job's native
        #: read (:func:`~kvtier.records.xxcopy.xxh3_read_check_keys`) reads it before each
        #: record's open, as the job's loop in Python looks at :attr:`fd`.
        self.dir_at = self._dir
        # Reads under way (enter/leave), waited for by close: one list entry each. A list's
        # append and pop are single steps under the GIL, so a read job pays about 0.2 us for its
        # count, where a lock taken twice cost about 2 us (a tenth of a 4 KiB read).
        self._under_way: list[None] = []
        self._closing = threading.Lock()
        _ROOTS.add(self)

    def _after_fork(self) -> None:
        """In a child of fork: the jobs counted, and a close under way, were the parent's other
        threads', which the child has not; its close waits for none of them."""
        self._under_way.clear()  # (in place: a tier's job_parts hold this list)
        self._closing = threading.Lock()

    def open(self, relative: str, *, directory: bool = False) -> int:
        """A read-only descriptor of ``relative`` beneath the root (``directory``: of a
        directory, ``ENOTDIR`` for anything else); ``OSError`` if it cannot be had, as
        ``os.open`` raises it (absent: ``FileNotFoundError``; a symlink on the way: ``ELOOP``;
        out of the root: ``EXDEV``)."""
        assert _syscall is not None
        how = self._dir_how_ref if directory else self._how_ref
        fd = _syscall(self._sys, self._dir, relative.encode(), how, self._how_size)
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM, errno.E2BIG, errno.EINVAL):
            self.usable = False  # no openat2 here (or not this form of it): general reads only
        raise OSError(err, os.strerror(err), relative)

    @property
    def under_way(self) -> list[None]:
        """The jobs counted beneath the root (:meth:`enter`): one entry each, for a native
        call that counts its own (:func:`~kvtier.records.xxcopy.xxh3_read_one`)."""
        return self._under_way

    def enter(self) -> bool:
        """Count a job on records beneath the root (a read; the tier's writes and deletes, which
        may reach them by the root's path), until :meth:`leave`; ``False``, counting nothing,
        once the root is closed or closing."""
        under_way = self._under_way
        under_way.append(None)  # counted before the root is looked at: a close that has not yet
        if self.fd < 0:  # marked it closed waits for this read, one that has is seen here
            under_way.pop()
            return False
        return True

    def leave(self) -> None:
        self._under_way.pop()

    def is_open(self) -> bool:
        """``False`` once the close has begun: a job that reached a directory by the root's path
        since may have reached another store's."""
        return self.fd >= 0

    def close(self) -> None:
        """Close the root's descriptor once the jobs counted (:meth:`enter`) have left: its
        number, handed out again, must not be opened beneath by a read still under way. After
        :data:`CLOSE_WAIT_S` the descriptor is left open instead (logged)."""
        with self._closing:
            if self.fd < 0:
                return
            fd, self.fd = self.fd, -1  # no new read from here; those under way leave the rest of their job to the general path
            self._dir.value = -1  # a read still holding this root opens nothing (EBADF) beneath the number's next owner
            end = time.monotonic() + CLOSE_WAIT_S
            while self._under_way:  # a close is rare and a read short: wait in small sleeps
                if time.monotonic() >= end:
                    log.warning("file: %d jobs beneath the root still run after %.3g s at close; its descriptor is left open", len(self._under_way), CLOSE_WAIT_S)
                    return
                time.sleep(0.0002)
            os.close(fd)


class PlainReads:
    """The one-pass read of one open store's plain records (see the module doc): every raw,
    unkeyed record of ``block_bytes`` and ``dtype_code`` has the same head but for its
    checksum, known here once. ``flat``: the records are in the root itself, not in ``ab/cd/``
    shard directories."""

    def __init__(
        self, root: BeneathRoot, *, flat: bool, block_bytes: int, dtype_code: int, views: dict[int, memoryview], counters: BackendCounters | None = None
    ) -> None:
        self.root = root
        self.views = views  # the rows' views by address (RowViews.views), for jobs of one record
        self.flat = flat
        self.block_bytes = block_bytes
        self.checksum = HeadChecksum.plain(block_bytes, dtype_code)
        self._row = ctypes.c_char * block_bytes
        self._shape = torch.Size([block_bytes])
        self._kind = (_TENSOR, _U8, self._shape, views, KEY_BYTES)  # what xxcopy.xxh3_read_rows takes of a row and a key
        #: Records of more than this many bytes are read in pieces of it (see the module doc).
        self.piece = PIECE_BYTES
        #: What :func:`~kvtier.records.xxcopy.xxh3_read_job` takes of this store, in its order: a
        #: flat job read, checked and counted in ``counters`` (the tier's) in one call from the
        #: tier's ``read_blocks``. ``None`` where that call is not built, the layout is sharded or
        #: no ``counters`` are given (the tier then takes :meth:`read_one` and :meth:`read_rows`).
        self.job_parts: tuple[Any, ...] | None = None
        if xxcopy.xxh3_read_job is not None and flat and counters is not None:
            self.job_parts = (
                root.under_way, root.dir_at, self.checksum.head, self._kind, self.piece, counters, block_bytes,
                devices, lmdb_plain.function_mode, lmdb_plain.dispatch_modes,
            )

    def read_one(self, key: Any, row: torch.Tensor, counters: BackendCounters) -> bool | None:
        """A job of one record, in one straight line: ``True`` when the record was read into
        ``row`` and checked, ``False`` when it is absent (a miss), each counted in
        ``counters``; ``None`` for anything the job's general path is to take (a key or row it
        must check and refuse by name, a row whose view is not kept in :attr:`views` yet, a
        record this pass does not serve, a closed root), counted there.

        The row is checked, and its kept view found, as :meth:`RowViews.of
        <kvtier.backends.lmdb_plain.RowViews.of>` does for a job's rows, in one native call
        (:data:`~kvtier.backends.lmdb_plain.host_view`; a row of a subclass of ``Tensor`` takes
        the job's path). In the flat layout the record is then counted among the root's jobs
        (a close waits for it), named, opened, read, checked, closed and let go in one more
        (:func:`~kvtier.records.xxcopy.xxh3_read_one`)."""
        if type(key) is not bytes or len(key) != KEY_BYTES or devices.locate is not None or lmdb_plain.modes_on():
            return None  # (a mode's handler may free the row once its view is found: python_in_torch)
        view = lmdb_plain.host_view(row, _TENSOR, _U8, self._shape, self.views)
        if view is None:
            return None
        root = self.root
        if self.flat:
            status = xxcopy.xxh3_read_one(root.under_way, root.dir_at, self.checksum.head, key, view, self.piece)
            if status == ONE_READ:
                counts_add(counters, "blocks_read", 1, "bytes_read", self.block_bytes)
                return True
            if status == ONE_ABSENT:
                counts_add(counters, "read_misses", 1)
                return False
            return None  # (the root closing, or a record this pass does not serve)
        if not root.enter():  # closed: the general path's
            return None
        try:
            return self._read_sharded(key, view, counters)
        finally:
            root.leave()

    def _read_sharded(self, key: bytes, view: memoryview, counters: BackendCounters) -> bool | None:
        """:meth:`read_one`'s read of ``key`` in the sharded layout, into the row ``view``."""
        root = self.root
        try:
            if not root.usable:
                return None
            name = key.hex()
            fd = root.open(f"{name[0:2]}/{name[2:4]}/{name}.kvb")
        except FileNotFoundError:
            counts_add(counters, "read_misses", 1)
            return False
        except OSError:
            return None
        try:
            if xxcopy.xxh3_read_check(fd, self.checksum.head, key, bytearray(HEADER_SIZE), view, self.piece):
                return None
        except OSError:
            return None
        finally:
            os.close(fd)
        counts_add(counters, "blocks_read", 1, "bytes_read", self.block_bytes)
        return True

    def read_rows(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> tuple[list[bool], list[int]] | None:
        """A flat job whose rows' views are kept in :attr:`views`, from its rows' checks to its
        reads in one native call (:func:`~kvtier.records.xxcopy.xxh3_read_rows`): each row
        checked as :meth:`RowViews.of <kvtier.backends.lmdb_plain.RowViews.of>` checks it, the
        job counted among the root's (a close waits for it), each record read as :meth:`read`
        reads it. ``(found, the positions left to the general read)``; ``None``, with nothing
        read, where the job's own checks and :meth:`read` are to take it (no native call, the
        sharded layout, a key or a row that call does not take, a torch function or dispatch mode
        on: :func:`~kvtier.backends.lmdb_plain.python_in_torch`)."""
        read = xxcopy.xxh3_read_rows
        if read is None or not self.flat or devices.locate is not None or lmdb_plain.modes_on():
            return None  # (a mode's handler, run in a later row's checks, may free a row whose view is taken)
        found = [False] * len(keys)
        root = self.root
        rest = read(root.under_way, root.dir_at, self.checksum.head, keys, out, self._kind, self.piece, found)
        return None if rest is None else (found, rest)

    def read(
        self, keys: Sequence[bytes], out: Sequence[torch.Tensor], found: list[bool], rows: Sequence[memoryview] | None = None
    ) -> list[int]:
        """:meth:`_read`, counted among the root's reads (a close waits for it); every
        position is the general path's once the root is closed."""
        if not self.root.enter():
            return list(range(len(keys)))
        try:
            return self._read(keys, out, found, rows)
        finally:
            self.root.leave()

    def _read(
        self, keys: Sequence[bytes], out: Sequence[torch.Tensor], found: list[bool], rows: Sequence[memoryview] | None = None
    ) -> list[int]:
        """Read the plain records of ``keys`` into their rows, setting ``found`` for each
        record read and checked; the positions left to the general read. An absent record is a
        miss (``found`` stays false), as it is for the general read. ``rows``: a writable view
        of each row, checked by the caller to be one run of ``block_bytes`` of host memory;
        else each row is checked and viewed here, and one that is not such a run is left to
        the general read."""
        rest: list[int] = []
        root, flat, size = self.root, self.flat, self.block_bytes
        if devices.locate is not None:  # a test's stand-in device map: the general read asks it
            return list(range(len(keys)))
        if rows is None and lmdb_plain.modes_on():  # a mode's handler may free a row once its address is read
            return list(range(len(keys)))
        expected, piece = self.checksum.head, self.piece
        if flat and rows is not None:  # the whole job in one call (xxcopy.xxh3_read_check_keys)
            return xxcopy.xxh3_read_check_keys(root.dir_at, expected, keys, rows, piece, found)
        head = bytearray(HEADER_SIZE)
        row_at = self._row.from_address
        read_check, read_check_key, close = xxcopy.xxh3_read_check, xxcopy.xxh3_read_check_key, os.close
        for i, key in enumerate(keys):
            if rows is not None:
                view = rows[i]
            else:
                row = out[i]
                if not row.is_cpu or not row.is_contiguous() or row.nbytes != size:
                    rest.append(i)
                    continue
                view = row_at(row.data_ptr())
            if flat:  # named, opened, read, checked and closed in one call (xxcopy.xxh3_read_check_key)
                if (root_fd := root.fd) < 0:  # the tier closed during the job: the general path's
                    rest.append(i)
                    continue
                try:
                    sound = not read_check_key(root_fd, expected, key, view, piece)
                except FileNotFoundError:  # (only its open says so: a read never does)
                    continue
                except OSError:
                    sound = False
            else:
                try:
                    if not root.usable:
                        rest.append(i)
                        continue
                    name = key.hex()
                    fd = root.open(f"{name[0:2]}/{name[2:4]}/{name}.kvb")
                except FileNotFoundError:
                    continue
                except OSError:
                    rest.append(i)
                    continue
                try:  # the head, the row and its checksum, in one call (xxcopy.xxh3_read_check)
                    sound = not read_check(fd, expected, key, head, view, piece)
                except OSError:
                    sound = False
                finally:
                    close(fd)
            if not sound:
                rest.append(i)
                continue
            found[i] = True
        return rest
