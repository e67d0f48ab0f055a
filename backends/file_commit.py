"""How the ``file`` tier makes a job's records durable together.

A job's records are first *staged*: each is written to a temporary file in its shard directory
(``O_EXCL``, no sync). Then one commit makes them durable: every temporary file is
``fdatasync``'ed, then renamed over its record's name, then every directory that changed (the
shard directories, and the parents of directories the job created) is ``fsync``'ed once. So a
record's data is on stable storage before its name is, a crash leaves at most temporary files,
and a write returns only once its records and their names are durable.

Measured (``benchmarks/bench_disk_sizes.py``, ``docs/tiers.md``): writing a job's files first
and syncing them afterwards beat a sync per file before its rename at every size, and syncing
the directories once per commit rather than once per file removed most of the rest.
``syncfs`` was faster again for small records, but it also flushes every other writer of the
filesystem, so a commit's time would depend on them: not used.

The syncs of a commit run side by side on a small pool of threads (:func:`sync_pool`): first
every file's ``fdatasync``, then, once every rename is done, every directory's ``fsync``. Each
sync waits for the device, and with a journal one commit serves the syncs that wait together,
so concurrent syncs cost little more than one. In the flat layout a job's records share one
directory, synced once; in the sharded one they are spread over as many shard directories as
the job has records (two levels of 256), and synced one after the other each of those
directory syncs cost a device flush. Measured on ext4 (64 KiB records, jobs of 16,
8 jobs, load 5): the tier's layout synced one after the other 49 blocks/s, side by side 143,
raw flat files synced one after the other (one directory) 116. The order that makes a record
durable before its name is kept: no rename starts before every data sync has returned, and no
directory sync before every rename.

Where ``kvtier.backends._filesync`` is built (:data:`NATIVE_SYNCS`), the syncs of several
descriptors are one native call without the GIL (``backends/_filesync.c``): its own threads
take the syncs from a list under a mutex and count them back, and the calling thread syncs its
share too. On Python's pool each sync was a task handed over and a result handed back, each
hand-off taking the GIL against the other callers' threads. Measured (64 KiB records, jobs of
16, one process, the tier with and without it alternated with the raw shapes, 21 rounds a
run): with 4 concurrent callers, the tier's CPU time 25.4 -> 21.9 and 21.1 -> 16.5 ms a
round of 128 records, its save against the best raw shape of the round 0.82 -> 0.91 and
0.84 -> 1.01 (paired medians; load 3.3 and 2.9), ``futex`` calls 19,550 -> 10,041 over 640
records; one caller, 0.90 -> 1.00 (load 3.0). The same order holds: the call returns once
every sync has returned, before any rename. A signal that arrives meanwhile (Ctrl-C) is
handled once it returns: no commit is left with syncs still running on its descriptors.

In a durable job of several records, each file of :data:`EARLY_WRITEBACK_BYTES` or more has
its writeback started as soon as it is written (:func:`start_writeback`), so the device writes
it while the next files are written, and the syncs find less to do. It makes nothing durable
by itself: the order above is kept, and a writeback error is still the ``fdatasync``'s.
Measured (``bench_disk_sizes.py --quick --tiers file``, two alternated pairs each, load 2.4-4.8):
2 MiB records in jobs of 16 saved at 0.44-0.46 GB/s before, 0.54-0.71 after (0.87-0.97 of
the best raw shape, then 1.06-1.42); 256 KiB in jobs of 16, 0.28-0.42 and 0.34-0.50 GB/s.
Raw, the same files written and synced with and without it, 6 alternated rounds: 1.21x at
2 MiB, 1.12x at 1 MiB, 1.04x at 256 KiB, and 0.93x at 64 KiB (not started there). A job
of one record syncs its file at once, so it is not started there either.

Each job commits on its caller's thread (its syncs on the pool). Committing the jobs of
concurrent writers together (:class:`~kvtier.backends.group_commit.GroupCommit`, as the ``lmdb``
tier does) was measured slower here, twice. In the sharded layout it shares only the directory
syncs, which rarely coincide (4 writers of 64 KiB jobs of 16: 67 blocks/s grouped against 313
for raw writers in the same layout, before the syncs ran side by side). In the flat layout,
with the syncs side by side, 4 writers: 0.72-0.97 of committing alone in jobs of 16 (4 KiB and
64 KiB, 5 alternated rounds, load 4), 0.61-1.36 in jobs of one: jobs that arrive while a
commit runs wait for it to end, where alone their syncs join the journal commit already under
way (the filesystem's journal groups concurrent syncs by itself).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.errors import DiskError
from kvtier.records.checks import HeadChecksum, ProcessThreads

__all__ = ["EARLY_WRITEBACK_BYTES", "SYNC_THREADS", "FileJob", "StagedFile", "close_logged", "commit_files", "commit_one", "plain_records", "start_writeback", "sync_pool", "write_all"]

log = logging.getLogger("kvtier.backends.file_tier")

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_SUM = struct.Struct("<Q")
_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW
#: Threads that run a commit's syncs side by side (process-wide, shared by every file tier).
SYNC_THREADS = 16
#: The name prefix of those threads (they outlive every store).
THREAD_PREFIX = "kvtier-fsync"

#: Staged files of at least this many bytes have their writeback started as soon as they are
#: written, in a durable commit (:func:`start_writeback`).
EARLY_WRITEBACK_BYTES = 256 << 10
_SYNC_FILE_RANGE_WRITE = 2

T = TypeVar("T")
_threads = ProcessThreads(SYNC_THREADS, THREAD_PREFIX)

try:
    from kvtier.backends import _filesync  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: Python's pool (sync_pool) runs the syncs
    _filesync = None
#: A commit's syncs of several descriptors go to ``_filesync.sync_all`` (side by side on the
#: extension's own threads, one call without the GIL) where it is built; ``False``: on
#: :func:`sync_pool`, one ``os`` call each (which the tests that watch those calls need).
NATIVE_SYNCS: bool = _filesync is not None


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if os.uname().sysname != "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_sync_range = _sync_file_range()


def start_writeback(fd: int) -> bool:
    """Start writing ``fd``'s dirty pages to the device, without waiting (Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; the GIL is released meanwhile); whether it was
    started. It makes nothing durable, and an error of that writeback is still reported by the
    file's next ``fdatasync``, which alone counts: the commit's order and its checks are
    unchanged."""
    return _sync_range is not None and _sync_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) == 0


def sync_pool() -> ThreadPoolExecutor:
    """The process's sync threads (see :class:`~kvtier.records.checks.ProcessThreads`)."""
    return _threads.get()


