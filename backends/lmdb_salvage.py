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
pages. **Checksums decide**: a record is copied only when its value (and its index entry, if it
has one: a joined record has none, :mod:`kvtier.backends.lmdb_layout`) pair up and its checksum (or keyed MAC) verifies for its key, exactly as a read would check it, and
only when the store's meta record was read and matches this store (namespace, format, keying).
Nothing that fails is copied, so salvage never adds a wrong byte.

A record this tier cannot check (keyed, read by a tier without the secret, in a store keyed
before meta records named the MAC; another record format, codec or MAC) is what a read treats
as unsupported: a miss, kept for a reader that can check it. Salvage keeps it too: it is copied
as it was stored, once its header's lengths pair up with its value, and counted apart. It stays
a miss here; a reader that can check it does so on every read, as for any record, so the copy
adds no byte anyone serves unchecked. Dropping it would lose, to a tier that merely lacks the
key, records the keyed tier still serves.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lmdb
from kvtier.backends.lmdb_files import META_KEY, DamagedEnvironment, read_meta_pages
from kvtier.backends.lmdb_layout import INDEX, entry_stamp
from kvtier.backends.lmdb_pages import _DB, _HEADER, _IGNORED_FLAGS, _MAIN_DB_AT, _MAX_DEPTH, _NODE, _P_BRANCH, _P_LEAF

from kvtier.backend import BlockFormat
from kvtier.errors import ConfigError, CorruptBlockError, DiskError
from kvtier.records.codec import UnsupportedRecordError
from kvtier.records.format import RecordMac, check_meta, decode_meta, parse_header, verify_payload
from kvtier.records.meta import NewerMetaError

__all__ = ["SalvagedRecord", "copy_into", "meta_refusal", "salvage_records"]

log = logging.getLogger("kvtier.backends.lmdb_tier")

_P_OVERFLOW = 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02


@dataclass(frozen=True, slots=True)
class SalvagedRecord:
    """A record whose check passed: its key, index entry (``None``: joined) and value, as stored."""

    key: bytes
    entry: bytes | None
    value: bytes


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

    def tree(self, record: bytes, *, lazy: bool = False) -> dict[bytes, tuple[int, Any]]:
        """Leaf nodes of the tree whose database record is ``record``: key -> (flags, value),
        or with ``lazy`` key -> (flags, (file offset, length)) of the value, read later with
        :meth:`read` (a store's values need not fit in memory)."""
        out: dict[bytes, tuple[int, Any]] = {}
        if len(record) != _DB.size:
            return out
        fields = _DB.unpack(record)
        depth, root = fields[2], fields[7]
        if 1 <= depth <= _MAX_DEPTH:
            self._walk(root, depth, out, lazy)
        return out

    def read(self, where: tuple[int, int]) -> bytes | None:
        offset, size = where
        value = os.pread(self.fd, size, offset)
        return value if len(value) == size else None

    def _walk(self, pgno: int, depth: int, out: dict[bytes, tuple[int, Any]], lazy: bool) -> None:
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
                self._walk(lo | hi << 16 | node_flags << 32, depth - 1, out, lazy)
                continue
            where = self._where(page, pgno, body, lo | hi << 16, node_flags)
            if where is None:
                continue
            if lazy:
                out[page[body - ksize : body]] = (node_flags, where)
                continue
            value = page[body : body + where[1]] if where[0] == pgno * psize + body else self.read(where)
            if value is not None:
                out[page[body - ksize : body]] = (node_flags, value)

    def _where(self, page: bytes, pgno: int, body: int, size: int, flags: int) -> tuple[int, int] | None:
        """(file offset, length) of a leaf node's value, once its extent checks."""
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
            return first * psize + _HEADER.size, size
        if flags & ~_F_SUBDATA or body + size > psize:
            return None
        return pgno * psize + body, size


