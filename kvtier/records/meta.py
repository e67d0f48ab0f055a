"""The store-level meta record: which record format, namespace, block size, dtype and MAC a
store holds, so a tier written for anything else is refused at open.

The meta record (``encode_meta`` / ``decode_meta``) says which format version and namespace a
store holds: ``b"KVTM"``, a version byte, a CRC32C of the body, then a msgpack map (never
pickle). A store whose meta record names a different namespace digest, block size or dtype is
refused at open with a :class:`~kvtier.errors.ConfigError` (see ``check_meta``): its records
could never be hits, and silently wiping another model's cache would be worse.

Every meta version keeps that prefix (magic, version byte, CRC32C of the body), so a build can
tell a meta record of a newer version (:class:`NewerMetaError`: its body's CRC holds) from a
damaged one: a newer build's store is refused, never moved aside or emptied by an older build.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from kvtier.backend import BlockFormat
from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.records.codec import UnsupportedRecordError
from kvtier.records.mac import MAC_ALGORITHMS, RecordMac
from kvtier.records.record import RECORD_VERSION, crc32c

__all__ = ["META_MAGIC", "META_VERSION", "NewerMetaError", "StoreMeta", "check_meta", "decode_meta", "encode_meta"]

META_MAGIC = b"KVTM"
META_VERSION = 1
_META_PREFIX = struct.Struct("<4sBI")


class NewerMetaError(UnsupportedRecordError):
    """A sound meta record of a newer version than this build reads: a newer kvtier's store."""

    def refusal(self, where: str) -> ConfigError:
        """The error that refuses the store at ``where`` at open (nothing in it is changed)."""
        return ConfigError(
            f"{where}: {self}: a newer kvtier wrote this store; upgrade kvtier, or point the tier at a new path "
            f"(the store is left as it is)"
        )


@dataclass(frozen=True, slots=True)
class StoreMeta:
    format_version: int
    block_bytes: int
    dtype: str
    namespace_digest: bytes
    namespace: dict[str, Any]
    #: The MAC algorithm of a keyed store's records; ``None`` for an unkeyed store, and for a
    #: keyed one written before the meta record named it (its records are HMAC-SHA256).
    mac: str | None = None
    #: How a directory tier places its records (the ``file`` tier's ``layout``); ``None`` for
    #: a store whose meta record names none (the layout it had before layouts were named).
    layout: str | None = None


def encode_meta(fmt: BlockFormat, mac: RecordMac | None = None, *, layout: str | None = None) -> bytes:
    """The meta record of a store of ``fmt`` records, keyed with ``mac`` (``None``: unkeyed),
    placed by ``layout`` (``None``: the tier's original layout). An unkeyed store's meta record
    has no ``mac`` field, as before keyed stores named theirs, and one of the original layout no
    ``layout`` field."""
    fields: dict[str, Any] = {
        "format_version": RECORD_VERSION,
        "block_bytes": fmt.block_bytes,
        "dtype": fmt.dtype,
        "namespace_digest": fmt.namespace_digest,
        "namespace": fmt.namespace,
    }
    if mac is not None:
        fields["mac"] = mac.algorithm
    if layout is not None:
        fields["layout"] = layout
    body = msgpack.packb(
        fields,
        use_bin_type=True,
        default=str,  # namespace values are plain data; anything else is recorded by its text
    )
    return _META_PREFIX.pack(META_MAGIC, META_VERSION, crc32c(body)) + body


def decode_meta(data: Any) -> StoreMeta:
    data = bytes(data)
    if len(data) < _META_PREFIX.size:
        raise CorruptBlockError("meta record truncated")
    magic, version, crc = _META_PREFIX.unpack_from(data, 0)
    if magic != META_MAGIC:
        raise CorruptBlockError("bad meta record magic")
    body = data[_META_PREFIX.size :]
    if version != META_VERSION:
        if version > META_VERSION and crc32c(body) == crc:
            raise NewerMetaError(f"meta record version {version} is not supported (this kvtier reads version {META_VERSION})")
        raise UnsupportedRecordError(f"meta record version {version} is not supported")
    if crc32c(body) != crc:
        raise CorruptBlockError("meta record checksum mismatch")
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True)
        return StoreMeta(
            format_version=int(fields["format_version"]),
            block_bytes=int(fields["block_bytes"]),
            dtype=str(fields["dtype"]),
            namespace_digest=bytes(fields["namespace_digest"]),
            namespace=dict(fields["namespace"]),
            mac=None if fields.get("mac") is None else str(fields["mac"]),
            layout=None if fields.get("layout") is None else str(fields["layout"]),
        )
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptBlockError(f"meta record is not readable: {exc}") from exc


def check_meta(meta: StoreMeta, fmt: BlockFormat, *, where: str, mac: RecordMac | None = None) -> None:
    """Refuse a store written for another namespace, block size, dtype or format version, and a
    keyed store whose meta record names a MAC algorithm whose records ``mac`` does not read
    (they would all be misses; a store keyed before the meta record named its MAC is accepted),
    and an unkeyed tier (``mac`` ``None``) on a store whose meta record names a MAC: it could check
    none of the store's records, and a local tier would drop every one it read."""
    if mac is None and meta.mac is not None:
        raise ConfigError(
            f"{where}: the store's records are keyed with {meta.mac}, and this tier has no mac_key; "
            f"set mac_key_env (the fleet's secret) and mac_algorithm: {meta.mac}, or point the tier at a new path"
        )
    if mac is not None and meta.mac is not None and not (meta.mac in MAC_ALGORITHMS and mac.accepts(MAC_ALGORITHMS[meta.mac])):
        raise ConfigError(
            f"{where}: the store's records are keyed with {meta.mac}, this tier's mac_algorithm is "
            f"{mac.algorithm}; set mac_algorithm: {meta.mac}, or point the tier at a new path"
        )
    if meta.format_version != RECORD_VERSION:
        raise ConfigError(
            f"{where}: the store holds record format {meta.format_version}, this kvtier writes "
            f"{RECORD_VERSION}; point the tier at a new path"
        )
    mismatch = []
    if meta.namespace_digest != fmt.namespace_digest:
        mismatch.append(f"namespace digest {meta.namespace_digest.hex()[:16]}… != {fmt.namespace_digest.hex()[:16]}…")
    if meta.block_bytes != fmt.block_bytes:
        mismatch.append(f"block_bytes {meta.block_bytes} != {fmt.block_bytes}")
    if meta.dtype != fmt.dtype:
        mismatch.append(f"dtype {meta.dtype!r} != {fmt.dtype!r}")
    if mismatch:
        raise ConfigError(
            f"{where}: the store was written for another namespace ({'; '.join(mismatch)}; stored namespace "
            f"{meta.namespace}). Use one path per model/namespace, or delete the store to reuse the path"
        )

