"""Where a Redis put or get spends the server's time: kvtier and LMCache's ``resp://`` connector
on one private redis-server, each move accounted on both ends.

Each side runs in a fresh process (kvtier in this Python, LMCache in ``--peer-python``, built
with its own harness's ``LMC`` class from ``--peer-bench``, so its connector is set up exactly
as there) and moves the same cases as ``bench_redis_vs_lmcache.py``: ``CHUNKS`` blocks of
``KIB`` KiB in one batched call. Every timed put starts on a just-flushed server, and every
get reads what the put before it stored; every get is checked byte for byte. Around each call
the side reads the server's CPU time (user and system) and minor page faults from
``/proc/PID/stat``, and its own CPU time. Per cell it reports the median over ``--reps`` after one
warm-up:

* ``gbps``: bytes over wall time;
* ``server_busy``: server CPU over wall time (1.0: the server never waited for the client);
* ``server_s_per_gb`` (split into ``server_sys_s_per_gb``) and ``server_faults_per_mib``: the
  server's work per byte moved, which the client's request shape could change;
* ``server_bound_gbps``: bytes over server CPU time, the most this server can take or give
  whatever the client does (``server_busy`` is also ``gbps`` over it);
* ``client_s_per_gb``: the side's own CPU per byte.

Rounds alternate kvtier and LMCache (the order reversed every round), after one uncounted
warm-up round (``--warmup-rounds``); ``ratios`` are kvtier
over LMCache per cell and round, and each round's ``steal_share`` the share of the host's CPU
time the hypervisor gave to other guests while each side ran.

    python benchmarks/bench_redis_server.py --peer-python PEER/bin/python \\
        --peer-bench peerbench/lmcache_redis_bench.py [--rounds 2] [--reps 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_CASES = "256x2048,4096x64"
_TICK = os.sysconf("SC_CLK_TCK")


def _cases(text: str) -> list[tuple[int, int]]:
    return [(int(n), int(k)) for n, k in (c.lower().split("x") for c in text.split(","))]


def _server(pid: int) -> tuple[float, float, int]:
    """The server's user and system CPU seconds and minor faults so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK, int(fields[7])


def _own() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def accounted(pid: int, nbytes: int, call: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """``call()``'s result and its accounts on both ends."""
    s0, c0, t0 = _server(pid), _own(), time.perf_counter()
    got = call()
    t1, c1, s1 = time.perf_counter(), _own(), _server(pid)
    wall = t1 - t0
    user, system, faults = s1[0] - s0[0], s1[1] - s0[1], s1[2] - s0[2]
    gb = nbytes / 1e9
    server = max(user + system, 1 / _TICK)  # one tick: the resolution of /proc
    return got, {
        "gbps": gb / wall,
        "server_busy": server / wall,
        "server_s_per_gb": server / gb,
        "server_sys_s_per_gb": system / gb,
        "server_faults_per_mib": faults / (nbytes / 2**20),
        "server_bound_gbps": gb / server,
        "client_s_per_gb": (c1 - c0) / gb,
    }


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}


def kvtier_side(url: str, pid: int, cases: list[tuple[int, int]], reps: int) -> dict[str, Any]:
    import asyncio
    import hashlib

    import redis
    import torch
    from kvtier.backends.redis_tier import RedisBackend

    from kvtier.backend import BlockFormat
    from kvtier.testing import make_key, random_block

    client = redis.Redis.from_url(url)
    result: dict[str, Any] = {}
    for n, kib in cases:
        block = kib << 10
        fmt = BlockFormat(
            block_bytes=block, dtype="bfloat16", namespace_digest=hashlib.sha256(b"server%d" % block).digest()
        )
        backend = RedisBackend(capacity=4 * n * (block + 64), url=url, prefix="benchserver")
        asyncio.run(backend.open(fmt))
        data = [random_block(block, i % 8) for i in range(n)]
        out = [torch.ones(block, dtype=torch.uint8) for _ in range(n)]
        puts, gets = [], []
        try:
            for rep in range(-1, reps):
                keys = [make_key(rep * n + i + n) for i in range(n)]
                client.flushall()
                sizes, put = accounted(pid, n * block, functools.partial(backend.write_blocks, keys, data))
                found, get = accounted(pid, n * block, functools.partial(backend.read_blocks, keys, out))
                assert all(s is not None for s in sizes), "a kvtier write failed"
                assert all(found) and all(torch.equal(a, b) for a, b in zip(out, data)), (
                    "a kvtier read returned other bytes"
                )
                if rep >= 0:
                    puts.append(put)
                    gets.append(get)
        finally:
            asyncio.run(backend.aclose())
        result[f"{n}x{kib}"] = {"put": _median(puts), "get": _median(gets)}
    client.flushall()
    return result


def _non_blocking_get(lmc: Any, keys: Any) -> Any:
    import asyncio

    return asyncio.run_coroutine_threadsafe(lmc.rb.batched_get_non_blocking("peerbench", keys), lmc.loop).result(300)


