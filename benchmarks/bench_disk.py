"""Disk and compression tier benchmark: prints one JSON object.

    python benchmarks/bench_disk.py [--quick] [--dir /tmp]

Measures, in one run on the same data (2 MiB blocks of KV-like bf16: per-channel scales across
a 128-wide head dimension times gaussian noise, slowly varying over tokens):

* the ``lmdb`` tier's save/load GB/s against raw python-lmdb put/get of the same bytes from/into
  a tensor with the same sync mode and transaction shape (``lmdb_*_ratio``), and the transaction
  shape itself (one value per transaction vs one transaction per job);
* the same with keyed records (the default MAC, AES-GMAC: ``lmdb_mac_*``; ``mac_load_cost`` /
  ``mac_save_cost`` are the keyed tier's GB/s over the plain tier's), and keyed loads with
  ``mac_algorithm: blake3`` and ``hmac-sha256`` (``lmdb_blake3_load_gbps``, ``blake3_load_cost``,
  ``lmdb_hmac_load_gbps``, ``hmac_load_cost``);
* a cold-cache load: each run reopens the environment after evicting its file from the page
  cache (``posix_fadvise(DONTNEED)`` on the file, or ``--drop-caches``: ``echo 3 >
  /proc/sys/vm/drop_caches``, root only), tier and raw alike, both reading the tier's own file
  (``lmdb_cold_*``, ``--cold-rounds`` rounds), with two sides that say where the tier's time
  goes (raw plus a serial XXH3 pass, ``raw_lmdb_cold_get_checked_gbps``; the tier with its check
  patched out, ``lmdb_cold_unchecked_load_gbps``), and what the tier's open reads of the cold file
  (``lmdb_cold_open_seconds``, ``lmdb_cold_open_read_fraction`` of its pages, by ``mincore``);
* whether this host can overlap cold reads with copies at all (``cold_contention``): raw cold
  ``get`` GB/s alone and with another thread copying memory meanwhile
  (``raw_lmdb_cold_get_alone_gbps``, ``raw_lmdb_cold_get_beside_copies_gbps``, and their ratio
  ``cold_get_beside_copies_ratio``);
* the ``file`` tier's save/load GB/s; its save against the same durable write protocol done raw
  (temporary file, ``pwritev``, ``fdatasync``, rename, one directory ``fsync`` per job:
  ``raw_file_write_gbps``, ``file_save_ratio``), and reading records with aiofiles vs
  ``os.preadv`` into the caller's buffer in a worker thread;
* how many blocks a GiB of the ``compressed`` tier holds vs the ``cpu`` tier, and its save and load speed (no raw baseline);
* zstd ratio and MB/s with and without byte-shuffle;
* how long ``scan()`` takes to rebuild the index of an lmdb store with many records.

Disk throughputs are the median of ``--repeat`` interleaved runs (tier and raw alternate, so
drift in the disk hits both alike), after one uncounted warm-up round. The order within a round
reverses every round: whichever side ran first in a round was measured up to 4x slower here (the
first save after the others' files were deleted, the first load after the saves), and a fixed
order charged all of that to one side (the tier, until this was changed). Codec speeds are the
best run. The page cache is warm, as in
steady state, so loads measure the CPU path (copy + XXH3 check), not the device; the cold-cache
figures measure the device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import lmdb
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records.codec import resolve_codec
from kvtier.testing import cached_pages, evict_from_page_cache, make_key

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


def jobs(n: int) -> list[range]:
    return [range(i, min(n, i + JOB)) for i in range(0, n, JOB)]


def open_backend(name: str, fmt: BlockFormat, **options: Any) -> Backend:
    backend = registry.backends.get(name)(**options)
    asyncio.run(backend.open(fmt))
    return backend


# -- lmdb ------------------------------------------------------------------------------------------


def _lmdb_job(blocks: list[torch.Tensor]) -> tuple[int, int, list[bytes], list[torch.Tensor], BlockFormat, int]:
    """What both LMDB benchmarks start from: block count, bytes, keys, output buffers, the
    record format and a map three times the job's size."""
    n = len(blocks)
    total = n * BLOCK
    outs = [torch.empty(BLOCK, dtype=torch.uint8) for _ in range(n)]
    return n, total, [make_key(i) for i in range(n)], outs, BlockFormat(block_bytes=BLOCK, dtype="bfloat16"), 3 * total


