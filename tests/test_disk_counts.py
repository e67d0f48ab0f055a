"""The ``lmdb`` and ``file`` tiers' counters (``blocks_written``, ``bytes_written``,
``blocks_read``, ``bytes_read``, ``read_misses``) are added to by jobs on several threads at once
(the store's worker pool, the engine's thread), by Python lines and native ones: none of their
adds is lost to another thread's add made between its read and its store. The counters here
let other threads run at each read (as tests/test_remote_counts.py does for the remote tiers),
so an add not made by ``kvtier.records.counts.counts_add`` (``counters.n += k``, or a native
read's own getattr and setattr) loses counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_tier, lmdb_lone, lmdb_one, lmdb_plain
from test_rows_moved_count import JOBS, THREADS, _race, busy_switches  # noqa: F401  (busy_switches: a fixture)

from kvtier import registry
from kvtier.backend import Backend, BackendCounters, BlockFormat
from kvtier.pool_rows import PoolRows
from kvtier.records import xxcopy
from kvtier.testing import make_key

SIZE = 4096
pytestmark = pytest.mark.usefixtures("busy_switches")


@pytest.fixture(params=["lmdb", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    more: dict[str, Any] = {"layout": "flat"} if request.param == "file" else {}
    opened = registry.backends.get(str(request.param))(capacity=64 << 20, path=str(tmp_path / "t"), sync_mode="fast", **more)
    asyncio.run(opened.open(BlockFormat(block_bytes=SIZE, dtype="uint8")))
    try:
        yield opened
    finally:
        asyncio.run(opened.aclose())


def _record_bytes(backend: Any, keys: list[bytes], rows: Any) -> int:
    """What one save of ``keys`` adds to ``bytes_written`` (asked alone, before the race)."""
    was = backend.counters.bytes_written
    assert None not in backend.write_blocks(keys, rows)
    return int(backend.counters.bytes_written - was)


class _YieldingSlots(BackendCounters):
    """Counters whose every read lets other threads run (as tests/test_remote_counts.py's do for
    the remote tiers), laid out as BackendCounters: the class of the counters a tier and its read
    and save lines (native ones included) took at its open can be switched to it."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        time.sleep(0)
        return value


def _yielding(counters: BackendCounters) -> None:
    """``counters`` zeroed, then of the class above."""
    for name in BackendCounters.__slots__:  # type: ignore[attr-defined]
        setattr(counters, name, 0)
    counters.__class__ = _YieldingSlots


def _stats(counters: BackendCounters) -> dict[str, int]:
    return {name: getattr(counters, name) for name in BackendCounters.__slots__}  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", ["straight", "general"])
@pytest.mark.parametrize("job", [1, 3])
def test_saves_on_many_threads_lose_no_count(backend: Any, job: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "general":
        monkeypatch.setattr(lmdb_lone, "LONE_SAVES", False)
    keys = [make_key(i) for i in range(job)]
    rows = PoolRows(torch.full((job, SIZE), 3, dtype=torch.uint8), range(job))
    each = _record_bytes(backend, keys, rows)
    _yielding(backend.counters)
    _race(lambda: backend.write_blocks(keys, rows))
    jobs = THREADS * JOBS
    stats = _stats(backend.counters)
    assert (stats["blocks_written"], stats["bytes_written"], stats["write_failures"]) == (jobs * job, jobs * each, 0)


@pytest.mark.parametrize("path", ["straight", "general"])
@pytest.mark.parametrize("job", [1, 3])
def test_loads_on_many_threads_lose_no_count(backend: Any, job: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loads' Python lines (the native ones add in one call with the GIL held, from the
    counters the tier had at its open)."""
    for name in ("one_read", "job_read", "straight_read"):
        monkeypatch.setattr(lmdb_plain, name, None)
    monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
    if path == "general":
        monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", False)
        monkeypatch.setattr(file_tier, "PLAIN_READS", False)
    keys, hits = [make_key(i) for i in range(job)], max(job - 1, 1)  # (a job of 3: its last key absent)
    backend.write_blocks(keys[:hits], [torch.zeros(SIZE, dtype=torch.uint8)] * hits)
    rows = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(job)]
    backend.read_blocks(keys, rows)  # (the rows' views kept: the straight lines take the next jobs)
    _yielding(backend.counters)
    _race(lambda: backend.read_blocks(keys, rows))
    jobs = THREADS * JOBS
    stats = _stats(backend.counters)
    assert (stats["blocks_read"], stats["bytes_read"], stats["read_misses"]) == (jobs * hits, jobs * hits * SIZE, jobs * (job - hits))


def test_a_miss_of_one_on_many_threads_loses_no_count(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("one_read", "job_read", "straight_read"):
        monkeypatch.setattr(lmdb_plain, name, None)
    monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
    keys, rows = [make_key(7)], [torch.zeros(SIZE, dtype=torch.uint8)]
    backend.write_blocks([make_key(8)], rows)
    backend.read_blocks([make_key(8)], rows)  # (the row's view kept)
    _yielding(backend.counters)
    _race(lambda: backend.read_blocks(keys, rows))
    assert _stats(backend.counters)["read_misses"] == THREADS * JOBS


def _counting_native(backend: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tier's native read of a job wrapped to note each job it served (a list), where built."""
    module, name = (lmdb_plain, "straight_read") if backend.name == "lmdb" else (xxcopy, "xxh3_read_job")
    native = getattr(module, name)
    if native is None:
        pytest.skip("the native reads are not built")
    served: list[int] = []

    def counted(*args: Any) -> Any:
        found = native(*args)
        if type(found) is list:
            served.append(1)
        return found

    monkeypatch.setattr(module, name, counted)
    return served


@pytest.mark.parametrize("kind", ["plain", "yielding"])
def test_native_reads_and_python_saves_on_one_counters_lose_no_count(backend: Any, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every thread reads a record natively (the counters the tier took at its open, added in C)
    and saves another (added in Python) into the same counters: no add of either kind is lost to
    the other. Plain counters: the native call's lock-free add; yielding ones: both under the
    Python form's lock (before, the native generic add and ``+=`` lost each other's)."""
    served = _counting_native(backend, monkeypatch)
    key, other, row, wrow = make_key(1), make_key(2), torch.zeros(SIZE, dtype=torch.uint8), torch.full((SIZE,), 5, dtype=torch.uint8)
    stored = backend.write_blocks([key], [row])
    assert stored == backend.write_blocks([other], [wrow]) and None not in stored
    each = backend.counters.bytes_written // 2
    assert backend.read_blocks([key], [row]) == [True]  # (the row's view kept: the native read takes the next jobs)
    counters = backend.counters
    if kind == "yielding":
        _yielding(counters)
    else:
        for name in BackendCounters.__slots__:  # type: ignore[attr-defined]
            setattr(counters, name, 0)
    served.clear()

    def work() -> None:
        assert backend.read_blocks([key], [row]) == [True]
        assert backend.write_blocks([other], [wrow]) == stored

    _race(work)
    jobs = THREADS * JOBS
    stats = _stats(counters)
    assert served  # (native reads among them: one that finds the file grown since the last takes the Python lines)
    assert (stats["blocks_read"], stats["bytes_read"], stats["read_misses"]) == (jobs, jobs * SIZE, 0)
    assert (stats["blocks_written"], stats["bytes_written"], stats["write_failures"]) == (jobs, jobs * each, 0)
