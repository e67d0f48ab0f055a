"""Calls run at once on a pool and the calling thread, each exactly once, all ended on return.

:func:`run_all` is what every split job uses (a copy cut in shares, a redis job on several
connections). A pool refuses new work at interpreter exit, and a close-time write-back from an
exit hook must still run: what the pool will not take runs on the calling thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Generic, TypeVar, cast

__all__ = ["run_all"]

T = TypeVar("T")


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

    Returns only once every call has ended, whatever any of them raised, whichever hand-over
    failed, or whatever interrupted this thread's waits (Ctrl-C: raised after): a share still
    running would go on writing into the caller's rows after the call returned. The calls are meant to catch their own errors; one that raises anyway has that
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
        shares[0]()
        wait(futures)  # a pooled share that never ran (cancelled) runs below rather than being waited for
    finally:  # an interrupt (Ctrl-C) in a submit or a wait above still waits for every share
        _end_all(shares[1:])
    for share in shares:
        if share.error is not None:
            raise share.error
    return [cast(T, share.result) for share in shares]


def _end_all(shares: Sequence[_Share[T]]) -> None:
    """Run each share no thread claimed, and wait until every share has ended; an interrupt
    that lands in these waits is raised once they have all ended."""
    interrupted: BaseException | None = None
    for share in shares:
        share()  # runs only what no thread claimed
        while not share.done.is_set():
            try:
                share.done.wait()
            except BaseException as exc:  # (KeyboardInterrupt) a share still runs: wait on
                interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
