"""The hybrid-model part of ``scripts/vllm_e2e.py``: a model with a sliding-window KV-cache
group and a full-attention one (vLLM's hybrid allocator on), both offloaded by kvtier.

A tiny random-weight Gemma 3 text model (``Gemma3ForCausalLM``: layer 0 sliding-window
attention over ``SLIDING_WINDOW`` tokens, layer 1 full attention; 2 KV heads, float32) runs in
three fresh processes, engine core in-process:

* **HA**   - kvtier on ``[cpu, lmdb]`` written through, empty: generates for ``P_i`` and stores;
* **HB**   - started after HA exited: generates for ``P_0 + E`` and must load ``P_0``'s blocks
  of *both* groups from the LMDB tier (each group has its own records: ``r0-of-1-g<group>``);
* **HC**   - after this script damaged the last payload byte of every record of the
  full-attention group in the LMDB tier: the same prompt. kvtier's loads of that group fail
  their checksum; with several groups vLLM 0.32 takes no failed block ids (it raises), so the
  request is reported as a failed receive (``failed_recving``) and vLLM recomputes it;
* **Href** - vLLM without kvtier on the same model: the recompute reference.

Checks: vLLM really ran two KV-cache groups (a sliding-window and a full-attention spec, hybrid
allocator not turned off) in HA and HB; HA left records of both groups, in their own
directories; HB's greedy tokens equal Href's and its log-probs differ by at most ``atol``; its
``num_cached_tokens`` covers all but the stored prefix's last block (vLLM's sliding-window
lookup stops one block short), and kvtier loaded that many blocks of the full-attention group
and the window's blocks of the sliding-window group, none failed. HC: its tokens equal Href's,
vLLM prefilled the whole prompt, the request was reported as a failed receive, no block id was
reported, and kvtier counted failed loads of the full-attention group.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ROLES = ("HA", "HB", "HC", "Href")
SLIDING_WINDOW = 64  # tokens: two vLLM blocks of 32


def make_hybrid_model(path: str, vocab: int, hidden: int = 256) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(path)


def kv_cache_groups(llm: Any) -> dict[str, Any]:
    """The KV-cache groups vLLM's scheduler runs (engine core in this process)."""
    core = llm.llm_engine.engine_core.engine_core
    return {
        "specs": [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups],
        "hybrid_allocator_disabled": bool(llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager),
    }


def group_counters() -> dict[str, dict[str, int]]:
    """Per KV-cache group, kvtier's counters of every side in this process, added up."""
    from kvtier.integrations.vllm import engines

    live = engines.live_engines()
    out: dict[str, dict[str, int]] = {}
    for eng in live:
        mine = out.setdefault(str(eng.group), {})
        for name, value in eng.counters.items():
            mine[name] = mine.get(name, 0) + value
    return out


def patch_failed_receives(cls: Any) -> list[str]:
    """Record the request ids the connector ``cls`` reports as failed receives (in-process)."""
    seen: list[str] = []
    original = cls.get_transfer_results

    def get_transfer_results(connector: Any, finished_req_ids: set[str]) -> Any:
        results = original(connector, finished_req_ids)
        seen.extend(sorted(results.failed_recving))
        return results

    cls.get_transfer_results = get_transfer_results
    return seen


def damage_group(open_lmdb: Callable[[str], Any], path: str) -> int:
    """Invert the last payload byte of every record in the LMDB tier directory ``path``
    (headers intact: only the checksum can tell); the number of records damaged."""
    env, blocks, _ = open_lmdb(path)
    try:
        with env.begin(write=True) as txn:
            damaged = []
            for key, value in txn.cursor(db=blocks):
                stored = bytearray(value)
                stored[-1] ^= 0xFF
                damaged.append((bytes(key), bytes(stored)))
            for key, value in damaged:
                txn.put(key, value, db=blocks)
    finally:
        env.close()
    return len(damaged)


def check_hc(hc: dict[str, Any], href: dict[str, Any], *, prompt: int, decode_steps: int) -> list[str]:
    failures: list[str] = []
    t, tr = hc["target"], href["target"]
    if t["tokens"] != tr["tokens"]:
        failures.append(f"HC's tokens differ from the recompute: {t['tokens']} != {tr['tokens']}")
    if len(hc["failed_receives"]) != 1 or hc["reported_block_ids"]:
        failures.append(
            f"HC: kvtier reported failed receives {hc['failed_receives']} and block ids {hc['reported_block_ids']}, "
            "expected the one request and no block id"
        )
    if hc["scheduled_tokens"] - decode_steps != prompt:
        failures.append(f"HC: vLLM prefilled {hc['scheduled_tokens'] - decode_steps} tokens, expected all {prompt}")
    specs = hc["kv_cache_groups"]["specs"]
    full = str(specs.index("FullAttentionSpec")) if "FullAttentionSpec" in specs else "?"
    before, after = hc["groups_before_target"], hc["groups_after_target"]
    failed = after.get(full, {}).get("blocks_load_failed", 0) - before.get(full, {}).get("blocks_load_failed", 0)
    if failed < 1:
        failures.append(f"HC: kvtier counted {failed} failed loads of the full-attention group {full}, expected some")
    return failures


