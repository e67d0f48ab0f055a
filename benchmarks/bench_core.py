"""Core benchmark: CPU-tier save/load bandwidth against raw copies, and manager cost per key.

Usage: ``python benchmarks/bench_core.py [--quick]``. Prints one JSON object on stdout and a
readable summary on stderr.

Bandwidth: a 32-layer paged cache of ``[blocks, 16 tokens, 2 (K/V), 8 heads, 128 dims]`` bf16
tensors (64 KiB per layer and block, 2 MiB per block). Jobs of 64 scattered blocks are saved
through ``kvtier.open(...).save`` and loaded back with ``load`` into other block ids; the same
job is also run through the transfer engine directly (no asyncio hop, ``engine_*``). The raw
baseline copies the same bytes between the same cache and a pool as large as the tier's (three
jobs, a third of it each round, as the tier's saves go) with torch alone:
``_foreach_copy_`` over the (block, layer) slices, ``index_select`` + ``index_copy_`` per layer
(gather into a temporary, ``save_index``), one ``index_select`` per layer straight into the pool
rows (``save_direct``; ``index_copy_`` back, ``load_direct``), and the direct copy with its
layers split over as many threads as the store's ``copy_threads`` (``*_split``, when above 1).
``raw_save_gbps`` / ``raw_load_gbps`` are the fastest of them; ``cpu_save_ratio`` /
``cpu_load_ratio`` the tier over them. Where ``kvtier.transfer._blockcopy`` is built, a small
job of the tier copies with it (non-temporal stores from 1 MiB), which can beat every torch shape:
the same native copy is then also called straight on the raw pool (``native_save`` /
``native_load``, ``raw_native_*_gbps``), kept apart from the raw shapes above, and
``cpu_*_vs_native_paired`` is the tier's paired ratio to it, what the job path costs above its
own copy. Everything runs interleaved: each of ``--rounds`` rounds
(an odd count, default 25, ``--quick`` 9) runs every copy once, in an order reversed every
round, after :data:`WARMUP_ROUNDS` uncounted warm-up rounds; figures are medians
(``*_best_gbps``: the best round). Every arm copies in the same state: the raw pool is memory of
the kind the tier's pool gets, touched before the first round as the tier's is at open
(:func:`pool_like_tiers`; untouched, its page faults fell into counted rounds), and before each
timed copy, the tier's and the engine's saves and loads included, a write over twice the
last-level cache evicts the CPU caches (:class:`ColdCaches`, ``cold_caches_bytes``;
``--warm-caches`` leaves them as the copy before left them). Without it a 4-block job (8 MiB
each way, this host's L3 holds 16 MiB) ran up to a quarter faster when the copy before it had
read the same blocks, which a raw copy after another raw copy had and the tier's never did: the
paired ratio then alternated round by round with the order (save 0.60 in one order, 0.82 in the
other) and the median of a few rounds fell on either side. ``cpu_*_ratio_paired`` is the median of
the per-round ratios against that fastest raw copy (the steadier figure where the machine's
speed drifts during a run), ``cpu_*_ratio_spread`` their minimum, quartiles and maximum over
the rounds, ``gbps_spread`` the same for the tier's, the engine's and the fastest raw copies'
GB/s, and ``cpu_steal_share`` the share of CPU time the hypervisor took
for other guests meanwhile. Other processes on the host disturb a round the same way: each
timed copy also notes how long the benchmark's thread waited on a run queue meanwhile
(``/proc/thread-self/schedstat``: runnable, another process on its CPU). ``run_queue_wait_share``
is that wait over the time of each arm, ``quiet_rounds`` counts the rounds where neither the
tier's copy nor the fastest raw copy waited more than :data:`QUIET_WAIT_SHARE` of its time, and
``cpu_*_ratio_quiet`` is the paired ratio over those rounds alone (``None`` without any): on a
shared host, the figure that measures the code rather than the neighbours. The garbage
collector's pauses land mostly in the arms that allocate Python objects (the tier's and the
engine's): ``gc_pause_share`` is their time over each arm's, ``gc_paused_rounds`` the rounds of
each arm that held one. ``--copy-threads N`` sets the store's
``copy_threads``; ``--bandwidth-only`` skips the manager part. ``--job-blocks N`` sets the job
(default 64 blocks, ``--quick`` 16); ``--inline-max-bytes N`` the store's ``inline_max_bytes``
(0: every job on the transfer threads; ``inline_jobs`` counts the jobs that ran on the caller's
thread, :mod:`kvtier.transfer.inline`).

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
import glob
import hashlib
import itertools
import json
import statistics
import sys
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from kvtier.backends.memory import advise_huge_pages

import kvtier
from kvtier.devices import one_intra_op_thread
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.tools.bench import paired, spread
from kvtier.tools.bench.host import CpuSteal
from kvtier.transfer.block_copy import native_blocks

LAYERS = 32
LAYER_SHAPE = (16, 2, 8, 128)  # tokens, K/V, heads, dims
#: a round is quiet for an arm that waited on a run queue at most this share of its time
QUIET_WAIT_SHARE = 0.02
#: uncounted rounds before the counted ones: after one, the tier's first counted save still ran
#: at 5.0-5.9 GB/s against 6.2-7.9 in the rounds after it (4 blocks)
WARMUP_ROUNDS = 2


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
def run_queue_wait() -> float:
    """Seconds this thread has waited on a run queue so far (runnable while another task ran
    on its CPU), from ``/proc/thread-self/schedstat``; 0.0 where that file is missing."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class GcPauses:
    """The seconds the garbage collector has paused this process for so far (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start


GC_PAUSES = GcPauses()
gc.callbacks.append(GC_PAUSES)


class Timed:
    """Seconds of a timed copy, the run-queue wait of its thread and the garbage collector's
    pauses meanwhile."""

    __slots__ = ("gc", "seconds", "wait")

    def __init__(self, seconds: float, wait: float, gc: float) -> None:
        self.seconds = seconds
        self.wait = wait
        self.gc = gc


def pool_like_tiers(rows: int, row_bytes: int) -> torch.Tensor:
    """A ``[rows, row_bytes]`` uint8 pool of the memory a CPU tier's pool gets
    (``backends/memory.py``): pinned where CUDA is (``pin_memory: auto``), else advised huge
    pages before the first touch, and touched whole now, as the tier fills its pool at open. A
    pool of 4 KiB pages would make the raw copy slower than the best raw shape; an untouched one
    put its page faults into the first raw copy of each region's first counted round (save
    ``_foreach_copy_`` at 1.8 GB/s against 7.7 in its other rounds, 4 blocks)."""
    pin = torch.cuda.is_available()
    pool = torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=pin)
    if not pin:
        advise_huge_pages(pool)
        pool.fill_(0)
    return pool


def last_level_cache_bytes() -> int:
    """The size of this host's largest CPU cache (sysfs), or 32 MiB where it is not found."""
    sizes = [0]
    for entry in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(entry) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) or 32 << 20


