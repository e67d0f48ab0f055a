"""What asking a save's rows again costs: thread CPU per ``lmdb`` save job with the rows' addresses
asked again in the call that copies (``lmdb_lone.ROWS_ASKED``, the default) and without, the two
alternated round by round in one process, against raw puts of the same rows in one transaction
(the baseline, in the same rounds). Rows given as one pool (``PoolRows``) and as a list of views,
jobs of 1 and 16, 4 KiB and 64 KiB; syncs off. Prints one JSON object: per cell, the median
thread CPU (µs a job) of each arm, the paired ratio asked over not asked (median, min, max), and
each arm's ratio to raw. Loads run no new code (the question is the saves')."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import torch
from kvtier.backends import lmdb_lone

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.pool_rows import PoolRows
from kvtier.testing import make_key, random_block


def _cpu(fn: object, reps: int) -> float:
    start = time.thread_time_ns()
    for _ in range(reps):
        fn()  # type: ignore[operator]
    return (time.thread_time_ns() - start) / reps / 1000


def cell(size: int, job: int, form: str, rounds: int, reps: int) -> dict[str, object]:
    backend = registry.backends.get("lmdb")(capacity=1 << 30, path=tempfile.mkdtemp(), sync_mode="fast")
    asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8")))
    pool = torch.stack([random_block(size, i, torch.uint8) for i in range(job)])
    rows = PoolRows(pool, range(job)) if form == "pool" else [pool[i] for i in range(job)]
    keys = [make_key(i) for i in range(job)]
    records = [bytes(pool[i].numpy()) for i in range(job)]
    env = backend._env  # type: ignore[attr-defined]

    def raw() -> None:
        with env.begin(write=True, db=backend._blocks) as txn:  # type: ignore[attr-defined]
            for key, record in zip(keys, records):
                txn.put(key, record)

    save = lambda: backend.write_blocks(keys, rows)  # noqa: E731
    for _ in range(3):
        save()
    got: dict[str, list[float]] = {"asked": [], "not_asked": [], "raw": []}
    try:
        for r in range(rounds):
            order = ("asked", "not_asked") if r % 2 == 0 else ("not_asked", "asked")
            for arm in order:
                lmdb_lone.ROWS_ASKED = arm == "asked"
                got[arm].append(_cpu(save, reps))
            got["raw"].append(_cpu(raw, reps))
    finally:
        lmdb_lone.ROWS_ASKED = True
        asyncio.run(backend.aclose())
    paired = [a / b for a, b in zip(got["asked"], got["not_asked"])]
    return {
        "us_asked": round(statistics.median(got["asked"]), 3),
        "us_not_asked": round(statistics.median(got["not_asked"]), 3),
        "asked_over_not": [round(statistics.median(paired), 3), round(min(paired), 3), round(max(paired), 3)],
        "raw_over_asked": round(statistics.median(r / a for r, a in zip(got["raw"], got["asked"])), 3),
        "raw_over_not_asked": round(statistics.median(r / a for r, a in zip(got["raw"], got["not_asked"])), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    out = {}
    for size in args.sizes:
        for job in args.jobs:
            for form in ("pool", "list"):
                out[f"{size // 1024}KiB_j{job}_{form}"] = cell(size, job, form, args.rounds, args.reps)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