def lmcache_side(url: str, pid: int, cases: list[tuple[int, int]], reps: int, harness: str) -> dict[str, Any]:
    import numpy as np
    import redis

    sys.path.insert(0, str(Path(harness).resolve().parent))
    import lmcache_redis_bench as h  # type: ignore[import-not-found]

    client = redis.Redis.from_url(url)
    host = url.split("://", 1)[1].split("/", 1)[0]
    result: dict[str, Any] = {}
    for n, kib in cases:
        cb = kib << 10
        src = np.random.default_rng(kib).integers(0, 256, size=n * cb, dtype=np.uint8)
        lmc = h.LMC(f"resp://{host}", n, cb)
        rng = np.random.default_rng(n)
        puts, gets = [], []
        for rep in range(-1, reps):
            keys = lmc.keys(rng.integers(1, 2**63, size=n))
            objs = lmc.alloc_filled(src, n, cb)
            client.flushall()
            _, put = accounted(pid, n * cb, functools.partial(lmc.put, keys, objs))
            lmc.release(objs)
            assert client.dbsize() == n, "an LMCache put did not land"
            # Its two batched gets, as its harness offers them; the faster one counts.
            got, blocking = accounted(pid, n * cb, functools.partial(lmc.rb.batched_get_blocking, keys))
            lmc.check(got, src, cb)
            lmc.release(got)

            got, other = accounted(pid, n * cb, functools.partial(_non_blocking_get, lmc, keys))
            lmc.check(got, src, cb)
            lmc.release(got)
            if rep >= 0:
                puts.append(put)
                gets.append(max(blocking, other, key=lambda x: x["gbps"]))
        lmc.close(5.0)
        result[f"{n}x{kib}"] = {"put": _median(puts), "get": _median(gets)}
    client.flushall()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--side", choices=("kvtier", "lmcache"), help="run one side against --url / --server-pid, print its JSON"
    )
    parser.add_argument("--url")
    parser.add_argument("--server-pid", type=int)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="CHUNKSxKIB[,...]")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="uncounted rounds first (default 1)")
    parser.add_argument("--peer-python", help="the Python that has LMCache installed")
    parser.add_argument(
        "--peer-bench", help="LMCache's harness, lmcache_redis_bench.py (its LMC class builds the connector)"
    )
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    cases = _cases(args.cases)
    if args.side:
        if not args.url or not args.server_pid:
            parser.error("--side needs --url and --server-pid")
        if args.side == "kvtier":
            out = kvtier_side(args.url, args.server_pid, cases, args.reps)
        else:
            if not args.peer_bench:
                parser.error("--side lmcache needs --peer-bench")
            out = lmcache_side(args.url, args.server_pid, cases, args.reps, args.peer_bench)
        print(json.dumps(out), flush=True)
        os._exit(0)  # LMCache's loop thread may not let the interpreter end
    if not args.peer_python or not args.peer_bench:
        parser.error("--peer-python and --peer-bench are required (the LMCache side)")
    from kvtier.tools.bench.host import CpuSteal
    from kvtier.tools.servers import RedisServer

    server = RedisServer(
        Path(tempfile.mkdtemp(prefix="kvtier-redis-server-")) / "server", extra=("--maxmemory", "4gb")
    ).start()
    pid = server.proc.pid
    sides = {
        "kvtier": [sys.executable, __file__],
        "lmcache": [args.peer_python, "-W", "ignore", __file__, "--peer-bench", args.peer_bench],
    }
    rounds: list[dict[str, Any]] = []
    try:
        # Round 0 warms the fresh server up and is not counted: it grows its memory during the
        # first puts it takes, which charged whichever side ran first.
        for r in range(args.warmup_rounds + args.rounds):
            entry: dict[str, Any] = {"round": r - args.warmup_rounds + 1}
            for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                cmd = [
                    *sides[name],
                    "--side",
                    name,
                    "--url",
                    server.url,
                    "--server-pid",
                    str(pid),
                    "--cases",
                    args.cases,
                    "--reps",
                    str(args.reps),
                ]
                with CpuSteal() as steal:
                    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode:
                    raise SystemExit(f"the {name} side failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                entry[name] = json.loads(proc.stdout.strip().splitlines()[-1])
                entry.setdefault("steal_share", {})[name] = steal.share
                tag = f"round {entry['round']}" if r >= args.warmup_rounds else "warm-up"
                print(f"{tag} {name}: {json.dumps(entry[name])} (steal {steal.share})", file=sys.stderr)
            if r >= args.warmup_rounds:
                rounds.append(entry)
    finally:
        server.stop()
    ratios: dict[str, list[float]] = {}
    for entry in rounds:
        for case, cell in entry["kvtier"].items():
            for op in ("put", "get"):
                ratios.setdefault(f"{op}_{case}", []).append(
                    round(cell[op]["gbps"] / entry["lmcache"][case][op]["gbps"], 3)
                )
    report = {"cases": args.cases, "reps": args.reps, "ratios": ratios, "rounds": rounds}
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
