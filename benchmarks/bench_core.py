"""Core benchmark: CPU-tier save/load bandwidth against raw copies, and manager cost per key.

Usage: ``python benchmarks/bench_core.py [--quick]``. Prints one JSON object on stdout and a
readable summary on stderr.

Bandwidth: a 32-layer paged cache of ``[blocks, 16 tokens, 2 (K/V), 8 heads, 128 dims]`` bf16
tensors (64 KiB per layer and block, 2 MiB per block). Jobs of 64 blocks are saved through
``kvtier.open(...).save`` and loaded back with ``load`` into other block ids; the same job is also
run through the transfer engine directly (no asyncio hop). The reference is the fastest raw copy
of the same bytes between the same cache and a pool, in the same run: ``index_select`` +
``index_copy_`` per tensor, or one ``copy_`` per (block, layer) slice. Each figure is the best of
several repetitions.

Manager: a one-tier ``TierManager`` holding 1M keys; batches of 32 keys for ``lookup``,
``prepare_store`` + ``complete_store`` (into a full tier, so every store evicts) and
``prepare_load`` + ``complete_load``; single-key ``lookup((key,))`` on a hit and on a miss (the
call vLLM's connector makes per block); then two write-back tiers of 500k keys each, both full:
``evict_store`` (every store evicts, demotes, and the second tier evicts in turn) and
``promote`` (``prepare_promote`` + ``complete_store`` of second-tier keys). The raw baseline,
run in the same process, is a plain function finding the leading run of keys in one ``dict``
of the same keys (``raw_lookup_us_per_key``, ``raw_lookup1_us``), and for stores the least a
one-tier LRU store does with one ``dict`` and one ``OrderedDict`` (``raw_store_us_per_key``);
``*_vs_raw*`` are the ratios. Manager figures are CPU time of the benchmark thread, the best of
five slices, so other processes on a shared machine disturb them less.
``--manager-only`` skips the bandwidth part. ``index_bytes_per_key`` is the memory the manager and its
policy allocate per key, measured with ``tracemalloc`` (the 32-byte key objects themselves are
the caller's and are not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import statistics
import sys
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

import kvtier
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy

LAYERS = 32
LAYER_SHAPE = (16, 2, 8, 128)  # tokens, K/V, heads, dims


def keys_of(start: int, n: int) -> list[bytes]:
    return [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(start, start + n)]


def best_of(reps: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# -- bandwidth ------------------------------------------------------------------------------
def raw_copies(caches: list[torch.Tensor], job: int, reps: int) -> dict[str, float]:
    """GB/s of raw gathers of ``job`` blocks from ``caches`` into a pool of records."""
    per_layer = caches[0][0].numel() * caches[0].element_size()
    block_bytes = per_layer * len(caches)
    pool = torch.empty((job, block_bytes), dtype=torch.uint8)
    ids = list(range(1, 2 * job, 2))[:job]  # every other block: a realistic scattered job
    nbytes = job * block_bytes
    words = [c.view(torch.uint8).view(c.shape[0], -1).view(torch.int64) for c in caches]
    pool_words = pool.view(torch.int64).view(job, len(caches), -1)
    idx = torch.tensor(ids)
    rows = torch.arange(job)

    def index() -> None:
        for layer, src in enumerate(words):
            pool_words[:, layer].index_copy_(0, rows, src.index_select(0, idx))

    pool_bytes = pool.view(job, len(caches), per_layer)
    src_bytes = [c.view(torch.uint8).view(c.shape[0], -1) for c in caches]

    def per_slice() -> None:
        for j, b in enumerate(ids):
            dst = pool_bytes[j]
            for layer, src in enumerate(src_bytes):
                dst[layer].copy_(src[b])

    dsts = [pool_bytes[j][layer] for j in range(job) for layer in range(len(caches))]
    srcs = [src_bytes[layer][b] for b in ids for layer in range(len(caches))]

    def foreach() -> None:
        torch._foreach_copy_(dsts, srcs)

    # A contiguous 2 MiB copy per block: the memcpy ceiling, for information only (the cache
    # keeps a block's bytes in 32 separate places, so no gather can be one memcpy).
    flat = torch.empty((job, block_bytes), dtype=torch.uint8)

    def memcpy() -> None:
        for j in range(job):
            pool[j].copy_(flat[j])

    out = {}
    for name, fn in (("index", index), ("per_slice", per_slice), ("foreach", foreach), ("memcpy", memcpy)):
        fn()
        out[name] = nbytes / best_of(reps, fn) / 1e9
    return out


async def store_bandwidth(caches: list[torch.Tensor], job: int, reps: int) -> dict[str, float]:
    per_layer = caches[0][0].numel() * caches[0].element_size()
    block_bytes = per_layer * len(caches)
    num_blocks = caches[0].shape[0]
    cfg = {"tiers": [{"backend": "cpu", "capacity": (job * 3) * block_bytes}]}
    nbytes = job * block_bytes
    src_ids = list(range(1, 2 * job, 2))[:job]
    dst_ids = [b - 1 for b in src_ids]
    assert max(src_ids) < num_blocks
    save_times, load_times = [], []
    async with kvtier.open(cfg, kv_caches=caches) as store:
        for r in range(reps + 1):
            keys = keys_of(r * job, job)
            t0 = time.perf_counter()
            saved = await store.save(keys, src_ids)
            t1 = time.perf_counter()
            loaded = await store.load(keys, dst_ids)
            t2 = time.perf_counter()
            assert saved == job and loaded == job, (saved, loaded)
            if r:  # the first round warms the pool pages and the worker threads
                save_times.append(t1 - t0)
                load_times.append(t2 - t1)
        # The transfer engine alone, without the asyncio hop or the manager.
        mgr, xfer = store.manager, store.transfers
        assert mgr is not None and xfer is not None
        eng_save, eng_load = [], []
        for r in range(reps + 1):
            keys = keys_of(10_000_000 + r * job, job)
            plan = mgr.prepare_store(keys)
            assert plan is not None
            t0 = time.perf_counter()
            (res,) = xfer.wait([xfer.submit_store(plan, src_ids)])
            t1 = time.perf_counter()
            mgr.complete_store(plan.keys, res.success, sizes=res.sizes)
            load = mgr.prepare_load(keys)
            t2 = time.perf_counter()
            (res2,) = xfer.wait([xfer.submit_load(load, dst_ids)])
            t3 = time.perf_counter()
            mgr.complete_load(keys)
            xfer.poll_finished()
            assert res.success and res2.success
            if r:
                eng_save.append(t1 - t0)
                eng_load.append(t3 - t2)
    return {
        "save": nbytes / min(save_times) / 1e9,
        "load": nbytes / min(load_times) / 1e9,
        "save_median": nbytes / statistics.median(save_times) / 1e9,
        "load_median": nbytes / statistics.median(load_times) / 1e9,
        "engine_save": nbytes / min(eng_save) / 1e9,
        "engine_load": nbytes / min(eng_load) / 1e9,
    }


# -- manager cost ---------------------------------------------------------------------------
def best_us(items: list[Any], op: Callable[[Any], Any], per: int = 1, slices: int = 5) -> float:
    """Microseconds per key of ``op(item)`` over ``items`` (``per`` keys each): the best of
    ``slices`` equal slices, in CPU time of this thread (on a shared machine, wall time counts
    the time other processes hold the core), with the garbage collector off (it would charge
    its pauses to whichever call happens to trigger them)."""
    size = max(1, len(items) // slices)
    best = float("inf")
    gc.disable()
    try:
        for start in range(0, size * slices, size):
            part = items[start : start + size]
            t0 = time.thread_time()
            for item in part:
                op(item)
            best = min(best, (time.thread_time() - t0) / (len(part) * per))
    finally:
        gc.enable()
    return best * 1e6


def fill(mgr: TierManager, keys: list[bytes], batch: int) -> None:
    for i in range(0, len(keys), batch):
        plan = mgr.prepare_store(keys[i : i + batch])
        assert plan is not None
        mgr.complete_store(plan.keys)
    mgr.take_events()


def raw_lookup(index: dict[bytes, int], keys: Any) -> int:
    """The floor for a lookup: the leading run of ``keys`` found in one plain dict."""
    get = index.get
    hits = 0
    for key in keys:
        if get(key) is None:
            break
        hits += 1
    return hits


def raw_store(index: dict[bytes, int], order: OrderedDict[bytes, None], keys: list[bytes]) -> None:
    """The floor for a store into a full LRU tier: the new keys replace as many of the oldest,
    pending first and then ready, in one plain dict and one ``OrderedDict``."""
    new = [key for key in keys if key not in index]
    for _ in new:
        victim, _ = order.popitem(last=False)
        del index[victim]
    for key in new:
        index[key] = 0
    for key in new:
        index[key] = 1
        order[key] = None


def manager_cost(capacity: int, batch: int, rounds: int) -> dict[str, float]:
    """Microseconds per key of each manager path at ``capacity`` keys, and the raw floor."""
    keys = keys_of(0, capacity)
    fresh = keys_of(capacity, rounds * batch)
    batches = [fresh[i : i + batch] for i in range(0, len(fresh), batch)]
    out = one_tier_cost(keys, batches, batch, rounds)
    gc.collect()
    out.update(chain_cost(keys, batches, batch, rounds))
    for name in ("lookup", "load", "store", "evict_store", "promote"):
        out[f"{name}_vs_raw_lookup"] = out[f"{name}_us_per_key"] / out["raw_lookup_us_per_key"]
    out["store_vs_raw_store"] = out["store_us_per_key"] / out["raw_store_us_per_key"]
    for name in ("lookup1_hit", "lookup1_miss"):
        out[f"{name}_vs_raw"] = out[f"{name}_us"] / out["raw_lookup1_us"]
    return out


def store_into(m: TierManager) -> Callable[[list[bytes]], None]:
    def store(part: list[bytes]) -> None:
        plan = m.prepare_store(part)
        assert plan is not None and (plan.drops or plan.demotions)  # every store evicts
        m.complete_store(plan.keys)

    return store


def one_tier_cost(keys: list[bytes], batches: list[list[bytes]], batch: int, rounds: int) -> dict[str, float]:
    """One full LRU tier: lookups, single-key lookups, loads, and stores that evict."""
    capacity = len(keys)
    mgr = TierManager([TierSpec("cpu", capacity, 1, LRUPolicy(capacity))])
    fill(mgr, keys, batch)
    raw_index = dict.fromkeys(keys, 1)
    step = max(1, capacity // rounds)
    lookups = [keys[i : i + batch] for i in range(0, capacity - batch, step)][:rounds]
    singles = [(k,) for k in keys[::step]][: rounds * 4]
    misses = [(k,) for k in keys_of(10 * capacity, len(singles))]
    assert mgr.lookup(singles[0]) == 1 and mgr.lookup(misses[0]) == 0
    out = {
        "raw_lookup_us_per_key": best_us(lookups, lambda part: raw_lookup(raw_index, part), batch),
        "raw_lookup1_us": best_us(singles, lambda one: raw_lookup(raw_index, one)),
        "lookup_us_per_key": best_us(lookups, mgr.lookup, batch),
        "lookup1_hit_us": best_us(singles, mgr.lookup),
        "lookup1_miss_us": best_us(misses, mgr.lookup),
        "load_us_per_key": best_us(lookups, lambda part: mgr.complete_load(mgr.prepare_load(part).keys), batch),
        "store_us_per_key": best_us(batches, store_into(mgr), batch),
    }
    raw_order = OrderedDict.fromkeys(keys)  # the raw store's own index and order (it evicts)
    out["raw_store_us_per_key"] = best_us(batches, lambda part: raw_store(raw_index, raw_order, part), batch)
    return out


def chain_cost(keys: list[bytes], batches: list[list[bytes]], batch: int, rounds: int) -> dict[str, float]:
    """Two write-back tiers, both full: every store evicts from the first, demotes its victims
    into the second, which evicts (drops) in turn; promotion brings second-tier keys back."""
    half = len(keys) // 2
    chain = TierManager([TierSpec("cpu", half, 1, LRUPolicy(half)), TierSpec("disk", half, 1, LRUPolicy(half))])
    fill(chain, keys, batch)
    evict_store = best_us(batches, store_into(chain), batch)
    lower = chain.tier_keys(1)[-min(rounds * batch, half // 2) :]  # the newest: not evicted meanwhile

    def promote(part: list[bytes]) -> None:
        plan = chain.prepare_promote(part)
        assert plan is not None and len(plan.keys) == len(part)
        chain.complete_store(plan.keys)

    promote_us = best_us([lower[i : i + batch] for i in range(0, len(lower), batch)], promote, batch)
    return {"evict_store_us_per_key": evict_store, "promote_us_per_key": promote_us}


def index_bytes_per_key(n: int, batch: int) -> float:
    keys = keys_of(0, n)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    mgr = TierManager([TierSpec("cpu", n, 1, LRUPolicy(n))])
    for i in range(0, n, batch):
        plan = mgr.prepare_store(keys[i : i + batch])
        assert plan is not None
        mgr.complete_store(plan.keys)
    mgr.take_events()  # events are transient: a consumer drains them
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(mgr) == n
    return used / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a small run (a few seconds)")
    parser.add_argument("--manager-only", action="store_true", help="only the manager figures (no bandwidth)")
    args = parser.parse_args()
    job = 16 if args.quick else 64
    reps = 2 if args.quick else 7
    capacity = 50_000 if args.quick else 1_000_000
    rounds = 1000 if args.quick else 10_000
    batch = 32

    if args.manager_only:
        cost = manager_cost(capacity, batch, rounds)
        print(json.dumps({"quick": args.quick, "manager_keys": capacity, "batch_keys": batch, **{k: round(v, 3) for k, v in cost.items()}}))
        return
    caches = [torch.randn((2 * job + 1, *LAYER_SHAPE)).to(torch.bfloat16) for _ in range(LAYERS)]
    block_bytes = sum(c[0].numel() * c.element_size() for c in caches)
    raw = raw_copies(caches, job, reps)
    ours = asyncio.run(store_bandwidth(caches, job, reps))
    del caches
    gc.collect()
    raw_best = max(raw["index"], raw["per_slice"], raw["foreach"])
    cost = manager_cost(capacity, batch, rounds)
    mem = index_bytes_per_key(min(capacity, 200_000), batch)

    result = {
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "block_bytes": block_bytes,
        "job_blocks": job,
        "cpu_save_gbps": round(ours["save"], 3),
        "cpu_load_gbps": round(ours["load"], 3),
        "cpu_save_median_gbps": round(ours["save_median"], 3),
        "cpu_load_median_gbps": round(ours["load_median"], 3),
        "engine_save_gbps": round(ours["engine_save"], 3),
        "engine_load_gbps": round(ours["engine_load"], 3),
        "raw_copy_gbps": round(raw_best, 3),
        "raw_index_gbps": round(raw["index"], 3),
        "raw_per_slice_gbps": round(raw["per_slice"], 3),
        "raw_foreach_gbps": round(raw["foreach"], 3),
        "memcpy_gbps": round(raw["memcpy"], 3),
        "cpu_save_ratio": round(ours["save"] / raw_best, 3),
        "cpu_load_ratio": round(ours["load"] / raw_best, 3),
        "manager_keys": capacity,
        "batch_keys": batch,
        **{k: round(v, 3) for k, v in cost.items()},
        "index_bytes_per_key": round(mem, 1),
    }
    print(
        f"save {result['cpu_save_gbps']} GB/s ({result['cpu_save_ratio']}x raw), "
        f"load {result['cpu_load_gbps']} GB/s ({result['cpu_load_ratio']}x raw), raw {result['raw_copy_gbps']} GB/s; "
        f"lookup {result['lookup_us_per_key']} us/key (1 key: hit {result['lookup1_hit_us']} us, miss "
        f"{result['lookup1_miss_us']} us), store {result['store_us_per_key']} us/key (chain "
        f"{result['evict_store_us_per_key']}), promote {result['promote_us_per_key']} us/key, "
        f"load {result['load_us_per_key']} us/key, index {result['index_bytes_per_key']} B/key",
        file=sys.stderr,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
