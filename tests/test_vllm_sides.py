"""The vLLM adapter's bookkeeping without vLLM: nothing raises into vLLM, loads settle by id (#9, item 8)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import kvtier
from kvtier.integrations.vllm.engines import _Engine
from kvtier.integrations.vllm.scheduler_side import _SchedulerSide
from kvtier.integrations.vllm.worker_side import _WorkerSide
from kvtier.testing import make_key

K = [make_key(900 + i) for i in range(16)]
BB = 2 * 4 * 8 * 4
HANG_GUARD = 60.0


@pytest.fixture
async def engine() -> AsyncIterator[_Engine]:
    g = torch.Generator().manual_seed(11)
    kv = [torch.randn(16, 4, 8, generator=g) for _ in range(2)]
    cfg = {"tiers": [{"backend": "cpu", "capacity": 8 * BB}], "job_deadline_s": None}
    store = await kvtier.open(cfg, kv_caches=kv)
    yield _Engine("e", store)
    await store.aclose()


def finished(worker: _WorkerSide) -> list[tuple[int, bool, int, float]]:
    assert worker._transfers is not None
    worker._transfers.wait(list(worker._jobs), timeout=HANG_GUARD)
    return worker.finished()


def pinned(engine: _Engine) -> int:
    return sum(t["pinned"] for t in engine.store.stats()["tiers"])


def pending(engine: _Engine) -> int:
    return sum(t["pending"] for t in engine.store.stats()["tiers"])


async def test_bad_block_ids_fail_the_store_job_without_raising(engine: _Engine) -> None:
    sched, worker = _SchedulerSide(engine), _WorkerSide(engine)
    plan = sched.prepare_store(K[:2])
    assert plan is not None
    worker.submit_store(7, plan, [0, 99])  # block 99 does not exist
    assert engine.counters["submit_failed"] == 1
    (done,) = finished(worker)
    assert done[0] == 7
    sched.complete_store(K[:2], success=done[1])
    assert pending(engine) == 0
    assert engine.store.manager is not None and engine.store.manager.lookup(K[:2]) == 0


@pytest.mark.parametrize("reports", [True, False])
async def test_a_load_into_a_closed_store_is_a_failed_job_not_an_exception(engine: _Engine, reports: bool) -> None:
    sched, worker = _SchedulerSide(engine), _WorkerSide(engine)
    engine.reports_load_errors = reports
    plan = sched.prepare_store(K[:1])
    assert plan is not None
    worker.submit_store(1, plan, [0])
    finished(worker)
    sched.complete_store(K[:1], True)
    load_id, load = sched.prepare_load(K[:1])
    assert engine.store.transfers is not None
    engine.store.transfers.close()
    worker.submit_load(2, load_id, load, [5])
    (done,) = worker.finished()
    assert done[0] == 2 and done[1] is reports  # with error reporting, vLLM recomputes the block
    assert worker.take_failed_block_ids() == ({5} if reports else set())
    sched.complete_load(K[:1])
    assert pinned(engine) == 0


async def test_complete_load_settles_the_finished_load_never_one_in_flight(engine: _Engine) -> None:
    sched, worker = _SchedulerSide(engine), _WorkerSide(engine)
    plan = sched.prepare_store(K[:2])
    assert plan is not None
    worker.submit_store(1, plan, [0, 1])
    finished(worker)
    sched.complete_store(K[:2], True)
    transfers = engine.store.transfers
    assert transfers is not None
    # Two requests load the same keys; the first one's job stalls.
    gate, entered = threading.Event(), threading.Event()
    real = transfers.layout.scatter

    def stalled(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert gate.wait(HANG_GUARD)
        return real(*args, **kwargs)

    slow_id, slow = sched.prepare_load(K[:2])  # prepared first,
    fast_id, fast = sched.prepare_load(K[:2])
    worker.submit_load(11, fast_id, fast, [6, 7])  # but the other one finishes first
    assert [d[0] for d in finished(worker)] == [11]
    transfers.layout.scatter = stalled  # type: ignore[method-assign]
    worker.submit_load(10, slow_id, slow, [4, 5])
    assert await asyncio.to_thread(entered.wait, HANG_GUARD)
    transfers.layout.scatter = real  # type: ignore[method-assign]
    sched.complete_load(K[:2])  # vLLM finished job 11: its load is settled, not the stalled one
    assert pinned(engine) == 2  # the stalled load still pins both keys
    assert slow_id in sched._loads and fast_id not in sched._loads
    assert engine.counters["complete_load_unmatched"] == 0
    gate.set()
    assert [d[0] for d in finished(worker)] == [10]
    sched.complete_load(K[:2])
    assert pinned(engine) == 0 and not sched._loads


async def test_complete_load_of_a_load_never_submitted_unpins(engine: _Engine) -> None:
    sched, worker = _SchedulerSide(engine), _WorkerSide(engine)
    plan = sched.prepare_store(K[:1])
    assert plan is not None
    worker.submit_store(1, plan, [0])
    finished(worker)
    sched.complete_store(K[:1], True)
    sched.prepare_load(K[:1])
    assert pinned(engine) == 1
    sched.complete_load(K[:1])
    assert pinned(engine) == 0
