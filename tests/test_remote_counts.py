"""A remote tier's counters (``blocks_written``, ``bytes_written``, ``write_failures``,
``blocks_read``, ``read_misses``, ``deleted``, ``auth_failures``, its servers' ``fast_failures``)
are added to by jobs running on several engine threads at once, and some of them by a job's
shares, each on a thread of its own: none of their adds is lost to another thread's add made
between its read and its store (the same race as ``rows_moved``'s, tests/test_rows_moved_count.py)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends.remote_health import Health
from test_rows_moved_count import JOBS, THREADS, _race, busy_switches  # noqa: F401  (busy_switches: a fixture)

from kvtier import registry
from kvtier.backend import Backend, BackendCounters, BlockFormat
from kvtier.records.mac import RecordAuthError

SIZE = 4096
ROWS = 3
pytestmark = pytest.mark.usefixtures("busy_switches")


class _YieldingCounters(BackendCounters):
    """Counters whose every read lets other threads run before the caller goes on: an add
    (``counters.n += k``: a read, then a store) without a lock then loses the adds made by the
    threads that ran in between, as a build without the GIL may anywhere."""

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        time.sleep(0)
        return value


class _YieldingHealth(Health):
    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if name == "fast_failures":
            time.sleep(0)
        return value


@pytest.fixture
def backend(redis_server: Any, tmp_path: Path) -> Iterator[Backend]:
    prefix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    opened = registry.backends.get("redis")(capacity=64 << 20, sync_interval_s=3600, url=redis_server.url, prefix=prefix, feed=False)
    asyncio.run(opened.open(BlockFormat(block_bytes=SIZE, dtype="uint8")))
    opened.counters = _YieldingCounters()
    opened._health.__class__ = _YieldingHealth
    try:
        yield opened
    finally:
        asyncio.run(opened.aclose())


def _keys() -> list[bytes]:
    return [hashlib.sha256(bytes([i])).digest() for i in range(ROWS)]


def test_saves_on_many_threads_lose_no_count(backend: Any) -> None:
    """Each job's shares (no server asked) store the first record and fail the others."""

    def first_stored(fn: Any, rkeys: Any, *args: Any, **kwargs: Any) -> list[int]:
        fn.keywords["job"].sizes[0] = SIZE + 32
        return []

    backend._run_io = first_stored
    rows = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(ROWS)]
    _race(lambda: backend.write_blocks(_keys(), rows))
    stats, jobs = backend.stats(), THREADS * JOBS
    assert (stats["blocks_written"], stats["bytes_written"], stats["write_failures"]) == (jobs, jobs * (SIZE + 32), jobs * (ROWS - 1))


def test_loads_on_many_threads_lose_no_count(backend: Any) -> None:
    """Each job's shares find the first record and miss the others."""

    def first_found(fn: Any, rkeys: Any, *args: Any, **kwargs: Any) -> list[int]:
        fn.keywords["job"].found[0] = True
        return []

    backend._run_io = first_found
    rows = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(ROWS)]
    _race(lambda: backend.read_blocks(_keys(), rows))
    stats, jobs = backend.stats(), THREADS * JOBS
    assert (stats["blocks_read"], stats["bytes_read"], stats["read_misses"]) == (jobs, jobs * SIZE, jobs * (ROWS - 1))


def test_refusals_and_deletes_on_many_threads_lose_no_count(backend: Any) -> None:
    """A record refused by the keyed check is counted from its share's thread; deletions are
    added up from each share's; a server in its backoff fails jobs fast on the callers' threads."""
    backend._delete_records = lambda handle, rkeys: len(rkeys)
    _race(lambda: backend._count_auth(RecordAuthError("refused")))
    _race(lambda: backend.delete_blocks(_keys()))
    down = backend._health
    down.failed(ConnectionError("gone"))
    down._retry_at = float("inf")  # (its backoff never runs out: every job fails fast)
    _race(lambda: backend.write_blocks(_keys(), [torch.zeros(SIZE, dtype=torch.uint8)] * ROWS))
    stats, jobs = backend.stats(), THREADS * JOBS
    assert (stats["auth_failures"], stats["deleted"]) == (jobs, jobs * ROWS)
    assert (stats["fast_failures"], stats["write_failures"]) == (jobs * ROWS, jobs * ROWS)
