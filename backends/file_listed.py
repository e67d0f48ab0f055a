"""The keys a ``file`` tier listed at open, in key order, with their stamps: the part of its
:class:`~kvtier.backends.file_known.KnownRecords` that grows with the store.

Two forms answer the same calls (``find``, ``touch``, ``packed_keys``, ``stamps_now``):

* :class:`ListedInMemory`: a list of the listing's own ``bytes`` objects (the ones the
  manager's index holds: 8 bytes a key) and their stamps in one array (8 bytes a key): where
  nothing could be written to disk, or the records' sizes differ.
* :class:`ListedOnDisk`: what an open takes from a clean close's table of records
  (:mod:`kvtier.backends.file_table`), left in that table's file. The open unlinks the table,
  so it keeps one descriptor on it; the keys are found there by ``pread``: one read of a run
  of :data:`RUN` keys (4 KiB), found by bisection over the first key of each run, held in
  memory (under 1 byte a key). The stamps stay there too: a clean close reads them back once,
  with the touches since the open (a dict of the keys touched) laid over them. Nothing of it
  is anonymous memory of the process, as an ``lmdb`` store keeps its keys in its mapped file:
  the table's pages are the page cache's, which the kernel may drop and read again. A read
  that fails (a failing disk) answers "not listed", logged once, and so does every find after
  it, even once the reads work again: a key written or deleted meanwhile was not marked as
  left, and listed again it would be counted twice or come back after its delete. The listed
  keys' bytes then leave the tier's accounting (never its reads, which look the record up by
  name), and the clean close writes no table from them (the next open walks).
  A ``stat`` walk's listing is kept the same way, in a scratch file of its own
  (:func:`scratch_listing`).
"""

from __future__ import annotations

import itertools
import logging
import os
from bisect import bisect_left, bisect_right

import numpy as np

__all__ = ["RUN", "ListedInMemory", "ListedOnDisk", "scratch_listing"]

log = logging.getLogger("kvtier.backends.file_tier")

#: Keys a :class:`ListedOnDisk` reads at once (128 keys of 32 bytes: one 4 KiB read).
RUN = 128
_KEY = 32


class ListedInMemory:
    """The listed ``keys`` (a sorted list of distinct ``bytes``) and their ``stamps``."""

    __slots__ = ("keys", "stamps")
    #: :meth:`without` gives the keys still listed (the others' objects let go).
    rebuilds = True

    def __init__(self, keys: list[bytes], stamps: np.ndarray) -> None:
        self.keys, self.stamps = keys, stamps

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, key: bytes) -> int:
        """``key``'s position, or -1."""
        keys = self.keys
        i = bisect_left(keys, key)
        return i if i < len(keys) and keys[i] == key else -1

    def touch(self, i: int, stamp: float) -> None:
        self.stamps[i] = stamp

    def packed_keys(self) -> np.ndarray:
        """Every listed key, in key order, as one ``S32`` column."""
        return np.array(self.keys, dtype=f"S{_KEY}") if self.keys else np.empty(0, dtype=f"S{_KEY}")

    def stamps_now(self) -> np.ndarray:
        return self.stamps

    def without(self, keep: list[int]) -> ListedInMemory:
        """The keys at ``keep`` only (the others have left: their objects are let go)."""
        return ListedInMemory([self.keys[i] for i in keep], self.stamps[keep])

    def close(self) -> None:
        pass


