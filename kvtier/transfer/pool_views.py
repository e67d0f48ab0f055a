"""Per-tensor views of a pool of records, for :class:`~kvtier.transfer.layout.KVLayout`'s copies.

A host job is one ``index_select`` (save) or ``index_copy_`` (load) per KV tensor, each into or
out of that tensor's words in the job's pool rows. Those views cost more than they look: a view
is about 1 µs here, and after a job's copy has pushed the interpreter's working set out of the
caches, the 32 views of a 32-layer job took about 80 µs and its index tensor about 60 µs, a
tenth of a 4-block job (``benchmarks/bench_core.py --job-blocks 4``).

A long-lived pool (``kept=True``: a memory tier's pool, the engine's staging) stays where it is
for the layout's life, so its views are made once and kept, keyed by the pool's ``id`` (the
pool is held with them, so the id is never reused):

* per tensor, its column of words in every row, ``[slots, n * words]`` (:meth:`PoolViews.columns`);
* per run of consecutive rows ``r0:end``, each tensor's words in those rows
  (:meth:`PoolViews.rows`), and the same cut row by row (:meth:`PoolViews.row_pieces`, for a
  small inline job's one copy per block and tensor). Runs recur: a tier's slots come back from its
  free list as the jobs that held them are evicted. At most :data:`MAX_KEPT_VIEWS` views of
  runs are kept (a view is about 600 bytes); past that the kept runs are dropped and made again
  as they come.

:func:`host_index` makes an index tensor from a list of ints through a buffer, at about half
the cost of ``torch.tensor``.

:class:`BlockViews` keeps the other side of a small job's copies: per engine block, its slice
of every KV tensor. A small inline job copies one ``_foreach_copy_`` over (block, tensor)
pieces, and making those views was its largest fixed cost: the 128 views of a 4-block job of
32 layers took about 350 µs after the job's copy had flushed the caches (a quarter of the copy).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

from kvtier.devices import device_index
from kvtier.errors import LayoutError

__all__ = ["MAX_KEPT_VIEWS", "BlockViews", "PoolViews", "check_pool", "host_index"]

#: Views of runs of rows kept per layout (about 10 MB of them).
MAX_KEPT_VIEWS = 16384


def host_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 index on ``device``; on the host, read from an ``array`` buffer
    (the tensor holds the buffer), not parsed element by element as ``torch.tensor`` does."""
    if device.type != "cpu" or not values:
        return device_index(values, device)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


