"""The ``redis`` tier against LMCache's Redis connectors, taking turns on one private redis-server.

Each round runs every kvtier side and LMCache's own harness (``lmcache_redis_bench.py``, in the
peer's Python, with ``--redis-url`` pointing at the same server), each in a fresh process, the
server flushed between them, in an order that reverses every round, after one uncounted warm-up
round (``--warmup-rounds``: a fresh server grows its memory during its first puts, which charged
whichever side ran first). kvtier moves the same cases as that harness: ``CHUNKS`` blocks of
``KIB`` KiB, every block of a case in one ``write_blocks`` / ``read_blocks`` call, as LMCache's
``batched_submit_put_task`` / ``batched_get_blocking`` take them all; every read is checked byte
for byte. Figures are medians over ``--reps`` reps after one warm-up, in GB/s (1e9 bytes).

Each side's entry also has ``steal_share``: the share of the host's CPU time the hypervisor gave to
other guests while it ran (a round with much of it measures the neighbours).

Ratios: kvtier over LMCache's best connector in the same round, per cell (put and get, each case);
LMCache's best is the highest of every connector and, for gets, every get call it offers
(``batched_get``, ``get_non_blocking``, ``get_blocking_serial``). Above 1 means kvtier is faster.

Sides: ``--kvtier NAME=PYTHONPATH`` (repeatable) runs kvtier with that directory first on
``PYTHONPATH`` (say, an exported copy of another revision, with ``kvtier/backends`` linked to its
``backends/``); the default is one side, ``kvtier``, with the code this script is installed with.

    python benchmarks/bench_redis_vs_lmcache.py --peer-python PEER/bin/python \\
        --peer-bench peerbench/lmcache_redis_bench.py [--rounds 2] [--reps 5] [--json OUT]
    python benchmarks/bench_redis_vs_lmcache.py --kvtier-side --url URL   # one kvtier side, JSON
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_CASES = "256x2048,4096x64"


def _cases(text: str) -> list[tuple[int, int]]:
    return [(int(n), int(k)) for n, k in (c.lower().split("x") for c in text.split(","))]


def kvtier_side(url: str, cases: list[tuple[int, int]], reps: int) -> dict[str, Any]:
    """kvtier's put and get of each case, median GB/s over ``reps`` after one warm-up."""
    import torch
    from kvtier.backends.redis_tier import RedisBackend

    from kvtier.backend import BlockFormat
    from kvtier.testing import make_key, random_block

    result: dict[str, Any] = {}
    for n, kib in cases:
        block = kib << 10
        fmt = BlockFormat(block_bytes=block, dtype="bfloat16", namespace_digest=hashlib.sha256(b"vs-lmcache%d" % block).digest())
        backend = RedisBackend(capacity=4 * n * (block + 64), url=url, prefix="benchpeer")
        asyncio.run(backend.open(fmt))
        data = [random_block(block, i % 8) for i in range(n)]
        out = [torch.ones(block, dtype=torch.uint8) for _ in range(n)]  # touched before timing, as LMCache's
        puts: list[float] = []
        gets: list[float] = []
        try:
            for rep in range(-1, reps):
                keys = [make_key(rep * n + i + n) for i in range(n)]
                t0 = time.perf_counter()
                sizes = backend.write_blocks(keys, data)
                t1 = time.perf_counter()
                found = backend.read_blocks(keys, out)
                t2 = time.perf_counter()
                assert all(s is not None for s in sizes), "a kvtier write failed"
                assert all(found), "a kvtier read missed"
                assert all(torch.equal(a, b) for a, b in zip(out, data)), "a kvtier read returned other bytes"
                backend.delete_blocks(keys)
                if rep >= 0:
                    puts.append(n * block / (t1 - t0) / 1e9)
                    gets.append(n * block / (t2 - t1) / 1e9)
        finally:
            asyncio.run(backend.aclose())
        result[f"{n}x{kib}"] = {"put": statistics.median(puts), "get": statistics.median(gets), "put_reps": puts, "get_reps": gets}
    return result


