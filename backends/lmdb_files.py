"""What the ``lmdb`` tier checks about its files before LMDB maps them, and who may open them.

LMDB trusts its file: it maps ``data.mdb`` and follows page numbers, so a truncated file faults
(SIGBUS) on the first read past its end, and a full filesystem faults on the first write into
the sparse ``lock.mdb``. Nothing here maps anything; the tier calls these before ``lmdb.open``:

* :func:`read_meta_pages` reads the two meta pages with ``pread`` and :func:`check_data_file`
  refuses a file whose newer meta page names a last page (or a database root) past the end of
  the file, a bad magic, or an unknown LMDB version. The tier moves such an environment aside
  (:func:`move_aside`, keeping it for ``kvtier verify``) and starts afresh.
* :func:`check_free_space` refuses, with a ``DiskError``, to create or open an environment on a
  filesystem without room for its lock file and first pages; :func:`preallocate_lock_file`
  allocates ``lock.mdb``'s blocks up front, so LMDB's later writes through its map of that file
  cannot fault.
* :class:`HolderLock` is the tier's one-process rule: an exclusive ``flock`` on
  ``kvtier.lock`` in the environment's directory, holding the holder's pid; a second opener (in
  any process) gets a ``BackendError`` naming that pid.
* :func:`map_base` finds where LMDB mapped ``data.mdb`` (``/proc/self/maps``), so a read can
  check that a value lies inside the file before touching its bytes, and
  :func:`touched_pages_only` can turn readahead off for the walk at open.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtier.errors import BackendError, DiskError

__all__ = [
    "META_KEY",
    "HolderLock",
    "MetaPage",
    "check_data_file",
    "check_free_space",
    "map_base",
    "map_pages",
    "touched_pages_only",
    "move_aside",
    "preallocate_lock_file",
    "read_meta_pages",
]

_MAGIC = 0xBEEFC0DE
_VERSION = 1
_P_INVALID = (1 << 64) - 1
_META = struct.Struct("<II")  # magic, version at offset 16 of a meta page
_PSIZE_AT = 40  # mm_dbs[FREE_DBI].md_pad holds the page size (meta page 0)
_MAIN_ROOT_AT = 128  # mm_dbs[MAIN_DBI].md_root
_LAST_AT = 136  # mm_last_pg, then mm_txnid
#: Bytes ``lock.mdb`` takes for ``max_readers`` slots (64 each) and its header, rounded up.
_LOCK_SLOT = 64
#: What creating an environment needs besides the lock file: meta pages, first transactions.
_OPEN_ROOM = 256 << 10
HOLDER_FILE = "kvtier.lock"
#: Key of the store's meta record in the ``meta`` database.
META_KEY = b"kvtier-meta"


class DamagedEnvironment(Exception):
    """``data.mdb`` would fault or mislead LMDB if mapped (carries the reason)."""


@dataclass(frozen=True, slots=True)
class MetaPage:
    psize: int
    last_pgno: int
    txnid: int
    main_root: int


def read_meta_pages(path: str) -> tuple[list[MetaPage | None], int] | None:
    """The two meta pages of ``<path>/data.mdb`` (``None`` for an unreadable one) and the file
    size, read with ``pread``; ``None`` if there is no file yet."""
    data = os.path.join(path, "data.mdb")
    try:
        fd = os.open(data, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, 4096, 0)
        page0 = _parse_meta(first, 4096)
        psize = page0.psize if page0 is not None else 4096
        page1 = _parse_meta(os.pread(fd, psize, psize), psize)
    finally:
        os.close(fd)
    return [page0, page1], size


def _parse_meta(page: bytes, psize_hint: int) -> MetaPage | None:
    if len(page) < _LAST_AT + 16:
        return None
    magic, version = _META.unpack_from(page, 16)
    if magic != _MAGIC:
        return None
    if version != _VERSION:
        raise DamagedEnvironment(f"LMDB data version {version}, this build reads {_VERSION}")
    psize = struct.unpack_from("<I", page, _PSIZE_AT)[0] or psize_hint
    (main_root,) = struct.unpack_from("<Q", page, _MAIN_ROOT_AT)
    last, txnid = struct.unpack_from("<QQ", page, _LAST_AT)
    return MetaPage(psize, last, txnid, main_root)


def check_data_file(path: str) -> int:
    """Refuse a ``data.mdb`` that LMDB would fault on; return the bytes it holds (0 if none).

    Raises :class:`DamagedEnvironment` naming the problem: no readable meta page, a page size
    that is not a power of two, or a newer meta page whose last page or main root lies past
    the end of the file (a truncated or damaged file)."""
    found = read_meta_pages(path)
    if found is None:
        return 0
    pages, size = found
    if size == 0:
        raise DamagedEnvironment("data.mdb is empty")
    valid = [m for m in pages if m is not None]
    if not valid:
        raise DamagedEnvironment("neither meta page of data.mdb is readable (bad magic)")
    meta = max(valid, key=lambda m: m.txnid)
    psize = meta.psize
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise DamagedEnvironment(f"meta page names a page size of {psize} bytes")
    have = size // psize
    if meta.last_pgno + 1 > have:
        raise DamagedEnvironment(
            f"data.mdb is {size} bytes ({have} pages) but its meta page (txn {meta.txnid}) uses {meta.last_pgno + 1} "
            "pages: the file is truncated or its meta page is damaged"
        )
    if meta.main_root != _P_INVALID and meta.main_root > meta.last_pgno:
        raise DamagedEnvironment(f"main database root page {meta.main_root} is past the last page {meta.last_pgno}")
    return (meta.last_pgno + 1) * psize


def move_aside(path: str, reason: str) -> str:
    """Move ``data.mdb`` (and ``lock.mdb``) into ``<path>/damaged-<UTC time>/``, where
    ``kvtier verify`` can read it; return that directory."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = os.path.join(path, f"damaged-{stamp}")
    n = 1
    while os.path.exists(target):
        n += 1
        target = os.path.join(path, f"damaged-{stamp}-{n}")
    try:
        os.mkdir(target, 0o700)
        os.replace(os.path.join(path, "data.mdb"), os.path.join(target, "data.mdb"))
        with open(os.path.join(target, "REASON"), "w", encoding="utf-8") as f:
            f.write(reason + "\n")
        lock = os.path.join(path, "lock.mdb")
        if os.path.exists(lock):
            os.unlink(lock)
    except OSError as exc:
        raise DiskError(f"lmdb: cannot move the damaged environment at {path!r} aside: {exc}") from exc
    return target


