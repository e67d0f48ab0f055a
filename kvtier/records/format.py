"""The on-disk record format shared by every byte backend, and the store-level meta record.

A record is a fixed 32-byte little-endian header followed by the payload::

    offset size field
    0      4    magic            b"KVTB"
    4      1    format version   RECORD_VERSION (1)
    5      1    codec id         see kvtier.records.codec.BUILTIN_CODEC_IDS
    6      1    dtype code       DTYPE_CODES; tells a shuffling codec the element width
    7      1    flags            0, or the MAC of a keyed record: FLAG_MAC_GMAC, FLAG_MAC_BLAKE3
                                 or FLAG_MAC (HMAC-SHA256); any other value is a format this
                                 build cannot read
    8      8    raw length       bytes of the block once decoded
    16     8    stored length    bytes of payload that follow the header (and the tag)
    24     8    checksum         XXH3-64 over header[0:24] + the 32-byte key + payload (0 when keyed)
    32     32   tag              keyed records only: the MAC over the same bytes (AES-GMAC:
                                 a 16-byte salt, then the 16-byte GMAC tag)

**Keyed records** carry a MAC instead of the checksum (a MAC flag, and the tag after the header):
:mod:`kvtier.records.mac` describes the three algorithms and which records each one reads. A
keyed store's meta record names its algorithm, and a tier that cannot read that algorithm's
records is refused at open (``check_meta``).

XXH3 rather than CRC32C: both catch bit rot and torn writes, and XXH3 runs at about 54 GB/s here
against 23 GB/s for hardware CRC32C, which kept loads from a warm LMDB at 0.6-0.75 of a raw get
(the check is a second pass over every loaded block).

The key is bound into the checksum but not stored, so a record copied or renamed under another
key fails its check. Readers parse and check the header *before* touching the payload: magic,
version, the raw length against the store's block size and the stored length against the bytes
actually present; only then is anything decoded, into a buffer of exactly the raw length. An
unknown version raises :class:`~kvtier.records.codec.UnsupportedRecordError` (a miss, never parsed);
every other failure raises :class:`~kvtier.errors.CorruptBlockError`.

The meta record (``encode_meta`` / ``decode_meta``) says which format version and namespace a
store holds: ``b"KVTM"``, a version byte, a CRC32C of the body, then a msgpack map (never
pickle). A store whose meta record names a different namespace digest, block size or dtype is
refused at open with a :class:`~kvtier.errors.ConfigError` (see ``check_meta``): its records
could never be hits, and silently wiping another model's cache would be worse.

Changing any byte of this layout is a format break: bump ``RECORD_VERSION`` and update the
golden vector in ``tests/test_record.py``.

The code lives by concern in :mod:`kvtier.records.record` (header, encode, check and decode),
:mod:`kvtier.records.mac` (keyed records), :mod:`kvtier.records.meta` (the meta record) and
:mod:`kvtier.records.record_backend` (the base class of record backends); every name stays
importable from here, its documented path.
"""

from __future__ import annotations

from kvtier.records.mac import (
    DEFAULT_MAC_ALGORITHM,
    FLAG_MAC,
    FLAG_MAC_BLAKE3,
    FLAG_MAC_GMAC,
    MAC_ALGORITHMS,
    MAC_FLAGS,
    MAC_TAG_SIZE,
    RecordAuthError,
    RecordMac,
)
from kvtier.records.meta import META_MAGIC, META_VERSION, StoreMeta, check_meta, decode_meta, encode_meta
from kvtier.records.record import (
    COPY_CHUNK,
    DTYPE_CODES,
    HEAD_MAX,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    RECORD_VERSION,
    RecordHeader,
    check_digest,
    crc32c,
    decode_payload,
    decode_record,
    dtype_code,
    encode_record,
    parse_header,
    payload_hasher,
    record_checksum,
    verify_payload,
)
from kvtier.records.record_backend import PersistentRecordBackend, RecordBackend

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "HEAD_MAX",
    "MAGIC",
    "META_MAGIC",
    "META_VERSION",
    "COPY_CHUNK",
    "RECORD_VERSION",
    "DTYPE_CODES",
    "FLAG_MAC",
    "FLAG_MAC_BLAKE3",
    "FLAG_MAC_GMAC",
    "DEFAULT_MAC_ALGORITHM",
    "MAC_ALGORITHMS",
    "MAC_FLAGS",
    "MAC_TAG_SIZE",
    "RecordAuthError",
    "RecordMac",
    "PersistentRecordBackend",
    "RecordBackend",
    "RecordHeader",
    "StoreMeta",
    "check_digest",
    "check_meta",
    "crc32c",
    "decode_meta",
    "decode_payload",
    "decode_record",
    "dtype_code",
    "encode_meta",
    "encode_record",
    "parse_header",
    "payload_hasher",
    "record_checksum",
    "verify_payload",
]