def _lmcache_cells(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """LMCache's best put and get per case (any connector, any get call), GB/s medians."""
    cells = {}
    for case in report["cases"]:
        med = case["GBps_median"]
        lmc = {k: v for k, v in med.items() if k.startswith("lmc_")}
        cells[f"{case['chunks']}x{case['chunk_bytes'] >> 10}"] = {
            "put": max(v for k, v in lmc.items() if k.endswith("_put")),
            "get": max(v for k, v in lmc.items() if "get" in k),
            "best_put": max((k for k in lmc if k.endswith("_put")), key=lmc.__getitem__),
            "best_get": max((k for k in lmc if "get" in k), key=lmc.__getitem__),
        }
    return cells


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvtier-side", action="store_true", help="run one kvtier side against --url and print its JSON")
    parser.add_argument("--url", help="the server (default: a private one started here)")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="CHUNKSxKIB[,...], as the LMCache harness takes them")
    parser.add_argument("--reps", type=int, default=5, help="timed reps per side and round (default 5, as the LMCache harness)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="uncounted rounds first (default 1)")
    parser.add_argument("--kvtier", action="append", default=[], metavar="NAME=PYTHONPATH", help="a kvtier side (repeatable)")
    parser.add_argument("--peer-python", help="the Python that has LMCache installed")
    parser.add_argument("--peer-bench", help="the LMCache harness, lmcache_redis_bench.py")
    parser.add_argument("--lmcache", default="resp", help="LMCache connectors to drive (resp, redis or both)")
    parser.add_argument("--lookups", type=int, default=200, help="passed to the harness (its lookup phase is not compared)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    cases = _cases(args.cases)
    if args.kvtier_side:
        if not args.url:
            parser.error("--kvtier-side needs --url")
        print(json.dumps(kvtier_side(args.url, cases, args.reps)))
        return
    if not args.peer_python or not args.peer_bench:
        parser.error("--peer-python and --peer-bench are required (the LMCache side)")
    sides = [s.split("=", 1) for s in args.kvtier] or [["kvtier", ""]]
    started = None
    import redis

    from kvtier.tools.bench.host import CpuSteal
    from kvtier.tools.servers import RedisServer

    url = args.url
    if url is None:
        started = RedisServer(Path(tempfile.mkdtemp(prefix="kvtier-vs-lmcache-")) / "server", extra=("--maxmemory", "4gb")).start()
        url = started.url
    client = redis.Redis.from_url(url)
    rounds: list[dict[str, Any]] = []

    def run_kvtier(name: str, path: str) -> tuple[dict[str, Any], float]:
        env = dict(os.environ)
        if path:
            env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
        with CpuSteal() as steal:
            out = subprocess.run(
                [sys.executable, __file__, "--kvtier-side", "--url", url, "--cases", args.cases, "--reps", str(args.reps)],
                env=env, check=True, capture_output=True, text=True,
            ).stdout
        return json.loads(out.strip().splitlines()[-1]), steal.share

    def run_lmcache() -> tuple[dict[str, Any], float]:
        with tempfile.TemporaryDirectory() as tmp:
            report_path = Path(tmp) / "lmcache.json"
            with CpuSteal() as steal:
                peer = subprocess.run(
                    [args.peer_python, "-W", "ignore", args.peer_bench, "--redis-url", url, "--reps", str(args.reps),
                     "--cases", args.cases, "--lmcache", args.lmcache, "--lookups", str(args.lookups), "--json", str(report_path)],
                    check=False, capture_output=True, text=True,
                )
            if peer.returncode:  # its raw redis.asyncio baseline times out on a badly overloaded host, say
                raise SystemExit(f"the LMCache harness failed (exit {peer.returncode}):\n{peer.stderr[-3000:]}")
            return _lmcache_cells(json.loads(report_path.read_text())), steal.share

    runners = [(name, lambda name=name, path=path: run_kvtier(name, path)) for name, path in sides]
    runners.append(("lmcache", run_lmcache))
    try:
        # Round 0 warms the server up and is not counted: a fresh redis-server grows its memory
        # during the first puts it takes (kvtier's first 2 MiB puts ran at 1.1-1.2 GB/s there,
        # 1.8-1.9 later), which charged whichever side ran first. The order reverses every round.
        for r in range(args.warmup_rounds + args.rounds):
            counted = r >= args.warmup_rounds
            entry: dict[str, Any] = {"round": r - args.warmup_rounds + 1}
            for name, run in runners if r % 2 == 0 else runners[::-1]:
                client.flushall()
                load = _load()
                cells, steal_share = run()
                entry[name] = {"load_before": load, "load_after": _load(), "steal_share": steal_share, "cells": cells}
                tag = f"round {entry['round']}" if counted else "warm-up"
                print(f"{tag} {name}: {json.dumps(cells)} (load {load}, steal {steal_share})", file=sys.stderr)
            if counted:
                rounds.append(entry)
    finally:
        client.close()
        if started is not None:
            started.stop()
    ratios: dict[str, Any] = {}
    for name, _ in sides:
        per: dict[str, list[float]] = {}
        for entry in rounds:
            for case, cell in entry[name]["cells"].items():
                peer = entry["lmcache"]["cells"][case]
                for op in ("put", "get"):
                    per.setdefault(f"{op}_{case}", []).append(round(cell[op] / peer[op], 3))
        ratios[name] = {cell: {"rounds": v, "min": min(v)} for cell, v in per.items()}
    print(json.dumps({"url": url, "cases": args.cases, "reps": args.reps, "lmcache_connectors": args.lmcache, "ratios": ratios, "rounds": rounds}))
    if args.json:
        Path(args.json).write_text(json.dumps({"ratios": ratios, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