def _tier_write(backend: Backend, keys: list[bytes], blocks: list[torch.Tensor]) -> float:
    """Write every block, job by job; the seconds spent in the tier."""
    return sum(timed(lambda j=j: backend.write_blocks([keys[i] for i in j], [blocks[i] for i in j])) for j in jobs(len(keys)))


def _tier_read(backend: Backend, keys: list[bytes], outs: list[torch.Tensor]) -> float:
    """Read every block back, job by job; the seconds spent in the tier."""
    return sum(timed(lambda j=j: backend.read_blocks([keys[i] for i in j], [outs[i] for i in j])) for j in jobs(len(keys)))


def _raw_env(path: str, capacity: int, *, readahead: bool = False, durable: bool = True) -> tuple[lmdb.Environment, Any]:
    """A raw python-lmdb environment synced as the tier's durable mode is (``durable=False``:
    as its fast mode, no syncs), and its database."""
    env = lmdb.open(path, map_size=capacity, max_dbs=3, sync=durable, metasync=False, readahead=readahead, meminit=False)
    return env, env.open_db(b"blocks")


def _raw_put(env: lmdb.Environment, db: Any, keys: list[bytes], blocks: list[torch.Tensor], which: Iterable[int]) -> None:
    """Put the blocks at ``which``, one transaction per value (the tier's shape)."""
    for i in which:
        with env.begin(write=True, db=db) as txn:
            txn.put(keys[i], blocks[i].numpy())


def _raw_read(env: lmdb.Environment, db: Any, keys: list[bytes], outs: list[torch.Tensor]) -> float:
    """A ``get`` and one copy per block, one read transaction per job; the seconds spent."""

    def job(j: range) -> None:
        with env.begin(buffers=True, db=db) as txn:
            for i in j:
                memoryview(outs[i].numpy())[:] = txn.get(keys[i])

    return sum(timed(lambda j=j: job(j)) for j in jobs(len(keys)))


