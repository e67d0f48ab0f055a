"""One redis tier job on several connections at once: the job's share of a server, cut in pieces.

A job's records on one server (the single server, or one primary of a cluster) are cut into
contiguous *shares*, and each share is one pipelined exchange on its own pooled connection, all of
them at the same time: the first on the calling thread, the others on the tier's I/O threads.

Why several connections rather than one deeper pipeline: redis-server writes at most 64 KiB to one
client per turn of its event loop, and the replies queued for a connection grow that client's
output buffer, memory the server allocates and touches anew for every reply. With four connections
and a 1 MiB window each, the server fills four sockets per turn and keeps about 4 MiB of replies in
flight. Measured here (2 cores, one private redis-server 7.0, 4096 reads of 64 KiB records): server
CPU per job 0.11-0.16 s against 0.21-0.27 s for one connection with 16 MiB in flight, and about 1.5x
the throughput.

A share is never smaller than :data:`SHARE_MIN_BYTES` of records, so a small job stays one exchange
on the calling thread, with no thread hop.

Each share receives and checksums on its own thread, so shares need cores: ``job_connections:
auto`` (the default) is half the CPUs this process may run on, 1 to :data:`AUTO_MAX_SHARES`. On a
quiet 2-core host, 4 connections lost to one on 64 KiB records (puts 0.48-0.55 against
0.57-0.66 GB/s, gets 0.88-0.91 against 1.03-1.14, same process, alternating), while the server's
CPU saving above showed only when the host was loaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Generic, TypeVar, cast

from kvtier.devices import usable_cpus

__all__ = ["AUTO_MAX_SHARES", "SHARE_MIN_BYTES", "auto_job_connections", "run_all", "split_shares"]

#: The fewest record bytes worth a connection (and a thread hop) of their own.
SHARE_MIN_BYTES = 1 << 20

#: The most connections ``job_connections: auto`` gives one job.
AUTO_MAX_SHARES = 4

T = TypeVar("T")


def auto_job_connections(cpus: int | None = None) -> int:
    """Connections per job for ``job_connections: auto``: half the CPUs this process may run
    on, between 1 and :data:`AUTO_MAX_SHARES` (1 on a 2-CPU host)."""
    if cpus is None:
        cpus = usable_cpus()
    return max(1, min(AUTO_MAX_SHARES, cpus // 2))


def split_shares(positions: Sequence[int], record_bytes: int, most: int) -> list[list[int]]:
    """``positions`` cut into at most ``most`` contiguous shares of near-equal length, each of at
    least :data:`SHARE_MIN_BYTES` when ``record_bytes`` is the size of one record (one share,
    the whole of ``positions``, when that cannot be had). Order is kept: the shares, joined, are
    ``positions``."""
    n = len(positions)
    k = min(most, n, max(1, n * record_bytes // SHARE_MIN_BYTES))
    if k <= 1:
        return [list(positions)]
    return [list(positions[j * n // k : (j + 1) * n // k]) for j in range(k)]


class _Share(Generic[T]):
    """One call that runs at most once, on whichever thread claims it first, and keeps its outcome."""

    __slots__ = ("_call", "_claimed", "_lock", "done", "error", "result")

    def __init__(self, call: Callable[[], T]) -> None:
        self._call = call
        self._claimed = False
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def __call__(self) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        try:
            self.result = self._call()
        except BaseException as exc:  # kept for the caller, raised there after every share ended
            self.error = exc
        finally:
            self.done.set()


def run_all(threads: Executor | None, calls: Sequence[Callable[[], T]]) -> list[T]:
    """Every call's result, in order: the first call runs on this thread, the others on
    ``threads`` (all on this thread when there is none, or only one call).

    A call the pool will not take runs on this thread after the first: at interpreter exit every
    pool refuses new work, and a close-time write-back from an exit hook must still write. Each
    call runs exactly once, whatever the pool did with it.

    Returns only once every call has ended, whatever any of them raised or whichever hand-over
    failed: a share still running would go on writing into the caller's rows after the call
    returned. The calls are meant to catch their own errors; one that raises anyway has that
    re-raised here (the first by position), after the wait."""
    if threads is None or len(calls) < 2:
        return [call() for call in calls]
    shares = [_Share(call) for call in calls]
    futures: list[Future[None]] = []
    try:
        for share in shares[1:]:
            try:
                futures.append(threads.submit(share))
            except Exception:  # refused (interpreter exit, a closed pool) or no thread: runs here below
                continue
    except BaseException:
        wait(futures)
        raise
    shares[0]()
    wait(futures)  # a pooled share that never ran (cancelled) runs below rather than being waited for
    for share in shares[1:]:
        share()  # runs only what no thread claimed
        share.done.wait()
    for share in shares:
        if share.error is not None:
            raise share.error
    return [cast(T, share.result) for share in shares]
