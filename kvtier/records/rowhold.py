"""The rows' hold: automatic garbage collection held off from a job's first row view to its
last copy, counted for the whole process (``kvtier/records/_xxhold.c`` keeps the native count,
``kvtier/records/_hostrow.h`` says why). The forms here: :data:`rows_hold` and
:data:`rows_let_go`, the decorator :func:`holding_rows` for a tier's whole read or save, and the
context manager :data:`rows_held` for a hold around a few lines. :mod:`kvtier.records.xxcopy`
exports them all."""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

try:
    from kvtier.records import _xxcopy  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the Python count below
    _xxcopy = None

#: Holds overlapping without a break (jobs on several threads) would keep automatic collection
#: off for good. Once the count has stayed above zero this long (seconds), a hold from a thread
#: holding none waits, the GIL released, at most :data:`DRAIN_WAIT` for the count to drain, then
#: runs the collection that was due before it holds (``kvtier/records/_xxhold.c``, the same
#: rule and numbers for the native count). A thread already holding never waits.
HOLD_RUN_LIMIT = 0.1
#: The longest a hold waits for the count to drain; past it, it holds as before, and the next
#: wait comes :data:`HOLD_RUN_LIMIT` later.
DRAIN_WAIT = 0.005
#: The longest a hold waits while a waiter's due collection runs (its finalizers may let other
#: threads run, and a view taken meanwhile could be moved by one): its end, not any job's, ends
#: the wait; bounded against a finalizer waiting on something a waiting thread has.
COLLECT_WAIT = 0.2
_DRAIN_POLL = 0.00005

_held = [0, False]  # the Python forms' count of holds, and whether collection was on before the first
_held_lock = threading.Lock()
_runs = [0, 0, 0.0]  # runs of holds (the count leaving zero), the run last seen by a new holder, and when
_drain = [0, False]  # holds waiting for the count to drain, and whether one's due collection runs
_mine = threading.local()  # .holds: this thread's
#: A collection running (``gc.callbacks``' start to its stop), and its thread: a hold from a
#: thread holding none, in any other thread, waits for its end (:data:`COLLECT_WAIT` at most)
#: once collection is off, as the native form does.
_collection: list[Any] = [False, 0]
_phase_at = [0]  # where the Python form's callback was last found in gc.callbacks


