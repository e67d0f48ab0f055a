"""A tier's counters added to from several threads at once, none of the adds lost.

A tier's jobs run on the engine's threads, on the store's worker pool and (for a remote tier) on
each share's thread at once. ``counters.n += k`` reads, adds and stores in steps another
thread's add may come between, and that add is then lost. Every add to a tier's counters is
therefore one call, :func:`counts_add` ``(counters, name, by, name, by, ...)``, with a job's
values worked out first, so a job adds once:

- where the native extension is built (``kvtier/records/_xxcounts.c``) and the counters' type
  keeps each named counter in a plain slot holding an int (as :class:`~kvtier.backend.BackendCounters`
  does: no ``__getattribute__``, ``__getattr__`` or ``__setattr__`` of its own), the call makes
  every sum and stores it with the GIL held from the first read to the last store, and no
  Python code runs in between: no thread's add can come between, nor can a reader see half a
  job's counts. The native reads add the same way (``_hostcounts.h``). It costs no lock.
- anything else (counters of another kind, attributes of an ordinary object, no extension, a
  build without the GIL) goes to :func:`counts_add_python`, which adds holding one lock of the
  whole process. Every add to such counters, native or Python, takes that lock, so none is lost
  either.

Both forms give the same sums and the same errors: ``TypeError`` for a value that is not an int
(nothing is added) or for an odd number of arguments, ``AttributeError`` for a counter the object
has not. A count made with ``+=`` outside these calls may still lose (or be lost to) an add made
at the same time.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["NATIVE", "counts_add", "counts_add_python"]

_ADDING = threading.Lock()


def counts_add_python(*args: Any) -> None:
    """``counters.name += by`` for each ``name, by`` pair after ``counters`` (the first argument),
    holding the process's counting lock."""
    if len(args) % 2 != 1:
        raise TypeError(
            f"counts_add(counters, name, by, ...): expected the counters then name and value pairs, got {len(args)} arguments"
        )
    counters = args[0]
    values = [operator.index(by) for by in args[2::2]]  # (before the lock: __index__ may be anyone's code)
    with _ADDING:
        for name, by in zip(args[1::2], values):
            setattr(counters, name, getattr(counters, name) + by)


try:
    from kvtier.records._xxcopy import counts_add as _native  # type: ignore[attr-defined]
except ImportError:  # (not built, or a build from before it)
    _native = None

#: Whether :func:`counts_add` is the native call.
NATIVE: bool = _native is not None
counts_add: Callable[..., None] = _native if _native is not None else counts_add_python
