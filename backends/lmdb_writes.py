"""The writing half of the ``lmdb`` tier (:class:`LmdbWrites`, a base of
:class:`~kvtier.backends.lmdb_tier.LmdbBackend`): saves by group commit, deletions and access
stamps. All of them serialise on the tier's one write lock (LMDB has one writer anyway).

A job's records go in one write transaction, and jobs whose writers wait together share it and its
sync (:mod:`kvtier.backends.group_commit`); a group whose values take more than
:data:`TXN_MOST_BYTES` of heap goes in several, each durable, the group acknowledged after the last
(:func:`transactions`). Durable (``sync_mode="durable"``), a write returns only
after its commit (``sync=True``: the data pages are synced before the meta page is written) and an
``env.sync()`` (the meta page) are done: a block counts as saved only once it is on stable storage,
and a commit that fails fails every job that shared it. Before a group's transaction, glibc is made
to keep as much freed heap as the group's records take
(:func:`~kvtier.backends.lmdb_heap.keep_heap_for`, once per larger size): LMDB ``malloc``s each
value's pages and frees them at the commit, and the records built whole for the puts (joined
records' ``bytes``) are freed with the job; the next commit then reuses both instead of faulting
them in again.

A plain split record's head is made in the write transaction
(:data:`~kvtier.backends.lmdb_records.UNSUMMED`), its checksum from the copy its put made. A plain
joined record is built whole here, from the rows' views just taken, before the job waits for the
write lock and LMDB's begin: both let the GIL go, in which another thread may move the rows
(``pool.resize_`` frees the memory a view points at), and no step of this path asks the rows again.
(Built just before each put in the transaction instead, 16 records of 64 KiB cost 27-33 µs more than
raw puts with the syncs off, against 110-124 built for the whole job before it; this path saves only
rows not seen yet and jobs the straight lines do not take.) A lone job of one such block, into a row
whose view the store keeps, is saved in one straight line instead
(:class:`~kvtier.backends.lmdb_lone.LoneSave`), and so is a job of several such blocks, its checks
and views in one call and its builds and puts in another, the rows asked again in the call that
copies (:meth:`~kvtier.backends.lmdb_lone.LoneSave.save_job`).

A record of at most :data:`~kvtier.backends.lmdb_entries.JOIN_MAX` bytes is put joined (head and
payload in one value, :mod:`kvtier.backends.lmdb_layout`): one B-tree put, and, while the index may
hold a split record's entry (``_splits``: the open found one, or a split save wrote one), a delete
of the key's entry. Access stamps (:meth:`LmdbWrites.touch_stamps`) give a joined record a 16-byte
entry: it is a whole record from then on, and that entry its stamp (its size is its value's), also
once the record was saved joined again.

In a store of records of :data:`MAP_AFTER_BYTES` or more, a commit that appends less than
:data:`MAP_BELOW_BYTES` to ``data.mdb`` enters those pages into the process's page tables before the
write returns (:func:`~kvtier.backends.lmdb_files.map_pages`, about 100 µs for 2 MiB here), so the
first load of its records does not fault them in: python-lmdb touches each page of a value inside
``get``, and on pages not mapped yet that took 180 µs per 2 MiB value against 37 once mapped.
Measured (fresh stores, tier against itself with and without, 6 alternated rounds, load 1.8-4.2):
saved in jobs of one, 2 MiB records loaded 1.07-1.08x as fast and 256 KiB 1.15x, their saves
0.94-0.98x; saved in jobs of 16 (4 and 32 MiB a commit), loads gained nothing (their pages faulted
in cheaply already) and saves lost up to 0.84x: not mapped. Records of 64 KiB in jobs of 16 (1 MiB a
commit) loaded 1.05x as fast and saved 0.97x: not mapped. A load waits, a save is the engine's
second phase. Pages a commit reuses (freed by evictions) are not mapped ahead: they stay mapped from
their last read while the page cache holds them."""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lmdb
import torch
from kvtier.backends import lmdb_entries
from kvtier.backends.group_commit import GroupCommit
from kvtier.backends.lmdb_entries import INDEX, index_entry, restamp
from kvtier.backends.lmdb_files import map_pages
from kvtier.backends.lmdb_heap import keep_heap_for
from kvtier.backends.lmdb_layout import JobReader
from kvtier.backends.lmdb_lone import LoneSave
from kvtier.backends.lmdb_plain import RowViews, host_rows
from kvtier.backends.lmdb_records import UNSUMMED, PlainReads, all_built

