"""The open-time page check of :mod:`kvtier.backends.lmdb_pages`, a level at a time in numpy,
and the listing of the records it reads on the way.

:func:`kvtier.backends.lmdb_pages.check_trees` walks page by page in Python (a ``pread`` and a
loop per page): at 10^6 records of 1 KiB (330k leaf pages) that was half of a store's open.
:func:`list_trees` makes the same checks over a read-only map of ``data.mdb``, one tree level
at a time: the page headers of a level, then all its nodes, as arrays. Overflow pages (a value's
bytes) are never read, and the map is told the reads are random, so the device does not read
around the pages it touches. On any page it would refuse, it hands over to ``check_trees``,
which walks the file as LMDB would and raises the error naming the first bad page: the two
accept exactly the same files (``tests/test_lmdb_scan.py`` compares them on damaged copies), and
this one never lets through what that one refuses.

On the way, it lists the leaf nodes of the named databases ``blocks`` and ``index``: their keys
(fixed width, in key order, as LMDB's leaves hold them), each value's length and, for
``index``, each entry's stamp and stored size (:mod:`kvtier.backends.lmdb_layout`; a joined
record has no entry: its size is its value's length). A store's open builds its index from this
listing without a cursor, a ``RecordInfo`` or a tuple per record (:class:`kvtier.bulk.RecordColumns`).
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import numpy as np
from kvtier.backends.lmdb_files import DamagedEnvironment, read_meta_pages
from kvtier.backends.lmdb_pages import check_file_trees, check_trees

from kvtier.bulk import RecordColumns, unpooled

__all__ = ["Leaves", "leaf_keys", "list_trees", "listed_records", "open_listing"]

_P_INVALID = (1 << 64) - 1
_P_BRANCH, _P_LEAF = 0x01, 0x02
_IGNORED_FLAGS = 0x10 | 0x4000 | 0x8000
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_HEADER = 16
_NODE = 8
_DB_SIZE = 48
_FREE_DB_AT = 40
_MAIN_DB_AT = _FREE_DB_AT + _DB_SIZE
_MAX_DEPTH = 32
#: A page header and a node header, as one gather each reads them (little-endian, LMDB's layout).
_PAGE_HEAD = np.dtype([("pgno", "<u8"), ("pad", "<u2"), ("flags", "<u2"), ("lower", "<u2"), ("upper", "<u2")])
_NODE_HEAD = np.dtype([("lo", "<u2"), ("hi", "<u2"), ("flags", "<u2"), ("ksize", "<u2")])
_ENTRY_HEAD = np.dtype([("stamp", "<f8"), ("stored", "<u8")])
_U16, _U64 = np.dtype("<u2"), np.dtype("<u8")
#: Rows gathered at a time into a column built at its final size (below malloc's mmap threshold).
_BATCH = 2048
#: Node pointers read with their page's header, in the same gather (a page touched once for
#: both); the pointers of a page's further nodes are read on their own.
_NEAR = 8
_PAGE_START = np.dtype({"names": ["pgno", "flags", "lower", "upper", "ptrs"],
                        "formats": ["<u8", "<u2", "<u2", "<u2", ("<u2", (_NEAR,))], "offsets": [0, 10, 12, 14, 16]})


class _Refused(Exception):
    """A page the check refuses: ``check_trees`` names it."""


@dataclass(slots=True)
class Leaves:
    """The leaf nodes of one named database, in key order. ``keys``: one row of ``key_size``
    bytes per node (``None`` when the keys differ in size); ``values``: each node's value size;
    ``at``: each value's offset in the file (inline values only; ``-1`` for an overflow value);
    ``psize``: the file's page size."""

    count: int
    key_size: int
    keys: np.ndarray | None
    values: np.ndarray
    at: np.ndarray
    psize: int = 4096


def list_trees(path: str, names: tuple[bytes, ...] = (b"blocks", b"index")) -> tuple[dict[bytes, Leaves], np.ndarray] | None:
    """Check every tree of ``<path>/data.mdb`` as :func:`~kvtier.backends.lmdb_pages.check_trees`
    does (``DamagedEnvironment`` naming the first bad page); return the leaves of the named
    databases ``names`` found and the file's bytes as an array (a read-only map: read the
    values it needs, then drop it); ``None`` when there is no file or no meta page yet."""
    found = read_meta_pages(path)
    if found is None or not any(found[0]):
        return None
    pages = found[0]
    newest = max((m for m in pages if m is not None), key=lambda m: m.txnid)
    psize, last = newest.psize, newest.last_pgno
    meta_pgno = pages.index(newest)
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        length = (last + 1) * psize  # check_data_file found the file at least this long
        mapped = mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ)
    mapped.madvise(mmap.MADV_RANDOM)
    data = np.frombuffer(mapped, dtype=np.uint8)  # the map goes with the last array made on it
    walk = _Walk(data, psize, last, names)
    meta = meta_pgno * psize
    try:
        for at, main in ((_FREE_DB_AT, False), (_MAIN_DB_AT, True)):
            walk.tree(bytes(data[meta + at : meta + at + _DB_SIZE]), main=main)
    except _Refused:
        del walk, data
        check_trees(path, psize, last, meta_pgno)  # raises, naming the first bad page
        raise DamagedEnvironment("a page LMDB could not walk safely") from None  # (never: the two agree)
    return walk.leaves, data


