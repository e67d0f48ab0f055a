"""What asking a save's rows again costs: thread CPU per ``lmdb`` save job with the rows' addresses
asked again in the call that copies (``lmdb_lone.ROWS_ASKED``, the default) and without, the two
alternated round by round in one process, against raw puts of the same rows in one transaction
(the baseline, in the same rounds). Rows given as one pool (``PoolRows``) and as a list of views,
jobs of 1 and 16, 4 KiB and 64 KiB; syncs off. Prints one JSON object: per cell, the median
thread CPU (µs a job) of each arm, the paired ratio asked over not asked (median, min, max), and
each arm's ratio to raw. Loads run no new code (the question is the saves').

``--steps``: instead, where a job's thread CPU goes, step by step, each step timed alone on the
same rows (alternated, the order reversed every round; µs a job, median over the rounds):
``raw`` (a write transaction, python-lmdb's put of each row's view, the commit), ``tier``
(``write_blocks``), ``views`` (the key's and rows' checks and views: ``host_view`` for a lone
row, ``held_views`` else), ``stayed`` (the rows asked again: ``views_stayed`` of what the views
were taken of), ``hold`` (the rows' collection hold and its let-go), ``modes`` (the torch mode
test), ``submit`` (``GroupCommit.submit_alone`` of a commit that does nothing), ``txn`` (the
write lock, an empty write transaction begun and committed) and ``put`` (the same with the
job's records written by ``put_reserved``, the rows asked again)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

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


def steps(size: int, job: int, form: str, rounds: int, reps: int) -> dict[str, float]:
    """Thread CPU (µs a job) of each step of a save of ``job`` rows of ``size`` bytes (``--steps``)."""
    from kvtier.backends import lmdb_plain

    from kvtier.records import xxcopy

    backend: Any = registry.backends.get("lmdb")(capacity=1 << 30, path=tempfile.mkdtemp(), sync_mode="fast")
    asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8")))
    pool = torch.stack([random_block(size, i, torch.uint8) for i in range(job)])
    rows: Any = PoolRows(pool, range(job)) if form == "pool" else [pool[i] for i in range(job)]
    keys = tuple(make_key(i) for i in range(job))
    arrays = [memoryview(pool[i].numpy()) for i in range(job)]
    env, db, lone = backend._env, backend._blocks, backend._lone
    if lone is None or lone.direct is None or lone.reserve_with is not xxcopy.xxh3_joined:
        raise SystemExit("bench_save_recheck --steps: needs the lmdb tier's native lone saves")
    for _ in range(3):
        backend.write_blocks(keys, rows)
    one = job == 1 and form != "pool"
    taken: Any = rows[0] if one else tuple(rows) if form != "pool" else None
    if one:
        viewed: Any = (lmdb_plain.host_view(rows[0], torch.Tensor, torch.uint8, lone.shape, lone.views),)
        views = lambda: lmdb_plain.host_view(rows[0], torch.Tensor, torch.uint8, lone.shape, lone.views)  # noqa: E731
    else:
        viewed = lmdb_plain.held_views(keys, rows, lone.shape, lone.views)
        views = lambda: lmdb_plain.held_views(keys, rows, lone.shape, lone.views)  # noqa: E731
        taken = viewed.taken if form == "pool" else taken
    lock, commits = backend._write_lock, backend._commits

    def raw() -> None:
        with env.begin(write=True, db=db) as txn:
            for key, array in zip(keys, arrays):
                txn.put(key, array)

    def txn(put: bool) -> None:
        with lock:
            t = env.begin(db, None, True, True)
            if put:
                lmdb_lone.put_reserved(lone.direct, env, t, db, backend._index, False, lone.head, keys, viewed, taken)  # type: ignore[misc]
            t.commit()

    arms = {
        "raw": raw,
        "tier": lambda: backend.write_blocks(keys, rows),
        "views": views,
        "stayed": lambda: lmdb_lone.views_stayed(taken, viewed),
        "hold": lambda: (xxcopy.rows_hold(), xxcopy.rows_let_go()),
        "modes": lmdb_plain.modes_on,
        "submit": lambda: commits.submit_alone(None, lambda batches: [None]),
        "txn": lambda: txn(False),
        "put": lambda: txn(True),
    }
    got: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for r in range(rounds):
            for name in list(arms) if r % 2 == 0 else list(reversed(arms)):
                got[name].append(_cpu(arms[name], reps))
    finally:
        asyncio.run(backend.aclose())
    out = {f"{name}_us": round(statistics.median(times), 3) for name, times in got.items()}
    out["raw_over_tier"] = round(statistics.median(a / b for a, b in zip(got["raw"], got["tier"])), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", action="store_true", help="where a save's thread CPU goes, step by step (see the module doc)")
    args = parser.parse_args()
    out = {}
    for size in args.sizes:
        for job in args.jobs:
            for form in ("pool", "list"):
                measure = steps if args.steps else cell
                out[f"{size // 1024}KiB_j{job}_{form}"] = measure(size, job, form, args.rounds, args.reps)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
