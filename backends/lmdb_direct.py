"""An ``lmdb`` tier's straight reads looking keys up by LMDB's own ``get``, where that is sound.

python-lmdb's ``Transaction.get`` costs about 20 % of a 4 KiB record's straight read: it parses
its arguments, makes a buffer object and hands the GIL over and back for each key. LMDB's C
``mdb_get`` costs about 0.14 µs. python-lmdb has no C interface, so the native job read
(``backends/_lmdbdirect.c``) reads the ``MDB_txn *`` and ``MDB_dbi`` out of python-lmdb's own
objects and calls the engine python-lmdb chose for the environment (it bundles LMDB 0.9 and 1.0
and picks one per environment) through that engine's table of entry points.

That reads another project's private structs, so it is taken only where everything it relies
on was checked, at the store's open (:func:`direct_gets`):

- python-lmdb is exactly the version whose source was read (:data:`LAYOUT_VERSION`), with its
  C extension (not the cffi form);
- its objects' sizes are those of the structs read, and the engine's ``get``, ``txn_id``,
  ``txn_abort`` and ``env_create`` are the ``mdb09_*`` or ``mdb10_*`` symbols python-lmdb's
  extension exports;
- the transaction's id as the engine reads it is ``txn.id()``, and a record read by the
  engine's ``get`` is at the address and of the length python-lmdb's ``get`` gives, and a key
  that is not there is not found.

Anything else leaves :func:`direct_gets` ``None`` and the reads use python-lmdb's ``get`` as
before. Each job checks again, under the GIL, that its environment is the one probed, still
open, in the process that probed it, and its databases python-lmdb's own live objects of it (a
test's stand-in environment is read by python-lmdb's transactions and ``get``). The job is
counted in the environment's in-flight operations, as python-lmdb counts its own ``get``,
until its last copy out of the map: a close or a resize waits for it. Every check of a record,
the file guard, the fork rule, the cold rule and the counters are the straight read's,
unchanged.

The jobs read in a read transaction of the engine's own that the store keeps between jobs
(``backends/_lmdbkeep.c``; python-lmdb's ``begin`` and ``abort`` made a Python object and two
calls a job): reset after each job, so it holds no snapshot, and renewed by the next, so it
reads the last commit, as a new one would. The probe checks the environment is ``MDB_NOTLS``
(a reset transaction is then renewed on any thread) and reads the meta record through one,
begun, reset and renewed. The store's close aborts it (:func:`drop_kept`) before the
environment closes; a fork's child never touches it.
"""

from __future__ import annotations

import logging
from typing import Any

import lmdb

from kvtier.records import xxcopy

__all__ = ["DIRECT_GETS", "LAYOUT_VERSION", "direct_gets", "drop_kept"]

log = logging.getLogger(__name__)

#: The python-lmdb whose C structs ``backends/_lmdbdirect.c`` mirrors (lmdb/cpython.c at 3.0.0).
LAYOUT_VERSION = "3.0.0"
#: ``False``: the straight reads look keys up by python-lmdb's ``get`` alone (the path the tests
#: compare the direct one with).
DIRECT_GETS = True

try:
    from kvtier.backends import _rowguard  # type: ignore[attr-defined]
except ImportError:  # not built
    _rowguard = None
try:
    from kvtier.records import _xxcopy  # type: ignore[attr-defined]
except ImportError:  # not built
    _xxcopy = None


def _extension() -> str | None:
    """The file of python-lmdb's C extension where ``lmdb`` is that form, else ``None``."""
    module = getattr(lmdb, "cpython", None)
    path = getattr(module, "__file__", None)
    if module is None or path is None or getattr(lmdb, "Transaction", None) is not getattr(module, "Transaction", None):
        return None
    return str(path)


def direct_gets(env: lmdb.Environment, meta: Any, key: bytes, blocks: Any, index: Any, *, version: str | None = None) -> object | None:
    """What the straight reads of ``env`` take to look keys up by LMDB's own ``get`` (see the
    module doc), or ``None`` where that is not sound or not built. ``meta``: a database of
    ``env`` holding ``key`` (the store's meta record); ``blocks``, ``index``: the databases the
    reads look in. ``version``: python-lmdb's (its ``__version__`` by default)."""
    version = lmdb.__version__ if version is None else version
    check = xxcopy.xxh3_check_copy
    if not DIRECT_GETS or _rowguard is None or _xxcopy is None or not hasattr(_rowguard, "direct_probe"):
        return None
    if version != LAYOUT_VERSION:
        log.debug("lmdb: python-lmdb %s, not %s: keys are looked up by its get", version, LAYOUT_VERSION)
        return None
    so_path = _extension()
    if so_path is None or check is not xxcopy.xxh3_check_copy_native:
        return None
    try:
        txn = env.begin(buffers=True)
        try:
            value = txn.get(key, db=meta)
            if value is None:
                return None
            return _rowguard.direct_probe(env, txn, meta, key, value, txn.id(), blocks, index, so_path, check, _xxcopy.check_copy_c)
        finally:
            txn.abort()
    except (RuntimeError, lmdb.Error) as exc:
        log.warning("lmdb: keys are looked up by python-lmdb's get: %s", exc)
        return None


def drop_kept(direct: object | None) -> None:
    """The store closes: the read transaction the direct lookups of ``direct`` (what
    :func:`direct_gets` gave, or ``None``) keep is aborted, and none is kept after. Called with
    no job of the store in flight, just before its environment closes."""
    if direct is not None and _rowguard is not None:
        _rowguard.direct_drop(direct)
