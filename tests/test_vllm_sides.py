"""The vLLM adapter's bookkeeping without vLLM, on one rank: nothing raises into vLLM, loads
settle by id and only once finished (several ranks: ``test_vllm_ranks.py``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from vllm_world import HANG_GUARD, World, cpu, open_world

from kvtier.testing import make_key

K = [make_key(900 + i) for i in range(16)]


@pytest.fixture
async def one() -> AsyncIterator[World]:
    w = await open_world(1, [cpu(8, 1)])
    yield w
    await w.close()


def pinned(w: World) -> int:
    return sum(t["pinned"] for t in w.manager.stats()["tiers"])


def pending(w: World) -> int:
    return sum(t["pending"] for t in w.manager.stats()["tiers"])


async def test_bad_block_ids_fail_the_store_job_without_raising(one: World) -> None:
    one.store(K[:2], [0, 99])  # block 99 does not exist
    assert one.engines[0].counters["submit_failed"] == 1
    assert pending(one) == 0
    assert one.manager.lookup(K[:2]) == 0


@pytest.mark.parametrize("reports", [True, False])
async def test_a_load_into_a_closed_store_is_a_failed_job_not_an_exception(reports: bool) -> None:
    w = await open_world(1, [cpu(8, 1)], reports_load_errors=reports)
    try:
        w.store(K[:1], [0])
        load_id, load = w.side.prepare_load(K[:1])
        worker = w.workers[0]
        worker._transfers.close()
        worker.submit_load(2, load_id, load, [5])
        (done,) = worker.finished()
        assert done[0] == 2 and done[1] is reports  # with error reporting, vLLM recomputes the block
        assert worker.take_failed_block_ids() == ({5} if reports else set())
        for kind, plan_id, result in worker.take_outbox():
            w.side.receive(0, kind, plan_id, result)
        w.side.complete_load(K[:1])
        assert pinned(w) == 0
    finally:
        await w.close()


async def test_complete_load_settles_the_finished_load_never_one_in_flight(one: World) -> None:
    one.store(K[:2], [0, 1])
    worker, transfers = one.workers[0], one.workers[0]._transfers
    # Two requests load the same keys; the first one's job stalls.
    gate, entered = threading.Event(), threading.Event()
    real = transfers.layout.scatter

    def stalled(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert gate.wait(HANG_GUARD)
        return real(*args, **kwargs)

    slow_id, slow = one.side.prepare_load(K[:2])  # prepared first,
    fast_id, fast = one.side.prepare_load(K[:2])
    worker.submit_load(11, fast_id, fast, [6, 7])  # but the other one finishes first
    one.deliver()
    transfers.layout.scatter = stalled  # type: ignore[method-assign]
    worker.submit_load(10, slow_id, slow, [4, 5])
    assert await asyncio.to_thread(entered.wait, HANG_GUARD)
    transfers.layout.scatter = real  # type: ignore[method-assign]
    one.side.complete_load(K[:2])  # vLLM finished job 11: its load is settled, not the stalled one
    assert pinned(one) == 2  # the stalled load still pins both keys
    assert slow_id in one.side._loads and fast_id not in one.side._loads
    assert one.sched_engine.counters["complete_load_unmatched"] == 0
    gate.set()
    one.deliver()
    one.side.complete_load(K[:2])
    assert pinned(one) == 0 and not one.side._loads


async def test_complete_load_without_a_finished_load_keeps_the_pins_until_it_is_done(one: World) -> None:
    one.store(K[:1], [0])
    load_id, plan = one.side.prepare_load(K[:1])
    one.side.complete_load(K[:1])  # no rank reported the load: its source may still be read
    assert pinned(one) == 1 and one.sched_engine.counters["complete_load_unmatched"] == 1
    one.workers[0].submit_load(3, load_id, plan, [5])
    one.deliver()  # done on every rank: settled now, vLLM will not complete it again
    assert pinned(one) == 0 and set(one.idle().values()) == {0}, one.idle()
    one.side.complete_load(K[:1])  # nothing left to complete: counted, ignored
    assert one.sched_engine.counters["complete_load_unmatched"] == 2 and pinned(one) == 0


def _stall(transfers: Any, name: str) -> tuple[threading.Event, threading.Event, Any]:
    """Make the layout's ``name`` (scatter: loads; gather: stores) wait for ``gate``;
    ``entered`` is set when a job reached it. Returns (gate, entered, the real method)."""
    gate, entered = threading.Event(), threading.Event()
    real = getattr(transfers.layout, name)

    def stalled(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert gate.wait(HANG_GUARD)
        return real(*args, **kwargs)

    setattr(transfers.layout, name, stalled)
    return gate, entered, real


async def test_wait_for_load_returns_when_the_oldest_load_has_finished(one: World) -> None:
    """An empty vLLM step waits for the load in flight (kvtier.integrations.vllm.idle_steps):
    once the wait returns, the very next ``finished`` reports the load."""
    one.store(K[:2], [0, 1])
    worker, transfers = one.workers[0], one.workers[0]._transfers
    load_id, plan = one.side.prepare_load(K[:2])
    gate, entered, real = _stall(transfers, "scatter")
    worker.submit_load(10, load_id, plan, [4, 5])
    assert await asyncio.to_thread(entered.wait, HANG_GUARD)
    transfers.layout.scatter = real  # type: ignore[method-assign]
    assert worker.wait_for_load(0.01) is True  # still stalled: the wait ends at its timeout
    assert worker.finished() == []
    waiting = asyncio.create_task(asyncio.to_thread(worker.wait_for_load, HANG_GUARD))
    gate.set()
    assert await waiting is True
    assert [job_id for job_id, *_ in worker.finished()] == [10]
    assert torch.equal(one.caches[0][0][4], one.caches[0][0][0])  # the bytes are in place
    assert worker.wait_for_load(HANG_GUARD) is False  # nothing in flight any more


async def test_wait_for_load_never_waits_for_a_store(one: World) -> None:
    worker, transfers = one.workers[0], one.workers[0]._transfers
    plan = one.side.prepare_store(K[:2])
    assert plan is not None
    gate, entered, real = _stall(transfers, "gather")
    worker.submit_store(7, plan, [0, 1])
    assert await asyncio.to_thread(entered.wait, HANG_GUARD)
    transfers.layout.gather = real  # type: ignore[method-assign]
    assert worker.wait_for_load(HANG_GUARD) is False  # returned although the store is stalled
    assert worker.finished() == []
    gate.set()
    one.deliver()
    one.side.complete_store(K[:2])
    assert one.manager.lookup(K[:2]) == 2


def test_idle_load_wait_config_and_idle_steps() -> None:
    from types import SimpleNamespace

    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.idle_steps import DEFAULT_IDLE_LOAD_WAIT_S, idle_load_wait, is_idle_step

    assert idle_load_wait(None) == DEFAULT_IDLE_LOAD_WAIT_S
    assert idle_load_wait(0) == 0.0 and idle_load_wait(0.02) == 0.02
    for bad in (-1, 2, "5ms", True):
        with pytest.raises(ConfigError, match="idle_load_wait_s"):
            idle_load_wait(bad)
    assert is_idle_step(SimpleNamespace(attn_metadata=None))  # vLLM's kv_connector_no_forward
    assert not is_idle_step(SimpleNamespace(attn_metadata={"layer.0": object()}))
    assert not is_idle_step(None) and not is_idle_step(object())
