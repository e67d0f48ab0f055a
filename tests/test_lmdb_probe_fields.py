"""The direct lookups' probe (``backends/_lmdbdirect.c``) against a python-lmdb whose fields lie
elsewhere than the ones it was written for: the struct sizes alone would take a build that moved
a field within the same size (other options, a patch). The probe checks a known value at each
offset the direct path reads, or beside it, and refuses by name where one does not hold. Here
each field is set to another value in place (and put back), as a build with that field moved
would show it; before, every one of these was taken."""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
from kvtier.backends import lmdb_direct, lmdb_plain
from kvtier.backends.lmdb_files import META_KEY

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.records import xxcopy

pytestmark = pytest.mark.skipif(
    lmdb_plain._rowguard is None or not hasattr(lmdb_plain._rowguard, "direct_probe") or lmdb.__version__ != lmdb_direct.LAYOUT_VERSION,
    reason="needs the native row guard and the python-lmdb the direct lookups were written for",
)

_P = ctypes.c_void_p
_HEAD = [("refcnt", ctypes.c_ssize_t), ("type", _P), ("siblings", _P * 2), ("children", _P * 2), ("valid", ctypes.c_int)]


class _Db(ctypes.Structure):  # python-lmdb 3.0.0's DbObject (lmdb/cpython.c)
    _fields_ = [*_HEAD, ("env", _P), ("dbi", ctypes.c_uint), ("flags", ctypes.c_uint)]


class _Env(ctypes.Structure):  # its EnvObject, up to the fields the probe reads
    _fields_ = [
        *_HEAD, ("weaklist", _P), ("env", _P), ("libv", _P), ("main_db", _P), ("readonly", ctypes.c_int), ("spare_txn", _P),
        ("max_spare_txns", ctypes.c_int), ("pid", ctypes.c_int), ("write_txn_tid", ctypes.c_ulong), ("open_keys", _P),
        ("active_ops", ctypes.c_int), ("ops_waiters", ctypes.c_int), ("write_begins", ctypes.c_int), ("resizing", ctypes.c_int),
        ("resize_tid", ctypes.c_ulong), ("ops_sync_ready", ctypes.c_int),
    ]


class _Txn(ctypes.Structure):  # its TransObject
    _fields_ = [*_HEAD, ("weaklist", _P), ("env", _P), ("parent", _P), ("libv", _P), ("txn", _P), ("flags", ctypes.c_int), ("db", _P), ("mutations", ctypes.c_int)]


@pytest.fixture
def probed(tmp_path: Path) -> Iterator[tuple[Any, ...]]:
    """A store just opened, and the probe's arguments for it (a read transaction begun as the store begins it)."""
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(tmp_path / "store"))
    asyncio.run(backend.open(BlockFormat(block_bytes=8192, dtype="uint8")))
    env, meta = backend._env, backend._meta  # type: ignore[attr-defined]
    so_path = lmdb_direct._extension()
    assert so_path is not None
    txn = env.begin(buffers=True)
    try:
        value = txn.get(META_KEY, db=meta)
        yield (env, txn, meta, META_KEY, value, txn.id(), backend._blocks, backend._index, so_path,  # type: ignore[attr-defined]
               xxcopy.xxh3_check_copy_native, lmdb_direct._xxcopy.check_copy_c)  # type: ignore[union-attr]
    finally:
        txn.abort()
        asyncio.run(backend.aclose())


def _cases(args: tuple[Any, ...]) -> list[tuple[Any, str, Any, str]]:
    env, txn, meta, blocks, index = args[0], args[1], args[2], args[6], args[7]
    e, t = _Env.from_address(id(env)), _Txn.from_address(id(txn))
    b, i = _Db.from_address(id(blocks)), _Db.from_address(id(index))
    return [
        (e, "valid", 2, "valid is not 1"),
        (t, "valid", 2, "valid is not 1"),
        (e, "max_spare_txns", 7, "max_spare_txns"),
        (e, "pid", e.pid + 1, "pid is not this process's"),
        (e, "write_txn_tid", threading.get_ident(), "write_txn_tid"),
        (e, "active_ops", 1, "active_ops"),
        (e, "ops_waiters", 1, "ops_waiters"),
        (e, "write_begins", 1, "write_begins"),
        (e, "resize_tid", threading.get_ident(), "resize_tid is not 0"),
        (e, "ops_sync_ready", 0, "ops_sync_ready"),
        (t, "parent", id(txn), "txn: parent"),
        (t, "flags", 1, "txn: parent, flags"),
        (t, "db", id(meta), "txn: parent, flags, db"),
        (t, "mutations", 3, "mutations"),
        (b, "dbi", 200, "blocks, index: their handles"),
        (i, "dbi", 0, "blocks, index: their handles"),  # (LMDB's free list's)
    ]


def test_the_probe_takes_the_store_as_opened(probed: tuple[Any, ...]) -> None:
    assert lmdb_plain._rowguard.direct_probe(*probed) is not None  # type: ignore[union-attr]


@pytest.mark.parametrize("case", range(16))
def test_the_probe_refuses_a_field_that_does_not_hold_its_known_value(probed: tuple[Any, ...], case: int) -> None:
    struct, field, bad, match = _cases(probed)[case]
    good = getattr(struct, field)
    setattr(struct, field, bad)
    try:
        with pytest.raises(RuntimeError, match=match):
            lmdb_plain._rowguard.direct_probe(*probed)  # type: ignore[union-attr]
    finally:
        setattr(struct, field, good)
    assert lmdb_plain._rowguard.direct_probe(*probed) is not None  # type: ignore[union-attr]
