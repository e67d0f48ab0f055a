#!/usr/bin/env python3
"""Soak of kvtier's vLLM sides below vLLM (no ``vllm`` import): the scheduler side over a
manager and two worker ranks, each with its own store over ``[cpu, lmdb]``, driven through the
test harness ``tests/vllm_world.py`` with a random schedule for ``--seconds`` (default 600):

* **stores** of random runs of keys from a fixed pool (the cpu tier is smaller than the pool,
  so plans evict, and write-through fills the lmdb tier); now and then one rank gets block ids
  it does not have (a store that fails on one rank: its copies on the others are deleted);
* **loads** of what the manager has, each for a request that then finishes;
* **aborts** mid-load: the request ends (``request_finished``) and vLLM drops the job while
  the ranks still run it; or before the step hands its load out (vLLM never issues it);
* **deadline expiries**: a store or load handed to one rank only (the other lost it), given up
  on after the scheduler side's deadline and settled by the silent rank on notice; and a rank's
  kvtier result lost on the way (vLLM's count arrives without it);
* **deletes**: every step ships the scheduler side's deletes to both ranks and runs them.

At the end every open request ends and the engine steps until vLLM has no job open, then it
checks: the scheduler side's tables (``table_sizes()``), vLLM's open jobs and every rank's
jobs are empty; the manager holds no pin and no pending key; each rank's lmdb tier holds
exactly the records the manager has there (no orphan left by a failed store or a delete); after the ranks close, no thread
they started is left; and the process's RSS grew less than ``--max-rss-growth`` (5 %) from the
end of the warm-up (the first ``--warmup`` fraction of the time) to the end. It prints one JSON
object and exits 1 when a check fails. ``tests/test_vllm_soak.py`` runs a short form.

Run: ``PYTHONPATH=$PWD nice -n 10 python scripts/soak_vllm_sides.py --seconds 600``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from vllm_world import World, cpu, open_world

from kvtier.integrations.vllm.deadlines import Abandoned
from kvtier.testing import make_key

RANKS = 2
WINDOW = 512  # requests draw their keys from the newest WINDOW keys (new ones keep coming)
CPU_BLOCKS = 24  # the first tier holds a few requests' keys: plans evict
LMDB_CAPACITY = "2MiB"  # about 240 blocks per rank: the lmdb tier evicts too (deletes)
STORE_BLOCKS = range(0, 8)  # engine blocks stores read ...
LOAD_BLOCKS = range(8, 16)  # ... and loads write (never the same in one step)
DEADLINE_S = 4.0  # the scheduler side's result deadline, on the world's clock (one step = 1 s)
MISSING_BLOCK = 99  # a block id no rank has: the store fails on that rank


def rss_bytes() -> tuple[int, int]:
    """(resident, anonymous resident) bytes of this process (Linux)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon"):
            fields[name] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("RssAnon", 0)


class Soak:
    """One random schedule over a :class:`World`; ``counts`` says what it did."""

    def __init__(self, w: World, seed: int) -> None:
        self.w = w
        self.rng = random.Random(seed)
        self.head = 0  # keys 0 .. head - 1 have been drawn so far
        self.counts: Counter[str] = Counter()
        self.next_job = 1
        self.next_request = 1
        self.running: dict[str, int] = {}  # request id -> its load's vLLM job id (finished next step)
        self.notices: tuple[Abandoned, ...] = ()

    def _job(self) -> int:
        self.next_job += 1
        return self.next_job

    def _one_rank(self) -> list[int]:
        return [self.rng.randrange(RANKS)]

    def _keys(self, fresh: int) -> list[bytes]:
        """A run of 1-4 keys from the newest ones (``fresh`` of them past the newest)."""
        start = self.rng.randrange(max(0, self.head - WINDOW), self.head + fresh)
        n = self.rng.randint(1, 4)
        self.head = max(self.head, min(start + n, self.head + fresh))
        return [make_key(700_000 + i) for i in range(start, start + n)]

    def store(self) -> None:
        keys = self._keys(fresh=4)
        plan = self.w.side.prepare_store(keys)
        if plan is None or not plan.keys:
            self.counts["stores_skipped"] += 1
            return
        job = self._job()
        blocks = self.rng.sample(STORE_BLOCKS, len(plan.keys))
        self.w.vllm.add(job, "store", list(plan.keys))
        self.w.side.deadlines.issued(job, "store", plan.plan_id)
        roll = self.rng.random()
        lost = roll < 0.05  # one rank never gets the job: given up on after the deadline
        bad_rank = self.rng.randrange(RANKS) if 0.05 <= roll < 0.1 else None  # fails on that rank
        for r in self._one_rank() if lost else range(RANKS):
            ids = [MISSING_BLOCK] * len(blocks) if r == bad_rank else blocks
            self.w.workers[r].submit_store(job, plan, ids)
        kind = "stores_lost_on_a_rank" if lost else "stores" if bad_rank is None else "stores_failing_on_a_rank"
        self.counts[kind] += 1

    def load(self) -> None:
        keys = self._keys(fresh=1)
        hit = self.w.manager.lookup(keys)
        if not hit:
            self.counts["load_misses"] += 1
            return
        keys = keys[:hit]
        request = f"req-{self.next_request}"
        self.next_request += 1
        job = self._job()
        blocks = self.rng.sample(LOAD_BLOCKS, hit)
        load_id, plan = self.w.side.prepare_load(keys, request)
        roll = self.rng.random()
        if roll < 0.03:  # aborted before the step handed the load out: vLLM never issues it
            self.w.side.request_finished(request)
            self.counts["loads_aborted_before_issue"] += 1
            return
        self.w.vllm.add(job, "load", list(keys))
        self.w.side.deadlines.issued(job, "load", load_id, tuple(blocks))
        lost = roll < 0.08  # one rank never gets the job: given up on after the deadline
        for r in self._one_rank() if lost else range(RANKS):
            self.w.workers[r].submit_load(job, load_id, plan, blocks)
        if 0.08 <= roll < 0.2:  # the request ends while its load runs; vLLM drops the job
            self.w.vllm.drop(job)
            self.w.side.request_finished(request)
            self.counts["loads_aborted"] += 1
        else:
            self.running[request] = job
            self.counts["loads_lost_on_a_rank" if lost else "loads"] += 1

    def step(self) -> None:
        """One engine step: vLLM's count and kvtier's results, the deadline, the deletes, and
        the requests whose loads vLLM settled finish."""
        lost = self._one_rank() if self.rng.random() < 0.03 else ()
        self.counts["results_lost"] += len(lost)
        self.w.step(notices=self.notices, lost=lost)
        self.notices = self.w.side.take_notices()
        self.counts["notices"] += len(self.notices)
        self.counts["keys_deleted"] += self.w.run_deletes()
        for request, job in list(self.running.items()):
            if job not in self.w.vllm.pending:
                del self.running[request]
                self.w.side.request_finished(request)
        self.w.now += 1.0
        self.counts["steps"] += 1

    def round(self) -> None:
        for _ in range(self.rng.randint(0, 3)):
            self.store()
        for _ in range(self.rng.randint(0, 3)):
            self.load()
        self.step()

    def drain(self) -> None:
        """End every request and step until no job is open (vLLM steps while a job it handed
        out runs) and no notice is owed."""
        for _ in range(int(DEADLINE_S) * 4 + 8):
            if not (self.w.vllm.pending or len(self.w.side.deadlines) or self.notices or self.running):
                break
            self.step()
        for request in list(self.running):
            self.w.side.request_finished(request)
        self.running.clear()
        self.step()
        self.w.run_deletes()