from kvtier.errors import BackendError, DiskError
from kvtier.keys import check_keys
from kvtier.pool_rows import PoolRows, refusing_writes
from kvtier.records import xxcopy
from kvtier.records.checks import EncodedStream
from kvtier.records.codec import NoneCodec
from kvtier.records.counts import counts_add
from kvtier.records.format import PersistentRecordBackend

__all__ = ["TXN_MOST_BYTES", "LmdbWrites", "Record", "transactions"]

log = logging.getLogger("kvtier.backends.lmdb_tier")

_EPOCH_KEY = b"kvtier-epoch"
# Errors confined to one put: the write of that key fails, the job goes on.
#: In a store of records of at least ``MAP_AFTER_BYTES``, a commit that appends less than
#: ``MAP_BELOW_BYTES`` to the data file maps those pages ahead of its loads (see the module doc).
MAP_AFTER_BYTES = 256 << 10
MAP_BELOW_BYTES = 4 << 20
_PUT_FAILED = (lmdb.MapFullError, lmdb.DiskError, lmdb.TxnFullError)
#: The most heap one write transaction's values take (see :func:`transactions`): a group of
#: jobs of more is put in several transactions, each durable, acknowledged once all are. glibc
#: keeps at most twice its mapping threshold's cap (:data:`~kvtier.backends.lmdb_heap.MOST_BYTES`,
#: so 64 MiB) of freed heap; a commit that frees more hands it back and the next faults it all in
#: again (64 records of 2 MiB: 0.51 of the best raw shape in one transaction).
TXN_MOST_BYTES = 48 << 20
#: key, head, payload; a joined record may come whole: head ``b""``, the record as its payload
#: (``PlainReads.records``), put as it is.
Record = tuple[bytes, bytes, Any]


