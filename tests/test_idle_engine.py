"""An idle engine holds nothing (issue 30): after a mixed workload (stores, loads that hit and
miss, cancelled calls, aborted and preempted requests, failed loads) and idling, the store
facade and the connector keep no plan, load, job, result, pin, reservation or fence, and once
closed no thread they started is left. (The vLLM sides: ``test_vllm_soak.py``.)"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch
from test_connector import Req, Rig, _admit

import kvtier
from kvtier.records import checks
from kvtier.store import KVStore
from kvtier.testing import make_key
from kvtier.transfer import copies

HANG_GUARD = 60.0
BB = 2 * 4 * 8 * 4
K = [make_key(31_000 + i) for i in range(12)]


def store_threads() -> set[threading.Thread]:
    """Threads a store or connector may start (not the process-wide pools, which outlive every
    store, nor the event loop's default executor)."""
    shared = (checks.THREAD_PREFIX, copies.THREAD_PREFIX, "asyncio_")
    return {t for t in threading.enumerate() if not t.name.startswith(shared)}


def manager_holds(manager: Any) -> dict[str, int]:
    tiers = manager.stats()["tiers"]
    return {"pinned": sum(t["pinned"] for t in tiers), "pending": sum(t["pending"] for t in tiers)}


def transfers_hold(transfers: Any) -> dict[str, int]:
    return {"jobs": len(transfers._jobs), "finished": len(transfers._finished), "running": transfers.pending_jobs()}


def facade_holds(store: KVStore) -> dict[str, int]:
    assert store.manager is not None and store.transfers is not None
    return {
        **manager_holds(store.manager),
        **transfers_hold(store.transfers),
        "unsettled": len(store._runs.unsettled),
        "settlers": len(store._runs.settlers),
    }


async def _cancelled(coro: Any, after: int) -> None:
    task = asyncio.ensure_future(coro)
    for _ in range(after):
        await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def test_an_idle_store_facade_holds_nothing_and_its_close_leaves_no_thread(tmp_path: Path) -> None:
    before = store_threads()
    kv = [torch.randn(16, 4, 8) for _ in range(2)]
    cfg = {
        "tiers": [
            {"backend": "cpu", "capacity": 4 * BB},
            {"backend": "lmdb", "path": str(tmp_path), "capacity": "2MiB"},
        ],
    }
    store = await kvtier.open(cfg, kv_caches=kv)
    try:
        assert await store.save(K[:6], list(range(6))) == 6  # past the first tier: lower tiers take the rest
        assert await store.save(K[:6], list(range(6))) == 0  # all present
        assert await store.save(K[6:8], [6, 7], durable=True) == 2
        assert await store.load(K[:3], [8, 9, 10]) == 3  # from lmdb, then promoted
        assert await store.load([make_key(1), *K[:2]], [8, 9, 10]) == 0  # a miss ends the run
        assert store.transfers is not None
        for _ in range(50):  # calls cancelled while their jobs run (on a loaded machine a round may cancel none)
            for after in range(4):
                await _cancelled(store.save(K[8 + after : 9 + after], [8 + after]), after)
                await _cancelled(store.load(K[:4], [12, 13, 14, 15]), after)
            if store.transfers.counters["cancelled_jobs"] > 0:
                break
        assert store.transfers.counters["cancelled_jobs"] > 0
        await asyncio.to_thread(store.transfers.wait_idle, HANG_GUARD)
        for _ in range(200):  # the cancelled calls' settlers run on the loop
            if not store._runs.settlers:
                break
            await asyncio.sleep(0.01)
        held = facade_holds(store)
        assert set(held.values()) == {0}, held
    finally:
        await store.aclose()
    left = store_threads() - before
    assert not left, sorted(t.name for t in left)


def test_an_idle_connector_holds_nothing_and_its_close_leaves_no_thread() -> None:
    before = store_threads()
    rig = Rig(world=2, capacity=f"{6 * 2 * 4 * 8 * 4}")
    try:
        # A request stores its prompt and finishes.
        src = Req("src", list(range(500, 517)))  # 4 full blocks and one token
        _admit(rig, src, [1, 2, 3, 4, 5])
        rig.run_workers(rig.meta({"src": 17}, allocated=src.block_ids), lambda: [rig.fill(b, b) for b in range(1, 6)])
        src.num_computed_tokens = 17
        rig.sched.request_finished(src, src.block_ids)
        rig.run_workers(rig.meta(finished=["src"]))
        # One request loads it; another is aborted while its load runs; a third is preempted.
        hit, gone, pre = (Req(r, [*src.tokens[:16], 9]) for r in ("hit", "gone", "pre"))
        assert rig.sched.get_num_new_matched_tokens(hit, 0) == (16, True)
        hit.block_ids = [10, 11, 12, 13, 14]
        rig.sched.update_state_after_alloc(hit, hit.block_ids, 16)
        meta = rig.meta(allocated=hit.block_ids)
        rig.sched.request_finished(hit, hit.block_ids)  # aborted with its load in flight
        rig.run_workers(meta)
        assert rig.sched.get_num_new_matched_tokens(gone, 0) == (16, True)
        gone.block_ids = [15, 16, 17, 18, 19]
        rig.sched.update_state_after_alloc(gone, gone.block_ids, 16)
        rig.run_workers(rig.meta(allocated=gone.block_ids))
        _admit(rig, pre, [20, 21, 22, 23, 24], computed=16)
        rig.run_workers(rig.meta({"pre": 1}, allocated=pre.block_ids))
        rig.run_workers(rig.meta(preempted=["pre"]))
        for r in (gone, pre):
            r.num_computed_tokens = 17
            rig.sched.request_finished(r, r.block_ids)
        rig.run_workers(rig.meta(finished=["gone", "pre"]))
        # A load whose bytes vanished on one rank: recomputed, and the other rank's copy deleted.
        rig.stores[1].backends[0].delete_blocks(rig.keys(src.tokens)[2:3])
        bad = Req("bad", [*src.tokens[:16], 8])
        assert rig.sched.get_num_new_matched_tokens(bad, 0)[0] is not None
        bad.block_ids = [25, 26, 27, 28, 29]
        rig.sched.update_state_after_alloc(bad, bad.block_ids, 16)
        rig.run_workers(rig.meta(allocated=bad.block_ids))
        bad.num_computed_tokens = 17
        rig.sched.request_finished(bad, bad.block_ids)
        for _ in range(3):  # idle steps: deferred stores, deletes and acks go through
            rig.run_workers(rig.meta(finished=["bad"] if _ == 0 else ()))
        sched = rig.sched
        c = sched.counters
        assert (c["stored_blocks"], c["load_jobs"]) == (4, 3) and c["load_missed_blocks"] and c["deleted_blocks"]
        jobs = sched._jobs
        held = {
            "requests": sched.num_request_states,
            "jobs": sched.num_jobs,
            "fenced": sched.num_fenced_blocks,
            "deletes": sched.num_pending_deletes,
            "pending_work": int(sched.has_pending_work()),
            "walk": len(sched._walk),
            "new_loads": len(sched._loads.new_loads),
            "ready_loads": len(sched._loads.ready),
            "waiting": len(jobs._waiting),
            "lingering": len(jobs._lingering),
            "storing": len(jobs._storing),
            "loading": len(jobs._loading),
            **manager_holds(rig.manager),
        }
        for r, w in enumerate(rig.workers):
            held |= {
                f"rank{r}_unsubmitted": w.num_unsubmitted,
                f"rank{r}_in_flight": w.num_in_flight,
                f"rank{r}_deleting": w.num_deletes_in_flight,
                f"rank{r}_transfer_of": len(w._transfer_of),
                f"rank{r}_waited": len(w._waited),
                f"rank{r}_released": len(w._released),
                f"rank{r}_failed": len(w._failed),
                **{f"rank{r}_{k}": v for k, v in transfers_hold(w.transfers).items()},
                **{f"rank{r}_store_{k}": v for k, v in manager_holds(rig.stores[r].manager).items()},
            }
        assert set(held.values()) == {0}, {k: v for k, v in held.items() if v}
    finally:
        rig.close()
    left = store_threads() - before
    assert not left, sorted(t.name for t in left)
