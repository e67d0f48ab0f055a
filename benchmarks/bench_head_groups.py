"""Head-group records against whole-block records, per tier: prints one JSON object.

    python benchmarks/bench_head_groups.py [--quick] [--dir /tmp] [--rounds N] [--tiers lmdb,file,...]

A TP=1 rank holds all 8 KV heads of a block laid out like vLLM's cache, ``[layers, K/V, tokens,
heads, head_size]`` in bf16 (so one head's bytes are 256-byte pieces, the hardest case for the
split and the join). For each tier (``lmdb`` and ``file`` with ``sync_mode: fast``, ``compressed``
with codec ``none``, ``redis`` on a private server when ``redis-server`` is installed), for one-head
records of several sizes (layers x 2 x tokens x head_size x 2 bytes) and head groups of 1, 2, 4
and 8 heads, it times a job of ``--job`` blocks:

* ``whole``: the tier's own ``write_blocks`` / ``read_blocks`` of the rank's whole blocks (the
  per-rank layout), the raw baseline;
* ``groups``: the same blocks through :class:`~kvtier.records.head_group_tier.HeadGroupTier`
  (split into group records, one inner call per job; read back and joined).

Both arms move the same bytes from and into rows of one staging buffer, alternate within a
round and swap order every round; figures are medians over ``--rounds`` rounds after one
uncounted warm-up (``*_ratio_best``: of the fastest rounds, since a shared host's stalls only add
time). ``save_ratio`` / ``load_ratio`` = groups over whole (1.0 = no cost). The
``breakdown`` of each cell splits the groups arm: the inner tier's calls on the group records
alone, and the split / join copies alone, so the cost is placed. ``summary`` gives the lowest
ratio per tier at records of 64 KiB and above, and below.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.keys import Namespace
from kvtier.records.head_group_tier import HeadGroupTier
from kvtier.records.head_groups import HeadAxis, HeadGroupLayout, HeadGroups

HEADS = 8
LAYERS = 8
HEAD_SIZE = 128
#: tokens per block, giving one-head records of 16, 64 and 256 KiB (8 layers x K/V x 128 x bf16)
TOKENS = (4, 16, 64)
GROUPS = (1, 2, 4, 8)


def _tier(kind: str, root: str, capacity: int, redis_url: str | None) -> Backend:
    cls = registry.backends.get("compressed" if kind == "compressed" else kind)
    if kind in ("lmdb", "file"):
        path = tempfile.mkdtemp(prefix=f"{kind}-", dir=root)
        return cls(capacity=capacity, path=path, sync_mode="fast")
    if kind == "compressed":
        return cls(capacity=capacity, codec="none")
    return cls(capacity=capacity, url=redis_url, prefix="bench" + os.urandom(4).hex())


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cell(kind: str, root: str, tokens: int, group_size: int, job: int, rounds: int, redis_url: str | None) -> dict[str, Any]:
    shape = (job, LAYERS, 2, tokens, HEADS, HEAD_SIZE)
    g = torch.Generator().manual_seed(tokens * 10 + group_size)
    staging = torch.randint(-30000, 30000, shape, dtype=torch.int16, generator=g).view(torch.uint8).view(job, -1)
    block_bytes = staging.shape[1]
    axis = HeadAxis(heads=HEADS, segments=((LAYERS * 2 * tokens, HEAD_SIZE * 2),), tag="bench")
    layout = HeadGroupLayout(HeadGroups.for_rank(HEADS, 1, 0, group_size), axis)
    capacity = block_bytes * job * 6 + (64 << 20)
    ns = Namespace(model_id="bench", dtype="bfloat16")
    whole = _tier(kind, root, capacity, redis_url)
    grouped = HeadGroupTier(_tier(kind, root, capacity, redis_url), layout, ns)
    fmt = BlockFormat(block_bytes=block_bytes, dtype="bfloat16")

    async def open_all() -> None:
        await whole.open(fmt)
        await grouped.open(fmt)

    asyncio.run(open_all())
    out = torch.empty_like(staging)
    rows, out_rows = list(staging), list(out)
    held = layout.groups.held
    records = layout.split(rows, held)
    buffers = layout.read_buffers(job)
    scratch = torch.empty(buffers.numel(), dtype=torch.uint8)  # the tier keeps one per thread too
    times: dict[str, list[float]] = {k: [] for k in ("save_whole", "save_groups", "load_whole", "load_groups",
                                                      "inner_save", "inner_load", "split", "join")}
    try:
        for r in range(rounds + 1):
            keys = [os.urandom(32) for _ in range(job)]
            arms: list[tuple[str, Callable[[], Any]]] = [
                ("save_whole", lambda keys=keys: whole.write_blocks(keys, rows)),
                ("save_groups", lambda keys=keys: grouped.write_blocks(keys, rows)),
            ]
            got: dict[str, float] = {}
            for name, fn in arms if r % 2 else arms[::-1]:
                got[name] = _timed(fn)
            loads: list[tuple[str, Callable[[], Any]]] = [
                ("load_whole", lambda keys=keys: whole.read_blocks(keys, out_rows)),
                ("load_groups", lambda keys=keys: grouped.read_blocks(keys, out_rows)),
            ]
            for name, fn in loads if r % 2 else loads[::-1]:
                got[name] = _timed(fn)
            if not all(grouped.read_blocks(keys, out_rows)) or not torch.equal(out, staging):
                raise AssertionError(f"{kind}: head-group records did not read back byte-exact")
            # the parts of the groups arm, on their own
            rkeys = layout.record_keys([os.urandom(32) for _ in range(job)], held)
            got["inner_save"] = _timed(lambda rkeys=rkeys: grouped.inner.write_blocks(rkeys, records))
            got["inner_load"] = _timed(lambda rkeys=rkeys: grouped.inner.read_blocks(rkeys, list(buffers.view(len(rkeys), -1))))
            got["split"] = _timed(lambda: layout.split(rows, held, scratch))
            got["join"] = _timed(lambda: layout.join(buffers, out_rows))
            grouped.inner.delete_blocks(rkeys)
            whole.delete_blocks(keys)
            grouped.delete_blocks(keys)
            if r:
                for name, value in got.items():
                    times[name].append(value)
    finally:
        async def close_all() -> None:
            await whole.aclose()
            await grouped.aclose()

        asyncio.run(close_all())
    med = {k: statistics.median(v) for k, v in times.items()}
    total = block_bytes * job
    gbps = {k: round(total / v / 1e9, 3) for k, v in med.items()}
    return {
        "record_bytes": layout.group_bytes,
        "group_size": group_size,
        "block_bytes": block_bytes,
        "save_gbps": gbps["save_groups"],
        "save_whole_gbps": gbps["save_whole"],
        "save_ratio": round(med["save_whole"] / med["save_groups"], 3),
        "load_gbps": gbps["load_groups"],
        "load_whole_gbps": gbps["load_whole"],
        "load_ratio": round(med["load_whole"] / med["load_groups"], 3),
        # the fastest round of each arm: a shared host's stalls only ever add time
        "save_ratio_best": round(min(times["save_whole"]) / min(times["save_groups"]), 3),
        "load_ratio_best": round(min(times["load_whole"]) / min(times["load_groups"]), 3),
        "breakdown_gbps": {k: gbps[k] for k in ("inner_save", "split", "inner_load", "join")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small grid for a shared machine")
    parser.add_argument("--dir", default=None, help="where the disk tiers live (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--job", type=int, default=None, help="blocks per job")
    parser.add_argument("--tiers", default="lmdb,file,compressed,redis")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    job = args.job or (4 if args.quick else 16)
    tokens = (4, 16) if args.quick else TOKENS
    kinds = [k for k in args.tiers.split(",") if k]
    root = tempfile.mkdtemp(prefix="kvtier-hg-", dir=args.dir)
    server = None
    skipped: dict[str, str] = {}
    result: dict[str, Any] = {"job_blocks": job, "rounds": rounds, "load_avg": list(os.getloadavg()), "tiers": {}}
    try:
        redis_url = None
        if "redis" in kinds:
            from kvtier.tools.servers import RedisServer, server_version

            if server_version() is None:
                kinds.remove("redis")
                skipped["redis"] = "REDIS-SERVER NOT INSTALLED"
            else:
                server = RedisServer(Path(root) / "redis").start()
                redis_url = server.url
        for kind in kinds:
            cells = []
            for t in tokens:
                for gs in GROUPS:
                    cell = _cell(kind, root, t, gs, job, rounds, redis_url)
                    cells.append(cell)
                    print(f"{kind:10s} record {cell['record_bytes'] >> 10:4d} KiB x{HEADS // gs}: save {cell['save_ratio']:.2f} "
                          f"load {cell['load_ratio']:.2f} {cell['breakdown_gbps']}", file=sys.stderr)
            result["tiers"][kind] = cells
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    summary: dict[str, Any] = {}
    for kind, cells in result["tiers"].items():
        big = [c for c in cells if c["record_bytes"] >= 64 << 10]
        small = [c for c in cells if c["record_bytes"] < 64 << 10]
        summary[kind] = {
            f"{op}_ratio_min_{label}": min(c[f"{op}_ratio"] for c in part)
            for op in ("save", "load") for label, part in (("ge64k", big), ("lt64k", small)) if part
        }
    result["summary"] = summary
    result["load_avg_after"] = list(os.getloadavg())
    if skipped:
        result["skipped"] = skipped
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
