"""What a closing store leaves to transfer threads that are still running.

A store's close first closes its transfer engine, which finishes the queued jobs and joins its
job threads for a bounded time (a shutdown never hangs on a dead disk or server). A thread
still inside a tier call then (a write to a slow tier, a read from one that stopped answering)
still uses the tiers and the staging its job holds. So nothing it may use is freed under it:

* every job that has not finished is stopped through its own cancellation (reported failed; from
  then on it never touches an engine block, so the engine may reuse or free them at once);
* the tiers and the device staging are handed to the job threads: the last one to end frees
  them (:class:`LastOut`), on its own thread, when its tier call returns. A thread that never
  returns keeps them for the life of the process.

The store's close returns at once either way; it does not wait for the job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LastOut", "release_tiers"]

log = logging.getLogger("kvtier.transfer")


class LastOut:
    """Counts ``threads`` running threads; runs the hand-over callbacks once the last has ended."""

    def __init__(self, threads: int) -> None:
        self._alive = threads
        self._lock = threading.Lock()
        self._then: list[Callable[[], None]] = []

    def ended(self) -> None:
        """One thread ended (called on that thread, last thing)."""
        with self._lock:
            self._alive -= 1
            run = self._then if self._alive == 0 else []
            if self._alive == 0:
                self._then = []
        _run_all(run)

    def when_all_ended(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` once every thread has ended: now, on this thread, if they have (returns
        ``True``), else on the last thread to end (``False``)."""
        with self._lock:
            if self._alive > 0:
                self._then.append(fn)
                return False
        _run_all([fn])
        return True


def _run_all(fns: Sequence[Callable[[], None]]) -> None:
    for fn in fns:
        try:
            fn()
        except Exception as exc:  # a late release never raises on a mover thread
            log.warning("releasing a closed store's tiers failed: %s", exc)


def release_tiers(backends: Sequence[Any], staging: Any = None) -> None:
    """Free ``staging`` (the device staging) and close ``backends``: a closed store's tiers,
    released by the last transfer thread to end (there is no event loop of the store's here)."""
    if staging is not None:
        staging.close()
    for backend in backends:
        try:
            asyncio.run(backend.aclose())
        except Exception as exc:  # the others are still closed
            log.warning("closing tier %s after its last transfer ended failed: %s", getattr(backend, "name", "?"), exc)