def bench_lmdb(root: str, blocks: list[torch.Tensor], repeat: int, sync_mode: str = "durable") -> dict[str, Any]:
    n, total, keys, outs, fmt, capacity = _lmdb_job(blocks)
    durable = sync_mode == "durable"

    def tier_save(**options: Any) -> float:
        path = tempfile.mkdtemp(dir=root)
        backend = open_backend("lmdb", fmt, capacity=capacity, path=path, sync_mode=sync_mode, **options)
        t = _tier_write(backend, keys, blocks)
        asyncio.run(backend.aclose())
        shutil.rmtree(path)
        return t

    def raw_save(per_job: bool = False) -> float:
        path = tempfile.mkdtemp(dir=root)
        env, db = _raw_env(path, capacity, durable=durable)

        def job(j: range) -> None:
            if per_job:
                with env.begin(write=True, db=db) as txn:
                    for i in j:
                        txn.put(keys[i], blocks[i].numpy())
            else:
                _raw_put(env, db, keys, blocks, j)
            if durable:
                env.sync(True)

        t = sum(timed(lambda j=j: job(j)) for j in jobs(n))
        env.close()
        shutil.rmtree(path)
        return t

    # Load: one populated store per side, read back job by job.
    tier_path = tempfile.mkdtemp(dir=root)
    backend = open_backend("lmdb", fmt, capacity=capacity, path=tier_path, sync_mode=sync_mode)
    _tier_write(backend, keys, blocks)
    raw_path = tempfile.mkdtemp(dir=root)
    env, db = _raw_env(raw_path, capacity, durable=durable)
    _raw_put(env, db, keys, blocks, range(n))

    mac_path = tempfile.mkdtemp(dir=root)
    mac_backend = open_backend("lmdb", fmt, capacity=capacity, path=mac_path, mac_key=MAC_SECRET, sync_mode=sync_mode)
    _tier_write(mac_backend, keys, blocks)
    hmac_path = tempfile.mkdtemp(dir=root)
    hmac_backend = open_backend("lmdb", fmt, capacity=capacity, path=hmac_path, mac_key=MAC_SECRET, mac_algorithm="hmac-sha256",
                                 sync_mode=sync_mode)
    _tier_write(hmac_backend, keys, blocks)
    blake3_path = tempfile.mkdtemp(dir=root)
    blake3_backend = open_backend("lmdb", fmt, capacity=capacity, path=blake3_path, mac_key=MAC_SECRET, mac_algorithm="blake3",
                                  sync_mode=sync_mode)
    _tier_write(blake3_backend, keys, blocks)

    def tier_load(tier: Backend = backend) -> float:
        return _tier_read(tier, keys, outs)

    def raw_load() -> float:
        return _raw_read(env, db, keys, outs)

    save_t, raw_save_t, batch_t, load_t, raw_load_t, mac_save_t, mac_load_t, hmac_load_t, blake3_load_t = [], [], [], [], [], [], [], [], []
    saves: list[tuple[list[float], Callable[[], float]]] = [
        (save_t, tier_save),
        (raw_save_t, raw_save),
        (batch_t, lambda: raw_save(per_job=True)),
        (mac_save_t, lambda: tier_save(mac_key=MAC_SECRET)),
    ]
    loads: list[tuple[list[float], Callable[[], float]]] = [
        (load_t, tier_load),
        (raw_load_t, raw_load),
        (mac_load_t, lambda: tier_load(mac_backend)),
        (hmac_load_t, lambda: tier_load(hmac_backend)),
        (blake3_load_t, lambda: tier_load(blake3_backend)),
    ]
    for r in range(repeat + 1):
        for group in (saves, loads):
            for times, run in group if r % 2 else group[::-1]:
                t = run()
                if r:  # round 0 warms up and is not counted
                    times.append(t)
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    asyncio.run(backend.aclose())
    asyncio.run(mac_backend.aclose())
    asyncio.run(hmac_backend.aclose())
    asyncio.run(blake3_backend.aclose())
    env.close()
    shutil.rmtree(tier_path)
    shutil.rmtree(raw_path)
    shutil.rmtree(mac_path)
    shutil.rmtree(hmac_path)
    shutil.rmtree(blake3_path)
    med = statistics.median
    res = {
        "lmdb_save_gbps": gbps(total, med(save_t)),
        "lmdb_load_gbps": gbps(total, med(load_t)),
        "raw_lmdb_put_gbps": gbps(total, med(raw_save_t)),
        "raw_lmdb_get_gbps": gbps(total, med(raw_load_t)),
        "lmdb_txn_per_value_put_gbps": gbps(total, med(raw_save_t)),
        "lmdb_txn_per_job_put_gbps": gbps(total, med(batch_t)),
    }
    res["lmdb_save_ratio"] = round(res["lmdb_save_gbps"] / res["raw_lmdb_put_gbps"], 3)
    res["lmdb_load_ratio"] = round(res["lmdb_load_gbps"] / res["raw_lmdb_get_gbps"], 3)
    res["lmdb_mac_save_gbps"] = gbps(total, med(mac_save_t))
    res["lmdb_mac_load_gbps"] = gbps(total, med(mac_load_t))
    res["lmdb_mac_save_ratio"] = round(res["lmdb_mac_save_gbps"] / res["raw_lmdb_put_gbps"], 3)
    res["lmdb_mac_load_ratio"] = round(res["lmdb_mac_load_gbps"] / res["raw_lmdb_get_gbps"], 3)
    res["mac_save_cost"] = round(res["lmdb_mac_save_gbps"] / res["lmdb_save_gbps"], 3)
    res["mac_load_cost"] = round(res["lmdb_mac_load_gbps"] / res["lmdb_load_gbps"], 3)
    res["lmdb_hmac_load_gbps"] = gbps(total, med(hmac_load_t))
    res["hmac_load_cost"] = round(res["lmdb_hmac_load_gbps"] / res["lmdb_load_gbps"], 3)
    res["lmdb_blake3_load_gbps"] = gbps(total, med(blake3_load_t))
    res["blake3_load_cost"] = round(res["lmdb_blake3_load_gbps"] / res["lmdb_load_gbps"], 3)
    return res


