"""A minimal third-party kvtier plugin, used by kvtier's own tests and shown in docs/plugins.md.

``DictBackend`` keeps records in a dict (a byte backend: the transfer engine reaches it through
the staging buffer), ``FifoPolicy`` evicts in insertion order, ``FlipCodec`` inverts every bit
(lossless, never smaller, so records are stored raw: it only demonstrates registration).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvtier.backend import Backend, BlockFormat
from kvtier.codec import Codec
from kvtier.errors import ConfigError, CorruptBlockError, LayoutError
from kvtier.policies import EvictionPolicy

__all__ = ["DictBackend", "FifoPolicy", "FlipCodec"]


class DictBackend(Backend):
    """Blocks in a process-local dict, at most ``capacity`` bytes."""

    name: ClassVar[str] = "demo-dict"

    def __init__(self, *, capacity: int | str, label: str = "demo") -> None:
        super().__init__(capacity=capacity)
        if not isinstance(label, str) or not label:
            raise ConfigError(f"label: expected a non-empty string, got {label!r}")
        self.label = label
        self._data: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "label": self.label}

    async def open(self, fmt: BlockFormat) -> None:
        await super().open(fmt)

    async def aclose(self) -> None:
        await super().aclose()
        self._data.clear()

    def _check(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> int:
        size = self._check_open().block_bytes
        if len(keys) != len(blocks):
            raise LayoutError(f"{len(keys)} keys but {len(blocks)} blocks")
        for i, b in enumerate(blocks):
            if b.dtype != torch.uint8 or b.dim() != 1 or b.numel() != size:
                raise LayoutError(f"blocks[{i}] must be a 1-D uint8 tensor of {size} bytes")
        return size

    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        size = self._check(keys, blocks)
        sizes: list[int | None] = []
        with self._lock:
            for key, block in zip(keys, blocks):
                if key not in self._data and (len(self._data) + 1) * size > self.capacity_bytes:
                    self.counters.write_failures += 1
                    sizes.append(None)
                    continue
                self._data[key] = block.cpu().numpy().tobytes()
                sizes.append(size)
        done = sum(s is not None for s in sizes)
        self.counters.blocks_written += done
        self.counters.bytes_written += done * size
        return sizes

    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        size = self._check(keys, out)
        found = []
        for key, dst in zip(keys, out):
            raw = self._data.get(key)
            if raw is None:
                self.counters.read_misses += 1
                found.append(False)
                continue
            dst.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            found.append(True)
        self.counters.blocks_read += sum(found)
        self.counters.bytes_read += sum(found) * size
        return found

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        with self._lock:
            for key in keys:
                if self._data.pop(key, None) is not None:
                    self.counters.deleted += 1


class FifoPolicy(EvictionPolicy):
    """First in, first out: ``touch`` does not change the order."""

    name: ClassVar[str] = "demo-fifo"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order.setdefault(key, None)

    def touch(self, key: bytes) -> None:
        pass

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, protected: Container[bytes] = ()) -> list[bytes] | None:
        victims = [k for k in self._order if k not in protected][: max(n, 0)]
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def order(self) -> list[bytes]:
        return list(self._order)


@dataclass(frozen=True, slots=True)
class FlipCodec(Codec):
    """Inverts every bit. Plugin codecs use ids 64-255."""

    name: ClassVar[str] = "demo-flip"
    codec_id: ClassVar[int] = 201

    def encode(self, raw: memoryview, itemsize: int) -> bytes:
        return bytes(b ^ 0xFF for b in raw)

    def decode_into(self, payload: memoryview, out: memoryview, itemsize: int) -> None:
        if len(payload) != len(out):
            raise CorruptBlockError("demo-flip payload length differs from the header's raw length")
        out[:] = bytes(b ^ 0xFF for b in payload)
