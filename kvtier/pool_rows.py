"""Rows of one host pool, handed to a tier as one object instead of a view per row.

A byte tier's ``read_blocks(keys, out)`` and ``write_blocks(keys, blocks)`` take a sequence of
rows. The engine's rows are rows of one pool (the staging rows of a job, a memory tier's pool),
and cutting a view per row (``staging[i]``, about 1 µs) only for the tier to ask each view's
dtype, shape, device, layout and address again (five torch getters, about 0.3 µs a row) is a cost
per block on the hot path. :class:`PoolRows` is that sequence made once a job: ``pool`` and the
row numbers ``numbers``. It is a ``Sequence[torch.Tensor]`` like any other (``rows[i]`` is
``pool[numbers[i]]``, made when asked), so a tier that knows nothing of it reads and writes rows
as before; a tier that knows it asks the pool's checks once and each row's address as
``pool.data_ptr() + numbers[i] * pool.stride(0)``.

The pool stays the caller's: a tier that knows :class:`PoolRows` checks the pool when it uses
it (its type, dtype, shape, device and layout, and each row number against the pool's rows
then), never from what this object saw when it was made.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

import torch

from kvtier.errors import LayoutError

__all__ = ["PoolRows", "pool_rows", "refusing_reads", "refusing_writes", "rows_refused"]

_R = TypeVar("_R")


class PoolRows(Sequence[torch.Tensor]):
    """``[pool[i] for i in numbers]`` as a sequence, without a view made per row.

    ``pool`` is a 2-D tensor (rows of bytes); ``numbers`` (the ``index`` given) a ``range`` or a sequence of row numbers,
    each in ``[0, pool.shape[0])``."""

    __slots__ = ("numbers", "pool")

    def __init__(self, pool: torch.Tensor, index: range | Sequence[int]) -> None:
        if not isinstance(pool, torch.Tensor) or pool.dim() != 2:
            what = f"a {pool.dim()}-D tensor" if isinstance(pool, torch.Tensor) else type(pool).__name__
            raise LayoutError(f"PoolRows: pool must be a 2-D tensor of rows, got {what}")
        if not isinstance(index, range):
            index = tuple(index)
            if any(type(i) is not int for i in index):
                raise LayoutError(f"PoolRows: row numbers must be ints, got {sorted({type(i).__name__ for i in index})}")
        rows = pool.shape[0]
        if len(index):
            lo, hi = (min(index[0], index[-1]), max(index[0], index[-1])) if isinstance(index, range) else (min(index), max(index))
            if lo < 0 or hi >= rows:
                raise LayoutError(f"PoolRows: row numbers must lie in [0, {rows}), got {lo}..{hi}")
        self.pool = pool
        self.numbers = index

    def __len__(self) -> int:
        return len(self.numbers)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> PoolRows: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | PoolRows:
        if isinstance(i, slice):
            return PoolRows(self.pool, self.numbers[i])
        return self.pool[self.numbers[i]]

    def __iter__(self) -> Iterator[torch.Tensor]:
        pool = self.pool
        for i in self.numbers:
            yield pool[i]

    def __repr__(self) -> str:
        return f"PoolRows({len(self.numbers)} rows of a pool of shape {tuple(self.pool.shape)}, numbers={self.numbers!r})"


def pool_rows(pool: torch.Tensor, count: int) -> PoolRows:
    """The first ``count`` rows of ``pool`` (a job's staging rows)."""
    return PoolRows(pool, range(count))


def rows_refused(tier: str, rows: Sequence[torch.Tensor], error: BaseException) -> BaseException:
    """The error to raise for a job its rows failed with ``error`` (asked only once the job
    raised, so it costs the hot path nothing): a :class:`LayoutError` naming the first row that
    is not strided (dense) memory, such as a row of a sparse pool, worded the same whether the
    rows came as a :class:`PoolRows` or as a list of its rows, with ``error`` as its cause;
    ``error`` itself where every row is strided."""
    try:
        for i in range(len(rows)):
            row = rows[i]
            if isinstance(row, torch.Tensor) and row.layout is not torch.strided:
                refused = LayoutError(
                    f"{tier}: rows[{i}] is a {str(row.layout).removeprefix('torch.')} tensor; "
                    "a tier reads and writes rows of strided (dense) memory only"
                )
                refused.__cause__ = error
                return refused
    except Exception:  # (rows whose own code raises here: the job's own error stands)
        return error
    return error


def refusing_reads(method: Callable[[Any, Sequence[bytes], Sequence[torch.Tensor]], _R]) -> Callable[[Any, Sequence[bytes], Sequence[torch.Tensor]], _R]:
    """``method`` (a tier's ``read_blocks(keys, out)``) with every ``Exception`` it raises mapped
    by :func:`rows_refused`: rows a tier cannot hold (such as a sparse pool's) fail the job by
    name, any other error is raised as it was. The tier's ``name`` names it. The wrapper takes
    the arguments by the names :class:`kvtier.backend.Backend` gives them, so a caller may pass
    ``out=`` by keyword."""

    @functools.wraps(method)
    def refusing(tier: Any, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> _R:
        try:
            return method(tier, keys, out)
        except Exception as exc:
            raise rows_refused(tier.name, out, exc)  # noqa: B904  (exc itself where the rows can be held; else its cause)

    return refusing


def refusing_writes(method: Callable[[Any, Sequence[bytes], Sequence[torch.Tensor]], _R]) -> Callable[[Any, Sequence[bytes], Sequence[torch.Tensor]], _R]:
    """:func:`refusing_reads` for a tier's ``write_blocks(keys, blocks)``: ``blocks=`` may be
    passed by keyword."""

    @functools.wraps(method)
    def refusing(tier: Any, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> _R:
        try:
            return method(tier, keys, blocks)
        except Exception as exc:
            raise rows_refused(tier.name, blocks, exc)  # noqa: B904  (exc itself where the rows can be held; else its cause)

    return refusing
