"""Where a ``file`` tier load of one record spends its time, step by step, against the raw read
of the same files in the same process: one JSON object.

    python benchmarks/bench_file_steps.py [--quick] [--sizes 4096 65536 262144] [--rounds N] [--blocks N]

Per record size, one flat ``file`` tier (syncs off: the records are in the page cache, as for
``bench_disk_sizes.py``'s loads) holds ``--blocks`` records. Every round runs each arm over
all of them in turn (the order reversed every round), one record a call, into rows of one
pool, and times it with the thread's CPU clock and the wall clock (the ratios and the gap are
of CPU time: on a loaded machine a preempted round swings the wall clock by tens of µs):

* ``raw``: ``open`` beneath the root's descriptor, ``preadv`` of the head and the row, ``close``,
  with the tier's flags (``bench_disk_sizes.py``'s raw load, nothing verified);
* ``read_check``: the tier's native read of one record and nothing else
  (:func:`~kvtier.records.xxcopy.xxh3_read_check_key`: the same three system calls, the head
  compared and the row hashed where the read put it);
* ``tier``: ``read_blocks`` of a job of one, its rows a :class:`~kvtier.pool_rows.PoolRows`
  (the engine's path): the read above plus the job's checks (modes, keys, the pool's checks,
  the hold of its memory, the root's count) and its counters;
* ``tier_views``: the same job given a list of one view.

And the steps alone, on one row kept in this core's cache (so they add up to the hot read, not
the cold one above): ``hash`` (XXH3 of head, key and row, the tier's hash path), ``copy``
(``memmove`` of a row), ``pread`` (``preadv`` of head and row from a descriptor held open),
``open_close`` (``open`` and ``close`` of a record). Reported per size: µs a record (median and
spread over the rounds) and GB/s (by the wall clock) of each, ``<arm>_raw_ratio`` (the median
of the per-round ratios raw over arm: 1 is raw speed), and ``gap_us``: the tier's time over raw
split into the read and its hash (``read_check`` - ``raw``) and the job around it (``tier`` -
``read_check``), with ``hash_alone`` beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.pool_rows import PoolRows
from kvtier.records import xxcopy
from kvtier.testing import make_key

READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
ARMS = ("raw", "read_check", "tier", "tier_views")
STEPS = ("hash", "copy", "pread", "open_close")


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    fn()
    return time.thread_time_ns() - cpu, time.perf_counter_ns() - wall


def job_arms(
    backend: Any, pooled: list[tuple[Any, Any]], viewed: list[tuple[Any, Any]]
) -> dict[str, Callable[[], None]]:
    """The tier's arms: ``read_blocks`` of each job of ``pooled`` (rows as a ``PoolRows``:
    ``tier``) and of ``viewed`` (a list of one view: ``tier_views``)."""

    def tier() -> None:
        for job in pooled:
            backend.read_blocks(*job)

    def tier_views() -> None:
        for job in viewed:
            backend.read_blocks(*job)

    return {"tier": tier, "tier_views": tier_views}


def _arms(backend: Any, size: int, keys: list[bytes], staging: torch.Tensor) -> dict[str, Callable[[], None]]:
    plain = backend._plain
    if plain is None or xxcopy.xxh3_read_check_key is None:
        raise SystemExit("bench_file_steps: needs the native extension and a plain (unkeyed) file tier")
    head, dir_fd, piece, n = plain.checksum.head, plain.root.fd, plain.piece, len(keys)
    names = [k.hex() + ".kvb" for k in keys]
    rows = [(ctypes.c_char * size).from_address(staging[i].data_ptr()) for i in range(n)]
    header = bytearray(len(head) + 8)
    pooled = [([keys[i]], PoolRows(staging, range(i, i + 1))) for i in range(n)]
    viewed = [([keys[i]], [staging[i]]) for i in range(n)]
    check = xxcopy.xxh3_read_check_key
    other = torch.empty(size, dtype=torch.uint8)
    prefix = head + keys[0]
    row0, at0, to0 = rows[0], staging[0].data_ptr(), other.data_ptr()
    hash_path = xxcopy.xxh3_copy

    def raw() -> None:
        for i in range(n):
            fd = os.open(names[i], READ_FLAGS, dir_fd=dir_fd)
            try:
                os.preadv(fd, [header, rows[i]], 0)
            finally:
                os.close(fd)

    def read_check() -> None:
        for i in range(n):
            if check(dir_fd, head, keys[i], rows[i], piece) != 0:
                raise AssertionError(f"record {i}: the tier's read refused it")

    def hash_() -> None:
        for _ in range(n):
            hash_path(prefix, row0)

    def copy() -> None:
        into = other  # (held: its memory is the copy's destination)
        for _ in range(n):
            ctypes.memmove(to0, at0, size)
        del into

    def pread() -> None:
        fd = os.open(names[0], READ_FLAGS, dir_fd=dir_fd)
        try:
            for _ in range(n):
                os.preadv(fd, [header, row0], 0)
        finally:
            os.close(fd)

    def open_close() -> None:
        for _ in range(n):
            os.close(os.open(names[0], READ_FLAGS, dir_fd=dir_fd))

    return {
        "raw": raw,
        "read_check": read_check,
        **job_arms(backend, pooled, viewed),
        "hash": hash_,
        "copy": copy,
        "pread": pread,
        "open_close": open_close,
    }


def alternated(
    arms: dict[str, Callable[[], None]], reads: Sequence[str], staging: torch.Tensor, source: torch.Tensor, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each arm's thread CPU and wall clock, µs a record, over ``rounds`` rounds (after one that
    warms up), the order of the arms reversed every round; ``staging`` zeroed before each arm
    and, after each of ``reads``, checked to hold ``source``."""
    blocks = len(staging)
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    wall: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for r in range(rounds + 1):  # round 0 warms up (the tier keeps its rows' views from it)
        for name in order if r % 2 else order[::-1]:
            staging.numpy().fill(0)
            spent_cpu, spent_wall = _timed(arms[name])
            if r:
                cpu[name].append(spent_cpu / blocks / 1e3)
                wall[name].append(spent_wall / blocks / 1e3)
            if name in reads and not torch.equal(staging, source):
                raise AssertionError(f"{name} read back other bytes")
    return cpu, wall