def bench_cold_contention(root: str, blocks: list[torch.Tensor], repeat: int, drop_caches: bool) -> dict[str, Any]:
    """Raw cold gets (no copies), alone and while another thread copies 64 MiB buffers over and
    over, alternating: how much a copy on the other core slows the disk reads themselves. A cold
    load can gain by overlapping its copies with its reads only where this ratio is near 1."""
    import threading

    n, total, keys, _, _, capacity = _lmdb_job(blocks)
    path = tempfile.mkdtemp(dir=root)
    env, db = _raw_env(path, capacity)
    _raw_put(env, db, keys, blocks, range(n))
    env.close()
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    alone: list[float] = []
    beside: list[float] = []
    for r in range(2 * repeat):
        busy = r % 2 == 1
        stop = threading.Event()

        def copy_until_stopped(stop: threading.Event = stop) -> None:
            while not stop.is_set():
                dst.copy_(src)

        _evict(path, drop_caches)
        env, db = _raw_env(path, capacity, readahead=True)
        worker = threading.Thread(target=copy_until_stopped)
        if busy:
            worker.start()
        t = time.perf_counter()
        for j in jobs(n):
            with env.begin(buffers=True, db=db) as txn:
                for i in j:
                    txn.get(keys[i])  # python-lmdb touches every page of the value
        (beside if busy else alone).append(time.perf_counter() - t)
        stop.set()
        if busy:
            worker.join()
        env.close()
    shutil.rmtree(path)
    med = statistics.median
    res = {"raw_lmdb_cold_get_alone_gbps": gbps(total, med(alone)), "raw_lmdb_cold_get_beside_copies_gbps": gbps(total, med(beside))}
    res["cold_get_beside_copies_ratio"] = round(res["raw_lmdb_cold_get_beside_copies_gbps"] / res["raw_lmdb_cold_get_alone_gbps"], 3)
    return res


def _evict(path: str, drop_caches: bool) -> str:
    """Push ``<path>/data.mdb`` out of the page cache (the environment must be closed: mapped
    pages cannot be evicted). Returns the method used."""
    evict_from_page_cache(os.path.join(path, "data.mdb"))  # written back, its pages dropped
    if drop_caches:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    return "fadvise_dontneed"


