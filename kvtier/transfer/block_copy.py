"""A small host job's whole copy in one native call (:class:`NativeBlocks`).

A small inline job between a host KV cache and a ``cpu`` tier's pool (at most
``_FOREACH_MAX_BLOCKS`` blocks, :meth:`KVLayout._small_run
<kvtier.transfer.layout.KVLayout._small_run>`) is one copy per (block, tensor) piece. Torch does
it as one ``_foreach_copy_`` of kept views when the pool rows are one ascending run (else one
index op per tensor): every piece a dispatch and an OpenMP region on the calling thread's team.
The native copy takes any rows, and the team's pace (:class:`~kvtier.transfer.copies.TeamPace`)
does not count its jobs. Where the extension ``kvtier.transfer._blockcopy`` is built (at install,
with a C compiler), :class:`NativeBlocks` copies the same pieces, in the same order, in one call
that checks every block id and pool row first and then copies without the GIL; a job of 1 MiB or
more writes with non-temporal stores (no read of the destination before it is overwritten).
Measured here on a 4-block job of 2 MiB blocks (32 layers) after a flush of the CPU caches: 1.2-1.3
ms against 1.3-1.7 ms for the ``_foreach_copy_`` on a team of two threads, and it does not
depend on a second CPU being free.

**A larger inline job on the caller's team** (:meth:`NativeBlocks.copy` with ``threads > 1``)
is one native call too, its blocks taken in turn by the threads of the calling thread's own
OpenMP team (the runtime's ``GOMP_parallel``, :func:`~kvtier.devices.openmp_team_runner`), the
threads torch's index ops on that thread would use. Right after an op of torch's the team's
helpers spin, awake, on the other CPUs: a copy thread of our own found none free there and ran
its share after the caller's, not beside it (16 blocks of 2 MiB split over the caller and one
pool thread: 3.8-4.1 ms, as slow as one thread; on the team: 2.0-2.3 ms, against 3.3-3.7 ms save
and 4.3-5.2 ms load for torch's index ops on the same team, measured here after a cache flush).
A job whose destinations repeat copies in order on the calling thread (the last one wins, as
in torch's serial order).

The bytes moved are the same either way (``tests/test_block_copy.py`` compares the two). Without
the extension, or with :attr:`NativeBlocks.enabled` off, the layout copies with torch as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from itertools import pairwise

import torch

from kvtier.devices import openmp_team_runner

try:
    import kvtier.transfer._blockcopy as _blockcopy  # type: ignore[import-not-found]
except ImportError:  # no C compiler at install: torch copies
    _blockcopy = None

__all__ = ["NATIVE", "TEAM", "NativeBlocks", "native_blocks"]

#: Whether the extension is built here.
NATIVE: bool = _blockcopy is not None
if _blockcopy is not None:
    _blockcopy.set_team(openmp_team_runner())
#: Whether a job can run on the calling thread's OpenMP team (``threads > 1``).
TEAM: bool = _blockcopy is not None and _blockcopy.team()
_DATA_PTR = torch.Tensor.data_ptr
#: Pools a copier keeps the address of at most (a store has one per memory tier).
MAX_POOLS = 16
_INT = frozenset({int})
#: Runs a job's parts, each a call writing rows no other writes (``CopySplitter.run``).
SplitRun = Callable[[Sequence[Callable[[], None]], int], None]


class NativeBlocks:
    """Blocks of host KV tensors ``sources`` (contiguous, block dimension first, ``blocks``
    each) copied to and from pools of records of ``row_bytes``, tensor ``i``'s
    ``piece_bytes[i]`` bytes of a block at ``offsets[i]`` in its record."""

    def __init__(self, sources: Sequence[torch.Tensor], piece_bytes: Sequence[int], offsets: Sequence[int], row_bytes: int) -> None:
        if _blockcopy is None:
            raise RuntimeError("native block copies: kvtier.transfer._blockcopy is not built (no C compiler at install)")
        blocks = sources[0].shape[0]
        for i, t in enumerate(sources):
            if t.device.type != "cpu" or not t.is_contiguous() or t.shape[0] != blocks:
                raise ValueError(f"sources[{i}]: expected a contiguous host tensor of {blocks} blocks, got {t.device} {tuple(t.shape)}")
            if t[0].numel() * t.element_size() != piece_bytes[i]:
                raise ValueError(f"piece_bytes[{i}]: {piece_bytes[i]}, but a block of sources[{i}] is {t[0].numel() * t.element_size()} bytes")
        # The tensors are held by the copier and their addresses read here; a cache whose storage
        # moves later (resize_ past its size, set_) would be copied at its old address (freed: a
        # fault or wrong bytes), where torch's views follow it. So every call first compares the
        # addresses again (:meth:`_moved`, one C-level pass: 1-3 us a job of 32 tensors, against
        # ~1 ms of copy), and a moved cache turns the native copy off for good: torch copies.
        self._sources = tuple(sources)
        self.blocks = blocks
        self._ptrs = [t.data_ptr() for t in sources]
        self._copier = _blockcopy.BlockCopier(list(self._ptrs), blocks, list(piece_bytes), list(offsets), row_bytes, self._sources)
        self.row_bytes = row_bytes
        self._pools: dict[int, torch.Tensor] = {}  # id(pool) -> pool, checked
        #: off: the layout copies with torch (tests compare the two)
        self.enabled = True

    def _check(self, pool: torch.Tensor) -> None:
        """``pool`` is a contiguous 2-D uint8 host tensor (checked once per pool; its address
        and shape are read at every call, so a pool resized in place is copied to where it is)."""
        if self._pools.get(id(pool)) is not pool:
            if pool.device.type != "cpu" or pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
                raise ValueError(f"pool: expected a contiguous [slots, {self.row_bytes}] uint8 host tensor, got {pool.dtype} {tuple(pool.shape)}")
            if len(self._pools) >= MAX_POOLS:  # pools of tiers gone: not held for good
                self._pools = {}
            self._pools[id(pool)] = pool

    def copy(self, save: bool, ids: list[int], pool: torch.Tensor, rows: Sequence[int], threads: int = 1) -> int:
        """:meth:`gather` (``save``) or :meth:`scatter`, on the calling thread's OpenMP team of
        ``threads`` where more than one (see the module doc): the number of threads that copied
        (1 where the team is not reachable or the destinations repeat); 0, having copied
        nothing, while not :attr:`enabled` (or once a cache moved: :meth:`_moved`)."""
        if not self.enabled or self._moved():
            return 0
        return self._run(save, ids, pool, rows, threads)

    def copy_split(self, save: bool, ids: list[int], pool: torch.Tensor, rows: Sequence[int], shares: int, run: SplitRun) -> int:
        """:meth:`copy` of a job on a transfer thread, its blocks cut into ``shares`` contiguous
        shares that ``run(parts, nbytes)`` (:meth:`CopySplitter.run
        <kvtier.transfer.copies.CopySplitter.run>`) runs on the copy threads, each share one native
        call without the GIL: the number of shares (1: one call here, where ``shares`` is 1 or the
        destinations repeat; 0: not copied, as :meth:`copy`). Every id and row is checked before
        any share starts, so a bad one is refused (by the one call) before a byte moves."""
        if not self.enabled or self._moved():
            return 0
        k = len(rows)
        shares = min(shares, k)
        dst = rows if save else ids
        if shares < 2 or len(set(dst)) != k or not self._in_range(ids, pool, rows):
            return self._run(save, ids, pool, rows)
        self._check(pool)
        cuts = [k * i // shares for i in range(shares + 1)]
        rows = list(rows)
        run([partial(self._share, save, ids[a:b], pool, rows[a:b]) for a, b in pairwise(cuts)], k * self.row_bytes)
        return shares

    def _share(self, save: bool, ids: list[int], pool: torch.Tensor, rows: Sequence[int]) -> None:
        self._run(save, ids, pool, rows)

    def _in_range(self, ids: list[int], pool: torch.Tensor, rows: Sequence[int]) -> bool:
        """Whether every id and row is an int in range (else one call refuses the job whole)."""
        if not (set(map(type, ids)) <= _INT and set(map(type, rows)) <= _INT):
            return False
        return 0 <= min(ids) and max(ids) < self.blocks and 0 <= min(rows) and max(rows) < pool.shape[0]

    def _moved(self) -> bool:
        """Whether some cache's storage moved since the copier took its address (then the copier
        is off for good: :attr:`enabled` false, and :meth:`gather` / :meth:`scatter` refuse)."""
        if list(map(_DATA_PTR, self._sources)) == self._ptrs:
            return False
        self.enabled = False
        return True

    def _run(self, save: bool, ids: list[int], pool: torch.Tensor, rows: Sequence[int], threads: int = 1) -> int:
        self._check(pool)
        slots, row_bytes = pool.shape
        used: int = (self._copier.gather if save else self._copier.scatter)(pool.data_ptr(), slots, row_bytes, rows, ids, threads)
        return used

    def _refuse_moved(self) -> None:
        if self._moved():
            raise RuntimeError("native block copies: a KV cache's storage moved (resize_ or set_) since the copier took its address")

    def gather(self, ids: list[int], pool: torch.Tensor, rows: Sequence[int]) -> None:
        """Copy engine block ``ids[j]`` of every tensor into record ``rows[j]`` of ``pool``."""
        self._refuse_moved()
        self._run(True, ids, pool, rows)

    def scatter(self, pool: torch.Tensor, rows: Sequence[int], ids: list[int]) -> None:
        """Copy record ``rows[j]`` of ``pool`` into engine block ``ids[j]`` of every tensor."""
        self._refuse_moved()
        self._run(False, ids, pool, rows)

    def held(self) -> bool:
        """Whether some pool is held (checked, kept)."""
        return bool(self._pools)

    def forget(self) -> None:
        """Drop the pools held (the tiers are closing)."""
        self._pools = {}


def native_blocks(sources: Sequence[torch.Tensor], piece_bytes: Sequence[int], offsets: Sequence[int], row_bytes: int) -> NativeBlocks | None:
    """A :class:`NativeBlocks` where the extension is built and the tensors are host ones, else ``None``."""
    if _blockcopy is None or any(t.device.type != "cpu" for t in sources):
        return None
    return NativeBlocks(sources, piece_bytes, offsets, row_bytes)