def transactions(jobs: list[list[Record]], each: int, most: int | None = None) -> list[tuple[list[list[Record]], list[int]]] | None:
    """The write transactions a group of ``jobs`` is put in, each of at most ``most`` bytes of
    the heap LMDB takes for its values (``each`` bytes a record; :data:`TXN_MOST_BYTES` by
    default), as equal as the records allow: ``None`` where the group fits one. Each part is
    its slices of the jobs and, for each slice, the index of the job it comes from (in order)."""
    most = TXN_MOST_BYTES if most is None else most
    count = sum(map(len, jobs))
    if count * each <= most or count < 2:
        return None
    per = max(1, most // max(1, each))
    per = -(-count // -(-count // per))  # as many parts as needed, the records dealt evenly
    parts: list[tuple[list[list[Record]], list[int]]] = []
    part: list[list[Record]] = []
    owners: list[int] = []
    room = per
    for owner, job in enumerate(jobs):
        start = 0
        while start < len(job):
            take = min(room, len(job) - start)
            part.append(job[start : start + take])
            owners.append(owner)
            start += take
            room -= take
            if room == 0:
                parts.append((part, owners))
                part, owners, room = [], [], per
    if part:
        parts.append((part, owners))
    return parts


class LmdbWrites(PersistentRecordBackend):
    """Saves, deletions and access stamps of an ``lmdb`` tier (see the module doc); the
    environment, its databases and the write lock are the tier's."""

    _env: lmdb.Environment | None
    _blocks: Any
    _index: Any
    _meta: Any
    _listed: Any
    _splits: bool
    _write_lock: threading.Lock
    _sync_lock: threading.Lock
    _commits: GroupCommit[list[Record], list[int | None]]
    _reader: JobReader | None

    if TYPE_CHECKING:

        def _env_or_raise(self) -> lmdb.Environment: ...

        def _pages(self, record_bytes: int) -> int: ...

    #: What a save of the open store uses, worked out once at its open (:meth:`_ready_writes`):
    #: where its records are plain (unkeyed, not compressed), the reader's row views and plain
    #: records (``None`` otherwise, and before the open); the bytes of one record and of the map
    #: pages it takes; whether a commit maps the pages it appends (``MAP_AFTER_BYTES``).
    _plain_rows: RowViews | None = None
    _plain_records: PlainReads | None = None
    _record_pages = (0, 0)
    _maps_appended = False
    #: Where records are plain and put joined, the straight line of a lone job of one block
    #: (:class:`~kvtier.backends.lmdb_lone.LoneSave`; ``None`` otherwise, and before the open).
    _lone: LoneSave | None = None

    def _ready_writes(self, direct: object | None = None) -> None:
        """Work out at the open what every save of the store asks (a 4 KiB save costs about
        160 µs durable, of which the tier's own Python was 12-15: these answers were a fifth
        of it). ``direct``: what :func:`~kvtier.backends.lmdb_direct.direct_gets` gave for the
        environment (a job save then puts by LMDB's own put, reserved), or ``None``."""
        reader = self._reader
        plain = reader is not None and self.mac is None and self.codec.codec_id == NoneCodec.codec_id
        self._plain_records = reader.plain if plain and reader is not None else None
        self._plain_rows = reader.views if plain and reader is not None else None
        record = self._head_bytes() + self.format.block_bytes
        self._record_pages = (record, self._pages(record))
        self._maps_appended = self.format.block_bytes >= MAP_AFTER_BYTES
        joined = record <= lmdb_entries.JOIN_MAX and not self._maps_appended
        self._lone = LoneSave(self, self._plain_records, self._plain_rows, direct) if joined and self._plain_records is not None and self._plain_rows is not None else None

    @refusing_writes  # (rows a tier cannot hold, such as a sparse pool's, fail the job by name)
    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        lone = self._lone
        if lone is not None:
            if len(keys) == 1 and len(blocks) == 1:
                saved = lone.save(keys[0], blocks if type(blocks) is PoolRows else blocks[0])  # a lone plain block in one straight line (lmdb_lone)
            else:
                saved = lone.save_job(keys, blocks)
            if saved is not None:
                return saved
        records, rows = self._plain_records, self._plain_rows
        # No collection from the first row's view to the last copy out of the views
        # (xxcopy.rows_hold: a finalizer run between may free a row whose view is taken): let
        # go once the records are built, or, where the commit copies the rows, once it returns.
        held = [False]
        try:
            if rows is not None or records is not None:
                xxcopy.rows_hold_flag(held)  # (the hold and its flag in one call: an interrupt lands before both or after both)
            # Plain jobs of host rows: the job's checks and its rows' views in one loop
            # (RowViews, as reads do; rows of one pool: the views hold its memory to the last
            # copy); other rows of plain jobs get views one by one (host_rows).
            views = rows.of(keys, blocks) if rows is not None else None
            if views is None:
                size = self._check_io(keys, blocks)
                views = host_rows(blocks, size) if records is not None else None
            self._env_or_raise()
            if views is not None and records is not None:
                # Plain records: joined ones built here, from the views just taken (see the
                # module doc: the commit's wait for the lock and its begin let the GIL go, in
                # which another thread may move the rows); split ones' heads made in the write
                # transaction (lmdb_plain). (The general encoder's side thread gains nothing
                # here: the whole job is encoded before its commit.)
                job = records.records(keys, views)
                # (not all built: a view the commit copies; every record of a split job, and any
                # joined one whose build failed here, which the transaction builds again)
                built = all_built(job)
            else:
                built = True  # no views
                # Checksums (and compression, MACs) run on a side thread for jobs of
                # SIDE_MIN_BYTES or more, outside the lock; then the job joins whatever other
                # jobs wait for a commit (see _commit_jobs).
                with self._encoded(keys, blocks) as records:
                    job = [(key, head, payload) for key, (head, payload) in zip(keys, records)]
            if built:
                xxcopy.rows_let_go_flag(held)
            sizes = self._commits.submit(job)
        finally:
            xxcopy.rows_let_go_flag(held)
        if views is not None and records is not None and None not in sizes:
            # A plain job stored whole: its records are all of one length (the head, then the
            # block; joined, one bytes of both), so it is counted with no pass over them.
            counts_add(self.counters, "blocks_written", len(sizes), "bytes_written", len(sizes) * self._record_pages[0])
            return sizes
        count = stored = 0
        for (_, head, payload), size in zip(job, sizes):
            if size is not None:
                count += 1
                stored += len(head) + len(payload)
        counts_add(self.counters, "blocks_written", count, "bytes_written", stored)
        return sizes

    def _commit_jobs(self, jobs: list[list[Record]]) -> list[list[int | None]]:
        """Put every record of ``jobs`` in one write transaction: a job of small records costs one
        durable commit instead of one per record, and jobs that waited together share it. If the
        transaction fails on a full map (or another error confined to a put), or a record built in
        it fails to build (a plain joined one, :meth:`PlainReads.joined`), it is aborted and the
        records are put one per transaction instead, so the failure is confined to the keys that do
        not fit or build: the other jobs of the group are stored and acknowledged, none for a record
        rolled back. Durable, each commit syncs its data pages before it writes its meta page;
        :meth:`_sync_jobs` then syncs that page."""
        with self._write_lock:
            self._listed = None
            # Only a store of large records maps what a commit appends: the others skip the
            # lseek before (see the module doc; the one after is the file guard's, _wrote).
            maps = self._maps_appended
            start = self._data_end() if maps else None
            # The transaction mallocs each value's pages and frees them all at its commit, and
            # the records built whole for it (joined records: a bytes each) are freed just
            # after: glibc is made to keep that much free heap for the next one (lmdb_heap).
            # Counted without the built records, 16 joined 64 KiB records faulted 30 pages in
            # a record at every job.
            record, pages = self._record_pages
            built = record if record <= lmdb_entries.JOIN_MAX else 0
            parts = transactions(jobs, pages + built)
            if parts is None:  # (the group fits one transaction: the common case)
                keep_heap_for(sum(map(len, jobs)) * (pages + built))
                sizes = self._put_group(jobs)
                end = self._wrote()
            else:
                keep_heap_for(max(sum(map(len, part)) for part, _ in parts) * (pages + built))
                sizes = [[] for _ in jobs]
                for part, owners in parts:
                    for owner, part_sizes in zip(owners, self._put_group(part)):
                        sizes[owner] += part_sizes
                    end = self._wrote()  # (each part's commit tells the guard the size it left)
            if maps:
                self._map_appended(start, end)
            return sizes

    def _put_group(self, jobs: list[list[Record]]) -> list[list[int | None]]:
        """``jobs`` in one write transaction; where it fails on a put or a build, each record in its own."""
        try:
            return self._put_together(jobs)
        except _PUT_FAILED as exc:
            log.debug("lmdb: a group of %d jobs did not fit one transaction (%s); putting each record alone", len(jobs), exc)
            return self._put_each(jobs)
        except lmdb.Error as exc:
            raise DiskError(f"lmdb: write to {self.path!r} failed: {exc}") from exc
        except BackendError:  # closed, or the file cut short (_begin_write's DiskError): nothing begun
            raise
        except Exception as exc:  # a record built in the transaction (aborted) failed: its own failure alone
            log.debug("lmdb: a record of a group of %d jobs failed to build (%r); putting each record alone", len(jobs), exc)
            return self._put_each(jobs)

    def _data_end(self) -> int | None:
        """Where ``data.mdb`` ends now, where its map is known (``None``: not known)."""
        reader = self._reader
        guard = reader.guard if reader is not None and reader.map_base is not None else None
        try:
            return None if guard is None else os.lseek(guard.fd, 0, os.SEEK_END)
        except OSError:
            return None

    def _map_appended(self, start: int | None, end: int | None) -> None:
        """Map the pages a commit appended to ``data.mdb`` from ``start`` to ``end`` (see the
        module doc)."""
        base = self._reader.map_base if self._reader is not None else None
        if start is not None and end is not None and base is not None and 0 < end - start < MAP_BELOW_BYTES and self.format.block_bytes >= MAP_AFTER_BYTES:
            map_pages(base + start, end - start)

    def _sync_jobs(self, sizes: list[list[int | None]]) -> None:
        """Durable: one ``env.sync`` after a group's commit, for its meta page (``metasync``
        is off), outside the write lock: the next group's transaction goes on meanwhile, as a
        raw writer's would (LMDB never overwrites the pages of the last two meta pages'
        transactions, and a commit's data sync comes before its meta page, so the meta page on
        disk always points at synced data). The group's writes return once it is done."""
        if self.sync_mode != "durable" or not any(map(any, sizes)):  # (a size is None or > 0)
            return
        with self._sync_lock:
            env = self._env
            if env is None:
                raise BackendError(f"lmdb: {self.path!r} was closed before the write was synced")
            try:
                env.sync(True)
            except lmdb.Error as exc:
                raise DiskError(f"lmdb: sync of {self.path!r} failed: {exc}") from exc

    def _put_together(self, jobs: list[list[Record]]) -> list[list[int | None]]:
        sizes: list[list[int | None]] = []
        blocks, index, pages, join_max = self._blocks, self._index, self._pages, lmdb_entries.JOIN_MAX
        length, stored, entry = -1, 0, b""  # the last record length, its stored bytes and entry's start
        stamp: float | None = None  # taken for the first split record (a joined one has no entry)
        # What makes UNSUMMED heads (a plain store's, whose PlainReads the open kept): a joined
        # record's builder is called here directly, one Python call fewer a record.
        plain, joined = self._plain_records, xxcopy.xxh3_joined
        plain_head = plain.head if plain is not None else b""
        # (blocks the transaction's default database: a put names none; buffers: a get gives the
        # put's copy, not a bytes of it)
        with self._begin_write(blocks, True) as txn:
            put, delete, get = txn.put, txn.delete, txn.get
            indexed = self._splits  # a joined save deletes the key's entry while it may be split
            for job in jobs:
                job_sizes: list[int | None] = []
                for key, head, payload in job:
                    if len(head) + len(payload) != length:  # (a job's records are mostly of one length)
                        length = len(head) + len(payload)
                        stored = pages(length)
                        entry = b""
                    if length <= join_max:
                        if head is UNSUMMED:  # a plain record, built whole just before its put (PlainReads.joined)
                            put(key, joined(plain_head, key, payload))
                        else:
                            put(key, head + payload if head else payload)
                        if indexed:
                            delete(key, db=index)
                    else:
                        if not entry:
                            if stamp is None:
                                stamp = time.time()
                            entry = index_entry(stamp, stored)
                        put(key, payload, db=blocks)
                        if head is UNSUMMED:  # a plain record: its checksum from the copy just put
                            if plain is None:
                                plain = self._plain()
                            head = plain.summed(key, get(key))
                        put(key, entry + head, db=index)
                        indexed = self._splits = True
                    job_sizes.append(stored)
                sizes.append(job_sizes)
        return sizes

    def _put_each(self, jobs: list[list[Record]]) -> list[list[int | None]]:
        """One transaction per record; a put that fails is that key's failure alone."""
        bumped = False
        sizes: list[list[int | None]] = []
        for job in jobs:
            job_sizes: list[int | None] = []
            for key, head, payload in job:
                stored = self._pages(len(head) + len(payload))
                try:
                    try:
                        self._put(key, head, payload, stored)
                    except lmdb.MapFullError:
                        if bumped:
                            raise
                        # Pages freed by the latest transaction (the manager's eviction) become
                        # reusable only to a transaction after the next one: commit a tiny one,
                        # then retry this key once.
                        bumped = True
                        self._bump_txnid()
                        self._put(key, head, payload, stored)
                except _PUT_FAILED as exc:
                    log.debug("lmdb: write of %s… failed: %s", key.hex()[:16], exc)
                    counts_add(self.counters, "write_failures", 1)
                    job_sizes.append(None)
                    continue
                except lmdb.Error as exc:
                    raise DiskError(f"lmdb: write to {self.path!r} failed: {exc}") from exc
                except BackendError:  # closed, or the file cut short (_begin_write's DiskError)
                    raise
                except Exception as exc:  # its record failed to build in the transaction (aborted)
                    log.warning("lmdb: record of %s… not built: %r", key.hex()[:16], exc)
                    counts_add(self.counters, "write_failures", 1)
                    job_sizes.append(None)
                    continue
                job_sizes.append(stored)
            sizes.append(job_sizes)
        return sizes

    def _encoded(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> EncodedStream[tuple[bytes, torch.Tensor], tuple[bytes, Any]]:
        """Each block's ``(head, payload)``, encoded on a side thread ahead of the puts."""
        return EncodedStream(lambda pair: self._encode_one(*pair), list(zip(keys, blocks)), sizes=[b.numel() for b in blocks])

    def _put(self, key: bytes, head: bytes, payload: Any, stored: int) -> None:
        with self._begin_write(None, True) as txn:
            if len(head) + len(payload) <= lmdb_entries.JOIN_MAX:
                value = self._plain().joined(key, payload) if head is UNSUMMED else head + payload if head else payload
                txn.put(key, value, db=self._blocks)
                txn.delete(key, db=self._index)
            else:
                txn.put(key, payload, db=self._blocks)
                if head is UNSUMMED:
                    head = self._plain().summed(key, txn.get(key, db=self._blocks))
                txn.put(key, index_entry(time.time(), stored, head), db=self._index)
                self._splits = True

    def _begin_write(self, db: Any = None, buffers: bool = False) -> lmdb.Transaction:
        """The one way a write transaction of the open store begins (under the write lock, taken
        by the caller, or while the store opens): :meth:`_guarded_env`'s checks, then LMDB's
        begin (``db``: its default database; ``buffers``: python-lmdb's). After its commit, before
        the lock is let go, the caller calls :meth:`_wrote` (once for several transactions under
        one hold of the lock)."""
        return self._guarded_env().begin(db, None, True, buffers)  # type: ignore[call-overload]  # (db, parent, write, buffers): by position

    def _guarded_env(self) -> lmdb.Environment:
        """The environment, for a write transaction about to begin (by :meth:`_begin_write`, or
        by native code that begins its own: it asks this first, and calls :meth:`_wrote` after
        its commit): ``BackendError`` where the store was closed meanwhile; ``DiskError`` where
        ``data.mdb`` is shorter than the file guard holds (a write transaction walks the map's
        pages as a read does, and one past the file's end faults the process:
        :class:`~kvtier.backends.lmdb_records.FileGuard`, one ``lseek``)."""
        env = self._env
        if env is None:
            raise BackendError(f"lmdb: {self.path!r} was closed during the write")
        reader = self._reader
        if reader is not None and reader.guard is not None:
            reader.guard.check()
        return env

    def _wrote(self) -> int | None:
        """After a commit (under the write lock): the file guard takes the file's size now as
        the least it may hold (:meth:`FileGuard.wrote`: one ``lseek``), so that a cut below what
        the commit appended is refused by the next read or write, also where the file stays
        longer than the guard's check before it saw. The size, or ``None`` (not known)."""
        reader = self._reader
        guard = reader.guard if reader is not None else None
        return None if guard is None else guard.wrote()

    def _plain(self) -> PlainReads:
        """The :class:`PlainReads` of this store (what makes an :data:`UNSUMMED` head)."""
        reader = self._reader
        if reader is None:
            raise BackendError(f"lmdb: {self.path!r} is not open")
        return reader.plain

    def _bump_txnid(self) -> None:
        try:
            with self._begin_write(self._meta) as txn:
                txn.put(_EPOCH_KEY, struct.pack("<d", time.time()))
        except _PUT_FAILED:
            pass  # even this did not fit; the retry will report the key as failed

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        self._env_or_raise()
        check_keys(keys)  # every key before any is deleted
        self._delete(list(keys))

    def _delete(self, keys: list[bytes]) -> None:
        with self._write_lock:
            self._listed = None  # the listing read at open is stale from now on
            deleted = 0
            try:
                with self._begin_write() as txn:
                    for key in keys:
                        deleted += txn.delete(key, db=self._blocks)
                        txn.delete(key, db=self._index)
                self._wrote()  # (a delete's commit appends pages too: the B-trees' copied pages, the freelist's)
            except lmdb.Error as exc:
                raise DiskError(f"lmdb: delete in {self.path!r} failed: {exc}") from exc
            self._count_deleted(deleted)

    def touch_stamps(self, stamps: Sequence[tuple[bytes, float]]) -> None:
        if not stamps:
            return
        self._env_or_raise()
        with self._write_lock:
            try:
                with self._begin_write(self._index, True) as txn:
                    for key, stamp in stamps:
                        value = txn.get(key)
                        if value is not None:
                            txn.put(key, restamp(value, float(stamp)))
                            continue
                        # A joined record (no entry) gains a whole one; a deleted block gains none.
                        record = txn.get(key, db=self._blocks)
                        if record is not None:
                            txn.put(key, INDEX.pack(float(stamp), self._pages(len(record))))
                self._wrote()
            except (lmdb.Error, ValueError) as exc:
                # Advisory (eviction order only): never fail a close over them.
                log.warning("lmdb: access stamps of %r not persisted: %s", self.path, exc)