def bench_lmdb_cold(root: str, blocks: list[torch.Tensor], repeat: int, drop_caches: bool) -> dict[str, Any]:
    """Loads from a cold page cache: every run opens the environment afresh after its file was
    evicted, tier and raw alternating, the order reversed every round (as in :func:`bench_lmdb`).
    Both read the same file: the raw side opens the tier's own store with python-lmdb and gets
    the payloads from its ``blocks`` database (where the tier keeps them as they were put), so
    where the file lies on the device counts for both alike (two files written one after the
    other read back at speeds up to 12 % apart here).

    Two more sides say where the tier's time goes; neither is a mode of the tier:
    ``raw_lmdb_cold_get_checked`` is the raw ``get`` and copy followed by an XXH3 pass over each
    copied block (the tier's check, done the plain serial way), and ``lmdb_cold_unchecked`` is
    the tier with its record check replaced by nothing (patched here, for the run alone)."""
    import xxhash

    from kvtier.records import checks

    _, total, keys, outs, fmt, capacity = _lmdb_job(blocks)
    tier_path = tempfile.mkdtemp(dir=root)
    backend = open_backend("lmdb", fmt, capacity=capacity, path=tier_path)
    _tier_write(backend, keys, blocks)
    asyncio.run(backend.aclose())
    tier_t: list[float] = []
    raw_t: list[float] = []
    checked_t: list[float] = []
    unchecked_t: list[float] = []
    open_t: list[float] = []
    open_read: list[float] = []
    method = ""
    data = os.path.join(tier_path, "data.mdb")

    def tier_side(times: list[float], check: bool = True) -> None:
        nonlocal method
        method = _evict(tier_path, drop_caches)
        cached_before = cached_pages(data)[0]
        t = time.perf_counter()
        tier = open_backend("lmdb", fmt, capacity=capacity, path=tier_path)
        if check:
            open_t.append(time.perf_counter() - t)
            cached, pages = cached_pages(data)
            open_read.append((cached - cached_before) / pages)
        verify = checks.verify_payload
        if not check:
            checks.verify_payload = lambda *args, **kwargs: None  # type: ignore[assignment]
        try:
            times.append(_tier_read(tier, keys, outs))
        finally:
            checks.verify_payload = verify
        asyncio.run(tier.aclose())

    def raw_side(times: list[float], check: bool = False) -> None:
        _evict(tier_path, drop_caches)
        # Readahead on for the raw side: with it off (as the warm raw runs have it) a cold mmap
        # faults in one page per read, 0.014-0.021 GB/s here, which would flatter the tier.
        env, db = _raw_env(tier_path, capacity, readahead=True)
        t = _raw_read(env, db, keys, outs)
        if check:
            t0 = time.perf_counter()
            for out in outs:
                xxhash.xxh3_64_intdigest(out.numpy())
            t += time.perf_counter() - t0
        times.append(t)
        env.close()

    sides: list[Callable[[], None]] = [
        lambda: tier_side(tier_t),
        lambda: raw_side(raw_t),
        lambda: tier_side(unchecked_t, check=False),
        lambda: raw_side(checked_t, check=True),
    ]
    for r in range(repeat + 1):
        for side in sides if r % 2 else sides[::-1]:
            side()
        if not r:  # the first round warms up and is not counted
            for times in (tier_t, raw_t, checked_t, unchecked_t, open_t, open_read):
                times.clear()
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    shutil.rmtree(tier_path)
    med = statistics.median
    res = {
        "lmdb_cold_method": method,
        "lmdb_cold_load_gbps": gbps(total, med(tier_t)),
        "raw_lmdb_cold_get_gbps": gbps(total, med(raw_t)),
    }
    # What the open itself reads of a cold store (index rebuild and damage walk), as a fraction
    # of the file: the loads above only measure cold if the open left the file cold.
    res["lmdb_cold_open_seconds"] = round(med(open_t), 4)
    res["lmdb_cold_open_read_fraction"] = round(med(open_read), 4)
    res["lmdb_cold_load_ratio"] = round(res["lmdb_cold_load_gbps"] / res["raw_lmdb_cold_get_gbps"], 3)
    res["raw_lmdb_cold_get_checked_gbps"] = gbps(total, med(checked_t))
    res["lmdb_cold_unchecked_load_gbps"] = gbps(total, med(unchecked_t))
    res["raw_cold_checked_ratio"] = round(res["raw_lmdb_cold_get_checked_gbps"] / res["raw_lmdb_cold_get_gbps"], 3)
    res["lmdb_cold_unchecked_ratio"] = round(res["lmdb_cold_unchecked_load_gbps"] / res["raw_lmdb_cold_get_gbps"], 3)
    res["lmdb_cold_vs_raw_checked"] = round(res["lmdb_cold_load_gbps"] / res["raw_lmdb_cold_get_checked_gbps"], 3)
    return res


