"""The ``redis`` tier against raw redis-py on the same bytes, in the same run; prints one JSON object.

Raw baselines (the best of several redis-py patterns, since none wins everywhere): a serial
``SET``/``GET`` loop, one pipeline per job, ``MSET``/``MGET`` (``mset_nonatomic``/``mget_nonatomic``
on a cluster), and four connections each running a serial loop over a quarter of the job.
kvtier: ``write_blocks``/``read_blocks`` of whole jobs (records with header and checksum).
Ratios are kvtier / best raw; GB/s count block bytes.

``lookup_us_per_key``: ``TierManager.lookup`` through a store whose redis tier's index was
filled by the shared-index sweep (no network in the lookup). ``sweep_us_per_key``: one full
sweep (SCAN) of the server, per key held.

Servers: ``--url`` / ``--cluster-url``, else private ones started here
(:mod:`kvtier.tools.servers`: it needs ``redis-server`` and ``redis-cli`` on ``PATH``).
``--connection-env VAR`` measures one configured server instead: ``VAR`` holds a JSON object of
the redis tier's connection options (``url``, ``cluster``, ``username``, ``password`` or
``password_env``, ``tls_*``), passed in the environment so that no secret shows on a command
line. ``--prefix P`` puts every key the benchmark writes under ``P:`` or ``P.<part>:`` (what
``kvtier bench --config`` gives, and deletes afterwards; default ``bench``).

    python benchmarks/bench_redis.py [--repeat 3] [--no-cluster] [--quick] [--prefix P]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import torch
from kvtier.backends.redis_client import client_options
from kvtier.backends.redis_tier import RedisBackend
from redis.cluster import RedisCluster

import kvtier
from kvtier.backend import BlockFormat
from kvtier.testing import make_key, random_block

SHAPES = {"2MiB": (2 << 20, 48, 16), "64KiB": (64 << 10, 768, 128)}  # block bytes, blocks, blocks per job


def _rate(fn: Any, nbytes: int) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e9


def raw_patterns(client: Any, cluster: bool, keys: list[bytes], values: list[bytes], job: int) -> dict[str, Any]:
    """Put and get functions of each raw redis-py pattern, over jobs of ``job`` blocks."""
    jobs = [(keys[i : i + job], values[i : i + job]) for i in range(0, len(keys), job)]
    pool = ThreadPoolExecutor(4)

    def serial_put() -> None:
        for k, v in zip(keys, values):
            client.set(k, v)

    def serial_get() -> None:
        for k in keys:
            client.get(k)

    def pipe_put() -> None:
        for ks, vs in jobs:
            p = client.pipeline(transaction=False)
            for k, v in zip(ks, vs):
                p.set(k, v)
            p.execute()

    def pipe_get() -> None:
        for ks, _ in jobs:
            p = client.pipeline(transaction=False)
            for k in ks:
                p.get(k)
            p.execute()

    def multi_put() -> None:
        for ks, vs in jobs:
            (client.mset_nonatomic if cluster else client.mset)(dict(zip(ks, vs)))

    def multi_get() -> None:
        for ks, _ in jobs:
            (client.mget_nonatomic if cluster else client.mget)(ks)

    def threads_put() -> None:
        for ks, vs in jobs:
            list(pool.map(lambda q, ks=ks, vs=vs: [client.set(k, v) for k, v in zip(ks[q::4], vs[q::4])], range(4)))

    def threads_get() -> None:
        for ks, _ in jobs:
            list(pool.map(lambda q, ks=ks: [client.get(k) for k in ks[q::4]], range(4)))

    return {
        "put_serial": serial_put, "get_serial": serial_get,
        "put_pipeline": pipe_put, "get_pipeline": pipe_get,
        "put_mset_mget": multi_put, "get_mset_mget": multi_get,
        "put_4_connections": threads_put, "get_4_connections": threads_get,
    }


def kvtier_io(backend: RedisBackend, block: int, n: int, job: int) -> tuple[dict[str, Any], Any]:
    """kvtier's put and get over the same jobs, and a check that the reads were byte-exact."""
    keys = [make_key(i) for i in range(n)]
    data = [random_block(block, i % 8) for i in range(n)]
    out = [torch.empty(block, dtype=torch.uint8) for _ in range(n)]

    def put() -> None:
        for i in range(0, n, job):
            assert all(s is not None for s in backend.write_blocks(keys[i : i + job], data[i : i + job]))

    def get() -> None:
        for i in range(0, n, job):
            assert all(backend.read_blocks(keys[i : i + job], out[i : i + job]))

    def check() -> None:
        assert all(torch.equal(a, b) for a, b in zip(out, data))
        backend.delete_blocks(keys)

    return {"put_kvtier": put, "get_kvtier": get}, check


def client_for(conn: dict[str, Any]) -> Any:
    """A raw redis-py client with the connection options of a redis tier built from ``conn``."""
    probe = RedisBackend(capacity=1 << 20, **conn)
    options = client_options(probe.username, probe._password, probe.tls, 30.0, 5.0, 32)
    return RedisCluster.from_url(probe.url, **options) if probe.cluster else redis.Redis.from_url(probe.url, **options)