def check(ha: dict[str, Any], hb: dict[str, Any], href: dict[str, Any], records: dict[int, int], *, block: int, prefix_blocks: int, atol: float) -> list[str]:
    failures: list[str] = []
    for name, x in (("HA", ha), ("HB", hb)):
        groups = x["kv_cache_groups"]
        if sorted(groups["specs"]) != ["FullAttentionSpec", "SlidingWindowSpec"] or groups["hybrid_allocator_disabled"]:
            failures.append(f"{name} ran KV-cache groups {groups}, expected a sliding-window and a full-attention group")
    if sorted(records) != [0, 1] or not all(records.values()):
        failures.append(f"HA left {records} records per KV-cache group in the LMDB tier, expected some of both groups")
    t, tr = hb["target"], href["target"]
    if t["tokens"] != tr["tokens"]:
        failures.append(f"HB's tokens differ from the recompute: {t['tokens']} != {tr['tokens']}")
    diffs = [abs(p - q) for p, q in zip(t["logprobs"], tr["logprobs"])]
    if not diffs or max(diffs) > atol:
        failures.append(f"HB: log-probs differ by {max(diffs, default=float('inf')):.3g} > atol {atol}")
    if tr["num_cached_tokens"] != 0:
        failures.append(f"Href had {tr['num_cached_tokens']} cached tokens, expected 0")
    cached = t["num_cached_tokens"]
    if cached != (prefix_blocks - 1) * block:
        failures.append(f"HB's num_cached_tokens is {cached}, expected {(prefix_blocks - 1) * block}")
    before, after = hb["groups_before_target"], hb["groups_after_target"]
    loaded = {g: after[g].get("blocks_loaded", 0) - before.get(g, {}).get("blocks_loaded", 0) for g in after}
    failed = sum(after[g].get("blocks_load_failed", 0) for g in after)
    specs = hb["kv_cache_groups"]["specs"]
    full = str(specs.index("FullAttentionSpec")) if "FullAttentionSpec" in specs else "?"
    window = str(specs.index("SlidingWindowSpec")) if "SlidingWindowSpec" in specs else "?"
    if loaded.get(full) != cached // block or not 1 <= loaded.get(window, 0) <= SLIDING_WINDOW // block + 1 or failed:
        failures.append(
            f"HB: kvtier loaded {loaded} blocks per group ({failed} failed), expected {cached // block} of the "
            f"full-attention group {full} and 1..{SLIDING_WINDOW // block + 1} of the sliding-window group {window}"
        )
    return failures


def run(
    spawn: Callable[[str, str, str, str], dict[str, Any]],
    open_lmdb: Callable[[str], Any],
    work: str,
    *,
    vocab: int,
    block: int,
    prefix_blocks: int,
    prompt: int,
    decode_steps: int,
    atol: float,
) -> tuple[list[str], dict[str, Any]]:
    """Run HA, HB, HC and Href; (failures, summary)."""
    model = os.path.join(work, "tiny-gemma3")
    make_hybrid_model(model, vocab)
    lmdb_path = os.path.join(work, "lmdb-hybrid")
    ha = spawn("HA", model, lmdb_path, work)
    records = {}
    for g in (0, 1):
        path = os.path.join(lmdb_path, f"r0-of-1-g{g}")
        records[g] = _count(open_lmdb, path) if os.path.isdir(path) else 0
    hb = spawn("HB", model, lmdb_path, work)
    full = hb["kv_cache_groups"]["specs"].index("FullAttentionSpec") if "FullAttentionSpec" in hb["kv_cache_groups"]["specs"] else 1
    damaged = damage_group(open_lmdb, os.path.join(lmdb_path, f"r0-of-1-g{full}"))
    hc = spawn("HC", model, lmdb_path, work)
    href = spawn("Href", model, lmdb_path, work)
    failures = check(ha, hb, href, records, block=block, prefix_blocks=prefix_blocks, atol=atol)
    failures += check_hc(hc, href, prompt=prompt, decode_steps=decode_steps)
    t, tr = hb["target"], href["target"]
    before, after = hb["groups_before_target"], hb["groups_after_target"]
    summary = {
        "kv_cache_groups": hb["kv_cache_groups"]["specs"],
        "sliding_window_tokens": SLIDING_WINDOW,
        "records_per_group_after_HA": records,
        "HB_num_cached_tokens": t["num_cached_tokens"],
        "HB_blocks_loaded_per_group": {
            g: after[g].get("blocks_loaded", 0) - before.get(g, {}).get("blocks_loaded", 0) for g in after
        },
        "tokens_equal": t["tokens"] == tr["tokens"],
        "max_logprob_abs_diff": max((abs(p - q) for p, q in zip(t["logprobs"], tr["logprobs"])), default=None),
        "HC": {
            "records_damaged_in_full_attention_group": damaged,
            "failed_receives_reported": hc["failed_receives"],
            "block_ids_reported": hc["reported_block_ids"],
            "vllm_tokens_prefilled": hc["scheduled_tokens"] - decode_steps,
            "tokens_equal": hc["target"]["tokens"] == tr["tokens"],
        },
    }
    return failures, summary


def _count(open_lmdb: Callable[[str], Any], path: str) -> int:
    env, blocks, _ = open_lmdb(path)
    try:
        with env.begin() as txn:
            return int(txn.stat(blocks)["entries"])
    finally:
        env.close()
