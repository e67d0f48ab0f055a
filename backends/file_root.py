"""The ``file`` tier's root directory while a store is open: its meta record and the
directories its records go in.

* The meta record (``kvtier-meta.kvm``) is read and checked against the store's format, or
  written once, exclusively, when the store is new (:func:`establish_meta`). It names the
  store's layout (``flat``: every record in the root; ``sharded``: ``ab/cd/`` directories); a
  meta record that names none is a store written before layouts were named: ``sharded``.
* In the flat layout every record's directory is the root (:meth:`ShardDirs.open_leaf` hands
  out a duplicate of the root's descriptor); what follows is the sharded layout's.
* The 256 first-level shard directories (``00`` … ``ff``) are made at open
  (:meth:`ShardDirs.make_top`), with one ``fsync`` of the root when any was missing. Without
  them, a record written to a fresh store made its first-level directory too, and its job
  synced the root as well; measured (4 KiB and 64 KiB records, jobs of 16, raw syscalls in the
  tier's layout): 1.4–1.5× the blocks/s of making them as records arrive. They cost 256 empty
  directories once per store.
* A shard directory that exists is opened in one ``openat2`` beneath the root with symlinks
  refused (:meth:`ShardDirs.open_leaf`), where reaching it one level at a time takes five
  system calls; a directory is known to exist once a write of this instance reached it and
  (durable) its entry in its parent is synced. Anything unusual (a directory gone, a symlink, no
  ``openat2``) takes the level-by-level walk, which makes missing directories and refuses
  symlinks.
* Durable, a job syncs the parents of the directories its walk made, and also those of
  directories another job made whose commit has not synced them yet (the walks take turns):
  a record is acknowledged only once every entry on its path is on stable storage, whichever
  job made its directory.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
from collections.abc import Callable

from kvtier.backends.file_reads import BeneathRoot
from kvtier.backends.file_tree import _META_NAME, FLAT, LAYOUTS, SHARDED, FileTree, Layout

from kvtier.backend import BlockFormat
from kvtier.errors import ConfigError, CorruptBlockError, DiskError
from kvtier.records.codec import UnsupportedRecordError
from kvtier.records.format import check_meta, decode_meta, encode_meta
from kvtier.records.mac import RecordMac
from kvtier.records.meta import NewerMetaError

__all__ = ["ShardDirs", "asked_layout", "establish_meta"]


def establish_meta(
    root: str,
    fmt: BlockFormat,
    mac: RecordMac | None,
    temp_name: Callable[[str], str],
    log_warning: Callable[[str], None],
    *,
    layout: Layout | None = None,
    new_layout: Layout = FLAT,
) -> Layout:
    """Check the meta record of the store at ``root`` against ``fmt`` (``ConfigError`` if it
    names another namespace), or write it when there is none; returns the store's layout. A new
    store gets ``layout``, or ``new_layout`` when that is ``None``; an existing one keeps its
    own, and a ``layout`` that differs from it is a ``ConfigError`` naming the field. A meta
    record of a newer version (sound: its body's CRC holds) is a newer kvtier's store, refused
    with a ``ConfigError`` and left as it is: moved aside, its records, of a format this build
    may not read, would be dropped one by one as they were read. An
    unreadable meta record (bad checksum, truncated, another meta version) is moved aside
    with a warning and rewritten: one flipped bit from ours is damage like any other, never a
    refusal to start (records are checked one by one when read). A meta record written where
    records already lie (the old one was damaged or removed) names the layout they are in
    (:func:`_tree_layout`), so none is orphaned. ``temp_name(path)`` names a temporary file
    beside ``path``."""
    meta_path = os.path.join(root, _META_NAME)
    for _ in range(2):
        try:
            with open(meta_path, "rb") as f:
                data = f.read(1 << 20)
        except FileNotFoundError:
            found = _tree_layout(root)
            if found is not None and layout is not None and layout != found:
                raise ConfigError(
                    f"layout: the store at {root!r} holds records in layout {found!r}, the tier asks for {layout!r}; "
                    f"set layout: {found} (or leave it out), or point the tier at a new path"
                ) from None
            chosen = found or layout or new_layout
            tmp = temp_name(meta_path)
            with open(tmp, "wb") as f:
                f.write(encode_meta(fmt, mac, layout=None if chosen == SHARDED else chosen))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, meta_path)  # exclusive create: another instance may race us
                FileTree._fsync_dir(root)
                return chosen
            except FileExistsError:
                continue  # read and check the winner's meta record
            finally:
                os.unlink(tmp)
        try:
            meta = decode_meta(data)
        except NewerMetaError as exc:
            raise exc.refusal(f"file {root!r}") from None
        except (CorruptBlockError, UnsupportedRecordError) as exc:
            moved = f"{meta_path}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
            os.replace(meta_path, moved)
            message = f"file: the meta record of {root!r} is unreadable ({exc}); moved it to {moved!r}"
            log_warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            continue
        check_meta(meta, fmt, where=f"file {root!r}", mac=mac)
        return _store_layout(root, meta.layout, layout)
    raise DiskError(f"file: cannot establish the meta record of {root!r}")


def _tree_layout(root: str) -> Layout | None:
    """The layout of the records already under ``root`` (``None``: none there): ``sharded``
    where shard directories are (a sharded store makes its first level at every open), else
    ``flat`` where records lie in the root itself, by the tree walk's own naming rules."""
    if FileTree._top_dirs(root):
        return SHARDED
    return FLAT if FileTree._dir_entries(root, "", None, False) else None


def asked_layout(layout: str | None) -> Layout | None:
    """A tier's ``layout`` option, checked: ``None`` (the store's own) or one of :data:`LAYOUTS`."""
    if layout is not None and layout not in LAYOUTS:
        raise ConfigError(f"layout: expected one of {', '.join(LAYOUTS)} (or none: the store's own), got {layout!r}")
    return layout


def _store_layout(root: str, stored: str | None, wanted: Layout | None) -> Layout:
    have = SHARDED if stored is None else stored
    if have not in LAYOUTS:
        raise ConfigError(
            f"file {root!r}: the store's layout is {have!r}, which this kvtier does not know (it knows "
            f"{', '.join(LAYOUTS)}); upgrade kvtier, or point the tier at a new path"
        )
    if wanted is not None and wanted != have:
        raise ConfigError(
            f"layout: the store at {root!r} was made with layout {have!r}, the tier asks for {wanted!r}; "
            f"a store keeps the layout it was made with: set layout: {have} (or leave it out), or point "
            f"the tier at a new path"
        )
    return have


class ShardDirs:
    """The directories records go in, in an open store under ``root`` laid out by ``layout``
    (see the module doc); ``beneath`` holds the root's descriptor."""

    def __init__(self, root: str, beneath: BeneathRoot, *, durable: bool, layout: Layout = SHARDED) -> None:
        self.root = root
        self.layout = layout
        self._beneath = beneath
        self._durable = durable
        self._known = bytearray(1 << 16)  # 1 where ``ab/cd`` is known to exist, by ``0xabcd``
        # Durable: each directory a walk made whose entry no commit has synced yet -> its parent.
        # A job that reaches such a directory (made by another job still committing) syncs that
        # parent too, else it could return before its record's path is durable; and ``ab/cd``
        # is known (opened in one call, unsynced entries unseen) only once its path is synced.
        # Each entry is numbered (``_made``): a commit marks synced only those made before its
        # syncs began (:meth:`mark`), not one another walk made in the parent after them.
        self._unsynced: dict[str, tuple[str, int]] = {}
        self._made = 0
        self._walks = threading.Lock()  # a walk that makes a directory, and another's that finds it

    def shard(self, key_hex: str) -> str:
        """The name of the directory a record goes in, relative to the root (``""``: the root)."""
        return "" if self.layout == FLAT else f"{key_hex[0:2]}/{key_hex[2:4]}"

    def make_top(self) -> int:
        """Make the missing first-level directories (sharded layout); sync the root once if any
        was made (durable). Returns how many were made. A name that exists as something else is
        left alone: the level-by-level walk refuses it when a record needs it."""
        if self.layout == FLAT:
            return 0
        made = 0
        for i in range(256):
            try:
                os.mkdir(f"{i:02x}", 0o700, dir_fd=self._beneath.fd)
            except FileExistsError:
                continue
            made += 1
        if made and self._durable:
            os.fsync(self._beneath.fd)
        return made

    def open_leaf(self, key: bytes, created: set[str]) -> int:
        """A descriptor of ``key``'s directory, made if missing (the parents that gained a
        directory are added to ``created``, to be synced by the commit). The caller closes it.
        ``EBADF`` once the root's close has begun, before the walk by the root's path or after it:
        a store may be opened there since by the time a write outlives the close's wait."""
        if self._beneath.fd < 0:
            raise OSError(errno.EBADF, "the store's root is closed", self.root)
        if self.layout == FLAT:
            return os.dup(self._beneath.fd)
        h = key.hex()
        index = int(h[:4], 16)
        if self._known[index] and self._beneath.usable:
            try:
                return self._beneath.open(f"{h[0:2]}/{h[2:4]}", directory=True)
            except OSError:
                pass  # gone, a symlink, no openat2: the walk below decides
        made: set[str] = set()
        top = os.path.join(self.root, h[0:2])
        unsynced = self._unsynced
        with self._walks:
            try:
                leaf = FileTree._leaf_at(self.root, key, create=True, durable=self._durable, created=made)
            finally:  # (also where the walk fails below a directory it made: the next job through it syncs its entry)
                if self._durable and self.root in made:
                    unsynced[top] = (self.root, self._made)
                if self._durable and top in made:
                    unsynced[os.path.join(top, h[2:4])] = (top, self._made)
                self._made += 1
            assert leaf is not None
            created |= made
            if self._durable:
                for path in (top, os.path.join(top, h[2:4])):
                    if path in unsynced:
                        created.add(unsynced[path][0])
                        index = -1
        if self._beneath.fd < 0:  # closed during the walk: the path may lead to a store opened since
            os.close(leaf[0])
            raise OSError(errno.EBADF, "the store's root was closed", self.root)
        if index >= 0:
            self._known[index] = 1
        return leaf[0]

    def mark(self) -> int:
        """Where the walks stand, taken by a durable commit before its syncs begin (see :meth:`synced`)."""
        return self._made

    def synced(self, parents: set[str], mark: int) -> None:
        """A durable commit synced the directories ``parents``, its syncs begun after ``mark``
        (:meth:`mark`): the entries made in them before the mark are durable (the walk after
        this one knows their shard directory). One made after it, by a walk of another job
        while these syncs ran, may have missed them: it stays for its own maker, or the next
        job through it, to sync."""
        if parents and self._unsynced:
            with self._walks:
                for path, (parent, made) in list(self._unsynced.items()):
                    if parent in parents and made < mark:
                        del self._unsynced[path]
