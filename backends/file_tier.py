"""``file``: a persistent tier with one file per block, for local or shared POSIX filesystems.

Layout under the root ``path``::

    kvtier-meta.kvm                     the store's meta record (format version, namespace, layout)
    abcd…(64 hex digits).kvb            one record (kvtier.records.format format) per key: ``flat``
    ab/cd/abcd…(64 hex digits).kvb      the same, in the ``sharded`` layout

The layout is the store's, named in its meta record when the store is made (``layout``, default
``flat`` for a new store; a store whose meta record names none is ``sharded``, as every store was
before layouts were named). ``flat`` puts a job's records in one directory, so a job syncs one
directory: the fastest durable saves measured here (``docs/tiers.md``). ``sharded`` keeps each
directory small, for filesystems that handle huge directories badly.

Contract and choices:

* File names are the hex digest of the 32-byte key, so no key can name a path outside the root.
  The root is resolved to its real path, created ``0700``, and refused if another user owns it.
  Every record is reached from the root one directory at a time with ``O_NOFOLLOW`` (``openat``
  through directory descriptors), so a symlinked shard directory or record is never followed:
  nothing is read, written or deleted outside the root. New shard directories are fsync'ed into
  their parent (durable mode). In the sharded layout the first level (``00`` … ``ff``) is made at
  open, and a shard directory a write has reached is opened again in one ``openat2``
  (:mod:`kvtier.backends.file_root`).
* Writes are atomic: the record goes to ``<name>.<pid>.<n>.tmp`` (``O_EXCL``), is fdatasync'ed
  (``sync_mode="durable"``), renamed over the final name, and each touched directory is fsync'ed
  once per job. A crash leaves at most a temp file, never a torn ``.kvb``. Temp files older than
  ``STALE_TEMP_SECONDS`` are swept at open; younger ones may belong to a live writer on a shared
  filesystem and are left alone. ``sync_mode="fast"`` skips the syncs: a power loss may lose
  recent blocks, a process crash loses nothing, and checksums keep torn data from being served.
* Several instances (processes, hosts) may share one directory: a read looks the file up by name,
  so a block written by another instance is served even if this one never listed it. Capacity is
  enforced per instance over the blocks it knows (listed at open or written since). With
  ``shared=True`` the manager's index follows the other instances live: each job's writes and
  deletes are published to a change feed in ``<path>/kvtier-feed``
  (:mod:`kvtier.backends.file_feed`), a :class:`~kvtier.backends.feed_follower.TierFollower`
  applies the others' entries, and a sweep of the directory every ``sweep_interval_s`` is the
  backstop; an eviction forgets records (``forget_blocks``) instead of deleting them.
* Reads ``pread`` the header, check it, then ``preadv`` the payload straight into the caller's
  tensor (one copy; measured faster than aiofiles, see ``docs/tiers.md``); in a job of 1 MiB or
  more a side thread checks each row while the next one is read (:mod:`kvtier.records.checks`). A
  bad record is deleted (if it is still the same inode), counted, and reported as a miss.
* Access stamps are kept as the files' mtime (``touch_stamps`` sets it), so the listing at open
  (``scan_columns``, or ``scan()``) restores the eviction order after a restart; after a clean close
  that listing comes from the table of records the close saved, without a ``stat`` per record,
  when the table names exactly the records there (:mod:`kvtier.backends.file_table`). An untouched file's stamp is its write time (``time.time()``).
* A store whose meta record names another namespace is refused at open (``ConfigError``); an
  unreadable meta record (bad checksum, truncated, or an unknown meta version) is moved aside
  with a warning and rewritten, as the ``lmdb`` tier moves a damaged environment aside.

Offline access (``kvtier inspect`` / ``kvtier verify``, see :mod:`kvtier.tools`) goes through the
classmethods (:mod:`kvtier.backends.file_tree`) ``is_store_dir``, ``read_store_meta``, ``count_raw_records``, ``iter_raw_records`` and
``delete_raw_records``: they need no ``BlockFormat`` or capacity, create nothing, sweep no temp
file, and only the deletion writes (it unlinks the named records).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from kvtier.backends.feed_follower import FollowedTier
from kvtier.backends.file_feed import FileFeed
from kvtier.backends.file_known import KnownRecords
from kvtier.backends.file_reads import BeneathRoot, PlainReads
from kvtier.backends.file_root import ShardDirs, asked_layout, establish_meta
from kvtier.backends.file_saves import FileSaves
from kvtier.backends.file_table import TABLE_NAME, open_listing, save_table
from kvtier.backends.file_tree import _RECORD_READ, FLAT, STALE_TEMP_SECONDS, FileTree
from kvtier.backends.lmdb_plain import RowViews
from kvtier.backends.tag_log import DirectoryTags

from kvtier.backend import BlockFormat, RecordInfo
from kvtier.bulk import RecordColumns, paused_gc
from kvtier.errors import ConfigError, CorruptBlockError, DiskError
from kvtier.keys import check_keys
from kvtier.pool_rows import refusing_reads
from kvtier.records import xxcopy
from kvtier.records.checks import RawPayload, fill_and_check
from kvtier.records.codec import Codec, NoneCodec, UnsupportedRecordError, codec_for_id
from kvtier.records.format import (
    DEFAULT_MAC_ALGORITHM,
    HEAD_MAX,
    RecordHeader,
    parse_header,
    verify_payload,
)
from kvtier.records.mac import RecordMac

__all__ = ["FileBackend", "STALE_TEMP_SECONDS"]

log = logging.getLogger(__name__)

_FS_BLOCK = 4096  # stored sizes are rounded to the usual filesystem block
#: Plain records are read in one pass (:mod:`kvtier.backends.file_reads`); ``False``: every
#: record by the general read (for tests and measurement).
PLAIN_READS = True


def _stored_bytes(record_bytes: Any) -> Any:
    """Bytes a record of ``record_bytes`` (an ``int``, or an array of them) takes on disk."""
    return -(-record_bytes // _FS_BLOCK) * _FS_BLOCK


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    filled = 0
    while filled < len(view):
        n = os.preadv(fd, [view[filled:]], offset + filled)
        if n <= 0:
            raise CorruptBlockError(f"record truncated: {filled} of {len(view)} payload bytes")
        filled += n


def _read_head(fd: int, out: memoryview, mac: RecordMac | None) -> tuple[bytes, RecordHeader]:
    """The record's head (header, and the tag of a keyed record), parsed and checked against
    the file's size before anything is allocated."""
    available = os.fstat(fd).st_size
    head = os.pread(fd, HEAD_MAX, 0)
    return head, parse_header(head, raw_length=len(out), available=available, mac=mac)


