"""``compressed``: a host-memory tier of compressed records.

Each block is kept as one :mod:`kvtier.records.format` record (header + codec payload) in a dict, and
capacity counts *stored* bytes, so a GiB holds more blocks than the ``cpu`` tier whenever the
codec shrinks the data (bf16 KV with ``zstd-shuffle``: about 1.4x, see ``docs/tiers.md``).

Capacity contract with the manager: ``reserve_bytes()`` is an *estimate* of one block's stored
size: the running average of the sizes written so far plus 5 % headroom, starting from the worst
case (raw block + header) before anything was written. The manager reserves that before a write
and learns the actual size from ``write_blocks``; the backend itself refuses (``None``) a write
that would take it past ``capacity``, so a block larger than its estimate can never overfill it.

Not persistent. Records keep their checksum so a codec bug can never serve wrong bytes.
Thread-safety: the dict and the byte count change under one lock; compression and decompression
run outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvtier.backend import BlockFormat
from kvtier.errors import CorruptBlockError
from kvtier.keys import check_keys
from kvtier.records import xxcopy
from kvtier.records.codec import Codec, UnsupportedRecordError
from kvtier.records.format import HEADER_SIZE, RecordBackend, decode_record

__all__ = ["CompressedBackend"]

_DEFAULT_CODEC: dict[str, Any] = {"name": "zstd-shuffle", "level": 1}
_HEADROOM = 1.05
_SMOOTHING = 0.05  # weight of each new size in the running average


class CompressedBackend(RecordBackend):
    """Compressed records in host memory, at most ``capacity`` stored bytes."""

    name: ClassVar[str] = "compressed"

    def __init__(
        self, *, capacity: int | str, codec: str | dict[str, Any] | Codec | None = None
    ) -> None:
        super().__init__(capacity=capacity, codec=dict(_DEFAULT_CODEC) if codec is None else codec)
        self._records: dict[bytes, bytes] = {}
        self._used = 0
        self._average = 0.0
        self._lock = threading.Lock()

    async def open(self, fmt: BlockFormat) -> None:
        await super().open(fmt)
        self._average = float(fmt.block_bytes + HEADER_SIZE)

    async def aclose(self) -> None:
        await super().aclose()
        with self._lock:
            self._records.clear()
            self._used = 0

    def reserve_bytes(self) -> int:
        worst = self.format.block_bytes + HEADER_SIZE
        if self._average <= 0:  # not opened (kvtier config check's slot count): the worst case
            return worst
        return max(1, min(worst, int(self._average * _HEADROOM)))

    def __len__(self) -> int:
        return len(self._records)

    def stored_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._records)

    @xxcopy.holding_rows  # no collection from a row's view to its copy
    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        self._check_io(keys, blocks)
        records = [b"".join(parts) for parts in self._encode(keys, blocks)]  # one copy per record
        sizes: list[int | None] = []
        with self._lock:
            for key, record in zip(keys, records):
                stored = len(record)
                old = self._records.get(key)
                grow = stored - (len(old) if old is not None else 0)
                if self._used + grow > self.capacity_bytes:
                    sizes.append(None)
                    continue
                self._records[key] = record
                self._used += grow
                self._average += _SMOOTHING * (stored - self._average)
                sizes.append(stored)
        stored_sizes = [s for s in sizes if s is not None]
        self._count_writes(len(stored_sizes), sum(stored_sizes), len(sizes) - len(stored_sizes))
        return sizes

    @xxcopy.holding_rows  # no collection from a row's view to its copy
    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        size = self._check_io(keys, out)
        found: list[bool] = []
        corrupt = 0
        for key, dst in zip(keys, out):
            record = self._records.get(key)  # a dict read is atomic; bytes are immutable
            if record is None:
                found.append(False)
                continue
            view, staging = self._host_view(dst)
            try:
                decode_record(key, record, view)
            except CorruptBlockError as exc:
                if not isinstance(exc, UnsupportedRecordError):
                    corrupt += 1
                self._drop(key, record)
                found.append(False)
                continue
            if staging is not None:
                dst.copy_(staging)
            found.append(True)
        self._count_reads(found, size, corrupt=corrupt)
        return found

    def _drop(self, key: bytes, record: bytes) -> None:
        with self._lock:
            if self._records.get(key) is record:
                del self._records[key]
                self._used -= len(record)
                self._count_deleted(1)

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        check_keys(keys)  # every key before any is deleted
        deleted = 0
        with self._lock:
            for key in keys:
                record = self._records.pop(key, None)
                if record is not None:
                    self._used -= len(record)
                    deleted += 1
        self._count_deleted(deleted)

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        raw = len(self._records) * (self._fmt.block_bytes if self._fmt else 0)
        data.update(
            used_bytes=self._used,
            blocks=len(self._records),
            compression_ratio=(raw / self._used) if self._used else None,
            reserve_bytes=self.reserve_bytes() if self._fmt else None,
        )
        return data
