"""Offline, read-only access to an ``lmdb`` tier's directory (``kvtier inspect`` / ``verify``).

:class:`OfflineLmdb` gives :class:`~kvtier.backends.lmdb_tier.LmdbBackend` its classmethods
``is_store_dir``, ``read_store_meta``, ``count_raw_records``, ``iter_raw_records`` and
``delete_raw_records``: they need no ``BlockFormat`` or capacity, open the environment read-only
(only the deletion writes), never map a damaged file, and never create a file in a directory
that holds no ``data.mdb``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import lmdb
from kvtier.backends.lmdb_files import META_KEY, DamagedEnvironment, HolderLock, check_data_file
from kvtier.backends.lmdb_layout import join_record

from kvtier.errors import ConfigError, DiskError
from kvtier.records.format import StoreMeta, decode_meta

__all__ = ["OfflineLmdb"]

class OfflineLmdb:
    @classmethod
    def is_store_dir(cls, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` is a directory holding an LMDB environment (``data.mdb``)."""
        return os.path.isfile(os.path.join(path, "data.mdb"))

    @classmethod
    @contextlib.contextmanager
    def _offline_env(cls, path: str | os.PathLike[str]) -> Iterator[tuple[lmdb.Environment, Any, Any]]:
        """The environment at ``path`` opened read-only, with its ``blocks`` and ``meta`` databases.

        The lock file is used only when it already exists and is writable: then this reader is
        registered and a live writer will not reuse the pages it reads. Without one (a copied
        ``data.mdb``, read-only media) no writer can be live, and ``lock=False`` creates nothing.
        """
        where = os.fspath(path)
        if not cls.is_store_dir(where):
            raise ConfigError(f"lmdb: {where!r} holds no LMDB environment (no data.mdb)")
        try:
            check_data_file(where)  # never map a file that would fault
        except DamagedEnvironment as exc:
            raise DiskError(f"lmdb: the environment at {where!r} is damaged ({exc}); its records cannot be read safely") from exc
        except OSError as exc:
            raise DiskError(f"lmdb: cannot read {where!r}: {exc}") from exc
        lock_file = os.path.join(where, "lock.mdb")
        lock = os.path.isfile(lock_file) and os.access(lock_file, os.R_OK | os.W_OK)
        try:
            env = lmdb.open(where, readonly=True, create=False, subdir=True, max_dbs=3, lock=lock, readahead=False)
        except lmdb.Error as exc:
            raise ConfigError(f"lmdb: cannot open the environment at {where!r} read-only: {exc}") from exc
        try:
            try:
                blocks = env.open_db(b"blocks", create=False)
                meta = env.open_db(b"meta", create=False)
            except lmdb.Error as exc:
                raise ConfigError(f"lmdb: {where!r} is an LMDB environment but not a kvtier tier: {exc}") from exc
            yield env, blocks, meta
        finally:
            env.close()

    @classmethod
    def read_store_meta(cls, path: str | os.PathLike[str]) -> StoreMeta | None:
        """The meta record of the tier at ``path``, or ``None`` if it has none (read-only).

        Raises ``ConfigError`` if ``path`` is not an lmdb tier, ``CorruptBlockError`` or
        ``UnsupportedRecordError`` if its meta record cannot be read.
        """
        with cls._offline_env(path) as (env, _blocks, meta_db):
            try:
                with env.begin(db=meta_db) as txn:
                    raw = txn.get(META_KEY)
            except lmdb.Error as exc:
                raise DiskError(f"lmdb: cannot read the meta record of {os.fspath(path)!r}: {exc}") from exc
        return None if raw is None else decode_meta(raw)

    @classmethod
    def count_raw_records(cls, path: str | os.PathLike[str]) -> int:
        """How many records the tier at ``path`` holds (from LMDB's statistics; read-only)."""
        with cls._offline_env(path) as (env, blocks, _meta):
            with env.begin() as txn:
                return int(txn.stat(blocks)["entries"])

    @classmethod
    def iter_raw_records(cls, path: str | os.PathLike[str]) -> Iterator[tuple[bytes, bytes]]:
        """Yield ``(key, record)`` for every record of the tier at ``path``, unchecked (read-only):
        head and payload joined, whatever the layout (:mod:`kvtier.backends.lmdb_layout`).

        One read transaction spans the iteration; close the generator (or exhaust it) promptly
        on a live store, since a long reader keeps the writer from reusing freed pages.
        """
        with cls._offline_env(path) as (env, blocks, _meta):
            try:
                index = env.open_db(b"index", create=False)
                with env.begin(db=blocks) as txn:
                    for key, value in txn.cursor():
                        yield bytes(key), join_record(txn.get(key, db=index), value)
            except lmdb.Error as exc:
                raise DiskError(f"lmdb: cannot read the records of {os.fspath(path)!r}: {exc}") from exc

    @classmethod
    def delete_raw_records(cls, path: str | os.PathLike[str], keys: Sequence[bytes]) -> int:
        """Delete ``keys`` (record and index entry, in one durable transaction) from the tier at
        ``path``; returns how many records were there. Missing keys are ignored.

        Refused (``BackendError`` naming the pid) while a process holds the tier open: its map
        could not follow a file this grows. Holds the tier's lock itself meanwhile. The map is
        opened with room past the file's used pages, since deleting copies pages (copy-on-write)
        and a full map would refuse it. Nothing else about the store is touched.
        """
        where = os.fspath(path)
        with cls._offline_env(where) as (env, _blocks, _meta):
            info = env.info()
            psize = int(env.stat()["psize"])
        if not keys:
            return 0
        used = (int(info["last_pgno"]) + 1) * psize
        map_size = max(int(info["map_size"]), used) + max(1 << 20, (64 + 8 * len(keys)) * psize)
        holder = HolderLock(where)
        holder.acquire()
        try:
            env = lmdb.open(where, map_size=map_size, create=False, subdir=True, max_dbs=3, sync=True, lock=True)
        except lmdb.Error as exc:
            holder.release()
            raise DiskError(f"lmdb: cannot open {where!r} for writing: {exc}") from exc
        deleted = 0
        try:
            blocks = env.open_db(b"blocks", create=False)
            index = env.open_db(b"index", create=False)
            with env.begin(write=True) as txn:
                for key in keys:
                    if txn.delete(key, db=blocks):
                        deleted += 1
                    txn.delete(key, db=index)
            env.sync(True)
        except lmdb.Error as exc:
            raise DiskError(f"lmdb: delete in {where!r} failed: {exc}") from exc
        finally:
            env.close()
            holder.release()
        return deleted