def lock_file_bytes(max_readers: int) -> int:
    return -(-((max_readers + 2) * _LOCK_SLOT) // 4096) * 4096


def check_free_space(path: str, max_readers: int) -> None:
    """Raise ``DiskError`` when the filesystem under ``path`` lacks room to open an environment:
    a new one needs its first pages, and a missing lock file its slots. An existing environment
    needs no room to open (its reads go on; writes fail one key at a time)."""
    need = 0
    if not os.path.exists(os.path.join(path, "data.mdb")):
        need += _OPEN_ROOM
    if not os.path.exists(os.path.join(path, "lock.mdb")):
        need += lock_file_bytes(max_readers)
    if need == 0:
        return
    try:
        free = shutil.disk_usage(path).free
    except OSError as exc:
        raise DiskError(f"lmdb: cannot stat the filesystem of {path!r}: {exc}") from exc
    if free < need:
        raise DiskError(
            f"lmdb: the filesystem of {path!r} has {free} bytes free; opening the tier needs at least {need} "
            "(lock file and first pages). Free some space or point the tier elsewhere"
        )


def preallocate_lock_file(path: str, max_readers: int) -> None:
    """Allocate ``lock.mdb``'s blocks before LMDB maps and writes it (a write into an unallocated
    page of a mapped file on a full filesystem is a SIGBUS). ``DiskError`` if there is no room."""
    lock = os.path.join(path, "lock.mdb")
    want = lock_file_bytes(max_readers)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise DiskError(f"lmdb: cannot create {lock!r}: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        try:
            os.posix_fallocate(fd, 0, max(size, want))
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", -1)):
                return  # the filesystem cannot preallocate; the free-space check still applies
            raise DiskError(f"lmdb: cannot allocate {lock!r} ({want} bytes): {exc}") from exc
    finally:
        os.close(fd)


class HolderLock:
    """An exclusive ``flock`` on ``<path>/kvtier.lock`` for the life of an open tier."""

    def __init__(self, path: str) -> None:
        self.path = os.path.join(path, HOLDER_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            raise DiskError(f"lmdb: cannot create {self.path!r}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise BackendError(
                f"lmdb: the environment at {os.path.dirname(self.path)!r} is in use by process {holder} "
                "(one process per lmdb tier; give each process its own path, or share blocks through a file or "
                "redis tier)"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise DiskError(f"lmdb: cannot lock {self.path!r}: {exc}") from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise DiskError(f"lmdb: cannot write {self.path!r}: {exc}") from exc
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock

    @staticmethod
    def holder(path: str) -> int | None:
        """The pid holding the tier at ``path``, or ``None`` if no process holds it."""
        lock = os.path.join(path, HOLDER_FILE)
        try:
            fd = os.open(lock, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                return int(text) if text.isdigit() else -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


@contextlib.contextmanager
def touched_pages_only(base: int | None, length: int) -> Iterator[None]:
    """Inside, a fault in the ``length`` bytes mapped at ``base`` reads only its own page
    (``MADV_RANDOM``); normal readahead again after (``MADV_NORMAL``). For walks that touch one
    page per value: under normal readahead (8 MiB per fault on the device here) a walk of the
    blocks database's keys, which touches each value's first page, read the whole file.
    Nothing happens where the base is unknown or ``madvise`` is not available."""
    advise = _madvise()
    if base is None or advise is None or length <= 0:
        yield
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = base - base % page
    span = length + (base - start)
    advised = advise(start, span, _MADV_RANDOM) == 0
    try:
        yield
    finally:
        if advised:
            advise(start, span, _MADV_NORMAL)


_MADV_NORMAL = 0
_MADV_RANDOM = 1


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lambda address, length, advice: int(fn(address, length, advice))


_MADV_POPULATE_READ = 22  # Linux 5.14 and later
_POPULATE = [True]  # turned off for good once the kernel refuses it


def map_pages(address: int, length: int) -> bool:
    """Enter the ``length`` bytes of a file mapping at ``address`` (page-aligned) into this
    process's page tables now, as reads would fault them in (``MADV_POPULATE_READ``; the GIL is
    released meanwhile); whether it was done. Nothing is read from disk that is not in the page
    cache already, nothing is written; a range past the file's end is refused (``EFAULT``),
    never signalled. Where the kernel lacks it (before 5.14), it is not tried again."""
    fn = _madvise()
    if fn is None or not _POPULATE[0]:
        return False
    if fn(address, length, _MADV_POPULATE_READ) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:
        _POPULATE[0] = False
    return False


def map_base(path: str) -> int | None:
    """The address where this process mapped ``<path>/data.mdb`` (Linux), else ``None``."""
    real = os.path.realpath(os.path.join(path, "data.mdb"))
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip("\n") == real:
                    return int(parts[0].split("-", 1)[0], 16) - int(parts[2], 16)
    except OSError:
        return None
    return None
