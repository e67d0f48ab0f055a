"""Bulk work on millions of objects, with the cyclic garbage collector paused meanwhile.

Opening a tier of 10^6 records builds millions of short-lived container objects (the records
listed, the tuples the manager adopts, the page walk's keys). Every 700 allocations start a young
collection, and each growth of the old generation by a quarter a full one that visits every
tracked object: at 10^6 LMDB records that was a fifth of a store's open
(``benchmarks/bench_scale.py``). Nothing built there forms a reference cycle, so a pause loses
nothing: the collector runs again as soon as the outermost pause ends.

The pause is process-wide and nests across threads (a counter under a lock): the first to enter
disables the collector, the last to leave re-enables it, and only if it was enabled before.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_gc"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off (see the module doc)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
