"""How kvtier scales with the number of records: prints one JSON object (and a table on stderr).

    python benchmarks/bench_scale.py [--quick] [--dir /tmp] [--sizes 10000,100000,1000000]
        [--index-sizes 10000,...,10000000] [--index-feed columns|tuples]
        [--tiers lmdb,file,redis,redis-cluster] [--png scale.png]

For each persistent tier (``lmdb``, ``file``, and ``redis`` on a private ``redis-server`` and
``redis-cluster`` on a private 3-primary Redis Cluster when ``redis-server`` is on ``PATH``) and
each record count N, the tier is filled with N small records (``--block``
bytes, 1 KiB by default, written through the tier's own batched ``write_blocks`` in big jobs, so
they are valid kvtier records), and then a fresh interpreter opens a store on it and measures:

* ``open_s`` / ``open_s_per_million``: ``KVStore.start()``, which opens the tier (LMDB's
  open-time page check included), lists its records and adopts them into the manager's index;
  ``open_cpu_s_per_million``: the CPU time of that open (every thread of the process), which
  other processes on a loaded machine do not inflate as much as they do the wall-clock time;
  ``scan_s``: a second ``scan()`` of the open tier, to tell listing from adopting (for
  ``redis`` that is the server's ``SCAN``, which the open no longer runs);
* ``rss_bytes_per_key``: the growth of the process's anonymous RSS (``RssAnon``: Python objects,
  not the mapped file) across that open, divided by N. It mixes what an open costs once
  (threads, imports, an LMDB environment, redis-py's slot map, a listing thread's malloc arena)
  with what each record costs, so at small N it is mostly the former;
* ``rss_fixed_bytes``: that growth across the open of the same tier holding only
  ``FIXED_RECORDS`` (16) records, filled and opened the same way in a fresh interpreter of the
  same run (one such open per tier and run, before its N points): what an open costs once;
* ``rss_bytes_per_key_marginal``: ``(growth at N - rss_fixed_bytes) / (N - FIXED_RECORDS)``,
  what each further record costs (the figure the 150 B goal is about once N is large; at small
  N it carries the noise of two RSS readings over few records);
* ``server_scan_s`` (``redis``, ``redis-cluster``): the CPU time the server (all primaries
  together) spent in ``SCAN`` during that open (its ``INFO commandstats``): 0 when the open read
  the tier's key log (``open_listing``: ``key log``, see ``backends/redis_keylog.py``; a
  cluster's slot logs, ``backends/redis_slotlogs.py``: ``key log`` when every primary's were
  read), else (``scan``) the part of ``open_s`` no client change can cut on one server;
* ``lookup_us`` / ``lookup_miss_us``: one single-key ``lookup`` of a random held key / of an
  absent key (4096 distinct keys, each probed once a round, best of 5 warm rounds);
  ``lookup64_us_per_key``: a 64-key batched lookup, per key. ``dict_*``: the same probes of a
  bare ``dict`` of the same N keys in the same process (the raw baseline: a hash table of N
  keys meets the CPU's cache and TLB misses too), and ``*_vs_dict`` the ratio to it: that is
  the figure that should stay flat in N;
* ``evict_us_per_block``: with the tier full, ``prepare_store`` + ``complete_store`` of 16 new
  blocks that each evict one (manager work only: the records' deletion is the tier's job);
  ``dict_evict_us_per_block``: a bare dict of the same keys dropping the same victims and taking
  the same keys, alternated batch by batch; ``evict_us_per_block_over_dict``: the difference.

``index`` does the same for the manager's index alone, up to 10^7 synthetic keys (no bytes):
``adopt_s`` of N records and the same RSS (its fixed point: an adoption of ``FIXED_RECORDS``
records into a manager made before the first reading, so close to 0), lookup and eviction
figures. The records are handed over as the tiers' opens hand them (``RecordColumns``);
``--index-feed tuples`` hands a list of ``(key, size, stamp)`` tuples instead, as runs before
that option did (their freed pools stay resident: about 22 B a key more at 10^5).

Each ``*_vs_smallest`` figure is that cost at N over the cost at the smallest N of the same run
(1.0 is flat). Every figure comes from a fresh interpreter per point, so one point's memory does
not shift the next one's RSS. The goals (issue 31): open <= 2 s per million records for ``lmdb``
and ``redis``, <= 150 bytes of RSS per key, lookups flat within 10 %, eviction flat.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BLOCK = 1024
FILL_JOB = 8192  # records per write_blocks call while filling
LOOKUP_SAMPLE = 4096
EVICT_ROUNDS = 400
EVICT_BATCH = 16
#: Records of the open that measures a tier's fixed cost (``rss_fixed_bytes``): a handful, so
#: the open takes the same paths as a full one (a key log, a table saved at close).
FIXED_RECORDS = 16
TIERS = ("lmdb", "file", "redis", "redis-cluster")
#: The tiers on private redis servers: a standalone server, and a cluster of three primaries.
REDIS_TIERS = ("redis", "redis-cluster")
#: Bytes of capacity per record: room for the record and its tier's own overhead (an LMDB leaf
#: entry and B-tree pages, a file's inode-backed block, Redis's per-key memory), so N fit.
PER_RECORD = {"lmdb": 5 * BLOCK, "file": 4 * BLOCK, "redis": 2 * BLOCK, "redis-cluster": 2 * BLOCK}


def _key(i: int) -> bytes:
    from kvtier.testing import make_key

    return make_key(i)


def _rss_anon() -> int:
    """Anonymous resident bytes of this process (Python objects; not a mapped file's pages)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _settle_memory() -> None:
    gc.collect()
    try:  # hand freed heap back, so RSS shows what is held, not what was once touched
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _per_call_us(fn: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    """The best over ``rounds`` of the microseconds one of ``calls`` calls of ``fn`` took (other
    processes on the machine only ever add time)."""
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return min(times)


def _lookup_figures(manager: Any, held: Sequence[bytes], absent: Sequence[bytes], tier: int = 0) -> dict[str, float]:
    """Lookup costs over ``held`` keys (random order) and distinct ``absent`` ones, per call or
    per key; and the same probes of a bare ``dict`` of the same keys built in the same process
    (``dict_*``, the raw baseline: what any hash index of N keys costs on this machine, its cache
    and TLB misses included), and each cost over that baseline's (``*_vs_dict``). The arms
    alternate round by round, and each figure is its best round (other processes only add time)."""
    lookup = manager.lookup
    bare = dict.fromkeys(manager.tier_keys(tier), 1)  # the same key objects, a table of its own
    get = bare.get

    def bare_lookup(keys: Sequence[bytes]) -> int:
        """The least a lookup can do: the leading run of ``keys`` the bare dict holds."""
        if len(keys) == 1:
            return 1 if get(keys[0]) else 0
        n = 0
        for key in keys:
            if not get(key):
                break
            n += 1
        return n

    singles = [[k] for k in held]
    misses = [[k] for k in absent]
    batches = [list(held[i : i + 64]) for i in range(0, len(held) - 63, 64)]
    for fn in (lookup, bare_lookup):
        assert all(fn(b) == 64 for b in batches[:4]) and fn(singles[0]) == 1 and fn(misses[0]) == 0

    def run(fn: Callable[[Sequence[bytes]], int], items: list[list[bytes]]) -> Callable[[], None]:
        def go() -> None:
            for item in items:
                fn(item)

        return go

    out: dict[str, float] = {}
    for name, items, per in (("lookup_us", singles, len(singles)), ("lookup_miss_us", misses, len(misses)),
                             ("lookup64_us_per_key", batches, 64 * len(batches))):
        ours, raw = [], []
        for _ in range(5):  # alternate the arms, so drift in the machine's load falls on both
            ours.append(_per_call_us(run(lookup, items), 1, rounds=1) / per)
            raw.append(_per_call_us(run(bare_lookup, items), 1, rounds=1) / per)
        out[name] = round(min(ours), 4)
        out[f"dict_{name}"] = round(min(raw), 4)
        out[f"{name}_vs_dict"] = round(min(ours) / min(raw), 3)
    return out


def _evict_figure(manager: Any, tier: int = 0) -> dict[str, float]:
    """Fill the tier's free room (manager only), then time stores that each evict a block."""
    counter = iter(range(10**9))

    def fresh(n: int) -> list[bytes]:
        return [b"\xee" * 20 + next(counter).to_bytes(12, "big") for _ in range(n)]

    while True:  # the tier's free room, in big batches; then it is full
        row = manager.stats()["tiers"][tier]
        room = (row["capacity_bytes"] - row["used_bytes"]) // max(1, manager.tier_spec(tier).block_reserve)
        if room <= 0:
            break
        keys = fresh(min(room, 65536))
        plan = manager.prepare_store(keys)
        assert plan is not None
        manager.complete_store(plan.keys)
    # The raw baseline: a bare dict of the same keys that drops the same victims, in the same
    # order, and takes the same new keys (what any hash index does per evicted block).
    order = manager.tier_keys(tier)
    bare = dict.fromkeys(order, 1)
    victims = iter(order[: EVICT_ROUNDS * EVICT_BATCH])
    del order
    before = manager.stats()["tiers"][tier]["evictions"]
    batches = [fresh(EVICT_BATCH) for _ in range(EVICT_ROUNDS)]
    took, raw = [], []
    for keys in batches:  # the two arms alternate batch by batch
        t = time.perf_counter()
        plan = manager.prepare_store(keys)
        assert plan is not None
        manager.complete_store(plan.keys)
        took.append(time.perf_counter() - t)
        t = time.perf_counter()
        for key, victim in zip(keys, victims):
            del bare[victim]
            bare[key] = 0
        for key in keys:
            bare[key] = 1
        raw.append(time.perf_counter() - t)
    evicted = manager.stats()["tiers"][tier]["evictions"] - before
    assert evicted == EVICT_ROUNDS * EVICT_BATCH, f"expected every stored block to evict one, got {evicted}"
    took.sort()
    raw.sort()
    # The median batch is the steady cost; the slowest is where a dict of the index grows or
    # compacts (a pause of O(N) that a batch meets about once per N stores).
    return {
        "evict_us_per_block": round(took[len(took) // 2] / EVICT_BATCH * 1e6, 3),
        "evict_mean_us_per_block": round(sum(took) / evicted * 1e6, 3),
        "evict_slowest_batch_ms": round(took[-1] * 1e3, 3),
        "dict_evict_us_per_block": round(raw[len(raw) // 2] / EVICT_BATCH * 1e6, 3),
        "evict_us_per_block_over_dict": round((took[len(took) // 2] - raw[len(raw) // 2]) / EVICT_BATCH * 1e6, 3),
    }


def _sample(n: int, k: int, seed: int = 1) -> list[int]:
    return random.Random(seed).sample(range(n), min(n, k))


# -- one tier, filled and reopened -------------------------------------------------------------
def tier_config(tier: str, root: str, n: int, url: str | None, sync_mode: str = "durable") -> dict[str, Any]:
    capacity = n * PER_RECORD[tier] + (64 << 20)
    spec: dict[str, Any] = {"backend": tier, "capacity": capacity}
    if tier in REDIS_TIERS:
        spec.update(backend="redis", url=url, prefix="scale", cluster=tier == "redis-cluster")
    else:
        spec.update(path=os.path.join(root, tier), sync_mode=sync_mode)
    return {"block_bytes": BLOCK, "tiers": [spec], "flush_on_close_s": 0}


async def _fill(config: dict[str, Any], n: int) -> float:
    """Write ``n`` records through the tier's batched write; seconds taken."""
    import torch

    from kvtier.config import StoreConfig
    from kvtier.store import KVStore

    store = await KVStore(StoreConfig.from_dict(config)).start()
    backend = store.backends[0]
    block = torch.arange(BLOCK, dtype=torch.int64).to(torch.uint8)
    t = time.perf_counter()
    try:
        for start in range(0, n, FILL_JOB):
            keys = [_key(i) for i in range(start, min(n, start + FILL_JOB))]
            sizes = await asyncio.to_thread(backend.write_blocks, keys, [block] * len(keys))
            if any(s is None for s in sizes):
                raise RuntimeError(f"fill: {sum(s is None for s in sizes)} of {len(keys)} records were not written at {start}")
    finally:
        await store.aclose()
    return time.perf_counter() - t


async def _measure_tier(config: dict[str, Any], n: int, rss_only: bool = False) -> dict[str, Any]:
    """In a fresh interpreter: open the filled tier and measure (see the module doc); with
    ``rss_only``, the open's figures alone (the fixed point: no lookups or eviction)."""
    from kvtier.config import StoreConfig
    from kvtier.store import KVStore

    store = KVStore(StoreConfig.from_dict(config))
    held = [_key(i) for i in _sample(n, LOOKUP_SAMPLE)]
    absent = [_key(n + 1 + i) for i in range(LOOKUP_SAMPLE)]
    _settle_memory()
    rss = _rss_anon()
    scan_usec = _server_scan_usec(config)
    t, cpu = time.perf_counter(), time.process_time()
    await store.start()
    open_s, open_cpu_s = time.perf_counter() - t, time.process_time() - cpu
    if scan_usec is not None:
        scan_usec = (_server_scan_usec(config) or 0) - scan_usec
    _settle_memory()
    grown = _rss_anon() - rss
    manager = store.manager
    assert manager is not None
    try:
        adopted = manager.stats()["tiers"][0]["ready"]
        if adopted != n:
            raise RuntimeError(f"the store adopted {adopted} of the {n} records written")
        t = time.perf_counter()
        listed = sum(1 for _ in store.backends[0].scan())
        scan_s = time.perf_counter() - t
        out: dict[str, Any] = {
            "records": n,
            "open_s": round(open_s, 4),
            "open_s_per_million": round(open_s / n * 1e6, 3),
            "open_cpu_s_per_million": round(open_cpu_s / n * 1e6, 3),
            "scan_s": round(scan_s, 4),
            "listed": listed,
            "rss_bytes_per_key": round(grown / n, 1),
            "rss_bytes": grown,
        }
        if rss_only:
            return out
        if scan_usec is not None:
            out["server_scan_s"] = round(scan_usec / 1e6, 4)
            logs = store.backends[0].stats()["key_log"]
            out["open_listing"] = "key log" if logs["opens"] and not logs["fallbacks"] else "scan"
        out.update(_lookup_figures(manager, held, absent))
        out.update(_evict_figure(manager))
        return out
    finally:
        await store.aclose()


def _server_scan_usec(config: dict[str, Any]) -> int | None:
    """Microseconds the redis tier's server (a cluster's primaries together) has spent in ``SCAN``
    (``None`` for other tiers)."""
    url = config["tiers"][0].get("url")
    if config["tiers"][0]["backend"] != "redis" or url is None:
        return None
    return sum(int(node.info("commandstats").get("cmdstat_scan", {}).get("usec", 0)) for node in _redis_nodes(url))


def _redis_nodes(url: str) -> list[Any]:
    """A client of each primary behind ``url`` (the server itself, or each cluster primary)."""
    import redis
    from redis.cluster import RedisCluster

    client = redis.Redis.from_url(url)
    if not client.info("cluster").get("cluster_enabled"):
        return [client]
    client.close()
    cluster = RedisCluster.from_url(url)
    return [cluster.get_redis_connection(node) for node in cluster.get_primaries()]


# -- the index alone ---------------------------------------------------------------------------
def _measure_index(n: int, rss_only: bool = False, feed: str = "columns") -> dict[str, Any]:
    """In a fresh interpreter: adopt ``n`` synthetic records into a one-tier manager (with
    ``rss_only``, the adoption's figures alone). ``feed``: the records as every persistent
    tier's open hands them over (``columns``: a :class:`RecordColumns` of the keys, oldest
    first, one size and one stamp for all), or as a list of ``(key, size, stamp)`` tuples
    (``tuples``, the general path; once freed, the tuples' pymalloc pools stay resident in
    arenas shared with live objects, about 22 B a key at 10^5, which the figure then counts)."""
    import numpy as np

    from kvtier.bulk import RecordColumns
    from kvtier.manager import TierManager, TierSpec
    from kvtier.manager.policies import LRUPolicy

    manager = TierManager(
        [TierSpec("disk", capacity_bytes=(n + n // 4 + 64) * BLOCK, block_reserve=BLOCK, policy=LRUPolicy(n), persistent=True)]
    )
    seed = os.urandom(8)
    _settle_memory()
    rss = _rss_anon()
    keys = [seed + i.to_bytes(24, "big") for i in range(n)]
    held = [keys[i] for i in _sample(n, LOOKUP_SAMPLE)]
    stamp = time.time()
    records: Any
    if feed == "tuples":
        records = [(k, BLOCK, stamp) for k in keys]
    else:
        records = RecordColumns(keys, np.broadcast_to(np.int64(BLOCK), (n,)), np.broadcast_to(np.float64(stamp), (n,)), oldest_first=True)
    del keys
    t = time.perf_counter()
    excess = manager.adopt(0, records)
    adopt_s = time.perf_counter() - t
    del records
    _settle_memory()
    grown = _rss_anon() - rss - sys.getsizeof(held)  # less the sample's list (its keys are the index's)
    assert not excess and manager.stats()["tiers"][0]["ready"] == n
    absent = [b"\xab" * 8 + os.urandom(24) for _ in range(LOOKUP_SAMPLE)]  # distinct misses, as for the tiers
    out: dict[str, Any] = {
        "records": n,
        "feed": feed,
        "adopt_s": round(adopt_s, 4),
        "adopt_s_per_million": round(adopt_s / n * 1e6, 3),
        "rss_bytes_per_key": round(grown / n, 1),
        "rss_bytes": grown,
    }
    if rss_only:
        return out
    out.update(_lookup_figures(manager, held, absent))
    out.update(_evict_figure(manager))
    return out


# -- the driver --------------------------------------------------------------------------------
def _child(args: list[str], timeout: float) -> dict[str, Any]:
    """Run this script with ``args`` in a fresh interpreter; its JSON."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_scale {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _split_rss(points: list[dict[str, Any]], fixed: dict[str, Any]) -> None:
    """Add ``rss_fixed_bytes`` (the growth across the open of ``fixed``, a tier of a handful of
    records) and ``rss_bytes_per_key_marginal`` (the rest of the growth, per further record) to
    every point measured (see the module doc)."""
    for p in points:
        if "rss_bytes" in p and "rss_bytes" in fixed and p["records"] > fixed["records"]:
            p["rss_fixed_bytes"] = fixed["rss_bytes"]
            p["rss_bytes_per_key_marginal"] = round((p["rss_bytes"] - fixed["rss_bytes"]) / (p["records"] - fixed["records"]), 1)


def _flatness(points: list[dict[str, Any]], fields: Sequence[str]) -> None:
    """Add ``<field>_vs_smallest`` to every point: its cost over the smallest N's."""
    if not points:
        return
    first = points[0]
    for p in points:
        for f in fields:
            if f in p and first.get(f):
                p[f"{f}_vs_smallest"] = round(p[f] / first[f], 3)


FLAT_FIELDS = ("lookup_us", "lookup_miss_us", "lookup64_us_per_key", "evict_us_per_block", "rss_bytes_per_key", "rss_bytes_per_key_marginal",
               "lookup_us_vs_dict", "lookup_miss_us_vs_dict", "lookup64_us_per_key_vs_dict", "evict_us_per_block_over_dict")


def run_tier(tier: str, sizes: Sequence[int], root: str, url: str | None, timeout: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The points of ``tier`` at each of ``sizes``, and its fixed point (``FIXED_RECORDS``)."""
    points = []
    fixed: dict[str, Any] = {}
    for n in (FIXED_RECORDS, *sizes):
        where = tempfile.mkdtemp(prefix=f"scale-{tier}-", dir=root)
        try:
            # LMDB fills durably (one sync per 8192-record job); the file tier would sync each
            # file, so it fills fast and is synced once: the open then finds nothing to flush.
            fill_s = asyncio.run(_fill(tier_config(tier, where, n, url, sync_mode="fast" if tier == "file" else "durable"), n))
            if tier == "file":
                os.sync()
            config = tier_config(tier, where, n, url)
            if not fixed:
                fixed = _child(["--measure-tier", json.dumps(config), str(n), "--rss-only"], timeout)
                print(f"bench_scale: {tier} fixed point N={n}: {fixed}", file=sys.stderr, flush=True)
                continue
            point = _child(["--measure-tier", json.dumps(config), str(n)], timeout)
            point["fill_s"] = round(fill_s, 2)
            points.append(point)
            print(f"bench_scale: {tier} N={n}: {point}", file=sys.stderr, flush=True)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"bench_scale: {tier} N={n}: stopped: {exc}", file=sys.stderr, flush=True)
            points.append({"records": n, "error": str(exc)[-500:]})
            break
        finally:
            shutil.rmtree(where, ignore_errors=True)
            if url is not None:
                _flush_redis(url)
    _split_rss(points, fixed)
    _flatness([p for p in points if "error" not in p], (*FLAT_FIELDS, "open_s_per_million", "open_cpu_s_per_million"))
    return points, fixed


def _flush_redis(url: str) -> None:
    for node in _redis_nodes(url):
        node.flushall()
        node.close()


def table(result: dict[str, Any]) -> str:
    cols = ("records", "open_s_per_million", "open_cpu_s_per_million", "adopt_s_per_million", "rss_bytes_per_key",
            "rss_fixed_bytes", "rss_bytes_per_key_marginal", "lookup_us", "lookup_us_vs_dict",
            "lookup_miss_us", "lookup_miss_us_vs_dict", "lookup64_us_per_key", "evict_us_per_block", "dict_evict_us_per_block")
    lines = ["tier     " + " ".join(f"{c[:18]:>18}" for c in cols)]
    for name, points in result["tiers"].items():
        for p in points:
            lines.append(f"{name:8} " + " ".join(f"{p.get(c, '-')!s:>18}" for c in cols))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> bool:
    """Costs against N, one line per tier (log-log); ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = (("open_s_per_million", "open (s per million records)"), ("rss_bytes_per_key", "RSS bytes per key"),
              ("lookup_us", "single-key lookup (µs)"), ("evict_us_per_block", "eviction (µs per block)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (field, title) in zip(axes, panels):
        for name, points in result["tiers"].items():
            xs = [p["records"] for p in points if field in p or (field == "open_s_per_million" and "adopt_s_per_million" in p)]
            ys = [p.get(field, p.get("adopt_s_per_million")) for p in points if xs and p["records"] in xs]
            if xs:
                ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("records")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _sizes(text: str, option: str) -> list[int]:
    """The record counts ``--sizes`` or ``--index-sizes`` names (``none``: no point)."""
    if text.strip().lower() == "none":
        return []
    try:
        sizes = [int(float(s)) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{option}: {text!r} is not a list of record counts (such as 10000,1e5; or none)") from None
    if any(n < 1 for n in sizes):
        raise ValueError(f"{option}: record counts are at least 1, got {text!r} (for no point of this kind: none)")
    return sizes


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^3 and 10^4 records (index: up to 10^5)")
    ap.add_argument("--dir", default=None, help="where the lmdb and file tiers are filled (default: a temporary folder)")
    ap.add_argument("--sizes", default=None, help="record counts per tier (default 10^4,10^5,10^6; none: no tier point)")
    ap.add_argument("--index-sizes", default=None, help="record counts for the index alone (default 10^4 .. 10^7; none: skip it)")
    ap.add_argument("--tiers", default=",".join(TIERS), help="tiers to fill: lmdb,file,redis,redis-cluster")
    ap.add_argument("--png", default=None, help="also draw the curves into this PNG (needs matplotlib)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one point may take")
    ap.add_argument("--measure-tier", nargs=2, metavar=("CONFIG", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--measure-index", type=int, metavar="N", help=argparse.SUPPRESS)
    ap.add_argument("--index-feed", choices=("columns", "tuples"), default="columns",
                    help="how the index alone is handed its records: as the tiers' opens do (columns, the default) "
                         "or as (key, size, stamp) tuples (the general path; the figures before this option)")
    ap.add_argument("--rss-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure_tier:
        print(json.dumps(asyncio.run(_measure_tier(json.loads(args.measure_tier[0]), int(args.measure_tier[1]), args.rss_only))))
        return {}
    if args.measure_index:
        print(json.dumps(_measure_index(args.measure_index, args.rss_only, args.index_feed)))
        return {}
    try:
        sizes = _sizes(args.sizes, "--sizes") if args.sizes else ([1000, 10_000] if args.quick else [10_000, 100_000, 1_000_000])
        index_sizes = _sizes(args.index_sizes, "--index-sizes") if args.index_sizes else (
            [1000, 10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000, 10_000_000])
    except ValueError as exc:
        ap.error(str(exc))
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        ap.error(f"--tiers: unknown {unknown}; known: {list(TIERS)}")
    result: dict[str, Any] = {"quick": args.quick, "block_bytes": BLOCK, "fixed_records": FIXED_RECORDS, "tiers": {},
                              "fixed": {}, "skipped": {}}
    feed = ["--index-feed", args.index_feed]
    index_points = [_child(["--measure-index", str(n), *feed], args.timeout) for n in index_sizes]
    if index_points:
        result["fixed"]["index"] = _child(["--measure-index", str(FIXED_RECORDS), "--rss-only", *feed], args.timeout)
        _split_rss(index_points, result["fixed"]["index"])
    _flatness(index_points, (*FLAT_FIELDS, "adopt_s_per_million"))
    result["tiers"]["index"] = index_points
    print(f"bench_scale: index: {index_points}", file=sys.stderr, flush=True)
    root = tempfile.mkdtemp(prefix="kvtier-scale-", dir=args.dir)
    server: Any = None
    try:
        for tier in tiers:
            url = None
            if tier in REDIS_TIERS:
                from kvtier.tools.servers import REDIS_CLI, RedisClusterServers, RedisServer, server_version

                if server_version() is None or REDIS_CLI is None:
                    result["skipped"][tier] = "redis-server is not on PATH"
                    continue
                memory = max(1 << 30, 3 * max(sizes) * PER_RECORD[tier])
                extra = ("--maxmemory", str(memory))
                if tier == "redis":
                    server = RedisServer(Path(root) / tier, extra=extra).start()
                else:
                    server = RedisClusterServers(Path(root) / tier, extra=extra)
                    server.start()
                url = server.url
            try:
                result["tiers"][tier], result["fixed"][tier] = run_tier(tier, sizes, root, url, args.timeout) if sizes else ([], {})
            finally:
                if server is not None:
                    server.stop()
                    server = None
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    if args.png and plot(result, args.png):
        result["png"] = args.png
    print(table(result), file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
