"""Rows of a host pool in the form a byte tier takes them: one :class:`~kvtier.pool_rows.PoolRows`
where the tier says it takes one (``Backend.takes_pool_rows``), else a list of views as before.

The engine's byte-tier jobs read into and write from rows of one pool (a job's staging, a host
memory tier's pool). A view per row costs about 1 µs a block; a :class:`PoolRows` is made once a
job. A plugin tier may do with its ``blocks`` what only a list allows (``torch.stack``,
``blocks + other``, ``isinstance(blocks, list)``), so only a tier that sets the flag gets one;
every other tier gets the list of views it always got. Rows of a pool that is not on the host
are always a list (:class:`PoolRows` names rows of a host pool).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.backend import Backend
from kvtier.devices import tensor_device
from kvtier.pool_rows import PoolRows

__all__ = ["gives_pool_rows", "kept_rows", "rows_at", "rows_for", "takes_pool_rows"]


def takes_pool_rows(backend: Backend) -> bool:
    """Whether ``backend`` says it takes a :class:`PoolRows` for its ``blocks`` and ``out``
    (a class that does not derive from :class:`Backend` and names no flag does not)."""
    return getattr(backend, "takes_pool_rows", False) is True


def gives_pool_rows(backend: Backend, pool: torch.Tensor) -> bool:
    """Whether rows of ``pool`` go to ``backend`` as one :class:`PoolRows`: it takes one and
    ``pool`` is on the host."""
    return takes_pool_rows(backend) and tensor_device(pool).type == "cpu"


def rows_at(backend: Backend, pool: torch.Tensor, numbers: range | Sequence[int]) -> Sequence[torch.Tensor]:
    """``pool[i]`` for each of ``numbers``, for ``backend``'s ``read_blocks``/``write_blocks``:
    one :class:`PoolRows` where it takes one (:func:`gives_pool_rows`), else a list of views."""
    if gives_pool_rows(backend, pool):
        return PoolRows(pool, numbers)
    return [pool[i] for i in numbers]


def rows_for(backend: Backend, pool: torch.Tensor, count: int) -> Sequence[torch.Tensor]:
    """The first ``count`` rows of ``pool`` (a job's staging) for ``backend`` (:func:`rows_at`)."""
    return rows_at(backend, pool, range(count))


def kept_rows(rows: Sequence[torch.Tensor], keep: Sequence[int]) -> Sequence[torch.Tensor]:
    """``rows[i]`` for each of ``keep``, in the form ``rows`` has: a :class:`PoolRows` of the same
    pool for a :class:`PoolRows`, else a list."""
    if isinstance(rows, PoolRows):
        numbers = rows.numbers
        return PoolRows(rows.pool, [numbers[i] for i in keep])
    return [rows[i] for i in keep]
