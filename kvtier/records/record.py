"""One record: its header, encoding it, and checking and decoding it on read.

The byte layout, and why it is what it is, is documented in :mod:`kvtier.records.format`;
keyed records (a MAC instead of the checksum) in :mod:`kvtier.records.mac`.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
import xxhash

from kvtier.errors import CorruptBlockError
from kvtier.records import xxcopy
from kvtier.records.codec import Codec, NoneCodec, UnsupportedRecordError, codec_for_id
from kvtier.records.mac import MAC_FLAGS, MAC_TAG_SIZE, RecordAuthError, RecordMac

__all__ = [
    "CHECKED",
    "COPY_CHUNK",
    "DTYPE_CODES",
    "HEADER",
    "HEADER_SIZE",
    "HEAD_MAX",
    "MAGIC",
    "RECORD_VERSION",
    "RecordHeader",
    "check_digest",
    "crc32c",
    "decode_payload",
    "decode_record",
    "dtype_code",
    "encode_record",
    "parse_header",
    "payload_hasher",
    "record_checksum",
    "verify_payload",
]

MAGIC = b"KVTB"
RECORD_VERSION = 1
HEADER = struct.Struct("<4sBBBBQQQ")
HEADER_SIZE = HEADER.size  # 32
CHECKED = 24  # header bytes covered by the checksum (all but the checksum itself)
#: Bytes a reader fetches first to see a header and, for a keyed record, its tag.
HEAD_MAX = HEADER_SIZE + MAC_TAG_SIZE
#: Raw payloads are copied and checked this many bytes at a time (see ``decode_record``).
COPY_CHUNK = 64 << 10

#: dtype name -> (code, element width). Code 0 is "opaque bytes".
DTYPE_CODES: dict[str, tuple[int, int]] = {
    "uint8": (0, 1),
    "bfloat16": (1, 2),
    "float16": (2, 2),
    "float8_e4m3fn": (3, 1),
    "float8_e5m2": (4, 1),
    "float32": (5, 4),
}
_WIDTH_OF_CODE = {code: width for code, width in DTYPE_CODES.values()}


def dtype_code(dtype: str) -> int:
    """The header code for ``dtype``; unknown dtypes are stored as opaque bytes (code 0)."""
    return DTYPE_CODES.get(dtype, (0, 1))[0]


def record_checksum(head: Any, key: bytes, payload: Any) -> int:
    """The record checksum: XXH3-64 over the checked header bytes, the key and the payload."""
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(key)
    h.update(payload)
    return h.intdigest()


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of any contiguous buffer (the C extension only takes read-only, release-free buffers)."""
    if not isinstance(data, bytes):
        data = np.frombuffer(data, dtype=np.uint8)
    return google_crc32c.extend(crc, data)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    version: int
    codec_id: int
    dtype_code: int
    raw_length: int
    stored_length: int
    checksum: int
    flags: int = 0

    @property
    def itemsize(self) -> int:
        return _WIDTH_OF_CODE.get(self.dtype_code, 1)

    @property
    def keyed(self) -> bool:
        return bool(self.flags & MAC_FLAGS)

    @property
    def payload_offset(self) -> int:
        """Where the payload starts: after the header, and after the tag of a keyed record."""
        return HEADER_SIZE + MAC_TAG_SIZE if self.flags & MAC_FLAGS else HEADER_SIZE

    @property
    def record_length(self) -> int:
        return self.payload_offset + self.stored_length



