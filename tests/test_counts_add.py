"""``counts_add`` (kvtier.records.counts): a job's adds to a tier's counters in one call, none
lost to another thread's add. The native call and the Python form give the same sums and the same
errors; the native call adds plain counters (``BackendCounters``: int slots, no attribute code of
their own) without any lock, and other counters under the Python form's lock."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_rows_moved_count import JOBS, THREADS, _race, busy_switches  # noqa: F401  (busy_switches: a fixture)

from kvtier.backend import BackendCounters
from kvtier.records import counts

native = pytest.mark.skipif(not counts.NATIVE, reason="the native extension is not built")
FORMS = [pytest.param(counts.counts_add, id="native", marks=native), pytest.param(counts.counts_add_python, id="python")]


class YieldingSlots(BackendCounters):
    """Counters whose every read lets other threads run (the layout of BackendCounters, so an
    object's class can be switched to it): an add that reads then stores loses the adds made by
    the threads that ran in between."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        time.sleep(0)
        return value


class Loose:
    """Counters as attributes of an ordinary object (a tier's own statistics)."""

    def __init__(self) -> None:
        self.waits = 0
        self.busy = 0


class Index:
    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n


def _outcome(fn: Any, make: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    counters = make()
    try:
        fn(counters, *args)
        error: tuple[str, str] | None = None
    except Exception as exc:  # (what each form raises is the point)
        error = (type(exc).__name__, str(exc))
    state = counters.as_dict() if isinstance(counters, BackendCounters) else dict(vars(counters))
    return state, error


CASES = [
    (BackendCounters, ("blocks_read", 2, "bytes_read", 8192, "read_misses", 0)),
    (BackendCounters, ("deleted", True, "write_failures", Index(3))),
    (BackendCounters, ("blocks_read", 1, "blocks_read", 2)),  # one name twice: both added
    (BackendCounters, ("blocks_read", 1 << 80, "bytes_read", -5)),
    (BackendCounters, ()),
    (BackendCounters, ("blocks_read", 1, "no_such_counter", 1)),
    (BackendCounters, ("blocks_read", None)),
    (BackendCounters, ("blocks_read", 1.5)),
    (BackendCounters, ("blocks_read", 1, "bytes_read")),
    (BackendCounters, (7, 1)),
    (YieldingSlots, ("blocks_written", 1, "bytes_written", 4096)),
    (YieldingSlots, ("deleted", "1")),
    (Loose, ("waits", 1, "busy", 2)),
    (Loose, ("gone", 1)),
    (BackendCounters, ("blocks_read", 1) * 17),  # more pairs than the native call keeps on its stack
    (BackendCounters, ("blocks_read", 1) * 16 + ("bytes_read", 2.0)),
    (Loose, ("waits", 1, "busy", 2) * 9),
]


@native
@pytest.mark.parametrize(("make", "args"), CASES)
def test_the_native_call_adds_and_fails_as_the_python_form(make: Any, args: tuple[Any, ...]) -> None:
    assert _outcome(counts.counts_add, make, args) == _outcome(counts.counts_add_python, make, args)


@pytest.mark.parametrize("fn", FORMS)
def test_sums_and_errors(fn: Any) -> None:
    c = BackendCounters()
    fn(c, "blocks_read", 2, "bytes_read", 8192, "blocks_read", 1)
    assert (c.blocks_read, c.bytes_read) == (3, 8192)
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        fn(c, "blocks_read", 1, "bytes_read", 2.0)
    assert c.blocks_read == 3  # (a bad value: nothing added)
    with pytest.raises(TypeError, match="name and value pairs, got 2 arguments"):
        fn(c, "blocks_read")
    with pytest.raises(AttributeError, match="no_such"):
        fn(c, "no_such", 1)


@pytest.mark.usefixtures("busy_switches")
@pytest.mark.parametrize("fn", FORMS)
@pytest.mark.parametrize("make", [BackendCounters, YieldingSlots, Loose])
def test_adds_on_many_threads_lose_none(fn: Any, make: Any) -> None:
    counters = make()
    names = ("waits", "busy") if make is Loose else ("blocks_written", "bytes_written")
    _race(lambda: fn(counters, names[0], 1, names[1], len("abcd")))
    jobs = THREADS * JOBS
    assert (getattr(counters, names[0]), getattr(counters, names[1])) == (jobs, 4 * jobs)


def _finishes_while_the_lock_is_held(counters: Any, wait_s: float) -> bool:
    """Whether counts_add on ``counters`` returns within ``wait_s`` while this thread holds the
    Python form's lock: if so it took no lock (the lock is let go at the end, so the call
    finishes either way; a call that takes it cannot finish before, however long the wait)."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (counts.counts_add(counters, "deleted", 1), done.set()))
    with counts._ADDING:
        thread.start()
        finished = done.wait(timeout=wait_s)
    thread.join()
    assert counters.deleted == 1
    return finished


@native
def test_plain_counters_take_no_lock_and_others_take_the_python_forms() -> None:
    """The rule the native call's lock-free add rests on: the tiers' counters are a type of int
    slots read and written the generic way (no __getattribute__, __getattr__ or __setattr__ of
    its own), so no Python code runs between an add's read and its store."""
    for name in ("__getattribute__", "__setattr__"):
        assert getattr(BackendCounters, name) is getattr(object, name)
    assert not hasattr(BackendCounters, "__getattr__") and not hasattr(BackendCounters(), "__dict__")
    assert all(type(BackendCounters.__dict__[name]).__name__ == "member_descriptor" for name in BackendCounters.__slots__)  # type: ignore[attr-defined]
    assert all(type(v) is int for v in BackendCounters().as_dict().values())
    assert _finishes_while_the_lock_is_held(BackendCounters(), 60)
    assert not _finishes_while_the_lock_is_held(YieldingSlots(), 0.2)


@native
def test_a_call_of_many_pairs_adds_plain_counters_as_a_short_one() -> None:
    """However many pairs a call gives, plain counters are added without the lock (the way every
    other add to them is made, so none is lost between the two ways) and the sums are all there."""
    counters = BackendCounters()
    pairs = ("deleted", 1) * 40
    done = threading.Event()
    thread = threading.Thread(target=lambda: (counts.counts_add(counters, *pairs), done.set()))
    with counts._ADDING:
        thread.start()
        finished = done.wait(timeout=60)
    thread.join()
    assert finished and counters.deleted == 40


def test_no_tier_adds_to_its_counters_but_by_counts_add() -> None:
    """``counters.n += k`` (or ``-=``) reads and stores in two steps: every add to a tier's
    counters goes through counts_add instead."""
    root = Path(__file__).resolve().parents[1]
    found = [
        f"{path.relative_to(root)}:{number}"
        for folder in ("kvtier", "backends")
        for path in sorted((root / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(?<![`\w])counters\.\w+\s*[-+]=", line.split("#")[0])  # (not ``counters.n += k`` in a doc)
    ]
    assert found == []
