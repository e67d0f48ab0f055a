"""Where an ``lmdb`` tier load of one record spends its time, step by step, against the raw
load of the same rows in the same process: one JSON object.

    python benchmarks/bench_lmdb_steps.py [--quick] [--sizes 4096 65536] [--rounds N] [--blocks N]

Per record size, one ``lmdb`` tier (warm: its records in the page cache, as for
``bench_disk_sizes.py``'s loads) and one raw environment beside it hold ``--blocks`` records.
Every round runs each arm over all of them in turn (the order of the arms reversed every
round), one record a call, into rows of one pool, and times it with the thread's CPU clock
and the wall clock (the ratios and the gaps are of CPU time):

* ``raw``: ``bench_disk_sizes.py``'s raw load (the goal's baseline): a read transaction of
  python-lmdb (``buffers=True``), its ``get`` and a copy into a view of the row made before
  the clock; nothing checked;
* ``raw_cget``: a python-lmdb read transaction and one native call that copies the value by
  LMDB's own ``get`` and ``memcpy`` (``bench_disk_sizes.py``'s ``raw_cget``), where built;
* ``tier``: ``read_blocks`` of a job of one, its rows a :class:`~kvtier.pool_rows.PoolRows`
  (the engine's path);
* ``tier_views``: the same job given a list of one view;
* ``native``: the native call ``read_blocks`` makes for such a job, called straight (so
  ``tier`` - ``native`` is the Python frame of ``read_blocks`` and its attribute loads);
* ``native_framed``: the same call from a method of two arguments whose other arguments are
  bound before the clock (so ``native_framed`` - ``native`` is a frame alone, and ``tier`` -
  ``native_framed`` the loads of the tier's state, switches and arguments ``read_blocks`` makes).

And the steps inside ``native`` alone, each on one row kept in this core's cache:
``modes`` (the torch function mode's test, a call), ``checks`` (the key's and the pool's
checks and the row's kept view, ``_rowguard.job_views``), ``guard`` (the data file's size,
``same_size``: one ``lseek``), ``hold`` (the rows' collection hold and its let-go),
``lookup`` (a python-lmdb read transaction and ``get``, nothing copied: what the native read's
lookups replace by LMDB's own ``get`` in a kept transaction), ``check_copy`` (the record's
check, copy and XXH3 in one pass, ``xxh3_check_copy``), ``copy`` (``memmove`` of a row).
Reported per size: µs a record (median and spread over the rounds) and GB/s (wall clock) of
each, ``<arm>_raw_ratio`` (the median of the per-round ratios raw over arm: 1 is raw speed),
and ``gap_us``: the tier's time over raw split into the frame (``tier`` - ``native``; of it,
``frame_alone`` and ``frame_loads`` as above) and the native call over raw (``native`` -
``raw``), with the steps' sum beside them.
"""

from __future__ import annotations

import asyncio
import ctypes
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import lmdb
import torch
from kvtier.tools.bench.scripts.bench_file_steps import alternated, figures, job_arms, steps_main

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.keys import KEY_BYTES
from kvtier.pool_rows import PoolRows
from kvtier.records import xxcopy
from kvtier.testing import make_key

ARMS = ("raw", "raw_cget", "tier", "tier_views", "native", "native_framed")
STEPS = ("modes", "checks", "guard", "hold", "lookup", "check_copy", "copy")


def _native_parts() -> tuple[Any, Any]:
    try:
        from kvtier.backends import _rowguard, lmdb_direct, lmdb_one, lmdb_plain  # type: ignore[attr-defined]
    except ImportError as exc:
        raise SystemExit(f"bench_lmdb_steps: needs the native extension ({exc})") from exc
    return _rowguard, (lmdb_direct, lmdb_one, lmdb_plain)