class ColdCaches:
    """Before each timed copy, of every arm alike, a write over twice the last-level cache, so
    that every copy starts with its source and destination out of the CPU caches. Without it
    each arm started in the state the arm before it left: a raw save after another raw save of
    the same blocks found up to 16 MiB of them in this host's 16 MiB L3, the tier's save after
    the tier's load of another job found none, and a 4-block job (8 MiB each way) ran 8-20 %
    faster or slower with its place in the round (``save_split`` 5.0 in forward rounds against
    6.0-6.2 in reversed ones, ``load_foreach`` 7.6-8.2 against 7.0-7.1)."""

    def __init__(self, nbytes: int | None = None) -> None:
        self.nbytes = nbytes or 2 * last_level_cache_bytes()
        self.scratch: torch.Tensor | None = None
        self.on = True

    def __call__(self) -> None:
        if not self.on:
            return
        if self.scratch is None:
            self.scratch = torch.zeros(self.nbytes, dtype=torch.uint8)
        self.scratch.add_(1)


COLD = ColdCaches()


class RawCopies:
    """Raw copies of a job of ``job`` scattered blocks between ``caches`` and a pool of
    records, done with torch alone on the calling thread (and, ``split``, over ``threads``
    threads as the tier may, each helper on one OpenMP thread): each returns its seconds.
    Gathers (``save_*``) read every other cache block into the rows of the round's pool region;
    scatters (``load_*``) write them back into the blocks in between, as the tier's save and
    load do."""

    def __init__(self, caches: list[torch.Tensor], job: int, threads: int, regions: int = 1) -> None:
        self.job = job
        per_layer = caches[0][0].numel() * caches[0].element_size()
        block_bytes = per_layer * len(caches)
        self.nbytes = job * block_bytes
        # A pool of ``regions`` jobs, one region per round in turn (:meth:`next_round`), as the
        # tier's own pool of as many jobs is: a pool this host's cache could keep whole would
        # flatter the raw copy.
        self.pool = pool_like_tiers(regions * job, block_bytes)
        self.src_ids = list(range(1, 2 * job, 2))[:job]  # every other block: a realistic scattered job
        self.dst_ids = [b - 1 for b in self.src_ids]
        self.words = [c.view(torch.uint8).view(c.shape[0], -1).view(torch.int64) for c in caches]
        self.src_idx, self.dst_idx = torch.tensor(self.src_ids), torch.tensor(self.dst_ids)
        self.rows = torch.arange(job)
        src_bytes = [c.view(torch.uint8).view(c.shape[0], -1) for c in caches]
        self.regions: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for r in range(regions):
            rows = self.pool[r * job : (r + 1) * job]
            pool_bytes = rows.view(job, len(caches), per_layer)
            pieces = [pool_bytes[j][layer] for j in range(job) for layer in range(len(caches))]
            self.regions.append((rows.view(torch.int64).view(job, len(caches), -1), pieces))
        self.round = 0
        self.pool_words, self.pieces = self.regions[0]
        self.src_slices = [src_bytes[layer][b] for b in self.src_ids for layer in range(len(caches))]
        self.dst_slices = [src_bytes[layer][b] for b in self.dst_ids for layer in range(len(caches))]
        self.threads = threads
        self.executor = ThreadPoolExecutor(max_workers=threads - 1) if threads > 1 else None
        self.layers = list(range(len(caches)))
        # kvtier's own native block copy called straight (no job path), where it is built: the
        # floor of the tier's small jobs, which copy with it.
        self.native = native_blocks(caches, [per_layer] * len(caches), [i * per_layer for i in self.layers], block_bytes)

    def next_round(self) -> None:
        """The next region of the pool: every copy of a round writes and reads the same rows."""
        self.round += 1
        self.pool_words, self.pieces = self.regions[self.round % len(self.regions)]

    def _timed(self, fn: Callable[[], Any]) -> Timed:
        COLD()
        w0, g0 = run_queue_wait(), GC_PAUSES.total
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        return Timed(t1 - t0, run_queue_wait() - w0, GC_PAUSES.total - g0)

    def _split(self, one: Callable[[int], None]) -> None:
        """``one(layer)`` for every layer, the layers dealt out in contiguous shares."""
        n = self.threads
        shares = [self.layers[i * len(self.layers) // n : (i + 1) * len(self.layers) // n] for i in range(n)]
        assert self.executor is not None
        futures = [self.executor.submit(self._alone, one, s) for s in shares[1:]]
        self._alone(one, shares[0])
        for f in futures:
            f.result()

    @classmethod
    def _alone(cls, one: Callable[[int], None], layers: list[int]) -> None:
        """A share of the split copy on one OpenMP thread, as the tier's copy threads run: a
        thread with an intra-op team of its own makes libgomp stop spinning, which slows every
        raw copy here (see kvtier.transfer.copies)."""
        with one_intra_op_thread():
            cls._each(one, layers)

    @staticmethod
    def _each(one: Callable[[int], None], layers: list[int]) -> None:
        for x in layers:
            one(x)

    def _gather_one(self, layer: int) -> None:
        torch.index_select(self.words[layer], 0, self.src_idx, out=self.pool_words[:, layer])

    def _scatter_one(self, layer: int) -> None:
        self.words[layer].index_copy_(0, self.dst_idx, self.pool_words[:, layer])

    def save_foreach(self) -> Timed:
        return self._timed(lambda: torch._foreach_copy_(self.pieces, self.src_slices))

    def save_index(self) -> Timed:  # gather into a temporary, then scatter into the rows
        def run() -> None:
            for layer, src in enumerate(self.words):
                self.pool_words[:, layer].index_copy_(0, self.rows, src.index_select(0, self.src_idx))

        return self._timed(run)

    def save_direct(self) -> Timed:  # one index_select per layer straight into the rows
        return self._timed(lambda: self._each(self._gather_one, self.layers))

    def save_split(self) -> Timed:
        return self._timed(lambda: self._split(self._gather_one))

    def load_foreach(self) -> Timed:
        return self._timed(lambda: torch._foreach_copy_(self.dst_slices, self.pieces))

    def load_direct(self) -> Timed:
        return self._timed(lambda: self._each(self._scatter_one, self.layers))

    def load_split(self) -> Timed:
        return self._timed(lambda: self._split(self._scatter_one))

    def native_copy(self) -> tuple[Timed, Timed]:
        """The job's save then load by :class:`~kvtier.transfer.block_copy.NativeBlocks` alone
        (arms ``native_save`` / ``native_load``, not among the raw shapes the ratios take)."""
        assert self.native is not None
        start = (self.round % len(self.regions)) * self.job
        rows = list(range(start, start + self.job))
        native = self.native
        saved = self._timed(lambda: native.gather(self.src_ids, self.pool, rows))
        return saved, self._timed(lambda: native.scatter(self.pool, rows, self.dst_ids))

    def variants(self) -> dict[str, Callable[[], Timed | tuple[Timed, Timed]]]:
        out: dict[str, Callable[[], Timed | tuple[Timed, Timed]]] = {
            "save_foreach": self.save_foreach,
            "save_index": self.save_index,
            "save_direct": self.save_direct,
            "load_foreach": self.load_foreach,
            "load_direct": self.load_direct,
        }
        if self.executor is not None:
            out.update(save_split=self.save_split, load_split=self.load_split)
        if self.native is not None:
            out["native"] = self.native_copy
        return out

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()


async def bandwidth(
    caches: list[torch.Tensor], job: int, reps: int, copy_threads: int | str, inline_max_bytes: int | None = None
) -> dict[str, Any]:
    """The tier's save and load of a ``job`` of scattered blocks (``kvtier.open(...)`` and the
    transfer engine alone), and the raw copies of the same bytes, interleaved: every round runs
    each of them once, in an order that reverses every round, after :data:`WARMUP_ROUNDS`
    uncounted warm-up rounds, each copy after :data:`COLD` evicted the CPU caches. Figures are
    medians over the rounds."""
    per_layer = caches[0][0].numel() * caches[0].element_size()
    block_bytes = per_layer * len(caches)
    regions = 3  # the tier holds three jobs, and each round's save goes to the slots of the oldest
    cfg: dict[str, Any] = {"tiers": [{"backend": "cpu", "capacity": (job * regions) * block_bytes}], "copy_threads": copy_threads}
    if inline_max_bytes is not None:
        cfg["inline_max_bytes"] = inline_max_bytes
    times: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}  # per arm and round, the run-queue wait of its copy
    pauses: dict[str, list[float]] = {}  # per arm and round, the garbage collector's pauses in it
    async with kvtier.open(cfg, kv_caches=caches) as store:
        assert store.layout is not None
        threads = store.layout.copies.threads
        raw = RawCopies(caches, job, threads, regions)
        mgr, xfer = store.manager, store.transfers
        assert mgr is not None and xfer is not None
        counter = itertools.count()

        async def tier_round() -> tuple[Timed, Timed]:
            keys = keys_of(next(counter) * job, job)
            COLD()
            w0, g0 = run_queue_wait(), GC_PAUSES.total
            t0 = time.perf_counter()
            saved = await store.save(keys, raw.src_ids)
            t1 = time.perf_counter()
            w1, g1 = run_queue_wait(), GC_PAUSES.total
            COLD()
            w2, g2 = run_queue_wait(), GC_PAUSES.total
            t2 = time.perf_counter()
            loaded = await store.load(keys, raw.dst_ids)
            t3 = time.perf_counter()
            w3, g3 = run_queue_wait(), GC_PAUSES.total
            assert saved == job and loaded == job, (saved, loaded)
            return Timed(t1 - t0, w1 - w0, g1 - g0), Timed(t3 - t2, w3 - w2, g3 - g2)

        def engine_round() -> tuple[Timed, Timed]:  # the transfer engine alone: no asyncio hop, no manager
            keys = keys_of(next(counter) * job, job)
            plan = mgr.prepare_store(keys)
            assert plan is not None
            COLD()
            w0, g0 = run_queue_wait(), GC_PAUSES.total
            t0 = time.perf_counter()
            (res,) = xfer.wait([xfer.submit_store(plan, raw.src_ids, inline=True)])
            t1 = time.perf_counter()
            w1, g1 = run_queue_wait(), GC_PAUSES.total
            mgr.complete_store(plan.keys, res.success, sizes=res.sizes)
            load = mgr.prepare_load(keys)
            COLD()
            w2, g2 = run_queue_wait(), GC_PAUSES.total
            t2 = time.perf_counter()
            (res2,) = xfer.wait([xfer.submit_load(load, raw.dst_ids, inline=True)])
            t3 = time.perf_counter()
            w3, g3 = run_queue_wait(), GC_PAUSES.total
            mgr.complete_load(keys)
            xfer.poll_finished()
            assert res.success and res2.success
            return Timed(t1 - t0, w1 - w0, g1 - g0), Timed(t3 - t2, w3 - w2, g3 - g2)

        steps: list[tuple[str, Callable[[], Any]]] = [("tier", tier_round), ("engine", engine_round), *raw.variants().items()]
        for r in range(-WARMUP_ROUNDS, reps):
            raw.next_round()
            for name, fn in steps[::-1] if r % 2 else steps:
                got = fn()
                if asyncio.iscoroutine(got):
                    got = await got
                if r < 0:
                    continue  # warm-up rounds: the threads, the pace, the allocator
                for arm, timed in zip((f"{name}_save", f"{name}_load"), got) if isinstance(got, tuple) else ((name, got),):
                    times.setdefault(arm, []).append(timed.seconds)
                    waits.setdefault(arm, []).append(timed.wait)
                    pauses.setdefault(arm, []).append(timed.gc)
        inline_jobs = xfer.counters["inline_jobs"]
        raw.close()
    gbps = {name: raw.nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}
    best = {name: raw.nbytes / min(ts) / 1e9 for name, ts in times.items()}
    return {"threads": threads, "median": gbps, "best": best, "times": times, "waits": waits, "pauses": pauses, "inline_jobs": inline_jobs}


def paired_ratios(times: dict[str, list[float]], side: str, raw: str) -> list[float]:
    """Per round, ``raw``'s seconds over ``side``'s in the same round: drift across a run (this
    VM's memory bandwidth swings by a third from one minute to the next) hits both terms of
    each ratio alike, where a ratio of two medians mixes rounds."""
    return paired(times[raw], times[side])


def paired_ratio(times: dict[str, list[float]], side: str, raw: str) -> float:
    """The median of :func:`paired_ratios`."""
    return statistics.median(paired_ratios(times, side, raw))


def quiet(times: list[float], waits: list[float]) -> list[bool]:
    """Per round, whether the arm's copy waited on a run queue at most :data:`QUIET_WAIT_SHARE`
    of its time."""
    return [w <= QUIET_WAIT_SHARE * t for t, w in zip(times, waits)]


def quiet_ratio(bw: dict[str, Any], side: str, raw: str) -> tuple[float | None, int]:
    """The median paired ratio of ``side`` to ``raw`` over the rounds quiet for both, and how
    many rounds that is."""
    times, waits = bw["times"], bw["waits"]
    both = [a and b for a, b in zip(quiet(times[side], waits[side]), quiet(times[raw], waits[raw]))]
    ratios = [x for x, ok in zip(paired_ratios(times, side, raw), both) if ok]
    return (round(statistics.median(ratios), 3) if ratios else None), len(ratios)


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
    parser.add_argument("--bandwidth-only", action="store_true", help="only the bandwidth figures (no manager)")
    parser.add_argument("--copy-threads", default="auto", help="the store's copy_threads (default auto); the raw split copy uses as many")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved bandwidth rounds, an odd count (default 25, --quick 9)")
    parser.add_argument(
        "--warm-caches", action="store_true", help="no cache eviction before each timed copy (each starts as the one before left the caches)"
    )
    parser.add_argument("--job-blocks", type=int, default=None, help="blocks per job (default 64, --quick 16)")
    parser.add_argument(
        "--inline-max-bytes", type=int, default=None, help="the store's inline_max_bytes (default: the store's default; 0: never inline)"
    )
    args = parser.parse_args()
    job = args.job_blocks or (16 if args.quick else 64)
    reps = args.rounds if args.rounds is not None else (9 if args.quick else 25)
    if reps < 1 or reps % 2 == 0:
        parser.error(f"--rounds: expected an odd count of rounds (a median of its own rounds, and one more in one order than the other), got {reps}")
    COLD.on = not args.warm_caches
    capacity = 50_000 if args.quick else 1_000_000
    rounds = 1000 if args.quick else 10_000
    batch = 32

    if args.manager_only:
        cost = manager_cost(capacity, batch, rounds)
        print(json.dumps({"quick": args.quick, "manager_keys": capacity, "batch_keys": batch, **{k: round(v, 3) for k, v in cost.items()}}))
        return
    caches = [torch.randn((2 * job + 1, *LAYER_SHAPE)).to(torch.bfloat16) for _ in range(LAYERS)]
    block_bytes = sum(c[0].numel() * c.element_size() for c in caches)
    threads = args.copy_threads if args.copy_threads == "auto" else int(args.copy_threads)
    with CpuSteal() as steal:
        bw = asyncio.run(bandwidth(caches, job, reps, threads, args.inline_max_bytes))
    bw_bytes = job * block_bytes
    del caches
    gc.collect()
    med = bw["median"]
    raw_save_name = max((k for k in med if k.startswith("save_")), key=med.__getitem__)
    raw_load_name = max((k for k in med if k.startswith("load_")), key=med.__getitem__)
    raw_save, raw_load = med[raw_save_name], med[raw_load_name]
    quiet_save = quiet_ratio(bw, "tier_save", raw_save_name)
    quiet_load = quiet_ratio(bw, "tier_load", raw_load_name)
    mem: float | None
    if args.bandwidth_only:
        cost = {}
        mem = None
    else:
        cost = manager_cost(capacity, batch, rounds)
        mem = index_bytes_per_key(min(capacity, 200_000), batch)

    result = {
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "copy_threads": bw["threads"],
        "block_bytes": block_bytes,
        "job_blocks": job,
        "rounds": reps,
        "warmup_rounds": WARMUP_ROUNDS,
        "cold_caches_bytes": COLD.nbytes if COLD.on else 0,
        "cpu_save_gbps": round(med["tier_save"], 3),
        "cpu_load_gbps": round(med["tier_load"], 3),
        "cpu_save_best_gbps": round(bw["best"]["tier_save"], 3),
        "cpu_load_best_gbps": round(bw["best"]["tier_load"], 3),
        "engine_save_gbps": round(med["engine_save"], 3),
        "engine_load_gbps": round(med["engine_load"], 3),
        "raw_save_gbps": round(raw_save, 3),
        "raw_load_gbps": round(raw_load, 3),
        **{f"raw_{k}_gbps": round(v, 3) for k, v in med.items() if k.startswith(("save_", "load_"))},
        "cpu_save_ratio": round(med["tier_save"] / raw_save, 3),
        "cpu_load_ratio": round(med["tier_load"] / raw_load, 3),
        "cpu_save_ratio_paired": round(paired_ratio(bw["times"], "tier_save", raw_save_name), 3),
        "cpu_load_ratio_paired": round(paired_ratio(bw["times"], "tier_load", raw_load_name), 3),
        "cpu_save_ratio_quiet": quiet_save[0],
        "cpu_load_ratio_quiet": quiet_load[0],
        "quiet_rounds": {"save": quiet_save[1], "load": quiet_load[1]},
        "run_queue_wait_share": {
            name: round(sum(bw["waits"][name]) / sum(ts), 4)
            for name, ts in bw["times"].items()
            if name.startswith(("tier_", "engine_")) or name in (raw_save_name, raw_load_name)
        },
        "gc_pause_share": {
            name: round(sum(bw["pauses"][name]) / sum(ts), 4)
            for name, ts in bw["times"].items()
            if name.startswith(("tier_", "engine_")) or name in (raw_save_name, raw_load_name)
        },
        "gc_paused_rounds": {
            name: sum(1 for p in bw["pauses"][name] if p > 0)
            for name in bw["times"]
            if name.startswith(("tier_", "engine_")) or name in (raw_save_name, raw_load_name)
        },
        "cpu_save_ratio_spread": spread(paired_ratios(bw["times"], "tier_save", raw_save_name)),
        "cpu_load_ratio_spread": spread(paired_ratios(bw["times"], "tier_load", raw_load_name)),
        "gbps_spread": {
            name: spread([bw_bytes / t / 1e9 for t in ts])
            for name, ts in bw["times"].items()
            if name.startswith(("tier_", "engine_")) or name in (raw_save_name, raw_load_name)
        },
        "inline_jobs": bw["inline_jobs"],
        "cpu_steal_share": steal.share,
        # kvtier's native block copy called straight: what the job path costs above its own copy
        # (None where the extension is not built).
        "raw_native_save_gbps": round(med["native_save"], 3) if "native_save" in med else None,
        "raw_native_load_gbps": round(med["native_load"], 3) if "native_load" in med else None,
        "cpu_save_vs_native_paired": round(paired_ratio(bw["times"], "tier_save", "native_save"), 3) if "native_save" in med else None,
        "cpu_load_vs_native_paired": round(paired_ratio(bw["times"], "tier_load", "native_load"), 3) if "native_load" in med else None,
        "cpu_save_vs_foreach": round(med["tier_save"] / med["save_foreach"], 3),
        "cpu_load_vs_foreach": round(med["tier_load"] / med["load_foreach"], 3),
        "manager_keys": capacity,
        "batch_keys": batch,
        **{k: round(v, 3) for k, v in cost.items()},
        "index_bytes_per_key": None if mem is None else round(mem, 1),
    }
    def raw_range(name: str) -> str:
        g = result["gbps_spread"][name]
        return f"{g['min']}-{g['max']}"

    summary = (
        f"save {result['cpu_save_gbps']} GB/s ({result['cpu_save_ratio']}x raw), "
        f"load {result['cpu_load_gbps']} GB/s ({result['cpu_load_ratio']}x raw), "
        f"raw {result['raw_save_gbps']} / {result['raw_load_gbps']} GB/s (rounds {raw_range(raw_save_name)} / "
        f"{raw_range(raw_load_name)}), {bw['threads']} copy threads; "
        f"quiet rounds {quiet_save[1]} / {quiet_load[1]} of {reps}: save {quiet_save[0]}x, load {quiet_load[0]}x"
    )
    if cost:
        summary += (
            f"; lookup {result['lookup_us_per_key']} us/key (1 key: hit {result['lookup1_hit_us']} us, miss "
            f"{result['lookup1_miss_us']} us), store {result['store_us_per_key']} us/key (chain "
            f"{result['evict_store_us_per_key']}), promote {result['promote_us_per_key']} us/key, "
            f"load {result['load_us_per_key']} us/key, index {result['index_bytes_per_key']} B/key"
        )
    print(summary, file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