def parse_header(
    buf: Any, *, raw_length: int, available: int | None = None, mac: RecordMac | None = None, any_keying: bool = False
) -> RecordHeader:
    """Parse and check a header without trusting anything after it.

    ``raw_length`` is the store's block size (the only raw length a record may claim);
    ``available`` is the record's full length when known (LMDB value, file size). With ``mac``
    only keyed records are accepted (:class:`RecordAuthError` otherwise); without one a keyed
    record is unsupported. ``buf`` must then also hold the tag (:data:`HEAD_MAX` bytes) for the
    caller to verify it. ``any_keying`` accepts both kinds (offline inspection of headers only).
    """
    if len(buf) < HEADER_SIZE:
        raise CorruptBlockError(f"record truncated: {len(buf)} bytes, the header alone is {HEADER_SIZE}")
    magic, version, codec_id, code, flags, raw, stored, checksum = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad record magic {bytes(magic)!r}")
    if version != RECORD_VERSION or flags & ~MAC_FLAGS or flags & (flags - 1):  # at most one MAC bit
        raise UnsupportedRecordError(f"record format version {version} (flags {flags}) is not supported")
    if any_keying:
        pass
    elif mac is not None and not flags & MAC_FLAGS:
        raise RecordAuthError("record carries no MAC, and this store accepts only keyed records")
    elif mac is None and flags & MAC_FLAGS:
        raise UnsupportedRecordError("record is keyed (MAC), and this store has no MAC secret to check it")
    elif mac is not None and not mac.accepts(flags):
        raise UnsupportedRecordError(f"record is keyed with another MAC (flags {flags}); this store uses {mac.algorithm}")
    offset = HEADER_SIZE + MAC_TAG_SIZE if flags & MAC_FLAGS else HEADER_SIZE
    if raw != raw_length:
        raise CorruptBlockError(f"record claims {raw} raw bytes, the store's block is {raw_length}")
    if stored > raw or (codec_id == NoneCodec.codec_id and stored != raw):
        raise CorruptBlockError(f"record claims {stored} stored bytes for a {raw}-byte block")
    if available is not None and available != offset + stored:
        raise CorruptBlockError(f"record is {available} bytes, its header says {offset + stored}")
    if mac is not None and len(buf) < offset:
        raise CorruptBlockError(f"record truncated: {len(buf)} bytes, the header and tag are {offset}")
    return RecordHeader(version, codec_id, code, raw, stored, checksum, flags)


def encode_record(
    key: bytes, raw: memoryview, codec: Codec, code: int, mac: RecordMac | None = None
) -> tuple[bytes, bytes | memoryview]:
    """Return ``(head, payload)`` for one block; the record is their concatenation.

    ``head`` is the 32-byte header, plus the 32-byte tag when ``mac`` is given. Falls back to
    the raw bytes (codec id 0) whenever the codec does not shrink the block.
    """
    itemsize = _WIDTH_OF_CODE.get(code, 1)
    payload: bytes | memoryview = raw
    codec_id = NoneCodec.codec_id
    if codec.codec_id != NoneCodec.codec_id:
        encoded = codec.encode(raw, itemsize)
        if len(encoded) < len(raw):
            payload, codec_id = encoded, codec.codec_id
    if mac is not None:
        head = HEADER.pack(MAGIC, RECORD_VERSION, codec_id, code, mac.flag, len(raw), len(payload), 0)[:CHECKED]
        return head + bytes(8) + mac.tag(head, key, payload), payload
    head = HEADER.pack(MAGIC, RECORD_VERSION, codec_id, code, 0, len(raw), len(payload), 0)[:CHECKED]
    return head + struct.pack("<Q", record_checksum(head, key, payload)), payload


def decode_record(
    key: bytes, record: Any, out: memoryview, *, available: int | None = None, mac: RecordMac | None = None
) -> RecordHeader:
    """Check ``record`` (header [+ tag] + payload) and decode it into ``out`` (``len(out)`` raw bytes).

    ``out`` holds garbage if the check fails, which callers treat as a miss."""
    view = memoryview(record)
    header = parse_header(view, raw_length=len(out), available=len(view) if available is None else available, mac=mac)
    start = header.payload_offset
    decode_payload(key, view, header, view[start : start + header.stored_length], out, mac=mac)
    return header