def _arms(
    backend: Any, raw_env: lmdb.Environment, raw_db: Any, size: int, keys: list[bytes], staging: torch.Tensor
) -> dict[str, Callable[[], None]]:
    rowguard, (lmdb_direct, lmdb_one, lmdb_plain) = _native_parts()
    straight, env = backend._straight, backend._env
    if straight is None or lmdb_plain.straight_read is None:
        raise SystemExit("bench_lmdb_steps: needs an unkeyed lmdb tier with its straight reads built")
    n = len(keys)
    parts = straight.native_parts
    blocks, index, head, _ = straight.parts
    rows = [memoryview(staging[i].numpy()) for i in range(n)]
    pooled = [([keys[i]], PoolRows(staging, range(i, i + 1))) for i in range(n)]
    viewed = [([keys[i]], [staging[i]]) for i in range(n)]
    straight_read, clock, cold_s, check = (
        lmdb_plain.straight_read,
        lmdb_one.perf_counter,
        lmdb_one.COLD_GET_S,
        xxcopy.xxh3_check_copy,
    )
    copy_direct = getattr(rowguard, "direct_copy", None)
    direct = None if copy_direct is None else lmdb_direct.direct_gets(raw_env, raw_db, keys[0], raw_db, raw_db)
    cget_jobs = [([keys[i]], [rows[i]]) for i in range(n)]
    # One record, as stored, for the check and copy alone (joined: the value; split: entry and value).
    with env.begin(buffers=False) as txn:
        value = txn.get(keys[0], db=blocks)
        entry = None if len(value) == parts[15] else txn.get(keys[0], db=index)
    stored_head = None if entry is None else entry[parts[16] :]
    other = torch.empty(size, dtype=torch.uint8)
    view0 = rows[0]
    at0, to0 = staging[0].data_ptr(), other.data_ptr()
    job0 = pooled[0]
    tensor, u8, shape, views = parts[2], parts[3], parts[1], parts[0]
    guard = straight.guard
    function_mode = lmdb_plain.function_mode
    same_size = lmdb_plain.same_size
    job_views = rowguard.job_views

    def raw() -> None:
        for i in range(n):
            with raw_env.begin(buffers=True, db=raw_db) as txn:
                rows[i][:] = txn.get(keys[i])

    def raw_cget() -> None:
        for job_keys, job_rows in cget_jobs:
            with raw_env.begin(buffers=True, db=raw_db) as txn:
                copy_direct(direct, raw_env, txn, raw_db, job_keys, job_rows)

    def native() -> None:
        for job_keys, job_rows in pooled:
            if straight_read(parts, env, job_keys, job_rows, clock, cold_s, check) != [True]:
                raise AssertionError("the native read handed the job over")

    class _Framed:
        """A method of two arguments around the native call, its other arguments bound."""

        __slots__ = ()

        def read(self, job_keys: Any, job_rows: Any) -> Any:
            return straight_read(parts, env, job_keys, job_rows, clock, cold_s, check)

    framed = _Framed()

    def native_framed() -> None:
        for job_keys, job_rows in pooled:
            if framed.read(job_keys, job_rows) != [True]:
                raise AssertionError("the native read handed the job over")

    def modes() -> None:
        for _ in range(n):
            function_mode()

    def checks() -> None:
        job_keys, job_rows = job0
        for _ in range(n):
            job_views(job_keys, job_rows, tensor, u8, shape, views, KEY_BYTES)

    def guard_() -> None:
        fd, seen = guard.fd, guard.seen
        for _ in range(n):
            same_size(fd, seen)

    def hold() -> None:
        for _ in range(n):
            xxcopy.rows_hold()
            xxcopy.rows_let_go()

    def lookup() -> None:
        key = keys[0]
        for _ in range(n):
            txn = env.begin(None, None, False, True)
            txn.get(key, None, blocks)
            txn.abort()

    def check_copy() -> None:
        key = keys[0]
        for _ in range(n):
            if stored_head is None:
                status = check(head, key, value, view0)
            else:
                status = check(head, key, stored_head, view0, value)
            if status:
                raise AssertionError("the stored record did not check")

    def copy() -> None:
        into = other  # (held: its memory is the copy's destination)
        for _ in range(n):
            ctypes.memmove(to0, at0, size)
        del into

    arms: dict[str, Callable[[], None]] = {"raw": raw, **job_arms(backend, pooled, viewed), "native": native, "native_framed": native_framed}
    if direct is not None:
        arms["raw_cget"] = raw_cget
    arms.update(modes=modes, checks=checks, guard=guard_, hold=hold, lookup=lookup, check_copy=check_copy, copy=copy)
    return arms


def run_size(root: str, size: int, blocks: int, rounds: int) -> dict[str, Any]:
    source = torch.randint(0, 256, (blocks, size), dtype=torch.uint8)
    keys = [make_key(i) for i in range(blocks)]
    capacity = max(64 << 20, 4 * blocks * (size + 8192))
    backend = registry.backends.get("lmdb")(capacity=capacity, path=tempfile.mkdtemp(dir=root))
    asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8")))
    raw_env = lmdb.open(
        tempfile.mkdtemp(dir=root),
        map_size=capacity,
        max_dbs=3,
        sync=True,
        metasync=False,
        readahead=True,
        meminit=False,
    )
    raw_db = raw_env.open_db(b"blocks")
    try:
        backend.write_blocks(keys, PoolRows(source, range(blocks)))
        with raw_env.begin(write=True, db=raw_db) as txn:
            for i in range(blocks):
                txn.put(keys[i], memoryview(source[i].numpy()))
        staging = torch.zeros((blocks, size), dtype=torch.uint8)
        arms = _arms(backend, raw_env, raw_db, size, keys, staging)
        arms["tier"]()  # the thread's first job (which the Python form reads and marks), the rows' views kept
        cpu, wall = alternated(arms, [name for name in ARMS if name in arms], staging, source, rounds)
        out = figures(list(arms), [name for name in ARMS[1:] if name in arms], cpu, wall, size, blocks, rounds)
        med = {name: statistics.median(cpu[name]) for name in arms}
        out["gap_us"] = {
            "frame": round(med["tier"] - med["native"], 3),
            "frame_alone": round(med["native_framed"] - med["native"], 3),
            "frame_loads": round(med["tier"] - med["native_framed"], 3),
            "native_over_raw": round(med["native"] - med["raw"], 3),
            "steps": {name: round(med[name], 3) for name in STEPS},
            "checks_sum": round(med["modes"] + med["checks"] + med["guard"] + med["hold"], 3),
        }
        return out
    finally:
        asyncio.run(backend.aclose())
        raw_env.close()


def main() -> None:
    steps_main("lmdb_steps", __doc__, run_size, [4096, 65536])


if __name__ == "__main__":
    main()
