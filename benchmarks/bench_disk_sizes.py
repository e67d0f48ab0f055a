"""Durable disk tiers at every record size: prints one JSON object.

    python benchmarks/bench_disk_sizes.py [--quick] [--dir /tmp] [--rounds N] [--rows pool|views]

For the ``lmdb`` and ``file`` tiers (durable), at 4 KiB, 64 KiB, 256 KiB and 2 MiB records, in
jobs of 1, 16 and 64 blocks, written by one caller or by 4 concurrent callers (threads, each with
its own jobs), it measures the tier's ``write_blocks`` / ``read_blocks`` against raw shapes of the
same durable work done in the same process on the same bytes:

* ``lmdb``: python-lmdb with the tier's sync flags (``sync=True, metasync=False`` and an
  ``env.sync(True)`` per job): ``raw_value`` puts each value in its own transaction, ``raw_job``
  puts a whole job in one; loads are a ``get`` and one copy per block in one read transaction
  per job (``raw_get``).
* ``file``: per block a temporary file, ``pwritev``, a rename, in one directory: ``raw_each``
  ``fdatasync``s each file before its rename and ``fsync``s the directory once per job (what the
  tier did), ``raw_batch`` writes the job's files, ``fdatasync``s them, renames them all and
  ``fsync``s the directory once, ``raw_parallel`` is ``raw_batch`` with the ``fdatasync``s run
  side by side on a pool of 16 threads (as the tier runs them), ``raw_syncfs`` replaces the per-file syncs by one ``syncfs``
  before and one after the renames (informational: it also flushes every other writer of the
  filesystem, so it is not counted as a raw shape to beat), ``raw_sharded`` is ``raw_batch`` in
  the tier's ``sharded`` layout of two levels of shard directories (informational: what that
  layout costs in directory syncs; a new store's default, ``flat``, is one directory); loads ``preadv`` each file,
  opened as the tier opens a record: beneath a descriptor of the folder held open, with the tier's flags,
  the names made before the clock, one head buffer reused (they opened each file by its whole path,
  made in the timed loop, with a new head buffer a file: 64 KiB loads 1.09-1.17x as long as these).

The blocks saved and the rows loaded into are the rows of one pool each (an engine's staging
rows). The tier arms take a job's rows as the engine hands them, a
:class:`~kvtier.pool_rows.PoolRows` of the pool (``--rows pool``, the default: the tier checks
the pool once a job and finds each row by its address), or, with ``--rows views``, as a list of
views of those rows (each row checked on its own); the JSON's ``rows`` (and each cell's) says
which. The raw arms read and write the same rows through views made before the clock.

Each operation is timed once a round, by one arm: ``raw_value`` and ``raw_job`` load alike
(``raw_job`` times it), and so do the flat file arms (``raw_batch``); in jobs of one,
``raw_value`` saves as ``raw_job`` and ``raw_each`` as ``raw_batch``, so those arms do not run.
(Counted twice, the luckier of two draws of one operation was the baseline of each round, and
a tier equal to it came out below 1.) Before each arm, one untimed ``syncfs`` commits what the
last arm left pending (its store's deletion: on a filesystem mounted with ``discard``, the
journal commit that the next arm's first sync forces issues the discards of every extent it
freed, and whichever arm came next paid for them).

LMDB saves are counted into a grown file, as in a store in use (whose evictions free the pages
its saves reuse): each ``lmdb`` arm, tier and raw, first saves into a fresh store (its
``<arm>_fresh_save_blocks_s``), then deletes those records and one spare record more, in two
transactions, and flushes the filesystem (untimed, ``disk_common.raw_empty`` /
``tier_empty``), then makes the counted save of the same records; ``<arm>_save_grew_bytes`` is
the most ``data.mdb`` grew by during one (0 at 256 KiB and 2 MiB; at 4 and 64 KiB a little, as
much for a raw shape making the same transactions: each copies tree pages whose old copies
become free only two transactions later). Saves into a new,
growing file took 1.3-1.5x as long as into freed pages at 2 MiB (1.26-1.49x at 256 KiB), tier
and raw alike, so arms that differed in whether they grew their files were not measured in one
state. The fresh saves stay in the cell: ``<arm>_fresh_save_time_ratio`` (an arm's fresh save's
seconds over its counted one's, median over rounds), ``fresh_save_ratio_paired`` and its
``_spread`` (the tier against the best counted raw shape, fresh saves, round by round).

Each cell reports blocks/s and GB/s of every arm and ``save_ratio`` / ``load_ratio``: the tier over
the best counted raw shape (``*_ratio_paired``: the median, over the rounds, of the tier against
the best counted raw shape of its own round; ``*_ratio_paired_spread``: the lowest and highest of
those per-round ratios, so a run shows its own swing; ``*_ratio_paired_shape``: the same
against the one counted shape that is best by its median, which does not also pick the best
noise of several shapes each round). ``raw_checked`` (informational, both tiers) saves as
``raw_job`` / ``raw_batch`` and loads as the raw loads plus one XXH3 pass over each row and its
key just read (what a tier's check adds); ``load_ceiling_ratio_paired``, its loads against the
best raw load shape's, is the most a checked load reaches on one core. ``raw_cget``
(informational, ``lmdb``, where kvtier's direct lookups are built) loads each job by LMDB's own C
``get`` and ``memcpy`` in one native call and nothing else: ``load_ratio_cget_paired`` (and
``load_cpu_ratio_cget_paired``) is the tier against it, ``cget_over_best_raw_load_paired`` it
against the baseline; the JSON's ``raw_arms`` says what each ``lmdb`` load arm is. A cell of one caller
also reports its loads in thread CPU time (``load_cpu_ratio_paired``, its ``_spread`` and
``load_cpu_ceiling_ratio_paired``, the same ratios of each arm's CPU seconds): what the tier's
load costs the core beside raw's, which the turns other processes take on a shared core do not
move (they move the wall-clock ratios by 0.1-0.7 a round at load 2-5), and its counted saves
likewise (``save_cpu_ratio_paired`` and its ``_spread``: the best counted raw shape's thread CPU
over the tier's, round by round, the system time of each sync included, a pool's threads not
counted: the ``file`` tier's syncs and ``raw_parallel``'s alike; a durable save's wall
time is mostly its syncs, whose waits on this disk swing a round's wall-clock ratio from 0.13
to 6.6 in 64 KiB jobs of 16). Arms alternate within a round and their order reverses every round;
figures are medians over ``--rounds`` rounds after one uncounted warm-up round. Every cell of
one record size moves the same number of blocks, so its cells differ in their jobs alone. ``summary`` holds
the lowest ratio per tier and size. ``--quick`` runs a small grid (jobs of 1 and 16, 4 concurrent
at 64 KiB only) for a shared machine, 5 counted rounds a cell (3 without ``--quick``), and at
most 256 blocks a cell (512 without): an odd count, so each paired median is one round's
ratio. It counted 2, whose median is their mean, so one round slowed by a descheduling moved a
cell's median by half its excess (a 64 KiB cell's rounds of 0.87 and 3.09 gave 1.98), and
medians moved by 0.1 and more from run to run; over 5 rounds two such rounds are outvoted.
Two quick runs each, alternated (load 1.3-2.9): the save medians of the 18 cells moved by 0.024
from one run to the next (median over cells; at most 0.12) against 0.047 (at most 0.28) at 2
rounds, the load medians by 0.022 against 0.061. Only the 4 KiB cells reach the block cap;
halving them keeps a quick run at 1.45x the time of 2 rounds (70-75 s against 46-54 here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmdb
import torch
import xxhash
from kvtier.tools.bench.scripts.disk_common import data_bytes, raw_empty, syncfs, syncfs_fd, tier_empty

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.pool_rows import PoolRows
from kvtier.testing import make_key

SIZES = (4 << 10, 64 << 10, 256 << 10, 2 << 20)
JOBS = (1, 16, 64)
CONCURRENT = 4
#: Counted rounds per cell (``--rounds``): odd, so a median is one round's figure. ``--quick``
#: counts 5 (it counted 2, whose median is their mean: one round slowed by a descheduling moved
#: it by half that round's excess, and paired medians moved by 0.1 and more between adjacent
#: runs); see the module doc.
ROUNDS = 3
QUICK_ROUNDS = 5
#: Blocks a cell moves at most (``--quick``: fewer, so that its 5 rounds take about 1.4x the
#: time its 2 did: only 4 KiB cells reach the cap).
MOST_BLOCKS = 512
QUICK_MOST_BLOCKS = 256


def _blocks(n: int, size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(size)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _open(name: str, size: int, path: str, capacity: int) -> Backend:
    backend = registry.backends.get(name)(capacity=capacity, path=path)
    asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8")))
    return backend


def _split(n: int, job: int, callers: int) -> list[list[range]]:
    """Each caller's jobs: ``n`` blocks in jobs of ``job``, dealt round-robin."""
    jobs = [range(i, min(n, i + job)) for i in range(0, n, job)]
    return [jobs[c::callers] for c in range(callers)]


