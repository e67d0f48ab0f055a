"""Memory tiers: one preallocated tensor pool of fixed-size slots.

``cpu`` keeps the pool in host memory (pinned when CUDA is available, so device copies are
asynchronous DMA); ``gpu`` keeps it on a CUDA device (spare HBM, or another GPU). Capacity in
bytes becomes a slot count; slots come from a free list. The pool is allocated in ``open()``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import sys
import threading
from collections.abc import Sequence
from itertools import repeat
from typing import Any, ClassVar

import torch

from kvtier.backend import BlockFormat, MemoryBackend
from kvtier.devices import copy_rows, one_intra_op_thread, tensor_device, usable_cpus, wait_for_copies
from kvtier.errors import BackendError, ConfigError, LayoutError, LifecycleError
from kvtier.keys import check_keys
from kvtier.records.counts import counts_add
from kvtier.units import format_size

__all__ = ["TensorPoolBackend", "CpuBackend", "GpuBackend", "advise_huge_pages"]

log = logging.getLogger("kvtier")

#: Linux's ``MADV_HUGEPAGE`` (the ``mmap`` module has it only for its own maps).
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def _memory_note(device: torch.device) -> str:
    """``", which has 23.5GiB in all"``: the memory to compare a capacity against."""
    try:
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except Exception:
        return ""
    return f", which has {format_size(total)} in all"


#: The most device memory a batched read out of a device pool gathers into at once.
GATHER_BYTES = 64 << 20


def _host_run(pool: torch.Tensor, rows: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``rows`` as one ``[len(rows), row_bytes]`` view when they are consecutive rows of one
    host tensor and ``pool`` lives on a device (what a batched read needs), else ``None``."""
    if len(rows) < 2 or tensor_device(pool).type == "cpu":
        return None
    first = rows[0]
    size = first.numel()
    if tensor_device(first).type != "cpu" or not all(r.is_contiguous() for r in rows):
        return None
    base = first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    for i, r in enumerate(rows):
        if r.data_ptr() != base + i * size or r.untyped_storage().data_ptr() != storage:
            return None
    return first.as_strided((len(rows), size), (size, 1), first.storage_offset())


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask Linux to back ``t``'s memory with transparent huge pages (``madvise(MADV_HUGEPAGE)``
    over the 2 MiB-aligned part of it), before its pages are first touched; return the bytes
    advised (0 where the host or the tensor does not allow it: a failure is only logged).

    A job's copy writes every tensor's share of each of its pool rows, a few 64 KiB pieces 2 MiB
    apart: with 4 KiB pages that is a TLB miss every 4 KiB. Measured here (4 blocks of 32 layers
    into rows of a 3-job pool, alternated in one process): ``index_select`` into the rows 7.09
    against 6.56 GB/s, ``index_copy_`` out of them 4.59 against 4.30."""
    if not sys.platform.startswith("linux") or tensor_device(t).type != "cpu":
        return 0
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(start, end - start, _MADV_HUGEPAGE) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as exc:  # no THP in this kernel, or no libc to ask
        log.debug("huge pages for a %s pool not advised: %s", format_size(end - start), exc)
        return 0
    return end - start


def _fill_zero(rows: torch.Tensor) -> None:
    with one_intra_op_thread():
        rows.fill_(0)


class TensorPoolBackend(MemoryBackend):
    """Slots in one ``[num_slots, block_bytes]`` uint8 tensor on ``device``."""

    name: ClassVar[str] = "pool"

    def __init__(self, *, capacity: int | str, device: str = "cpu", pin_memory: bool | str = "auto") -> None:
        super().__init__(capacity=capacity)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device: cannot parse {device!r} as a torch device") from exc
        if pin_memory not in (True, False, "auto"):
            raise ConfigError(f"pin_memory: expected true, false or 'auto', got {pin_memory!r}")
        self.pin_memory = pin_memory
        self._pool: torch.Tensor | None = None
        self._slot_of: dict[bytes, int] = {}
        self._free: list[int] = []
        self._lock = threading.Lock()
        self.num_slots = 0

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["device"] = str(self.device)
        if self.device.type == "cpu":
            data["pin_memory"] = self.pin_memory
        return data

    async def open(self, fmt: BlockFormat) -> None:
        await super().open(fmt)
        self.num_slots = self.capacity_bytes // fmt.block_bytes
        pin = self.device.type == "cpu" and (
            self.pin_memory is True or (self.pin_memory == "auto" and torch.cuda.is_available())
        )
        try:
            self._pool = torch.empty(
                (self.num_slots, fmt.block_bytes), dtype=torch.uint8, device=self.device, pin_memory=pin
            )
        except (RuntimeError, MemoryError) as exc:
            # Name the setting: the capacity is what was too big for this machine.
            raise BackendError(
                f"capacity: cannot allocate {format_size(self.capacity_bytes)} ({self.num_slots} slots of "
                f"{fmt.block_bytes} bytes) on {self.device}{_memory_note(self.device)}; lower the capacity ({exc})"
            ) from exc
        if self.device.type == "cpu" and not pin:
            # Huge pages first: the fill below is the first touch, which places the pages.
            advise_huge_pages(self._pool)
            # Touch every page now, off the event loop: a first write into a fresh mapping
            # page-faults, and measured here that cost a third of a cold store's bandwidth.
            # (Pinned memory is already resident.)
            # In a few shares on helper threads, each on one intra-op thread: a fill on one
            # thread with torch's OpenMP team would leave a second team beside the engine's,
            # which slows every copy of the process (see kvtier.transfer.copies).
            shares = torch.tensor_split(self._pool, max(1, min(4, usable_cpus(), self.num_slots)))
            await asyncio.gather(*(asyncio.to_thread(_fill_zero, share) for share in shares))
        # Pop from the end: slot 0 first, so a fresh pool fills in address order.
        self._free = list(range(self.num_slots - 1, -1, -1))

    async def aclose(self) -> None:
        await super().aclose()
        with self._lock:
            self._pool = None
            self._slot_of.clear()
            self._free.clear()

    @property
    def pool(self) -> torch.Tensor:
        pool = self._pool
        if pool is None or self._closed:  # (no call when open: every job asks)
            self._check_open()  # raises: closed, or not open yet
            assert pool is not None
        return pool

    def reserve_bytes(self) -> int:
        return self.format.block_bytes

    @property
    def max_blocks(self) -> int:
        return self.num_slots

    def __len__(self) -> int:
        return len(self._slot_of)

    def stored_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._slot_of)  # in the order their rows were taken

    def slots(self, keys: Sequence[bytes]) -> list[int]:
        self._check_open()
        try:
            return list(map(self._slot_of.__getitem__, keys))
        except KeyError as exc:
            raise LifecycleError(f"{self.name}: key {exc.args[0].hex()[:16]}… is not stored") from None

    def reserve(self, keys: Sequence[bytes]) -> list[int] | None:
        self._check_open()
        with self._lock:
            return self._reserve(keys)

    def _reserve(self, keys: Sequence[bytes]) -> list[int] | None:
        slot_of = self._slot_of
        # (In C where no key is held yet, a store's usual keys: no comprehension per job.)
        unique = dict.fromkeys(keys)
        new = unique if slot_of.keys().isdisjoint(unique) else [k for k in unique if k not in slot_of]
        if len(new) > len(self._free):
            return None
        free = self._free
        for k in new:
            slot_of[k] = free.pop()
        return list(map(slot_of.__getitem__, keys))

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        check_keys(keys)  # every key before any is deleted
        with self._lock:
            self._free_slots(keys)

    def _free_slots(self, keys: Sequence[bytes]) -> None:
        """Give the slots of the stored ones of ``keys`` back (under the lock)."""
        freed = list(map(self._slot_of.pop, keys, repeat(-1)))  # -1: not stored (slots are >= 0)
        if -1 in freed:  # (usually every key is stored: no comprehension then)
            freed = [slot for slot in freed if slot >= 0]
        # Highest first: the next reserve of as many keys takes them lowest first, so the
        # slots of one evicted job come back as one ascending run (a job's copy then takes
        # its rows as one run at a glance, kvtier.transfer.layout).
        freed.sort(reverse=True)
        self._free += freed
        counts_add(self.counters, "deleted", len(freed))

    def evict_and_reserve(self, victims: Sequence[bytes], keys: Sequence[bytes]) -> list[int] | None:
        """``delete_blocks(victims)`` and ``reserve(keys)`` under one lock: a store job's own
        room (one call, one open check, one lock taken, where the two calls took two each)."""
        self._check_open()
        with self._lock:
            if victims:
                self._free_slots(victims)
            return self._reserve(keys)

    def _check_blocks(self, blocks: Sequence[torch.Tensor], n: int) -> None:
        size = self.format.block_bytes
        if len(blocks) != n:
            raise LayoutError(f"{self.name}: {n} keys but {len(blocks)} blocks")
        for i, b in enumerate(blocks):
            if b.dtype != torch.uint8 or b.dim() != 1 or b.numel() != size:
                raise LayoutError(
                    f"{self.name}: blocks[{i}] must be a 1-D uint8 tensor of {size} bytes, "
                    f"got {tuple(b.shape)} {b.dtype}"
                )

    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        self._check_open()
        self._check_blocks(blocks, len(keys))
        if not keys:
            return []
        # Reserve one key at a time: a full pool stores what fits and reports the rest as failed.
        pool = self.pool
        sizes: list[int | None] = []
        for key, block in zip(keys, blocks):
            got = self.reserve([key])
            if got is None:
                sizes.append(None)
                continue
            pool[got[0]].copy_(block, non_blocking=True)
            sizes.append(self.format.block_bytes)
        # The copies may be queued on a device (a device pool, or device rows such as staging
        # or another tier's pool into a host pool): the key is ready and the caller's rows
        # reusable only once they have landed.
        wait_for_copies((pool, *blocks))
        done = sum(1 for s in sizes if s is not None)
        counts_add(self.counters, "blocks_written", done, "bytes_written", done * self.format.block_bytes, "write_failures", len(sizes) - done)
        return sizes

    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        self._check_open()
        self._check_blocks(out, len(keys))
        pool = self.pool
        slot_of = self._slot_of
        slots = [slot_of.get(key) for key in keys]
        found = [s is not None for s in slots]
        hits = [(dst, s) for dst, s in zip(out, slots) if s is not None]
        run = _host_run(pool, out) if all(found) else None
        if run is not None:
            # Out of a device pool into consecutive host rows (a staging buffer): one gather on
            # the device and one DMA per piece, not a copy per block.
            self._read_run(pool, [s for s in slots if s is not None], run)
        else:
            for dst, slot in hits:
                dst.copy_(pool[slot], non_blocking=True)
        # Only the current streams of the devices these copies ran on: a device-wide
        # synchronize waits on the current device (the wrong one for a pool on another GPU)
        # and on the engine's compute stream.
        wait_for_copies((pool, *out))
        hit = len(hits)
        counts_add(self.counters, "blocks_read", hit, "bytes_read", hit * self.format.block_bytes, "read_misses", len(keys) - hit)
        return found

    def _read_run(self, pool: torch.Tensor, slots: list[int], run: torch.Tensor) -> None:
        """``run[i] = pool[slots[i]]``, ``run`` in host memory, ``pool`` on a device; the
        gather's device memory bounded by :data:`GATHER_BYTES`."""
        step = max(1, GATHER_BYTES // self.format.block_bytes)
        for c in range(0, len(slots), step):
            part = slots[c : c + step]
            copy_rows(pool, part, run[c : c + len(part)])

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        data.update(slots=self.num_slots, used_slots=len(self._slot_of), device=str(self.device))
        return data


class CpuBackend(TensorPoolBackend):
    """Host-memory pool; pinned when CUDA is available (``pin_memory: auto``)."""

    name: ClassVar[str] = "cpu"
    #: Accepted for symmetry with ``gpu`` (only ``cpu`` is valid) but not listed as an option.
    hidden_options: ClassVar[frozenset[str]] = frozenset({"device"})

    def __init__(self, *, capacity: int | str, pin_memory: bool | str = "auto", device: str = "cpu") -> None:
        if torch.device(device).type != "cpu":
            raise ConfigError(f"device: the cpu backend keeps its pool in host memory, got {device!r}")
        super().__init__(capacity=capacity, device="cpu", pin_memory=pin_memory)


class GpuBackend(TensorPoolBackend):
    """Device-memory pool on ``device`` (default ``cuda``)."""

    name: ClassVar[str] = "gpu"

    def __init__(self, *, capacity: int | str, device: str = "cuda") -> None:
        super().__init__(capacity=capacity, device=device, pin_memory=False)
        if self.device.type == "cpu":
            raise ConfigError("device: the gpu backend needs an accelerator device such as 'cuda:0'; use 'cpu' for host memory")

    async def open(self, fmt: BlockFormat) -> None:
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device: {self.device} requested but CUDA is not available on this machine")
        await super().open(fmt)
