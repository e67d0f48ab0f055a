"""One raw record of an ``lmdb`` tier's split layout copied into its row and checked, record by
record (:func:`copy_plain`, :func:`copy_keyed`): the loop of
:meth:`kvtier.backends.lmdb_layout.JobReader.read_in_one_pass` for what the tight pass of
:mod:`kvtier.backends.lmdb_plain` does not take (keyed records, rows that are not views); and
warm jobs of plain records read in one straight line (:class:`StraightRead`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from threading import get_ident
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

import lmdb
import torch
from kvtier.backends import lmdb_plain
from kvtier.backends.lmdb_entries import COLD_GET_S, INDEX

from kvtier import devices
from kvtier.errors import CorruptBlockError
from kvtier.keys import KEY_BYTES
from kvtier.pool_rows import PoolRows
from kvtier.records import xxcopy
from kvtier.records.codec import NoneCodec
from kvtier.records.counts import counts_add
from kvtier.records.format import (
    HEAD_MAX,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    RECORD_VERSION,
    RecordMac,
    parse_header,
    verify_payload,
)
from kvtier.records.record import CHECKED

if TYPE_CHECKING:
    from kvtier.backends.lmdb_plain import RowViews
    from kvtier.backends.lmdb_records import FileGuard, PlainReads

    from kvtier.backend import BackendCounters

__all__ = ["STRAIGHT_READS", "StraightRead", "copy_keyed", "copy_plain", "forks"]

#: Warm unkeyed jobs go through :class:`StraightRead` first; ``False``: through the job reader
#: alone (the general path, which the tests compare it with).
STRAIGHT_READS = True
_U8 = torch.uint8
_TENSOR = torch.Tensor
try:
    from kvtier.backends._rowguard import forks as _native_forks  # type: ignore[import-not-found]
except ImportError:  # not built, or a stale build
    _native_forks = None

#: ``forks()``: forks of this process so far: an environment opened at one count is another
#: process's at any other. Counted in each child by a ``pthread_atfork`` handler
#: (``_rowguard.forks``), which sees every fork through libc, also one that runs no
#: ``os.register_at_fork`` hook (a C library's, ctypes'): counted by those hooks alone, such a
#: child saved into its parent's environment, and read through it (a read transaction takes a
#: reader slot of the parent's, in the parent's name). Without the extension, the pid
#: (``os.getpid()``: a system call each time, glibc caches no pid, where the native count is a
#: read). The function itself, not a call wrapping it: a straight read asks it every job
#: (about 45 ns a call, where a wrapper doubled it).
forks: Callable[[], int] = os.getpid if _native_forks is None else _native_forks


class _Temperature(Protocol):
    cold: bool
    jobs: list[None]
    marks: dict[int, int | None]

    def begin(self) -> None: ...

    def slow(self, start: float) -> bool: ...

_PLAIN_ENTRY = INDEX.size + HEADER_SIZE  # a split, unkeyed record's index entry
_KEYED_ENTRY = INDEX.size + HEAD_MAX  # a split, keyed record's index entry
_JOINED_PLAIN = HEADER_SIZE  # where a joined plain record's payload starts in its value
_ENTRY_HEAD = INDEX.size  # where a split record's head (and checksum) starts in its entry


def copy_plain(key: bytes, pair: tuple[Any, Any], row: torch.Tensor, size: int) -> bool:
    """Copy a plain raw record of ``size`` bytes into ``row`` (host memory) and check it;
    ``False`` (``row`` perhaps written) when it is anything else or its check fails. Split
    (the head in the entry) or joined (the head starts the value)."""
    entry, value = pair
    if len(entry) == _PLAIN_ENTRY and len(value) == size:
        head, payload = entry[INDEX.size :], value
    elif len(entry) == INDEX.size and len(value) == HEADER_SIZE + size:
        head, payload = value[:HEADER_SIZE], value[HEADER_SIZE:]
    else:
        return False
    magic, version, codec_id, _, flags, raw, stored, checksum = HEADER.unpack_from(head, 0)
    if magic != MAGIC or version != RECORD_VERSION or codec_id != NoneCodec.codec_id or flags or raw != size or stored != size:
        return False
    if devices.locate is not None or not row.is_cpu or not row.is_contiguous():
        return False
    # One pass: the payload copied into the row and hashed from the same loads.
    return xxcopy.xxh3_copy(bytes(head[:CHECKED]) + key, payload, row.numpy().data) == checksum


def copy_keyed(key: bytes, pair: tuple[Any, Any], row: torch.Tensor, size: int, mac: RecordMac) -> bool:
    """:func:`copy_plain` for a keyed raw record: the row's MAC is checked (a MAC guards
    against tampering: the bytes the caller gets are the ones checked). An AES-GMAC record is
    copied and checked in one native pass where it is built
    (:meth:`~kvtier.records.mac.RecordMac.check_native`), hashing the bytes it stores."""
    entry, value = pair
    if len(entry) == _KEYED_ENTRY and len(value) == size:
        head, payload = entry[INDEX.size :], value
    elif len(entry) == INDEX.size and len(value) == HEAD_MAX + size:
        head, payload = value[:HEAD_MAX], value[HEAD_MAX:]
    else:
        return False
    if devices.locate is not None or not row.is_cpu or not row.is_contiguous():
        return False
    try:
        header = parse_header(head, raw_length=size, available=len(head) + size, mac=mac)
        if header.codec_id != NoneCodec.codec_id or header.payload_offset != len(head):
            return False
        view = row.numpy().data
        if mac.native(header.flags):
            # One native pass: copied into the row and MACed from the same registers.
            mac.check_native(head[:CHECKED], key, head[HEADER_SIZE:], payload, view)
        else:
            view[:] = payload
            verify_payload(key, head, header, view, mac=mac)
    except CorruptBlockError:
        return False
    return True


class StraightRead:
    """Warm jobs of an unkeyed store into host rows whose views the tier already keeps, read
    in one straight line: what the job reader does for them
    (:meth:`~kvtier.backends.lmdb_layout.JobReader.read_job`), without its calls (about 6 µs
    a job: a 4 KiB record costs 2 µs to read). :meth:`read` takes every job: one of one key,
    the commonest and the dearest per record, it reads itself with no further call; one of
    several it hands to :meth:`job`, which reads it, of any size,
    while the reader is warm (the job reader, too, reads a warm unkeyed job in one pass on the
    calling thread, whatever its size).

    A job is taken only when every key and row are as they should be and every record is
    either absent or raw and sound; anything else (a bad key or row, a row not in host memory
    or not seen before, another layout, a compressed record, a bad check, an LMDB error, a
    store used after a fork, a slow lookup with keys after it) returns ``None`` before a
    counter moved, and the caller reads the whole job by the general path, whose outcome,
    errors, deletions and counters are then the job's. A record read by either is checked
    alike: its head's 24 checked bytes compared with the store's, then the payload copied into
    the row and its XXH3 (head, key, payload) taken in the same pass (:mod:`kvtier.records.xxcopy`)."""

    __slots__ = ("counters", "forks", "guard", "native_parts", "one_parts", "parts", "shape", "temperature", "views")

    def __init__(
        self, plain: PlainReads, views: RowViews, guard: FileGuard, temperature: _Temperature, counters: BackendCounters, direct: object | None = None
    ) -> None:
        """``plain``, ``views``, ``guard`` and ``temperature``: the job reader's. ``direct``: what
        :func:`~kvtier.backends.lmdb_direct.direct_gets` gave for the environment (the native
        reads then look keys up by LMDB's own ``get``), or ``None``."""
        #: What a read uses, in one tuple (one attribute load, not six).
        self.parts = (plain.blocks, plain.index, plain.head, plain.size)
        self.shape, self.views = torch.Size([plain.size]), views.views
        self.guard, self.temperature, self.counters = guard, temperature, counters
        self.forks = forks()  # the environment is this process's: a child must not use it
        #: What a job of one key uses besides, in one tuple too.
        self.one_parts = (self.views, self.shape, guard, temperature, temperature.jobs, temperature.marks, counters)
        #: What the native form of a job of one key takes (lmdb_plain.one_read), in its order.
        self.native_parts = (
            self.views, self.shape, _TENSOR, _U8, KEY_BYTES, guard, temperature, temperature.jobs, temperature.marks, counters,
            plain.blocks, plain.index, plain.head, plain.size, lmdb.Error, _JOINED_PLAIN + plain.size, _ENTRY_HEAD,
            devices, lmdb_plain.function_mode, self.forks, direct,
        )

    def read(self, env: lmdb.Environment, keys: Any, out: Any) -> list[bool] | None:
        """Each key's hit (``False``: absent), or ``None`` when the job is the general path's
        (see the class doc): a job of one key read here in one straight line, with no call
        (about 4 µs in all for a 4 KiB record: a call, a list or a check less counts), a job of
        several by :meth:`job`. ``DiskError`` when the file was cut short under the store (as
        the general path). Where ``kvtier.backends._rowguard`` is built, a job of one key
        is read by its one call (:data:`~kvtier.backends.lmdb_plain.one_read`), with the same
        outcome, counters and errors as the lines below, which read the thread's first job
        (whose faults they mark) and a job that finds the data file's size moved."""
        if len(keys) != 1 or len(out) != 1:
            return self.job(env, keys, out)
        key = keys[0]
        row = out[0]
        if devices.locate is not None or self.forks != forks() or lmdb_plain.function_mode():
            return None  # (a mode's handler may free the row once its view is found: python_in_torch)
        native = lmdb_plain.one_read
        if native is not None:
            # All that follows in one native call (about 1 µs less of a 4 KiB record's 2.6 here),
            # with the same outcome; False: read here (the thread's first job, or the data
            # file's size moved), nothing counted yet.
            found = native(self.native_parts, env, key, row, perf_counter, COLD_GET_S, xxcopy.xxh3_check_copy)
            if found is not False:
                return found  # type: ignore[no-any-return]
        # No collection from the row's checks to its copy (xxcopy.rows_hold: a finalizer run
        # between may free the row whose view is taken).
        with xxcopy.rows_held:
            return self._read_held(env, key, row)

    def _read_held(self, env: lmdb.Environment, key: Any, row: Any) -> list[bool] | None:
        """The lines of :meth:`read` for a job of one key, under the rows' hold."""
        views, shape, guard, temperature, jobs, marks, counters = self.one_parts
        if get_ident() not in marks:
            temperature.begin()  # the thread's first job marks its faults, as the job reader's
        try:
            # Counted among the jobs being read (Temperature) before the guard is read: a close
            # closes the guard first, then waits for the jobs counted (LmdbBackend._close_env).
            # First in the try: an interrupt once counted (as the call returns) is inside it.
            jobs.append(None)
            # The key's check, the row's (a host uint8 tensor of the record's size, contiguous)
            # and its view, then the file guard's test, in one call (lmdb_plain.one_row). None:
            # not such a key or row, or a row not seen yet (the general path makes its view).
            view = lmdb_plain.one_row(key, KEY_BYTES, row, _TENSOR, _U8, shape, views, guard.fd, guard.seen)
            if view is None:
                return None
            if view is False:  # the size moved: grown (noted), or cut short (DiskError), or closed
                guard.check()
                view = lmdb_plain.host_view(row, _TENSOR, _U8, shape, views)
                if view is None:
                    return None
            blocks, index, head, size = self.parts
            txn = env.begin(None, None, False, True)  # buffers=True: by position, 0.2 µs less than by name
            try:
                start = perf_counter()
                value = txn.get(key, None, blocks)
                # joined (the whole record in the value): no index lookup
                entry = None if value is None or len(value) == _JOINED_PLAIN + size else txn.get(key, None, index)
                if perf_counter() - start >= COLD_GET_S and temperature.slow(start):
                    temperature.cold = True  # read from disk: the next job is read cold
                if value is None:
                    counts_add(counters, "read_misses", 1)
                    return [False]
                # One call: the lengths, the stored head against the store's, then the payload
                # copied into the row and hashed from the same loads (xxcopy.xxh3_check_copy).
                if entry is None:  # joined (a value of another length is refused as not plain)
                    status = xxcopy.xxh3_check_copy(head, key, value, view)
                else:
                    status = xxcopy.xxh3_check_copy(head, key, entry[_ENTRY_HEAD:], view, value)
                if status:
                    return None
            finally:
                txn.abort()
        except lmdb.Error:
            return None
        finally:
            jobs.pop()
        counts_add(counters, "blocks_read", 1, "bytes_read", size)
        return [True]

    def one(self, env: lmdb.Environment, key: Any, row: Any) -> bool | None:
        """:meth:`read` of a job of one key: whether it was read into ``row`` (``False``:
        absent), or ``None`` when the job is the general path's."""
        found = self.read(env, [key], [row])
        return None if found is None else found[0]

    def job(self, env: lmdb.Environment, keys: Any, out: Any) -> list[bool] | None:
        """:meth:`read` for a job of several keys: each key's hit, or ``None``. The job is timed
        as a whole, not lookup by lookup (a clock read a record cost 0.2 µs of a 4 KiB record's
        3): one that took :data:`COLD_GET_S` and read from disk makes the next job cold, and
        this one is read on here, as the job reader reads the rest of a cold job where no core
        is spare. An entry of another length and a value of another length are not plain
        (:func:`~kvtier.records.xxcopy.xxh3_check_copy` says so), a missing entry is a
        ``TypeError``: each hands the job over."""
        n = len(keys)
        temperature = self.temperature
        if n != len(out) or temperature.cold or devices.locate is not None or self.forks != forks():
            return None
        native = lmdb_plain.job_read
        if native is not None:
            # All that follows in one native call, with the same outcome; False: read here (the
            # thread's first job, or the data file's size moved), nothing counted yet.
            found = native(self.native_parts, env, keys, out, perf_counter, COLD_GET_S, xxcopy.xxh3_check_copy)
            if found is not False:
                return found  # type: ignore[no-any-return]
        if lmdb_plain.python_in_torch(out):
            # A handler run in a later row's checks below may free a row whose view is taken
            # already: the general path's job, whose copies take each row's memory.
            return None
        with xxcopy.rows_held:  # no collection from the first row's checks to the last copy, likewise
            return self._job_held(env, keys, out)

    def _job_held(self, env: lmdb.Environment, keys: Any, out: Any) -> list[bool] | None:
        """The lines of :meth:`job` from its rows' checks on, under the rows' hold."""
        n = len(keys)
        temperature = self.temperature
        views, shape, host_view = self.views, self.shape, lmdb_plain.host_view
        if type(out) is PoolRows:  # rows of one pool: its checks once, each row's view by its address (they hold its memory)
            rows = lmdb_plain.held_views(keys, out, shape, views)
            if rows is None:
                return None
        else:
            rows = []
            for key, row in zip(keys, out):
                if type(key) is not bytes or len(key) != KEY_BYTES:
                    return None
                view = host_view(row, _TENSOR, _U8, shape, views)  # the row's checks and view (as read's)
                if view is None:
                    return None  # not such a row, or one not seen yet: the general path makes its view
                rows.append(view)
        blocks, index, head, size = self.parts
        joined_size = _JOINED_PLAIN + size
        check_copy = xxcopy.xxh3_check_copy
        jobs = temperature.jobs
        temperature.begin()  # the thread's first job marks its faults, as the job reader's
        found: list[bool] = []
        hit = found.append
        guard = self.guard
        try:
            jobs.append(None)  # counted (Temperature), first in the try (as read), then the guard
            if not lmdb_plain.same_size(guard.fd, guard.seen):
                guard.check()  # the size moved: grown (noted), or cut short (DiskError), or closed
            txn = env.begin(None, None, False, True)  # buffers=True: by position, 0.2 µs less than by name
            get = txn.get
            try:
                start = perf_counter()
                for key, row in zip(keys, rows):
                    value = get(key, None, blocks)
                    if value is None:
                        hit(False)
                        continue
                    # The lengths, the stored head against the store's, then the payload copied
                    # and hashed in one pass (xxcopy.xxh3_check_copy): anything but good hands over.
                    if len(value) == joined_size:  # joined: no index lookup
                        status = check_copy(head, key, value, row)
                    else:
                        status = check_copy(head, key, get(key, None, index)[_ENTRY_HEAD:], row, value)
                    if status:
                        return None
                    hit(True)
                if perf_counter() - start >= COLD_GET_S and temperature.slow(start):
                    temperature.cold = True  # read from disk: the next job is read cold
            finally:
                txn.abort()
        except (lmdb.Error, TypeError, ValueError):
            return None
        finally:
            jobs.pop()
        hits = found.count(True)
        counts_add(self.counters, "blocks_read", hits, "bytes_read", hits * size, "read_misses", n - hits)
        return found