def measure_shape(conn: dict[str, Any], prefix: str, client: Any, block: int, n: int, job: int, repeat: int) -> dict[str, Any]:
    """Every pattern, interleaved ``repeat`` times (best kept), so load swings hit all alike."""
    fmt = BlockFormat(block_bytes=block, dtype="bfloat16", namespace_digest=hashlib.sha256(b"bench-redis%d" % block).digest())
    backend = RedisBackend(capacity=4 * n * (block + 64), prefix=prefix, **conn)
    cluster = backend.cluster
    asyncio.run(backend.open(fmt))
    try:
        keys = [f"{prefix}.raw:".encode() + make_key(i) for i in range(n)]
        values = [random_block(block, i % 8).numpy().tobytes() for i in range(n)]
        patterns = raw_patterns(client, cluster, keys, values, job)
        ours, check = kvtier_io(backend, block, n, job)
        best: dict[str, float] = {}
        for _ in range(repeat):
            for name, fn in (*patterns.items(), *ours.items()):  # puts before gets, per pattern
                best[name] = max(best.get(name, 0.0), _rate(fn, n * block))
        check()
        for k in keys:
            client.delete(k)
    finally:
        asyncio.run(backend.aclose())
    raw = {k: round(v, 3) for k, v in best.items() if not k.endswith("_kvtier")}
    best_put = max(v for k, v in raw.items() if k.startswith("put_"))
    best_get = max(v for k, v in raw.items() if k.startswith("get_"))
    return {
        "kvtier_put_gbps": round(best["put_kvtier"], 3),
        "kvtier_get_gbps": round(best["get_kvtier"], 3),
        "raw_best_put_gbps": best_put,
        "raw_best_get_gbps": best_get,
        "redis_save_ratio": round(best["put_kvtier"] / best_put, 3),
        "redis_load_ratio": round(best["get_kvtier"] / best_get, 3),
        "raw": raw,
    }


async def lookup_cost(conn: dict[str, Any], prefix: str, n: int) -> dict[str, float]:
    """Lookups through a store whose redis index was filled by one sweep of ``n`` records."""
    block = 4096
    tier = {"backend": "redis", "capacity": 4 * n * (block + 64), **conn, "prefix": f"{prefix}.lookup"}
    cfg = {"block_bytes": block, "tiers": [{**tier, "sync_interval_s": 3600}]}
    writer = RedisBackend(**{k: v for k, v in tier.items() if k != "backend"})
    async with kvtier.open(cfg) as store:
        await writer.open(store.format)
        keys = [make_key(i) for i in range(n)]
        blk = [torch.zeros(block, dtype=torch.uint8)] * 1000
        for i in range(0, n, 1000):
            writer.write_blocks(keys[i : i + 1000], blk[: len(keys[i : i + 1000])])
        tier = store.backends[0]
        assert isinstance(tier, RedisBackend) and tier.view is not None
        view = tier.view
        t0 = time.perf_counter()
        view.sweep_once()
        sweep_s = time.perf_counter() - t0
        mgr = store.manager
        assert mgr is not None
        queries = [keys[i : i + 64] for i in range(0, n, 64)]
        t0 = time.perf_counter()
        hits = sum(mgr.lookup(q) for q in queries)
        lookup_s = time.perf_counter() - t0
        assert hits == n, hits
        writer.delete_blocks(keys)
        await writer.aclose()
    return {"lookup_us_per_key": round(lookup_s / n * 1e6, 3), "sweep_us_per_key": round(sweep_s / n * 1e6, 3), "sweep_keys": n}


def measure(conn: dict[str, Any], repeat: int, lookup_keys: int = 20000, prefix: str = "bench") -> dict[str, Any]:
    client = client_for(conn)
    result: dict[str, Any] = {label: measure_shape(conn, prefix, client, *shape, repeat) for label, shape in SHAPES.items()}
    client.close()
    result.update(asyncio.run(lookup_cost(conn, prefix, lookup_keys)))
    # Headline ratios: the 2 MiB cell, the shape of real KV blocks.
    result["redis_save_ratio"] = result["2MiB"]["redis_save_ratio"]
    result["redis_load_ratio"] = result["2MiB"]["redis_load_ratio"]
    return result


def headline(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures ``kvtier bench`` reads at the top level of the report."""
    return {f: figures[f] for f in ("redis_save_ratio", "redis_load_ratio", "2MiB", "64KiB", "lookup_us_per_key", "sweep_us_per_key")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url")
    parser.add_argument("--cluster-url")
    parser.add_argument("--no-cluster", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repetition, 2000 lookup keys, no cluster (what `kvtier bench --quick` runs)")
    parser.add_argument("--connection-env", metavar="VAR",
                        help="measure only the server whose redis tier options (JSON) environment variable VAR holds")
    parser.add_argument("--prefix", default="bench", help="the keys written go under PREFIX: and PREFIX.<part>: (default bench)")
    args = parser.parse_args()
    lookup_keys = 20000
    if args.quick:
        args.repeat, args.no_cluster, lookup_keys = 1, True, 2000
    if args.connection_env:
        conn = json.loads(os.environ[args.connection_env])
        report = {"cpus": os.cpu_count(), "server": measure(conn, args.repeat, lookup_keys, args.prefix)}
        print(json.dumps({**report, **headline(report["server"])}))
        return
    started: list[Any] = []
    try:
        from kvtier.tools.servers import RedisClusterServers, RedisServer, server_version

        tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-"))
        url = args.url
        if url is None:
            server = RedisServer(tmp / "server", extra=("--maxmemory", "4gb")).start()
            started.append(server)
            url = server.url
        server_figures = measure({"url": url}, args.repeat, lookup_keys, args.prefix)
        # Top level: the standalone server's figures (what `kvtier bench` plots), the cluster's below.
        report: dict[str, Any] = {"redis_server": server_version(), "cpus": os.cpu_count(), "server": server_figures,
                                  **headline(server_figures)}
        if not args.no_cluster:
            curl = args.cluster_url
            if curl is None:
                cluster = RedisClusterServers(tmp / "cluster").start()
                started.append(cluster)
                curl = cluster.url
            report["cluster"] = measure({"url": curl, "cluster": True}, args.repeat, lookup_keys, args.prefix)
        print(json.dumps(report))
    finally:
        for s in started:
            s.stop()


if __name__ == "__main__":
    main()
