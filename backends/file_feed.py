"""The change feed of a ``file`` tier on a shared filesystem: an append-only log in the tier's
directory (see :mod:`kvtier.backends.change_feed` for what a feed carries).

Layout under the tier's root::

    kvtier-feed/lock                    writers hold an exclusive ``flock`` on it while appending
    kvtier-feed/seg-<16 digits>         segments of framed entries, the newest one appended to

Each entry is one frame, written with one ``write`` call under the lock::

    4 bytes magic "KVF1" | u32 payload length | u32 crc32c of the payload | payload

Bounded: a writer that finds the newest segment at ``segment_bytes`` or more starts the next
one and deletes all but the newest ``segments`` (under the lock, so no writer ever appends to a
segment once the next exists: a reader that sees segment ``n + 1`` reads ``n`` to its end once
more and moves on). A reader never takes the lock: it reads whole frames from its cursor
(segment, offset); a frame still being written is short and is read at the next poll.

Gaps (the follower sweeps): the reader's segment was deleted (it fell behind by ``segments``
segments), the log was wiped, or a frame is damaged (a writer that died mid-write on a
filesystem that shows partial writes: the reader skips to the next frame's magic).

Staleness is the poll interval (``poll_s``, 50 ms) plus the filesystem's own visibility delay: on
NFS, attribute caching (``actimeo``) can hide a file's growth for up to its timeout, so mount
the shared directory with ``actimeo=1`` or less (``docs/tiers.md``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
from collections.abc import Sequence

from kvtier.backends.change_feed import ChangeFeed, FeedCursor, FeedEntry, FeedRead, decode_entry

from kvtier.records.format import crc32c

__all__ = ["FileFeed"]

log = logging.getLogger("kvtier")

_MAGIC = b"KVF1"
_FRAME = struct.Struct("<4sII")
_PREFIX = "seg-"
_MAX_PAYLOAD = 1 << 20  # a frame longer than this is damage, not an entry
_READ_CHUNK = 4 << 20  # bytes read per call at most


def _seg_name(n: int) -> str:
    return f"{_PREFIX}{n:016d}"


class FileFeed(ChangeFeed):
    """An append-only, rotated log of feed entries under ``<root>/kvtier-feed``."""

    def __init__(
        self,
        root: str,
        *,
        writer: bytes | None = None,
        segment_bytes: int = 4 << 20,
        segments: int = 4,
        poll_s: float = 0.05,
    ) -> None:
        super().__init__(writer)
        if segment_bytes < 4096:
            raise ValueError(f"segment_bytes: expected at least 4096, got {segment_bytes!r}")
        if segments < 2:
            raise ValueError(f"segments: expected at least 2, got {segments!r}")
        self.dir = os.path.join(root, "kvtier-feed")
        self.segment_bytes = int(segment_bytes)
        self.segments = int(segments)
        self.poll_s = float(poll_s)
        self._lock_fd: int | None = None
        self._seg = 0  # the writer's newest known segment (0: not looked yet)
        self._seg_fd: int | None = None
        self._read_fd: tuple[int, int] | None = None  # (segment, fd) the reader keeps open
        self.rotations = 0
        self.bytes_read = 0

    # -- segments ------------------------------------------------------------------------------
    def _path(self, n: int) -> str:
        return os.path.join(self.dir, _seg_name(n))

    def _list(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit():
                out.append(int(name[len(_PREFIX):]))
        return sorted(out)

    # -- writing -------------------------------------------------------------------------------
    def append(self, values: Sequence[bytes]) -> bool:
        data = b"".join(_FRAME.pack(_MAGIC, len(v), crc32c(v)) + v for v in values)
        try:
            if self._lock_fd is None:
                os.makedirs(self.dir, mode=0o700, exist_ok=True)
                self._lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                fd = self._writable_segment()
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        except OSError as exc:
            log.debug("file feed %s: append failed: %s", self.dir, exc)
            self._drop_segment_fd()
            return False
        return True

    def _writable_segment(self) -> int:
        """The descriptor of the newest segment, rotating it when full (the lock is held)."""
        if self._seg_fd is None or os.path.exists(self._path(self._seg + 1)) or os.fstat(self._seg_fd).st_nlink == 0:
            self._drop_segment_fd()
            found = self._list()
            self._seg = found[-1] if found else 1
            self._seg_fd = os.open(self._path(self._seg), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(self._seg_fd).st_size >= self.segment_bytes:
            self._drop_segment_fd()
            self._seg += 1
            self._seg_fd = os.open(self._path(self._seg), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self.rotations += 1
            for old in self._list():
                if old <= self._seg - self.segments:
                    try:
                        os.unlink(self._path(old))
                    except FileNotFoundError:
                        pass
        return self._seg_fd

    def _drop_segment_fd(self) -> None:
        fd, self._seg_fd = self._seg_fd, None
        if fd is not None:
            os.close(fd)

    # -- reading -------------------------------------------------------------------------------
    def head(self) -> FeedCursor:
        found = self._list()
        if not found:
            return FeedCursor()
        try:
            return FeedCursor(found[-1], os.stat(self._path(found[-1])).st_size)
        except FileNotFoundError:  # rotated away this instant: the next segment's start is the head
            return FeedCursor(found[-1] + 1, 0)

    def read(self, cursor: FeedCursor, wait_s: float) -> FeedRead:
        deadline = time.monotonic() + wait_s
        while True:
            result = self._read_once(cursor)
            if result.entries or result.gap or result.skipped or time.monotonic() >= deadline:
                return result
            cursor = result.cursor
            # Between polls the read waits on the wake event, not in a sleep: a stopping
            # follower's read returns at once.
            if self._woken.wait(min(self.poll_s, max(0.0, deadline - time.monotonic()))):
                self._take_wake()
                return result

    def _open_segment(self, n: int) -> int | None:
        held = self._read_fd
        if held is not None and held[0] == n:
            return held[1]
        self._close_reader()
        try:
            fd = os.open(self._path(n), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        self._read_fd = (n, fd)
        return fd

    def _close_reader(self) -> None:
        held, self._read_fd = self._read_fd, None
        if held is not None:
            os.close(held[1])

    def _read_once(self, cursor: FeedCursor) -> FeedRead:
        seg, off = cursor.major, cursor.minor
        gap = False
        if seg == 0:  # before the first segment ever written
            found = self._list()
            if not found:
                return FeedRead((), cursor)
            gap = found[0] != 1
            seg, off = found[0], 0
        entries: list[FeedEntry] = []
        skipped = nbytes = 0
        while True:
            fd = self._open_segment(seg)
            if fd is None:
                found = self._list()
                newer = [n for n in found if n > seg]
                if newer:  # we fell behind: the segments between were rotated away
                    return FeedRead(tuple(entries), FeedCursor(newer[0], 0), True, skipped, nbytes)
                if found and found[-1] == seg - 1 and off == 0:  # the next segment is not started yet
                    return FeedRead(tuple(entries), FeedCursor(seg, 0), gap or skipped > 0, skipped, nbytes)
                # Our segment is gone and nothing newer exists: the log was wiped (and may be
                # starting over). Start from its beginning; the sweep reconciles.
                return FeedRead(tuple(entries), FeedCursor(), True, skipped, nbytes)
            # Whether the next segment exists is looked at *before* reading to the end: then
            # this one is complete (writers never append to it again) once read.
            # A deleted segment (rotated away while we held it open) is complete as well.
            st = os.fstat(fd)
            if st.st_nlink == 0 and os.path.exists(self._path(seg)):  # a new log under the old name
                self._close_reader()
                return FeedRead(tuple(entries), FeedCursor(), True, skipped, nbytes)
            finished = st.st_nlink == 0 or os.path.exists(self._path(seg + 1))
            size = st.st_size
            if size < off:  # shorter than our cursor: not the file we read from
                return FeedRead(tuple(entries), FeedCursor(seg + 1 if finished else seg, 0 if finished else size), True, skipped, nbytes)
            data = os.pread(fd, min(size - off, _READ_CHUNK), off) if size > off else b""
            nbytes += len(data)
            used, bad = self._parse(data, entries)
            skipped += bad
            off += used
            if len(data) == _READ_CHUNK or not finished:
                break
            if off < size:  # a frame left unfinished at the end of a segment no one writes: lost
                skipped += 1
            seg, off = seg + 1, 0
        self.bytes_read += nbytes
        return FeedRead(tuple(entries), FeedCursor(seg, off), gap or skipped > 0, skipped, nbytes)

    @staticmethod
    def _parse(data: bytes, entries: list[FeedEntry]) -> tuple[int, int]:
        """Whole frames of ``data`` appended to ``entries``: ``(bytes used, damaged frames)``.
        A short frame at the end is left for the next read; damage is skipped to the next magic."""
        pos = bad = 0
        end = len(data)
        view = memoryview(data)
        while end - pos >= _FRAME.size:
            magic, length, crc = _FRAME.unpack_from(data, pos)
            if magic == _MAGIC and length <= _MAX_PAYLOAD and end - pos - _FRAME.size < length:
                break  # still being written
            body = view[pos + _FRAME.size : pos + _FRAME.size + length]
            entry = decode_entry(body) if magic == _MAGIC and length <= _MAX_PAYLOAD and crc32c(body) == crc else None
            if entry is None:
                bad += 1
                nxt = data.find(_MAGIC, pos + 1)
                pos = nxt if nxt >= 0 else end
                continue
            entries.append(entry)
            pos += _FRAME.size + length
        return pos, bad

    def close(self) -> None:
        self._drop_segment_fd()
        self._close_reader()
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)
