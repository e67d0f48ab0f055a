"""The file tier's tree: naming rules, symlink-proof access, and offline (read-only) access.

:class:`FileTree` is the base of :class:`~kvtier.backends.file_tier.FileBackend`. It holds what
needs no open backend: the tree walk by the tier's naming rules (``<64 hex>.kvb`` names, regular
files only, in the root itself in the ``flat`` layout, in two levels of 2-hex directories in the
``sharded`` one), reaching a record's directory from the root with
``O_NOFOLLOW`` directory descriptors, unlinking a record without following a symlink, and the
classmethods ``kvtier inspect`` / ``kvtier verify`` use (``is_store_dir``, ``read_store_meta``,
``count_raw_records``, ``iter_raw_records``, ``delete_raw_records``): they need no
``BlockFormat`` or capacity, create nothing, sweep no temp file, and only the deletion writes.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from stat import S_ISREG

import numpy as np

from kvtier.errors import ConfigError, DiskError, InvalidKeyError
from kvtier.records.format import StoreMeta, decode_meta

__all__ = ["FLAT", "LAYOUTS", "SHARDED", "FileTree", "Layout"]

log = logging.getLogger("kvtier.backends.file_tier")

STALE_TEMP_SECONDS = 600.0
FLAT = "flat"  # every record in the root directory: ``<root>/<64 hex>.kvb``
SHARDED = "sharded"  # two levels of shard directories: ``<root>/ab/cd/abcd….kvb``
LAYOUTS = (FLAT, SHARDED)
#: A store's layout; ``None`` where a walk covers both (the offline tools, whatever the meta says).
Layout = str
_SUFFIX = ".kvb"
_META_NAME = "kvtier-meta.kvm"
_HEX2 = frozenset(f"{i:02x}" for i in range(256))  # the names of shard directories
_NAME_LENGTH = 64 + len(_SUFFIX)
_RECORD_NAME = re.compile(r"[0-9a-f]{64}\.kvb").fullmatch
_HEX = re.compile(r"[0-9a-f]*").fullmatch
KEY_BATCH = 2048  # keys per buffer of :meth:`FileTree._record_key_batches`
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: A record is opened for reading with these: no symlink followed, and no wait for a writer
#: where a FIFO stands in its place (anyone who can write the directory can plant one; its read
#: then fails, a miss). ``O_NONBLOCK`` changes nothing for a regular file.
_RECORD_READ = os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC


def _packed_keys(hexes: list[str]) -> bytes:
    """The keys of the record names' hex parts ``hexes`` (64 characters each), packed; a part
    that is not lowercase hex (not a record's name) is left out."""
    joined = "".join(hexes)
    if _HEX(joined) is None:
        joined = "".join(h for h in hexes if _HEX(h) is not None)
    return bytes.fromhex(joined)


class _DirFd:
    """``with _DirFd(name, parent_fd) as d``: ``d.fd``, a descriptor of the directory ``name``
    (in ``parent_fd``; ``None``: a path) opened with ``O_NOFOLLOW | O_DIRECTORY``, or ``-1`` when
    a symlink, a file or nothing stands there (other errors raise); closed on exit."""

    __slots__ = ("fd",)

    def __init__(self, name: str, parent_fd: int | None) -> None:
        try:
            self.fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if parent_fd is None or exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                raise
            self.fd = -1

    def __enter__(self) -> _DirFd:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)


