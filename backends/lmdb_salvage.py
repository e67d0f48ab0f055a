"""Salvage: the sound records of a damaged LMDB environment, read page by page with ``pread``.

When the open-time check (:mod:`kvtier.backends.lmdb_pages`) finds a page LMDB could not walk,
the environment is moved aside and a fresh one started. Before this module, that cost every
record of the tier: one zeroed leaf page discarded the store. Now the records that can still be
read are copied into the fresh environment, so damage to a page costs the records on (or under)
that page, not the tier.

The damaged file is never mapped (LMDB would abort on the page it cannot walk). It is read the
way the page check reads it, but tolerantly: a page that fails a check (its own number, its
type, its node area, a node past its end, a child or overflow run outside the file) is skipped
with everything under it, and the walk goes on. Values are read from their leaf or overflow
pages. **Checksums decide**: a record is copied only when its index entry and value pair up
and its checksum (or keyed MAC) verifies for its key, exactly as a read would check it, and
only when the store's meta record was read and matches this store (namespace, format, keying).
Nothing that fails is copied, so salvage never adds a wrong byte.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lmdb
from kvtier.backends.lmdb_files import META_KEY, DamagedEnvironment, read_meta_pages
from kvtier.backends.lmdb_layout import INDEX, entry_stamp
from kvtier.backends.lmdb_pages import _DB, _HEADER, _IGNORED_FLAGS, _MAIN_DB_AT, _MAX_DEPTH, _NODE, _P_BRANCH, _P_LEAF

from kvtier.backend import BlockFormat
from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.records.format import RecordMac, check_meta, decode_meta, parse_header, verify_payload

__all__ = ["SalvagedRecord", "copy_records", "salvage_records"]

log = logging.getLogger("kvtier.backends.lmdb_tier")

_P_OVERFLOW = 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02


@dataclass(frozen=True, slots=True)
class SalvagedRecord:
    """A record whose check passed: its key, index entry and value, as stored."""

    key: bytes
    entry: bytes
    value: bytes

    @property
    def stamp(self) -> float:
        return entry_stamp(self.entry)[0]


@dataclass(slots=True)
class _Reader:
    fd: int
    psize: int
    last_pgno: int
    seen: set[int] = field(default_factory=set)
    skipped: int = 0  # pages that failed a check (with everything under them)

    def page(self, pgno: int) -> bytes | None:
        if not 2 <= pgno <= self.last_pgno or pgno in self.seen:
            return None
        self.seen.add(pgno)
        page = os.pread(self.fd, self.psize, pgno * self.psize)
        return page if len(page) == self.psize else None

    def tree(self, record: bytes) -> dict[bytes, tuple[int, bytes]]:
        """Leaf nodes of the tree whose database record is ``record``: key -> (flags, value)."""
        out: dict[bytes, tuple[int, bytes]] = {}
        if len(record) != _DB.size:
            return out
        fields = _DB.unpack(record)
        depth, root = fields[2], fields[7]
        if 1 <= depth <= _MAX_DEPTH:
            self._walk(root, depth, out)
        return out

    def _walk(self, pgno: int, depth: int, out: dict[bytes, tuple[int, bytes]]) -> None:
        psize = self.psize
        page = self.page(pgno)
        if page is None:
            self.skipped += 1
            return
        own, _, flags, lower, upper = _HEADER.unpack_from(page, 0)
        kind = flags & ~_IGNORED_FLAGS
        if (
            own != pgno
            or kind not in (_P_BRANCH, _P_LEAF)
            or (kind == _P_LEAF) != (depth == 1)
            or lower & 1
            or not _HEADER.size <= lower <= upper <= psize
        ):
            self.skipped += 1
            return
        count = (lower - _HEADER.size) // 2
        for ptr in struct.unpack_from(f"<{count}H", page, _HEADER.size):
            if not upper <= ptr <= psize - _NODE.size:
                continue
            lo, hi, node_flags, ksize = _NODE.unpack_from(page, ptr)
            body = ptr + _NODE.size + ksize
            if body > psize:
                continue
            if kind == _P_BRANCH:
                self._walk(lo | hi << 16 | node_flags << 32, depth - 1, out)
                continue
            value = self._value(page, body, lo | hi << 16, node_flags)
            if value is not None:
                out[page[body - ksize : body]] = (node_flags, value)

    def _value(self, page: bytes, body: int, size: int, flags: int) -> bytes | None:
        psize = self.psize
        if flags & _F_BIGDATA and not flags & ~_F_BIGDATA:
            if body + 8 > psize:
                return None
            (first,) = struct.unpack_from("<Q", page, body)
            pages = -(-(size + _HEADER.size) // psize)
            if first < 2 or first + pages - 1 > self.last_pgno:
                return None
            head = os.pread(self.fd, _HEADER.size, first * psize)
            if len(head) < _HEADER.size:
                return None
            own, _, oflags, _, _ = _HEADER.unpack_from(head, 0)
            if own != first or not oflags & _P_OVERFLOW:
                return None
            value = os.pread(self.fd, size, first * psize + _HEADER.size)
            return value if len(value) == size else None
        if flags & ~_F_SUBDATA or body + size > psize:
            return None
        return page[body : body + size]


def salvage_records(path: str, fmt: BlockFormat, mac: RecordMac | None) -> tuple[list[SalvagedRecord], int, str | None]:
    """The records of the environment at ``path`` (its ``data.mdb``) that pass their check;
    with how many records were found but refused, and why nothing could be salvaged (``None``
    when the walk ran). Never raises over the file's contents."""
    try:
        found = read_meta_pages(path)
    except (DamagedEnvironment, OSError) as exc:
        return [], 0, f"its meta pages are unreadable ({exc})"
    if found is None:
        return [], 0, "it has no data file"
    metas = sorted((m for m in found[0] if m is not None), key=lambda m: -m.txnid)
    if not metas:
        return [], 0, "neither meta page is readable"
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        why = "no meta page leads to the store's databases"
        for meta in metas:  # the newer one first; the older is one commit behind
            last = min(meta.last_pgno, max(0, found[1] // meta.psize - 1))
            reader = _Reader(fd, meta.psize, last)
            page = os.pread(fd, meta.psize, (0 if meta is found[0][0] else 1) * meta.psize)
            dbs = {k: v for k, (flags, v) in reader.tree(page[_MAIN_DB_AT : _MAIN_DB_AT + _DB.size]).items() if flags & _F_SUBDATA}
            if not {b"blocks", b"index", b"meta"} <= dbs.keys():
                continue
            stored_meta = reader.tree(dbs[b"meta"]).get(META_KEY)
            try:
                if stored_meta is None:
                    raise CorruptBlockError("no meta record")
                check_meta(decode_meta(stored_meta[1]), fmt, where=f"lmdb {path!r}", mac=mac)
            except (CorruptBlockError, ConfigError) as exc:
                why = f"its meta record cannot vouch for its records ({exc})"
                continue
            blocks, index = reader.tree(dbs[b"blocks"]), reader.tree(dbs[b"index"])
            records = list(_checked(blocks, index, fmt, mac))
            refused = len(blocks.keys() | index.keys()) - len(records)
            return records, refused, None
        return [], 0, why
    finally:
        os.close(fd)


def _checked(blocks: dict[bytes, tuple[int, bytes]], index: dict[bytes, tuple[int, bytes]], fmt: BlockFormat, mac: RecordMac | None) -> Iterator[SalvagedRecord]:
    for key, (_, value) in blocks.items():
        pair = index.get(key)
        if pair is None or len(key) != 32:
            continue
        entry = pair[1]
        try:
            entry_stamp(entry)
            _verify(key, entry, value, fmt, mac)
        except (ValueError, CorruptBlockError):
            continue
        yield SalvagedRecord(key, entry, value)


def _verify(key: bytes, entry: bytes, value: bytes, fmt: BlockFormat, mac: RecordMac | None) -> None:
    """Raise ``CorruptBlockError`` unless the record checks, as a read would check it."""
    head: Any
    if len(entry) == INDEX.size:  # whole layout: the head starts the value
        head = value
        header = parse_header(value, raw_length=fmt.block_bytes, available=len(value), mac=mac)
        payload = memoryview(value)[header.payload_offset : header.payload_offset + header.stored_length]
    else:
        head = entry[INDEX.size :]
        header = parse_header(head, raw_length=fmt.block_bytes, available=len(head) + len(value), mac=mac)
        payload = memoryview(value)[: header.stored_length]
        if len(value) != header.stored_length:
            raise CorruptBlockError(f"value of {len(value)} bytes, its header says {header.stored_length}")
    verify_payload(key, head, header, payload, mac=mac)


def copy_records(env: lmdb.Environment, blocks: Any, index: Any, records: list[SalvagedRecord], *, durable: bool) -> int:
    """Put ``records`` into the (fresh) environment, the most recently used first, in
    transactions of 64; how many went in. A full map (a lowered capacity) or a failing disk
    stops the copy, keeping what is in."""
    records = sorted(records, key=lambda r: -r.stamp)
    kept = 0
    try:
        for start in range(0, len(records), 64):
            chunk = records[start : start + 64]
            with env.begin(write=True) as txn:
                for r in chunk:
                    txn.put(r.key, r.value, db=blocks)
                    txn.put(r.key, r.entry, db=index)
            kept += len(chunk)
        if durable:
            env.sync(True)
    except lmdb.Error as exc:
        log.warning("lmdb: salvage stopped after %d records: %s", kept, exc)
    return kept
