"""A check of an LMDB file's B-trees, page by page with ``pread``, before LMDB maps it.

LMDB trusts the pages it follows. A zeroed or damaged branch or leaf page makes it fail an
assertion (``IS_LEAF(mp)`` in ``mdb_cursor_next``, and others), and an assertion aborts the
process: nothing can catch it, so an engine would die at every restart. A node whose sizes
point past its page, or an overflow run past the end of the file, makes it read unmapped
memory (SIGBUS). :func:`check_trees` walks every tree of the environment (the free-page
database, the main database, and each named database found in it) the way LMDB would, and
raises :class:`~kvtier.backends.lmdb_files.DamagedEnvironment` at the first page LMDB could not
walk safely:

* the page number in the page's header is the page's own (a zeroed page has 0),
* its type is a branch or a leaf page (nothing else belongs in these trees), its node pointers
  lie between the header and the page's end, and each node (key, inline value) fits the page,
* every child page number is inside the file, no page is reached twice, and every leaf of a
  tree lies at the tree's recorded depth (LMDB steps to a sibling subtree assuming it does),
* an overflow value's pages lie inside the file, and a named database's record is whole.

It reads each branch and leaf page once and never an overflow page (a value's bytes are covered
by the record checksum): a store of 2 MiB blocks has one leaf page for about 80 records, so
the walk reads well under 1 % of the file. It runs before ``lmdb.open``, in the process that is
about to map the file, and the tier holds the file's lock meanwhile.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from kvtier.backends.lmdb_files import DamagedEnvironment, read_meta_pages

__all__ = ["check_file_trees", "check_trees"]

_P_INVALID = (1 << 64) - 1
_P_BRANCH, _P_LEAF = 0x01, 0x02
_IGNORED_FLAGS = 0x10 | 0x4000 | 0x8000  # P_DIRTY, P_LOOSE, P_KEEP: bookkeeping, not the page's type
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_HEADER = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_DB = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, branch, leaf, overflow pages, entries, root
_FREE_DB_AT = 40  # mm_dbs[FREE_DBI] in a meta page, after the page header and magic/version/address/mapsize
_MAIN_DB_AT = _FREE_DB_AT + _DB.size
_MAX_DEPTH = 32  # LMDB's cursor stack (CURSOR_STACK)


@dataclass(slots=True)
class _Walk:
    fd: int
    psize: int
    last_pgno: int
    seen: set[int]
    keys_of: bytes | None = None  # the named database whose keys are collected
    keys: dict[bytes, bytes] | None = None


def check_file_trees(path: str, keys_of: bytes | None = None) -> dict[bytes, bytes] | None:
    """:func:`check_trees` as of the newer meta page (the one LMDB will use); nothing to check
    when there is no file yet (``None``). Call it after ``check_data_file`` accepted the meta
    pages. With ``keys_of``, returns the keys of that named database (empty if it has none),
    each mapped to itself, so a caller can keep these key objects rather than copies."""
    found = read_meta_pages(path)
    if found is None or not any(found[0]):
        return None
    pages = found[0]
    newest = max((m for m in pages if m is not None), key=lambda m: m.txnid)
    return check_trees(path, newest.psize, newest.last_pgno, pages.index(newest), keys_of=keys_of)


def check_trees(
    path: str, psize: int, last_pgno: int, meta_pgno: int, *, keys_of: bytes | None = None
) -> dict[bytes, bytes] | None:
    """Walk every tree of ``<path>/data.mdb`` as of the meta page ``meta_pgno`` (0 or 1, the
    newer one); raise ``DamagedEnvironment`` naming the first page LMDB could not walk. With
    ``keys_of``, returns the keys of that named database (each mapped to itself), read from its
    leaf pages: no page of a value is read, where a cursor over LMDB's map touches each value's
    first page."""
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        walk = _Walk(fd, psize, last_pgno, set(), keys_of)
        meta = os.pread(fd, psize, meta_pgno * psize)
        for name, at in (("free-page", _FREE_DB_AT), ("main", _MAIN_DB_AT)):
            _tree(walk, meta[at : at + _DB.size], f"the {name} database", main=name == "main")
    finally:
        os.close(fd)
    if keys_of is None:
        return None
    return walk.keys if walk.keys is not None else {}


def _tree(walk: _Walk, record: bytes, what: str, *, main: bool = False, keys: dict[bytes, bytes] | None = None) -> None:
    if len(record) != _DB.size:
        raise DamagedEnvironment(f"{what}: its record is {len(record)} bytes, expected {_DB.size}")
    depth, root = _DB.unpack(record)[2], _DB.unpack(record)[7]
    if root == _P_INVALID:
        return  # an empty tree
    if not 1 <= depth <= _MAX_DEPTH:
        raise DamagedEnvironment(f"{what}: depth {depth}")
    _page(walk, root, depth, what, main, keys)


def _page(walk: _Walk, pgno: int, depth: int, what: str, main: bool, keys: dict[bytes, bytes] | None = None) -> None:
    psize = walk.psize
    if not 2 <= pgno <= walk.last_pgno:
        raise DamagedEnvironment(f"{what}: page {pgno} is outside the file's pages 2..{walk.last_pgno}")
    if pgno in walk.seen:
        raise DamagedEnvironment(f"{what}: page {pgno} is reached twice")
    walk.seen.add(pgno)
    page = os.pread(walk.fd, psize, pgno * psize)
    if len(page) < psize:
        raise DamagedEnvironment(f"{what}: page {pgno} is cut short")
    own, _, flags, lower, upper = _HEADER.unpack_from(page, 0)
    kind = flags & ~_IGNORED_FLAGS
    where = f"{what}, page {pgno}"
    if own != pgno:
        raise DamagedEnvironment(f"{where}: its header names page {own}")
    if kind not in (_P_BRANCH, _P_LEAF) or (kind == _P_LEAF) != (depth == 1):
        raise DamagedEnvironment(f"{where}: flags {flags:#x} at depth {depth}")
    if lower & 1 or not _HEADER.size <= lower <= upper <= psize:
        raise DamagedEnvironment(f"{where}: node area {lower}..{upper}")
    count = (lower - _HEADER.size) // 2
    if kind == _P_BRANCH and count < 1:
        raise DamagedEnvironment(f"{where}: a branch page without children")
    for ptr in struct.unpack_from(f"<{count}H", page, _HEADER.size):
        if not upper <= ptr <= psize - _NODE.size:
            raise DamagedEnvironment(f"{where}: a node at offset {ptr}, outside {upper}..{psize}")
        lo, hi, node_flags, ksize = _NODE.unpack_from(page, ptr)
        body = ptr + _NODE.size + ksize
        if kind == _P_BRANCH:
            if body > psize:
                raise DamagedEnvironment(f"{where}: a key of {ksize} bytes runs past the page")
            _page(walk, lo | hi << 16 | node_flags << 32, depth - 1, what, main, keys)
            continue
        key = page[body - ksize : body]  # whole unless the node runs past the page (refused below)
        if keys is not None:
            keys[key] = key
        if node_flags == 0 and body + (lo | hi << 16) <= psize:
            continue  # the common node, a value inside the page: nothing more to check
        _leaf_node(walk, page, where, body, lo | hi << 16, node_flags, main, key)


def _leaf_node(walk: _Walk, page: bytes, where: str, body: int, size: int, flags: int, main: bool, key: bytes = b"") -> None:
    psize = walk.psize
    if flags & _F_DUPDATA or flags & ~(_F_BIGDATA | _F_SUBDATA):
        raise DamagedEnvironment(f"{where}: node flags {flags:#x} (no database here keeps duplicates)")
    if flags & _F_BIGDATA:
        if body + 8 > psize:
            raise DamagedEnvironment(f"{where}: an overflow node runs past the page")
        (first,) = struct.unpack_from("<Q", page, body)
        pages = -(-(size + _HEADER.size) // psize)
        if first < 2 or first + pages - 1 > walk.last_pgno:
            raise DamagedEnvironment(f"{where}: a value on pages {first}..{first + pages - 1}, past the file's last page {walk.last_pgno}")
        return
    if body + size > psize:
        raise DamagedEnvironment(f"{where}: a value of {size} bytes runs past the page")
    if flags & _F_SUBDATA:
        if not main:
            raise DamagedEnvironment(f"{where}: a named database inside a named database")
        collect = None
        if walk.keys_of is not None and key == walk.keys_of:
            collect = walk.keys = {}
        _tree(walk, page[body : body + size], f"a named database ({where})", keys=collect)