class ListedOnDisk:
    """``n`` keys in key order at offset ``keys_at`` of the open file ``fd`` (owned: closed by
    :meth:`close`), their stamps (``<f8``) at ``stamps_at``; ``firsts``: the first key of each
    run of :data:`RUN` keys."""

    __slots__ = ("_failed", "_last", "fd", "firsts", "keys_at", "n", "stamps_at", "touched")
    #: Never rebuilt: its keys hold no object of the process.
    rebuilds = False

    def __init__(self, fd: int, n: int, keys_at: int, stamps_at: int, firsts: list[bytes]) -> None:
        if len(firsts) != -(-n // RUN):
            raise ValueError(f"firsts: expected the first key of each of the {-(-n // RUN)} runs of {n} keys, got {len(firsts)}")
        self.fd, self.n, self.keys_at, self.stamps_at, self.firsts = fd, n, keys_at, stamps_at, firsts
        self.touched: dict[int, float] = {}  # stamps given since the open, by position
        self._failed = False
        self._last: tuple[bytes, int] = (b"", -1)  # the last key found and its answer (a write asks twice)

    def __len__(self) -> int:
        return self.n

    def find(self, key: bytes) -> int:
        """``key``'s position, or -1 (also once a read of the table has failed: logged once)."""
        if self._failed:
            return -1
        last = self._last
        if key == last[0]:
            return last[1]
        run = bisect_right(self.firsts, key) - 1
        if run < 0:
            return -1
        start = run * RUN
        count = min(RUN, self.n - start)
        try:
            block = self._read(self.keys_at + start * _KEY, count * _KEY)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("file: the listed keys cannot be read back (%s); those keys leave the tier's accounting", exc)
            return -1
        at = block.find(key)  # a scan in C: faster here than a bisection in Python
        while at > 0 and at % _KEY:  # found across two keys' bytes: look on
            at = block.find(key, at + 1)
        found = -1 if at < 0 else start + at // _KEY
        self._last = (key, found)  # the keys and their places never change: always true
        return found

    def touch(self, i: int, stamp: float) -> None:
        self.touched[i] = stamp

    def packed_keys(self) -> np.ndarray:
        """Every listed key, in key order; ``OSError`` once a read has failed (see the module doc)."""
        if self._failed:
            raise OSError("the listed keys could not be read back once: no table is written from them")
        return np.frombuffer(self._read(self.keys_at, self.n * _KEY), dtype=f"S{_KEY}")

    def stamps_now(self) -> np.ndarray:
        """The stamps, the touches since the open laid over the table's."""
        stamps = np.frombuffer(self._read(self.stamps_at, self.n * 8), dtype="<f8").astype(np.float64)
        if self.touched:
            at = np.fromiter(self.touched, dtype=np.intp, count=len(self.touched))
            stamps[at] = np.fromiter(self.touched.values(), dtype=np.float64, count=len(self.touched))
        return stamps

    def _read(self, at: int, size: int) -> bytes:
        data = os.pread(self.fd, size, at)
        if len(data) == size:
            return data
        parts = [data]
        while size > (got := sum(map(len, parts))):
            part = os.pread(self.fd, size - got, at + got)
            if not part:
                raise OSError(f"the table of records ends at {at + got}, {size - got} bytes short")
            parts.append(part)
        return b"".join(parts)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def scratch_listing(root: str, keys: list[bytes], stamps: np.ndarray) -> ListedOnDisk | None:
    """``keys`` (in key order, distinct, each 32 bytes) and their ``stamps`` written to a file
    of their own under ``root`` that no name reaches (``O_TMPFILE``, else a temp name unlinked
    at once), as a table's: where a ``stat`` walk's listing is kept. ``None`` (logged) where it
    cannot be written: the caller keeps the keys in memory. Written a chunk at a time, so no
    temporary grows with the keys."""
    n = len(keys)
    try:
        fd = _scratch_fd(root)
    except OSError as exc:
        log.warning("file: no scratch file under %s for the listed keys (%s); they stay in memory", root, exc)
        return None
    try:
        for start in range(0, n, 8192):
            _write_all(fd, b"".join(keys[start : start + 8192]))
        _write_all(fd, memoryview(np.ascontiguousarray(stamps, dtype="<f8")).cast("B"))
        if os.fstat(fd).st_size != 40 * n:
            raise OSError(f"the scratch file holds {os.fstat(fd).st_size} bytes, not {40 * n}")
        return ListedOnDisk(fd, n, 0, 32 * n, keys[::RUN])
    except (OSError, ValueError) as exc:
        os.close(fd)
        log.warning("file: the listed keys cannot be written under %s (%s); they stay in memory", root, exc)
        return None
    except BaseException:  # refused memory, an interrupt: the descriptor goes before the error
        os.close(fd)
        raise


_scratch_names = itertools.count()


def _scratch_fd(root: str) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(root, flags | os.O_TMPFILE, 0o600)
        except OSError:
            pass  # a filesystem without it: a name of its own, unlinked at once
    path = os.path.join(root, f"kvtier-listed.{os.getpid()}.{next(_scratch_names)}.tmp")
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.unlink(path)
    except OSError:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
