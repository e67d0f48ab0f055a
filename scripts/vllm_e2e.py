#!/usr/bin/env python3
"""End-to-end check of kvtier under vLLM (``kvtier.integrations.vllm``), on CPU.

Three fresh processes share one tiny random Llama and one LMDB tier under a temp dir:

* **ref**  - vLLM without kvtier: the recompute reference (tokens, log-probs, TTFT on misses);
* **A**    - vLLM with kvtier on the empty LMDB tier: generates for prompts ``P_i`` and stores
  their blocks;
* **B**    - vLLM with kvtier on the same LMDB tier, started after A exited: generates for
  ``P_0 + E`` (a longer prompt with the same prefix) and must load ``P_0``'s blocks.

Checks (any failure exits 1): B's greedy tokens equal ref's; the log-prob of each generated
token differs by at most ``--atol`` (float32 model); B's ``num_cached_tokens`` equals the
stored prefix (vLLM's count of tokens it did not prefill, and B's GPU prefix cache is empty,
so they came from kvtier); kvtier's own counters show the blocks loaded from the LMDB tier.
It also prints TTFT (one request, ``max_tokens=1``) with and without kvtier hits.

If vLLM cannot be imported it prints one line ``VLLM E2E SKIPPED: <reason>`` and exits 0.
Run with the interpreter of an environment that has vLLM and kvtier installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

BLOCK = 32
PREFIX_BLOCKS = 16  # tokens of each stored prompt: PREFIX_BLOCKS * BLOCK
EXTRA = 24  # tokens B appends to P_0
MAX_TOKENS = 16
NUM_TTFT = 4  # prompts per TTFT measurement
VOCAB = 1000


def _set_prefix_blocks(n: int) -> None:
    global PREFIX_BLOCKS
    PREFIX_BLOCKS = n


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(n)]


def make_model(path: str, layers: int = 2, hidden: int = 256) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)


def child(role: str, model: str, lmdb_path: str, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvtier.integrations import vllm as kv_vllm

    kwargs: dict[str, Any] = {}
    if role != "ref":
        tiers = [{"backend": "lmdb", "path": lmdb_path, "capacity": "2GiB"}]
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_vllm.kv_transfer_config({"tiers": tiers}))
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=-(-(PREFIX_BLOCKS * BLOCK + EXTRA + MAX_TOKENS) // BLOCK) * BLOCK,
        max_num_seqs=4,
        seed=0,
        **kwargs,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, detokenize=False)
    first = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    length = PREFIX_BLOCKS * BLOCK
    stored = _prompts(1, NUM_TTFT, length)  # P_0 .. P_3, stored by A
    unseen = _prompts(2, NUM_TTFT, length)  # never stored

    def run(tokens: list[int], params: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return outs[0], time.perf_counter() - start

    # Warm up on unrelated tokens: the first prefill of a shape is slow.
    for warm in _prompts(3 if role == "A" else 5, 2, length):
        run(warm, first)
    result: dict[str, Any] = {"role": role}

    def record(o: Any) -> dict[str, Any]:
        c = o.outputs[0]
        lps = [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)]
        return {"tokens": list(c.token_ids), "logprobs": lps, "num_cached_tokens": o.num_cached_tokens}

    if role == "A":
        result["stored"] = [record(run(p, greedy)[0]) for p in stored]
    else:
        target = stored[0] + _prompts(4, 1, EXTRA)[0]
        o, _ = run(target, greedy)
        result["target"] = record(o)
        if role != "ref":
            result["kvtier_after_target"] = kv_vllm.engine_stats()
        # Alternate hit and miss prompts so drift in machine load affects both alike.
        result["ttft_stored"], result["ttft_unseen"] = [], []
        for hit, miss in zip(stored[1:], unseen):
            result["ttft_stored"].append(run(hit, first)[1])
            result["ttft_unseen"].append(run(miss, first)[1])
    if role != "ref":
        result["kvtier"] = kv_vllm.engine_stats()
    with open(out, "w") as f:
        json.dump(result, f)


def spawn(role: str, model: str, lmdb_path: str, work: str) -> dict[str, Any]:
    out = os.path.join(work, f"{role}.json")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        role,
        "--model",
        model,
        "--lmdb",
        lmdb_path,
        "--out",
        out,
        "--prefix-blocks",
        str(PREFIX_BLOCKS),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"VLLM E2E FAILED: process {role} exited with {proc.returncode}")
    print(f"process {role}: {time.perf_counter() - start:.1f} s")
    with open(out) as f:
        return json.load(f)  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["ref", "A", "B"])
    ap.add_argument("--model")
    ap.add_argument("--lmdb")
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the random Llama")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (64 per head, 2 query heads per KV head)")
    ap.add_argument("--prefix-blocks", type=int, default=PREFIX_BLOCKS, help=f"{BLOCK}-token blocks per stored prompt")
    ap.add_argument("--atol", type=float, default=1e-3, help="max |logprob_B - logprob_ref| per generated token")
    args = ap.parse_args()
    _set_prefix_blocks(args.prefix_blocks)
    if args.child:
        child(args.child, args.model, args.lmdb, args.out)
        return 0
    try:
        import vllm  # noqa: F401

        import kvtier.integrations.vllm as kv_vllm

        kv_vllm.KvtierConnector  # noqa: B018  (builds the vLLM classes: fails here if vLLM's API moved)
    except Exception as exc:
        print(f"VLLM E2E SKIPPED: cannot import vLLM / kvtier's vLLM classes: {type(exc).__name__}: {exc}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-e2e-") as work:
        model = os.path.join(work, "tiny-llama")
        make_model(model, args.layers, args.hidden)
        lmdb_path = os.path.join(work, "lmdb")
        spawn("A", model, lmdb_path, work)
        b = spawn("B", model, lmdb_path, work)
        ref = spawn("ref", model, lmdb_path, work)
    failures: list[str] = []
    prefix = PREFIX_BLOCKS * BLOCK
    # Blocks A left in the LMDB tier, as B's kvtier found them at open (A's own completion
    # counter lags: vLLM reports a store's completion on a later engine step).
    stored_blocks = b["kvtier"].get("blocks_adopted", 0)
    want = NUM_TTFT * PREFIX_BLOCKS + 2 * PREFIX_BLOCKS  # the stored prompts + A's two warm-up prompts
    if stored_blocks != want:
        failures.append(f"B found {stored_blocks} blocks in the LMDB tier, expected {want} stored by A")
    tb, tr = b["target"], ref["target"]
    if tb["tokens"] != tr["tokens"]:
        failures.append(f"B's tokens differ from the recompute: {tb['tokens']} != {tr['tokens']}")
    diffs = [abs(x - y) for x, y in zip(tb["logprobs"], tr["logprobs"])]
    max_diff = max(diffs) if diffs else float("inf")
    if max_diff > args.atol:
        failures.append(f"log-probs differ by {max_diff:.3g} > atol {args.atol}")
    if tb["num_cached_tokens"] != prefix:
        failures.append(f"B's num_cached_tokens is {tb['num_cached_tokens']}, expected the {prefix} stored tokens")
    if tr["num_cached_tokens"] != 0:
        failures.append(f"the recompute had {tr['num_cached_tokens']} cached tokens, expected 0")
    loaded = b["kvtier_after_target"].get("blocks_loaded", 0)
    if loaded != PREFIX_BLOCKS:
        failures.append(f"kvtier loaded {loaded} blocks for B's request, expected {PREFIX_BLOCKS}")
    if b["kvtier_after_target"].get("blocks_load_failed", 0):
        failures.append("kvtier reported failed loads in B")
    ms = 1000.0
    summary = {
        "prompt_tokens": prefix + EXTRA,
        "stored_prefix_tokens": prefix,
        "B_num_cached_tokens": tb["num_cached_tokens"],
        "blocks_in_lmdb_after_A": stored_blocks,
        "B_blocks_loaded": loaded,
        "B_bytes_loaded": b["kvtier_after_target"].get("transfers", {}).get("bytes_loaded"),
        "tokens_equal": tb["tokens"] == tr["tokens"],
        "max_logprob_abs_diff": max_diff,
        "ttft_ms_no_kvtier_median": statistics.median(ref["ttft_stored"] + ref["ttft_unseen"]) * ms,
        "ttft_ms_kvtier_hit_median": statistics.median(b["ttft_stored"]) * ms,
        "ttft_ms_kvtier_miss_median": statistics.median(b["ttft_unseen"]) * ms,
        "ttft_prompt_tokens": prefix,
        "ttft_ms_samples": {
            "no_kvtier": [round(x * ms, 1) for x in ref["ttft_stored"] + ref["ttft_unseen"]],
            "kvtier_hit": [round(x * ms, 1) for x in b["ttft_stored"]],
            "kvtier_miss": [round(x * ms, 1) for x in b["ttft_unseen"]],
        },
        "model": {"layers": args.layers, "hidden": args.hidden, "dtype": "float32", "block_size": BLOCK},
    }
    print(json.dumps(summary, indent=1))
    if failures:
        for f in failures:
            print(f"VLLM E2E FAILED: {f}")
        return 1
    print("VLLM E2E PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