def _read_compressed(fd: int, key: bytes, head: bytes, header: RecordHeader, out: memoryview, mac: RecordMac | None) -> None:
    payload = bytearray(header.stored_length)  # <= raw length, checked by parse_header
    _read_exact(fd, memoryview(payload), header.payload_offset)
    verify_payload(key, head, header, payload, mac=mac)
    codec_for_id(header.codec_id).decode_into(memoryview(payload), out, header.itemsize)


def _settle(dst: torch.Tensor, staging: torch.Tensor | None) -> bool:
    """Copy a row read into host staging to its destination; ``True`` (a hit)."""
    if staging is not None:
        dst.copy_(staging)
    return True


class FileBackend(FollowedTier, FileTree, DirectoryTags, FileSaves):
    """One record file per block under ``path``, at most ``capacity`` bytes (this instance's view)."""

    name: ClassVar[str] = "file"
    takes_pool_rows: ClassVar[bool] = True  # every path reads rows by len, iteration and indexing (tests/test_tier_rows.py)
    path_meaning: ClassVar[str] = "a root directory"

    def __init__(
        self,
        *,
        capacity: int | str,
        path: str | os.PathLike[str] | None = None,
        codec: str | dict[str, Any] | Codec | None = "none",
        sync_mode: Literal["durable", "fast"] = "durable",
        mac_key: bytes | str | None = None,
        mac_key_env: str | None = None,
        mac_algorithm: str = DEFAULT_MAC_ALGORITHM,
        shared: bool = False,
        sweep_interval_s: float = 60.0,
        layout: Literal["flat", "sharded"] | None = None,
    ) -> None:
        super().__init__(capacity=capacity, path=path, codec=codec, sync_mode=sync_mode, mac_key=mac_key, mac_key_env=mac_key_env, mac_algorithm=mac_algorithm)
        if not isinstance(shared, bool):
            raise ConfigError(f"shared: expected true or false, got {shared!r}")
        if isinstance(sweep_interval_s, bool) or not isinstance(sweep_interval_s, (int, float)) or sweep_interval_s <= 0:
            raise ConfigError(f"sweep_interval_s: expected a positive number of seconds, got {sweep_interval_s!r}")
        #: Engines on other hosts use this directory too: the index follows them (a change feed
        #: in ``<path>/kvtier-feed`` and a sweep every ``sweep_interval_s``), and this engine's evictions
        #: forget records without deleting them (see ``docs/tiers.md``, "Shared tiers").
        self.shared = shared
        self.sweep_interval_s = float(sweep_interval_s)
        #: The layout asked for (``None``: the store's own, ``flat`` if new); ``store_layout``: the store's.
        self.layout = asked_layout(layout)
        self.store_layout: str = layout or FLAT
        self._root = ""
        self._lock = threading.Lock()
        self._sizes = KnownRecords()  # the records this instance knows and their stored sizes
        self._used = 0
        self._listed: RecordColumns | None = None
        self._tmp_counter = itertools.count()
        self._beneath: BeneathRoot | None = None  # the root's descriptor
        self._plain: PlainReads | None = None  # the one-pass reads (unkeyed stores)
        self._views: RowViews | None = None  # the rows' views of unkeyed jobs, checked and kept by address
        self._shards: ShardDirs | None = None  # the shard directories, for writes

    # -- lifecycle -----------------------------------------------------------------------------
    async def open(self, fmt: BlockFormat) -> None:
        await super().open(fmt)
        await asyncio.to_thread(self._open_root, fmt)

    def _open_root(self, fmt: BlockFormat) -> None:
        try:
            self._open_steps(fmt)
        except BaseException:  # the store closes only the tiers that opened: let go of all now
            self._let_go()
            raise

    def _open_steps(self, fmt: BlockFormat) -> None:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ConfigError(f"path: {self.path!r} exists and is not a directory; a file tier needs a directory of its own")
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            self._root = os.path.realpath(self.path)
            owner = os.stat(self._root).st_uid
            if hasattr(os, "geteuid") and owner != os.geteuid():
                raise ConfigError(
                    f"path: the file tier root {self._root!r} belongs to uid {owner}, not to this process (uid "
                    f"{os.geteuid()}); another user could plant or swap records there. Use a directory of your own"
                )
            self.store_layout = establish_meta(self._root, fmt, self.mac, self._temp_name, log.warning, layout=self.layout)
            if self.shared:  # the feed's head is noted before the listing, so nothing falls between
                self._start_following(
                    f"file {self._root}", sweep=self._sweep_keys, record_bytes=self.reserve_bytes(),
                    feed=FileFeed(self._root), sweep_interval_s=self.sweep_interval_s,
                )
            with paused_gc():  # a clean close's table of records, else a stat per record (not shared: others write)
                names = functools.partial(self._record_key_batches, self._root, sweep_now=time.time(), layout=self.store_layout)
                walk = functools.partial(self._walk, sweep=True)
                self._listed = listed = open_listing(self._root, self._sizes, walk=walk, names=names, table=not self.shared)
            self._beneath = BeneathRoot(self._root)
            if self.mac is None:
                self._views = RowViews(fmt.block_bytes)
                self._plain = PlainReads(self._beneath, flat=self.store_layout == FLAT, block_bytes=fmt.block_bytes, dtype_code=self._dtype_code(), views=self._views.views, counters=self.counters)
            self._shards = ShardDirs(self._root, self._beneath, durable=self.sync_mode == "durable", layout=self.store_layout)
            self._shards.make_top()
        except OSError as exc:
            raise DiskError(f"file: cannot open the store at {self.path!r}: {exc}") from exc
        self._used = int(listed.stored.sum())
        free = shutil.disk_usage(self._root).free
        if free + self._used < self.capacity_bytes:
            message = (
                f"file: capacity {self.capacity_bytes} bytes exceeds what {self._root!r} can hold "
                f"({free} bytes free + {self._used} in use); writes will fail once the disk is full"
            )
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    async def aclose(self) -> None:
        await super().aclose()
        if self.follower is not None:
            await asyncio.to_thread(self._stop_following)
        elif self._beneath is not None and not self.shared:  # opened: the table of records for the next open
            temp = self._temp_name(os.path.join(self._root, TABLE_NAME))
            await asyncio.to_thread(save_table, self._root, self._sizes, self._lock, layout=self.store_layout, durable=self.sync_mode == "durable", temp=temp)
        self._let_go()

    def _let_go(self) -> None:
        """Release what an open took: the following of a shared directory, the listed keys'
        table (its descriptor), the root's descriptor."""
        if self.follower is not None:
            self._stop_following()
        with self._lock:
            self._sizes.clear()
            self._listed = None
            self._plain = None
            beneath, self._beneath = self._beneath, None
        if beneath is not None:
            beneath.close()

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if self.shared:
            data.update(shared=True, sweep_interval_s=self.sweep_interval_s)
        if self.layout is not None:
            data["layout"] = self.layout
        return data

    def _temp_name(self, path: str) -> str:
        return f"{path}.{os.getpid()}.{next(self._tmp_counter)}.tmp"

    # -- paths ---------------------------------------------------------------------------------
    def _path(self, key: bytes) -> str:
        """The record's path, for messages (I/O goes through :meth:`_leaf`, never this string)."""
        return self._record_path(self._root, key, self.store_layout)

    def _leaf(self, key: bytes) -> tuple[int, str] | None:
        """``(fd of the key's directory, file name)`` in the store's layout, the directory reached
        from the root one level at a time with ``O_NOFOLLOW`` (a symlinked shard directory is never
        followed, so nothing lands outside the root); ``None`` if it does not exist."""
        return self._leaf_at(self._root, key, layout=self.store_layout)

    _stored = staticmethod(_stored_bytes)

    def reserve_bytes(self) -> int:
        return self._stored(self._head_bytes() + self.format.block_bytes)

    @refusing_reads  # (rows a tier cannot hold, such as a sparse pool's, fail the job by name)
    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        """A flat job into rows seen before in one native call (``xxcopy.xxh3_read_job``, which holds collection off itself); else :meth:`_read_held`."""
        if (plain := self._plain) is not None and PLAIN_READS and (parts := plain.job_parts) is not None and not self._closed and (read := xxcopy.xxh3_read_job) is not None:
            if type(got := read(parts, keys, out)) is list:  # every record read or absent, and counted
                if self.follower is not None:
                    self._followed_reads(keys, got)
                return got  # type: ignore[no-any-return]
            return self._read_held(keys, out, plain, got, False)  # (None: the job not taken)
        return self._read_held(keys, out, plain, None, plain is not None and PLAIN_READS)

    @xxcopy.holding_rows  # no collection from the first row's view taken in Python to the last read
    def _read_held(self, keys: Sequence[bytes], out: Sequence[torch.Tensor], plain: PlainReads | None, got: Any, straight: bool) -> list[bool]:
        """Plain records (no MAC) in one pass (``PlainReads``: first, where ``straight``, a job of one in a straight line, else the flat rows' one call),
        the rest by :meth:`_read_each`, after what the native job left (``got``); a failure is a miss for its key alone, a bad record deleted."""
        if straight and plain is not None and len(keys) == 1 and len(out) == 1 and (hit := plain.read_one(keys[0], out[0], self.counters)) is not None:
            if self.follower is not None:
                self._followed_reads(keys, [hit])
            return [hit]
        got = plain.read_rows(keys, out) if straight and plain is not None and not self._closed else got  # (found, the positions left to the general read)
        if got is not None:
            found, rest = got
            size = self.format.block_bytes
        else:  # the job's checks and its rows' views in one loop (a pool's memory held), then the plain reads
            rows = views.of(keys, out) if (views := self._views) is not None else None  # (rows of one pool: they hold its memory)
            size = self._check_io(keys, out) if rows is None else self._check_open().block_bytes
            found = [False] * len(keys)
            if plain is not None and PLAIN_READS and (plain.flat or plain.root.usable):
                rest = plain.read(keys, out, found, rows)
            else:
                rest = list(range(len(keys)))
        corrupt = self._read_each(keys, out, rest, found) if rest else 0
        self._count_reads(found, size, corrupt=corrupt)
        if self.follower is not None:
            self._followed_reads(keys, found)
        return found

    def _read_each(self, keys: Sequence[bytes], out: Sequence[torch.Tensor], which: Sequence[int], found: list[bool]) -> int:
        """Read the records at ``which`` into their rows, setting ``found``; how many were
        corrupt. Each record's header is read and checked first; raw payloads are then read
        straight into their rows, a side thread checking each row while the next one is read
        (:func:`~kvtier.records.checks.fill_and_check`); compressed ones are read, checked and
        decoded one by one. Counted among the root's reads, so a close waits for it: its
        records are opened by the root's path, which a store opened since may hold; once the
        tier is closed, every record is a miss, and so is every record after the close began,
        the one whose walk it began during too (one that outlived the close's wait would be
        opened where a store may be since)."""
        beneath = self._beneath
        if beneath is None or not beneath.enter():
            return 0
        try:
            return self._read_counted(keys, out, which, found, beneath)
        finally:
            beneath.leave()

    def _read_counted(self, keys: Sequence[bytes], out: Sequence[torch.Tensor], which: Sequence[int], found: list[bool], beneath: BeneathRoot) -> int:
        corrupt = 0
        handles: list[tuple[int, str, int]] = []
        raw: list[RawPayload] = []
        raw_at: list[tuple[int, tuple[int, str, int], torch.Tensor | None]] = []
        fds: dict[int, int] = {}
        try:
            for i in which:
                if beneath.fd < 0:  # the close began
                    break
                key, dst = keys[i], out[i]
                handle = self._open_record(key)
                if handle is None:
                    continue
                handles.append(handle)
                if beneath.fd < 0:  # the close began during the walk: the record may be a store's opened since
                    break
                view, staging = self._host_view(dst)
                try:
                    head, header = _read_head(handle[2], view, self.mac)
                    if header.codec_id == NoneCodec.codec_id:
                        item = RawPayload(key, head, header, None, view)
                        fds[id(item)] = handle[2]
                        raw.append(item)
                        raw_at.append((i, handle, staging))
                        continue
                    _read_compressed(handle[2], key, head, header, view, self.mac)
                except (CorruptBlockError, OSError) as exc:
                    corrupt += self._refuse(key, handle, exc)
                    continue
                found[i] = _settle(dst, staging)

            def fill(item: RawPayload) -> None:
                _read_exact(fds[id(item)], item.out, item.header.payload_offset)

            for (i, handle, staging), error in zip(raw_at, fill_and_check(raw, fill, self.mac)):
                if error is None:
                    found[i] = _settle(out[i], staging)
                else:
                    corrupt += self._refuse(keys[i], handle, error)
        finally:
            for dir_fd, _name, fd in handles:
                os.close(fd)
                os.close(dir_fd)
        return corrupt

    def _open_record(self, key: bytes) -> tuple[int, str, int] | None:
        """``(directory fd, name, record fd)`` of ``key``'s record, or ``None`` (absent, or a
        symlink where a directory or record should be: logged)."""
        try:
            leaf = self._leaf(key)
            if leaf is None:
                return None
            dir_fd, name = leaf
            try:
                return dir_fd, name, os.open(name, _RECORD_READ, dir_fd=dir_fd)
            except BaseException:
                os.close(dir_fd)
                raise
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP/ENOTDIR
            log.warning("file: cannot open %s: %s", self._path(key), exc)
            return None

    def _refuse(self, key: bytes, handle: tuple[int, str, int], exc: Exception) -> int:
        """Log a record that could not be served and drop it if it is bad; 1 if it was corrupt."""
        path = self._path(key)
        dir_fd, name, fd = handle
        if isinstance(exc, UnsupportedRecordError):
            # Another format, codec or secret: a miss, kept for a reader that has it (lmdb_layout).
            log.warning("file: %s cannot be read by this build (%s); a miss, kept", path, exc)
            return 0
        if isinstance(exc, CorruptBlockError):
            log.warning("file: corrupt record %s (%s); deleting it", path, exc)
            self._drop(key, dir_fd, name, fd)
            self._count_auth(exc)
            return 1
        log.warning("file: cannot read %s: %s", path, exc)
        return 0

    def _drop(self, key: bytes, dir_fd: int, name: str, fd: int) -> None:
        """Delete a bad record, unless another instance has replaced the file since we opened it."""
        try:
            if os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(name, dir_fd=dir_fd)
                self._forget(key)
                self._count_deleted(1)
                if self.follower is not None:
                    self._followed_deletes([key])
        except OSError:
            pass

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._used -= self._sizes.pop(key, 0)

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        """Counted among the root's jobs (a close waits for it): records are reached by the
        root's path, where a store opened since may be."""
        self._check_open()
        check_keys(keys)  # every key before any is deleted
        beneath = self._beneath
        if beneath is None or not beneath.enter():
            self._check_open()
            return
        try:
            self._delete_counted(keys, beneath)
        finally:
            beneath.leave()

    def _delete_counted(self, keys: Sequence[bytes], beneath: BeneathRoot) -> None:
        """Each record's directory is checked again once reached: a delete that outlived the
        close's wait must not unlink a record of a store opened at the path since."""
        gone = []
        for key in keys:
            removed = self._unlink_record(self._root, key, self.store_layout, beneath.is_open)
            self._forget(key)
            if removed:
                gone.append(key)
        self._count_deleted(len(gone))
        if self.follower is not None:
            self._followed_deletes(gone)

    def forget_blocks(self, keys: Sequence[bytes]) -> None:
        """Drop ``keys`` from this instance's accounting and leave their records in place: what
        an eviction does in a shared directory, where other engines may serve them."""
        for key in keys:
            self._forget(key)

    def scan_columns(self) -> RecordColumns | None:
        """The records listed at open, as columns (:class:`kvtier.bulk.RecordColumns`), once;
        then ``None``."""
        self._check_open()
        listed, self._listed = self._listed, None
        if listed is not None and self.follower is not None:
            self.follower.note_listed(len(listed))
        return listed

    def scan(self) -> Iterator[RecordInfo]:
        listed = self.scan_columns()  # the walk done at open, used once
        if listed is None:
            try:
                listed = self._walk(sweep=False)
            except OSError as exc:
                raise DiskError(f"file: cannot list {self._root!r}: {exc}") from exc
            self._check_open()  # closed during the walk by the root's path: it may have listed a store opened since
            if self.follower is not None:
                self.follower.note_listed(len(listed))
        return (RecordInfo(key, stored, stamp) for key, stored, stamp in listed)

    def _sweep_keys(self) -> set[bytes] | None:
        """Every record's key in the directory now (the shared index's sweep); ``None`` when it
        cannot be listed, or once the close has begun (checked again after the walk)."""
        if self._closed:
            return None
        try:
            found = {bytes.fromhex(e.name[:64]) for _, entries in self._leaf_entries(self._root, ordered=False, layout=self.store_layout) for e in entries}
        except OSError as exc:
            log.warning("file: cannot list %s for the shared index: %s", self._root, exc)
            return None
        return None if self._closed else found  # closed during the walk: the path may lead to a store opened since

    def _walk(self, *, sweep: bool) -> RecordColumns:
        """Every record's key, stored size and stamp (a ``stat`` per record, no open)."""
        keys, sizes, stamps = self._record_columns(self._root, sweep_now=time.time() if sweep else None, layout=self.store_layout)
        return RecordColumns(keys, self._stored(np.asarray(sizes, dtype=np.int64)), np.asarray(stamps, dtype=np.float64))

    def touch_stamps(self, stamps: Sequence[tuple[bytes, float]]) -> None:
        """Each record's mtime set by the root's path; once the close has begun (checked after
        each walk), no further one: the path may lead to a store opened there since."""
        self._check_open()
        beneath = self._beneath
        for key, stamp in stamps:
            try:
                leaf = self._leaf(key)
                if leaf is None:
                    continue
                try:
                    if beneath is None or not beneath.is_open():
                        return
                    os.utime(leaf[1], (float(stamp), float(stamp)), dir_fd=leaf[0], follow_symlinks=False)
                    with self._lock:
                        self._sizes.touch(key, float(stamp))
                finally:
                    os.close(leaf[0])
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.debug("file: stamp of %s… not persisted: %s", key.hex()[:16], exc)

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        data.update(path=self.path, used_bytes=self._used, known_blocks=len(self._sizes))
        if self.follower is not None:
            data["follow"] = self.follower.stats()
        return data