def bench_lmdb_scan(root: str, count: int) -> dict[str, Any]:
    """Index rebuild time: open + ``scan()`` of a store with ``count`` records (small blocks: open
    reads the index database and the blocks database's leaf pages, never a block's pages)."""
    fmt = BlockFormat(block_bytes=512, dtype="bfloat16")
    path = tempfile.mkdtemp(dir=root)
    backend = open_backend("lmdb", fmt, capacity=count * 8192 + (64 << 20), path=path, sync_mode="fast")
    block = torch.zeros(512, dtype=torch.uint8)
    step = 2000
    for start in range(0, count, step):
        ks = [make_key(i) for i in range(start, min(count, start + step))]
        backend.write_blocks(ks, [block] * len(ks))
    asyncio.run(backend.aclose())
    # Timed from the open: the index is read (and the blocks database's leaf pages checked) there.
    t = time.perf_counter()
    reopened = open_backend("lmdb", fmt, capacity=count * 8192 + (64 << 20), path=path, sync_mode="fast")
    listed = sum(1 for _ in reopened.scan())
    seconds = time.perf_counter() - t
    asyncio.run(reopened.aclose())
    shutil.rmtree(path)
    assert listed == count
    return {"lmdb_scan_records": count, "lmdb_scan_seconds": round(seconds, 4)}


# -- file ------------------------------------------------------------------------------------------


def _aio_read(paths: list[str], outs: list[torch.Tensor]) -> None:
    import aiofiles

    async def run() -> None:
        for p, out in zip(paths, outs):
            async with aiofiles.open(p, "rb") as f:
                data = await f.read()
            memoryview(out.numpy())[:] = memoryview(data)[32:]

    asyncio.run(run())


def _preadv_read(paths: list[str], outs: list[torch.Tensor]) -> None:
    def job(j: range) -> None:
        for i in j:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.preadv(fd, [memoryview(outs[i].numpy())], 32)
            finally:
                os.close(fd)

    async def run() -> None:
        for j in jobs(len(paths)):
            await asyncio.to_thread(job, j)  # one worker-thread hop per job, as the engine does

    asyncio.run(run())


def _raw_file_write(folder: str, blocks: list[torch.Tensor], durable: bool = True) -> float:
    """The file tier's durable write protocol with nothing of kvtier: per block a temporary file,
    one ``pwritev`` of a 32-byte header and the payload, ``fdatasync``, a rename; per job one
    ``fsync`` of the directory; one worker-thread hop per job (``durable=False``: the fast
    mode's, without the syncs). The seconds spent."""
    header = bytes(32)
    dir_fd = os.open(folder, os.O_RDONLY)

    def job(j: range) -> None:
        for i in j:
            tmp, name = f"{i}.tmp", f"{i}.kvb"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            try:
                os.pwritev(fd, [header, memoryview(blocks[i].numpy())], 0)
                if durable:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if durable:
            os.fsync(dir_fd)

    async def run() -> None:
        for j in jobs(len(blocks)):
            await asyncio.to_thread(job, j)

    try:
        return timed(lambda: asyncio.run(run()))
    finally:
        os.close(dir_fd)


