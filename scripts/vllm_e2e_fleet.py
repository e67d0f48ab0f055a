#!/usr/bin/env python3
"""End-to-end check of kvtier under vLLM for a fleet: engines of different TP sizes share one
Redis tier live and one file tier across a restart, and routers see the other engine's blocks.

Three fresh processes share one tiny random Llama (2 KV heads, 32-token blocks), one Redis
server (started here on a free port, stopped by pid) and one ``file`` tier under a temp dir;
records are head-group records (the default), so their keys and bytes do not depend on the
writer's TP size:

* **B** - TP=2 under vLLM's multiprocess executor (the engine core in this script's child
  process, so the spies see its scheduler side), tiers ``[file, redis]`` written through.
  It starts first and warms up, then waits;
* **A** - TP=1, its own process, tier ``[redis]``: serves prompts ``P_i`` (computing them) and
  exits;
* **B**, live: within ``--adopt-timeout`` seconds of A's exit its scheduler side holds every
  block of ``P_i`` (followed from the Redis tier, never written by B) and its KV event stream
  announced them as stored (``medium`` STORAGE, ``locality`` REMOTE, ``ownership``
  ``kvtier:redis``). Then it generates ``P_i``: every block comes from kvtier
  (``num_cached_tokens``), and its greedy tokens equal a TP=2 recompute (the same prompts with a
  ``cache_salt``, so no cache holds them). It then computes prompts ``Q_i`` (stored to the file
  tier by both its ranks, one head group each) and exits;
* **D** - a fresh TP=1 engine on the ``file`` tier alone: served every block of ``Q_i`` from
  it, its tokens equal its own recompute and B's.

Prints a JSON summary (the adoption delay, counters) and ``VLLM FLEET E2E PASSED``; any failed
check exits 1. Without vLLM it prints ``VLLM FLEET E2E SKIPPED: <reason>`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from vllm_engine import BLOCK, VOCAB, free_port, make_llm, make_model, verdict
from vllm_engine import engine_env as _env
from vllm_engine import prompts as _prompts

PREFIX_BLOCKS = 6
NUM_PROMPTS = 2
MAX_TOKENS = 8
FILE_CAPACITY = 1 << 30
REDIS_CAPACITY = 1 << 30


def _tiers(role: str, file_path: str, redis_url: str) -> list[dict[str, Any]]:
    file_tier = {"backend": "file", "path": file_path, "capacity": FILE_CAPACITY}
    redis_tier = {"backend": "redis", "url": redis_url, "prefix": "fleet", "capacity": REDIS_CAPACITY, "sync_interval_s": 0.5}
    return {"A": [redis_tier], "B": [file_tier, redis_tier], "D": [file_tier]}[role]


def _worker_drain(worker: Any = None) -> bool:
    """Run in each vLLM worker: wait until the kvtier jobs of its ranks ended (tier writes too)."""
    from kvtier.integrations.vllm import engines

    for engine in engines.live_engines():
        if isinstance(engine, engines.RankEngine) and engine.store.transfers is not None:
            engine.store.transfers.wait_idle(timeout=120.0)
    return True


def _worker_stats(worker: Any = None) -> dict[str, Any]:
    """Run in each vLLM worker: the kvtier counters of its ranks."""
    from kvtier.integrations.vllm import engine_stats

    return engine_stats()


def _block_hashes(llm: Any, tokens: list[int]) -> list[Any]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    hash_fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    parent, hashes = None, []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hash_block_tokens(hash_fn, parent, tokens[start : start + BLOCK])
        hashes.append(parent)
    return hashes


def _held(llm: Any, prompts: list[list[int]]) -> tuple[int, int]:
    """(blocks of ``prompts`` the scheduler side's manager holds ready, blocks in all)."""
    from vllm.v1.kv_offload.base import make_offload_key

    from kvtier.integrations.vllm import engines
    from kvtier.keys import fold_block_hashes

    sched = [e for e in engines.live_engines() if isinstance(e, engines.SchedulerEngine) and e.manager is not None]
    if not sched:
        return 0, 1
    engine = sched[0]
    assert engine.manager is not None and engine.namespace is not None
    held = total = 0
    for tokens in prompts:
        keys = fold_block_hashes([make_offload_key(h, 0) for h in _block_hashes(llm, tokens)], namespace=engine.namespace)
        total += len(keys)
        held += sum(engine.manager.status(k).tier is not None for k in keys)
    return held, total


class _Events:
    """Every BlockStored event kvtier's connector handed vLLM (block hash -> medium, locality,
    ownership)."""

    def __init__(self, cls: Any) -> None:
        self.stored: dict[Any, tuple[Any, Any, Any]] = {}
        take_events = cls.take_events
        events = self

        def spied(connector: Any) -> Any:
            out = list(take_events(connector))
            for event in out:
                if type(event).__name__ == "BlockStored":
                    for h in event.block_hashes:
                        events.stored[h] = (event.medium, event.locality, event.ownership)
            return out

        cls.take_events = spied


def child(role: str, model: str, file_path: str, redis_url: str, work: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations import vllm as kv_vllm

    events = _Events(kv_vllm.KvtierConnector) if role == "B" else None
    store = {"tiers": _tiers(role, file_path, redis_url), "write": "through"}
    llm = make_llm(
        model,
        max_model_len=-(-(PREFIX_BLOCKS * BLOCK + MAX_TOKENS) // BLOCK) * BLOCK + BLOCK,
        kv_transfer=kv_vllm.kv_transfer_config(store),
        tp=2 if role == "B" else 1,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    tick = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    length = PREFIX_BLOCKS * BLOCK
    shared, restart = _prompts(1, NUM_PROMPTS, length), _prompts(2, NUM_PROMPTS, length)

    def run(tokens: list[int], params: Any = greedy, salt: str | None = None) -> dict[str, Any]:
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salt is not None:
            prompt["cache_salt"] = salt
        o = llm.generate([prompt], params, use_tqdm=False)[0]
        return {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}

    def stats() -> dict[str, Any]:
        views = llm.collective_rpc(_worker_stats)
        total: dict[str, int] = {}
        for view in views:
            for name, value in view.items():
                if isinstance(value, int):
                    total[name] = total.get(name, 0) + value
        return total

    result: dict[str, Any] = {"role": role}
    for warm in _prompts(9, 2, length // 2):  # the first prefill of a shape is slow
        run(warm, tick)
    if role == "A":
        result["shared"] = [run(p) for p in shared]
        for warm in _prompts(8, 2, 10):  # a few more steps: the last stores complete
            run(warm, tick)
        result["drained"] = all(llm.collective_rpc(_worker_drain))
    elif role == "B":
        assert events is not None
        with open(os.path.join(work, "B.ready"), "w") as f:
            f.write("ready")
        while not os.path.exists(os.path.join(work, "A.done")):
            time.sleep(0.2)
        with open(os.path.join(work, "A.done")) as f:
            a_exited = float(f.read())
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        wanted = [maybe_convert_block_hash(h) for p in shared for h in _block_hashes(llm, p)]
        deadline = time.time() + ADOPT_TIMEOUT
        held, total = _held(llm, shared)
        while time.time() < deadline:
            held, total = _held(llm, shared)
            announced = sum(h in events.stored for h in wanted)
            if held == total and announced == len(wanted):
                break
            run([VOCAB - 1, 2, 3], tick)  # a step: vLLM takes the connector's events
            time.sleep(0.1)
        result["adopted_after_s"] = time.time() - a_exited
        result["held"], result["blocks"] = held, total
        result["announced"] = sum(h in events.stored for h in wanted)
        result["announced_as"] = sorted({str(events.stored[h]) for h in wanted if h in events.stored})
        before = stats()
        result["shared"] = [run(p) for p in shared]
        result["kvtier_delta"] = {k: v - before.get(k, 0) for k, v in stats().items()}
        result["shared_recompute"] = [run(p, salt="recompute") for p in shared]
        result["restart"] = [run(p) for p in restart]
        for warm in _prompts(8, 2, 10):
            run(warm, tick)
        result["drained"] = all(llm.collective_rpc(_worker_drain))
    else:  # D
        before = stats()
        result["restart"] = [run(p) for p in restart]
        result["kvtier_delta"] = {k: v - before.get(k, 0) for k, v in stats().items()}
        result["restart_recompute"] = [run(p, salt="recompute") for p in restart]
    with open(out, "w") as f:
        json.dump(result, f)


ADOPT_TIMEOUT = 30.0


def _command(role: str, model: str, file_path: str, redis_url: str, work: str) -> list[str]:
    out = os.path.join(work, f"{role}.json")
    return [sys.executable, os.path.abspath(__file__), "--child", role, "--model", model, "--file", file_path,
            "--redis", redis_url, "--work", work, "--out", out, "--adopt-timeout", str(ADOPT_TIMEOUT)]


def _result(role: str, proc: Any, work: str, started: float) -> dict[str, Any]:
    out = os.path.join(work, f"{role}.json")
    if proc.returncode != 0 or not os.path.exists(out):
        stdout, stderr = (proc.stdout or ""), (proc.stderr or "")
        sys.stderr.write(stdout[-3000:] + stderr[-8000:])
        raise SystemExit(f"VLLM FLEET E2E FAILED: process {role} exited with {proc.returncode}")
    print(f"process {role}: {time.time() - started:.1f} s", flush=True)
    with open(out) as f:
        return json.load(f)  # type: ignore[no-any-return]


def checks(a: dict[str, Any], b: dict[str, Any], d: dict[str, Any]) -> list[str]:
    failures = []
    prefix = PREFIX_BLOCKS * BLOCK
    if b["held"] != b["blocks"]:
        failures.append(f"B holds {b['held']} of the {b['blocks']} blocks A stored, {ADOPT_TIMEOUT} s after A exited")
    if b["announced"] != b["blocks"]:
        failures.append(f"B's KV events announced {b['announced']} of the {b['blocks']} blocks A stored")
    if any("kvtier:redis" not in s for s in b["announced_as"]):
        failures.append(f"B announced A's blocks as {b['announced_as']}, expected the redis tier named")
    for i, (x, ref, other) in enumerate(zip(b["shared"], b["shared_recompute"], a["shared"])):
        if x["num_cached_tokens"] != prefix:
            failures.append(f"B, P_{i}: num_cached_tokens {x['num_cached_tokens']}, expected {prefix} from kvtier")
        if x["tokens"] != ref["tokens"]:
            failures.append(f"B, P_{i}: tokens {x['tokens']} != its TP=2 recompute {ref['tokens']}")
        if ref["num_cached_tokens"] != 0:
            failures.append(f"B, P_{i}: the recompute found {ref['num_cached_tokens']} cached tokens")
        if x["tokens"] != other["tokens"]:
            failures.append(f"B, P_{i}: tokens {x['tokens']} != A's (TP=1) {other['tokens']}")
    loaded = b["kvtier_delta"].get("blocks_loaded", 0)
    if loaded != 2 * b["blocks"] or b["kvtier_delta"].get("blocks_load_failed", 0):
        failures.append(f"B's ranks loaded {loaded} blocks (failed {b['kvtier_delta'].get('blocks_load_failed')}), expected 2 x {b['blocks']}")
    for i, (x, ref, other) in enumerate(zip(d["restart"], d["restart_recompute"], b["restart"])):
        if x["num_cached_tokens"] != prefix:
            failures.append(f"D, Q_{i}: num_cached_tokens {x['num_cached_tokens']}, expected {prefix} from the file tier")
        if x["tokens"] != ref["tokens"] or x["tokens"] != other["tokens"]:
            failures.append(f"D, Q_{i}: tokens {x['tokens']} != its recompute {ref['tokens']} / B's {other['tokens']}")
    if not (a["drained"] and b["drained"]):
        failures.append("a writer's kvtier jobs did not end before it exited")
    return failures


def main() -> int:
    global ADOPT_TIMEOUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["A", "B", "D"])
    ap.add_argument("--model")
    ap.add_argument("--file")
    ap.add_argument("--redis")
    ap.add_argument("--work")
    ap.add_argument("--out")
    ap.add_argument("--adopt-timeout", type=float, default=ADOPT_TIMEOUT, help="seconds B may take to adopt A's blocks")
    args = ap.parse_args()
    ADOPT_TIMEOUT = args.adopt_timeout
    if args.child:
        child(args.child, args.model, args.file, args.redis, args.work, args.out)
        return 0
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        print(f"VLLM FLEET E2E SKIPPED: cannot import vLLM: {type(exc).__name__}: {exc}")
        return 0
    import kvtier.integrations.vllm as kv_vllm

    kv_vllm.KvtierConnector  # noqa: B018  (kvtier's vLLM classes: an error here is a failure)
    server = shutil.which("redis-server")
    if server is None:
        print("VLLM FLEET E2E SKIPPED: NO redis-server ON PATH")
        return 0
    port = free_port()
    redis = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-vllm-fleet-") as work:
            model = os.path.join(work, "tiny-llama")
            make_model(model)
            file_path, url = os.path.join(work, "file-tier"), f"redis://127.0.0.1:{port}/0"
            started = time.time()
            b_proc = subprocess.Popen(_command("B", model, file_path, url, work), env=_env(2, True),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            while not os.path.exists(os.path.join(work, "B.ready")):
                if b_proc.poll() is not None:
                    b_proc.communicate()
                    return _result("B", b_proc, work, started) and 1
                time.sleep(0.5)
            print(f"process B ready: {time.time() - started:.1f} s", flush=True)
            a_started = time.time()
            a_proc = subprocess.run(_command("A", model, file_path, url, work), env=_env(1, False), capture_output=True, text=True)
            with open(os.path.join(work, "A.done"), "w") as f:
                f.write(repr(time.time()))
            a = _result("A", a_proc, work, a_started)
            stdout, stderr = b_proc.communicate()
            b_proc.stdout, b_proc.stderr = stdout, stderr  # type: ignore[assignment]
            b = _result("B", b_proc, work, started)
            d_started = time.time()
            d = _result("D", subprocess.run(_command("D", model, file_path, url, work), env=_env(1, False),
                                            capture_output=True, text=True), work, d_started)
    finally:
        redis.terminate()
        redis.wait(timeout=30)
    failures = checks(a, b, d)
    summary = {
        "adopted_after_s": round(b["adopted_after_s"], 2),
        "blocks_shared": b["blocks"],
        "announced": b["announced"],
        "announced_as": b["announced_as"],
        "B_kvtier_delta": {k: v for k, v in b["kvtier_delta"].items() if v},
        "D_kvtier_delta": {k: v for k, v in d["kvtier_delta"].items() if v},
    }
    print(json.dumps(summary, indent=1))
    return verdict("VLLM FLEET E2E", failures)


if __name__ == "__main__":
    sys.exit(main())