def _side_by_side(sync: Callable[[T], None], items: Sequence[T]) -> list[OSError | None]:
    """``sync(item)`` for every item, on the sync threads when there are several (on this
    thread when one, or when the pool is shut down); per item, the ``OSError`` it raised. Returns
    once every call has returned."""
    if len(items) > 1:
        try:
            futures = [sync_pool().submit(_caught, sync, item) for item in items]
        except RuntimeError:  # the interpreter is shutting down: no new threads
            futures = []
        if len(futures) == len(items):
            return [f.result() for f in futures]
        for f in futures:  # (a partial submit: wait for what started, then do it all here)
            f.result()
    return [_caught(sync, item) for item in items]


def _sync_all(items: Sequence[int | str], *, data: bool) -> list[OSError | None]:
    """``fdatasync`` (``data``) or ``fsync`` of every item, a descriptor or (a directory) a path,
    side by side: natively where built (:data:`NATIVE_SYNCS`) and every item is a descriptor,
    else by :func:`_side_by_side`; per item, the ``OSError`` of its sync or ``None``."""
    if NATIVE_SYNCS and len(items) > 1 and all(type(i) is int for i in items):
        return [None if e == 0 else OSError(e, os.strerror(e)) for e in _filesync.sync_all(items, data)]
    return _side_by_side(_sync_data if data else _sync_dir, items)


def _caught(sync: Callable[[T], None], item: T) -> OSError | None:
    try:
        sync(item)
    except OSError as exc:
        return exc
    return None


def plain_records(checksum: HeadChecksum, keys: Sequence[bytes], rows: Sequence[Any]) -> list[tuple[bytes, Any]]:
    """``(header, payload)`` of each block (``rows``: its bytes) as ``encode_record`` makes them
    for a block neither compressed nor keyed: the store's one header but for the checksum, which
    goes on from ``checksum``'s state after that header (one hash state per store)."""
    head, pack = checksum.head, _SUM.pack
    return [(head + pack(checksum(key, row)), row) for key, row in zip(keys, rows)]


def write_all(fd: int, buffers: Sequence[Any], nbytes: int | None = None) -> None:
    """``pwritev`` until every byte is written (a short write is legal for large buffers).
    ``nbytes``: their total, when the caller knows it (one ``pwritev`` then usually does)."""
    if nbytes is not None and os.pwritev(fd, buffers, 0) == nbytes:
        return
    views = [memoryview(b).cast("B") for b in buffers]
    offset = 0
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


@dataclass(slots=True, eq=False)
class StagedFile:
    """A record written to a temporary file, waiting for its commit."""

    shard: str
    dir_fd: int  # the job's descriptor of the shard directory (owned by the job)
    tmp: str
    name: str
    fd: int  # the temporary file, open until the commit syncs it (-1 once closed)
    renamed: bool = False


