"""``lmdb``: a persistent tier in one LMDB environment.

Layout: three named databases in the environment at ``path``:

* ``blocks``: key -> the record (joined: records of up to 64 KiB, head and payload in one value, one
  B-tree put per save and one lookup per load) or its payload (split: larger ones),
* ``index``:  key -> ``<d Q`` (last-access stamp, stored bytes) + the record's head
  (:mod:`kvtier.records.format` header [+ tag]) of a split record, written in the same transaction
  as the payload, so a large save puts the caller's block as it is, with no staging copy; a joined
  record has an entry (stamp and size: then it is a whole record) only once ``touch_stamps`` gave it
  one. ``scan()`` rebuilds the manager's index from both without touching any value's page
  (:mod:`kvtier.backends.lmdb_layout`, which also reads stores written by earlier code),
* ``meta``:   the store's meta record (format version, namespace); a store written for another
  namespace is refused at open with a ``ConfigError``.

Contract and choices:

* ``map_size`` is the tier's capacity and is never grown. A put that does not fit (``MapFullError``)
  makes that key's write return ``None`` and counts a write failure; nothing stored earlier is
  touched. The manager owns eviction and retries.
* ``sync_mode="durable"`` (default): ``sync=True, metasync=False`` and an ``env.sync()`` after every
  commit, so a block is on stable storage before its write returns. ``sync_mode="fast"``: no syncs;
  a power loss may lose recently written blocks (a process crash loses nothing), and the record
  checksum still keeps a torn record from being served.
* Group commit (:mod:`kvtier.backends.group_commit`): a job's records go in one write transaction,
  and jobs whose writers wait together (concurrent ``write_blocks`` calls) share it and its sync.
  Measured (``benchmarks/bench_disk_sizes.py``, ``docs/tiers.md``, raw python-lmdb, jobs of 16): at
  4-256 KiB one durable commit per value ran 2-13x slower than one per job (1.5-6x at 128-256 KiB on
  a second machine); at 1-2 MiB the lead flips from run to run, and where one value per transaction
  led, the cause was the allocator, not the disk: without ``writemap`` LMDB ``malloc``s each large
  value's pages and frees them at the commit, and glibc hands the top of its heap back to the kernel
  after a commit of 16 such values, so the next one faults 32 MiB in afresh, while one value per
  transaction reuses one chunk. Before its first commit of a larger size the tier has glibc keep
  that much freed heap (:mod:`kvtier.backends.lmdb_heap`: glibc's own dynamic threshold, raised as
  freeing any large buffer raises it; never ``mallopt``, which stays the engine's), and one
  transaction per job then leads at 2 MiB too. So there is no size threshold (``docs/tiers.md``). A
  transaction that hits a full map is aborted and its records are put one per transaction, so the
  failure stays confined to the keys that do not fit.
* Never ``writemap`` (a stray write through the map would corrupt the file); ``readahead`` on
  (values are read whole: with it off a cold map faults in one page at a time, 20x slower);
  ``reader_check()`` at open clears slots of dead readers.
* The environment is opened in ``open()``, in the process that uses it, never across ``fork``.
* Threads: ``write_blocks``/``delete_blocks``/``touch_stamps`` (:mod:`kvtier.backends.lmdb_writes`)
  and the deletion of corrupt records found by ``read_blocks`` serialise on one lock; reads use
  their own read transaction, copy straight from the map into the caller's tensor, and never hold a
  transaction across an await. A close waits for the reads under way before it unmaps the file (a
  read that starts once it began is refused with ``DiskError``), so a read never copies from an
  unmapped value. A warm job of plain records is read in one pass: lookup, copy into the row, the
  row's checksum, record after record
  (:meth:`~kvtier.backends.lmdb_layout.JobReader.read_in_one_pass`); other jobs' checksums (keyed,
  cold, or large ones while a core is spare) run on a side thread while the job's copies run on the
  calling one (:mod:`kvtier.records.checks`). A job of plain records is encoded in one loop on the
  calling thread (:mod:`kvtier.backends.lmdb_plain`); a split one's checksum is taken from the copy
  its put made, in the write transaction.
* Damage is never a crash (:mod:`kvtier.backends.lmdb_files`). Before LMDB maps ``data.mdb``, its
  meta pages are read with ``pread`` and checked against the file's size, and every branch and leaf
  page of its B-trees is checked as LMDB will walk it (LMDB aborts on a page it cannot walk), a
  level at a time (:mod:`kvtier.backends.lmdb_scan`, which also lists the records; a refused page is
  named by :mod:`kvtier.backends.lmdb_pages`). Any damage found (a truncated file, a bad page, an
  unreadable meta record) moves the environment to ``<path>/damaged-<UTC time>/`` (kept for ``kvtier
  verify``, with a ``REASON`` file) and starts a fresh one, into which the records that still pass
  their check are salvaged (:mod:`kvtier.backends.lmdb_salvage`), with a warning. A meta record of a
  newer version is no damage: a newer kvtier's store, refused at open (``ConfigError``) and left as
  it is. A damaged store whose meta record refuses this tier (another namespace, keyed where the
  tier has no secret, a newer kvtier's) is refused the same and left where it is, for a tier that
  can read and salvage it. A job is not read from a file cut short under the open store
  (:mod:`kvtier.backends.lmdb_records`), and any LMDB error on one key is a miss for that key. Only a
  failed check deletes: a bad record, or a lookup that met a damaged page (``CorruptedError``,
  ``PageNotFoundError``); any other error (``MapResizedError``, reader-slot errors) keeps the record
  for the next read. A record this build cannot read (another record format, a codec not installed,
  keyed where the tier has no secret) is a miss and stays.
* One process per environment: ``open()`` takes an exclusive ``flock`` on ``kvtier.lock`` and a
  second opener (another process, or another instance in this one) gets a ``BackendError`` naming
  the holder's pid. A full filesystem is a ``DiskError`` at open, never a SIGBUS (``lock.mdb`` is
  preallocated). A capacity lowered below what the file holds drops the oldest records, compacts the
  file and logs the counts.

Offline access (``kvtier inspect`` / ``kvtier verify``, see :mod:`kvtier.tools`) goes through the
classmethods (:mod:`kvtier.backends.lmdb_offline`) ``is_store_dir``, ``read_store_meta``,
``count_raw_records``, ``iter_raw_records`` and ``delete_raw_records``: they need no ``BlockFormat``
or capacity, open the environment read-only (only the deletion writes), and never create a file in a
directory that holds no ``data.mdb``."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal

import lmdb
import torch
from kvtier.backends import lmdb_one, lmdb_plain
from kvtier.backends.group_commit import GroupCommit
from kvtier.backends.lmdb_direct import direct_gets, drop_kept
from kvtier.backends.lmdb_files import (
    META_KEY,
    DamagedEnvironment,
    HolderLock,
    check_data_file,
    check_free_space,
    map_base,
    move_aside,
    preallocate_lock_file,
    touched_pages_only,
)
from kvtier.backends.lmdb_layout import ENTRY_SIZES, INDEX, JobReader
from kvtier.backends.lmdb_offline import OfflineLmdb
from kvtier.backends.lmdb_one import StraightRead, forks
from kvtier.backends.lmdb_plain import RowViews
from kvtier.backends.lmdb_records import FileGuard, PlainReads
from kvtier.backends.lmdb_salvage import copy_into, meta_refusal, salvage_records
from kvtier.backends.lmdb_scan import open_listing
from kvtier.backends.lmdb_shrink import LmdbShrink
from kvtier.backends.lmdb_writes import LmdbWrites, Record
from kvtier.backends.tag_log import DirectoryTags

from kvtier.backend import BlockFormat, RecordInfo
from kvtier.bulk import RecordColumns, paused_gc
from kvtier.errors import BackendError, ConfigError, CorruptBlockError, DiskError
from kvtier.pool_rows import refusing_reads
from kvtier.records import xxcopy
from kvtier.records.codec import Codec, UnsupportedRecordError
from kvtier.records.format import DEFAULT_MAC_ALGORITHM, check_meta, decode_meta, encode_meta
from kvtier.records.meta import NewerMetaError
from kvtier.units import format_size

__all__ = ["LmdbBackend"]

log = logging.getLogger(__name__)

# LMDB errors that mean "this file is not a sound environment": move it aside and start afresh.
_CORRUPT = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.PageNotFoundError)
_PAGE_HEADER = 16  # bytes of an LMDB page header before overflow data
#: How long a close waits for the reads under way (:func:`_close_after_reads`).
CLOSE_WAIT_S = 30.0


def _refuse_reads(reader: JobReader | None) -> list[Any] | None:
    """Close ``reader``'s file guard, so that a read starting from now on is refused (a read
    counts itself among the jobs being read before it reads the guard), and return those jobs
    (``None`` without a reader)."""
    if reader is None:
        return None
    if reader.guard is not None:
        reader.guard.close()
    return reader.temperature.jobs


async def _reads_ended(jobs: list[Any] | None) -> None:
    """Wait for ``jobs`` to end, :data:`CLOSE_WAIT_S` at most, with the event loop running."""
    end = time.monotonic() + CLOSE_WAIT_S
    while jobs and time.monotonic() < end:
        await asyncio.sleep(0.001)


def _close_after_reads(env: lmdb.Environment, jobs: list[Any] | None, path: str, direct: object | None = None) -> bool:
    """Close ``env`` once the reads ``jobs`` counted have ended: python-lmdb's ``close`` unmaps the
    file at once, and a read copying from a mapped value with the GIL released (the native
    check-copy) would fault the process. :data:`CLOSE_WAIT_S` at most: a read still running then
    leaves the environment open, its map kept until the process ends (``False``). ``direct``: what
    the direct lookups took (:func:`~kvtier.backends.lmdb_direct.direct_gets`): the read transaction
    they keep is aborted just before the close, none kept after."""
    end = time.monotonic() + CLOSE_WAIT_S
    while jobs and time.monotonic() < end:
        time.sleep(0.001)
    if jobs:
        log.warning("lmdb: %d reads of %r still run after %.3g s at close; its environment is left open", len(jobs), path, CLOSE_WAIT_S)
        return False
    drop_kept(direct)
    env.close()
    return True


#: What every job of an LmdbBackend reads, in slots: 31 in its dict, past the 30 keys CPython 3.11
#: shares, made it a plain dict, no lookup on it specialized (tests/test_lmdb_instance_dict.py).
_JOB_SLOTS = ("_closed", "_env", "_reader", "_straight", "counters", "mac")


class LmdbBackend(OfflineLmdb, DirectoryTags, LmdbShrink, LmdbWrites):
    """Records in an LMDB environment at ``path``, at most ``capacity`` bytes of map."""

    __slots__ = _JOB_SLOTS
    name: ClassVar[str] = "lmdb"
    takes_pool_rows: ClassVar[bool] = True  # every path reads rows by len, iteration and indexing (tests/test_tier_rows.py)
    path_meaning: ClassVar[str] = "a directory for its environment"

    def __init__(
        self,
        *,
        capacity: int | str,
        path: str | os.PathLike[str] | None = None,
        codec: str | dict[str, Any] | Codec | None = "none",
        sync_mode: Literal["durable", "fast"] = "durable",
        max_readers: int = 126,
        mac_key: bytes | str | None = None,
        mac_key_env: str | None = None,
        mac_algorithm: str = DEFAULT_MAC_ALGORITHM,
    ) -> None:
        super().__init__(capacity=capacity, path=path, codec=codec, sync_mode=sync_mode, mac_key=mac_key, mac_key_env=mac_key_env, mac_algorithm=mac_algorithm)
        if isinstance(max_readers, bool) or not isinstance(max_readers, int) or max_readers < 1:
            raise ConfigError(f"max_readers: expected a positive integer, got {max_readers!r}")
        self.max_readers = max_readers
        self._env: lmdb.Environment | None = None
        self._blocks: Any = None
        self._index: Any = None
        self._meta: Any = None
        self._psize = 4096
        self._forks = -1  # the fork count at the open (lmdb_one.forks)
        self._write_lock = threading.Lock()
        self._sync_lock = threading.Lock()  # a commit's sync (run outside the write lock) and the close
        self._holder: HolderLock | None = None
        self._reader: JobReader | None = None
        self._straight: StraightRead | None = None  # warm jobs of an unkeyed store (read_blocks)
        self._direct: object | None = None  # what the straight reads' direct lookups took (lmdb_direct)
        self._listed: list[RecordInfo] | RecordColumns | None = None
        #: Whether the index may hold a split record's entry: a joined save then deletes the
        #: key's entry (lmdb_writes). Set at open from the listing, and by a split save.
        self._splits = False
        self._commits: GroupCommit[list[Record], list[int | None]] = GroupCommit(self._commit_jobs, self._sync_jobs)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data.update(max_readers=self.max_readers)
        return data

    # -- lifecycle -----------------------------------------------------------------------------
    async def open(self, fmt: BlockFormat) -> None:
        await super().open(fmt)
        await asyncio.to_thread(self._open_env, fmt)

    def _open_env(self, fmt: BlockFormat) -> None:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ConfigError(f"path: {self.path!r} exists and is not a directory; an lmdb tier needs a directory of its own")
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"path: cannot create the directory {self.path!r}: {exc.strerror or exc}") from exc
        check_free_space(self.path, self.max_readers)
        holder = HolderLock(self.path)
        holder.acquire()  # BackendError naming the pid of a process that holds the tier already
        try:
            with paused_gc():  # the page walk and the index read build an object per record
                self._open_checked(fmt)
        except BaseException:
            self._close_env()
            holder.release()
            raise
        self._holder = holder
        self._forks = forks()

    def _open_checked(self, fmt: BlockFormat) -> None:
        """Open, and on damage found before or while opening, move the environment aside and
        start a fresh one."""
        try:
            self._try_open(fmt)
        except ConfigError:
            raise
        except lmdb.MemoryError as exc:
            raise ConfigError(
                f"capacity: {format_size(self.capacity_bytes)} cannot be mapped at {self.path!r}: "
                f"LMDB reserves the whole capacity as address space when it opens, and the system refused ({exc}); "
                "lower the capacity"
            ) from exc
        except (DamagedEnvironment, *_CORRUPT, CorruptBlockError) as exc:
            self._close_env()
            # A store that refuses this tier undamaged (keyed, another model's, a newer kvtier's)
            # refuses it damaged too, left in place for a tier that can read and salvage it.
            refused = meta_refusal(self.path, fmt, self.mac, where=f"lmdb {self.path!r} (damaged, and left as it is)")
            if refused is not None:
                raise refused from exc
            moved = move_aside(self.path, f"{type(exc).__name__}: {exc}")
            try:
                self._try_open(fmt)
            except (DamagedEnvironment, lmdb.Error) as again:
                raise DiskError(f"lmdb: cannot start a fresh environment at {self.path!r}: {again}") from again
            message = (
                f"lmdb: the environment at {self.path!r} is damaged ({exc}); moved it to {moved!r} "
                f"(check it with 'kvtier verify {moved}') and started a fresh one; {self._salvage(moved, fmt)}"
            )
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        except lmdb.Error as exc:
            raise DiskError(f"lmdb: cannot open {self.path!r}: {exc}") from exc

    def _try_open(self, fmt: BlockFormat) -> None:
        used = check_data_file(self.path)  # before anything maps the file
        # LMDB aborts the process on a page it cannot walk; the walk (lmdb_scan) also lists the
        # blocks and index databases' leaves, read from their leaf pages alone (see _read_index).
        columns, block_keys, self._splits = open_listing(self.path, ENTRY_SIZES) if used else (None, {}, False)
        preallocate_lock_file(self.path, self.max_readers)
        map_size = self.capacity_bytes
        shrinking = used > map_size
        if shrinking:  # a lowered capacity: open with room to delete the excess, then compact
            map_size = used + used // 10 + 256 * 65536
        env = self._env = self._lmdb_open(map_size)
        # Readahead off while opening: the pages touched here are read alone, not with the
        # device's read-around (see _read_index).
        base = map_base(self.path)
        with touched_pages_only(base, map_size):
            env.reader_check()
            self._psize = int(env.stat()["psize"])
            self._blocks = env.open_db(b"blocks")
            self._index = env.open_db(b"index")
            meta_db = self._meta = env.open_db(b"meta")
            with env.begin(write=True, db=meta_db) as txn:
                stored = txn.get(META_KEY)
                if stored is None:
                    txn.put(META_KEY, encode_meta(fmt, self.mac))
                else:
                    try:
                        meta = decode_meta(stored)
                    except NewerMetaError as exc:  # a newer kvtier's store: never moved aside
                        raise exc.refusal(f"lmdb {self.path!r}") from None
                    except UnsupportedRecordError as exc:
                        raise DamagedEnvironment(f"meta record: {exc}") from exc
                    check_meta(meta, fmt, where=f"lmdb {self.path!r}", mac=self.mac)
            if self.sync_mode == "durable":
                env.sync(True)
            self._reader = JobReader(
                blocks=self._blocks, index=self._index, psize=self._psize, map_base=base, path=self.path, block_bytes=fmt.block_bytes,
                plain=PlainReads(blocks=self._blocks, index=self._index, block_bytes=fmt.block_bytes, dtype_code=self._dtype_code(), head_at=INDEX.size),
                keyed=None if self.mac is None else PlainReads(
                    blocks=self._blocks, index=self._index, block_bytes=fmt.block_bytes, dtype_code=self._dtype_code(), head_at=INDEX.size, mac=self.mac
                ),
                guard=FileGuard(os.path.join(self.path, "data.mdb")), views=RowViews(fmt.block_bytes),
            )
            reader, direct = self._reader, None
            if self.mac is None and reader.views is not None and reader.guard is not None:
                direct = self._direct = direct_gets(env, meta_db, META_KEY, self._blocks, self._index)  # LMDB's own get (and put), where probed sound
                self._straight = StraightRead(reader.plain, reader.views, reader.guard, reader.temperature, self.counters, direct)
            self._ready_writes(direct)
        if columns is None or shrinking:  # (a lowered capacity drops records: from a cursor read)
            columns = self._read_index(env, block_keys if columns is None else None)
        self._listed = columns
        if shrinking:
            self._shrink(fmt, used)

    def _salvage(self, moved: str, fmt: BlockFormat) -> str:
        """Copy the sound records of the damaged environment moved to ``moved`` into the fresh
        one (:mod:`kvtier.backends.lmdb_salvage`: checksums decide); say what it did."""
        env = self._env
        assert env is not None
        kept, refused, why, unchecked = salvage_records(moved, fmt, self.mac, copy_into(self._begin_write, self._blocks, self._index))
        self._wrote()  # (the file guard takes the salvaged file's size)
        if why is not None:
            return f"salvaged no record: {why}"
        if kept and self.sync_mode == "durable":
            env.sync(True)
        self._listed = self._read_index(env)
        kept_as_they_are = (
            f"; {unchecked} this tier cannot check (keyed, and this tier has no mac_key; or another record format) "
            "were copied as they are, misses here, for a tier that can check them"
            if unchecked
            else ""
        )
        return f"salvaged {kept - unchecked} sound records into it ({refused} found damaged or unpaired were dropped){kept_as_they_are}"

    def _lmdb_open(self, map_size: int) -> lmdb.Environment:
        return lmdb.open(
            self.path,
            map_size=map_size,
            subdir=True,
            max_dbs=3,
            max_readers=self.max_readers,
            sync=self.sync_mode == "durable",
            metasync=False,  # the env.sync() at the end of each job writes the meta page
            writemap=False,
            map_async=False,
            # On: a value is 2 MiB read whole, and with readahead off (MADV_RANDOM) a cold map is
            # faulted in one 4 KiB page at a time: 0.02 GB/s measured against 0.4-0.6 with it on,
            # warm loads unchanged (benchmarks/bench_disk.py, lmdb_cold_*).
            readahead=True,
            meminit=False,
            lock=True,
        )

    def _read_index(self, env: lmdb.Environment, block_keys: dict[bytes, bytes] | None = None) -> list[RecordInfo]:
        """Every record the blocks database holds: its stamp from its index entry (a split
        one's stored size too), or, joined (no entry), the time now; whole and joined, its
        value's pages. Notes whether the index holds a split entry (``_splits``). LMDB errors
        propagate: the caller treats them as a damaged environment.

        A cursor walks the blocks database, keys and value lengths, under readahead off: the
        cursor touches each value's first page, and with the device's read-around (8 MiB a
        fault here) those touches read the whole file; with it off, the pages touched alone.
        (An open lists its records from the page walk before ``lmdb.open`` instead,
        :func:`~kvtier.backends.lmdb_scan.open_listing`, and reads no page of any value; this
        runs when that form does not apply, and for a later ``scan()``.)

        The records hold the key objects of ``block_keys`` (the walk's, when given), not
        copies: at a million records, one copy fewer per key is less time and less memory the
        index keeps (the copies freed between kept keys leave the heap fragmented:
        benchmarks/bench_scale.py)."""
        base = self._reader.map_base if self._reader is not None else None
        now, pages, sizes, unpack = time.time(), self._pages, ENTRY_SIZES, INDEX.unpack_from
        records: list[RecordInfo] = []
        append = records.append
        own = block_keys.get if block_keys is not None else None
        splits = False
        with touched_pages_only(base, int(env.info()["map_size"])), env.begin(buffers=True) as txn:
            entries: dict[bytes, tuple[float, int, bool]] = {}
            for index_key, entry in txn.cursor(db=self._index):
                if len(entry) not in sizes:
                    raise DamagedEnvironment(f"index entry is not readable: index entry of {len(entry)} bytes (expected one of {sizes})")
                stamp, stored = unpack(entry, 0)
                split = len(entry) != INDEX.size
                splits |= split
                entries[bytes(index_key)] = (stamp, stored, split)
            find = entries.get
            for block_key, value in txn.cursor(db=self._blocks):
                key = bytes(block_key)
                if own is not None:
                    key = own(key, key)
                found = find(key)
                if found is None:  # joined
                    append(RecordInfo(key, pages(len(value)), now))
                else:  # a split record's size is its entry's; a whole one's, its value's
                    append(RecordInfo(key, found[1] if found[2] else pages(len(value)), found[0]))
        self._splits = splits or self._splits
        return records

    def _close_env(self) -> bool:
        """Close the environment, never under a read (:func:`_close_after_reads`); ``False``
        where a read still ran and it was left open."""
        self._straight = None
        jobs = _refuse_reads(self._reader)
        env, self._env = self._env, None
        direct, self._direct = self._direct, None
        return env is None or _close_after_reads(env, jobs, self.path, direct)

    async def aclose(self) -> None:
        """Close the tier. The reads under way are waited for on the event loop (it keeps
        running meanwhile), then the environment is closed under the write locks. Where a read
        still runs after :data:`CLOSE_WAIT_S` the environment stays open and so does the holder
        lock: the same path opened again in this process is then refused (naming this process),
        never mapped a second time beside the first, which LMDB forbids."""
        await super().aclose()
        self._straight = None
        await _reads_ended(_refuse_reads(self._reader))
        with self._write_lock, self._sync_lock:
            if not self._close_env():
                return
            holder, self._holder = self._holder, None
            if holder is not None:
                holder.release()

    def _env_or_raise(self) -> lmdb.Environment:
        self._check_open()
        env = self._env
        if env is None:
            raise BackendError(f"lmdb: {self.path!r} is not open")
        if self._forks != forks():  # (a fork's count, not os.getpid(): a system call each save)
            raise BackendError("lmdb: the environment was opened in another process; open the backend after fork")
        return env

    # -- capacity ------------------------------------------------------------------------------
    def _pages(self, record_bytes: int) -> int:
        """Bytes of map a record of ``record_bytes`` occupies (values above a page overflow)."""
        psize = self._psize
        return -(-(record_bytes + _PAGE_HEADER) // psize) * psize

    def reserve_bytes(self) -> int:
        return self._pages(self._head_bytes() + self.format.block_bytes)

    def usable_bytes(self) -> int:
        """The map less LMDB's own needs: B-tree and index pages, and freed pages that stay unusable
        until two transactions later. Measured under churn (a job deletes its victims, then puts its
        blocks): with a tenth of the map plus 32 pages held back, no put failed for 16 KiB to 2 MiB
        blocks; with a twentieth, up to 17 % of puts hit a full map. Tiny maps are dominated by the
        fixed pages: below about 40 pages nothing is usable and the store refuses the tier at open
        (``tiers[i].capacity``)."""
        slack = self.capacity_bytes // 10 + 32 * self._psize
        return max(0, self.capacity_bytes - slack)

    # -- bulk I/O --------------------------------------------------------------------------------
    @refusing_reads  # (rows a tier cannot hold, such as a sparse pool's, fail the job by name)
    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        """Copy each record straight from the map into its ``out`` row, checking it meanwhile
        (:class:`~kvtier.backends.lmdb_layout.JobReader`). Every failure is confined to its key and
        is a miss; bad records are deleted, so the manager drops them and nobody is offered them
        again; rows a tier cannot hold (:func:`~kvtier.pool_rows.rows_refused`) fail the job by
        name."""
        straight = self._straight
        if straight is not None and lmdb_one.STRAIGHT_READS and not self._closed:  # (StraightRead; None: the general path's)
            native = lmdb_plain.straight_read  # StraightRead.read in one call where built, no frame; False: its lines
            one = lmdb_one
            found = False if native is None else native(straight.native_parts, self._env, keys, out, one.perf_counter, one.COLD_GET_S, xxcopy.xxh3_check_copy)
            if found is False:
                found = straight.read(self._env, keys, out)
            if found is not None:
                return found
        reader, mac = self._reader, self.mac
        # Unkeyed jobs into host rows: the job's checks and its rows' views in one loop.
        views = reader.views if reader is not None and mac is None else None
        # No collection from the first view to the last copy (rows_hold: a finalizer may free a row); a pool's memory is held by
        # the views of its rows (lmdb_plain.HeldViews: RowViews.of, or host_rows in read_job).
        with xxcopy.rows_held:  # (not rows_hold() then a try: an exception raised between would leave the hold)
            try:
                rows = views.of(keys, out) if views is not None else None
                size = self._check_io(keys, out) if rows is None else views.size  # type: ignore[union-attr]
                env = self._env_or_raise()
                assert reader is not None
                outcome = reader.read_job(env, keys, out, mac, rows)
            except lmdb.Error as exc:  # beginning a read transaction failed: nothing can be read
                raise DiskError(f"lmdb: read from {self.path!r} failed: {exc}") from exc
        if outcome.bad:
            try:
                self._delete(list(outcome.bad))  # after the read transaction: one writer, never nested in a reader
            except DiskError as exc:
                log.warning("lmdb: cannot delete %d bad records from %s: %s", len(outcome.bad), self.path, exc)
        self._count_reads(outcome.found, size, corrupt=outcome.corrupt, auth=outcome.auth)
        return outcome.found

    def scan(self) -> Iterator[RecordInfo]:
        env = self._env_or_raise()
        listed, self._listed = self._listed, None  # read (and checked) at open, used once
        if isinstance(listed, RecordColumns):
            return (RecordInfo(key, stored, stamp) for key, stored, stamp in listed)
        if listed is not None:
            return iter(listed)
        try:
            return iter(self._read_index(env))
        except (lmdb.Error, DamagedEnvironment) as exc:
            raise DiskError(f"lmdb: scan of {self.path!r} failed: {exc}") from exc

    def scan_columns(self) -> RecordColumns | None:
        """The open's listing as columns (``kvtier.bulk``) if read so and not used yet; else
        ``None``."""
        listed = self._listed
        if isinstance(listed, RecordColumns):
            self._listed = None
            return listed
        return None

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        env = self._env
        if env is not None and self.is_open:
            info = env.info()
            data.update(path=self.path, map_size=info["map_size"], used_bytes=(info["last_pgno"] + 1) * self._psize)
        return data