def _file_round(
    root: str, blocks: list[torch.Tensor], outs: list[torch.Tensor], tier_first: bool, sync_mode: str
) -> tuple[float, ...]:
    n = len(blocks)
    keys = [make_key(i) for i in range(n)]
    fmt = BlockFormat(block_bytes=BLOCK, dtype="bfloat16")
    path = tempfile.mkdtemp(dir=root)
    raw_path = tempfile.mkdtemp(dir=root)
    backend = open_backend("file", fmt, capacity=3 * n * BLOCK, path=path, sync_mode=sync_mode)
    saves: list[tuple[str, Callable[[], float]]] = [
        ("save", lambda: _tier_write(backend, keys, blocks)),
        ("raw_save", lambda: _raw_file_write(raw_path, blocks, durable=sync_mode == "durable")),
    ]
    times: dict[str, float] = {}
    # Whichever save runs first in a round was measured slower (the other's files just went): alternate.
    for name, save in saves if tier_first else saves[::-1]:
        times[name] = save()
    shutil.rmtree(raw_path)
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".kvb"))
    assert len(paths) == n
    reads: list[tuple[str, Callable[[], Any]]] = [
        ("load", lambda: _tier_read(backend, keys, outs)),
        ("aio", lambda: _aio_read(paths, outs)),
        ("pread", lambda: _preadv_read(paths, outs)),
    ]
    # The first read after the saves was measured slower whichever side it was: alternate.
    for name, read in reads if tier_first else reads[::-1]:
        times[name] = timed(read)
        if name == "load":  # (the raw reads go in path order, not key order)
            assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    asyncio.run(backend.aclose())
    shutil.rmtree(path)
    return times["save"], times["raw_save"], times["load"], times["aio"], times["pread"]


def bench_file(root: str, blocks: list[torch.Tensor], repeat: int, sync_mode: str = "durable") -> dict[str, Any]:
    total = len(blocks) * BLOCK
    outs = [torch.empty(BLOCK, dtype=torch.uint8) for _ in blocks]
    rounds = [_file_round(root, blocks, outs, tier_first=r % 2 == 1, sync_mode=sync_mode) for r in range(repeat + 1)][1:]  # round 0 warms up
    save_t, raw_save_t, load_t, aio_t, pread_t = (list(col) for col in zip(*rounds))
    med = statistics.median
    res = {
        "file_save_gbps": gbps(total, med(save_t)),
        "raw_file_write_gbps": gbps(total, med(raw_save_t)),
        "file_load_gbps": gbps(total, med(load_t)),
        "file_read_aiofiles_gbps": gbps(total, med(aio_t)),
        "file_read_preadv_thread_gbps": gbps(total, med(pread_t)),
    }
    res["file_save_ratio"] = round(res["file_save_gbps"] / res["raw_file_write_gbps"], 3)
    return res


# -- compression -----------------------------------------------------------------------------------


def _codec_figures(spec: dict[str, Any], raws: list[memoryview], repeat: int) -> tuple[float, float, float]:
    codec = resolve_codec(spec)
    total = sum(len(r) for r in raws)
    payloads: list[Any] = []
    out = memoryview(bytearray(BLOCK))

    def compress() -> None:
        payloads[:] = [codec.encode(r, 2) for r in raws]

    def decompress() -> None:
        for p in payloads:
            codec.decode_into(memoryview(p), out, 2)

    t = best(lambda: timed(compress), repeat)
    d = best(lambda: timed(decompress), repeat)
    return total / sum(len(p) for p in payloads), total / t / 1e6, total / d / 1e6


def bench_codecs(blocks: list[torch.Tensor], repeat: int) -> dict[str, Any]:
    raws = [memoryview(b.numpy()) for b in blocks]
    res: dict[str, Any] = {}
    specs = {
        "plain": {"name": "zstd", "level": 1},
        "shuffle": {"name": "zstd-shuffle", "level": 1},
        "plain_l3": {"name": "zstd", "level": 3},
        "shuffle_l3": {"name": "zstd-shuffle", "level": 3},
    }
    for label, spec in specs.items():
        ratio, cmbps, dmbps = _codec_figures(spec, raws, repeat)
        res[f"{label}_ratio"] = round(ratio, 4)
        res[f"{label}_compress_mbps"] = round(cmbps, 1)
        res[f"{label}_decompress_mbps"] = round(dmbps, 1)
    res["shuffle_ratio_gain"] = round(res["shuffle_ratio"] / res["plain_ratio"], 4)
    res["shuffle_speed_ratio"] = round(res["shuffle_compress_mbps"] / res["plain_compress_mbps"], 4)
    return res


