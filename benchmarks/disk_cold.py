"""The cold-cache part of ``bench_disk.py``: loads after the store's file was evicted from the
page cache (tier and raw alternating), and whether this host overlaps cold reads with copies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import torch
from kvtier.backends.lmdb_scan import list_trees
from kvtier.tools.bench.scripts.disk_common import (
    alternating,
    gbps,
    jobs,
    lmdb_job,
    open_backend,
    paired_ratio,
    raw_env,
    raw_put,
    raw_read,
    tier_read,
    tier_write,
)

from kvtier.testing import cached_pages, evict_from_page_cache

#: Seconds an open's read-around is given to land before the file is evicted again (8 MiB
#: takes well under 0.1 s here).
_SETTLE = 0.1


def _cache_trees(path: str) -> None:
    """Read the B-tree pages of ``<path>/data.mdb`` into the page cache, no value page (the
    tier's open-time page walk, on a map of its own): after the second eviction both sides
    start from what the tier's open leaves cached, the trees, with every value cold."""
    listed = list_trees(path)
    del listed


def bench_cold_contention(root: str, blocks: list[torch.Tensor], repeat: int, drop_caches: bool) -> dict[str, Any]:
    """Raw cold gets (no copies), alone and while another thread copies 64 MiB buffers over and
    over, alternating: how much a copy on the other core slows the disk reads themselves. A cold
    load can gain by overlapping its copies with its reads only where this ratio is near 1."""
    n, total, keys, _, _, capacity = lmdb_job(blocks)
    path = tempfile.mkdtemp(dir=root)
    env, db = raw_env(path, capacity)
    raw_put(env, db, keys, blocks, range(n))
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
        env, db = raw_env(path, capacity, readahead=True)
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


@contextlib.contextmanager
def unchecked_reads() -> Iterator[None]:
    """For a diagnostic side alone: the lmdb tier with every record check it makes on a read
    replaced by nothing: the general path's (``verify_payload``), the fused copy and XXH3
    of raw records (``xxcopy.xxh3_copy``, by a plain copy whose "digest" answers "equal" to any
    stored checksum), and the one-call check of plain records (``xxcopy.xxh3_check_copy``, by
    its length and head checks and a plain copy). Hash states taken from ``HeadChecksum`` at a store's open hash nothing
    either: open the store inside."""
    from kvtier.records import checks, xxcopy

    saved = checks.verify_payload, xxcopy.xxh3_copy, xxcopy.xxh3_check_copy, checks.xxhash
    checks.verify_payload = lambda *args, **kwargs: None  # type: ignore[assignment]
    xxcopy.xxh3_copy = _copy_only
    xxcopy.xxh3_check_copy = _check_copy_only
    checks.xxhash = types.SimpleNamespace(xxh3_64=lambda *args: _NoHash())  # type: ignore[assignment]
    try:
        yield
    finally:
        checks.verify_payload, xxcopy.xxh3_copy, xxcopy.xxh3_check_copy, checks.xxhash = saved  # type: ignore[assignment]


def _copy_only(prefix: Any, src: Any, dst: Any = None) -> Any:
    """``xxcopy.xxh3_copy`` without the hash (see :func:`unchecked_reads`)."""
    if dst is not None:
        memoryview(dst).cast("B")[:] = memoryview(src).cast("B")
    return _Matches()


def _check_copy_only(head: Any, key: Any, stored: Any, dst: Any, payload: Any = None) -> int:
    """``xxcopy.xxh3_check_copy`` without the hash (see :func:`unchecked_reads`): the lengths
    and the head are still told apart (they route a record that is not plain to the general
    read), the payload is copied, and its checksum is taken as good."""
    from kvtier.records import xxcopy

    hlen = len(head)
    record = memoryview(stored).cast("B")
    out = None if dst is None else memoryview(dst).cast("B")
    n = len(out) if out is not None else memoryview(payload).nbytes if payload is not None else max(0, len(record) - hlen - 8)
    if payload is None:
        if len(record) != hlen + 8 + n:
            return xxcopy.CHECK_SHAPE
        source = record[hlen + 8 :]
    elif len(record) != hlen + 8 or memoryview(payload).nbytes != n:
        return xxcopy.CHECK_SHAPE
    else:
        source = memoryview(payload).cast("B")
    if record[:hlen] != memoryview(head).cast("B"):
        return xxcopy.CHECK_HEAD
    if out is not None:
        out[:] = source
    return xxcopy.CHECK_GOOD


class _Matches:
    """What a patched check's digest is: equal to any stored checksum."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


class _NoHash:
    """A hash state that hashes nothing (see :func:`unchecked_reads`)."""

    def copy(self) -> _NoHash:
        return self

    def update(self, data: object) -> None:
        pass

    def intdigest(self) -> _Matches:
        return _Matches()


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

    Each side opens the store, lets the open's own reads land, and evicts the file again, so
    the timed loads read every value cold: a raw open read 8 MiB of values around its first
    fault before its clock started (``raw_lmdb_cold_open_read_fraction``, a quarter of the
    quick run's file), the tier's open none (``lmdb_cold_open_read_fraction``). Both sides then
    read the B-tree pages back (:func:`_cache_trees`): what a tier's open leaves cached.

    Two more sides say where the tier's time goes; neither is a mode of the tier:
    ``raw_lmdb_cold_get_checked`` is the raw ``get`` and copy followed by an XXH3 pass over each
    copied block (the tier's check, done the plain serial way), and ``lmdb_cold_unchecked`` is
    the tier with its record checks replaced by nothing (:func:`unchecked_reads`, for the run alone)."""
    import xxhash

    _, total, keys, outs, fmt, capacity = lmdb_job(blocks)
    tier_path = tempfile.mkdtemp(dir=root)
    backend = open_backend("lmdb", fmt, capacity=capacity, path=tier_path)
    tier_write(backend, keys, blocks)
    asyncio.run(backend.aclose())
    open_t: list[float] = []
    open_read: list[float] = []
    raw_open_read: list[float] = []
    method = ""
    data = os.path.join(tier_path, "data.mdb")

    def tier_side(check: bool = True) -> float:
        with contextlib.nullcontext() if check else unchecked_reads():
            return tier_pass(check)

    def tier_pass(check: bool) -> float:
        nonlocal method
        method = _evict(tier_path, drop_caches)
        cached_before = cached_pages(data)[0]
        t = time.perf_counter()
        tier = open_backend("lmdb", fmt, capacity=capacity, path=tier_path)
        if check:
            open_t.append(time.perf_counter() - t)
        time.sleep(_SETTLE)
        if check:
            cached, pages = cached_pages(data)
            open_read.append((cached - cached_before) / pages)
        evict_from_page_cache(data)  # every value cold at the first read, as on the raw side
        _cache_trees(tier_path)
        t = tier_read(tier, keys, outs)
        asyncio.run(tier.aclose())
        return t

    def raw_side(check: bool = False) -> float:
        _evict(tier_path, drop_caches)
        # Readahead on for the raw side: with it off (as the warm raw runs have it) a cold mmap
        # faults in one page per read, 0.014-0.021 GB/s here, which would flatter the tier.
        cached_before = cached_pages(data)[0]
        env, db = raw_env(tier_path, capacity, readahead=True)
        # Its open's first fault in the map (the main database's root page, at open_db) reads
        # around that page: 8 MiB of values here, a quarter of the quick run's file, still in
        # flight when the open returns (mincore then saw 20 pages; 0.1 s later 2062). The
        # tier's open reads its pages alone. Left there, a quarter of the raw side's "cold"
        # load was read before its clock started; so both sides let the open's reads land,
        # then evict the file again: every value is read inside the timed loads (the few pages
        # LMDB mapped stay).
        time.sleep(_SETTLE)
        if not check:
            cached, pages = cached_pages(data)
            raw_open_read.append((cached - cached_before) / pages)
        evict_from_page_cache(data)
        _cache_trees(tier_path)
        t = raw_read(env, db, keys, outs)
        if check:
            t0 = time.perf_counter()
            for out in outs:
                xxhash.xxh3_64_intdigest(out.numpy())
            t += time.perf_counter() - t0
        env.close()
        return t

    def warmed() -> None:  # the open figures of the warm-up round are not counted either
        open_t.clear()
        open_read.clear()
        raw_open_read.clear()

    tier_t, raw_t, unchecked_t, checked_t = alternating(
        [tier_side, raw_side, lambda: tier_side(check=False), lambda: raw_side(check=True)], repeat, warmed
    )
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
    res["raw_lmdb_cold_open_read_fraction"] = round(med(raw_open_read), 4)
    res["raw_lmdb_cold_open_read_fraction_max"] = round(max(raw_open_read), 4)
    res["lmdb_cold_load_ratio"] = round(res["lmdb_cold_load_gbps"] / res["raw_lmdb_cold_get_gbps"], 3)
    res["raw_lmdb_cold_get_checked_gbps"] = gbps(total, med(checked_t))
    res["lmdb_cold_unchecked_load_gbps"] = gbps(total, med(unchecked_t))
    res["raw_cold_checked_ratio"] = round(res["raw_lmdb_cold_get_checked_gbps"] / res["raw_lmdb_cold_get_gbps"], 3)
    res["lmdb_cold_unchecked_ratio"] = round(res["lmdb_cold_unchecked_load_gbps"] / res["raw_lmdb_cold_get_gbps"], 3)
    res["lmdb_cold_vs_raw_checked"] = round(res["lmdb_cold_load_gbps"] / res["raw_lmdb_cold_get_checked_gbps"], 3)
    paired_ratio(res, "lmdb_cold_load_ratio", raw_t, tier_t)
    return res