def salvage_records(
    path: str, fmt: BlockFormat, mac: RecordMac | None, put: Callable[[list[SalvagedRecord]], bool], *, batch_bytes: int = 32 << 20
) -> tuple[int, int, str | None, int]:
    """Hand the records of the environment at ``path`` (its ``data.mdb``) that pass their
    check, or that this tier cannot check (see the module doc), to ``put``, most recently used
    first, in batches of about ``batch_bytes`` (``put`` returns ``False`` to stop: a full map).
    Returns how many were handed over, how many were found but refused, why nothing could be
    salvaged (``None`` when the walk ran), and how many of those handed over this tier could not
    check. Never raises over the file's contents; values are read one at a time, never all at once."""
    pages = _meta_pages(path)
    if isinstance(pages, str):
        return 0, 0, pages, 0
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        why = "no meta page leads to the store's databases"
        for reader, dbs, stored_meta in _databases(fd, *pages):
            try:
                if stored_meta is None:
                    raise CorruptBlockError("no meta record")
                check_meta(decode_meta(stored_meta), fmt, where=f"lmdb {path!r}", mac=mac)
            except (CorruptBlockError, ConfigError) as exc:
                why = f"its meta record cannot vouch for its records ({exc})"
                continue
            values = reader.tree(dbs[b"blocks"], lazy=True)
            index = reader.tree(dbs[b"index"])
            kept, refused, unchecked = _hand_over(reader, values, index, fmt, mac, put, batch_bytes)
            return kept, refused, None, unchecked
        return 0, 0, why, 0
    finally:
        os.close(fd)


def meta_refusal(path: str, fmt: BlockFormat, mac: RecordMac | None, *, where: str) -> ConfigError | None:
    """The ``ConfigError`` with which an undamaged store would refuse this tier at open (another
    namespace, block size, dtype or format; keyed, and this tier has no ``mac_key`` or reads
    none of its MAC's records; a newer kvtier's), read from the meta record of the damaged
    environment at ``path`` as salvage reads it; ``None`` when its meta record accepts this
    tier or cannot be read. A tier refused so leaves the environment where it is: moving it
    aside would lose its records to a tier that merely lacks the key or is another model's."""
    pages = _meta_pages(path)
    if isinstance(pages, str):
        return None
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for _, _, stored_meta in _databases(fd, *pages):
            if stored_meta is None:
                continue
            try:
                check_meta(decode_meta(stored_meta), fmt, where=where, mac=mac)
            except NewerMetaError as exc:
                return exc.refusal(where)
            except ConfigError as exc:
                return exc
            except CorruptBlockError:
                continue  # (the older meta page's commit may hold a readable one)
            return None
        return None
    finally:
        os.close(fd)


def _meta_pages(path: str) -> tuple[Any, list[Any]] | str:
    """The environment's meta pages as read (and the file's size), with the readable ones newest
    first; or why there are none."""
    try:
        found = read_meta_pages(path)
    except (DamagedEnvironment, OSError) as exc:
        return f"its meta pages are unreadable ({exc})"
    if found is None:
        return "it has no data file"
    metas = sorted((m for m in found[0] if m is not None), key=lambda m: -m.txnid)
    if not metas:
        return "neither meta page is readable"
    return found, metas