def _kvtier_threads(before: set[int]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.ident not in before and t.is_alive())


async def soak(
    seconds: float, seed: int = 0, warmup: float = 0.1, root: str | None = None, rounds: int | None = None
) -> dict[str, Any]:
    """Run the schedule for ``seconds`` (or ``rounds`` steps, when given: the same schedule
    whatever the machine's speed) and return the figures and checks (see the module doc)."""
    threads_before = {t.ident for t in threading.enumerate()}
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tiers = [
            cpu(CPU_BLOCKS, RANKS),
            {"backend": "lmdb", "path": str(Path(tmp) / "lmdb"), "capacity": LMDB_CAPACITY},
        ]
        w = await open_world(RANKS, tiers, deadline_s=DEADLINE_S)
        s = Soak(w, seed)
        start = time.monotonic()
        warm_end = start + seconds * warmup
        rss_warm: tuple[int, int] | None = None
        try:
            while time.monotonic() - start < seconds if rounds is None else s.counts["steps"] < rounds:
                s.round()
                if rss_warm is None and (time.monotonic() >= warm_end or rounds is not None):
                    gc.collect()
                    rss_warm = rss_bytes()
            s.drain()
            gc.collect()
            rss_end = rss_bytes()
            idle = w.idle()
            stats = w.manager.stats()
            held = [w.held(r, 1) for r in range(RANKS)]
        finally:
            await w.close()
        assert rss_warm is not None
    await asyncio.sleep(0)
    gc.collect()
    left = _kvtier_threads(threads_before)
    # The copy and check pools are process-wide by design (they outlive every store), and
    # asyncio's default executor (``to_thread``) is the event loop's, shut down with it.
    leaked = [n for n in left if not n.startswith(("kvtier-copy", "kvtier-check", "asyncio_"))]
    growth = (rss_end[0] - rss_warm[0]) / rss_warm[0]
    return {
        "seconds": round(time.monotonic() - start, 1),
        "seed": seed,
        "counts": dict(sorted(s.counts.items())),
        "scheduler_counters": {k: v for k, v in w.sched_engine.counters.items() if v},
        "rank_counters": [{k: v for k, v in e.counters.items() if v} for e in w.engines],
        "idle": idle,
        "pins": idle["pins"],
        "ready_per_tier": [t["ready"] for t in stats["tiers"]],
        "lmdb_records_per_rank": held,
        "threads_left": left,
        "threads_leaked": leaked,
        "rss_warm_mib": round(rss_warm[0] / 2**20, 1),
        "rss_end_mib": round(rss_end[0] / 2**20, 1),
        "rss_growth": round(growth, 4),
        "rss_anon_growth": round((rss_end[1] - rss_warm[1]) / rss_warm[1], 4),
    }


def failures(report: dict[str, Any], max_rss_growth: float) -> list[str]:
    """The checks ``report`` fails (empty: it passed)."""
    out = [f"{name}: {n} left" for name, n in report["idle"].items() if n]
    ready = report["ready_per_tier"][1]
    if any(n != ready for n in report["lmdb_records_per_rank"]):
        out.append(
            f"lmdb records per rank {report['lmdb_records_per_rank']}, the manager has {ready} (orphans or holes)"
        )
    if report["threads_leaked"]:
        out.append(f"threads left: {report['threads_leaked']}")
    if report["rss_growth"] >= max_rss_growth:
        out.append(f"RSS grew {report['rss_growth']:.1%} (limit {max_rss_growth:.0%})")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the time before the RSS baseline")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--dir", default=None, help="where the lmdb tiers go (a temporary folder under it)")
    args = p.parse_args()
    report = asyncio.run(soak(args.seconds, args.seed, args.warmup, args.dir))
    report["failures"] = failures(report, args.max_rss_growth)
    print(json.dumps(report, indent=1))
    sys.exit(1 if report["failures"] else 0)


if __name__ == "__main__":
    main()
