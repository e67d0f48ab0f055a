"""kvtier's TierManager against vLLM's ``CPUOffloadingManager``, phase by phase, in one process.

Needs vLLM importable (a venv with ``vllm`` installed ``--no-deps`` is enough: only its
``kv_offload`` manager is used). Run it with that venv's python and kvtier on the path::

    PYTHONPATH=. $PEER_VENV/bin/python benchmarks/bench_vllm_manager.py

Each phase is run on both managers in alternating slices (vLLM slice, kvtier slice, ...), so
both see the same moment of a shared machine, and is timed in CPU time of this thread with the
garbage collector off. Per phase it prints the best slice of each side in microseconds per key
and the speedup vLLM / kvtier (above 1: kvtier is faster) of each rep (a fresh pair of managers
and keys): ``speedup_range`` and ``speedup_spread`` ([min, median, max] of the reps' speedups,
each the best vLLM slice over the best kvtier slice of its rep), and ``slice_speedup_spread``,
[min, median, max] of vLLM / kvtier over every pair of adjacent slices of every rep. A run
that dips is mostly a rep whose slices all read slower (docs/architecture.md, "Against vLLM,
run after run"): compare the medians. Phases, with the same keys and
sizes for both: ``store`` (``prepare_store`` + ``complete_store`` of new keys, not full; vLLM's
``on_request_finished`` of those requests is timed apart as ``vllm_finish``), ``lookup_hit`` and
``lookup_miss`` (one key per call, as vLLM's scheduler asks), ``load`` (``prepare_load`` +
``complete_load``), ``touch``, ``store_evict`` (the cache is full: every call evicts).

The lookups are timed as a scheduler makes them: vLLM's ``lookup(key, req_context)`` called
directly, kvtier's ``lookup_key(key)`` (its call for one key as it is; ``lookup((key,))``, with
the one-key tuple built in the timed loop as the caller must, is timed too: ``tuple_form``). A
scheduler asks for the keys of a request it has just keyed: fresh objects, recently made, equal
to a stored key but not the same object, their hash not yet computed, so each side's slice runs
on fresh copies of its keys made just before it. Also timed: the floor of any single-key lookup
written in Python (a function that probes one dict, no check, no counter; ``floor``), and that
floor with what the manager's contract adds to it (a hit or miss counter, and on a miss the
key's type and length check, so that a malformed key is an error, not a miss;
``checked_floor``). kvtier's call, the tuple form and the two floors are each timed in a pass of
their own, alternating with vLLM, on keys no other pass probes, all on the manager's one index:
a side that follows another on the same keys finds the stored ones in the cache (30-40%
faster), and a dict built apart can run 20-30% faster or slower for where it lies. Each prints
its speedup over the vLLM of its own pass (``<name>_speedup_range``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

try:
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
except ImportError as exc:  # a clear word, not a traceback, where vLLM is not installed
    raise SystemExit(f"bench_vllm_manager: needs vLLM's kv_offload manager importable ({exc})") from None

from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy

PHASES = ("store", "lookup_hit", "lookup_miss", "load", "touch", "store_evict")
LOOKUP_SIDES = 4  # kvtier's lookup_key, its lookup((key,)), and the two floors


def make_keys(n: int) -> list[bytes]:
    """32-byte keys in vLLM's layout (28 hash bytes + a 4-byte group index); kvtier takes
    them as they are. Fresh objects per side: CPython caches a bytes object's hash."""
    raw = os.urandom(28 * n)
    return [make_offload_key(raw[i * 28 : (i + 1) * 28], 0) for i in range(n)]


def twin(keys: list[bytes]) -> list[bytes]:
    return [bytes(bytearray(k)) for k in keys]


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def timed(items: list[Any], op: Callable[[Any], Any]) -> float:
    t0 = time.thread_time_ns()
    for item in items:
        op(item)
    return time.thread_time_ns() - t0


