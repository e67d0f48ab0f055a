"""Time to first token in transformers' continuous-batching engine, with and without kvtier hits.

A random ``LlamaForCausalLM`` (float32, sdpa, CPU) answers a request whose long prefix (a
previous chat turn) was served before. Per repetition, a fresh prefix of ``--prefix`` tokens is
sent once (its blocks are stored at finish), then a follow-up with that prefix plus
``--suffix`` new tokens is timed. Scenarios:

* ``recompute``: a fresh engine, no kvtier -- the follow-up prefills everything;
* ``engine``: the engine's own in-memory prefix cache serves the prefix;
* ``kvtier_cpu`` / ``kvtier_lmdb``: the engine's cache is off (``engine_prefix_cache=False``)
  and kvtier serves the prefix from the cpu tier / an lmdb-only tier.

TTFT is the engine's own measure (first token timestamp minus request creation), median over
``--reps`` (the minimum is printed too: on a shared machine it is the steadier figure). The
follow-up is sent ``--think`` seconds after the turn it continues, as a user would, so the
turn's store has settled. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import tempfile
import time
from typing import Any

import torch

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


def build_manager(args: argparse.Namespace) -> Any:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    gen = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        page_size=args.page,
        num_blocks=args.blocks,
        max_batch_tokens=args.prefix + args.suffix + 16,
        use_async_batching=False,
    )
    return model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)


def one(manager: Any, prompt: list[int]) -> Any:
    rid = manager.add_request(prompt, max_new_tokens=2, record_timestamps=True)
    while True:
        result = manager.get_result(request_id=rid, timeout=30)
        if result is None:
            raise RuntimeError("the engine produced no result")
        if result.is_finished():
            return result


def scenario(name: str, args: argparse.Namespace, lmdb_dir: str) -> dict[str, Any]:
    from kvtier.integrations.transformers import attach

    manager = build_manager(args)
    kv = None
    if name.startswith("kvtier"):
        tier = (
            {"backend": "cpu", "capacity": "512MiB"}
            if name == "kvtier_cpu"
            else {"backend": "lmdb", "path": f"{lmdb_dir}/{name}", "capacity": "1GiB"}
        )
        kv = attach(manager, {"tiers": [tier]}, model_id="bench-random-llama", engine_prefix_cache=False)
    manager.start()
    g = torch.Generator().manual_seed(11)
    ttft: list[float] = []
    try:
        one(manager, torch.randint(1, 1000, (args.prefix,), generator=g).tolist())  # warm-up
        for _ in range(args.reps):
            prefix = torch.randint(1, 1000, (args.prefix,), generator=g).tolist()
            follow = prefix + torch.randint(1, 1000, (args.suffix,), generator=g).tolist()
            if name != "recompute":
                one(manager, prefix)
                time.sleep(args.think)  # the user reads and types; the store settles
            result = one(manager, follow)
            ttft.append(result.timestamps[0] - result.created_time)
    finally:
        manager.stop(block=True)
    out: dict[str, Any] = {
        "ttft_ms_median": round(1e3 * statistics.median(ttft), 2),
        "ttft_ms_min": round(1e3 * min(ttft), 2),
        "ttft_ms": [round(1e3 * t, 2) for t in ttft],
    }
    if kv is not None:
        follow_ups = list(kv.matches.values())[2::2]
        out["tokens_skipped_per_request"] = statistics.median(m.kvtier_tokens for m in follow_ups)
        stats = kv.stats()
        out["blocks_loaded"] = stats["blocks_loaded"]
        out["blocks_stored"] = stats["blocks_stored"]
        out["bytes_per_block"] = kv.store.format.block_bytes
        kv.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=1024, help="tokens reused from the previous turn")
    parser.add_argument("--suffix", type=int, default=16, help="new tokens of the follow-up")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2048, help="engine cache size in pages")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--think", type=float, default=0.5, help="seconds between a turn and its follow-up")
    args = parser.parse_args()
    import transformers

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: scenario(name, args, tmp) for name in ("recompute", "engine", "kvtier_cpu", "kvtier_lmdb")}
    base = results["recompute"]["ttft_ms_median"]
    for r in results.values():
        r["speedup_vs_recompute"] = round(base / r["ttft_ms_median"], 2)
    print(
        json.dumps(
            {
                "bench": "transformers_continuous_batching",
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "cpu_threads": torch.get_num_threads(),
                "machine": platform.machine(),
                "model": {"layers": args.layers, "hidden": args.hidden, "heads": 4, "kv_heads": 2, "dtype": "float32"},
                "page_size": args.page,
                "prefix_tokens": args.prefix,
                "suffix_tokens": args.suffix,
                "reps": args.reps,
                "think_seconds": args.think,
                "scenarios": results,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