def decode_payload(
    key: bytes, head: Any, header: RecordHeader, payload: Any, out: memoryview, *, mac: RecordMac | None = None
) -> None:
    """Check ``payload`` against its parsed ``header`` (``head`` holds the header bytes and, keyed,
    the tag) and decode it into ``out``; for a record whose head is stored apart from its payload.

    A raw, unkeyed payload is copied and checksummed in one pass
    (:func:`kvtier.records.xxcopy.xxh3_copy`: each piece loaded once, stored to ``out`` and
    hashed). So is an AES-GMAC one where the native pass is built
    (:meth:`~kvtier.records.mac.RecordMac.check_native`: the tag checked over the bytes stored
    to ``out``). Another keyed one is copied in chunks of :data:`COPY_CHUNK` bytes, each MACed
    right after it lands in ``out``, while it is still in the CPU cache. ``out`` then holds
    garbage if the check fails. (:mod:`kvtier.records.checks` checks a large job on a side
    thread instead, while this thread copies, where the check is not in the copy's pass.)
    """
    head = memoryview(head)
    if header.codec_id == NoneCodec.codec_id and mac is None and not header.keyed:
        # One pass: each piece of the payload loaded once, stored to out and hashed (xxcopy).
        if xxcopy.xxh3_copy(bytes(head[:CHECKED]) + key, payload, out) != header.checksum:
            raise CorruptBlockError("record checksum mismatch")
        return
    if header.codec_id == NoneCodec.codec_id:
        if mac is not None and header.keyed and mac.native(header.flags):
            # One native pass: each piece loaded once, stored to out and hashed (mac.gmac_copy).
            mac.check_native(head[:CHECKED], key, head[HEADER_SIZE : HEADER_SIZE + MAC_TAG_SIZE], payload, out)
            return
        h = payload_hasher(key, head, header, mac)
        n = len(out)
        for a in range(0, n, COPY_CHUNK):
            b = min(n, a + COPY_CHUNK)
            out[a:b] = payload[a:b]
            h.update(out[a:b])
        check_digest(h, head, header)
        return
    verify_payload(key, head, header, payload, mac=mac)
    codec_for_id(header.codec_id).decode_into(payload, out, header.itemsize)


def payload_hasher(key: bytes, head: memoryview, header: RecordHeader, mac: RecordMac | None) -> Any:
    """A hasher fed with the checked header bytes and the key; the caller feeds it the payload
    (in pieces as they arrive, if it likes) and then calls :func:`check_digest`."""
    if header.keyed:
        if mac is None:  # parse_header refuses this already; never check a keyed record unkeyed
            raise UnsupportedRecordError("record is keyed (MAC), and this store has no MAC secret to check it")
        return mac.start(head[:CHECKED], key, header.flags, header.stored_length, tag=head[HEADER_SIZE : HEADER_SIZE + MAC_TAG_SIZE])
    if mac is not None:
        raise RecordAuthError("record carries no MAC, and this store accepts only keyed records")
    h = xxhash.xxh3_64()
    h.update(head[:CHECKED])
    h.update(key)
    return h


def check_digest(h: Any, head: memoryview, header: RecordHeader) -> None:
    """Raise unless ``h`` (from :func:`payload_hasher`, fed the whole payload) matches the record."""
    if header.keyed:
        if not hmac.compare_digest(h.digest(), bytes(head[HEADER_SIZE : HEADER_SIZE + MAC_TAG_SIZE])):
            raise RecordAuthError("record MAC mismatch (forged, or written with another secret)")
    elif h.intdigest() != header.checksum:
        raise CorruptBlockError("record checksum mismatch")


def verify_payload(key: bytes, header_bytes: Any, header: RecordHeader, payload: Any, *, mac: RecordMac | None = None) -> None:
    """Check the checksum (or, keyed, the MAC) of a record read in pieces (head, then payload).

    ``header_bytes`` holds the header and, for a keyed record, the tag that follows it."""
    head = memoryview(header_bytes)
    if mac is not None and header.keyed and mac.native(header.flags):
        mac.check_native(head[:CHECKED], key, head[HEADER_SIZE : HEADER_SIZE + MAC_TAG_SIZE], payload)
        return
    h = payload_hasher(key, head, header, mac)
    h.update(payload)
    check_digest(h, head, header)