@dataclass(slots=True, eq=False)
class FileJob:
    """A job's staged records, the shard directories they are in (``shard -> fd``), and the
    directories that gained a subdirectory for them (their entries must be synced too).
    ``early_writeback``: a file of :data:`EARLY_WRITEBACK_BYTES` or more starts its writeback
    once written (:func:`start_writeback`), for a durable commit."""

    files: list[StagedFile] = field(default_factory=list)
    dirs: dict[str, int] = field(default_factory=dict)
    parents: set[str] = field(default_factory=set)
    early_writeback: bool = False

    def stage(self, shard: str, tmp: str, name: str, buffers: Sequence[Any], nbytes: int | None = None) -> None:
        """Write ``buffers`` (``nbytes`` in all, if known) to ``tmp`` in ``shard``'s directory;
        ``OSError`` leaves nothing behind."""
        dir_fd = self.dirs[shard]
        fd = os.open(tmp, _O_NEW, 0o600, dir_fd=dir_fd)
        try:
            write_all(fd, buffers, nbytes)
        except BaseException:
            os.close(fd)
            _unlink(tmp, dir_fd)
            raise
        if self.early_writeback and nbytes is not None and nbytes >= EARLY_WRITEBACK_BYTES:
            start_writeback(fd)
        self.files.append(StagedFile(shard, dir_fd, tmp, name, fd))

    def close(self) -> None:
        """Close every descriptor, and remove the temporary files not renamed (a failed or
        abandoned commit). A close that fails is logged and the rest are closed all the same:
        the commit has decided every record's outcome by then."""
        for f in self.files:
            if f.fd >= 0:
                fd, f.fd = f.fd, -1
                close_logged(fd, f.tmp)
            if not f.renamed:
                _unlink(f.tmp, f.dir_fd)
        for shard, fd in self.dirs.items():
            close_logged(fd, shard or ".")
        self.dirs.clear()


def close_logged(fd: int, name: str) -> bool:
    """Close a staged file's (or a directory's) descriptor; ``False`` (logged) when the close
    reports an error: on NFS a write error may first show there, after the sync, so a record
    whose file's close fails is not committed."""
    try:
        os.close(fd)
    except OSError as exc:
        log.warning("file: close of %s failed: %s", name, exc)
        return False
    return True


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def commit_files(jobs: list[FileJob], *, durable: bool) -> list[list[bool]]:
    """Make the staged records of ``jobs`` final (see the module doc); per job, per staged file,
    whether it was committed. A file that cannot be synced, closed or renamed fails alone; a directory
    that cannot be synced is a ``DiskError`` (its renames may not survive a power loss)."""
    files = [f for job in jobs for f in job.files]
    failed: set[int] = set()
    errors = _sync_all([f.fd for f in files], data=True) if durable else None
    for i, f in enumerate(files):
        if errors is not None and errors[i] is not None:
            log.warning("file: sync of %s failed: %s", f.tmp, errors[i])
            failed.add(id(f))
        fd, f.fd = f.fd, -1  # released even when close fails: never closed again
        if not close_logged(fd, f.tmp):
            failed.add(id(f))
    renamed: set[str] = set()  # shards a record was renamed in
    for f in files:
        if id(f) in failed:
            continue
        try:
            os.replace(f.tmp, f.name, src_dir_fd=f.dir_fd, dst_dir_fd=f.dir_fd)
            f.renamed = True
            renamed.add(f.shard)
        except OSError as exc:
            log.warning("file: rename of %s failed: %s", f.tmp, exc)
            failed.add(id(f))
    if durable:
        dirs: dict[str, int | str] = {}  # shard -> its descriptor; parent path -> itself
        for job in jobs:
            for shard, fd in job.dirs.items():
                if shard in renamed:
                    dirs.setdefault(shard, fd)
        for path in sorted({p for job in jobs for p in job.parents}):
            dirs[path] = path
        for error in _sync_all(list(dirs.values()), data=False):
            if error is not None:
                raise DiskError(f"file: cannot sync directory entries: {error}") from error
    return [[id(f) not in failed for f in job.files] for job in jobs]


def commit_one(dir_fd: int, tmp: str, name: str, buffers: Sequence[Any], nbytes: int, *, durable: bool) -> bool:
    """:meth:`FileJob.stage` and :func:`commit_files` for a job of one file in the directory
    ``dir_fd`` that no new directory leads to: the same calls in the same order, without the
    job's lists. ``OSError`` when the temporary file cannot be made or written; ``False`` when
    it cannot be synced, closed or renamed (logged); in both cases nothing is left behind. A
    ``DiskError`` when the directory cannot be synced (the record was renamed)."""
    fd = os.open(tmp, _O_NEW, 0o600, dir_fd=dir_fd)
    renamed = False
    try:
        write_all(fd, buffers, nbytes)
        if durable:
            try:
                os.fdatasync(fd)
            except OSError as exc:
                log.warning("file: sync of %s failed: %s", tmp, exc)
                return False
        closing, fd = fd, -1  # released even when close fails: never closed again
        if not close_logged(closing, tmp):
            return False
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            log.warning("file: rename of %s failed: %s", tmp, exc)
            return False
        renamed = True
    finally:
        if fd >= 0:
            os.close(fd)
        if not renamed:
            _unlink(tmp, dir_fd)
    if durable:
        try:
            os.fsync(dir_fd)
        except OSError as exc:
            raise DiskError(f"file: cannot sync directory entries: {exc}") from exc
    return True


def _sync_data(fd: int | str) -> None:
    assert isinstance(fd, int)
    os.fdatasync(fd)


def _sync_dir(where: int | str) -> None:
    """``fsync`` a directory: by its descriptor, or by its path (opened and closed here)."""
    if isinstance(where, int):
        os.fsync(where)
        return
    dir_fd = os.open(where, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
