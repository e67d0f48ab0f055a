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

Each job commits on its caller's thread. Committing the jobs of concurrent writers together
(:class:`~kvtier.backends.group_commit.GroupCommit`, as the ``lmdb`` tier does) was measured
slower here: it shares only the directory syncs, and it runs every file's ``fdatasync`` on the
leader's thread, one after the other, where concurrent writers overlap theirs on the device
(4 writers of 64 KiB jobs of 16: 67 blocks/s grouped against 313 for raw writers in the same
layout).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import DiskError

__all__ = ["FileJob", "StagedFile", "commit_files", "write_all"]

log = logging.getLogger("kvtier.backends.file_tier")

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def write_all(fd: int, buffers: Sequence[Any]) -> None:
    """``pwritev`` until every byte is written (a short write is legal for large buffers)."""
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
    directories that gained a subdirectory for them (their entries must be synced too)."""

    files: list[StagedFile] = field(default_factory=list)
    dirs: dict[str, int] = field(default_factory=dict)
    parents: set[str] = field(default_factory=set)

    def stage(self, shard: str, tmp: str, name: str, buffers: Sequence[Any]) -> None:
        """Write ``buffers`` to ``tmp`` in ``shard``'s directory; ``OSError`` leaves nothing behind."""
        dir_fd = self.dirs[shard]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        try:
            write_all(fd, buffers)
        except BaseException:
            os.close(fd)
            _unlink(tmp, dir_fd)
            raise
        self.files.append(StagedFile(shard, dir_fd, tmp, name, fd))

    def close(self) -> None:
        """Close every descriptor, and remove the temporary files not renamed (a failed or
        abandoned commit)."""
        for f in self.files:
            if f.fd >= 0:
                os.close(f.fd)
                f.fd = -1
            if not f.renamed:
                _unlink(f.tmp, f.dir_fd)
        for fd in self.dirs.values():
            os.close(fd)
        self.dirs.clear()


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def commit_files(jobs: list[FileJob], *, durable: bool) -> list[list[bool]]:
    """Make the staged records of ``jobs`` final (see the module doc); per job, per staged file,
    whether it was committed. A file that cannot be synced or renamed fails alone; a directory
    that cannot be synced is a ``DiskError`` (its renames may not survive a power loss)."""
    files = [f for job in jobs for f in job.files]
    failed: set[int] = set()
    for f in files:
        try:
            if durable:
                os.fdatasync(f.fd)
        except OSError as exc:
            log.warning("file: sync of %s failed: %s", f.tmp, exc)
            failed.add(id(f))
        finally:
            os.close(f.fd)
            f.fd = -1
    for f in files:
        if id(f) in failed:
            continue
        try:
            os.replace(f.tmp, f.name, src_dir_fd=f.dir_fd, dst_dir_fd=f.dir_fd)
            f.renamed = True
        except OSError as exc:
            log.warning("file: rename of %s failed: %s", f.tmp, exc)
            failed.add(id(f))
    if durable:
        synced: set[str] = set()
        try:
            for job in jobs:
                for shard, fd in job.dirs.items():
                    if shard not in synced and any(f.renamed and f.shard == shard for f in job.files):
                        synced.add(shard)
                        os.fsync(fd)
            for path in sorted({p for job in jobs for p in job.parents}):
                dir_fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as exc:
            raise DiskError(f"file: cannot sync directory entries: {exc}") from exc
    return [[id(f) not in failed for f in job.files] for job in jobs]