def _gc_phase(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _collection[1] = threading.get_ident()
    _collection[0] = phase == "start"


def _phase_listed() -> None:
    """:func:`_gc_phase` found in ``gc.callbacks`` (by identity, at its last place first), and added
    where it is not: at the first hold, and where the list was put back to an earlier copy, or
    cleared, between collections (else no later collection would be seen). Asked where no
    collection is known to run; with one, :func:`_wait_collection_end` sees to it."""
    callbacks = gc.callbacks
    at = _phase_at[0]
    if at < len(callbacks) and callbacks[at] is _gc_phase:
        return
    for i, callback in enumerate(callbacks):
        if callback is _gc_phase:
            _phase_at[0] = i
            return
    _phase_at[0] = len(callbacks)
    callbacks.append(_gc_phase)


def _wait_collection_end() -> None:
    """Wait (sleeping: the GIL released) for a collection running in another thread to end, :data:`COLLECT_WAIT` at most.
    Timed out with :func:`_gc_phase` no longer in ``gc.callbacks`` (the list cleared mid-collection), the end can never be
    seen: the flag is cleared and the callback added again, else every later hold would wait that long."""
    start = time.monotonic()
    while _collection[0] and time.monotonic() - start < COLLECT_WAIT:
        time.sleep(_DRAIN_POLL)
    if _collection[0] and _gc_phase not in gc.callbacks:
        _collection[0] = False
        gc.callbacks.append(_gc_phase)


def rows_hold_python() -> None:
    """:data:`rows_hold` in Python: the same count, under a lock, and the same bound on a run."""
    depth = getattr(_mine, "holds", 0)
    _mine.holds = depth + 1
    if depth == 0:
        try:
            if not _collection[0]:
                _phase_listed()
            if (_held[0] > 0 or _drain[0]) and _hold_should_wait():
                _drain_and_collect()
        except BaseException:  # (a KeyboardInterrupt in a wait's sleep): no hold taken, none counted as this thread's
            _mine.holds = depth
            raise
    with _held_lock:
        if _held[0] == 0:
            _held[1] = gc.isenabled()
            gc.disable()
            _runs[0] += 1
        _held[0] += 1
    # The look for a running collection comes once collection is off (held), not before: in
    # Python another thread may run between any two lines, and a collection it begins before
    # gc.disable() (after the drain's wait too) is seen here; none begins after it.
    if depth == 0 and _collection[0] and _collection[1] != threading.get_ident():
        try:
            _wait_collection_end()
        except BaseException:  # (interrupted, likewise): the hold just taken is let go, not left to the caller
            rows_let_go_python()
            raise


def rows_let_go_python() -> None:
    """:data:`rows_let_go` in Python."""
    depth = getattr(_mine, "holds", 0)
    if depth > 0:
        _mine.holds = depth - 1
    with _held_lock:
        if _held[0] > 0:
            _held[0] -= 1
            if _held[0] == 0 and _held[1]:
                gc.enable()


def rows_hold_flag_python(held: list[bool]) -> None:
    """:data:`rows_hold_flag` in Python (where an asynchronous exception may land between any two lines)."""
    if held[0] is not True:
        rows_hold_python()
        held[0] = True


def rows_let_go_flag_python(held: list[bool]) -> None:
    """:data:`rows_let_go_flag` in Python."""
    if held[0] is True:
        held[0] = False
        rows_let_go_python()


def _hold_should_wait() -> bool:
    """Whether a hold from a thread holding none waits: others wait already, or the run of holds
    has lasted :data:`HOLD_RUN_LIMIT` with collection on before it."""
    if _drain[0]:
        return True
    if not _held[1]:
        return False  # the engine keeps collection off itself: nothing is due
    now = time.monotonic()
    with _held_lock:
        if _runs[1] != _runs[0]:
            _runs[1], _runs[2] = _runs[0], now
            return False
        return now - _runs[2] > HOLD_RUN_LIMIT


def _drain_and_collect() -> None:
    """Wait (sleeping: the GIL released) for no job to hold and no collection of a waiter to run,
    :data:`DRAIN_WAIT` at most; then run the collection that was due, else hold as before."""
    with _held_lock:
        _drain[0] += 1
    try:
        start = time.monotonic()
        while True:
            with _held_lock:  # (the check and the collection's start in one step)
                running = _drain[1]
                if _held[0] == 0 and not running:
                    _drain[1] = True
                    break
            if time.monotonic() - start >= (COLLECT_WAIT if running else DRAIN_WAIT):
                _runs[2] = time.monotonic()  # not drained: the next wait a limit later
                return
            time.sleep(_DRAIN_POLL)
        try:
            _collect_due()
        finally:
            _drain[1] = False
    finally:
        with _held_lock:
            _drain[0] -= 1


def _collect_due() -> None:
    """The collection automatic collection would run now: the oldest generation whose count
    passed its threshold, if any (``_drain[1]`` set by the caller meanwhile)."""
    due = [g for g, (count, threshold) in enumerate(zip(gc.get_count(), gc.get_threshold())) if threshold > 0 and count > threshold]
    if due:
        gc.collect(due[-1])


def _rows_forked() -> None:
    """In a child just forked: the holds of the parent's other threads dropped (their jobs do
    not go on here), and collection on again where it was before the first; else a fork taken
    while another thread's job held it would leave the child without automatic collection."""
    global _held_lock, _mine
    _held_lock = threading.Lock()  # (another thread may have held it at the fork)
    _mine = threading.local()
    _drain[:] = [0, False]
    _collection[0] = False
    if _held[0] > 0:
        _held[0] = 0
        if _held[1]:
            gc.enable()
    if _NATIVE_HOLD:
        _xxcopy.rows_forked()


_NATIVE_HOLD = _xxcopy is not None and hasattr(_xxcopy, "rows_forked")
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_rows_forked)
#: ``rows_hold()``: automatic garbage collection held off until the matching
#: :data:`rows_let_go` (counted for the whole process, with the native jobs' holds: the last one
#: lets collection go again where it was on before the first). A job holds it from its first
#: row's view to its last copy: a view is a row's address and holds nothing, and a collection
#: run between (any allocation may start one) runs finalizers and weakref callbacks, Python that
#: may free or move a row whose view is taken (``row.set_(...)``); the copy would then write or
#: read memory the row no longer owns (``kvtier/records/_hostrow.h``).
rows_hold: Callable[[], None] = _xxcopy.rows_hold if _NATIVE_HOLD else rows_hold_python
#: ``rows_let_go()``: one :data:`rows_hold` ended.
rows_let_go: Callable[[], None] = _xxcopy.rows_let_go if _NATIVE_HOLD else rows_let_go_python
#: ``rows_hold_flag(held)``: :data:`rows_hold` and ``held[0] = True`` in one call (no hold taken
#: where ``held[0]`` is set already), for a hold that the job lets go early by the flag: taken as
#: the first line of a ``try`` whose ``finally`` lets it go by the flag, an asynchronous exception
#: lands before both or after both, never between (``rows_hold()`` then ``try:`` would leak it).
rows_hold_flag: Callable[[list[bool]], None] = _xxcopy.rows_hold_flag if _NATIVE_HOLD else rows_hold_flag_python
#: ``rows_let_go_flag(held)``: where ``held[0]``, ``held[0] = False`` and :data:`rows_let_go` in one call.
rows_let_go_flag: Callable[[list[bool]], None] = _xxcopy.rows_let_go_flag if _NATIVE_HOLD else rows_let_go_flag_python


def holding_rows(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a tier's whole read or save of rows) run under :data:`rows_hold`, let go however
    it ends: for the paths that take their rows' views in Python, between calls that allocate."""

    @functools.wraps(method)
    def held(*args: Any, **kwargs: Any) -> Any:
        with rows_held:  # (not a call then a ``try``: an exception raised between would leave the hold)
            return method(*args, **kwargs)

    return held


def _rows_exit_python(*exc: object) -> None:
    rows_let_go_python()


class _RowsHeld:
    """``with rows_held:``, :data:`rows_hold` on entry and :data:`rows_let_go` on exit, however
    the block ends (its exception propagates). Both are the count's own functions (no Python
    frame between), so the ``with`` costs what a ``try``/``finally`` around the two calls costs."""

    __slots__ = ()
    __enter__ = staticmethod(rows_hold)
    __exit__ = staticmethod(_xxcopy.rows_exit if _NATIVE_HOLD else _rows_exit_python)


#: ``with rows_held:``: the rows held from the block's start to its end (one object, no state:
#: holds nest, each ``with`` its own).
rows_held = _RowsHeld()