class PoolViews:
    """Views of pools of ``[slots, record]`` uint8 rows, cut per tensor: ``slices[i]`` is the
    ``(start, stop)`` of tensor ``i``'s words in a record read as ``wide`` words (an integer
    dtype), and ``span`` the words of every tensor's share where all are as wide (else 0)."""

    def __init__(self, slices: Sequence[tuple[int, int]], wide: torch.dtype, span: int) -> None:
        self._slices = list(slices)
        self._wide = wide
        self._span = span
        self._columns: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        # (pool id, r0, end) -> [pool, per-tensor views, per (tensor, row) views or None]
        self._runs: dict[tuple[int, int, int], list[object]] = {}
        self._kept = 0  # views in _runs (another thread may race it: a bound, not a count)

    def held(self) -> bool:
        """Whether views of some pool are kept (and with them the pool)."""
        return bool(self._columns or self._runs)

    def forget(self) -> None:
        """Drop every kept view (and with them the pools they hold): the tiers are closing."""
        self._columns = {}
        self._runs = {}
        self._kept = 0

    def columns(self, pool: torch.Tensor, kept: bool = False) -> list[torch.Tensor]:
        """Per tensor, the pool's words for that tensor as a 2-D ``[slots, n * words]`` view
        (two-dimensional on purpose: ``index_copy_`` into ``[slots, n, words]`` was slower)."""
        if kept:
            got = self._columns.get(id(pool))
            if got is None or got[0] is not pool:
                got = self._columns[id(pool)] = (pool, self.columns(pool))
            return got[1]
        wide = pool.view(self._wide)
        return [wide[:, a:b] for a, b in self._slices]

    def rows(self, pool: torch.Tensor, kept: bool, r0: int, end: int) -> Sequence[torch.Tensor]:
        """Per tensor, its words in pool rows ``r0:end``: ``[v[r0:end] for v in columns(pool)]``.
        Where every tensor's share of a record is as wide, the same views come from one
        ``unbind`` of the rows, a third of the cost of the slices (a test compares them)."""
        if not kept:
            return self._cut(pool, r0, end, False)
        return self._run(pool, r0, end)[1]  # type: ignore[return-value]

    def row_pieces(self, pool: torch.Tensor, kept: bool, r0: int, end: int) -> list[torch.Tensor]:
        """Per row of ``r0:end``, then per tensor, that tensor's bytes in that row: the views of
        :meth:`rows` cut row by row (row-major, as :meth:`BlockViews.pieces` lists blocks), as
        ``uint8``: a copy of a piece of more than 32768 elements is split over torch's intra-op
        threads, so a 64 KiB piece copies on two threads as bytes and on one as 8192 words
        (``_foreach_copy_`` of 4 blocks of 32 such pieces, 1148 against 1368 µs here)."""
        if not kept:
            return self._pieces(self._cut(pool, r0, end, False))
        entry = self._run(pool, r0, end)
        if entry[2] is None:
            pieces = self._pieces(entry[1])  # type: ignore[arg-type]
            if self._kept + len(pieces) > MAX_KEPT_VIEWS:
                return pieces  # kept next time, once the runs start over
            self._kept += len(pieces)
            entry[2] = pieces
        return entry[2]  # type: ignore[return-value]

    @staticmethod
    def _pieces(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        cut = [view.view(torch.uint8).unbind(0) for view in views]
        return [piece for row in zip(*cut) for piece in row]

    def _run(self, pool: torch.Tensor, r0: int, end: int) -> list[object]:
        key = (id(pool), r0, end)
        entry = self._runs.get(key)
        if entry is None or entry[0] is not pool:
            views = self._cut(pool, r0, end, True)
            runs = self._runs
            if self._kept + len(views) > MAX_KEPT_VIEWS:
                # Start over (a whole new dict: another thread may be reading the old one).
                runs = self._runs = {}
                self._kept = 0
            self._kept += len(views)
            entry = runs[key] = [pool, views, None]
        return entry

    def _cut(self, pool: torch.Tensor, r0: int, end: int, kept: bool) -> Sequence[torch.Tensor]:
        span = self._span
        if span and pool.is_contiguous():
            return pool[r0:end].view(self._wide).view(end - r0, len(self._slices), span).unbind(1)
        return [view[r0:end] for view in self.columns(pool, kept)]


class BlockViews:
    """Per engine block, its bytes in every KV tensor (``tensors``: ``[blocks, words]`` views of
    the cache, read as ``uint8`` as :meth:`PoolViews.row_pieces` are), made on a block's first
    use and kept for the cache's life: an engine hands out the same blocks again and again. At
    most :data:`MAX_KEPT_VIEWS` views are kept (the first blocks seen); the views of any other
    block are made for each job."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = [t.view(torch.uint8) for t in tensors]
        self._kept: dict[int, list[torch.Tensor]] = {}
        self._room = max(0, MAX_KEPT_VIEWS // max(1, len(self._tensors)))

    def pieces(self, blocks: Sequence[int]) -> list[torch.Tensor]:
        """Per block of ``blocks``, then per tensor, that tensor's bytes in the block
        (block-major, as :meth:`PoolViews.row_pieces` lists rows)."""
        kept = self._kept
        out: list[torch.Tensor] = []
        for b in blocks:
            views = kept.get(b)
            if views is None:
                views = [t[b] for t in self._tensors]
                if len(kept) < self._room:  # another thread may race it: a bound, not a count
                    kept[b] = views
            out += views
        return out


def check_pool(pool: torch.Tensor, rows: Sequence[int], block_bytes: int) -> None:
    """That ``pool`` is a ``[slots, block_bytes]`` uint8 tensor and every one of ``rows`` a row
    of it; a :class:`~kvtier.errors.LayoutError` naming what is wrong otherwise."""
    if pool.dim() != 2 or pool.shape[1] != block_bytes or pool.dtype != torch.uint8:
        raise LayoutError(f"pool: expected a [slots, {block_bytes}] uint8 tensor, got {tuple(pool.shape)} {pool.dtype}")
    slots = pool.shape[0]
    if rows and not (min(rows) >= 0 and max(rows) < slots):
        i, r = next((i, r) for i, r in enumerate(rows) if not 0 <= r < slots)
        raise LayoutError(f"rows[{i}]: pool row {r} is out of range [0, {slots})")
