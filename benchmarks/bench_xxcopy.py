"""The fused copy + XXH3 pass of raw records against a plain copy of the same bytes: one JSON object.

    python benchmarks/bench_xxcopy.py [--quick] [--sizes 65536 262144 2097152] [--rounds N]

Per payload size, in one process on the same bytes, each arm copies (and checks) every block
of a set of sources into a set of destinations (``--spread`` bytes each, so a pass reads from
memory or the last-level cache as a tier's load from the page cache or an LMDB map does, not
from a core's own cache):

* ``raw_copy`` (the baseline): ``numpy.copyto`` of each block;
* ``fused``: ``kvtier.records.xxcopy.xxh3_copy`` of a 56-byte prefix (checked header bytes and
  key) and the block into its destination, one pass (native where built);
* ``python``: the same function's Python path (a copy, then one XXH3 of it);
* ``copy_then_hash``: ``numpy.copyto``, then ``xxhash.xxh3_64`` over the prefix and the copy:
  two passes;
* ``hash_only``: ``xxh3_copy`` without a destination (what a save that already wrote the block
  pays), and ``xxhash_only``: ``xxhash.xxh3_64`` over the prefix and the block;
* with ``--paths``, ``fused_<path>`` and ``hash_<path>`` for each native path the CPU runs
  (``scalar``, ``avx2``, ``avx512``): what picks the default one.

Arms alternate within a round and their order reverses every round; each reports GB/s (median
over rounds) and ``<arm>_ratio``, its GB/s over ``raw_copy``'s, median of the per-round ratios.
``path`` names the native path (``avx2``, ``scalar``) or ``python`` where the extension is
not built.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from kvtier.records import xxcopy

SIZES = (4096, 65536, 262144, 2 << 20)
PREFIX = bytes(range(56))


def _path_arms(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Callable[[], None]]:
    """``fused_<path>`` and ``hash_<path>`` for each native path this CPU runs (``--paths``)."""
    from kvtier.records import _xxcopy  # type: ignore[attr-defined]

    arms: dict[str, Callable[[], None]] = {}
    for path in _xxcopy.paths():

        def fused(path: str = path) -> None:
            for s, d in pairs:
                _xxcopy.xxh3_64_copy_with(path, PREFIX, s, d)

        def hashed(path: str = path) -> None:
            for s, _ in pairs:
                _xxcopy.xxh3_64_copy_with(path, PREFIX, s)

        arms[f"fused_{path}"], arms[f"hash_{path}"] = fused, hashed
    return arms


def _arms(srcs: list[np.ndarray], dsts: list[np.ndarray], paths: bool = False) -> dict[str, Callable[[], None]]:
    pairs = list(zip(srcs, dsts))

    def raw_copy() -> None:
        for s, d in pairs:
            np.copyto(d, s)

    def fused() -> None:
        for s, d in pairs:
            xxcopy.xxh3_copy(PREFIX, s, d)

    def python() -> None:
        for s, d in pairs:
            xxcopy.xxh3_copy_python(PREFIX, s, d)

    def copy_then_hash() -> None:
        for s, d in pairs:
            np.copyto(d, s)
            h = xxhash.xxh3_64(PREFIX)
            h.update(d)
            h.intdigest()

    def hash_only() -> None:
        for s in srcs:
            xxcopy.xxh3_copy(PREFIX, s)

    def xxhash_only() -> None:
        for s in srcs:
            h = xxhash.xxh3_64(PREFIX)
            h.update(s)
            h.intdigest()

    arms = {
        "raw_copy": raw_copy,
        "fused": fused,
        "python": python,
        "copy_then_hash": copy_then_hash,
        "hash_only": hash_only,
        "xxhash_only": xxhash_only,
    }
    return {**arms, **_path_arms(pairs)} if paths and xxcopy.NATIVE else arms


def _cell(size: int, spread: int, rounds: int, reps: int, paths: bool) -> dict[str, Any]:
    count = max(1, spread // size)
    rng = np.random.default_rng(size)
    srcs = [rng.integers(0, 256, size=size, dtype=np.uint8) for _ in range(count)]
    dsts = [np.zeros(size, dtype=np.uint8) for _ in range(count)]
    arms = _arms(srcs, dsts, paths)
    for fn in arms.values():  # warm-up, uncounted
        fn()
    nbytes = size * count * reps
    gbps: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            fn = arms[name]
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            gbps[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    cell: dict[str, Any] = {"block_bytes": size, "blocks": count, "rounds": rounds}
    for name, values in gbps.items():
        cell[f"{name}_GBps"] = round(statistics.median(values), 2)
        if name != "raw_copy":
            ratios = [v / b for v, b in zip(values, gbps["raw_copy"])]
            cell[f"{name}_ratio"] = round(statistics.median(ratios), 3)
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, for a shared machine")
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="payload sizes in bytes")
    parser.add_argument("--rounds", type=int, default=None, help="counted rounds per size (default 9, --quick 5)")
    parser.add_argument("--paths", action="store_true", help="also each native path apart (fused_<path>, hash_<path>)")
    parser.add_argument("--spread", type=int, default=32 << 20, help="bytes of sources (and of destinations) a pass walks")
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 9)
    reps = 2 if args.quick else 4
    cells = [_cell(size, args.spread, rounds, reps, args.paths) for size in args.sizes]
    print(json.dumps({"path": xxcopy.PATH, "native": xxcopy.NATIVE, "spread_bytes": args.spread, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
