"""Where a kvtier ``cpu`` hit's time goes under vLLM, step by step, next to the engine-cache hit.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core, scheduler,
worker and kvtier's two connector sides on one thread, kvtier's transfer threads beside it), on
the random Llama of ``bench_vllm_e2e.py``. For each of ``--prompts`` documents it computes the
document once (kvtier stores it), then asks it another question twice: once with the blocks in
vLLM's prefix cache (the limit), once after ``llm.reset_prefix_cache()`` so kvtier loads them.
Every engine step of the two target requests is timed and split into: the scheduler
(``schedule`` and ``update_from_output``, kvtier's scheduler side inside them, timed apart),
the model (``execute_model``; kvtier's worker side inside it, timed apart: ``start_load_kv``,
``wait_for_save``, ``get_finished``, ``build_connector_worker_meta``), and the rest of the step.

    python benchmarks/profile_vllm_hit.py [--prompts 5] [--doc-tokens 1472] [--cprofile]

Prints one JSON object: per request kind the medians over the prompts of TTFT, steps, and
each part's milliseconds; with ``--cprofile``, kvtier's own functions by cumulative time over
the kvtier hits (main thread only).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

from bench_vllm_e2e import BLOCK, _tokens, child_env, make_model

WORKER_SIDE = ("start_load_kv", "wait_for_save", "get_finished", "build_connector_worker_meta",
               "get_block_ids_with_load_errors", "handle_preemptions", "bind_connector_metadata")
SCHEDULER_SIDE = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                  "update_connector_output", "request_finished", "take_events", "get_kv_connector_stats")


class Timeline:
    """Milliseconds per part of every engine step while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name)
        timeline = self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timeline.on:
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timeline.current[part] += (time.perf_counter() - t0) * 1e3

        setattr(owner, name, timed)

    def wrap_step(self, core: Any) -> None:
        original = core.step_fn  # what the in-process engine loop calls
        timeline = self

        def step(*args: Any, **kwargs: Any) -> Any:
            if not timeline.on:
                return original(*args, **kwargs)
            timeline.current = defaultdict(float)
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            timeline.current["step"] = (time.perf_counter() - t0) * 1e3
            timeline.steps.append(dict(timeline.current))
            return out

        core.step_fn = step


