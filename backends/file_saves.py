"""The saving half of the ``file`` tier (:class:`FileSaves`, a base of
:class:`~kvtier.backends.file_tier.FileBackend`): the room each record takes is reserved first
and given back if its write fails, then the job's records are staged and committed together
(:mod:`kvtier.backends.file_commit`).

A job of one plain record (an unkeyed store, no compression, a host row whose view the tier
keeps, the ``flat`` layout) is saved in one straight line (:meth:`FileSaves._save_one` and
:func:`~kvtier.backends.file_commit.commit_one`): the general path's system calls in the same
order (a descriptor of the root, the temporary file opened and written, ``fdatasync``, close,
rename, ``fsync`` of the root, durable) and the same outcomes, logs and counters on every
failure, without the job's lists, records and loops. Jobs of one are the commonest and, their
syncs aside, the dearest per record. Measured (4 KiB records, durable, one process, the
tier's CPU time per save, 8 alternated rounds of 300 saves at load 4.3-4.8): 166-202 µs by the
general path, 136-173 in the straight line; a raw save of the same bytes (``raw_each`` of
``benchmarks/bench_disk_sizes.py``) took 147-185 before and 168-216 after in the same runs.
``bench_disk_sizes.py --quick --tiers file``, 4 KiB jobs of one, alternated twice (load 2.4-3.6):
0.90, 0.91 of the best raw shape before, 0.95, 0.92 after.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from kvtier.backends.file_commit import FileJob, close_logged, commit_files, commit_one, plain_records
from kvtier.backends.file_known import KnownRecords
from kvtier.backends.file_reads import BeneathRoot, PlainReads
from kvtier.backends.file_root import ShardDirs
from kvtier.backends.file_tree import _SUFFIX, FLAT
from kvtier.backends.lmdb_plain import RowViews

from kvtier.errors import DiskError
from kvtier.pool_rows import refusing_writes
from kvtier.records import xxcopy
from kvtier.records.codec import NoneCodec
from kvtier.records.counts import counts_add
from kvtier.records.format import PersistentRecordBackend

if TYPE_CHECKING:
    from kvtier.backends.feed_follower import TierFollower

__all__ = ["SAVE_ONE", "FileSaves"]

log = logging.getLogger("kvtier.backends.file_tier")

_SUM = struct.Struct("<Q")
#: Jobs of one plain record in the flat layout take the straight line (:meth:`FileSaves._save_one`);
#: ``False``: the general path (which the tests compare it with).
SAVE_ONE = True


class FileSaves(PersistentRecordBackend):
    """Saves of a ``file`` tier (see the module doc); the room, the shard directories and the
    rows' views are the tier's."""

    store_layout: str
    _lock: threading.Lock
    _sizes: KnownRecords
    _used: int
    _plain: PlainReads | None
    _views: RowViews | None
    _shards: ShardDirs | None
    _beneath: BeneathRoot | None

    if TYPE_CHECKING:
        follower: TierFollower | None

        def _followed_writes(self, keys: Sequence[bytes]) -> None: ...

        def _temp_name(self, path: str) -> str: ...

        def _path(self, key: bytes) -> str: ...

        @staticmethod
        def _stored(record_bytes: Any) -> Any: ...

    @refusing_writes  # (rows a tier cannot hold, such as a sparse pool's, fail the job by name)
    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        """Stage every record of the job, then commit them together (:mod:`kvtier.backends.file_commit`).
        Counted among the root's jobs, so a close waits for it: a record's directory may be
        reached by the root's path, where a store opened since may be."""
        beneath = self._beneath
        if beneath is None or not beneath.enter():
            self._check_open()  # closed: refused by name
            return [None] * len(keys)
        try:
            return self._write_counted(keys, blocks)
        finally:
            beneath.leave()

    @xxcopy.holding_rows  # no collection from the rows' views to the records' writes
    def _write_counted(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        # Unkeyed, uncompressed jobs of host rows: the job's checks and its rows' views in one
        # loop, and each record's checksum from the store's one hash state (plain_records).
        plain = self._plain if self.codec.codec_id == NoneCodec.codec_id else None
        rows = self._views.of(keys, blocks) if plain is not None and self._views is not None else None
        self._check_io(keys, blocks) if rows is None else self._check_open()
        if rows is not None and plain is not None and len(rows) == 1 and self.store_layout == FLAT and SAVE_ONE:
            return self._save_one(keys[0], rows[0], plain)
        parts = self._encode(keys, blocks) if plain is None or rows is None else plain_records(plain.checksum, keys, rows)
        shards = self._shards
        assert shards is not None
        sizes: list[int | None] = []
        staged: list[tuple[int, bytes, int, int]] = []  # position, key, reserved growth, record bytes
        job = FileJob(early_writeback=self.sync_mode == "durable" and len(keys) > 1)
        try:
            for key, (header, payload) in zip(keys, parts):
                n = len(header) + len(payload)
                stored = self._stored(n)
                grow = self._reserve(key, stored)
                if grow is None:
                    sizes.append(None)
                    continue
                name = key.hex() + _SUFFIX
                shard = shards.shard(name)
                try:
                    if shard not in job.dirs:
                        job.dirs[shard] = shards.open_leaf(key, job.parents)
                    job.stage(shard, self._temp_name(name), name, (header, payload), n)
                except OSError as exc:
                    log.warning("file: write of %s failed: %s", self._path(key), exc)
                    self._unreserve(key, grow, stored)
                    sizes.append(None)
                    continue
                staged.append((len(sizes), key, grow, n))
                sizes.append(stored)
            mark = shards.mark()  # (before the syncs: what a walk makes during them is not theirs)
            committed = commit_files([job], durable=self.sync_mode == "durable")[0]
            if self.sync_mode == "durable":
                shards.synced(job.parents, mark)
        except BaseException:
            for (pos, key, grow, _), f in zip(staged, job.files):
                if not f.renamed:  # (a renamed record is there, synced or not: it keeps its room)
                    self._unreserve(key, grow, sizes[pos] or 0, count=False)
            raise
        finally:
            job.close()
        for (pos, key, grow, _), ok in zip(staged, committed):
            if not ok:
                self._unreserve(key, grow, sizes[pos] or 0)
                sizes[pos] = None
        written = sum(n for pos, _, _, n in staged if sizes[pos] is not None)
        counts_add(self.counters, "blocks_written", sum(1 for s in sizes if s is not None), "bytes_written", written)
        if self.follower is not None:
            self._followed_writes([key for key, size in zip(keys, sizes) if size is not None])
        return sizes

    def _save_one(self, key: bytes, row: memoryview, plain: PlainReads) -> list[int | None]:
        """:meth:`write_blocks` for a job of one plain record in the flat layout, in one
        straight line (see the module doc): the same calls, outcomes, logs and counters."""
        checksum = plain.checksum
        header = checksum.head + _SUM.pack(checksum(key, row))
        n = len(header) + len(row)
        stored = self._stored(n)
        grow = self._reserve(key, stored)
        if grow is None:
            return [None]
        shards = self._shards
        assert shards is not None
        name = key.hex() + _SUFFIX
        dir_fd = -1
        try:
            dir_fd = shards.open_leaf(key, set())
            ok = commit_one(dir_fd, self._temp_name(name), name, (header, row), n, durable=self.sync_mode == "durable")
        except DiskError:  # the root's sync failed after the rename: the record keeps its room
            raise
        except OSError as exc:  # the root's descriptor, or the temporary file's open or write
            log.warning("file: write of %s failed: %s", self._path(key), exc)
            ok = False
        finally:
            if dir_fd >= 0:
                close_logged(dir_fd, self._root)  # (its entry synced by now: the record stands)
        if not ok:
            self._unreserve(key, grow, stored)
            return [None]
        counts_add(self.counters, "blocks_written", 1, "bytes_written", n)
        if self.follower is not None:
            self._followed_writes([key])
        return [stored]

    def _reserve(self, key: bytes, stored: int) -> int | None:
        """Reserve room for ``key``'s record of ``stored`` bytes: the growth reserved (given
        back by :meth:`_unreserve` if the write fails), or ``None`` (a write failure counted)
        when it does not fit the capacity."""
        with self._lock:
            grow = stored - self._sizes.get(key, 0)
            if self._used + grow > self.capacity_bytes:
                counts_add(self.counters, "write_failures", 1)
                return None
            self._used += grow
            self._sizes.set(key, stored)
        return grow

    def _unreserve(self, key: bytes, grow: int, stored: int, *, count: bool = True) -> None:
        """Give back the room reserved for ``key``'s write that failed."""
        with self._lock:
            self._used -= grow
            if grow == stored:
                self._sizes.pop(key)
        if count:
            counts_add(self.counters, "write_failures", 1)
