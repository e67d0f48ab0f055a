"""The engine's paged KV cache as kvtier sees it.

An engine keeps its KV cache as one or more tensors whose first dimension is the engine block
id (one tensor per layer, K and V split or fused, any dtype). An engine block is the same slice
of every tensor. One *offloaded* block spans ``n >= 1`` engine blocks; its record is the
concatenation, tensor by tensor, of those ``n`` slices, so its size is
``n * sum(bytes per engine block of each tensor)``.

Moving a job's blocks between the cache and a pool of such records is batched per job and per
tensor, never per block and layer. Measured on this project's CPU machine (2 cores; a 32-layer
cache of 64 KiB per layer and block, 64 blocks per job):

====================================================  =========
one ``copy_`` per (block, layer), Python loop           4.1 GB/s
``torch._foreach_copy_`` over (block, layer) views      8.7 GB/s
``index_select`` + ``index_copy_`` per tensor, uint8    1.7 GB/s
the same through an int64 view of the bytes            10.0 GB/s
====================================================  =========

so the default ``index`` strategy views each tensor's bytes as the widest integer type that
divides every slice and moves a whole job with one gather and one scatter per tensor. Where
the pool rows of a job form a few runs of consecutive rows (the usual case in a ``cpu`` or
``gpu`` tier), each run is one ``index_select`` per tensor straight into the pool (or one
``index_copy_`` out of it), with no intermediate buffer: one pass over memory instead of two
(on the host here, about twice the speed of the gather plus scatter). Between host buffers
the per-tensor copies of a job are dealt out to ``copy_threads`` threads
(:mod:`kvtier.transfer.copies`), each of which copies on one OpenMP thread.

Across devices (a CUDA cache and a host pool) the default ``staged`` strategy hands the job to
the layout's :class:`~kvtier.transfer.staging.StagedCopier` (``layout.staging``): a gather per tensor
into a bounded device staging buffer, then large DMAs to the host rows, pipelined in chunks
(see :mod:`kvtier.transfer.staging`). The ``foreach`` strategy issues one asynchronous copy per (block,
tensor) slice in a single ``_foreach_copy_`` call; it is also the last fallback when no
staging memory can be spared. ``gather_chunks`` / ``scatter_chunks`` move a job chunk by chunk
through host staging rows for byte tiers, with a callback per chunk.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.errors import LayoutError
from kvtier.transfer import staging as _staging
from kvtier.transfer.block_copy import native_blocks
from kvtier.transfer.copies import CopySplitter, CopyThreads
from kvtier.transfer.layout_checks import check_distinct_memory
from kvtier.transfer.pool_views import BlockViews, PoolViews, check_pool, host_index
from kvtier.transfer.staging import DEFAULT_STAGING_BYTES, ChunkSink, ChunkSource, StagedCopier

__all__ = ["KVLayout", "Strategy"]

Strategy = Literal["auto", "index", "foreach", "staged"]
_WIDE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Beyond this many runs of consecutive pool rows, one gather plus one scatter per tensor wins.
_MAX_RUNS = 4
# Up to this many blocks, an inline job into or out of one run of pool rows is one
# ``_foreach_copy_`` over (block, tensor) pieces, their views kept on both sides
# (:class:`~kvtier.transfer.pool_views.BlockViews`): at 4 blocks of 32 layers ``index_copy_``
# per tensor ran at 0.4 of it (benchmarks/bench_core.py --job-blocks 4); at 16 blocks the
# calling thread's team of OpenMP threads makes the per-tensor ops faster. Natively such a job
# copies on one thread, never on the team: a ~1 ms copy there lost a quarter of its rounds to
# the helper's waits on a loaded host (bench_core --job-blocks 4, load average 3).
_FOREACH_MAX_BLOCKS = 8


def _run_cuts(runs: list[tuple[list[int], int, int]]) -> list[int]:
    """Where each run starts in the job's index of sorted positions."""
    cuts, j = [], 0
    for _, _, length in runs:
        cuts.append(j)
        j += length
    return cuts


_INT = frozenset({int})


