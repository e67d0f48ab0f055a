"""A job's ``done`` / ``device_done`` signals behave as ``threading.Event`` does: set before a
wait, set while threads wait (each is woken), a wait that times out, a set from many threads."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.transfer.jobs import Signal


@pytest.mark.parametrize("kind", [Signal, threading.Event], ids=["signal", "event"])
def test_set_before_a_wait_and_a_wait_that_times_out(kind: type) -> None:
    s = kind()
    assert not s.is_set()
    t0 = time.monotonic()
    assert s.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.04
    s.set()
    assert s.is_set() and s.wait() is True and s.wait(0) is True
    s.set()  # a second set changes nothing
    assert s.is_set()


@pytest.mark.parametrize("kind", [Signal, threading.Event], ids=["signal", "event"])
def test_every_thread_waiting_is_woken_by_one_set(kind: type) -> None:
    s = kind()
    woken: list[bool] = []
    started = threading.Barrier(5)

    def waiter() -> None:
        started.wait()
        woken.append(s.wait(10))

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)  # the waiters block (most of them) before the flag is set
    assert not woken
    s.set()
    for t in threads:
        t.join(10)
    assert woken == [True] * 4


def test_no_wake_up_is_lost_between_a_wait_and_a_set() -> None:
    """Many rounds of one thread waiting while another sets, at every interleaving the
    scheduler happens to give: each wait returns ``True`` long before its timeout."""
    for _ in range(300):
        s = Signal()
        got: list[bool] = []
        t = threading.Thread(target=lambda s=s, got=got: got.append(s.wait(10)))
        t.start()
        s.set()
        t.join(10)
        assert got == [True]