class FileTree:
    """Tree access shared by the live tier and its offline tools."""

    @staticmethod
    def _record_path(root: str, key: bytes, layout: Layout = SHARDED) -> str:
        """``key``'s record path under ``root`` in ``layout``, for messages and bookkeeping (I/O
        goes through :meth:`_leaf_at`, never this string)."""
        if type(key) is not bytes or len(key) != 32:
            raise InvalidKeyError("file: keys must be 32 bytes")
        h = key.hex()
        if layout == FLAT:
            return os.path.join(root, h + _SUFFIX)
        return os.path.join(root, h[0:2], h[2:4], h + _SUFFIX)

    @staticmethod
    def _leaf_at(
        root: str,
        key: bytes,
        *,
        create: bool = False,
        durable: bool = True,
        created: set[str] | None = None,
        layout: Layout = SHARDED,
    ) -> tuple[int, str] | None:
        """``(fd of key's directory, file name)`` in ``layout`` (see ``FileBackend._leaf``): the
        root's in the flat layout, its shard directory's in the sharded one. A directory created
        here is synced into its parent at once (``durable``), or, given ``created``, the parent's
        path is added to it for the caller to sync once for many."""
        if type(key) is not bytes or len(key) != 32:
            raise InvalidKeyError("file: keys must be 32 bytes")
        h = key.hex()
        fd = os.open(root, _DIR_FLAGS)
        try:
            for level, part in enumerate(() if layout == FLAT else (h[0:2], h[2:4])):
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                    try:
                        os.mkdir(part, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    if created is not None:
                        created.add(os.path.join(root, h[0:2]) if level else root)
                    elif durable:
                        os.fsync(fd)  # the new directory's entry in its parent survives a power loss
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd, h + _SUFFIX

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @classmethod
    def _unlink_record(cls, root: str, key: bytes, layout: Layout = SHARDED, still_open: Callable[[], bool] | None = None) -> bool:
        """Unlink ``key``'s record under ``root`` in ``layout``, never through a symlink; ``False``
        if there was none (or a symlink stood in its path, which is logged and left alone).
        ``still_open``: asked once the record's directory is reached by the path; ``False`` (the
        store was closed meanwhile, and another may be open at ``root`` since) unlinks nothing."""
        path = cls._record_path(root, key, layout)
        try:
            leaf = cls._leaf_at(root, key, layout=layout)
            if leaf is None:
                return False
            if still_open is not None and not still_open():
                os.close(leaf[0])
                return False
            try:
                os.unlink(leaf[1], dir_fd=leaf[0])
            finally:
                os.close(leaf[0])
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink in the tree: never followed
                log.warning("file: not deleting %s: a symlink in its path (%s)", path, exc)
                return False
            raise DiskError(f"file: cannot delete {path!r}: {exc}") from exc
        return True

    @classmethod
    def _leaf_entries(
        cls, root: str, *, sweep_now: float | None = None, ordered: bool = True, layout: Layout | None = SHARDED
    ) -> Iterator[tuple[str, list[os.DirEntry[str]]]]:
        """``(hex prefix, entries)``, one per directory holding records, of every record under
        ``root`` by the tier's naming rules in ``layout`` (``None``: both): ``<64 hex>.kvb``
        names (in the sharded layout under two levels of 2-hex directories their names start
        with), regular files only (no symlinks; the directory entry's type, no ``stat``). Temp
        files are skipped; with ``sweep_now`` (a ``time.time()``) the stale ones are unlinked as
        they are met. ``ordered``: in key order within each layout."""
        if layout in (FLAT, None):
            found = cls._dir_entries(root, "", sweep_now, ordered)
            if found:
                yield "", found
        if layout == FLAT:
            return
        for n1 in cls._top_dirs(root, ordered):
            d1 = os.path.join(root, n1)
            with os.scandir(d1) as mid:
                level2 = [e.name for e in mid if e.name in _HEX2 and e.is_dir(follow_symlinks=False)]
            if ordered:
                level2.sort()
            for n2 in level2:
                found = cls._dir_entries(os.path.join(d1, n2), n1 + n2, sweep_now, ordered)
                if found:
                    yield n1 + n2, found

    @classmethod
    def _dir_entries(cls, path: str, prefix: str, sweep_now: float | None, ordered: bool) -> list[os.DirEntry[str]]:
        """The record entries of one directory (see :meth:`_leaf_entries`)."""
        found: list[os.DirEntry[str]] = []
        with os.scandir(path) as leaf:
            for entry in leaf:
                name = entry.name
                if len(name) == _NAME_LENGTH and name.startswith(prefix) and _RECORD_NAME(name) is not None:
                    if entry.is_file(follow_symlinks=False):
                        found.append(entry)
                elif sweep_now is not None and name.endswith(".tmp") and cls._stale(entry, sweep_now):
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        pass
        if ordered:
            found.sort(key=lambda e: e.name)
        return found

    @staticmethod
    def _top_dirs(root: str, ordered: bool = False) -> list[str]:
        with os.scandir(root) as top:
            level1 = [e.name for e in top if e.name in _HEX2 and e.is_dir(follow_symlinks=False)]
        if ordered:
            level1.sort()
        return level1

    @classmethod
    def _record_entries(
        cls, root: str, *, sweep_now: float | None = None, layout: Layout | None = SHARDED
    ) -> Iterator[tuple[bytes, os.DirEntry[str]]]:
        """``(key, entry)`` of every record file under ``root``, in key order within each layout
        (see :meth:`_leaf_entries`)."""
        for _, entries in cls._leaf_entries(root, sweep_now=sweep_now, layout=layout):
            for entry in entries:
                yield bytes.fromhex(entry.name[:64]), entry

    @classmethod
    def _record_columns(
        cls, root: str, *, sweep_now: float | None = None, layout: Layout = SHARDED
    ) -> tuple[list[bytes], array[int], array[float]]:
        """Every record under ``root`` in ``layout`` as columns, in key order: keys,
        file sizes and modification times, by the naming rules of :meth:`_leaf_entries` (the same
        records, a test compares them). Directories are opened from their parent's descriptor
        with ``O_NOFOLLOW | O_DIRECTORY`` (a symlink or a file in their place is skipped) and
        listed by name; each record name that fits is ``stat``'ed once, and kept if a regular
        file. No object per entry but its name: about half the time of a ``scandir`` walk. (Two
        threads walking half the first level each were no faster on two cores.) The sizes and
        stamps go into ``array`` columns, not lists: an ``int`` and a ``float`` object per record,
        alive until the open ends and allocated among the keys, kept the allocator's arenas of
        the keys resident after they were freed (10^5 records: 168-178 B per listed key resident
        with lists, 130 with arrays). The keys are gathered as raw bytes in one ``bytearray``
        while the names are alive, and made into ``bytes`` objects only once the names are
        freed: made among the names, they kept the names' memory resident after the names were
        freed (see ``docs/tiers.md``)."""
        raw = bytearray()
        columns: tuple[bytearray, array[int], array[float]] = (raw, array("q"), array("d"))
        for fd, prefix in cls._leaf_fds(root, layout, sweep_now):
            cls._list_leaf(fd, prefix, columns, sweep_now)
        keys = np.frombuffer(raw, dtype="V32").tolist()  # a bytes object each, in C; no copy of the buffer
        return keys, columns[1], columns[2]

    @classmethod
    def _record_key_batches(
        cls, root: str, *, sweep_now: float | None = None, layout: Layout = SHARDED, batch: int = KEY_BATCH
    ) -> Iterator[bytes]:
        """The 32 bytes of every record name's key under ``root`` in ``layout``, one after the
        other in no particular order, ``batch`` keys at a time (fewer in a directory's last): the
        names of :meth:`_record_columns` without a ``stat`` (so a name of the pattern that is not
        a regular file counts too). Each directory is read as it is iterated, not listed whole,
        so nothing grows with the number of records (a buffer of every key, 32 MB at 10^6, and
        a flat store's list of every name, freed, left the memory allocated after them
        resident: see ``docs/tiers.md``); a batch's names are checked and decoded together
        (one match and one ``fromhex`` over their joined hex: 0.6 s less per million names
        than one of each per name)."""
        names: list[str] = []
        add = names.append
        for fd, prefix in cls._leaf_fds(root, layout, sweep_now):
            with os.scandir(fd) as entries:
                for entry in entries:
                    name = entry.name
                    if len(name) == _NAME_LENGTH and name.endswith(_SUFFIX) and name.startswith(prefix):
                        add(name[:64])
                        if len(names) >= batch:
                            yield _packed_keys(names)
                            names.clear()
                    elif sweep_now is not None and name.endswith(".tmp"):
                        cls._sweep_at(fd, name, sweep_now)
            if names:
                yield _packed_keys(names)
                names.clear()

    @classmethod
    def _leaf_fds(cls, root: str, layout: Layout, sweep_now: float | None = None) -> Iterator[tuple[int, str]]:
        """``(descriptor, hex prefix)`` of every directory that may hold records, each opened
        from its parent's with ``O_NOFOLLOW | O_DIRECTORY`` (a symlink or a file in a shard
        directory's place is skipped); each is closed once the next is asked for. With
        ``sweep_now``, a sharded root's own stale temp files are unlinked as its shards are
        listed (a table of records cut short by a crash in a close, a scratch listing's by one
        in an open); a flat root is a leaf, which the caller's listing sweeps."""
        listdir = os.listdir
        with _DirFd(root, None) as top:
            if layout == FLAT:
                yield top.fd, ""
                return
            shards = []
            for n in listdir(top.fd):
                if n in _HEX2:
                    shards.append(n)
                elif sweep_now is not None and n.endswith(".tmp"):
                    cls._sweep_at(top.fd, n, sweep_now)
            for n1 in sorted(shards):
                with _DirFd(n1, top.fd) as mid:
                    if mid.fd < 0:
                        continue
                    for n2 in sorted(listdir(mid.fd)):
                        if n2 not in _HEX2:
                            continue
                        with _DirFd(n2, mid.fd) as leaf:
                            if leaf.fd >= 0:
                                yield leaf.fd, n1 + n2

    @classmethod
    def _list_leaf(cls, fd: int, prefix: str, columns: tuple[bytearray, array[int], array[float]], sweep_now: float | None) -> None:
        """Append the records of the directory ``fd`` to ``columns``, each key's 32 bytes to the
        first (see :meth:`_record_columns`)."""
        key, size, stamp = columns[0].extend, columns[1].append, columns[2].append
        fromhex, stat_at, isreg, match = bytes.fromhex, os.stat, S_ISREG, _RECORD_NAME
        for name in sorted(os.listdir(fd)):  # hex names sort as their keys: the walk's keys in key order
            if len(name) == _NAME_LENGTH and name.startswith(prefix) and match(name) is not None:
                try:
                    st = stat_at(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted by another instance while we walked
                if isreg(st.st_mode):
                    key(fromhex(name[:64]))
                    size(st.st_size)
                    stamp(st.st_mtime)
            elif sweep_now is not None and name.endswith(".tmp"):
                cls._sweep_at(fd, name, sweep_now)

    @staticmethod
    def _sweep_at(dir_fd: int, name: str, now: float) -> None:
        """Unlink the temp file ``name`` in ``dir_fd`` if it is stale."""
        try:
            if now - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS:
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass

    @staticmethod
    def _stale(entry: os.DirEntry[str], now: float) -> bool:
        try:
            return now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS
        except FileNotFoundError:
            return False

    # -- offline, read-only access (kvtier inspect / verify) ---------------------------------------
    # They walk both layouts: they need no readable meta record, and they see a record written
    # in the other layout (by an older build, say) that the open tier would never serve.
    @classmethod
    def is_store_dir(cls, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` is a directory holding a file tier's meta record (``kvtier-meta.kvm``)."""
        return os.path.isfile(os.path.join(path, _META_NAME))

    @classmethod
    def _offline_root(cls, path: str | os.PathLike[str]) -> str:
        if not cls.is_store_dir(path):
            raise ConfigError(f"file: {os.fspath(path)!r} is not a file tier (no {_META_NAME})")
        return os.path.realpath(path)

    @classmethod
    def read_store_meta(cls, path: str | os.PathLike[str]) -> StoreMeta:
        """The meta record of the tier at ``path`` (read-only).

        Raises ``ConfigError`` if ``path`` is not a file tier, ``CorruptBlockError`` or
        ``UnsupportedRecordError`` if its meta record cannot be read.
        """
        root = cls._offline_root(path)
        meta_path = os.path.join(root, _META_NAME)
        try:
            with open(meta_path, "rb") as f:
                data = f.read(1 << 20)
        except OSError as exc:
            raise DiskError(f"file: cannot read the meta record {meta_path!r}: {exc}") from exc
        return decode_meta(data)

    @classmethod
    def count_raw_records(cls, path: str | os.PathLike[str]) -> int:
        """How many record files the tier at ``path`` holds (a directory walk; nothing is read)."""
        root = cls._offline_root(path)
        try:
            return sum(1 for _ in cls._record_entries(root, layout=None))
        except OSError as exc:
            raise DiskError(f"file: cannot list {root!r}: {exc}") from exc

    @classmethod
    def iter_raw_records(cls, path: str | os.PathLike[str]) -> Iterator[tuple[bytes, bytes]]:
        """Yield ``(key, record)`` for every record file of the tier at ``path``, unchecked and in
        key order within each layout (read-only; files are opened ``O_NOFOLLOW``). A file deleted by another
        instance during the walk is skipped; any other read error raises ``DiskError``."""
        root = cls._offline_root(path)
        try:
            for key, entry in cls._record_entries(root, layout=None):
                try:
                    fd = os.open(entry.path, _RECORD_READ)
                except FileNotFoundError:
                    continue
                try:
                    with os.fdopen(fd, "rb", closefd=True) as f:
                        data = f.read()
                except FileNotFoundError:
                    continue
                yield key, data
        except OSError as exc:
            raise DiskError(f"file: cannot read the records under {root!r}: {exc}") from exc

    @classmethod
    def delete_raw_records(cls, path: str | os.PathLike[str], keys: Sequence[bytes]) -> int:
        """Unlink the record files of ``keys`` from the tier at ``path``; returns how many existed.

        Only ``<root>/<64 hex>.kvb`` and ``<root>/ab/cd/<64 hex>.kvb`` names derived from 32-byte
        keys are removed (never a symlink's target), and the touched directories are fsync'ed. Instances sharing the
        directory see the deletion on their next read (a miss)."""
        root = cls._offline_root(path)
        deleted = 0
        dirty: set[str] = set()
        for key in keys:
            for layout in LAYOUTS:
                if cls._unlink_record(root, key, layout):
                    deleted += 1
                    dirty.add(os.path.dirname(cls._record_path(root, key, layout)))
        try:
            for d in dirty:
                cls._fsync_dir(d)
        except OSError as exc:
            raise DiskError(f"file: cannot sync directory entries under {root!r}: {exc}") from exc
        return deleted