def figures(
    arms: Sequence[str],
    against_raw: Sequence[str],
    cpu: dict[str, list[float]],
    wall: dict[str, list[float]],
    size: int,
    blocks: int,
    rounds: int,
) -> dict[str, Any]:
    """The JSON of one record size: each arm's spreads and GB/s, and each of ``against_raw``'s
    ratio to the ``raw`` arm, round by round."""
    out: dict[str, Any] = {"block_bytes": size, "blocks": blocks, "rounds": rounds}
    for name in arms:
        out[f"{name}_cpu_us"] = _spread(cpu[name])
        out[f"{name}_wall_us"] = _spread(wall[name])
        out[f"{name}_gb_s"] = float(f"{size / statistics.median(wall[name]) / 1e3:.3g}")  # (3 figures: a slow arm's rate is not rounded to 0)
    for name in against_raw:
        out[f"{name}_raw_ratio"] = _spread([b / t for b, t in zip(cpu["raw"], cpu[name])])
    return out


def run_size(root: str, size: int, blocks: int, rounds: int) -> dict[str, Any]:
    source = torch.randint(0, 256, (blocks, size), dtype=torch.uint8)
    keys = [make_key(i) for i in range(blocks)]
    backend = registry.backends.get("file")(
        capacity=max(64 << 20, 4 * blocks * (size + 8192)), path=tempfile.mkdtemp(dir=root), sync_mode="fast"
    )
    asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8")))
    try:
        backend.write_blocks(keys, PoolRows(source, range(blocks)))
        staging = torch.zeros((blocks, size), dtype=torch.uint8)
        arms = _arms(backend, size, keys, staging)
        cpu, wall = alternated(arms, ARMS[1:], staging, source, rounds)
        out = figures(list(arms), ARMS[1:], cpu, wall, size, blocks, rounds)
        med = {name: statistics.median(cpu[name]) for name in arms}
        out["gap_us"] = {
            "read_and_hash": round(med["read_check"] - med["raw"], 3),
            "job": round(med["tier"] - med["read_check"], 3),
            "hash_alone": round(med["hash"], 3),
        }
        return out
    finally:
        asyncio.run(backend.aclose())


def steps_main(bench: str, doc: str, run: Callable[[str, int, int, int], dict[str, Any]], sizes: list[int]) -> None:
    """A steps bench's command line (``--quick``, ``--sizes``, ``--rounds``, ``--blocks``): each
    size's ``run(root, size, blocks, rounds)`` under one temporary root, printed as one JSON object."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and records")
    parser.add_argument("--sizes", type=int, nargs="+", default=sizes)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (9 if args.quick else 21)
    blocks = args.blocks or (64 if args.quick else 128)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        figures = [run(root, size, blocks, rounds) for size in args.sizes]
    print(
        json.dumps(
            {"bench": bench, "native": xxcopy.NATIVE, "load_at_start": round(load, 2), "sizes": figures}, indent=1
        )
    )


def main() -> None:
    steps_main("file_steps", __doc__, run_size, [4096, 65536, 262144])


if __name__ == "__main__":
    main()
