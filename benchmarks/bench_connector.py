"""Connector benchmark: prints ONE JSON object.

- ``last_block_gain``: prefix-hit tokens of a multi-turn chat run with the last-block-at-finish
  path, divided by the same run with it disabled. Measured with async scheduling (the newest
  sampled token reaches the scheduler one step late, so a request's final block is keyed only
  at finish) and with the engine's own prefix cache off, so every hit is a kvtier hit.
- ``hit_vs_oracle``: kvtier + GPU prefix-cache hit tokens divided by those of an unbounded cache
  of every block ever computed, with a small GPU pool and a host tier large enough for the
  workload (target >= 0.99).
- ``hits_by_tier_size``: the same share per workload with the host tier sized at a tenth, a
  quarter, half and all of the workload's footprint, and the engine's prefix cache off (what a
  tier the workload overflows keeps; ``hit_vs_oracle`` is near 1 by construction).
- ``step_ms_256``: scheduler-side cost of ``build_connector_meta`` + ``update_connector_output``
  per decode step with 256 running requests (target <= 1 ms), workers answered instantly.
- ``step_ms_raw``: the floor measured in the same process, a bare scan of the same 256 requests
  per step (one dict lookup and one integer comparison each, a list of the ones that completed
  a block); ``step_vs_raw`` is ``step_ms_256 / step_ms_raw`` (the machine's speed cancels out).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from kvtier.connector import (
    ConnectorConfig,
    JobReport,
    SchedulerConnector,
    SchedulerStep,
    WorkerOutput,
)
from kvtier.keys import Namespace
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.sim import SimConfig, run_sim

HOST = {"tiers": [{"backend": "cpu", "capacity": "64MiB"}]}


def last_block_gain(requests: int = 200) -> dict[str, float]:
    hits = {}
    for flag in (True, False):
        sim = SimConfig(
            async_scheduling=True,
            prefix_caching=False,
            num_gpu_blocks=2048,
            engine_blocks_per_block=1,
            store_last_block_at_finish=flag,
        )
        report = run_sim(HOST, workload="chat", requests=requests, sim=sim)
        assert report.ok, report.to_dict()
        hits[flag] = report.hit_tokens
    return {
        "last_block_gain": hits[True] / hits[False],
        "hit_tokens_with": hits[True],
        "hit_tokens_without": hits[False],
    }


def hit_vs_oracle(requests: int = 96) -> dict[str, float]:
    out = {}
    total_hit = total_oracle = 0
    for workload in ("chat", "shared", "docqa"):
        sim = SimConfig(num_gpu_blocks=256, engine_blocks_per_block=1)
        report = run_sim(HOST, workload=workload, requests=requests, sim=sim)
        assert report.ok, report.to_dict()
        out[f"hit_vs_oracle_{workload}"] = report.hit_tokens / max(1, report.oracle_hit_tokens)
        total_hit += report.hit_tokens
        total_oracle += report.oracle_hit_tokens
    out["hit_vs_oracle"] = total_hit / max(1, total_oracle)
    return out


#: Host tier sizes of the sweep, as fractions of the blocks a workload stores: all of them fit
#: only at 1.0 (the unbounded run itself), so the smaller sizes show what an overflowing tier keeps.
TIER_FRACTIONS = (0.1, 0.25, 0.5)


def hits_by_tier_size(requests: int = 48, fractions: tuple[float, ...] = TIER_FRACTIONS) -> dict[str, object]:
    """Per workload, hits over the unbounded cache's with the host tier at ``fractions`` of the
    workload's footprint (the bytes an unbounded tier ends up storing) and at all of it. The
    engine's own prefix cache is off, so every hit comes from the kvtier tier being sized."""
    out: dict[str, object] = {}
    sim = SimConfig(num_gpu_blocks=256, engine_blocks_per_block=1, prefix_caching=False)
    for workload in ("chat", "shared", "docqa"):
        unbounded = run_sim(HOST, workload=workload, requests=requests, sim=sim)
        assert unbounded.ok, unbounded.to_dict()
        footprint = unbounded.bytes_stored
        points = []
        for fraction in fractions:
            tier = {"tiers": [{"backend": "cpu", "capacity": max(1, int(footprint * fraction))}]}
            report = run_sim(tier, workload=workload, requests=requests, sim=sim)
            assert report.ok, report.to_dict()
            points.append({"tier_fraction": fraction, "hit_vs_oracle": round(report.hit_tokens / max(1, report.oracle_hit_tokens), 4)})
        points.append({"tier_fraction": 1.0, "hit_vs_oracle": round(unbounded.hit_tokens / max(1, unbounded.oracle_hit_tokens), 4)})
        out[workload] = {"footprint_bytes": footprint, "points": points}
    return {"hits_by_tier_size": out}


