"""The remote tiers' ``rows_moved`` count (records not served or not stored because their row
moved in the transfer, ``kvtier.backends.remote_rows``) is added to from several threads at
once: engine threads running jobs, and a job's shares, each on a thread of its own. Every add
counts: none is lost to another thread's add made between its read and its store."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends.remote_rows import Count

from kvtier import registry
from kvtier.backend import BlockFormat

SIZE = 4096
THREADS, JOBS, ROWS = 8, 300, 3


@pytest.fixture
def busy_switches() -> Iterator[None]:
    """Threads switched as often as the interpreter can: a lost add, if any, shows."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


class _Listed(list):  # type: ignore[type-arg]
    """A list whose length is asked in Python: where the count is read before it (``rows_moved
    += len(...)``), this interpreter may switch threads between the count's read and its store,
    as a build without the GIL may anywhere."""

    def __len__(self) -> int:
        return super().__len__()


def _race(work: Any) -> None:
    start = threading.Barrier(THREADS)

    def run() -> None:
        start.wait()
        for _ in range(JOBS):
            work()

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_a_count_added_to_from_many_threads_loses_no_add(busy_switches: None) -> None:
    count = Count()
    _race(lambda: count.add(len("abc")))
    count.add(0)
    assert count.value == THREADS * JOBS * 3


def test_a_redis_tiers_rows_moved_loses_no_count_from_jobs_on_many_threads(redis_server: Any, tmp_path: Path, busy_switches: None) -> None:
    """Saves run at once on many threads, each finding all its rows moved since the job's
    checks (refused, nothing sent): ``rows_moved`` counts every one of them. (Before its adds
    were under a lock, one run here counted 4188 of 7200.)"""
    backend = registry.backends.get("redis")(capacity=64 << 20, sync_interval_s=3600, url=redis_server.url, prefix=hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12])
    asyncio.run(backend.open(BlockFormat(block_bytes=SIZE, dtype="uint8")))
    try:

        def every_row_moved(fn: Any, rkeys: Any, *args: Any, **kwargs: Any) -> None:
            job = fn.keywords["job"]  # (the shares' transfer, on no server: each row found moved)
            job.refused = _Listed(range(len(rkeys)))

        backend._run_io = every_row_moved  # type: ignore[method-assign]
        keys = [hashlib.sha256(bytes([i])).digest() for i in range(ROWS)]
        rows = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(ROWS)]
        _race(lambda: backend.write_blocks(keys, rows))
        assert backend.stats()["rows_moved"] == THREADS * JOBS * ROWS
    finally:
        asyncio.run(backend.aclose())