def _databases(fd: int, found: Any, metas: list[Any]) -> Iterator[tuple[_Reader, dict[bytes, Any], bytes | None]]:
    """For each readable meta page, the newer first (the older is one commit behind), whose main
    database names the store's three: a reader of that commit, its databases and its meta record
    (``None``: absent)."""
    for meta in metas:
        reader = _Reader(fd, meta.psize, min(meta.last_pgno, max(0, found[1] // meta.psize - 1)))
        page = os.pread(fd, meta.psize, (0 if meta is found[0][0] else 1) * meta.psize)
        main = reader.tree(page[_MAIN_DB_AT : _MAIN_DB_AT + _DB.size])
        dbs = {k: v for k, (flags, v) in main.items() if flags & _F_SUBDATA}
        if not {b"blocks", b"index", b"meta"} <= dbs.keys():
            continue
        stored = reader.tree(dbs[b"meta"]).get(META_KEY)
        yield reader, dbs, None if stored is None else stored[1]


def _hand_over(
    reader: _Reader,
    values: dict[bytes, tuple[int, Any]],
    index: dict[bytes, tuple[int, Any]],
    fmt: BlockFormat,
    mac: RecordMac | None,
    put: Callable[[list[SalvagedRecord]], bool],
    batch_bytes: int,
) -> tuple[int, int, int]:
    order: list[tuple[float, bytes]] = []
    for key in values.keys():
        if key not in index:
            order.append((float("inf"), key))  # joined: saved since the last stamps were written
            continue
        try:
            order.append((entry_stamp(index[key][1])[0], key))
        except ValueError:
            continue
    order.sort(reverse=True)
    kept = refused = unchecked = 0
    batch: list[SalvagedRecord] = []
    size = batch_unchecked = 0  # (records of the batch this tier cannot check: see the module doc)
    for _, key in order:
        entry, value = index[key][1] if key in index else None, reader.read(values[key][1])
        try:
            if value is None or len(key) != 32:
                raise CorruptBlockError("unreadable")
            batch_unchecked += not _verify(key, entry, value, fmt, mac)
        except CorruptBlockError:
            refused += 1
            continue
        batch.append(SalvagedRecord(key, entry, value))
        size += len(value)
        if size >= batch_bytes:
            if not put(batch):
                return kept, refused, unchecked
            kept, unchecked, batch, size, batch_unchecked = kept + len(batch), unchecked + batch_unchecked, [], 0, 0
    if batch and put(batch):
        kept, unchecked = kept + len(batch), unchecked + batch_unchecked
    return kept, refused + len(index.keys() - values.keys()), unchecked


def _verify(key: bytes, entry: bytes | None, value: bytes, fmt: BlockFormat, mac: RecordMac | None) -> bool:
    """``True`` when the record checks, as a read would check it; ``False`` when this tier
    cannot check it (a read's ``UnsupportedRecordError``: a miss, kept), once its header's
    lengths pair up with its value where this build can parse them; raise ``CorruptBlockError``
    otherwise."""
    head: Any = value
    available = len(value)
    if entry is not None and len(entry) != INDEX.size:  # split: the head is in the index entry
        head = entry[INDEX.size :]
        available += len(head)
    try:
        header = parse_header(head, raw_length=fmt.block_bytes, available=available, mac=mac)
    except UnsupportedRecordError:
        try:
            parse_header(head, raw_length=fmt.block_bytes, available=available, any_keying=True)
        except UnsupportedRecordError:  # another record format: nothing here to check
            pass
        return False
    if head is value:  # joined or whole layout: the head starts the value
        payload = memoryview(value)[header.payload_offset : header.payload_offset + header.stored_length]
    else:
        payload = memoryview(value)
        if len(value) != header.stored_length:
            raise CorruptBlockError(f"value of {len(value)} bytes, its header says {header.stored_length}")
    verify_payload(key, head, header, payload, mac=mac)
    return True


def copy_into(begin: Callable[[], lmdb.Transaction], blocks: Any, index: Any) -> Callable[[list[SalvagedRecord]], bool]:
    """A ``put`` for :func:`salvage_records`: each batch in one write transaction that
    ``begin()`` begins (the store's ``_begin_write``: its file guard asked first); ``False``
    (stop) on an LMDB error, such as a full map under a lowered capacity, or on the guard's
    refusal (``DiskError``: the fresh file was cut short meanwhile)."""

    def put(batch: list[SalvagedRecord]) -> bool:
        try:
            with begin() as txn:
                for r in batch:
                    txn.put(r.key, r.value, db=blocks)
                    if r.entry is not None:
                        txn.put(r.key, r.entry, db=index)
        except (lmdb.Error, DiskError) as exc:
            log.warning("lmdb: salvage stopped: %s", exc)
            return False
        return True

    return put
