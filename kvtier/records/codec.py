"""Codecs: the lossless byte transform in front of a byte backend.

A codec turns one raw block (``BlockFormat.block_bytes`` bytes) into a payload and back. The
record header (:mod:`kvtier.records.format`) stores the codec's numeric ``codec_id``, so a record is
decoded by the codec that wrote it even after the store's configured codec changed.

Contract for implementations:

* ``encode(raw, itemsize)`` returns the payload. The caller stores the block raw (codec id 0)
  whenever the payload is not strictly smaller than the raw bytes, so a record never exceeds
  raw length + header.
* ``decode_into(payload, out, itemsize)`` fills the writable buffer ``out`` with exactly
  ``len(out)`` bytes and raises :class:`~kvtier.errors.CorruptBlockError` if the payload decodes
  to anything else. It must never allocate more than ``len(out)`` bytes of output: ``len(out)``
  is the raw length from a header that was already checked, and the payload is untrusted
  (decompression bombs).
* Codecs are immutable value objects; ``to_dict()`` / ``from_dict()`` round-trip them, and they
  are safe to share between threads (per-thread compression contexts live outside the object).

Codec ids 0-63 are reserved for kvtier's built-ins (0 ``none``, 1 ``zstd``, 2 ``zstd-shuffle``);
plugin codecs registered under the ``kvtier.codecs`` entry-point group pick an id from 64-255.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.errors import ConfigError, CorruptBlockError, UnknownNameError

__all__ = [
    "BUILTIN_CODEC_IDS",
    "Codec",
    "NoneCodec",
    "UnsupportedRecordError",
    "codec_for_id",
    "resolve_codec",
]

#: Codec id -> registry name for the built-ins; the header stores the id, never the name.
BUILTIN_CODEC_IDS: dict[int, str] = {0: "none", 1: "zstd", 2: "zstd-shuffle"}


class UnsupportedRecordError(CorruptBlockError):
    """A record this build cannot read (unknown format version or codec id). Served as a miss and
    never parsed further; it is not counted as corrupt."""


class Codec(ABC):
    """A lossless block transform identified in record headers by ``codec_id``."""

    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = -1

    @abstractmethod
    def encode(self, raw: memoryview, itemsize: int) -> bytes | memoryview:
        """Return the payload for ``raw`` (element width ``itemsize`` bytes)."""

    @abstractmethod
    def decode_into(self, payload: memoryview, out: memoryview, itemsize: int) -> None:
        """Fill ``out`` (exactly ``len(out)`` bytes) from ``payload``; ``CorruptBlockError`` otherwise."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Codec:
        options = dict(data)
        options.pop("name", None)
        try:
            return cls(**options)
        except TypeError as exc:
            raise ConfigError(f"codec {cls.name!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class NoneCodec(Codec):
    """Stores blocks as they are."""

    name: ClassVar[str] = "none"
    codec_id: ClassVar[int] = 0

    def encode(self, raw: memoryview, itemsize: int) -> bytes | memoryview:
        return raw

    def decode_into(self, payload: memoryview, out: memoryview, itemsize: int) -> None:
        if len(payload) != len(out):
            raise CorruptBlockError(f"raw payload is {len(payload)} bytes, header says {len(out)}")
        out[:] = payload


def resolve_codec(spec: str | dict[str, Any] | Codec | None) -> Codec:
    """A codec from a name (``"zstd"``), a dict (``{"name": "zstd", "level": 3}``) or an instance."""
    from kvtier import registry  # registry imports nothing of ours; imported late to keep layers one-way

    if spec is None:
        return NoneCodec()
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ConfigError(f"codec: expected a codec name or a dict with a 'name', got {spec!r}")
    cls = registry.codecs.get(spec["name"])
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise ConfigError(f"codec {spec['name']!r}: the registered object is not a kvtier Codec class")
    return cls.from_dict(spec)


_by_id_lock = threading.Lock()
_by_id: dict[int, Codec] = {0: NoneCodec()}


def codec_for_id(codec_id: int) -> Codec:
    """The decoder for a header's codec id; ``CorruptBlockError`` if no installed codec has it."""
    codec = _by_id.get(codec_id)
    if codec is not None:
        return codec
    from kvtier import registry

    with _by_id_lock:
        names = [BUILTIN_CODEC_IDS[codec_id]] if codec_id in BUILTIN_CODEC_IDS else registry.codecs.names()
        for name in names:
            try:
                cls = registry.codecs.get(name)
            except (UnknownNameError, ImportError):
                continue
            if isinstance(cls, type) and issubclass(cls, Codec) and cls.codec_id == codec_id:
                _by_id[codec_id] = cls()  # decoding needs no options (level only matters to encode)
                return _by_id[codec_id]
    raise UnsupportedRecordError(f"record uses codec id {codec_id}, which no installed codec provides")
