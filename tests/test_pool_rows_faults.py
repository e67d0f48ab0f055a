"""The ``lmdb`` and ``file`` tiers given rows they cannot hold the memory of: a sparse pool's rows
fail the job with a :class:`LayoutError` that names the row and its layout, the same whether the
rows come as one pool (:class:`PoolRows`) or as a list of its rows, as a row of the wrong shape is
refused; a pool whose own code refuses to hand out its storage is taken as its rows are. Either
way the rows' hold is let go (automatic collection on again) and nothing stored is lost."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_pool_rows_tiers import SIZE, _opened, _outcome, _saved, form  # noqa: F401  (form: a fixture)

from kvtier.backend import Backend
from kvtier.errors import LayoutError
from kvtier.pool_rows import PoolRows
from kvtier.testing import make_key


class _NoStorage(torch.Tensor):
    """A pool whose own code refuses to hand its storage out."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", None) == "untyped_storage":
            raise ValueError("no storage handed out")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture(params=["lmdb", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    assert gc.isenabled()
    with _opened(tmp_path / "t", str(request.param)) as opened:
        try:
            yield opened
        finally:
            gc.enable()  # (for the tests after a failure here)


def _job(backend: Backend, op: str, keys: list[bytes], rows: Any) -> Any:
    return _outcome(lambda: backend.read_blocks(keys, rows) if op == "read" else backend.write_blocks(keys, rows))


def _intact(backend: Backend, keys: list[bytes], src: torch.Tensor) -> None:
    back = torch.zeros_like(src)
    assert backend.read_blocks(keys, list(back)) == [True] * len(keys)
    assert torch.equal(back, src), "a stored record was lost or changed"


@pytest.mark.usefixtures("form")
@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("job", [1, 3])
def test_a_sparse_pool_fails_the_job_by_name_as_its_rows_do(backend: Backend, job: int, op: str) -> None:
    """Before, torch's own error, naming nothing: ``Cannot access storage of SparseTensorImpl``
    for the pool, ``nbytes is not defined for sparse tensors`` for its rows as a list."""
    keys, src = _saved(backend, job)
    failures = backend.counters.write_failures
    outcomes = []
    for as_list in (False, True):
        rows: Any = PoolRows(torch.zeros(job + 1, SIZE, dtype=torch.uint8).to_sparse(), range(1, job + 1))
        rows = list(rows) if as_list else rows
        for _ in range(2):  # (the second: whatever the first kept)
            got = _job(backend, op, keys, rows)
            assert gc.isenabled(), f"the rows' hold was not let go ({got})"
            outcomes.append(got)
    assert outcomes[0] == ("LayoutError", f"{backend.name}: rows[0] is a sparse_coo tensor; a tier reads and writes rows of strided (dense) memory only")
    assert all(o == outcomes[0] for o in outcomes), outcomes
    assert issubclass(LayoutError, ValueError)
    assert backend.counters.write_failures == failures
    _intact(backend, keys, src)


@pytest.mark.usefixtures("form")
@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("job", [1, 3])
def test_a_pool_refusing_its_storage_is_taken_as_its_rows_are(backend: Backend, job: int, op: str) -> None:
    """Before, the pool failed the job with its own ``ValueError`` while the same rows as a list
    were read and saved: the pool's storage, which holds its memory through the job, is taken
    before its checks. Now such a pool is not held by its storage and its rows go the way its
    rows as a list go, with the same bytes."""
    keys, src = _saved(backend, job)
    fresh = torch.stack([torch.full((SIZE,), 7 + i, dtype=torch.uint8) for i in range(job)])
    for as_list in (False, True):
        whole = torch.zeros(job + 1, SIZE, dtype=torch.uint8)
        if op == "write":
            whole[1:] = fresh
        rows: Any = PoolRows(whole.as_subclass(_NoStorage), range(1, job + 1))
        rows = list(rows) if as_list else rows
        for _ in range(2):
            got = _job(backend, op, keys, rows)
            assert gc.isenabled(), f"the rows' hold was not let go ({got})"
            if op == "read":
                assert got == [True] * job
                assert torch.equal(whole[1:], src)
            else:
                assert None not in got and len(set(got)) == 1, got
                _intact(backend, keys, fresh)


def test_the_jobs_take_their_rows_by_the_backend_apis_names(backend: Backend) -> None:
    """``write_blocks(keys, blocks=...)`` and ``read_blocks(keys, out=...)`` by keyword, as
    :class:`kvtier.backend.Backend` names them: the jobs' wrapper that names refused rows took
    them by position only (a ``TypeError`` before), and a sparse pool is refused by name so too."""
    src = torch.arange(2 * SIZE, dtype=torch.int64).to(torch.uint8).view(2, SIZE)
    keys = [make_key(700), make_key(701)]
    assert all(backend.write_blocks(keys=keys, blocks=list(src)))
    back = torch.zeros_like(src)
    assert backend.read_blocks(keys=keys, out=list(back)) == [True, True]
    assert torch.equal(back, src)
    with pytest.raises(LayoutError, match=r"rows\[0\] is a sparse_coo tensor"):
        backend.read_blocks(keys=keys, out=[torch.zeros(SIZE, dtype=torch.uint8).to_sparse()] * 2)
    assert gc.isenabled()
