"""PoolRows: a pool's rows as a sequence, the same rows a list of views names."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import LayoutError
from kvtier.pool_rows import PoolRows, pool_rows, refusing_reads, refusing_writes


def _pool(rows: int = 6, size: int = 16) -> torch.Tensor:
    return torch.arange(rows * size, dtype=torch.int64).to(torch.uint8).reshape(rows, size)


@pytest.mark.parametrize("index", [range(6), range(1, 5), range(5, -1, -2), [4, 0, 2], (3,), []])
def test_rows_are_the_pools_rows(index: object) -> None:
    pool = _pool()
    rows = PoolRows(pool, index)  # type: ignore[arg-type]
    want = [pool[i] for i in index]  # type: ignore[attr-defined]
    assert len(rows) == len(want)
    for got, row in zip(rows, want, strict=True):
        assert got.data_ptr() == row.data_ptr() and got.shape == row.shape and torch.equal(got, row)
    for k in range(len(want)):
        assert rows[k].data_ptr() == want[k].data_ptr()
        assert rows[-1 - k].data_ptr() == want[-1 - k].data_ptr()


def test_rows_write_into_the_pool() -> None:
    pool = _pool()
    rows = pool_rows(pool, 3)
    rows[2].fill_(7)
    assert bool((pool[2] == 7).all()) and not bool((pool[3] == 7).all())


def test_slice_is_pool_rows_of_the_same_pool() -> None:
    pool = _pool()
    rows = PoolRows(pool, [5, 1, 3, 0])
    part = rows[1:3]
    assert isinstance(part, PoolRows) and part.pool is pool and list(part.numbers) == [1, 3]
    back = PoolRows(pool, range(6))[::-1]
    assert [r.data_ptr() for r in back] == [pool[i].data_ptr() for i in range(5, -1, -1)]


def test_index_past_the_pool_is_refused() -> None:
    with pytest.raises(LayoutError, match=r"\[0, 6\), got 0\.\.6"):
        PoolRows(_pool(), range(7))
    with pytest.raises(LayoutError, match=r"got -1\.\.2"):
        PoolRows(_pool(), [2, -1])
    with pytest.raises(IndexError):
        PoolRows(_pool(), range(2))[2]


def test_bad_pool_or_index_is_refused() -> None:
    with pytest.raises(LayoutError, match="2-D tensor of rows, got a 1-D tensor"):
        PoolRows(torch.zeros(8, dtype=torch.uint8), range(1))
    with pytest.raises(LayoutError, match="got list"):
        PoolRows([[0]], range(1))  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="must be ints, got \\['float'\\]"):
        PoolRows(_pool(), [1.0])  # type: ignore[list-item]


def test_a_sequence_to_code_that_knows_nothing_of_it() -> None:
    pool = _pool()
    rows = pool_rows(pool, 4)
    assert [r.data_ptr() for r in list(rows)] == [pool[i].data_ptr() for i in range(4)]
    assert "4 rows of a pool of shape (6, 16)" in repr(rows)


class _Tier:
    """A tier whose jobs raise what it is given, through :func:`refusing_writes` and :func:`refusing_reads`."""

    name = "sketch"

    def __init__(self, error: BaseException) -> None:
        self.error = error

    @refusing_writes
    def write_blocks(self, keys: list[bytes], blocks: list[torch.Tensor]) -> list[int | None]:
        """The job's own doc."""
        raise self.error

    @refusing_reads
    def read_blocks(self, keys: list[bytes], out: list[torch.Tensor]) -> list[bool]:
        raise self.error


def test_refusing_names_a_row_a_tier_cannot_hold() -> None:
    cause = RuntimeError("no storage")
    rows = [torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8).to_sparse()]
    with pytest.raises(LayoutError, match=r"sketch: rows\[1\] is a sparse_coo tensor") as caught:
        _Tier(cause).write_blocks([b"k", b"l"], rows)
    assert caught.value.__cause__ is cause


def test_refusing_raises_other_errors_as_they_were() -> None:
    cause = ValueError("bad key")
    with pytest.raises(ValueError) as caught:
        _Tier(cause).write_blocks([b"k"], [torch.zeros(4, dtype=torch.uint8)])
    assert caught.value is cause
    interrupt = KeyboardInterrupt()  # (not an Exception: never mapped)
    with pytest.raises(KeyboardInterrupt) as stopped:
        _Tier(interrupt).write_blocks([b"k"], [torch.zeros(4, dtype=torch.uint8).to_sparse()])
    assert stopped.value is interrupt
    assert _Tier.write_blocks.__doc__ == "The job's own doc." and _Tier.write_blocks.__name__ == "write_blocks"