def _rows(data: np.ndarray, at: np.ndarray, dtype: np.dtype | int, out: np.ndarray | None = None) -> np.ndarray:
    """The ``dtype`` items (or ``width``-byte rows, as ``V<width>``) at byte offsets ``at`` of
    ``data``: one gather of whole rows over an overlapping view, not one per byte. An offset
    whose row would end past ``data`` raises ``IndexError``, as a gather of each byte would."""
    width = dtype if isinstance(dtype, int) else dtype.itemsize
    count = len(data) - width + 1
    if count <= 0:
        raise IndexError(f"no row of {width} bytes fits {len(data)} bytes")
    # Gathered as opaque rows (a plain copy per row; a structured or numeric item gathers
    # slower), then read as ``dtype``.
    view: np.ndarray = np.ndarray(shape=(count,), dtype=f"V{width}", buffer=data, strides=(1,))
    if out is None:
        rows = view[at]
    else:  # gathered in batches into ``out``: no temporary of the whole column
        for start in range(0, len(at), _BATCH):
            out[start : start + _BATCH] = view[at[start : start + _BATCH]]
        rows = out
    return rows if isinstance(dtype, int) else rows.view(dtype)


def _field(rows: np.ndarray, name: str) -> np.ndarray:
    return rows[name].astype(np.int64)


