"""A thread that starts to wait while a job runs at once on a caller's thread
(:mod:`kvtier.transfer.jobs_now`) is woken when that job ends. The job's end notifies the
engine's ``_idle`` and ``_inline_done`` only where a thread waits on them (their ``waiting``
count, read under the engine's lock): a thread that began waiting during the job is counted by
then, so it is never left asleep. The waiters: a job on the transfer threads (they start nothing
while a job runs on a caller's thread, and wait on ``_inline_done``) and ``wait_idle`` (on
``_idle``), for a store and a load, each run at once or through the usual inline submit, and
ended by its copy or by an interrupt in it. Without the notify at the job's end (or with a
``waiting`` count that missed them) both waiters sleep on: checked by taking the two notifies
out, when the queued job's ``wait`` timed out and ``wait_idle`` never returned."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from test_jobs_now import HANG_GUARD, K, Rig
from test_transfer import record_of

from kvtier.manager import KeyState, StorePlan
from kvtier.transfer.jobs import apply_result, plan_failed


def _until(check: Any) -> None:
    """Wait (a millisecond at a time, :data:`HANG_GUARD` at most) until ``check()`` holds."""
    for _ in range(int(HANG_GUARD * 1000)):
        if check():
            return
        threading.Event().wait(0.001)
    raise AssertionError("the waiter never started to wait")


def _run_job(rig: Rig, plan: Any, ids: list[int]) -> Any:
    """``plan`` run at once or through the usual inline submit; its result, or the interrupt."""
    e = rig.engine
    store = isinstance(plan, StorePlan)
    try:
        res = (e.store_now(plan, ids) if store else e.load_now(plan, ids)) if rig.now else None
        if res is None:
            job = (
                e.submit_store(plan, ids, inline=True, checked=True)
                if store
                else e.submit_load(plan, ids, inline=True, checked=True)
            )
            res = e.take(job)
        else:
            rig.ran_now += 1
    except KeyboardInterrupt as exc:
        return exc
    return res


@pytest.mark.parametrize("interrupt", [False, True])
@pytest.mark.parametrize("now", [True, False])
@pytest.mark.parametrize("kind", ["store", "load"])
@pytest.mark.parametrize("waiter", ["thread_job", "wait_idle"])
def test_a_thread_that_waits_during_a_job_on_the_callers_thread_is_woken_at_its_end(
    monkeypatch: pytest.MonkeyPatch, now: bool, kind: str, waiter: str, interrupt: bool
) -> None:
    """``interrupt``: the job goes up as a ``KeyboardInterrupt`` from its copy instead."""
    rig = Rig(now=now)
    e = rig.engine
    try:
        rig.store(K[0:2], [0, 1])
        started, release = threading.Event(), threading.Event()
        copy = "gather" if kind == "store" else "scatter"
        inner = getattr(rig.layout, copy)

        def held(*args: Any, **kwargs: Any) -> None:
            if not release.is_set():  # the job on the caller's thread: held in its copy
                started.set()
                release.wait(HANG_GUARD)
                if interrupt:
                    raise KeyboardInterrupt
            inner(*args, **kwargs)

        monkeypatch.setattr(rig.layout, copy, held)
        plan = rig.manager.prepare_store(K[2:4]) if kind == "store" else rig.manager.prepare_load(K[0:2])
        assert plan is not None
        results: list[Any] = []
        job = threading.Thread(
            target=lambda: results.append(_run_job(rig, plan, [2, 3] if kind == "store" else [4, 5]))
        )
        job.start()
        assert started.wait(HANG_GUARD)
        assert e._inline_running and e._active == 1
        woke = threading.Event()
        if waiter == "thread_job":
            other = rig.manager.prepare_store(K[10:11])
            assert other is not None
            queued = e.submit_store(other, [6])  # its thread waits for the job on the caller's thread
            _until(lambda: e._inline_done.waiting == 1)
        else:
            sleeper = threading.Thread(target=lambda: (e.wait_idle(None), woke.set()), daemon=True)
            sleeper.start()
            _until(lambda: e._idle.waiting == 1)
        release.set()
        job.join(HANG_GUARD)
        assert not job.is_alive() and len(results) == 1
        (res,) = results
        if interrupt:
            assert isinstance(res, KeyboardInterrupt)
            apply_result(rig.manager, plan, plan_failed(0, plan, "interrupted"))  # as the store facade does
        else:
            assert res.error is None
            apply_result(rig.manager, plan, res)
        if waiter == "thread_job":
            (res,) = e.wait([queued], timeout=HANG_GUARD)  # a TimeoutError: its thread was never woken
            assert res.error is None
            rig.manager.complete_store(res.keys, True)
            assert torch.equal(rig.tier()[K[10]], record_of(rig.layout, 6))
        else:
            assert woke.wait(HANG_GUARD)  # wait_idle(None) returned: it was woken
        assert rig.ran_now == (1 + (not interrupt) if now else 0)
        if kind == "load" and not interrupt:
            assert torch.equal(record_of(rig.layout, 5), rig.tier()[K[1]])
        e.wait_idle(HANG_GUARD)
        assert e._idle.waiting == 0 and e._inline_done.waiting == 0 and e._active == 0 and not e._inline_running
        assert set(rig.backend.stored_keys()) == {k for k in K if rig.manager.holds(k, 0)}  # no orphan, no pin
        stored = kind == "store" and not interrupt
        assert [rig.manager.status(k).state for k in K[2:4]] == [KeyState.READY if stored else KeyState.MISS] * 2
        assert rig.manager.remove(K[0:2], 0) == K[0:2]  # no pin left on them
    finally:
        e.close(HANG_GUARD)
