"""The engine's job cost through an ``lmdb`` tier with ``takes_pool_rows`` on (one PoolRows a job)
and off (a view per row), alternated in one process: one JSON object.

    python benchmarks/bench_pool_rows.py [--quick] [--sizes 4096 65536] [--blocks 16] [--rounds N] [--durable]

Per block size, one :class:`~kvtier.transfer.TransferEngine` over one ``lmdb`` tier (syncs off
unless ``--durable``: the CPU of a job, not the disk's) runs, every round, for each arm in turn
(the order reversed every round): a store job of ``--blocks`` new keys (staged rows to the
tier), then a load job of them (the tier into staged rows, scattered into the engine's blocks).
The arms differ only in the class attribute ``LmdbBackend.takes_pool_rows``:

* ``pool_rows``: the engine hands the tier one :class:`~kvtier.pool_rows.PoolRows` a job;
* ``views``: a list of views, one per row (what every tier got before the flag).

Each job's cost is the CPU time of the engine's threads (``kvtier-store``, ``kvtier-store-tiers``,
``kvtier-load``) over the job, read from their thread clocks, and its wall time. The raw
baseline, in the same process and round, is python-lmdb on an environment of its own: the
same values put in one transaction (``raw_put``) and got and copied into rows of one tensor
(``raw_get``), the calling thread's CPU time. Reported per size: medians over the rounds and
the spread (min, max) of µs per job for each arm and job kind, ``<kind>_views_over_pool_rows``
(the median of the per-round ratios of the two arms' CPU: above 1, PoolRows is cheaper) with
its spread, and each arm's ``<kind>_<arm>_raw_ratio`` (raw CPU over the arm's CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import lmdb
import numpy as np
import torch
from kvtier.backends.lmdb_tier import LmdbBackend

from kvtier.backend import BlockFormat
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key
from kvtier.transfer import TransferEngine
from kvtier.transfer.layout import KVLayout

ARMS = ("pool_rows", "views")
THREADS = ("kvtier-store", "kvtier-store-tiers", "kvtier-load")


def _engine_cpu_ns() -> int:
    total = 0
    for t in threading.enumerate():
        if t.name in THREADS and t.ident is not None:
            total += time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
    return total


def _timed(fn: Any) -> tuple[float, float]:
    """(engine CPU µs, wall µs) of ``fn()``."""
    cpu, wall = _engine_cpu_ns(), time.perf_counter_ns()
    fn()
    return (_engine_cpu_ns() - cpu) / 1e3, (time.perf_counter_ns() - wall) / 1e3


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def run_size(block_bytes: int, blocks: int, rounds: int, durable: bool, root: str) -> dict[str, Any]:
    engine_blocks = 2 * blocks
    g = torch.Generator().manual_seed(block_bytes)
    cache = torch.randint(0, 256, (engine_blocks, block_bytes), dtype=torch.uint8, generator=g)
    layout = KVLayout([cache.view(torch.float16)])
    keys_needed = rounds * len(ARMS) * blocks + blocks
    capacity = max(64 << 20, 3 * keys_needed * (block_bytes + 4096))
    backend = LmdbBackend(capacity=capacity, path=os.path.join(root, f"tier-{block_bytes}"), sync_mode="durable" if durable else "fast")
    asyncio.run(backend.open(BlockFormat(block_bytes=layout.block_bytes)))
    reserve = backend.reserve_bytes()
    manager = TierManager([TierSpec("lmdb", backend.max_blocks * reserve, reserve, LRUPolicy(backend.max_blocks))])
    engine = TransferEngine(layout, [backend], staging_blocks=blocks)
    raw_env = lmdb.open(os.path.join(root, f"raw-{block_bytes}"), map_size=capacity, sync=durable, metasync=durable)
    raw_out = torch.empty(blocks, block_bytes, dtype=torch.uint8)
    values = [bytes(cache[i].numpy()) for i in range(blocks)]
    counter = iter(range(10**9))
    saved = LmdbBackend.takes_pool_rows

    def job(arm: str) -> dict[str, tuple[float, float]]:
        LmdbBackend.takes_pool_rows = arm == "pool_rows"
        keys = [make_key(next(counter)) for _ in range(blocks)]
        plan = manager.prepare_store(keys)
        assert plan is not None

        def store() -> None:
            (result,) = engine.wait([engine.submit_store(plan, list(range(blocks)))], timeout=60)
            assert result.success, result.error

        costs = {"save": _timed(store)}
        manager.complete_store(plan.keys, True)
        load = manager.prepare_load(keys, promote=False)

        def fill() -> None:
            (result,) = engine.wait([engine.submit_load(load, list(range(blocks, 2 * blocks)))], timeout=60)
            assert result.success and not result.missed

        costs["load"] = _timed(fill)
        manager.complete_load(keys)
        assert torch.equal(cache[blocks:], cache[:blocks])
        cache[blocks:].zero_()
        return costs

    def raw() -> dict[str, tuple[float, float]]:
        keys = [make_key(10**8 + next(counter)) for _ in range(blocks)]
        t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        with raw_env.begin(write=True) as txn:
            for k, v in zip(keys, values):
                txn.put(k, v)
        t1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        rows = raw_out.numpy()
        with raw_env.begin(buffers=True) as txn:
            for i, k in enumerate(keys):
                rows[i] = np.frombuffer(txn.get(k), dtype=np.uint8)
        t2, w2 = time.thread_time_ns(), time.perf_counter_ns()
        return {"save": ((t1 - t0) / 1e3, (w1 - w0) / 1e3), "load": ((t2 - t1) / 1e3, (w2 - w1) / 1e3)}

    got: dict[str, dict[str, list[tuple[float, float]]]] = {a: {"save": [], "load": []} for a in (*ARMS, "raw")}
    try:
        for arm in ARMS:  # warm-up, not counted
            job(arm)
        raw()
        for r in range(rounds):
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            for arm in order:
                for kind, cost in job(arm).items():
                    got[arm][kind].append(cost)
            for kind, cost in raw().items():
                got["raw"][kind].append(cost)
    finally:
        LmdbBackend.takes_pool_rows = saved
        engine.close()
        asyncio.run(backend.aclose())
        raw_env.close()
    out: dict[str, Any] = {"block_bytes": block_bytes, "blocks_per_job": blocks, "rounds": rounds}
    for kind in ("save", "load"):
        for arm in (*ARMS, "raw"):
            out[f"{kind}_{arm}_cpu_us"] = _spread([c for c, _ in got[arm][kind]])
            out[f"{kind}_{arm}_wall_us"] = _spread([w for _, w in got[arm][kind]])
        ratios = [v / p for (v, _), (p, _) in zip(got["views"][kind], got["pool_rows"][kind])]
        out[f"{kind}_views_over_pool_rows"] = _spread(ratios)
        for arm in ARMS:
            out[f"{kind}_{arm}_raw_ratio"] = round(
                statistics.median(rc / ac for (rc, _), (ac, _) in zip(got["raw"][kind], got[arm][kind])), 3
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--quick", action="store_true", help="9 rounds")
    parser.add_argument("--durable", action="store_true", help="syncs on (the default measures CPU with syncs off)")
    args = parser.parse_args()
    rounds = 9 if args.quick else args.rounds
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-pool-rows-") as root:
        results = [run_size(size, args.blocks, rounds, args.durable, root) for size in args.sizes]
    print(json.dumps({"bench": "pool_rows", "durable": args.durable, "load_at_start": round(load, 2), "load_at_end": round(os.getloadavg()[0], 2), "sizes": results}, indent=1))


if __name__ == "__main__":
    main()