def phase(
    slices: int,
    v_items: list[Any],
    k_items: list[Any],
    v_op: Callable[[Any], Any],
    k_op: Callable[[Any], Any],
    per: int,
) -> dict[str, Any]:
    """Each side's microseconds per key in every one of ``slices`` alternating slices (see
    :func:`summary`)."""
    v_us: list[float] = []
    k_us: list[float] = []
    size = max(1, len(v_items) // slices)
    for start in range(0, size * slices, size):
        v_us.append(timed(v_items[start : start + size], v_op) / (size * per) / 1e3)
        k_us.append(timed(k_items[start : start + size], k_op) / (size * per) / 1e3)
    return summary(v_us, k_us)


def summary(v_us: list[float], k_us: list[float]) -> dict[str, Any]:
    """One pass's slices: the best of each side, ``speedup`` (vLLM's best / kvtier's best), and
    ``slice_speedups``, vLLM / kvtier of each pair of adjacent slices (the same moment of the
    machine for both sides)."""
    return {
        "vllm_us": min(v_us),
        "kvtier_us": min(k_us),
        "speedup": min(v_us) / min(k_us),
        "slice_speedups": [v / k for v, k in zip(v_us, k_us)],
    }


def timed_calls(keys: list[bytes], call: Callable[[bytes], Any]) -> float:
    t0 = time.thread_time_ns()
    for key in keys:
        call(key)
    return time.thread_time_ns() - t0


def timed_calls_with(keys: list[bytes], call: Callable[[bytes, Any], Any], ctx: Any) -> float:
    t0 = time.thread_time_ns()
    for key in keys:
        call(key, ctx)
    return time.thread_time_ns() - t0


def timed_tuple_calls(keys: list[bytes], call: Callable[[tuple[bytes]], Any]) -> float:
    t0 = time.thread_time_ns()
    for key in keys:
        call((key,))
    return time.thread_time_ns() - t0


def lookup_phase(
    slices: int,
    v_lookup: Callable[[bytes, Any], Any],
    ctx: Any,
    passes: list[tuple[str, Callable[[list[bytes]], float], list[bytes], list[bytes]]],
) -> dict[str, Any]:
    """:func:`phase` for single-key lookups, one pass per kvtier side: ``(name, timer, vLLM's
    keys, kvtier's keys)``, each pass alternating vLLM and that side on keys no other pass
    probes. ``kvtier`` is the manager's call; the others are reported as ``<name>_us`` and
    ``<name>_speedup`` (over the vLLM of their own pass). Each side runs its slice on fresh
    copies of its keys made just before it (see the module's note)."""
    out: dict[str, Any] = {}
    for name, timer, v_keys, k_keys in passes:
        v_us: list[float] = []
        k_us: list[float] = []
        size = max(1, len(v_keys) // slices)
        for start in range(0, size * slices, size):
            v_us.append(timed_calls_with(twin(v_keys[start : start + size]), v_lookup, ctx) / size / 1e3)
            k_us.append(timer(twin(k_keys[start : start + size])) / size / 1e3)
        got = summary(v_us, k_us)
        if name == "kvtier":
            out.update(got)
        else:
            out.update({f"{name}_us": got["kvtier_us"], f"{name}_speedup": got["speedup"]})
    return out


def bare_lookup(index: dict[bytes, Any]) -> Callable[[bytes], Any]:
    """The floor of a single-key lookup in Python: probe one dict, nothing else (no key check,
    no counter). What any manager written in Python pays per call."""
    get = index.get

    def lookup(key: bytes) -> Any:
        return get(key)

    return lookup


def checked_lookup(index: dict[bytes, Any]) -> Callable[[bytes], bool]:
    """The floor with what the manager's contract adds: a counter of hits and of misses (the
    cheapest we know, a countdown that ``next`` steps in C), and on a miss the key's type and
    length check (a malformed key must be an error, not a miss)."""
    get = index.get
    hits, misses = itertools.repeat(None, sys.maxsize), itertools.repeat(None, sys.maxsize)

    def lookup(key: bytes) -> bool:
        if get(key):
            next(hits)
            return True
        if type(key) is not bytes or len(key) != 32:
            raise ValueError("not a key")
        next(misses)
        return False

    return lookup


def run(cap: int, ops: int, batch: int, slices: int, seed: int) -> dict[str, dict[str, Any]]:
    rng = random.Random(seed)
    if LOOKUP_SIDES * ops > cap:
        raise SystemExit(f"bench_vllm_manager: --ops {ops} needs a --capacity of at least {LOOKUP_SIDES * ops}")
    v_keys = make_keys(cap + ops + LOOKUP_SIDES * ops)
    k_keys = twin(v_keys)
    v_res, v_fresh, v_absent = v_keys[:cap], v_keys[cap : cap + ops], v_keys[cap + ops :]
    k_res, k_fresh, k_absent = k_keys[:cap], k_keys[cap : cap + ops], k_keys[cap + ops :]
    vm = CPUOffloadingManager(num_chunks=cap, cache_policy="lru")
    km = TierManager([TierSpec(name="cpu", capacity_bytes=cap, block_reserve=1, policy=LRUPolicy(cap))])
    out: dict[str, dict[str, Any]] = {}

    def v_store(item: tuple[list[bytes], ReqContext]) -> None:
        vm.prepare_store(item[0], item[1])
        vm.complete_store(item[0], item[1])

    def k_store(kb: list[bytes]) -> None:
        km.prepare_store(kb)
        km.complete_store(kb)

    v_fill = [(kb, ReqContext(req_id=f"f{i}")) for i, kb in enumerate(chunks(v_res, batch))]
    out["store"] = phase(slices, v_fill, chunks(k_res, batch), v_store, k_store, batch)
    finish = timed([c for _, c in v_fill], vm.on_request_finished) / cap / 1e3
    assert km.lookup(k_res[-1:]) == 1 and len(km) == cap

    # One pass per kvtier side (its call, the tuple form, the floors), each alternating with vLLM
    # on keys of its own, and every kvtier side on the manager's one index: a side that ran on
    # keys another had just brought into the cache, or more often than vLLM on its own, would
    # gain 30-40%, and one on a dict built apart may lose as much to where it lies.
    picks = rng.sample(range(cap), LOOKUP_SIDES * ops)
    pick = picks[:ops]
    ctx = ReqContext(req_id="lookup")
    index = km._tiers[0].index  # the floors probe the manager's own index
    floor, checked_floor = bare_lookup(index), checked_lookup(index)
    timers: dict[str, Callable[[list[bytes]], float]] = {
        "kvtier": lambda ks: timed_calls(ks, km.lookup_key),
        "tuple_form": lambda ks: timed_tuple_calls(ks, km.lookup),
        "floor": lambda ks: timed_calls(ks, floor),
        "checked_floor": lambda ks: timed_calls(ks, checked_floor),
    }
    parts = [slice(j * ops, (j + 1) * ops) for j in range(LOOKUP_SIDES)]
    hits = [
        (n, t, [v_res[i] for i in picks[p]], [k_res[i] for i in picks[p]]) for (n, t), p in zip(timers.items(), parts)
    ]
    misses = [(n, t, v_absent[p], k_absent[p]) for (n, t), p in zip(timers.items(), parts)]
    out["lookup_hit"] = lookup_phase(slices, vm.lookup, ctx, hits)
    out["lookup_miss"] = lookup_phase(slices, vm.lookup, ctx, misses)

    def v_load(item: tuple[list[bytes], ReqContext]) -> None:
        vm.prepare_load(item[0], item[1])
        vm.complete_load(item[0], item[1])

    def k_load(kb: list[bytes]) -> None:
        km.prepare_load(kb, promote=False)
        km.complete_load(kb)

    v_loads = [(kb, ReqContext(req_id=f"l{i}")) for i, kb in enumerate(chunks([v_res[i] for i in pick], batch))]
    out["load"] = phase(slices, v_loads, chunks([k_res[i] for i in pick], batch), v_load, k_load, batch)
    for _, c in v_loads:
        vm.on_request_finished(c)

    touched = rng.sample(range(cap), ops)
    out["touch"] = phase(
        slices,
        chunks([v_res[i] for i in touched], batch),
        chunks([k_res[i] for i in touched], batch),
        lambda kb: vm.touch(kb, ctx),
        km.touch,
        batch,
    )
    v_evict = [(kb, ReqContext(req_id=f"e{i}")) for i, kb in enumerate(chunks(v_fresh, batch))]
    out["store_evict"] = phase(slices, v_evict, chunks(k_fresh, batch), v_store, k_store, batch)
    assert len(km) == cap and km.lookup(k_fresh[:1]) == 1
    out["vllm_finish"] = {"vllm_us": finish}
    return out


def spread(values: list[float]) -> list[float]:
    """[min, median, max] of ``values``, rounded."""
    return [round(min(values), 2), round(statistics.median(values), 2), round(max(values), 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--capacity", type=int, default=200_000)
    parser.add_argument("--ops", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--slices", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a small run (a few seconds)")
    args = parser.parse_args()
    if args.quick:
        args.capacity, args.ops, args.reps = 20_000, 5_000, 1
    gc.disable()  # both sides alike: a collection would land on whichever call triggers it
    reps = [run(args.capacity, args.ops, args.batch, args.slices, seed) for seed in range(args.reps)]
    gc.enable()
    result: dict[str, Any] = {"capacity": args.capacity, "ops": args.ops, "batch": args.batch, "reps": args.reps}
    for name in PHASES:
        ups = [r[name]["speedup"] for r in reps]
        pairs = [u for r in reps for u in r[name]["slice_speedups"]]
        result[name] = {
            "vllm_us": round(min(r[name]["vllm_us"] for r in reps), 3),
            "kvtier_us": round(min(r[name]["kvtier_us"] for r in reps), 3),
            "speedup_range": [round(min(ups), 2), round(max(ups), 2)],
            "speedup_spread": spread(ups),
            "slice_speedup_spread": spread(pairs),
        }
        for floor in ("tuple_form", "floor", "checked_floor"):
            if f"{floor}_speedup" in reps[0][name]:
                floors = sorted(r[name][f"{floor}_speedup"] for r in reps)
                result[name][f"{floor}_speedup_range"] = [round(floors[0], 2), round(floors[-1], 2)]
    result["vllm_finish_us"] = round(min(r["vllm_finish"]["vllm_us"] for r in reps), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
