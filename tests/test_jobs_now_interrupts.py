"""An interrupt (a ``BaseException`` such as ``KeyboardInterrupt``, not an ``Exception``) in the
copy of a job run at once (:mod:`kvtier.transfer.jobs_now`) goes on up to the caller, and the
engine is given back: the transfer threads, which start nothing while a job runs on a caller's
thread, would otherwise wait for it forever, and a store's close with them."""

from __future__ import annotations

from typing import Any

import pytest
from test_jobs_now import K, Rig


def _interrupt(*args: Any, **kwargs: Any) -> None:
    raise KeyboardInterrupt


def test_an_interrupt_in_a_store_or_load_run_at_once_gives_the_engine_back(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(now=True)
    try:
        rig.store(K[0:2], [0, 1])
        assert rig.ran_now == 1
        monkeypatch.setattr(rig.layout, "gather", _interrupt)
        plan = rig.manager.prepare_store(K[2:4])
        assert plan is not None
        with pytest.raises(KeyboardInterrupt):
            rig.engine.store_now(plan, [2, 3])
        assert not rig.engine._inline_running and rig.engine._active == 0
        assert set(rig.backend.stored_keys() or ()) == set(K[0:2])  # its new blocks freed, as a failed copy's
        rig.manager.complete_store(plan.keys, False)
        monkeypatch.setattr(rig.layout, "scatter", _interrupt)
        load = rig.manager.prepare_load(K[0:2])
        with pytest.raises(KeyboardInterrupt):
            rig.engine.load_now(load, [5, 6])
        assert not rig.engine._inline_running and rig.engine._active == 0
        rig.manager.complete_load(load.keys)
        monkeypatch.undo()
        # The engine goes on: jobs run at once again, and the counters hold the jobs that ran.
        before = dict(rig.engine.counters)
        assert rig.store(K[4:6], [4, 5]).error is None and rig.load(K[0:2], [7, 8]).error is None
        assert rig.ran_now == 3 and rig.idle()
        assert rig.engine.counters["jobs"] == before["jobs"] + 2 and before["jobs"] == 1
        assert rig.engine.counters["failed_jobs"] == 0
    finally:
        rig.engine.close()
