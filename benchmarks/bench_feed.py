"""Live following of a shared Redis tier: the change feed against the sweep it replaces.

One private redis-server holds ``--keys`` records of one namespace. ``--engines`` followers
(each a ``redis`` tier opened as an engine opens it, bound to a manager of its own) follow it
while one more engine writes ``--rate`` jobs a second of ``--job-keys`` new keys for
``--seconds``. Each mode runs in turn, on the same server and the same writes:

* ``writer``: the writes alone, nobody following: the raw baseline of the server's cost;
* ``sweep``: followers without a feed, sweeping every ``--sweep-interval-s`` (today's
  ``SharedIndexView``: a full ``SCAN`` each time, stretched to ten sweep durations);
* ``feed``: followers reading the capped stream (``XREAD BLOCK``), their sweep held off.

Per mode: the staleness of every written key at every follower (from the writer's completed
``write_blocks`` to the follower's index holding the key: p50, p99, max, and the share of keys
never seen within the window), and the server's cost over the window: CPU seconds (``INFO
cpu``), bytes in and out (``INFO stats``: ``total_net_input_bytes`` and
``total_net_output_bytes``) and commands (``total_commands_processed``). ``ratios`` compare the
feed with the sweep (``feed_over_sweep``) and each with the writer alone
(``over_writer``), from adjacent runs in this process. Prints one JSON object.

    python benchmarks/bench_feed.py [--keys 10000,100000] [--engines 2,4] [--seconds 20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.backend import BlockFormat
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy

BLOCK_BYTES = 256


def _info(client: Any) -> dict[str, float]:
    cpu = client.info("cpu")
    stats = client.info("stats")
    return {
        "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "bytes_in": float(stats["total_net_input_bytes"]),
        "bytes_out": float(stats["total_net_output_bytes"]),
        "commands": float(stats["total_commands_processed"]),
    }


def _fmt(keys: int) -> BlockFormat:
    digest = hashlib.sha256(f"bench-feed-{keys}".encode()).digest()
    return BlockFormat(block_bytes=BLOCK_BYTES, dtype="uint8", namespace_digest=digest)


def _preload(url: str, fmt: BlockFormat, keys: int) -> None:
    """``keys`` records' names under the namespace (the sweep lists names; their bytes are
    never read here)."""
    import redis

    client = redis.Redis.from_url(url)
    prefix = f"bench:{fmt.namespace_digest[:8].hex()}:".encode()
    pipe = client.pipeline(transaction=False)
    for i in range(keys):
        pipe.set(prefix + hashlib.sha256(b"pre%d" % i).digest(), b"x" * 16)
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    client.close()


def _tier(url: str, mode: str, sweep_interval_s: float) -> Any:
    from kvtier.backends.redis_tier import RedisBackend

    feed = mode == "feed"
    return RedisBackend(
        capacity=1 << 40, url=url, prefix="bench", feed=feed, sync_interval_s=3600.0 if feed else sweep_interval_s
    )


def run_mode(url: str, client: Any, keys: int, engines: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    fmt = _fmt(keys)
    followers: list[tuple[Any, TierManager]] = []
    seen: list[dict[bytes, float]] = []
    lock = threading.Lock()

    async def open_all() -> None:
        for _ in range(engines if mode != "writer" else 0):
            tier = _tier(url, mode, args.sweep_interval_s)
            await tier.open(fmt)
            manager = TierManager([TierSpec("redis", (keys * 4 + 1_000_000) * BLOCK_BYTES, BLOCK_BYTES, LRUPolicy(capacity=keys * 4 + 1_000_000), persistent=True)])
            records = list(tier.scan())
            manager.adopt(0, [(r.key, BLOCK_BYTES, r.stamp) for r in records])
            mine: dict[bytes, float] = {}
            seen.append(mine)

            def note(change: Any, mine: dict[bytes, float] = mine) -> None:
                now = time.perf_counter()
                with lock:
                    for k in change.adopted:
                        mine.setdefault(k, now)

            tier.follower.listen(note)
            tier.bind_index(manager, 0)
            followers.append((tier, manager))

    asyncio.run(open_all())
    writer = _tier(url, "feed" if mode == "feed" else "sweep", 3600.0)
    asyncio.run(writer.open(fmt))
    if writer.follower is not None:
        writer.follower.view.stop()  # the writer follows nobody
    blocks = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8)] * args.job_keys
    written: dict[bytes, float] = {}
    time.sleep(0.5)  # the followers' first reads are in place
    before = _info(client)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < args.seconds:
        job = [hashlib.sha256(b"%s-%d-%d-%d" % (mode.encode(), keys, engines, n * args.job_keys + j)).digest() for j in range(args.job_keys)]
        sizes = writer.write_blocks(job, blocks)
        done = time.perf_counter()
        for k, s in zip(job, sizes):
            if s is not None:
                written[k] = done
        n += 1
        pause = t0 + n / args.rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    window = time.perf_counter() - t0
    # Let the slowest follower catch up (up to the drain budget): keys still unseen then count as lost.
    drain_end = time.perf_counter() + (args.drain_s if mode != "writer" else 0.0)
    while time.perf_counter() < drain_end:
        with lock:
            if all(len(s.keys() & written.keys()) == len(written) for s in seen):
                break
        time.sleep(0.05)
    after = _info(client)
    lags: list[float] = []
    unseen = 0
    with lock:
        for mine in seen:
            for k, t in written.items():
                got = mine.get(k)
                if got is None:
                    unseen += 1
                else:
                    lags.append(max(0.0, got - t))

    async def close_all() -> None:
        for tier, _ in followers:
            await tier.aclose()
        await writer.aclose()

    asyncio.run(close_all())
    cost = {name: after[name] - before[name] for name in before}
    lags.sort()
    out: dict[str, Any] = {
        "window_s": round(window, 2),
        "jobs": n,
        "keys_written": len(written),
        "server": {k: round(v, 4) for k, v in cost.items()},
        "unseen_share": round(unseen / max(1, len(written) * max(1, len(seen))), 4),
    }
    if lags:
        out["staleness_s"] = {
            "p50": round(statistics.median(lags), 4),
            "p99": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))], 4),
            "max": round(lags[-1], 4),
        }
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default="10000,100000", help="records held, comma-separated")
    parser.add_argument("--engines", default="2,4", help="followers, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="window of writes per mode")
    parser.add_argument("--rate", type=float, default=20.0, help="write jobs per second")
    parser.add_argument("--job-keys", type=int, default=16, help="keys per write job")
    parser.add_argument("--sweep-interval-s", type=float, default=1.0, help="the sweep mode's interval (today's default)")
    parser.add_argument("--drain-s", type=float, default=30.0, help="time after the window for followers to catch up")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2000 keys, 2 engines, 3 s")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if args.quick:
        args.keys, args.engines, args.seconds, args.drain_s = "2000", "2", 3.0, 15.0
    import redis

    from kvtier.tools.servers import RedisServer

    result: dict[str, Any] = {"load_average": list(os.getloadavg()), "rate": args.rate, "job_keys": args.job_keys, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            client = redis.Redis.from_url(server.url)
            for keys in (int(k) for k in args.keys.split(",")):
                client.flushall()
                _preload(server.url, _fmt(keys), keys)
                for engines in (int(e) for e in args.engines.split(",")):
                    case: dict[str, Any] = {"keys": keys, "engines": engines}
                    for mode in ("writer", "sweep", "feed"):
                        case[mode] = run_mode(server.url, client, keys, engines, mode, args)
                    w, s, f = case["writer"]["server"], case["sweep"]["server"], case["feed"]["server"]
                    case["ratios"] = {
                        "feed_over_sweep": {
                            "cpu_s": _ratio(f["cpu_s"], s["cpu_s"]),
                            "bytes": _ratio(f["bytes_in"] + f["bytes_out"], s["bytes_in"] + s["bytes_out"]),
                            "commands": _ratio(f["commands"], s["commands"]),
                            "staleness_p99": _ratio(case["feed"].get("staleness_s", {}).get("p99", 0.0), case["sweep"].get("staleness_s", {}).get("p99", 0.0)),
                        },
                        "over_writer": {
                            mode: {"cpu_s": _ratio(case[mode]["server"]["cpu_s"], w["cpu_s"]),
                                   "bytes": _ratio(case[mode]["server"]["bytes_in"] + case[mode]["server"]["bytes_out"], w["bytes_in"] + w["bytes_out"])}
                            for mode in ("sweep", "feed")
                        },
                    }
                    result["cases"].append(case)
            client.close()
        finally:
            server.stop()
    result["load_average_after"] = list(os.getloadavg())
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return result


if __name__ == "__main__":
    main()