def _block_id_list(block_ids: Sequence[int], what: str) -> list[int]:
    """``block_ids`` as plain ints. A float (``1.5`` is not block 1) or a bool is an error
    naming its position; numpy and 0-d torch integers are accepted."""
    if isinstance(block_ids, (str, bytes)):
        raise LayoutError(f"{what}: expected a sequence of integer block ids, got {type(block_ids).__name__}")
    ids = list(block_ids)
    if set(map(type, ids)) <= {int}:
        return ids
    for i, b in enumerate(ids):
        if isinstance(b, bool) or getattr(b, "dtype", None) == torch.bool:
            raise LayoutError(f"{what}[{i}]: expected an integer block id, got {b!r}")
        try:
            ids[i] = operator.index(b)
        except TypeError:
            raise LayoutError(f"{what}[{i}]: expected an integer block id, got {b!r} ({type(b).__name__})") from None
    return ids


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    offset: int  # byte offset of this tensor's slices inside a record
    engine_block_bytes: int


class KVLayout:
    """Describes ``kv_caches`` and moves whole jobs of blocks between it and record pools."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor] | torch.Tensor,
        *,
        engine_blocks_per_block: int = 1,
        strategy: Strategy = "auto",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        copy_threads: CopyThreads = "auto",
    ) -> None:
        if isinstance(kv_caches, torch.Tensor):
            kv_caches = [kv_caches]
        caches = list(kv_caches)
        if not caches:
            raise LayoutError("kv_caches: expected at least one tensor")
        if not isinstance(engine_blocks_per_block, int) or engine_blocks_per_block < 1:
            raise LayoutError(f"engine_blocks_per_block: expected an integer >= 1, got {engine_blocks_per_block!r}")
        if strategy not in ("auto", "index", "foreach", "staged"):
            raise LayoutError(f"strategy: expected 'auto', 'index', 'foreach' or 'staged', got {strategy!r}")
        if not isinstance(staging_bytes, int) or isinstance(staging_bytes, bool) or staging_bytes < 0:
            raise LayoutError(f"staging_bytes: expected an integer >= 0, got {staging_bytes!r}")
        num = None
        device = _staging.tensor_device(caches[0]) if isinstance(caches[0], torch.Tensor) else None
        infos: list[_TensorInfo] = []
        offset = 0
        n = engine_blocks_per_block
        for i, t in enumerate(caches):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"kv_caches[{i}]: expected a torch.Tensor, got {type(t).__name__}")
            if t.dim() < 1 or t.shape[0] < 1:
                raise LayoutError(
                    f"kv_caches[{i}]: expected a tensor with the block dimension first, got shape {tuple(t.shape)}"
                )
            if not t.is_contiguous():
                raise LayoutError(
                    f"kv_caches[{i}]: expected a contiguous tensor (block dimension first), got strides {t.stride()}"
                )
            if _staging.tensor_device(t) != device:
                raise LayoutError(f"kv_caches[{i}]: on {_staging.tensor_device(t)}, but kv_caches[0] is on {device}")
            if num is None:
                num = t.shape[0]
            elif t.shape[0] != num:
                raise LayoutError(f"kv_caches[{i}]: {t.shape[0]} blocks in dimension 0, but kv_caches[0] has {num}")
            per = t[0].numel() * t.element_size()
            if per == 0:
                raise LayoutError(f"kv_caches[{i}]: empty blocks, shape {tuple(t.shape)}")
            infos.append(_TensorInfo(offset, per))
            offset += n * per
        assert num is not None and device is not None
        check_distinct_memory(caches)
        self.kv_caches = caches
        self.device = device
        self.engine_blocks_per_block = n
        #: one engine block per block, in host memory (a small job's copy may be one _foreach_copy_)
        self._host_blocks = device.type == "cpu" and n == 1
        self.num_engine_blocks = int(num)
        self.block_bytes = offset
        self._infos = infos
        dtypes = {t.dtype for t in caches}
        self.dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "uint8"
        # The widest integer type dividing every slice, offset and the record size.
        g = 0
        for info in infos:
            g = math.gcd(g, info.engine_block_bytes)
        self._width = next(w for w in (8, 4, 2, 1) if g % w == 0)
        wide = _WIDE[self._width]
        #: words per tensor in a record when every tensor's share is as wide (then a record is
        #: ``[tensors, span]`` words, and :meth:`_row_views` cuts every tensor's rows at once)
        self._span = n * infos[0].engine_block_bytes // self._width if len({i.engine_block_bytes for i in infos}) == 1 else 0
        self._src = [
            t.view(-1).view(torch.uint8).view(num, info.engine_block_bytes).view(wide) for t, info in zip(caches, infos)
        ]
        self.strategy: Strategy = strategy
        # Device staging for cross-device jobs; allocated on the first such job (or open()).
        self.staging = StagedCopier(self, staging_bytes)
        # Host jobs' per-tensor copies, dealt out to this many threads.
        self.copies = CopySplitter(copy_threads)
        # Per-tensor views of pools; those of long-lived pools (``kept=True``: a memory tier's
        # pool, the engine's staging) made once (see kvtier.transfer.pool_views).
        w = self._width
        self.pool_views = PoolViews([(i.offset // w, (i.offset + n * i.engine_block_bytes) // w) for i in infos], wide, self._span)
        # Per engine block, its words in every tensor: the cache side of a small job's pieces.
        self.block_views = BlockViews(self._src)
        # The same pieces copied in one native call (kvtier.transfer.block_copy), where built.
        self.native = native_blocks(self._src, [i.engine_block_bytes for i in infos], [i.offset for i in infos], offset) if self._host_blocks else None

    # -- description -----------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A stable description of shapes and dtypes, for ``Namespace.kv_layout``."""
        parts = [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape[1:])}" for t in self.kv_caches]
        return f"n={self.engine_blocks_per_block};" + ";".join(parts)

    def __repr__(self) -> str:
        return (
            f"KVLayout(tensors={len(self.kv_caches)}, engine_blocks={self.num_engine_blocks}, "
            f"engine_blocks_per_block={self.engine_blocks_per_block}, block_bytes={self.block_bytes}, dtype={self.dtype})"
        )

    def record_views(self, record: torch.Tensor) -> list[torch.Tensor]:
        """The per-tensor pieces of one record, shaped ``[n, *tensor.shape[1:]]``."""
        views = []
        n = self.engine_blocks_per_block
        for t, info in zip(self.kv_caches, self._infos):
            piece = record[info.offset : info.offset + n * info.engine_block_bytes]
            views.append(piece.view(t.dtype).view(n, *t.shape[1:]))
        return views

    # -- validation ------------------------------------------------------------------------
    def check_block_ids(self, block_ids: Sequence[int], num_blocks: int, *, what: str = "block_ids") -> list[int]:
        """Validate engine block ids for ``num_blocks`` offloaded blocks (``n`` ids each)."""
        if type(block_ids) is list and set(map(type, block_ids)) <= _INT:  # (a list of ints: no call)
            ids = block_ids.copy()
        else:
            ids = _block_id_list(block_ids, what)
        want = num_blocks * self.engine_blocks_per_block
        if len(ids) != want:
            raise LayoutError(
                f"{what}: expected {want} engine block ids ({num_blocks} blocks x {self.engine_blocks_per_block}), got {len(ids)}"
            )
        if ids and not (min(ids) >= 0 and max(ids) < self.num_engine_blocks):  # two calls, not a loop
            i, b = next((i, b) for i, b in enumerate(ids) if not 0 <= b < self.num_engine_blocks)
            raise LayoutError(f"{what}[{i}]: engine block id {b} is out of range [0, {self.num_engine_blocks})")
        return ids

    def _pick(self, pool: torch.Tensor) -> Strategy:
        same = _staging.tensor_device(pool) == self.device
        if self.strategy == "staged" and same:
            return "index"  # nothing to stage on one device
        if self.strategy != "auto":
            return self.strategy
        return "index" if same else "staged"

    def _dst_views(self, pool: torch.Tensor, kept: bool = False) -> list[torch.Tensor]:
        """Per tensor, the pool's words for that tensor (:meth:`PoolViews.columns`)."""
        return self.pool_views.columns(pool, kept)

    def _row_views(self, pool: torch.Tensor, kept: bool, r0: int, end: int) -> Sequence[torch.Tensor]:
        """Per tensor, its words in pool rows ``r0:end`` (:meth:`PoolViews.rows`)."""
        return self.pool_views.rows(pool, kept, r0, end)

    def forget_views(self) -> None:
        """Drop the kept views (and with them the pools they hold): the tiers are closing."""
        self.pool_views.forget()
        if self.native is not None:
            self.native.forget()

    # -- movement --------------------------------------------------------------------------
    def gather(
        self,
        block_ids: Sequence[int],
        pool: torch.Tensor,
        rows: Sequence[int],
        *,
        non_blocking: bool = False,
        kept: bool = False,
        checked: bool = False,
    ) -> None:
        """Copy the blocks made of engine ``block_ids`` (``n`` per block) into ``pool[rows]``.

        On a device the copies are queued on the current stream (``staged``: that stream
        waits for them); ``non_blocking=False`` then waits for the stream. ``kept``: ``pool``
        lives as long as this layout (a memory tier's pool, the engine's staging), so the
        views of it a copy needs are made once and kept. ``checked``: a transfer job's own
        call, whose ``block_ids`` (a list) passed :meth:`check_block_ids` at submit and whose
        rows a tier of this layout handed out, so neither is checked again."""
        if checked and kept and isinstance(block_ids, list) and self._small_run(block_ids, pool, rows, True):
            return
        ids = block_ids if checked and isinstance(block_ids, list) else self.check_block_ids(block_ids, len(rows))
        if not checked:
            check_pool(pool, rows, self.block_bytes)
        if not rows:
            return
        pick = self._pick(pool)
        if pick == "index":
            self._gather_index(ids, pool, rows, kept)
        elif pick == "staged":
            self.staging.save(ids, pool, rows)
        else:
            dsts, srcs = self._pairs(ids, pool, rows)
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
        if not non_blocking and self.device.type != "cpu":
            torch.cuda.current_stream(self.device).synchronize()

    def scatter(
        self,
        pool: torch.Tensor,
        rows: Sequence[int],
        block_ids: Sequence[int],
        *,
        non_blocking: bool = False,
        kept: bool = False,
        checked: bool = False,
    ) -> None:
        """Copy ``pool[rows]`` into the engine blocks ``block_ids`` (``n`` per block);
        ``kept`` and ``checked`` as for :meth:`gather`."""
        if checked and kept and isinstance(block_ids, list) and self._small_run(block_ids, pool, rows, False):
            return
        ids = block_ids if checked and isinstance(block_ids, list) else self.check_block_ids(block_ids, len(rows))
        if not checked:
            check_pool(pool, rows, self.block_bytes)
        if not rows:
            return
        pick = self._pick(pool)
        if pick == "index":
            self._scatter_index(ids, pool, rows, kept)
        elif pick == "staged":
            self.staging.load(pool, rows, ids)
        else:
            dsts, srcs = self._pairs(ids, pool, rows)
            torch._foreach_copy_(srcs, dsts, non_blocking=non_blocking)
        if not non_blocking and self.device.type != "cpu":
            torch.cuda.current_stream(self.device).synchronize()

    def gather_chunks(
        self, block_ids: Sequence[int], sink: ChunkSink, *, on_device_done: Callable[[], None] | None = None
    ) -> None:
        """Copy a job's blocks (``n`` engine ids each) out in chunks of host rows, handing
        each chunk to ``sink(first_position, rows)`` in order; see
        :meth:`StagedCopier.save_chunks`. ``on_device_done()`` runs once the engine's blocks
        have all been read."""
        n = self.engine_blocks_per_block
        ids = self.check_block_ids(block_ids, len(block_ids) // n)
        self.staging.save_chunks(ids, sink, on_device_done=on_device_done)

    def scatter_chunks(self, block_ids: Sequence[int], source: ChunkSource) -> list[bool]:
        """Fill a job's blocks chunk by chunk from ``source(first_position, rows)``, which
        reads the records into host rows and returns found flags; returns them all."""
        n = self.engine_blocks_per_block
        ids = self.check_block_ids(block_ids, len(block_ids) // n)
        return self.staging.load_chunks(ids, source)

    def _row_runs(self, pool: torch.Tensor, rows: Sequence[int]) -> list[tuple[list[int], int, int]] | None:
        """The job as runs of consecutive pool rows (positions, first row, length) when there
        are few enough of them to beat a gather plus a scatter. On the host too: a job's rows
        in a ``cpu`` tier are mostly one run, and one ``index_select`` per tensor straight
        into them is one pass over memory instead of two (about twice the speed measured
        here, 2 MiB blocks of 32 layers)."""
        if not rows:  # one row is one run: straight in, not a gather into a temporary and a scatter
            return None
        k, r0 = len(rows), rows[0]
        if rows[k - 1] == r0 + k - 1 and list(rows) == list(range(r0, r0 + k)):  # one run in order (the usual job)
            return [(list(range(k)), r0, k)]
        order = sorted(range(len(rows)), key=rows.__getitem__)
        runs: list[tuple[list[int], int, int]] = []
        start = 0
        for j in range(1, len(order) + 1):
            if j == len(order) or rows[order[j]] != rows[order[j - 1]] + 1:
                runs.append((order[start:j], rows[order[start]], j - start))
                start = j
                if len(runs) > _MAX_RUNS:
                    return None
        return runs

    def _small_run(self, ids: list[int], pool: torch.Tensor, rows: Sequence[int], save: bool) -> bool:
        """A job's own copy (``checked``, ``kept``) between host memory of at most
        ``_FOREACH_MAX_BLOCKS`` blocks: :attr:`native`, where built, copies them in one call on
        this thread whatever their rows (:mod:`kvtier.transfer.block_copy`), and so a larger job
        (inline: on the caller's team, or alone as the pace says; on a transfer thread: split
        over the copy threads; :meth:`CopySplitter.native_copy`); else, on a thread that copies unsplit (inline) and rows in one ascending run,
        the ``_foreach_copy_`` of kept pieces :meth:`_gather_index` / :meth:`_scatter_index` choose
        for it, without their dispatch; ``False``, having copied nothing, for any other job."""
        k = len(rows)
        if not (0 < k and self._host_blocks and pool.is_cpu and self.strategy != "foreach"):
            return False
        small = k <= _FOREACH_MAX_BLOCKS
        if self.native is not None and self.copies.native_copy(self.native, save, ids, pool, rows, small):
            return True
        r0 = rows[0]
        if not small or rows[k - 1] != r0 + k - 1 or list(rows) != list(range(r0, r0 + k)) or not self.copies.on_this_thread():
            return False
        pieces = self.pool_views.row_pieces(pool, True, r0, r0 + k)
        if save:
            torch._foreach_copy_(pieces, self.block_views.pieces(ids))
        else:
            torch._foreach_copy_(self.block_views.pieces(ids), pieces)
        return True

    def _gather_index(self, ids: list[int], pool: torch.Tensor, rows: Sequence[int], kept: bool = False) -> None:
        n = self.engine_blocks_per_block
        pool_device = _staging.tensor_device(pool)
        runs = self._row_runs(pool, rows) if n == 1 else None
        parts: list[Callable[[], None]]
        if runs is not None and len(runs) == 1:  # one run (a small job's usual case): no index slices
            ((order, r0, length),) = runs
            blocks = [ids[p] for p in order]
            here = self._here(pool_device)
            if here and length <= _FOREACH_MAX_BLOCKS:  # a small job: one copy per (block, tensor)
                pieces = self.pool_views.row_pieces(pool, kept, r0, r0 + length)
                torch._foreach_copy_(pieces, self.block_views.pieces(blocks))
                return
            whole = host_index(blocks, self.device)
            views = self._row_views(pool, kept, r0, r0 + length)
            if here:  # the copies' own loop, without a call per tensor
                for src, dst in zip(self._src, views):
                    torch.index_select(src, 0, whole, out=dst)
                return

            def select_run(src: torch.Tensor, dst: torch.Tensor) -> None:
                torch.index_select(src, 0, whole, out=dst)

            parts = [functools.partial(select_run, src, dst) for src, dst in zip(self._src, views)]
        elif runs is not None:  # straight into the pool: one index_select per (run, tensor)
            order = [p for run in runs for p in run[0]]
            idx = host_index([ids[p] for p in order], self.device)
            cuts = _run_cuts(runs)

            def select(src: torch.Tensor, dst: torch.Tensor) -> None:
                for (_, r0, length), j in zip(runs, cuts):
                    torch.index_select(src, 0, idx[j : j + length], out=dst[r0 : r0 + length])

            parts = [functools.partial(select, src, dst) for src, dst in zip(self._src, self._dst_views(pool, kept))]
        else:
            src_idx = host_index(ids, self.device)
            dst_idx = host_index(list(rows), pool_device)
            k = len(rows)

            def gather(src: torch.Tensor, dst: torch.Tensor) -> None:
                picked = src.index_select(0, src_idx).view(k, -1)  # a block's n rows are consecutive
                dst.index_copy_(0, dst_idx, picked)

            parts = [functools.partial(gather, src, dst) for src, dst in zip(self._src, self._dst_views(pool, kept))]
        self._copy(parts, pool_device, len(rows))

    def _scatter_index(self, ids: list[int], pool: torch.Tensor, rows: Sequence[int], kept: bool = False) -> None:
        n = self.engine_blocks_per_block
        pool_device = _staging.tensor_device(pool)
        runs = self._row_runs(pool, rows) if n == 1 else None
        parts: list[Callable[[], None]]
        if runs is not None and len(runs) == 1:  # one run: no index slices
            ((order, r0, length),) = runs
            blocks = [ids[p] for p in order]
            here = self._here(pool_device)
            if here and length <= _FOREACH_MAX_BLOCKS:  # a small job: one copy per (block, tensor)
                pieces = self.pool_views.row_pieces(pool, kept, r0, r0 + length)
                torch._foreach_copy_(self.block_views.pieces(blocks), pieces)
                return
            views = self._row_views(pool, kept, r0, r0 + length)
            whole = host_index(blocks, self.device)
            if here:
                for cache, view in zip(self._src, views):
                    cache.index_copy_(0, whole, view)
                return

            def place_run(cache: torch.Tensor, view: torch.Tensor) -> None:
                cache.index_copy_(0, whole, view)

            parts = [functools.partial(place_run, cache, view) for cache, view in zip(self._src, views)]
        elif runs is not None:  # straight out of the pool: one index_copy_ per (run, tensor)
            order = [p for run in runs for p in run[0]]
            idx = host_index([ids[p] for p in order], self.device)
            cuts = _run_cuts(runs)

            def place(cache: torch.Tensor, view: torch.Tensor) -> None:
                for (_, r0, length), j in zip(runs, cuts):
                    cache.index_copy_(0, idx[j : j + length], view[r0 : r0 + length])

            parts = [functools.partial(place, cache, view) for cache, view in zip(self._src, self._dst_views(pool, kept))]
        else:
            src_idx = host_index(list(rows), pool_device)
            dst_idx = host_index(ids, self.device)

            def scatter(cache: torch.Tensor, view: torch.Tensor) -> None:
                picked = view.index_select(0, src_idx).view(len(rows) * n, -1)
                cache.index_copy_(0, dst_idx, picked)

            parts = [functools.partial(scatter, cache, view) for cache, view in zip(self._src, self._dst_views(pool, kept))]
        self._copy(parts, pool_device, len(rows))

    def _here(self, pool_device: torch.device) -> bool:
        """Host to host on a thread whose copies run unsplit on it (an inline job): what
        :meth:`_copy` would run part by part, the caller may run in a plain loop."""
        return self.device.type == "cpu" and pool_device.type == "cpu" and self.copies.on_this_thread()

    def _copy(self, parts: list[Callable[[], None]], pool_device: torch.device, blocks: int) -> None:
        """Run a job's per-tensor copies: split over the copy threads between host buffers
        (see :mod:`kvtier.transfer.copies`), queued in order on a device's stream."""
        if self.device.type == "cpu" and pool_device.type == "cpu":
            self.copies.run(parts, blocks * self.block_bytes)
        else:
            for part in parts:
                part()

    def _pairs(
        self, ids: list[int], pool: torch.Tensor, rows: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(pool piece, cache slice) pairs, one per (block, tensor, engine block)."""
        n = self.engine_blocks_per_block
        views = self._dst_views(pool)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for j, row in enumerate(rows):
            for src, view in zip(self._src, views):
                piece = view[row].view(n, -1)
                for m in range(n):
                    dsts.append(piece[m])
                    srcs.append(src[ids[j * n + m]])
        return dsts, srcs