def bench_compressed_tier(blocks: list[torch.Tensor]) -> dict[str, Any]:
    fmt = BlockFormat(block_bytes=BLOCK, dtype="bfloat16")
    capacity = (len(blocks) // 2) * BLOCK
    backend = open_backend("compressed", fmt, capacity=capacity)
    stored = 0
    i = 0
    started = time.perf_counter()
    while True:
        # Cycle the sample blocks under fresh keys until the tier refuses a write.
        size = backend.write_blocks([make_key(10_000 + i)], [blocks[i % len(blocks)]])[0]
        if size is None:
            break
        stored += 1
        i += 1
    save_s = time.perf_counter() - started
    keys = [make_key(10_000 + j) for j in range(stored)]
    out = [torch.empty(BLOCK, dtype=torch.uint8) for _ in range(min(stored, 16))]
    started = time.perf_counter()
    for j in range(0, stored, len(out)):  # whole jobs of 16 blocks, as a load reads them
        chunk = keys[j : j + len(out)]
        assert all(backend.read_blocks(chunk, out[: len(chunk)]))
    load_s = time.perf_counter() - started
    asyncio.run(backend.aclose())
    per_gib = stored * (1 << 30) / capacity
    return {
        "compressed_blocks_per_gib": round(per_gib, 1),
        "cpu_blocks_per_gib": (1 << 30) // BLOCK,
        "compressed_vs_cpu": round(per_gib / ((1 << 30) // BLOCK), 3),
        # block bytes per second through the tier (zstd-shuffle both ways); no raw baseline
        "compressed_save_gbps": round(stored * BLOCK / save_s / 1e9, 3),
        "compressed_load_gbps": round(stored * BLOCK / load_s / 1e9, 3),
    }


_PARTS = {"lmdb", "cold", "cold_contention", "file", "codecs", "compressed", "scan"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a few seconds)")
    parser.add_argument("--dir", default=None,
                        help="the filesystem to measure: temporary stores go in a folder under DIR (default: system temp)")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument(
        "--cold-rounds",
        type=int,
        default=None,
        help="rounds of the cold part (default 21, --quick 3): a cold read swings more than a warm one",
    )
    parser.add_argument("--drop-caches", action="store_true", help="cold runs drop the whole page cache (root only)")
    parser.add_argument("--only", nargs="+", choices=sorted(_PARTS), help="run only these parts")
    parser.add_argument("--sync-mode", choices=["durable", "fast"], default="durable",
                        help="the lmdb and file tiers' sync_mode, and the raw baselines' syncs to match (default durable)")
    args = parser.parse_args()
    n = 16 if args.quick else 48
    repeat = args.repeat or (3 if args.quick else 5)
    cold_rounds = args.cold_rounds or (3 if args.quick else 21)
    scan_records = 20_000 if args.quick else 100_000
    blocks = kv_like_blocks(n)
    root = tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir)
    started = time.perf_counter()
    try:
        result: dict[str, Any] = {"block_bytes": BLOCK, "blocks": n, "quick": args.quick, "sync_mode": args.sync_mode, "dir": os.path.dirname(root)}
        parts: dict[str, Callable[[], dict[str, Any]]] = {
            "lmdb": lambda: bench_lmdb(root, blocks, repeat, args.sync_mode),
            "cold": lambda: bench_lmdb_cold(root, blocks, cold_rounds, args.drop_caches),
            "cold_contention": lambda: bench_cold_contention(root, blocks, repeat, args.drop_caches),
            "file": lambda: bench_file(root, blocks, repeat, args.sync_mode),
            "codecs": lambda: bench_codecs(blocks, repeat),
            "compressed": lambda: bench_compressed_tier(blocks),
            "scan": lambda: bench_lmdb_scan(root, scan_records),
        }
        assert set(parts) == _PARTS
        for name, part in parts.items():
            if not args.only or name in args.only:
                result.update(part())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["bench_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
