"""An interrupt (a ``BaseException`` such as ``KeyboardInterrupt``, not an ``Exception``) in the
copy of a job run at once (:mod:`kvtier.transfer.jobs_now`) goes on up to the caller, and the
engine is given back: the transfer threads, which start nothing while a job runs on a caller's
thread, would otherwise wait for it forever, and a store's close with them. The job is settled
as the usual inline submit settles one (``tests/test_inline_interrupts.py``): the same counters,
tier contents and manager state."""

from __future__ import annotations

from typing import Any

import pytest
from test_jobs_now import K, Rig

from kvtier.transfer.jobs import apply_result, plan_failed


def _interrupt(*args: Any, **kwargs: Any) -> None:
    raise KeyboardInterrupt


def _run(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """Stores and loads, two of them interrupted (the store's evicting one); what they leave."""
    e = rig.engine
    try:
        rig.store(K[0:4], [0, 1, 2, 3])
        rig.store(K[4:8], [4, 5, 6, 7])  # the tier (8 slots) is full
        monkeypatch.setattr(rig.layout, "gather", _interrupt)
        plan = rig.manager.prepare_store(K[8:10])  # evicts K[0:2]
        assert plan is not None and plan.drops
        with pytest.raises(KeyboardInterrupt):
            if rig.now:
                e.store_now(plan, [8, 9])
            else:
                e.submit_store(plan, [8, 9], inline=True, checked=True)
        assert not e._inline_running and e._active == 0
        apply_result(rig.manager, plan, plan_failed(0, plan, "interrupted"))  # as the store facade does
        tier = set(rig.backend.stored_keys() or ())
        assert tier == set(K[2:8])  # its victims and its new blocks freed
        monkeypatch.setattr(rig.layout, "scatter", _interrupt)
        load = rig.manager.prepare_load(K[2:4])
        with pytest.raises(KeyboardInterrupt):
            if rig.now:
                e.load_now(load, [10, 11])
            else:
                e.submit_load(load, [10, 11], inline=True, checked=True)
        assert not e._inline_running and e._active == 0
        apply_result(rig.manager, load, plan_failed(0, load, "interrupted"))
        monkeypatch.undo()
        # The engine goes on: jobs run at once again (or inline), and nothing of the two is left.
        assert rig.store(K[8:10], [8, 9]).error is None and rig.load(K[2:4], [12, 13]).error is None
        assert rig.idle()
        blocks = [b.clone() for b in rig.blocks()]
        return dict(e.counters), tier, set(rig.backend.stored_keys()), [rig.manager.status(k) for k in K[0:10]], blocks
    finally:
        e.close()


def test_an_interrupt_in_a_store_or_load_run_at_once_is_settled_as_by_the_inline_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    now = Rig(now=True)
    got_now = _run(now, monkeypatch)
    assert now.ran_now == 4  # every store and load but the interrupted ones ran at once
    got_usual = _run(Rig(now=False), monkeypatch)
    counters, tier, held, statuses, blocks = got_now
    assert counters == got_usual[0]
    assert counters["jobs"] == 6 and counters["failed_jobs"] == 2 and counters["inline_jobs"] == 6
    assert tier == got_usual[1] and held == got_usual[2] == set(K[2:10]) and statuses == got_usual[3]
    assert all(a.equal(b) for a, b in zip(blocks, got_usual[4]))
    assert blocks[12].equal(blocks[2]) and blocks[13].equal(blocks[3])  # the loads read the stored bytes