def _connector_parts(steps: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for s in steps:
        for k, v in s.items():
            total[k] += v
    out = {k: round(v, 2) for k, v in sorted(total.items())}
    sched = total["schedule"] + total["update_from_output"]
    kv_sched = sum(total[f"kvtier_scheduler.{m}"] for m in SCHEDULER_SIDE)
    kv_worker = sum(total[f"kvtier_worker.{m}"] for m in WORKER_SIDE)
    out["scheduler_without_kvtier"] = round(sched - kv_sched, 2)
    out["model_without_kvtier"] = round(total["execute_model"] - kv_worker, 2)
    out["kvtier_scheduler_side"] = round(kv_sched, 2)
    out["kvtier_worker_side"] = round(kv_worker, 2)
    out["rest_of_step"] = round(total["step"] - sched - total["execute_model"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--doc-tokens", type=int, default=1472)
    ap.add_argument("--question-tokens", type=int, default=28)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--cores", default="1")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--idle-load-wait", type=float, help="kvtier's idle_load_wait_s (default: kvtier's default)")
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval for this process (seconds)")
    ap.add_argument("--json", help="also write the JSON here (vLLM logs to stdout too)")
    args = ap.parse_args()
    os.environ.update(child_env("cpu", args.cores))
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    import kvtier.integrations.vllm as kv_vllm

    work = tempfile.mkdtemp(prefix="kvtier-profile-vllm-")
    model = os.path.join(work, "model")
    info = make_model(model, args.layers, args.hidden)
    timeline = Timeline()
    jobs: list[tuple[str, float, int]] = []  # (kind, seconds in kvtier's transfer engine, bytes) per finished job
    from kvtier.integrations.vllm import worker_side

    finished = worker_side.WorkerSide.finished

    def spied_finished(side: Any) -> list[tuple[int, bool, int, float]]:
        out = finished(side)
        if timeline.on:
            jobs.extend(("job", seconds, nbytes) for _, _, nbytes, seconds in out)
        return out

    worker_side.WorkerSide.finished = spied_finished  # type: ignore[method-assign]
    connector_cls = kv_vllm.KvtierConnector
    for m in WORKER_SIDE:
        timeline.wrap(connector_cls, m, f"kvtier_worker.{m}")
    for m in SCHEDULER_SIDE:
        timeline.wrap(connector_cls, m, f"kvtier_scheduler.{m}")
    store = {"tiers": [{"backend": "cpu", "capacity": "1GiB"}]}
    extra = {} if args.idle_load_wait is None else {"idle_load_wait_s": args.idle_load_wait}
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=BLOCK, seed=0,
              max_model_len=-(-(args.doc_tokens + args.question_tokens + 8) // BLOCK) * BLOCK,
              num_gpu_blocks_override=192, disable_log_stats=False,
              kv_transfer_config=KVTransferConfig(**kv_vllm.kv_transfer_config(store, **extra)))
    core = llm.llm_engine.engine_core.engine_core
    timeline.wrap_step(core)
    timeline.wrap(core.scheduler, "schedule", "schedule")
    timeline.wrap(core.scheduler, "update_from_output", "update_from_output")
    timeline.wrap(core.model_executor, "execute_model", "execute_model")
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)

    def generate(tokens: list[int]) -> Any:
        return llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]

    for w in range(2):
        generate(_tokens(("warm", w), args.doc_tokens))
    runs: dict[str, list[dict[str, Any]]] = {"engine_hit": [], "kvtier_hit": []}
    profiler = cProfile.Profile() if args.cprofile else None
    for i in range(args.prompts):
        doc = _tokens(("doc", i), args.doc_tokens)
        generate(doc + _tokens(("q", i, 0), args.question_tokens))
        generate(_tokens(("filler", i), BLOCK))  # one more step: the document's stores are submitted
        for kind in ("engine_hit", "kvtier_hit"):
            if kind == "kvtier_hit":
                llm.reset_prefix_cache()
            timeline.steps, timeline.on = [], True
            jobs.clear()
            if profiler is not None and kind == "kvtier_hit":
                profiler.enable()
            t0 = time.perf_counter()
            out = generate(doc + _tokens(("q", i, kind), args.question_tokens))
            wall = time.perf_counter() - t0
            if profiler is not None:
                profiler.disable()
            timeline.on = False
            runs[kind].append({"wall_ms": wall * 1e3, "ttft_ms": out.metrics.first_token_latency * 1e3,
                               "cached_tokens": out.num_cached_tokens, "steps": len(timeline.steps),
                               "jobs": [(k, round(sec * 1e3, 2), b) for k, sec, b in jobs],
                               "per_step_ms": [round(s["step"], 2) for s in timeline.steps],
                               "parts_ms": _connector_parts(timeline.steps)})
    summary: dict[str, Any] = {"model": info, "doc_tokens": args.doc_tokens, "loadavg": os.getloadavg(),
                               "idle_load_wait_s": args.idle_load_wait, "switch_interval": sys.getswitchinterval()}
    for kind, rs in runs.items():
        parts = {k: round(statistics.median(r["parts_ms"].get(k, 0.0) for r in rs), 2) for k in rs[0]["parts_ms"]}
        summary[kind] = {
            "ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in rs), 1),
            "wall_ms_median": round(statistics.median(r["wall_ms"] for r in rs), 1),
            "steps": [r["steps"] for r in rs],
            "cached_tokens": [r["cached_tokens"] for r in rs],
            "parts_ms_median": parts,
            "per_step_ms_first": rs[0]["per_step_ms"],
            "kvtier_jobs_ms_bytes": [r["jobs"] for r in rs],
        }
    summary["kvtier_vs_engine_ttft"] = round(summary["kvtier_hit"]["ttft_ms_median"] / summary["engine_hit"]["ttft_ms_median"], 3)
    summary["kvtier_counters"] = {k: v for k, v in kv_vllm.engine_stats().items() if isinstance(v, int) and v}
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(r"kvtier|offloading|kv_offload", 40)
        summary["cprofile_kvtier"] = text.getvalue().splitlines()[-50:]
    text_out = json.dumps(summary, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text_out)
    print(text_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
