"""``kvtier.bulk``: ``paused_gc`` (the collector is off inside, back as it was after, nesting across
threads) and ``RecordColumns.distinct`` (each key's first row, as a dict of the rows keeps them)."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from kvtier.bulk import READY, RecordColumns, paused_gc
from kvtier.testing import make_key


@pytest.fixture(autouse=True)
def _restore_gc() -> object:
    was = gc.isenabled()
    yield None
    if was:
        gc.enable()


def test_the_collector_is_off_inside_and_on_again_after() -> None:
    gc.enable()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner pause ending does not end the outer one
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled() -> None:
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()


def test_an_error_inside_still_restores_the_collector() -> None:
    gc.enable()
    with pytest.raises(KeyError), paused_gc():
        raise KeyError("x")
    assert gc.isenabled()


def test_pauses_in_two_threads_end_when_the_last_one_ends() -> None:
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with paused_gc():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause is still on
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_distinct_keeps_each_keys_first_row_as_a_dict_of_the_rows_would() -> None:
    keys = [make_key(i % 7) for i in (0, 1, 2, 1, 3, 0, 4, 5, 6, 2)]
    stored, stamps = np.arange(10, dtype=np.int64) + 100, np.arange(10.0) * 2
    columns = RecordColumns(list(keys), stored, stamps, repeats=True)
    first: dict[bytes, tuple[int, float]] = {}
    for key, size, stamp in zip(keys, stored.tolist(), stamps.tolist()):
        first.setdefault(key, (size, stamp))
    kept = columns.distinct()
    assert not kept.repeats and kept.table == dict.fromkeys(first, READY)
    assert list(kept) == [(key, size, stamp) for key, (size, stamp) in first.items()]
    three = keys[:3]
    once = RecordColumns(three, stored[:3], stamps[:3], repeats=True).distinct()
    assert once.keys is three and list(once.table or {}) == keys[:3]  # no repeat: the same list
    plain = RecordColumns(keys, stored, stamps)
    assert plain.distinct() is plain
    with pytest.raises(ValueError, match="repeats must be false"):
        RecordColumns(keys[:3], stored[:3], stamps[:3], table=dict.fromkeys(keys[:3], READY), repeats=True)
