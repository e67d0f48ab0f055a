"""One job's host copy, dealt out to a few threads.

A job between a host KV cache and a host pool is one ``index_select`` (or ``index_copy_``) per
KV tensor. :class:`CopySplitter` deals a job's per-tensor copies out to ``threads`` threads: the
calling thread runs one share and a process-wide pool (``kvtier-copy-*`` threads, created on
first use and again in a forked child) the others. The ops release the GIL, so the shares
overlap.

**Each share runs on its thread alone** (:func:`one_intra_op_thread`): torch splits a copy this
wide over its OpenMP intra-op threads, and OpenMP gives every thread that starts a parallel
region a team of its own. So a copy on the mover thread made a second team beside the
engine's. With more OpenMP threads than CPUs, libgomp stops spinning between regions, and every
region of either team then waits for its helpers to be woken. Measured on 2 CPUs
(``benchmarks/bench_core.py``): one thread copies at 6.4 GB/s and the calling thread with its
team of two at 12.8. A copy on another thread with a team of its own reached 9.7, and the
calling thread's own copies then fell to 9.7 as well. Two threads with one OpenMP thread each
reached 12.7 and left the calling thread's copies at 13.2. So ``copy_threads`` is exactly the
threads a job's copy uses.

The split never changes what is copied, only which thread copies it: every share writes
rows no other share writes. :meth:`CopySplitter.run` returns only once every share has ended,
failed or not, so no copy of the job is still running when the caller reports it (or a
cancellation waits for it). Jobs under :data:`MIN_SPLIT_BYTES` stay on the calling thread,
where a hop would cost more than it saves.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Literal

from kvtier.devices import one_intra_op_thread, usable_cpus
from kvtier.errors import LayoutError
from kvtier.shares import run_all

__all__ = ["MIN_SPLIT_BYTES", "THREAD_PREFIX", "CopySplitter", "CopyThreads", "auto_copy_threads", "one_intra_op_thread"]

#: Jobs with fewer bytes than this are copied on the calling thread alone.
MIN_SPLIT_BYTES = 8 << 20
#: Name prefix of the copy threads (process-wide: they outlive every store).
THREAD_PREFIX = "kvtier-copy"
#: ``auto`` uses at most this many threads: a few saturate a socket's memory bandwidth, and
#: the engine's own compute (CPU inference) needs the other cores.
AUTO_MAX = 4
#: ``auto`` uses at least this many threads where there are as many CPUs: torch's own copy on
#: the calling thread uses every core with its intra-op threads.
AUTO_MIN = 2

CopyThreads = int | Literal["auto"]

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_pid = 0
_lock = threading.Lock()


def auto_copy_threads(cpus: int | None = None) -> int:
    """Threads per job copy for ``copy_threads: auto``: a quarter of the CPUs this process may
    run on, between :data:`AUTO_MIN` and :data:`AUTO_MAX`, and never more than the CPUs."""
    if cpus is None:
        cpus = usable_cpus()
    return max(1, min(cpus, max(AUTO_MIN, min(AUTO_MAX, cpus // 4))))


def resolve_copy_threads(value: CopyThreads) -> int:
    """``value`` as a thread count (``auto``: :func:`auto_copy_threads`); a clear error otherwise."""
    if value == "auto":
        return auto_copy_threads()
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"copy_threads: expected 'auto' or an integer >= 1, got {value!r}")
    return value


def _pool(workers: int) -> ThreadPoolExecutor:
    global _pools_pid
    with _lock:
        if _pools_pid != os.getpid():  # a forked child: the parent's pools have no threads here
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=THREAD_PREFIX)
        return pool


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # it may have been held by a thread that does not exist here


os.register_at_fork(after_in_child=_after_fork_in_child)


def _run_all(parts: Sequence[Callable[[], None]]) -> None:
    with one_intra_op_thread():
        for part in parts:
            part()


class _CallersTeam:
    """:meth:`CopySplitter.on_callers_team`'s context: sets the thread's flag, then restores it."""

    __slots__ = ("_before", "_callers")

    def __init__(self, callers: threading.local) -> None:
        self._callers = callers
        self._before = False

    def __enter__(self) -> None:
        self._before = getattr(self._callers, "on", False)
        self._callers.on = True

    def __exit__(self, *exc: object) -> None:
        self._callers.on = self._before


class CopySplitter:
    """Runs a job's copies (independent callables writing disjoint rows) on ``threads`` threads."""

    def __init__(self, threads: CopyThreads = 1, *, min_bytes: int = MIN_SPLIT_BYTES) -> None:
        self.threads = resolve_copy_threads(threads)
        self.min_bytes = min_bytes
        self._callers = threading.local()

    def on_callers_team(self) -> _CallersTeam:
        """Inside, this thread's jobs copy on this thread with its own OpenMP team, unsplit: for
        a job run on the engine's own thread (:mod:`kvtier.transfer.inline`), whose team is the
        engine's, so no second team is started. Measured here the fastest host copy (the raw
        ``index_select`` with torch's team of two in ``bench_core.py``). A plain class, not a
        generator: entered once per inline job, right after a copy has flushed the caches, where
        a ``contextlib`` manager cost 43 µs and this one 10."""
        return _CallersTeam(self._callers)

    def on_this_thread(self) -> bool:
        """Whether this thread's copies run here, on its own team, unsplit (inside
        :meth:`on_callers_team`): a caller may then copy in a plain loop, as :meth:`run` would."""
        return getattr(self._callers, "on", False)

    def shares(self, parts: Sequence[Callable[[], None]], nbytes: int) -> list[Sequence[Callable[[], None]]]:
        """``parts`` cut into contiguous shares, one per thread used (one share: no split)."""
        n = min(self.threads, len(parts)) if nbytes >= self.min_bytes else 1
        if n <= 1:
            return [parts]
        q, r = divmod(len(parts), n)
        out: list[Sequence[Callable[[], None]]] = []
        start = 0
        for i in range(n):
            end = start + q + (i < r)
            out.append(parts[start:end])
            start = end
        return out

    def run(self, parts: Sequence[Callable[[], None]], nbytes: int) -> None:
        """Run every part once; ``nbytes`` is what they copy in all. Returns (or raises the
        first error) only after every share has ended."""
        if getattr(self._callers, "on", False):
            for part in parts:
                part()
            return
        shares = self.shares(parts, nbytes)
        pool = _pool(self.threads - 1) if len(shares) > 1 else None
        run_all(pool, [partial(_run_all, share) for share in shares])
