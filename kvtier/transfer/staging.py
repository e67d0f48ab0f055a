"""Cross-device block copies at link speed: a bounded device staging buffer, pipelined.

A job's blocks are slices of the engine's KV tensors on the device (one slice per tensor and
engine block, often 8-64 KiB); on the host they are rows of records: a pinned pool's rows
(the ``cpu`` tier) or host staging rows handed to a byte tier. One copy per slice runs at a
tenth of the link (measured on an H200: 2 MiB blocks of 64 KiB pages, 4 GB/s per-slice
copies, 48 GB/s for a gather into one buffer plus one DMA, 55 GB/s the link). So
:class:`StagedCopier` moves a job in chunks through two halves of a device staging buffer:

*save* (device -> host), chunk ``i`` in half ``h = i % 2``:

1. on the caller's stream (the transfer stream, which has already waited for the compute
   stream): wait for ``free[h]`` (the earlier DMA out of that half), then gather the chunk
   with one ``index_select`` per KV tensor into the half, record ``ready[h]``;
2. on the copier's copy stream: wait for ``ready[h]``, send the half to the host rows in as
   few DMAs as the rows allow (one per run of consecutive rows; a job visits its rows in row
   order), record ``free[h]``.

The gather of chunk ``i + 1`` (SMs) thus overlaps the DMA of chunk ``i`` (copy engine). At the
end the caller's stream waits for the last DMA, so synchronising the caller's stream covers
the whole job. *load* is the mirror image: DMA into half ``h`` on the copy stream after
``free[h]`` (the scatter that last read it), record ``ready[h]``; the caller's stream waits for
it and scatters with one ``index_copy_`` per KV tensor, then records ``free[h]``.

Byte tiers go through :meth:`StagedCopier.save_chunks` / :meth:`load_chunks`: the chunk's rows
land in (or come from) two halves of pinned host staging, and a callback per chunk writes
(reads) them, so the disk works on chunk ``i`` while the device copies chunk ``i + 1``.

Where no staging memory can be spared (``staging_bytes=0``, or the allocation fails), the
copier falls back to a batched copy of the slices: ``cudaMemcpyBatchAsync`` through the
``cuda-python`` bindings on a side stream where they import and work, else the per-slice
``_foreach_copy_``. ``stats()`` says which path runs and what was allocated.

``tensor_device(t)`` (from :mod:`kvtier.devices`) is the one place kvtier asks where a tensor
lives, so that a test stand-in for ``torch.cuda`` can place CPU tensors on a pretend device.

An error between two chunks (a failed gather, an allocation that fails mid-job) still leaves
the caller's stream behind every copy already queued on the copy stream: synchronising the
caller's stream after a failed job covers what it started, as after one that succeeded.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from kvtier.devices import device_index, tensor_device

__all__ = ["DEFAULT_STAGING_BYTES", "ChunkSink", "ChunkSource", "StagedCopier", "device_index", "tensor_device"]

log = logging.getLogger("kvtier.transfer.staging")

DEFAULT_STAGING_BYTES = 256 << 20


class StagedLayout(Protocol):
    """What the copier uses of the layout it serves (``KVLayout``), which passes itself in, so
    this module never imports the layout's."""

    @property
    def kv_caches(self) -> Sequence[torch.Tensor]: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def engine_blocks_per_block(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def _infos(self) -> Sequence[Any]: ...
    @property
    def _width(self) -> int: ...
    @property
    def _src(self) -> Sequence[torch.Tensor]: ...
    def _gather_index(self, ids: list[int], pool: torch.Tensor, rows: Sequence[int], kept: bool = False) -> None: ...
    def _scatter_index(self, ids: list[int], pool: torch.Tensor, rows: Sequence[int], kept: bool = False) -> None: ...
    def forget_views(self) -> None: ...
    def _pairs(
        self, ids: list[int], pool: torch.Tensor, rows: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...
Mode = Literal["unused", "staged", "batched", "foreach", "host"]
ChunkSink = Callable[[int, torch.Tensor], None]
"""``sink(first, rows)``: the records of job positions ``first .. first + len(rows) - 1``."""
ChunkSource = Callable[[int, torch.Tensor], Sequence[bool]]
"""``source(first, rows)``: fill ``rows`` with the records of those positions; say which exist."""
BatchCopy = Callable[[list[int], list[int], list[int], Any], None]


def load_batch_copy() -> BatchCopy | None:
    """``cudaMemcpyBatchAsync`` from the ``cuda-python`` bindings, or None where absent."""
    try:
        from cuda.bindings import runtime as rt  # type: ignore[import-not-found]
    except ImportError:
        return None
    if not hasattr(rt, "cudaMemcpyBatchAsync"):
        return None

    def batch_copy(dsts: list[int], srcs: list[int], sizes: list[int], stream: Any) -> None:
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        # The legacy default stream is refused (cudaErrorInvalidValue): always a side stream.
        res = rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [attr], [0], 1, stream.cuda_stream)
        err = res[0] if isinstance(res, tuple) else res
        if err != rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpyBatchAsync failed: {err}")

    return batch_copy


@dataclass(slots=True)
class _Lane:
    """One direction's staging: two device halves, pinned host halves, events, a copy stream."""

    name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    mode: Mode = "unused"
    dev: torch.Tensor | None = None  # [2, chunk, block_bytes] uint8 on the device
    host: torch.Tensor | None = None  # [2, chunk, block_bytes] uint8, pinned where possible
    stream: Any = None
    ready: list[Any] = field(default_factory=list)
    free: list[Any] = field(default_factory=list)

    def buf(self) -> torch.Tensor:
        assert self.dev is not None
        return self.dev


@dataclass(slots=True)
class _Plan:
    """A job in row order: positions, their engine ids and host rows, and the device index."""

    order: list[int]  # job positions, sorted by host row
    rows: list[int]  # host rows, in that order
    flat: Any  # device index [k * n]: engine ids, block-major
    per_m: Any  # device index [n, k]: the m-th engine id of each block


class StagedCopier:
    """Moves whole jobs between ``layout``'s device KV cache and host rows (see module doc)."""

    def __init__(self, layout: StagedLayout, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.layout = layout
        self.staging_bytes = 0
        self._count_lock = threading.Lock()
        self.configure(staging_bytes)
        self.batch_copy: BatchCopy | None = None
        self._batch_checked = False
        self._lanes = {"save": _Lane("save"), "load": _Lane("load")}
        self.counters = {"chunks": 0, "staged_jobs": 0, "batched_jobs": 0, "foreach_jobs": 0, "host_jobs": 0}

    def configure(self, staging_bytes: int) -> None:
        """Set the device staging size (bytes, split between the save and load directions,
        each in two halves). 0 disables staging. Buffers already allocated are released (the
        next job allocates the new size)."""
        if not isinstance(staging_bytes, int) or isinstance(staging_bytes, bool) or staging_bytes < 0:
            raise ValueError(f"staging_bytes: expected an integer >= 0, got {staging_bytes!r}")
        if getattr(self, "_lanes", None) is not None:
            self.close()
        self.staging_bytes = staging_bytes

    @property
    def chunk_blocks(self) -> int:
        """Blocks per chunk: a quarter of the staging, at least one block."""
        return max(1, self.staging_bytes // 4 // self.layout.block_bytes)

    @property
    def on_device(self) -> bool:
        return self.layout.device.type != "cpu"

    # -- resources ---------------------------------------------------------------------------
    def _lane(self, name: str) -> _Lane:
        """The lane, its buffers allocated on first use (or its fallback mode chosen)."""
        lane = self._lanes[name]
        if lane.mode != "unused":
            return lane
        if not self.on_device:
            lane.mode = "host"
            return lane
        dev = self.layout.device
        lane.stream = torch.cuda.Stream(device=dev)
        lane.ready = [torch.cuda.Event(), torch.cuda.Event()]
        lane.free = [torch.cuda.Event(), torch.cuda.Event()]
        if self.staging_bytes > 0:
            try:
                lane.dev = torch.empty((2, self.chunk_blocks, self.layout.block_bytes), dtype=torch.uint8, device=dev)
                lane.mode = "staged"
                return lane
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                log.warning(
                    "no device memory for %d bytes of %s staging, copying slices in batches: %s",
                    self.staging_bytes // 2,
                    name,
                    exc,
                )
        if not self._batch_checked:
            self._batch_checked = True
            self.batch_copy = self.batch_copy or load_batch_copy()
        lane.mode = "batched" if self.batch_copy is not None else "foreach"
        return lane

    def _host(self, lane: _Lane) -> torch.Tensor:
        if lane.host is None:
            shape = (2 if self.on_device else 1, self.chunk_blocks, self.layout.block_bytes)
            try:
                lane.host = torch.empty(shape, dtype=torch.uint8, pin_memory=self.on_device)
            except RuntimeError:  # no pinned memory to spare: copies become synchronous
                lane.host = torch.empty(shape, dtype=torch.uint8)
        return lane.host

    def open(self) -> None:
        """Allocate both directions' staging now rather than on the first job."""
        for name in self._lanes:
            with self._lanes[name].lock:
                self._lane(name)

    def close(self) -> None:
        """Release the buffers (a later job allocates them again), and the layout's kept views
        of tier pools (:meth:`KVLayout.forget_views`): the store closes its tiers next."""
        for lane in self._lanes.values():
            with lane.lock:
                lane.dev = lane.host = None
                lane.mode = "unused"
        self.layout.forget_views()

    def stats(self) -> dict[str, Any]:
        dev = sum(lane.dev.numel() for lane in self._lanes.values() if lane.dev is not None)
        host = sum(lane.host.numel() for lane in self._lanes.values() if lane.host is not None)
        return {
            "staging_bytes": self.staging_bytes,
            "chunk_blocks": self.chunk_blocks,
            "device_staging_allocated": dev,
            "host_staging_allocated": host,
            "save_mode": self._lanes["save"].mode,
            "load_mode": self._lanes["load"].mode,
            **self.counters,
        }

    # -- jobs ----------------------------------------------------------------------------------
    def _plan(self, ids: Sequence[int], rows: Sequence[int]) -> _Plan:
        n = self.layout.engine_blocks_per_block
        order = sorted(range(len(rows)), key=rows.__getitem__)
        flat = [ids[p * n + m] for p in order for m in range(n)]
        per_m = [flat[j * n + m] for m in range(n) for j in range(len(order))] if n > 1 else []
        index = device_index(flat + per_m, self.layout.device)
        k = len(order)
        return _Plan(order, [rows[p] for p in order], index[: k * n], index[k * n :].view(n, k) if n > 1 else None)

    def save(self, ids: Sequence[int], pool: torch.Tensor, rows: Sequence[int]) -> None:
        """Copy the blocks of engine ``ids`` (``n`` per block, device) into host ``pool[rows]``."""
        if not rows:
            return
        with self._job("save") as lane:
            if lane.mode != "staged":
                self._fallback(lane, ids, pool, rows, save=True)
                return
            plan = self._plan(ids, rows)
            cur = torch.cuda.current_stream(self.layout.device)
            for h, c0, c1 in self._chunks(len(rows)):
                self._gather_chunk(lane, h, plan, c0, c1, cur)
                with torch.cuda.stream(lane.stream):
                    for j0, r0, length in _runs(plan.rows, c0, c1):
                        pool[r0 : r0 + length].copy_(lane.buf()[h, j0 - c0 : j0 - c0 + length], non_blocking=True)
                    lane.free[h].record(lane.stream)
                self._count(lane, chunks=1)
            cur.wait_event(lane.free[h])

    def load(self, pool: torch.Tensor, rows: Sequence[int], ids: Sequence[int]) -> None:
        """Copy host ``pool[rows]`` into the device engine blocks ``ids`` (``n`` per block)."""
        if not rows:
            return
        with self._job("load") as lane:
            if lane.mode != "staged":
                self._fallback(lane, ids, pool, rows, save=False)
                return
            plan = self._plan(ids, rows)
            cur = torch.cuda.current_stream(self.layout.device)
            for h, c0, c1 in self._chunks(len(rows)):
                lane.stream.wait_event(lane.free[h])
                with torch.cuda.stream(lane.stream):
                    for j0, r0, length in _runs(plan.rows, c0, c1):
                        lane.buf()[h, j0 - c0 : j0 - c0 + length].copy_(pool[r0 : r0 + length], non_blocking=True)
                    lane.ready[h].record(lane.stream)
                self._scatter_chunk(lane, h, plan.flat, plan.per_m, c0, c1, cur)
                self._count(lane, chunks=1)

    def save_chunks(
        self, ids: Sequence[int], sink: ChunkSink, *, on_device_done: Callable[[], None] | None = None
    ) -> None:
        """Copy the job's blocks out chunk by chunk and hand each chunk's host rows to
        ``sink`` in job order. ``on_device_done()`` runs once the device reads are all done
        (the engine may reuse its blocks), possibly before the last sinks."""
        n = self.layout.engine_blocks_per_block
        k = len(ids) // n
        if k == 0:
            if on_device_done is not None:
                on_device_done()
            return
        with self._job("save") as lane:
            host = self._host(lane)
            chunk = self.chunk_blocks
            starts = list(range(0, k, chunk))
            if lane.mode != "staged":
                for c0 in starts:
                    c1 = min(c0 + chunk, k)
                    self._fallback(lane, ids[c0 * n : c1 * n], host[0], range(c1 - c0), save=True)
                    if self.on_device:
                        torch.cuda.current_stream(self.layout.device).synchronize()
                    if c1 == k and on_device_done is not None:
                        on_device_done()
                    sink(c0, host[0, : c1 - c0])
                return
            plan = self._plan(ids, range(k))
            cur = torch.cuda.current_stream(self.layout.device)

            def enqueue(i: int) -> None:
                c0, h = starts[i], i & 1
                c1 = min(c0 + chunk, k)
                self._gather_chunk(lane, h, plan, c0, c1, cur)
                with torch.cuda.stream(lane.stream):
                    host[h, : c1 - c0].copy_(lane.buf()[h, : c1 - c0], non_blocking=True)
                    lane.free[h].record(lane.stream)
                self._count(lane, chunks=1)

            for i in range(min(2, len(starts))):
                enqueue(i)
            done = False
            for i, c0 in enumerate(starts):
                h = i & 1
                if not done and i + 2 >= len(starts):
                    # Every chunk is queued: wait for the last DMA (the copy stream is in
                    # order), so the engine's blocks are free before the disk is done.
                    lane.free[(len(starts) - 1) & 1].synchronize()
                    cur.wait_event(lane.free[(len(starts) - 1) & 1])
                    done = True
                    if on_device_done is not None:
                        on_device_done()
                else:
                    lane.free[h].synchronize()
                sink(c0, host[h, : min(c0 + chunk, k) - c0])
                if i + 2 < len(starts):
                    enqueue(i + 2)

    def load_chunks(self, ids: Sequence[int], source: ChunkSource) -> list[bool]:
        """Fill the job's blocks chunk by chunk: ``source`` reads each chunk's records into
        host rows; the found ones are copied into engine ``ids``. Returns found flags."""
        n = self.layout.engine_blocks_per_block
        k = len(ids) // n
        found: list[bool] = []
        if k == 0:
            return found
        with self._job("load") as lane:
            host = self._host(lane)
            staged = lane.mode == "staged"
            plan = self._plan(ids, range(k)) if staged else None
            cur = torch.cuda.current_stream(self.layout.device) if self.on_device else None
            for h, c0, c1 in self._chunks(k):
                h = h if self.on_device else 0
                if self.on_device:
                    lane.ready[h].synchronize()  # the DMA that last read this host half is done
                rows = host[h, : c1 - c0]
                got = [bool(f) for f in source(c0, rows)]
                if len(got) != c1 - c0:
                    raise ValueError(f"source: expected {c1 - c0} found flags, got {len(got)}")
                found.extend(got)
                have = [j for j, ok in enumerate(got) if ok]
                if not have:
                    continue
                part = [b for j in have for b in ids[(c0 + j) * n : (c0 + j + 1) * n]]
                if not staged:
                    self._fallback(lane, part, rows, have, save=False)
                    if lane.ready:
                        lane.ready[h].record(torch.cuda.current_stream(self.layout.device))
                    continue
                assert plan is not None and cur is not None
                flat, per_m, m0, m1 = plan.flat, plan.per_m, c0, c1
                if len(have) < c1 - c0:  # compact the found rows to the front (a miss is rare)
                    rows[: len(have)] = rows[have].clone()
                    sub = self._plan(part, range(len(have)))
                    flat, per_m, m0, m1 = sub.flat, sub.per_m, 0, len(have)
                lane.stream.wait_event(lane.free[h])
                with torch.cuda.stream(lane.stream):
                    lane.buf()[h, : len(have)].copy_(rows[: len(have)], non_blocking=True)
                    lane.ready[h].record(lane.stream)
                self._scatter_chunk(lane, h, flat, per_m, m0, m1, cur)
                self._count(lane, chunks=1)
        return found

    @contextlib.contextmanager
    def _job(self, name: str) -> Iterator[_Lane]:
        """One job in direction ``name``: its lane, locked and ready; counted when it ends."""
        lane = self._lanes[name]
        with lane.lock:
            self._lane(name)
            try:
                yield lane
            except BaseException:
                # Failed between two chunks: the copies already queued on the copy stream
                # still read or write the caller's rows. Put the caller's stream behind them,
                # so that the caller's wait for its stream covers them.
                if lane.stream is not None:
                    torch.cuda.current_stream(self.layout.device).wait_stream(lane.stream)
                raise
            self._count(lane)

    def _chunks(self, k: int) -> Iterator[tuple[int, int, int]]:
        """(staging half, first position, end position) of each chunk of a ``k``-block job."""
        for i, c0 in enumerate(range(0, k, self.chunk_blocks)):
            yield i & 1, c0, min(c0 + self.chunk_blocks, k)

    def _count(self, lane: _Lane, *, chunks: int = 0) -> None:
        with self._count_lock:  # the two directions run on different threads
            if chunks:
                self.counters["chunks"] += chunks
            else:
                self.counters[f"{lane.mode}_jobs"] += 1

    # -- the device ops ------------------------------------------------------------------------
    def _views(self, half: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Per KV tensor: (its wide cache view, its columns of the staging half, words per slice)."""
        lay = self.layout
        w = lay._width
        n = lay.engine_blocks_per_block
        wide = half.view(lay._src[0].dtype)
        out = []
        for src, info in zip(lay._src, lay._infos):
            words = info.engine_block_bytes // w
            out.append((src, wide[:, info.offset // w : info.offset // w + n * words], words))
        return out

    def _gather_chunk(self, lane: _Lane, h: int, plan: _Plan, c0: int, c1: int, cur: Any) -> None:
        assert lane.dev is not None
        n = self.layout.engine_blocks_per_block
        k = c1 - c0
        cur.wait_event(lane.free[h])  # the DMA that last read this half is done
        for src, cols, words in self._views(lane.buf()[h]):
            if n == 1:
                torch.index_select(src, 0, plan.flat[c0:c1], out=cols[:k])
            elif n == 2:
                for m in range(n):
                    torch.index_select(src, 0, plan.per_m[m, c0:c1], out=cols[:k, m * words : (m + 1) * words])
            else:  # one gather, one strided copy: fewer launches than n gathers
                cols[:k].copy_(src.index_select(0, plan.flat[c0 * n : c1 * n]).view(k, n * words))
        lane.ready[h].record(cur)
        lane.stream.wait_event(lane.ready[h])

    def _scatter_chunk(self, lane: _Lane, h: int, flat: Any, per_m: Any, c0: int, c1: int, cur: Any) -> None:
        assert lane.dev is not None
        n = self.layout.engine_blocks_per_block
        k = c1 - c0
        cur.wait_event(lane.ready[h])
        for cache, cols, words in self._views(lane.buf()[h]):
            if n == 1:
                cache.index_copy_(0, flat[c0:c1], cols[:k])
            elif n == 2:
                for m in range(n):
                    cache.index_copy_(0, per_m[m, c0:c1], cols[:k, m * words : (m + 1) * words])
            else:
                cache.index_copy_(0, flat[c0 * n : c1 * n], cols[:k].reshape(k * n, words))
        lane.free[h].record(cur)

    def _fallback(
        self, lane: _Lane, ids: Sequence[int], pool: torch.Tensor, rows: Sequence[int], *, save: bool
    ) -> None:
        """No staging: one batched copy of every slice, else ``_foreach_copy_`` (or, for a
        layout on the host, the index path)."""
        lay = self.layout
        if lane.mode == "host":
            (lay._gather_index if save else lay._scatter_index)(list(ids), pool, rows)
            return
        if lane.mode == "batched" and self.batch_copy is not None:
            dsts, srcs, sizes = self._pointers(list(ids), pool, rows, save=save)
            cur = torch.cuda.current_stream(lay.device)
            lane.stream.wait_stream(cur)
            try:
                with torch.cuda.stream(lane.stream):
                    self.batch_copy(dsts, srcs, sizes, lane.stream)
                cur.wait_stream(lane.stream)
                return
            except Exception as exc:  # a binding that does not work here: stop trying it
                log.warning("batched copy failed, falling back to one copy per slice: %s", exc)
                lane.mode = "foreach"
        dsts_t, srcs_t = lay._pairs(list(ids), pool, rows)
        if save:
            torch._foreach_copy_(dsts_t, srcs_t, non_blocking=True)
        else:
            torch._foreach_copy_(srcs_t, dsts_t, non_blocking=True)

    def _pointers(
        self, ids: list[int], pool: torch.Tensor, rows: Sequence[int], *, save: bool
    ) -> tuple[list[int], list[int], list[int]]:
        """(destination, source, size) of every (block, tensor, engine block) slice."""
        lay = self.layout
        n = lay.engine_blocks_per_block
        base = pool.data_ptr()
        stride = pool.stride(0) * pool.element_size()
        cache_ptrs = [
            (t.data_ptr(), info.engine_block_bytes, info.offset) for t, info in zip(lay.kv_caches, lay._infos)
        ]
        host: list[int] = []
        dev: list[int] = []
        sizes: list[int] = []
        for j, row in enumerate(rows):
            rec = base + row * stride
            for ptr, size, offset in cache_ptrs:
                for m in range(n):
                    host.append(rec + offset + m * size)
                    dev.append(ptr + ids[j * n + m] * size)
                    sizes.append(size)
        return (host, dev, sizes) if save else (dev, host, sizes)


def _runs(rows: list[int], c0: int, c1: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive rows in ``rows[c0:c1]``: (position, first row, length)."""
    out: list[tuple[int, int, int]] = []
    j = c0
    while j < c1:
        e = j + 1
        while e < c1 and rows[e] == rows[e - 1] + 1:
            e += 1
        out.append((j, rows[j], e - j))
        j = e
    return out
