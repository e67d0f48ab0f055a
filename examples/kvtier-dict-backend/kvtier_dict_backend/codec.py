"""A codec: inverts every bit. Plugin codecs take a ``codec_id`` from 64 to 255."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtier.errors import CorruptBlockError
from kvtier.records.codec import Codec


@dataclass(frozen=True, slots=True)
class FlipCodec(Codec):
    name: ClassVar[str] = "demo-flip"
    codec_id: ClassVar[int] = 201  # written in every record header: never reuse one

    def encode(self, raw: memoryview, itemsize: int) -> bytes:
        return bytes(b ^ 0xFF for b in raw)

    def decode_into(self, payload: memoryview, out: memoryview, itemsize: int) -> None:
        if len(payload) != len(out):  # never write more than the header's raw length
            raise CorruptBlockError("demo-flip payload length differs from the header's raw length")
        out[:] = bytes(b ^ 0xFF for b in payload)