class _Walk:
    def __init__(self, data: np.ndarray, psize: int, last: int, names: tuple[bytes, ...]) -> None:
        self.data, self.psize, self.last, self.names = data, psize, last, names
        self.seen = np.zeros(last + 1, dtype=bool)
        self.leaves: dict[bytes, Leaves] = {}

    def tree(self, record: bytes, *, main: bool = False, name: bytes | None = None) -> None:
        if len(record) != _DB_SIZE:
            raise _Refused
        depth = int.from_bytes(record[6:8], "little")
        root = int.from_bytes(record[40:48], "little")
        if root == _P_INVALID:
            return
        if not 1 <= depth <= _MAX_DEPTH:
            raise _Refused
        level = np.array([root], dtype=np.int64)
        while True:
            base, upper, count, near = self._pages(level, depth)
            page = np.repeat(np.arange(len(level)), count)
            first = np.cumsum(count) - count
            slot = np.arange(len(page)) - first[page]
            ptr = self._pointers(base, page, slot, near)
            if np.any(ptr < upper[page]) or np.any(ptr > self.psize - _NODE):
                raise _Refused
            node = base[page] + ptr
            head = _rows(self.data, node, _NODE_HEAD)
            lo, hi, flags, ksize = (_field(head, f) for f in ("lo", "hi", "flags", "ksize"))
            del head
            body = ptr + _NODE + ksize
            if depth > 1:
                if np.any(body > self.psize):
                    raise _Refused
                level = lo | hi << 16 | flags << 32
                depth -= 1
                continue
            self._leaf(node, body, lo | hi << 16, flags, ksize, base[page], main, name)
            return

    def _pointers(self, base: np.ndarray, page: np.ndarray, slot: np.ndarray, near: np.ndarray) -> np.ndarray:
        """Each node's pointer: its page's ``near`` ones (read with the header), the rest read."""
        known = near.shape[1]
        if len(slot) and int(slot.max()) < known:
            return near[page, slot].astype(np.int64)
        ptr = np.empty(len(slot), dtype=np.int64)
        close = slot < known
        ptr[close] = near[page[close], slot[close]]
        far = ~close
        ptr[far] = _rows(self.data, base[page[far]] + _HEADER + 2 * slot[far], _U16)
        return ptr

    def _pages(self, level: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Check a level's page headers; each page's offset, node area's end, node count, and
        its first node pointers (read with the header, whether or not they are in use)."""
        if np.any(level < 2) or np.any(level > self.last):
            raise _Refused
        seen = self.seen
        if np.any(seen[level]):
            raise _Refused
        before = np.count_nonzero(seen)
        seen[level] = True
        if np.count_nonzero(seen) - before != len(level):  # a page listed twice in this level
            raise _Refused
        base = level * self.psize
        head = _rows(self.data, base, _PAGE_START if self.psize >= _PAGE_START.itemsize else _PAGE_HEAD)
        own = head["pgno"]
        flags, lower, upper = (_field(head, f) for f in ("flags", "lower", "upper"))
        near = head["ptrs"] if "ptrs" in (head.dtype.names or ()) else np.zeros((len(level), 0), _U16)
        del head
        kind = flags & ~_IGNORED_FLAGS
        if np.any(own != level.astype(np.uint64)) or np.any(kind != (_P_LEAF if depth == 1 else _P_BRANCH)):
            raise _Refused
        if np.any(lower & 1) or np.any(lower < _HEADER) or np.any(lower > upper) or np.any(upper > self.psize):
            raise _Refused
        count = (lower - _HEADER) // 2
        if depth > 1 and np.any(count < 1):
            raise _Refused
        return base, upper, count, near

    def _leaf(self, node: np.ndarray, body: np.ndarray, size: np.ndarray, flags: np.ndarray, ksize: np.ndarray,
              base: np.ndarray, main: bool, name: bytes | None) -> None:
        """A leaf level: its odd nodes checked; for a named database, its keys listed. (The keys
        are read apart from the node headers, once their sizes are checked: read with them, the
        wider rows raised the RSS a store keeps after its open by ~60 B per record at 10^6.)"""
        psize = self.psize
        common = (flags == 0) & (body + size <= psize)
        if not np.all(common):
            self._odd_nodes(np.flatnonzero(~common), node, body, size, flags, ksize, base, main)
        if name is None:
            return
        count = len(node)
        width = int(ksize[0]) if count else 0
        keys = None
        if count and np.all(ksize == width):
            if width:
                keys = _rows(self.data, node + _NODE, width, out=unpooled(count, np.dtype(f"V{width}")))
                keys = keys.view(np.uint8).reshape(count, width)
            else:
                keys = np.zeros((count, 0), np.uint8)
        values, at = unpooled(count, np.int64), unpooled(count, np.int64)
        values[:] = size
        np.copyto(at, np.where(flags & _F_BIGDATA, -1, base + body))
        self.leaves[name] = Leaves(count, width, keys, values, at, psize)

    def _odd_nodes(self, odd: np.ndarray, node: np.ndarray, body: np.ndarray, size: np.ndarray, flags: np.ndarray,
                   ksize: np.ndarray, base: np.ndarray, main: bool) -> None:
        """The nodes that are not a plain value inside the page: overflow values and, in the
        main database, named databases."""
        psize, data = self.psize, self.data
        f = flags[odd]
        if np.any(f & _F_DUPDATA) or np.any(f & ~(_F_BIGDATA | _F_SUBDATA)):
            raise _Refused
        big = odd[(f & _F_BIGDATA) != 0]
        if len(big):
            if np.any(body[big] + 8 > psize):
                raise _Refused
            first = _rows(data, base[big] + body[big], _U64).astype(np.int64)
            pages = -(-(size[big] + _HEADER) // psize)
            if np.any(first < 2) or np.any(first + pages - 1 > self.last):
                raise _Refused
        rest = odd[(f & _F_BIGDATA) == 0]
        if np.any(body[rest] + size[rest] > psize):
            raise _Refused
        for i in rest[(flags[rest] & _F_SUBDATA) != 0]:
            if not main:
                raise _Refused
            key_at = int(node[i]) + _NODE
            key = bytes(data[key_at : key_at + int(ksize[i])])
            at = int(base[i] + body[i])
            self.tree(bytes(data[at : at + int(size[i])]), name=key if key in self.names else None)


def listed_records(leaves: dict[bytes, Leaves], data: np.ndarray, entry_sizes: tuple[int, ...], now: float) -> RecordColumns | None:
    """Every record of the ``blocks`` database, oldest stamp first, as columns read from the
    walk's leaves: a record with an index entry takes its stamp from it, and a split one its
    stored size too; a whole one the pages of its value's length, and a joined record (no
    entry, :mod:`kvtier.backends.lmdb_layout`) those and the stamp ``now`` (read from its leaf node: no page of the value is touched). Index entries
    without a value are left out. ``None`` when this form does not apply (no blocks database
    yet, keys of several sizes, an index entry that is not inline): the caller reads with a
    cursor then. ``DamagedEnvironment`` for an index entry of a size no layout writes."""
    index, blocks = leaves.get(b"index"), leaves.get(b"blocks")
    if blocks is None or blocks.keys is None or not blocks.key_size:
        return None
    count, width, psize = blocks.count, blocks.key_size, blocks.psize
    # In place, on maps of their own (kvtier.bulk.unpooled): every temporary array of a
    # record's width that is freed before the keys are made stays in the heap under them
    # (about 8 B per record each, bench_scale.py's RSS).
    stamps = unpooled(count, np.float64)
    stamps.fill(now)
    stored = unpooled(count, np.int64)
    stored[:] = blocks.values
    stored += _HEADER + psize - 1
    stored //= psize
    stored *= psize  # each value's pages, as a save counts them
    one_stamp = True
    if index is not None and index.count:
        if index.keys is None or index.key_size != width:
            return None
        bad = np.flatnonzero(~np.isin(index.values, entry_sizes))
        if len(bad):
            raise DamagedEnvironment(
                f"index entry is not readable: index entry of {int(index.values[bad[0]])} bytes (expected one of {entry_sizes})"
            )
        if np.any(index.at < 0):
            return None
        if index.count == count and np.array_equal(index.keys, blocks.keys):
            pos, at, values = np.arange(count), index.at, index.values
        else:  # both in LMDB's key order (memcmp, as ``S`` items compare): each entry's record
            block_keys, index_keys = blocks.keys.view(f"S{width}").reshape(-1), index.keys.view(f"S{width}").reshape(-1)
            pos = np.minimum(np.searchsorted(block_keys, index_keys), count - 1) if count else np.zeros(0, np.int64)
            paired = block_keys[pos] == index_keys if count else np.zeros(len(index_keys), bool)
            pos, at, values = pos[paired], index.at[paired], index.values[paired]
            del block_keys, index_keys
        head = _rows(data, at, _ENTRY_HEAD)  # each entry's <d Q: stamp, stored bytes
        stamps[pos] = head["stamp"]
        # A split record's size is its entry's (its value is the payload alone); a whole one's,
        # its value's (its entry may be from before the record was saved again joined).
        split = values != entry_sizes[0]
        stored[pos[split]] = head["stored"][split]
        del head, pos, at, split, values
        one_stamp = False
    # One row per key as V<width> items: a gather of rows, then one ``bytes`` object each, whole
    # (trailing zero bytes kept, unlike an S<width> array's). Joined records alone share one
    # stamp: they are in order already.
    rows = blocks.keys.view(f"V{width}").reshape(-1)
    if one_stamp:
        return RecordColumns(rows.tolist(), stored, stamps, oldest_first=True)
    order = np.argsort(stamps, kind="stable")
    keys = rows[order].tolist()
    return RecordColumns(keys, np.take(stored, order, out=unpooled(count, np.int64), mode="clip"),
                         np.take(stamps, order, out=unpooled(count, np.float64), mode="clip"), oldest_first=True)


def leaf_keys(leaves: dict[bytes, Leaves], name: bytes) -> dict[bytes, bytes] | None:
    """The keys of the named database ``name`` (each mapped to itself, as
    :func:`~kvtier.backends.lmdb_pages.check_file_trees` gives them); ``None`` if their sizes differ."""
    found = leaves.get(name)
    if found is None:
        return {}
    if found.keys is None:
        return None
    width = found.key_size
    rows = found.keys.tobytes()
    return {key: key for key in (rows[i : i + width] for i in range(0, len(rows), width))} if width else {b"": b""}


def open_listing(
    path: str, entry_sizes: tuple[int, ...], now: float | None = None
) -> tuple[RecordColumns | None, dict[bytes, bytes] | None, bool]:
    """The page check of ``<path>/data.mdb`` and what it lists: the records as columns
    (:func:`listed_records`; a joined record's stamp ``now``, default the time now), or, when
    that form does not apply, ``None`` and the blocks database's keys for a cursor read of
    the index (``None`` too when there is no file); and whether the index holds an entry
    longer than ``entry_sizes[0]`` (a split record's, or one of an unknown length: ``True``
    when the walk did not list the index)."""
    walked = list_trees(path)
    if walked is None:
        return None, None, False
    leaves, data = walked
    index = leaves.get(b"index")
    split = index is not None and bool(np.any(index.values != entry_sizes[0]))
    columns = listed_records(leaves, data, entry_sizes, time.time() if now is None else now)
    if columns is not None:
        return columns, {}, split
    keys = leaf_keys(leaves, b"blocks")
    del data, walked
    return None, keys if keys is not None else check_file_trees(path, keys_of=b"blocks"), True
