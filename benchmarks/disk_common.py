"""What the disk benchmarks share (``bench_disk.py`` and its cold part, ``disk_cold.py``): the
KV-like blocks, timing helpers, and the LMDB job both the tier and raw python-lmdb run."""

from __future__ import annotations

import asyncio
import ctypes
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lmdb
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import make_key
from kvtier.tools.bench import paired, spread

BLOCK = 2 << 20
MAC_SECRET = "bench-disk-mac-secret-0123456789"
JOB = 8  # blocks per write/read job, as the transfer engine batches them


def kv_like_blocks(n: int, block_bytes: int = BLOCK, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head_dim = 128
    rows = block_bytes // 2 // head_dim
    blocks = []
    for i in range(n):
        channel_scale = torch.logspace(-1.5, 0.7, head_dim)[torch.randperm(head_dim, generator=g)]
        drift = 1 + 0.2 * torch.sin(torch.arange(rows).float() / 37 + i)[:, None]
        values = torch.randn(rows, head_dim, generator=g) * channel_scale * drift
        blocks.append(values.to(torch.bfloat16).view(-1).view(torch.uint8).clone())
    return blocks


def best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def alternating(arms: Sequence[Callable[[], float]], rounds: int, warmed: Callable[[], None] | None = None) -> list[list[float]]:
    """Each arm's seconds (what it returns) over ``rounds`` counted rounds, after one uncounted
    warm-up round (then ``warmed()``, for arms that note more than their seconds), the order of
    the arms reversed every round: whichever arm runs first in a round was measured up to 4x
    slower here (the first save after the others' files were deleted, the first load after the
    saves), and a fixed order would charge all of that to one arm."""
    times: list[list[float]] = [[] for _ in arms]
    order = list(range(len(arms)))
    for r in range(rounds + 1):
        for i in order if r % 2 else order[::-1]:
            t = arms[i]()
            if r:
                times[i].append(t)
        if not r and warmed is not None:
            warmed()
    return times


def paired_ratio(res: dict[str, Any], name: str, base_seconds: Sequence[float], side_seconds: Sequence[float]) -> None:
    """Put the side's speed as a share of the baseline's, round by round (each against the
    baseline of its own round, so drift in the machine's load hits both terms alike), into
    ``res``: ``<name>_paired``, their median, and ``<name>_spread``, their minimum, quartiles and
    maximum."""
    rounds = paired(base_seconds, side_seconds)
    res[f"{name}_paired"] = round(statistics.median(rounds), 3)
    res[f"{name}_spread"] = spread(rounds)


def jobs(n: int) -> list[range]:
    return [range(i, min(n, i + JOB)) for i in range(0, n, JOB)]


def open_backend(name: str, fmt: BlockFormat, **options: Any) -> Backend:
    backend = registry.backends.get(name)(**options)
    asyncio.run(backend.open(fmt))
    return backend


# -- lmdb ------------------------------------------------------------------------------------------


def lmdb_job(blocks: list[torch.Tensor]) -> tuple[int, int, list[bytes], list[torch.Tensor], BlockFormat, int]:
    """What both LMDB benchmarks start from: block count, bytes, keys, output buffers, the
    record format and a map three times the job's size."""
    n = len(blocks)
    total = n * BLOCK
    outs = [torch.empty(BLOCK, dtype=torch.uint8) for _ in range(n)]
    return n, total, [make_key(i) for i in range(n)], outs, BlockFormat(block_bytes=BLOCK, dtype="bfloat16"), 3 * total


def tier_write(backend: Backend, keys: list[bytes], blocks: list[torch.Tensor]) -> float:
    """Write every block, job by job; the seconds spent in the tier."""
    return sum(timed(lambda j=j: backend.write_blocks([keys[i] for i in j], [blocks[i] for i in j])) for j in jobs(len(keys)))


def tier_read(backend: Backend, keys: list[bytes], outs: list[torch.Tensor]) -> float:
    """Read every block back, job by job; the seconds spent in the tier."""
    return sum(timed(lambda j=j: backend.read_blocks([keys[i] for i in j], [outs[i] for i in j])) for j in jobs(len(keys)))


def raw_env(path: str, capacity: int, *, readahead: bool = False, durable: bool = True) -> tuple[lmdb.Environment, Any]:
    """A raw python-lmdb environment synced as the tier's durable mode is (``durable=False``:
    as its fast mode, no syncs), and its database."""
    env = lmdb.open(path, map_size=capacity, max_dbs=3, sync=durable, metasync=False, readahead=readahead, meminit=False)
    return env, env.open_db(b"blocks")


def raw_put(env: lmdb.Environment, db: Any, keys: list[bytes], blocks: list[torch.Tensor], which: Iterable[int]) -> None:
    """Put the blocks at ``which``, one transaction per value (the tier's shape)."""
    for i in which:
        with env.begin(write=True, db=db) as txn:
            txn.put(keys[i], blocks[i].numpy())


def raw_read(env: lmdb.Environment, db: Any, keys: list[bytes], outs: list[torch.Tensor]) -> float:
    """A ``get`` and one copy per block, one read transaction per job; the seconds spent."""

    def job(j: range) -> None:
        with env.begin(buffers=True, db=db) as txn:
            for i in j:
                memoryview(outs[i].numpy())[:] = txn.get(keys[i])

    return sum(timed(lambda j=j: job(j)) for j in jobs(len(keys)))


# -- a grown store ---------------------------------------------------------------------------------
#
# A save into a new ``data.mdb`` grows the file, and growing it cost 1.45-1.54x the time of the
# same save into pages written and freed before (raw python-lmdb, 2 MiB jobs of 16): two arms of
# one bench differed by whether they grew their files. A store in use saves into the pages its
# evictions freed, so the save ratios are measured there: each arm first fills a fresh store
# (timed apart: its "fresh" figure), empties it (untimed), then makes the counted save.


def data_bytes(path: str) -> int:
    """The size of ``<path>/data.mdb``: how far an LMDB store has grown its file."""
    return os.path.getsize(os.path.join(path, "data.mdb"))


#: The key of one record more than a fill's, put and deleted with them: LMDB's free-page
#: bookkeeping takes a few pages of what the deletions freed, so without it the counted save
#: of a 2 MiB cell still grew the file by one record (measured: with it, by none).
SPARE_KEY = make_key(1 << 62)


def halves(keys: Sequence[bytes]) -> list[Sequence[bytes]]:
    """``keys`` in two parts, deleted in two transactions: LMDB hands the pages a transaction
    freed only to a transaction two after it, so after deletions in two transactions the first
    save reuses the first half's pages, and the next ones the rest."""
    mid = (len(keys) + 1) // 2
    return [keys[:mid], keys[mid:]]


def raw_empty(env: lmdb.Environment, db: Any, keys: Sequence[bytes], spare: torch.Tensor, path: str) -> None:
    """Put one record more (``spare``, under :data:`SPARE_KEY`), delete it and ``keys`` from a
    raw store at ``path`` (see :func:`halves`), then flush its filesystem (:func:`syncfs`), all
    outside any clock."""
    with env.begin(write=True, db=db) as txn:
        txn.put(SPARE_KEY, spare.numpy())
    for part in halves([*keys, SPARE_KEY]):
        with env.begin(write=True, db=db) as txn:
            for key in part:
                txn.delete(key)
    syncfs(path)


def tier_empty(backend: Backend, keys: Sequence[bytes], spare: torch.Tensor, path: str) -> None:
    """What :func:`raw_empty` does, through a tier: the same state for its counted save."""
    if backend.write_blocks([SPARE_KEY], [spare])[0] is None:
        raise RuntimeError(f"the spare record did not fit {path!r}")
    for part in halves([*keys, SPARE_KEY]):
        backend.delete_blocks(part)
    syncfs(path)


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs_fd(fd: int, path: str | None = None) -> None:
    """``syncfs`` of the filesystem that holds the open descriptor ``fd`` (of ``path``, named
    in the error)."""
    if _libc.syncfs(fd) != 0:
        raise OSError(ctypes.get_errno(), "syncfs failed", path)


def syncfs(path: str) -> None:
    """``syncfs`` of the filesystem that holds ``path``: what a deletion left pending (its
    meta page, freed extents) is written out before the next clock starts, not inside it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        syncfs_fd(fd, path)
    finally:
        os.close(fd)
