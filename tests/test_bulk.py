"""``kvtier.bulk.paused_gc``: the collector is off inside, back as it was after, nesting across threads."""

from __future__ import annotations

import gc
import threading

import pytest

from kvtier.bulk import paused_gc


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
