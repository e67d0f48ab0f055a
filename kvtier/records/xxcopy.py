"""XXH3-64 of a prefix and a payload, optionally copying the payload in the same pass.

A raw record's checksum is XXH3-64 over its 24 checked header bytes, its key and its payload
(:func:`~kvtier.records.record.record_checksum`). Loading one copies the payload into its row
and hashes it; saving one copies the block into the record and hashes it. Done as two passes
(or as a Python loop over 64 KiB chunks, each copied then hashed while in cache) the payload is
read twice. :func:`xxh3_copy` does both in one pass: the native extension
(``kvtier/records/_xxh3.c`` and its bindings ``_xxcopy.c``, built at install where a C compiler exists) loads each 64-byte
stripe once, stores it to the destination and feeds it to the XXH3 accumulators from the same
registers, without the GIL (from 16 KiB), on an AVX2 path where the CPU has one; each stripe
also prefetches its source line and its destination line (for writing, where the CPU has
``PREFETCHW``) 1 KiB ahead, so a row not in the caches costs no more than a ``memcpy``'s.

:func:`xxh3_check_copy` is one raw record's whole check in one call: the lengths, its stored
head against the store's, then the copy and the checksum in the pass above (or, with no row,
the checksum of the payload where it lies). A small record's load costs about as much in
Python calls as in bytes moved, so the checks that were a struct unpack, slices, a
concatenation and compares before the fused pass are one call here: the ``lmdb`` tier's
straight reads and the ``file`` tier's plain reads take it.

:func:`xxh3_read_check` is the ``file`` tier's read of one such record in one call: its head
and checksum, then its payload straight into the row, a piece at a time, each piece hashed just
after its ``pread`` lands it (``kvtier/records/_xxread.c``), with no Python between the pieces.

Without the extension (no compiler at install) the same function runs a pure-Python path
(:func:`xxh3_copy_python`) with identical results and errors; so does a CPU without AVX2,
where the extension's portable scalar path ran slower than the Python one (``xxhash``'s own
vector code after a whole copy): 0.35-0.53 of a copy against 0.46-0.71 from 64 KiB to 2 MiB
(``benchmarks/bench_xxcopy.py --paths``). :data:`NATIVE` says whether the extension is
loaded, :data:`PATH` which path this process takes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from kvtier.records.rowhold import (
    DRAIN_WAIT,
    HOLD_RUN_LIMIT,
    holding_rows,
    rows_held,
    rows_hold,
    rows_hold_flag,
    rows_hold_flag_python,
    rows_hold_python,
    rows_let_go,
    rows_let_go_flag,
    rows_let_go_flag_python,
    rows_let_go_python,
)

__all__ = [
    "DRAIN_WAIT",
    "HOLD_RUN_LIMIT",
    "CHECK_GOOD",
    "CHECK_HEAD",
    "CHECK_SHAPE",
    "CHECK_SUM",
    "NATIVE",
    "ONE_ABSENT",
    "ONE_ELSE",
    "ONE_READ",
    "PATH",
    "fused",
    "holding_rows",
    "rows_held",
    "rows_hold",
    "rows_hold_flag",
    "rows_hold_flag_python",
    "rows_hold_python",
    "rows_let_go",
    "rows_let_go_flag",
    "rows_let_go_flag_python",
    "rows_let_go_python",
    "xxh3_check_copy",
    "xxh3_check_copy_native",
    "xxh3_check_copy_python",
    "xxh3_copy",
    "xxh3_copy_native",
    "xxh3_copy_python",
    "xxh3_joined",
    "xxh3_joined_native",
    "xxh3_joined_python",
    "xxh3_read_check",
    "xxh3_read_check_key",
    "xxh3_read_check_key_native",
    "xxh3_read_check_key_python",
    "xxh3_read_check_keys",
    "xxh3_read_check_keys_native",
    "xxh3_read_check_keys_python",
    "xxh3_read_check_native",
    "xxh3_read_check_python",
    "xxh3_read_job",
    "xxh3_read_one",
    "xxh3_read_one_native",
    "xxh3_read_one_python",
    "xxh3_read_rows",
]

try:
    from kvtier.records import _xxcopy  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the Python path below
    _xxcopy = None

_SUM = struct.Struct("<Q")
_C_INT = struct.Struct("i")
#: XXH3's short forms take inputs up to this many bytes whole: such a record is read in one piece.
_SHORT_MAX = 240
#: (``O_NONBLOCK``: a FIFO in a record's place is not waited on; its read fails.)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)

#: Whether the native extension is loaded.
NATIVE: bool = _xxcopy is not None
#: Whether the default functions take the native one: built, and with a vector path here.
_VECTOR = _xxcopy is not None and _xxcopy.path != "scalar"
#: The path :data:`xxh3_copy` takes: the native one (``"avx2"``), or ``"python"``.
PATH: str = _xxcopy.path if _VECTOR else "python"


def _flat(obj: Any, what: str, expected: str) -> memoryview:
    """``obj``'s buffer as a flat run of bytes, or the error naming ``what`` (``expected``: the
    kind of object it should have been)."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what}: expected {expected}, got {type(obj).__name__}") from None
    if not view.c_contiguous:
        raise ValueError(f"{what}: expected a contiguous buffer ({type(obj).__name__} is not)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _readable(obj: Any, what: str) -> Any:
    """``obj`` as a flat run of bytes (``bytes`` as it is), or the error naming ``what``."""
    return obj if type(obj) is bytes else _flat(obj, what, "a bytes-like object")


def xxh3_copy_python(prefix: Any, src: Any, dst: Any = None) -> int:
    """:func:`xxh3_copy` in Python: the same digest, the same copy, the same errors (but for an
    overlap with a read-only source, which is copied right rather than refused). The whole
    copy (``memoryview`` assignment), then one XXH3 of it while it is in the cache: faster than
    64 KiB pieces each copied then hashed, whose slicing and calls cost more than they save."""
    source = _readable(src, "src")
    h = xxhash.xxh3_64(_readable(prefix, "prefix"))
    if dst is None:
        h.update(source)
        return h.intdigest()  # type: ignore[no-any-return]
    out = _flat(dst, "dst", "a writable bytes-like object")
    if out.readonly:
        raise TypeError(f"dst: expected a writable buffer (this {type(dst).__name__} is read-only)")
    n = len(source)
    if len(out) != n:
        raise ValueError(f"dst: holds {len(out)} bytes, src {n}: they must be the same size")
    # Overlap is refused where the source is writable memory (as the native pass refuses it);
    # a read-only source (bytes, a store's mapped value) is not looked at, which saves a
    # microsecond a call, and the copy below would be right even then (memoryview assignment
    # copies overlapping buffers as memmove does, and the hash reads the copy).
    writable_source = type(source) is memoryview and not source.readonly
    if n and writable_source and np.may_share_memory(np.frombuffer(out, dtype=np.uint8), np.frombuffer(source, dtype=np.uint8)):
        raise ValueError("dst: overlaps src")
    out[:] = source
    h.update(out)
    return h.intdigest()  # type: ignore[no-any-return]


#: The native function (``None`` without the extension).
xxh3_copy_native: Callable[..., int] | None = _xxcopy.xxh3_64_copy if _xxcopy is not None else None

#: ``xxh3_copy(prefix, src, dst=None) -> int``: ``xxhash.xxh3_64(prefix + src).intdigest()``,
#: copying ``src`` into ``dst`` on the way when given (writable, contiguous, the same size, not
#: overlapping ``src``: a :class:`TypeError` or :class:`ValueError` naming the argument
#: otherwise), for inputs of any length. The native function where built with a vector path
#: (:data:`PATH`), else :func:`xxh3_copy_python`. Callers look it up here at each use (``xxcopy.xxh3_copy``), so a
#: test can put either path in its place.
xxh3_copy: Callable[..., int] = xxh3_copy_native if _VECTOR and xxh3_copy_native is not None else xxh3_copy_python


def xxh3_joined_python(head: Any, key: Any, src: Any) -> bytes:
    """:func:`xxh3_joined` in Python: the same bytes."""
    h = xxhash.xxh3_64(_readable(head, "head"))
    h.update(_readable(key, "key"))
    source = _readable(src, "src")
    h.update(source)
    return bytes(head) + _SUM.pack(h.intdigest()) + source


#: The native function (``None`` without the extension).
xxh3_joined_native: Callable[..., bytes] | None = _xxcopy.xxh3_64_joined if _xxcopy is not None else None

#: ``xxh3_joined(head, key, src) -> bytes``: ``head``, then the XXH3-64 of ``head + key + src``
#: (8 bytes, little-endian), then ``src``, as one new ``bytes``: a whole raw record (its checked
#: header bytes, its checksum, its payload) built with the payload copied in the checksum's pass.
#: The native function where :data:`xxh3_copy` is native, else :func:`xxh3_joined_python`;
#: looked up here at each use.
xxh3_joined: Callable[..., bytes] = xxh3_joined_native if _VECTOR and xxh3_joined_native is not None else xxh3_joined_python


#: What :func:`xxh3_check_copy` found, in the order it looks: a good record (copied, its
#: checksum matches); not a record for the row (a length is off: the row untouched); a stored
#: head other than the expected one (the row untouched); a checksum mismatch (the row written).
CHECK_GOOD, CHECK_SHAPE, CHECK_HEAD, CHECK_SUM = 0, 1, 2, 3


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def xxh3_check_copy_python(head: Any, key: Any, stored: Any, dst: Any, payload: Any = None) -> int:
    """:func:`xxh3_check_copy` in Python: the same outcome, the same copy, the same errors."""
    expected = _readable(head, "head")
    prefix = bytes(expected) + bytes(_readable(key, "key"))
    record = _readable(stored, "stored")
    out = None if dst is None else _flat(dst, "dst", "a writable bytes-like object")
    if out is not None and out.readonly:
        raise TypeError(f"dst: expected a writable buffer (this {type(dst).__name__} is read-only)")
    source = None if payload is None else _readable(payload, "payload")
    hlen = len(expected)
    n = len(out) if out is not None else len(source) if source is not None else max(0, len(record) - hlen - 8)
    if source is None:
        if len(record) != hlen + 8 + n:
            return CHECK_SHAPE
        source = memoryview(record)[hlen + 8 :]
    elif len(record) != hlen + 8 or len(source) != n:
        return CHECK_SHAPE
    if record[:hlen] != expected:
        return CHECK_HEAD
    source = memoryview(source)
    if out is None:
        checked: Any = source
    else:
        if n and abs(_address(out) - _address(source)) < n:
            raise ValueError("dst: overlaps the payload")
        at, stored_at = _address(out), _address(memoryview(record))
        if n and at < stored_at + len(record) and stored_at < at + n:
            raise ValueError("dst: overlaps stored")
        out[:] = source
        checked = out
    h = xxhash.xxh3_64(prefix)
    h.update(checked)
    return CHECK_GOOD if h.intdigest() == _SUM.unpack_from(record, hlen)[0] else CHECK_SUM


#: The native function (``None`` without the extension).
xxh3_check_copy_native: Callable[..., int] | None = _xxcopy.xxh3_64_check_copy if _xxcopy is not None else None

#: ``xxh3_check_copy(head, key, stored, dst, payload=None) -> int``: one raw record checked
#: and copied into ``dst`` in one call (one of the ``CHECK_*`` outcomes). ``stored`` begins
#: with the stored head (``len(head)`` bytes, which must equal ``head``) and its checksum (8
#: bytes, little-endian: the XXH3-64 of ``head + key + payload``); the payload follows in
#: ``stored`` (a joined record: ``stored`` is then ``len(head) + 8 + len(dst)`` bytes) or is
#: given apart (``len(dst)`` bytes, ``stored`` then exactly ``len(head) + 8``). The copy and
#: the checksum are one pass, as in :data:`xxh3_copy`; a ``dst`` over the payload or ``stored`` is
#: refused (:class:`ValueError`). ``dst`` ``None``: the record is only
#: checked, its payload read where it is (a row a read just filled). The native function where
#: :data:`xxh3_copy` is native, else :func:`xxh3_check_copy_python`; looked up here at each use.
xxh3_check_copy: Callable[..., int] = (
    xxh3_check_copy_native if _VECTOR and xxh3_check_copy_native is not None else xxh3_check_copy_python
)


def _read_check_args(head: Any, key: Any, stored: Any, row: Any, piece: int) -> tuple[memoryview, bytes, memoryview, memoryview]:
    """The checks of :func:`xxh3_read_check_python`'s arguments, in the native call's order:
    the expected head, the prefix hashed (head and key), ``stored`` and ``row`` as views."""
    if piece < 0:
        raise ValueError(f"piece: expected a count of bytes >= 0, got {piece}")
    expected = _readable(head, "head")
    prefix = bytes(expected) + bytes(_readable(key, "key"))
    into, out = _writable(stored, "stored"), _writable(row, "row")
    hlen, n = len(expected), len(out)
    if len(into) != hlen + 8:
        raise ValueError(f"stored: holds {len(into)} bytes, expected len(head) + 8 = {hlen + 8}")
    if n and _address(out) < _address(into) + hlen + 8 and _address(into) < _address(out) + n:
        raise ValueError("row: overlaps stored")
    return memoryview(expected), prefix, into, out


def xxh3_read_check_python(fd: int, head: Any, key: Any, stored: Any, row: Any, piece: int) -> int:
    """:func:`xxh3_read_check` in Python: the same reads (``os.preadv``), outcome and errors."""
    expected, prefix, into, out = _read_check_args(head, key, stored, row, piece)
    hlen, n = len(expected), len(out)
    if not piece or len(prefix) + n <= _SHORT_MAX:
        piece = n  # (the native pass hashes inputs this short in one piece)
    spare = bytearray(1)  # a record of the right length never reaches it
    first = min(n, piece)
    if os.preadv(fd, [into, out[:first], spare] if first == n else [into, out[:first]], 0) != hlen + 8 + first:
        return CHECK_SHAPE
    if into[:hlen] != expected:
        return CHECK_HEAD
    h = xxhash.xxh3_64(prefix)
    h.update(out[:first])
    at = first
    while at < n:
        end = min(at + piece, n)
        if os.preadv(fd, [out[at:end], spare] if end == n else [out[at:end]], hlen + 8 + at) != end - at:
            return CHECK_SHAPE
        h.update(out[at:end])
        at = end
    return CHECK_GOOD if h.intdigest() == _SUM.unpack_from(into, hlen)[0] else CHECK_SUM


#: The native function (``None`` without the extension).
xxh3_read_check_native: Callable[..., int] | None = _xxcopy.xxh3_64_read_check if _xxcopy is not None else None

#: ``xxh3_read_check(fd, head, key, stored, row, piece) -> int``: one raw record read from the
#: file ``fd`` (from offset 0) and checked in one call, one of the ``CHECK_*`` outcomes. Its
#: stored head and checksum go into ``stored`` (``len(head) + 8`` bytes, which must begin with
#: ``head``), its payload into ``row``, ``piece`` bytes a ``preadv`` (``0``: one ``preadv``),
#: each piece hashed just after it lands, while it is in this core's cache; the last read also
#: offers a spare byte, so a longer file is refused as a shorter one is (``CHECK_SHAPE``). The
#: checksum is the XXH3-64 of ``head + key + payload``. ``OSError`` where a read fails;
#: :class:`ValueError` or :class:`TypeError` naming a bad argument. The native function reads
#: and hashes without the GIL and with no Python between the pieces; it is taken where
#: :data:`xxh3_copy` is native, else :func:`xxh3_read_check_python`; looked up here at each use.
xxh3_read_check: Callable[..., int] = (
    xxh3_read_check_native if _VECTOR and xxh3_read_check_native is not None else xxh3_read_check_python
)


def xxh3_read_check_key_python(dir_fd: int, head: Any, key: Any, row: Any, piece: int) -> int:
    """:func:`xxh3_read_check_key` in Python: the same open, reads, outcome and errors."""
    if dir_fd < 0:
        raise ValueError(f"dir_fd: expected an open file descriptor, got {dir_fd}")
    name = f"{bytes(_readable(key, 'key')).hex()}.kvb".encode()
    stored = bytearray(len(_readable(head, "head")) + 8)
    _read_check_args(head, key, stored, row, piece)  # (every argument checked before the open)
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        return xxh3_read_check_python(fd, head, key, stored, row, piece)
    finally:
        os.close(fd)


#: The native function (``None`` without the extension, or one built before it).
xxh3_read_check_key_native: Callable[..., int] | None = getattr(_xxcopy, "xxh3_64_read_check_key", None)

#: ``xxh3_read_check_key(dir_fd, head, key, row, piece) -> int``: :func:`xxh3_read_check` of
#: the file ``key.hex() + ".kvb"`` (the ``file`` tier's flat records) opened beneath ``dir_fd``
#: (``O_NOFOLLOW``, ``O_CLOEXEC``, ``O_NONBLOCK``: a FIFO is not waited on) and closed in the
#: same call, one call a record from open to close, the stored head and checksum read into a
#: buffer of the call's own. The name is made and the
#: buffer found in the native call: 0.4 µs of a record's Python work (``key.hex()``, the
#: f-string, ``bytearray``) where a 4 KiB record's read takes about 2. ``OSError`` naming the
#: file (as bytes) where it cannot be opened. The native function where :data:`xxh3_copy` is
#: native, else :func:`xxh3_read_check_key_python`; looked up here at each use.
xxh3_read_check_key: Callable[..., int] = (
    xxh3_read_check_key_native if _VECTOR and xxh3_read_check_key_native is not None else xxh3_read_check_key_python
)


def xxh3_read_check_keys_python(dir_at: Any, head: Any, keys: Sequence[Any], rows: Sequence[Any], piece: int, found: list[bool]) -> list[int]:
    """:func:`xxh3_read_check_keys` in Python: :func:`xxh3_read_check_key_python` a record."""
    if piece < 0:
        raise ValueError(f"piece: expected a count of bytes >= 0, got {piece}")
    if not isinstance(found, list):
        raise TypeError(f"found: expected a list, got {type(found).__name__}")
    if len(rows) != len(keys) or len(found) != len(keys):
        raise ValueError(f"rows, found: expected {len(keys)} each (one per key), got {len(rows)} and {len(found)}")
    fd_at = memoryview(dir_at).cast("B")
    if len(fd_at) != _C_INT.size:
        raise ValueError(f"dir_at: expected an aligned C int holding the directory's descriptor, got {len(fd_at)} bytes")
    fd_at = fd_at.cast("i")
    rest: list[int] = []
    for i, (key, row) in enumerate(zip(keys, rows)):
        if (dir_fd := fd_at[0]) < 0:  # the directory is closing: no more opens
            rest.extend(range(i, len(keys)))
            break
        try:
            sound = xxh3_read_check_key_python(dir_fd, head, key, row, piece) == CHECK_GOOD
        except FileNotFoundError:  # (only its open says so: a read never does)
            continue
        except OSError:
            sound = False
        if sound:
            found[i] = True
        else:
            rest.append(i)
    return rest


#: The native function (``None`` without the extension, or one built before it).
xxh3_read_check_keys_native: Callable[..., list[int]] | None = getattr(_xxcopy, "xxh3_64_read_check_keys", None)

#: ``xxh3_read_check_keys(dir_at, head, keys, rows, piece, found) -> list[int]``: a job of
#: :func:`xxh3_read_check_key` calls in one, each key's record into its row: ``found[i]`` set
#: ``True`` for each record read and checked, and the positions left to a general read returned
#: (a record that failed a check or a read, an open that failed but for ``ENOENT``); an absent
#: record is neither (a miss). ``dir_at`` is a C ``int`` (a ``ctypes.c_int``) holding the
#: directory's descriptor, read again before each record's open: once it is negative (the
#: directory is being closed) no record is opened, and every one left is returned. The native
#: function hands the GIL over once a job, not once a record (0.5-1 µs of Python and hand-overs
#: a record: a tenth of a 64 KiB read). The native function where :data:`xxh3_copy` is native,
#: else :func:`xxh3_read_check_keys_python`; looked up here at each use.
xxh3_read_check_keys: Callable[..., list[int]] = (
    xxh3_read_check_keys_native if _VECTOR and xxh3_read_check_keys_native is not None else xxh3_read_check_keys_python
)


#: What :func:`xxh3_read_one` says of its record: read and checked; absent (a miss); anything
#: else (a failed check or read, another open error, the directory closing): a general read's.
ONE_READ, ONE_ABSENT, ONE_ELSE = 0, 1, 2


def xxh3_read_one_python(under_way: list[None], dir_at: Any, head: Any, key: Any, row: Any, piece: int) -> int:
    """:func:`xxh3_read_one` in Python: :func:`xxh3_read_check_keys_python` of one key."""
    if type(under_way) is not list:
        raise TypeError(f"under_way: expected a list, got {type(under_way).__name__}")
    if piece < 0:
        raise ValueError(f"piece: expected a count of bytes >= 0, got {piece}")
    found = [False]
    under_way.append(None)  # counted before the directory is looked at
    try:
        rest = xxh3_read_check_keys_python(dir_at, head, [key], [row], piece, found)
    finally:
        under_way.pop()
    return ONE_READ if found[0] else ONE_ELSE if rest else ONE_ABSENT


#: The native function (``None`` without the extension, or one built before it).
xxh3_read_one_native: Callable[..., int] | None = getattr(_xxcopy, "xxh3_64_read_one", None)

#: ``xxh3_read_one(under_way, dir_at, head, key, row, piece) -> int``:
#: :func:`xxh3_read_check_keys` of one key, counted among the jobs of ``under_way`` (a list:
#: one entry appended for the call and one popped after it, as ``BeneathRoot.enter`` and
#: ``leave`` count a job) in the same call: :data:`ONE_READ`, :data:`ONE_ABSENT` or
#: :data:`ONE_ELSE`. A job of one record of the ``file`` tier is then one call from its count
#: to its close. The native function where :data:`xxh3_copy` is native, else
#: :func:`xxh3_read_one_python`; looked up here at each use.
xxh3_read_one: Callable[..., int] = xxh3_read_one_native if _VECTOR and xxh3_read_one_native is not None else xxh3_read_one_python


#: ``xxh3_read_rows(under_way, dir_at, head, keys, out, kind, piece, found) -> list[int] | None``:
#: a job from its rows' checks to its records' reads in one native call. ``kind`` is
#: ``(tensor_type, dtype, shape, views, key_bytes)``; each row of ``out`` is taken where
#: ``lmdb_plain.host_view(row, tensor_type, dtype, shape, views)`` would take it (the same C
#: lines, ``_hostrow.h``) and each key is ``bytes`` of ``key_bytes``; then
#: :func:`xxh3_read_check_keys` into those views, counted in ``under_way`` as
#: :func:`xxh3_read_one` counts its key. ``None``, with nothing read or counted, at the first key
#: or row that is not so (the caller's general checks take the job). ``None`` where the native
#: function is not loaded or :data:`xxh3_copy` is not native: the caller then checks its rows
#: and calls :func:`xxh3_read_check_keys` (the same outcome); looked up here at each use.
xxh3_read_rows: Callable[..., list[int] | None] | None = getattr(_xxcopy, "xxh3_64_read_rows", None) if _VECTOR else None


#: ``xxh3_read_job(parts, keys, out) -> list[bool] | tuple[list[bool], list[int]] | None``: a flat
#: ``file`` store's job in one native call, from the checks that keep Python out of the rows'
#: getters to the counters. ``parts`` is what ``PlainReads.job_parts`` makes (the root's count
#: and descriptor, the store's head, the rows' ``kind``, the piece, the tier's counters, the
#: record size, the ``devices`` module and torch's two mode checks). ``None``, with nothing read
#: or counted, where ``devices.locate`` is set, a torch function or dispatch mode is on in this
#: thread, or :func:`xxh3_read_rows` would answer ``None``; else :func:`xxh3_read_rows` into a
#: new ``found`` list: ``found`` itself once every record was read or absent, its hits
#: (``blocks_read``, ``bytes_read``) and misses (``read_misses``) counted; ``(found, rest)``,
#: nothing counted, where records are left to the general read. ``None`` where the native
#: function is not loaded or :data:`xxh3_copy` is not native (the tier then takes
#: ``PlainReads.read_one`` and ``read_rows``, the same outcome); looked up here at each use.
xxh3_read_job: Callable[..., Any] | None = getattr(_xxcopy, "xxh3_64_read_job", None) if _VECTOR else None


def _writable(obj: Any, what: str) -> memoryview:
    out = _flat(obj, what, "a writable bytes-like object")
    if out.readonly:
        raise TypeError(f"{what}: expected a writable buffer (this {type(obj).__name__} is read-only)")
    return out


def fused() -> bool:
    """Whether :data:`xxh3_copy` is the native one-pass function: a copy and its check then cost
    about a copy, and splitting them over two threads no longer pays."""
    return xxh3_copy is xxh3_copy_native