def _run(parts: list[list[range]], one: Callable[[range], None], cpu: list[float] | None = None) -> float:
    """Run each caller's jobs on a thread of its own (inline for one caller); the seconds spent.
    ``cpu``: for one caller, the thread's CPU seconds are appended to it as well."""
    start = time.perf_counter()
    if len(parts) == 1:
        began = time.thread_time()
        for j in parts[0]:
            one(j)
        if cpu is not None:
            cpu.append(time.thread_time() - began)
    else:
        threads = [threading.Thread(target=lambda p=p: [one(j) for j in p]) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return time.perf_counter() - start


# -- raw shapes ------------------------------------------------------------------------------------


#: The raw arms, in the order they run. Each times an operation only where no other arm makes
#: the same calls: ``raw_value`` loads as ``raw_job`` does (one ``get`` and copy a block, in one
#: read transaction a job), and in jobs of one it saves as ``raw_job`` too, so there it does not
#: run; the file arms load their flat files alike (``raw_batch`` times it), and in jobs of one
#: ``raw_each`` saves as ``raw_batch``. Counting two draws of one operation took, round by
#: round, the luckier of two as the baseline: a tier equal to them came out below 1.
LMDB_SHAPES = ("value", "job", "checked")
FILE_SHAPES = ("each", "batch", "parallel", "syncfs", "sharded", "checked")
#: Raw arms reported but never the baseline (see the module doc).
INFORMATIONAL = ("raw_syncfs", "raw_sharded", "raw_checked", "raw_cget")
#: What each ``lmdb`` load arm is, as the JSON says (``raw_arms``).
LMDB_LOAD_ARMS = {
    "raw_job": "python-lmdb's Transaction.get and a copy into the row, a read transaction a job: the goal's baseline",
    "raw_checked": "raw_job plus one XXH3 pass over each row and its key: informational (a one-core ceiling)",
    "raw_cget": "LMDB's own C get and memcpy, a read transaction and one native call a job, nothing else: "
    "informational (a reference, never the baseline; only where kvtier's direct lookups are built)",
}


def _raw_lmdb(path: str, capacity: int) -> tuple[lmdb.Environment, Any]:
    env = lmdb.open(path, map_size=capacity, max_dbs=3, sync=True, metasync=False, readahead=True, meminit=False)
    return env, env.open_db(b"blocks")


def _arrays(rows: list[torch.Tensor]) -> list[memoryview]:
    """A view of each row, made before the clock: a raw arm, like the tier (whose row views
    are kept across jobs), converts no tensor in its timed loop (``Tensor.numpy()`` cost
    1.5 us a row here, more than a 4 KiB get's copy)."""
    return [memoryview(r.numpy()) for r in rows]


def _raw_lmdb_put(env: lmdb.Environment, db: Any, keys: list[bytes], blocks: list[torch.Tensor], per_job: bool) -> Callable[[range], None]:
    arrays = _arrays(blocks)

    def one(j: range) -> None:
        if per_job:
            with env.begin(write=True, db=db) as txn:
                for i in j:
                    txn.put(keys[i], arrays[i])
        else:
            for i in j:
                with env.begin(write=True, db=db) as txn:
                    txn.put(keys[i], arrays[i])
        env.sync(True)

    return one


def _raw_lmdb_get(env: lmdb.Environment, db: Any, keys: list[bytes], outs: list[torch.Tensor], checked: bool = False) -> Callable[[range], None]:
    """``checked``: each row then hashed once, as the tier checks it (:func:`_check`)."""
    rows = _arrays(outs)

    def one(j: range) -> None:
        with env.begin(buffers=True, db=db) as txn:
            for i in j:
                row = rows[i]
                row[:] = txn.get(keys[i])
                if checked:
                    _check(keys[i], row)

    return one


def _raw_lmdb_cget(env: lmdb.Environment, db: Any, keys: list[bytes], outs: list[torch.Tensor], parts: list[list[range]]) -> Callable[[range], None] | None:
    """The reference load (``raw_cget``): each job's values copied into their rows by LMDB's own
    C ``get`` and ``memcpy`` in one native call (``_rowguard.direct_copy``, on the engine
    ``lmdb_direct.direct_gets`` probed for ``env``), nothing else; ``None`` where that is not
    built or not probed sound (and in a tree without it)."""
    try:
        from kvtier.backends import _rowguard, lmdb_direct  # type: ignore[attr-defined]
    except ImportError:
        return None
    copy = getattr(_rowguard, "direct_copy", None)
    direct = None if copy is None else lmdb_direct.direct_gets(env, db, keys[0], db, db)
    if direct is None:
        return None
    rows = _arrays(outs)
    jobs = {j.start: ([keys[i] for i in j], [rows[i] for i in j]) for part in parts for j in part}  # before the clock

    def one(j: range) -> None:
        job_keys, job_rows = jobs[j.start]
        with env.begin(buffers=True, db=db) as txn:
            copy(direct, env, txn, db, job_keys, job_rows)

    return one


def _check(key: bytes, row: memoryview) -> int:
    """One XXH3 over a key and its row just read: what a tier's check of a plain record costs
    beyond a raw read (it goes on from a state that holds the record's head, as this one goes on
    from an empty one)."""
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(row)
    return h.intdigest()  # type: ignore[no-any-return]


_pool = ThreadPoolExecutor(16, thread_name_prefix="raw-fsync")


#: Before each arm, the filesystem's pending work (the last arm's deleted store) is committed
#: outside the clock (:func:`_settle`); ``False``: not (to measure what settling changes).
SETTLE = True


def _settle(root: str) -> None:
    """One ``syncfs`` of the filesystem that holds ``root``, untimed: the last arm's store was
    just deleted, and on a filesystem mounted with ``discard`` (ext4 here) the journal commit
    that the next arm's first sync forces issues the discards of every extent it freed, so
    whichever arm came next paid for the last one's deletion within its own save."""
    syncfs(root)


def _shard(i: int) -> str:
    h = make_key(i).hex()
    return os.path.join(h[:2], h[2:4])


def _raw_file_write(folder: str, blocks: list[torch.Tensor], shape: str) -> Callable[[range], None]:
    """``sharded``: ``batch`` in the tier's layout (two levels of directories, new ones synced
    into their parents, each touched directory synced once per job)."""
    header = bytes(32)
    arrays = _arrays(blocks)
    dir_fd = os.open(folder, os.O_RDONLY)
    seq = iter(range(1 << 62))
    lock = threading.Lock()

    def one(j: range) -> None:
        with lock:
            tag = next(seq)
        if shape == "sharded":
            sharded(j, tag)
            return
        names = []
        fds = []
        for i in j:
            tmp, name = f"{i}.{tag}.tmp", f"{i}.kvb"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            os.pwritev(fd, [header, arrays[i]], 0)
            if shape == "each":
                os.fdatasync(fd)
                os.close(fd)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            else:
                fds.append(fd)
                names.append((tmp, name))
        if shape == "batch":
            for fd in fds:
                os.fdatasync(fd)
        elif shape == "parallel":
            list(_pool.map(os.fdatasync, fds))
        elif shape == "syncfs":
            syncfs_fd(dir_fd)
        for fd in fds:
            os.close(fd)
        for tmp, name in names:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if shape == "syncfs":
            syncfs_fd(dir_fd)
        else:
            os.fsync(dir_fd)

    def sharded(j: range, tag: int) -> None:
        files = []
        dirs: set[str] = set()
        for i in j:
            shard = _shard(i)
            path = os.path.join(folder, shard)
            if not os.path.isdir(path):
                os.makedirs(path, exist_ok=True)
                dirs.update((folder, os.path.dirname(path)))
            dirs.add(path)
            tmp = os.path.join(path, f"{i}.{tag}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.pwritev(fd, [header, arrays[i]], 0)
            files.append((fd, tmp, os.path.join(path, f"{i}.kvb")))
        for fd, _, _ in files:
            os.fdatasync(fd)
            os.close(fd)
        for _, tmp, name in files:
            os.replace(tmp, name)
        for d in sorted(dirs):
            fd = os.open(d, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    one.close = lambda: os.close(dir_fd)  # type: ignore[attr-defined]
    return one


#: How a raw load opens a file: the tier's flags (``backends/file_reads.py``).
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def _raw_file_read(folder: str, outs: list[torch.Tensor], sharded: bool, keys: list[bytes] | None = None) -> Callable[[range], None]:
    """Each file opened beneath a descriptor of ``folder`` held open, with the tier's flags, its
    name made before the clock, its head read into one buffer a load reuses: as the tier reads
    a record (an ``openat`` of one name beneath its root's descriptor, a head buffer of its
    own). ``keys``: each row then hashed once with its key (:func:`_check`)."""
    rows = _arrays(outs)
    names = [os.path.join(_shard(i), f"{i}.kvb") if sharded else f"{i}.kvb" for i in range(len(outs))]
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    header = bytearray(32)

    def one(j: range) -> None:
        for i in j:
            fd = os.open(names[i], READ_FLAGS, dir_fd=dir_fd)
            try:
                row = rows[i]
                os.preadv(fd, [header, row], 0)
            finally:
                os.close(fd)
            if keys is not None:
                _check(keys[i], row)

    one.close = lambda: os.close(dir_fd)  # type: ignore[attr-defined]
    return one


# -- one cell ----------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def paired(base: Sequence[float], side: Sequence[float]) -> list[float]:
    """Per round, the side's speed as a share of the base's (both given as seconds)."""
    return [b / t for b, t in zip(base, side)]


def plan(sizes: Sequence[int], *, quick: bool) -> list[tuple[int, int, int, int]]:
    """The cells to measure: ``(record bytes, blocks per job, callers, blocks)``. Every cell of
    one size moves the same number of blocks, a multiple of each of its shapes' ``job *
    callers``, so its cells differ in their jobs alone. Counts that differed by shape measured
    the cache, not the jobs: at 2 MiB in ``--quick`` jobs of 1 read 4 blocks (8 MiB, inside the
    16 MiB L3 cache here) and jobs of 16 read 32 (64 MiB), and jobs of 1 seemed to load 15 %
    nearer raw than jobs of 16; with 32 blocks each, the tier reads both at the same speed."""
    target = (8 << 20) if quick else (64 << 20)
    most = QUICK_MOST_BLOCKS if quick else MOST_BLOCKS
    cells = []
    for size in sizes:
        shapes = [(job, 1) for job in ((1, 16) if quick else JOBS)]
        if not quick or size == 64 << 10:
            shapes.append((16, CONCURRENT))
        span = max(job * callers for job, callers in shapes)
        n = max(2 * span, min(most, target // size) // span * span)
        cells.extend((size, job, callers, n) for job, callers in shapes)
    return cells


def _cell(root: str, tier: str, size: int, job: int, callers: int, rounds: int, n: int, rows: str = "pool") -> dict[str, Any]:
    # The blocks and the rows loaded into are rows of one pool each (an engine's staging rows):
    # the tier arms take a job's rows as PoolRows of its pool (rows="pool", the engine's path) or
    # as a list of views of them ("views"); the raw arms use views of the same rows, made before
    # the clock.
    source = torch.stack(_blocks(n, size))
    blocks = list(source)
    keys = [make_key(i) for i in range(n)]
    staging = torch.empty((n, size), dtype=torch.uint8)
    outs = list(staging)
    pooled = rows == "pool"
    parts = _split(n, job, callers)
    capacity = max(64 << 20, 4 * n * (size + 8192))
    saves: dict[str, list[float]] = {}
    loads: dict[str, list[float]] = {}
    fresh_saves: dict[str, list[float]] = {}  # lmdb: each arm's first save, into a new file
    grew: dict[str, list[int]] = {}  # lmdb: bytes data.mdb grew by during the counted save
    load_cpus: dict[str, list[float]] = {}  # one caller: each arm's load in thread CPU seconds
    save_cpus: dict[str, list[float]] = {}  # one caller: each arm's counted save in thread CPU seconds
    cpu: list[float] = []  # the thread CPU of the arm's load that just ran (one caller)
    save_cpu: list[float] = []  # the thread CPU of the arm's counted save that just ran (one caller)
    for r in range(rounds + 1):
        arms: list[tuple[str, Callable[[], tuple[float | None, float | None, float | None]]]] = []

        def tier_arm() -> tuple[float, float, float | None]:
            path = tempfile.mkdtemp(dir=root)
            backend = _open(tier, size, path, capacity)
            try:
                # Each job's key and block lists are built before the clock starts, as for its
                # loads below: a raw arm indexes its lists without building any.
                saved = {j.start: ([keys[i] for i in j], PoolRows(source, j) if pooled else [blocks[i] for i in j]) for part in parts for j in part}
                save_all = lambda spent=None: _run(parts, lambda j: backend.write_blocks(*saved[j.start]), spent)  # noqa: E731
                fresh = None
                if tier == "lmdb":  # the counted save goes into a grown file (see the module doc)
                    fresh = save_all()
                    tier_empty(backend, keys, blocks[0], path)
                    before = data_bytes(path)
                save = save_all(save_cpu)
                if tier == "lmdb":
                    grew.setdefault("tier", []).append(data_bytes(path) - before)
                for o in outs:  # by numpy: after Tensor.zero_ torch's OpenMP pool spins on the other core through the timed load
                    o.numpy().fill(0)
                # Each job's key and row lists are built before the clock starts, as a raw arm
                # indexes its lists without building any.
                jobs = {j.start: ([keys[i] for i in j], PoolRows(staging, j) if pooled else [outs[i] for i in j]) for part in parts for j in part}
                load = _run(parts, lambda j: backend.read_blocks(*jobs[j.start]), cpu)
                assert all(torch.equal(o, b) for o, b in zip(outs, blocks)), f"{tier} read back other bytes"
            finally:
                asyncio.run(backend.aclose())
                shutil.rmtree(path)
            return save, load, fresh

        arms.append(("tier", tier_arm))
        if tier == "lmdb":
            for shape in LMDB_SHAPES if job > 1 else LMDB_SHAPES[1:]:

                def lmdb_arm(shape: str = shape) -> tuple[float | None, float | None, float | None]:
                    path = tempfile.mkdtemp(dir=root)
                    env, db = _raw_lmdb(path, capacity)
                    try:
                        put = _raw_lmdb_put(env, db, keys, blocks, per_job=shape != "value")
                        fresh = _run(parts, put)
                        raw_empty(env, db, keys, blocks[0], path)
                        before = data_bytes(path)
                        save = _run(parts, put, save_cpu)
                        grew.setdefault(f"raw_{shape}", []).append(data_bytes(path) - before)
                        load = None if shape == "value" else _run(parts, _raw_lmdb_get(env, db, keys, outs, checked=shape == "checked"), cpu)
                    finally:
                        env.close()
                        shutil.rmtree(path)
                    return save, load, fresh

                arms.append((f"raw_{shape}", lmdb_arm))

            def cget_arm() -> tuple[float | None, float | None, float | None]:
                path = tempfile.mkdtemp(dir=root)
                env, db = _raw_lmdb(path, capacity)
                try:
                    put = _raw_lmdb_put(env, db, keys, blocks, per_job=True)  # raw_job's saves, not timed: the file as raw_job's is at its load
                    _run(parts, put)
                    raw_empty(env, db, keys, blocks[0], path)
                    _run(parts, put)
                    read = _raw_lmdb_cget(env, db, keys, outs, parts)
                    load = None if read is None else _run(parts, read, cpu)
                finally:
                    env.close()
                    shutil.rmtree(path)
                return None, load, None

            arms.append(("raw_cget", cget_arm))
        else:
            for shape in FILE_SHAPES if job > 1 else FILE_SHAPES[1:]:

                def file_arm(shape: str = shape) -> tuple[float | None, float | None, float | None]:
                    path = tempfile.mkdtemp(dir=root)
                    write = _raw_file_write(path, blocks, "batch" if shape == "checked" else shape)
                    try:
                        save = _run(parts, write, save_cpu)
                        loaded = shape in ("batch", "sharded", "checked")
                        load = None
                        if loaded:
                            read = _raw_file_read(path, outs, shape == "sharded", keys if shape == "checked" else None)
                            try:
                                load = _run(parts, read, cpu)
                            finally:
                                read.close()  # type: ignore[attr-defined]
                    finally:
                        write.close()  # type: ignore[attr-defined]
                        shutil.rmtree(path)
                    return save, load, None

                arms.append((f"raw_{shape}", file_arm))
        for name, arm in arms if r % 2 == 0 else arms[::-1]:
            if SETTLE:
                _settle(root)
            cpu.clear()
            save_cpu.clear()
            save, load, fresh = arm()
            if r and cpu:
                load_cpus.setdefault(name, []).append(cpu[-1])
            if r and save_cpu and save is not None:
                save_cpus.setdefault(name, []).append(save_cpu[-1])
            if r:  # round 0 warms up
                if save is not None:
                    saves.setdefault(name, []).append(save)
                if fresh is not None:
                    fresh_saves.setdefault(name, []).append(fresh)
                if load is not None:
                    loads.setdefault(name, []).append(load)
    total = n * size
    cell: dict[str, Any] = {"tier": tier, "record_bytes": size, "job_blocks": job, "callers": callers, "blocks": n, "rows": rows}
    for name in saves:
        s = _median(saves[name])
        cell[f"{name}_save_blocks_s"] = round(n / s, 1)
        cell[f"{name}_save_gbps"] = round(total / s / 1e9, 4)
        cell[f"{name}_save_spread"] = round((max(saves[name]) - min(saves[name])) / s, 3)
    for name in loads:
        cell[f"{name}_load_gbps"] = round(total / _median(loads[name]) / 1e9, 3)
    counted_saves = [k for k in saves if k.startswith("raw_") and k not in INFORMATIONAL]
    counted_loads = [k for k in loads if k.startswith("raw_") and k not in INFORMATIONAL]
    best_save = max(counted_saves, key=lambda k: cell[f"{k}_save_blocks_s"])
    best_load = max(counted_loads, key=lambda k: cell[f"{k}_load_gbps"])
    cell["best_raw_save"] = best_save
    cell["best_raw_load"] = best_load
    cell["save_ratio"] = round(cell["tier_save_blocks_s"] / cell[f"{best_save}_save_blocks_s"], 3)
    cell["load_ratio"] = round(cell["tier_load_gbps"] / cell[f"{best_load}_load_gbps"], 3)
    # Round by round, against the best counted raw shape of the same round (drift in the
    # machine's load hits both terms alike): the median of those ratios.
    for op, times, counted in (("save", saves, counted_saves), ("load", loads, counted_loads)):
        best_raw = [min(times[k][r] for k in counted) for r in range(len(times["tier"]))]
        per_round = [b / t for b, t in zip(best_raw, times["tier"])]
        cell[f"{op}_ratio_paired"] = round(_median(per_round), 3)
        cell[f"{op}_ratio_paired_spread"] = [round(min(per_round), 3), round(max(per_round), 3)]
        # The same against one shape, the best by its median: the best of several shapes
        # round by round also picks their noise (in jobs of 1 ``raw_each`` and ``raw_batch``
        # make the same system calls), which holds a tier equal to them below 1.
        shape = best_save if op == "save" else best_load
        cell[f"{op}_ratio_paired_shape"] = round(_median(paired(times[shape], times["tier"])), 3)
    if fresh_saves:
        # The same saves into a new, growing data.mdb (each arm's first, before the store was
        # emptied): reported beside the counted ones, which went into a grown file.
        for name, times in fresh_saves.items():
            cell[f"{name}_fresh_save_blocks_s"] = round(n / _median(times), 1)
        for name, sizes in grew.items():
            cell[f"{name}_save_grew_bytes"] = max(sizes)
        best_fresh = [min(fresh_saves[k][r] for k in counted_saves) for r in range(len(fresh_saves["tier"]))]
        per_round = [b / t for b, t in zip(best_fresh, fresh_saves["tier"])]
        cell["fresh_save_ratio_paired"] = round(_median(per_round), 3)
        cell["fresh_save_ratio_paired_spread"] = [round(min(per_round), 3), round(max(per_round), 3)]
        # What growing the file costs each arm: its fresh save's time over its grown one's.
        for name in fresh_saves:
            cell[f"{name}_fresh_save_time_ratio"] = round(_median(paired(fresh_saves[name], saves[name])), 3)
    # A raw load with one check pass over each row, against the best raw load: a one-core ceiling.
    cell["load_ceiling_ratio_paired"] = round(_median(paired(loads[best_load], loads["raw_checked"])), 3)
    if "raw_cget" in loads:  # the tier against the reference load, and that against the baseline
        cell["load_ratio_cget_paired"] = round(_median(paired(loads["raw_cget"], loads["tier"])), 3)
        cell["cget_over_best_raw_load_paired"] = round(_median(paired(loads[best_load], loads["raw_cget"])), 3)
    if save_cpus:  # one caller: the save ratio in thread CPU too (syncs' own system time included)
        best_cpu = [min(save_cpus[k][r] for k in counted_saves) for r in range(len(save_cpus["tier"]))]
        per_round = [b / t for b, t in zip(best_cpu, save_cpus["tier"])]
        cell["save_cpu_ratio_paired"] = round(_median(per_round), 3)
        cell["save_cpu_ratio_paired_spread"] = [round(min(per_round), 3), round(max(per_round), 3)]
    if load_cpus:  # one caller: the same ratios in thread CPU, which other processes' turns on the core do not move
        best_cpu = [min(load_cpus[k][r] for k in counted_loads) for r in range(len(load_cpus["tier"]))]
        per_round = [b / t for b, t in zip(best_cpu, load_cpus["tier"])]
        cell["load_cpu_ratio_paired"] = round(_median(per_round), 3)
        cell["load_cpu_ratio_paired_spread"] = [round(min(per_round), 3), round(max(per_round), 3)]
        cell["load_cpu_ceiling_ratio_paired"] = round(_median(paired(load_cpus[best_load], load_cpus["raw_checked"])), 3)
        if "raw_cget" in load_cpus:
            cell["load_cpu_ratio_cget_paired"] = round(_median(paired(load_cpus["raw_cget"], load_cpus["tier"])), 3)
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small grid, for a shared machine")
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    parser.add_argument("--rounds", type=int, default=None, help=f"counted rounds per cell (default {ROUNDS}, --quick {QUICK_ROUNDS})")
    parser.add_argument("--tiers", nargs="+", default=["lmdb", "file"], choices=["lmdb", "file"])
    parser.add_argument("--sizes", nargs="+", type=int, default=None, help="record sizes in bytes")
    parser.add_argument(
        "--rows", default="pool", choices=["pool", "views"],
        help="how the tier arms get a job's rows: PoolRows of one pool (default, the engine's path) or a list of views of its rows",
    )
    args = parser.parse_args()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    grid = plan(tuple(args.sizes) if args.sizes else SIZES, quick=args.quick)
    root = tempfile.mkdtemp(prefix="kvtier-bench-sizes-", dir=args.dir)
    cells = []
    try:
        for tier in args.tiers:
            for size, job, callers, n in grid:
                cells.append(_cell(root, tier, size, job, callers, rounds, n, rows=args.rows))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict[str, float] = {}
    for c in cells:
        for op in ("save", "load"):
            name = f"{c['tier']}_{c['record_bytes'] >> 10}k_min_{op}_ratio"
            summary[name] = min(summary.get(name, 9e9), c[f"{op}_ratio"])
    arms = {"raw_arms": LMDB_LOAD_ARMS} if "lmdb" in args.tiers else {}
    print(json.dumps({"rounds": rounds, "quick": args.quick, "rows": args.rows, **arms, "summary": summary, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
