"""A lowered capacity of an ``lmdb`` tier (:class:`LmdbShrink`, a base of
:class:`~kvtier.backends.lmdb_tier.LmdbBackend`): where the map holds more than the capacity at
open, the oldest records are dropped until the rest fits, the file is compacted into a copy whose
data is synced before its name replaces the old file's, and the store is opened again at the
capacity. A power loss leaves the old file or the whole copy, never a name over data not yet
written.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

import lmdb
from kvtier.backends.lmdb_files import check_data_file

from kvtier.backend import BlockFormat, RecordInfo

__all__ = ["LmdbShrink"]

log = logging.getLogger("kvtier.backends.lmdb_tier")


def _synced_copy(env: lmdb.Environment, directory: str) -> None:
    """A compacted copy of ``env`` in ``directory``, its data synced (LMDB's copy does not sync
    it): on disk before its name replaces the old file's, so a power loss leaves the old file or
    the whole copy, never a name over data not yet written."""
    env.copy(directory, compact=True)
    _fsync_path(os.path.join(directory, "data.mdb"))


def _fsync_path(path: str) -> None:
    """``fsync`` of a file or a directory, by its path."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LmdbShrink:
    """Drops the oldest records of a store that holds more than its lowered capacity (see the
    module doc); the environment, its databases and its listing are the tier's."""

    path: str
    capacity_bytes: int
    _env: lmdb.Environment | None
    _blocks: Any
    _index: Any
    _listed: Any

    if TYPE_CHECKING:

        def usable_bytes(self) -> int: ...

        def _close_env(self) -> bool: ...

        def _try_open(self, fmt: BlockFormat) -> None: ...

        def _begin_write(self, db: Any = None, buffers: bool = False) -> lmdb.Transaction: ...

        def _wrote(self) -> int | None: ...

    def _shrink(self, fmt: BlockFormat, used: int) -> None:
        """The map holds more than the (lowered) capacity: drop the oldest records until the rest
        fits, compact the file, and reopen at the capacity. Logged with the counts."""
        env = self._env
        assert env is not None
        records = sorted(self._listed if isinstance(self._listed, list) else [], key=lambda r: r.stamp)
        total = sum(r.stored_bytes for r in records)
        room = self.usable_bytes()
        dropped: list[RecordInfo] = []
        while records and total > room:
            victim = records.pop(0)
            dropped.append(victim)
            total -= victim.stored_bytes
        with self._begin_write() as txn:
            for r in dropped:
                txn.delete(r.key, db=self._blocks)
                txn.delete(r.key, db=self._index)
        self._wrote()
        compacted = os.path.join(self.path, "compact.tmp")
        shutil.rmtree(compacted, ignore_errors=True)
        os.makedirs(compacted, mode=0o700)
        try:
            _synced_copy(env, compacted)
            self._close_env()
            os.replace(os.path.join(compacted, "data.mdb"), os.path.join(self.path, "data.mdb"))
            _fsync_path(self.path)
        except (OSError, lmdb.Error) as exc:
            log.warning("lmdb: cannot compact %r after lowering its capacity (%s); it keeps its larger file", self.path, exc)
            return
        finally:
            shutil.rmtree(compacted, ignore_errors=True)
        message = (
            f"lmdb: {self.path!r} held {used} bytes, more than its capacity of {self.capacity_bytes}: dropped the "
            f"{len(dropped)} oldest records ({sum(r.stored_bytes for r in dropped)} bytes), kept {len(records)}, "
            f"compacted the file to {check_data_file(self.path)} bytes"
        )
        log.warning(message)
        self._try_open(fmt)