@dataclass
class _Req:
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)


def step_ms(running: int = 256, steps: int = 400, prompt: int = 512, block_size: int = 16) -> float:
    """Mean ms per step of the scheduler half alone (``build_connector_meta`` +
    ``update_connector_output``), decode steps of ``running`` requests."""
    block_bytes = 64 * 1024
    blocks = running * (prompt + steps) // block_size + 64
    spec = TierSpec(
        "cpu", capacity_bytes=blocks * block_bytes, block_reserve=block_bytes, policy=LRUPolicy(capacity=blocks)
    )
    manager = TierManager([spec])
    sched = SchedulerConnector(manager, Namespace(model_id="bench"), ConnectorConfig(block_size=block_size))
    reqs = []
    next_block = 0
    for i in range(running):
        tokens = [(i * 7919 + j) % 30000 + 3 for j in range(prompt)]
        n_blocks = (prompt + steps) // block_size + 1
        req = _Req(f"r{i}", tokens, 0, list(range(next_block, next_block + n_blocks)))
        next_block += n_blocks
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, req.block_ids, 0)
        reqs.append(req)

    def answer(meta) -> WorkerOutput:  # an instant worker: every job succeeds
        return WorkerOutput(0, tuple(JobReport(j.job_id, "store", True, 0) for j in meta.stores))

    # Prefill (not timed), then decode.
    meta = sched.build_connector_meta(SchedulerStep(0, {r.request_id: prompt for r in reqs}))
    for r in reqs:
        r.num_computed_tokens = prompt
        r.token_ids.append(5)
    sched.update_connector_output(answer(meta))
    scheduled = {r.request_id: 1 for r in reqs}
    elapsed = 0.0
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        meta = sched.build_connector_meta(SchedulerStep(s, scheduled))
        t1 = time.perf_counter()
        output = answer(meta)  # the workers' side: not the scheduler's cost
        t2 = time.perf_counter()
        sched.update_connector_output(output)
        elapsed += (t1 - t0) + (time.perf_counter() - t2)
        for r in reqs:  # the engine's own bookkeeping, not timed
            r.num_computed_tokens += 1
            r.token_ids.append((s * 31 + len(r.token_ids)) % 30000 + 3)
    return 1000 * elapsed / steps


def step_ms_raw(running: int = 256, steps: int = 400, prompt: int = 512, block_size: int = 16) -> float:
    """Mean ms per step of a bare scan of ``running`` decoding requests: the least any
    per-step bookkeeping over them costs in this interpreter."""
    states = {f"r{i}": [prompt, prompt // block_size] for i in range(running)}
    scheduled = {rid: 1 for rid in states}
    t0 = time.perf_counter()
    for _ in range(steps):
        done = []
        for rid, count in scheduled.items():
            st = states[rid]
            st[0] += count
            if st[0] // block_size <= st[1]:
                continue
            st[1] = st[0] // block_size
            done.append(rid)
    return 1000 * (time.perf_counter() - t0) / steps


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer requests, steps and repetitions (a few seconds)")
    quick = parser.parse_args().quick
    result: dict[str, float | str] = {"quick": quick}
    result.update(last_block_gain(48 if quick else 200))
    result.update(hit_vs_oracle(32 if quick else 96))
    result.update(hits_by_tier_size(12 if quick else 48))
    steps, reps = (100, 1) if quick else (400, 3)
    raw = min(step_ms_raw(steps=steps) for _ in range(reps))
    step = min(step_ms(steps=steps) for _ in range(reps))
    result["step_ms_256"] = step
    result["step_ms_raw"] = raw
    result["step_vs_raw"] = step / raw
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
