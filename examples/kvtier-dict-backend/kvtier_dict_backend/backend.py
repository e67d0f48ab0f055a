"""A byte backend that keeps every block in a process-local dict."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ConfigError, LayoutError


class DictBackend(Backend):
    """Blocks in a dict, at most ``capacity`` bytes. ``label`` is an example option."""

    name: ClassVar[str] = "demo-dict"

    def __init__(self, *, capacity: int | str, label: str = "demo") -> None:
        super().__init__(capacity=capacity)  # parses and checks the capacity
        if not isinstance(label, str) or not label:
            raise ConfigError(f"label: expected a non-empty string, got {label!r}")
        self.label = label
        self._data: dict[bytes, bytes] = {}  # no I/O in the constructor
        self._lock = threading.Lock()  # the bulk calls run on worker threads

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "label": self.label}

    async def open(self, fmt: BlockFormat) -> None:
        await super().open(fmt)  # checks that the capacity holds one block

    async def aclose(self) -> None:
        await super().aclose()  # later calls raise ClosedError
        self._data.clear()

    def _check(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> int:
        """Reject a malformed call before any write; raises ClosedError after close."""
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
                    self.counters.write_failures += 1  # full: a per-key failure, not an exception
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
        found: list[bool] = []
        with self._lock:
            for key, dst in zip(keys, out):
                raw = self._data.get(key)
                if raw is None:
                    self.counters.read_misses += 1  # a miss leaves out[i] untouched
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
