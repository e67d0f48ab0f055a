"""The native copy of a job on the calling thread's OpenMP team (kvtier.transfer.block_copy,
``threads > 1``) against the general path (torch's index ops, the native copy off): the same
bytes in the pool and in the cache for odd shapes (blocks not divisible by the threads, one
block, many tensors, pieces off any 64-byte line), on every store path; repeated destinations
copied in order on one thread (the last one wins); without a team runner or without the
extension, the same bytes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

import kvtier
from kvtier.devices import openmp_team_runner
from kvtier.transfer import block_copy, copies
from kvtier.transfer.copies import PACE_MIN_BYTES, CopySplitter
from kvtier.transfer.layout import KVLayout

native = pytest.mark.skipif(not block_copy.NATIVE, reason="kvtier.transfer._blockcopy not built (no C compiler)")
BLOCKS = 12


def layout_of(name: str) -> KVLayout:
    g = torch.Generator().manual_seed(11)
    if name == "odd":  # pieces of odd sizes: a record's shares start off any 64-byte line
        caches = [torch.randint(0, 256, (BLOCKS, n), dtype=torch.uint8, generator=g) for n in (300_007, 262_147, 129)]
    elif name == "many":  # many tensors of small pieces
        caches = [torch.randint(0, 256, (BLOCKS, 4, 1024 + i), dtype=torch.uint8, generator=g) for i in range(40)]
    else:  # 64 KiB bf16 pages, the bench's shape
        caches = [torch.randint(0, 256, (BLOCKS, 16, 2, 8, 256), dtype=torch.uint8, generator=g).view(torch.bfloat16) for _ in range(4)]
    return KVLayout(caches)


def record_of(layout: KVLayout, block: int) -> torch.Tensor:
    return torch.cat([c[block].reshape(-1).view(torch.uint8) for c in layout.kv_caches])


def general_path(layout: KVLayout, ids: list[int], rows: list[int], back: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Save ``ids`` into ``rows`` with torch's index ops, change the rows, load them into ``back``."""
    assert layout.native is not None
    layout.native.enabled = False
    try:
        pool = torch.full((BLOCKS, layout.block_bytes), 0xA5, dtype=torch.uint8)
        layout.gather(ids, pool, rows)
        pool[rows] ^= 0x5A
        layout.scatter(pool, rows, back)
        return pool, [record_of(layout, b).clone() for b in back]
    finally:
        layout.native.enabled = True


def native_path(layout: KVLayout, ids: list[int], rows: list[int], back: list[int], copy: Callable[[bool, list[int], torch.Tensor, list[int]], int]) -> tuple[torch.Tensor, list[torch.Tensor], set[int]]:
    """The same with a native ``copy(gather, ids, pool, rows)``; also what each call returned."""
    pool = torch.full((BLOCKS, layout.block_bytes), 0xA5, dtype=torch.uint8)
    used = {copy(True, ids, pool, rows)}
    pool[rows] ^= 0x5A
    used.add(copy(False, back, pool, rows))
    return pool, [record_of(layout, b).clone() for b in back], used


def team_path(layout: KVLayout, ids: list[int], rows: list[int], back: list[int], threads: int) -> tuple[torch.Tensor, list[torch.Tensor], set[int]]:
    """The native copy on a team of ``threads``; also the threads each call used."""
    nb = layout.native
    assert nb is not None
    return native_path(layout, ids, rows, back, lambda *a: nb.copy(*a, threads))


def job_of(blocks: int) -> tuple[list[int], list[int], list[int]]:
    """A job's first ``blocks`` ids, its rows (scattered, out of order) and the blocks loaded back."""
    return [9, 0, 5, 3, 11, 1, 7, 2, 10, 4][:blocks], [6, 2, 9, 0, 11, 3, 8, 1, 10, 4][:blocks], [4, 6, 8, 10, 0, 2, 1, 3, 11, 5][:blocks]


def odd_jobs(test: Callable[[str, int, int], None]) -> Callable[[str, int, int], None]:
    """``test(name, blocks, threads)`` over every shape of ``layout_of``, 1-10 blocks, 2 and 3 threads."""
    for mark in (
        pytest.mark.parametrize("name", ["odd", "many", "pages"]),
        pytest.mark.parametrize("blocks", [1, 3, 5, 10]),
        pytest.mark.parametrize("threads", [2, 3]),
    ):
        test = mark(test)
    return test


@native
@odd_jobs
def test_a_team_copy_matches_the_general_path(name: str, blocks: int, threads: int) -> None:
    ids, rows, back = job_of(blocks)
    before = block_copy._blockcopy.path()
    try:
        want_pool, want_loaded = general_path(layout_of(name), ids, rows, back)
        expected = [record_of(layout_of(name), b) for b in ids]
        assert all(torch.equal(want_pool[r], rec ^ 0x5A) for r, rec in zip(rows, expected))  # (the reference itself)
        for path in block_copy._blockcopy.paths():
            block_copy._blockcopy.set_path(path)
            pool, loaded, used = team_path(layout_of(name), ids, rows, back, threads)
            assert used == {min(threads, blocks) if block_copy.TEAM else 1}, path
            assert torch.equal(pool, want_pool), path  # untouched rows too: nothing written outside the job
            assert all(torch.equal(a, b) for a, b in zip(loaded, want_loaded)), path
    finally:
        block_copy._blockcopy.set_path(before)


@native
def test_repeated_destinations_copy_in_order_on_one_thread() -> None:
    """Two rows of a gather (or ids of a scatter) that are one: in order the last one wins, as in
    torch's serial loop; split over threads either could."""
    layout = layout_of("pages")
    nb = layout.native
    assert nb is not None
    pool = torch.zeros((BLOCKS, layout.block_bytes), dtype=torch.uint8)
    assert nb.copy(True, [3, 5, 7, 9], pool, [2, 4, 2, 6], 2) == 1
    assert torch.equal(pool[2], record_of(layout, 7)) and torch.equal(pool[4], record_of(layout, 5))
    assert nb.copy(False, [1, 1, 8, 1], pool, [4, 6, 2, 2], 2) == 1
    assert torch.equal(record_of(layout, 1), record_of(layout, 7))  # row 2 last, holding block 7
    assert torch.equal(record_of(layout, 8), record_of(layout, 7))
    assert nb.copy(True, [3, 5], pool, [2, 4], 2) == (2 if block_copy.TEAM else 1)  # distinct again: the team


@native
def test_without_a_team_runner_the_job_copies_on_the_calling_thread() -> None:
    layout = layout_of("odd")
    ids, rows, back = [9, 0, 5, 3], [1, 2, 3, 4], [6, 7, 8, 10]
    want_pool, want_loaded = general_path(layout_of("odd"), ids, rows, back)
    block_copy._blockcopy.set_team(0)
    try:
        assert not block_copy._blockcopy.team()
        pool, loaded, used = team_path(layout, ids, rows, back, 2)
    finally:
        block_copy._blockcopy.set_team(openmp_team_runner())
    assert used == {1}
    assert torch.equal(pool, want_pool) and all(torch.equal(a, b) for a, b in zip(loaded, want_loaded))
    assert block_copy._blockcopy.team() is block_copy.TEAM


@native
def test_bad_thread_counts_and_runners_are_refused() -> None:
    layout = layout_of("pages")
    nb = layout.native
    assert nb is not None
    pool = torch.zeros((BLOCKS, layout.block_bytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match="threads: expected an integer >= 1, got 0"):
        nb.copy(True, [1], pool, [0], 0)
    with pytest.raises(ValueError, match="set_team: expected the address"):
        block_copy._blockcopy.set_team(-1)
    assert not pool.any()


def test_without_the_extension_a_larger_inline_job_copies_with_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_copy, "_blockcopy", None)
    layout = layout_of("pages")
    assert layout.native is None
    ids, rows = [11, 0, 9, 2, 7, 4, 5, 6, 3, 8], [9, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    pool = torch.zeros((BLOCKS, layout.block_bytes), dtype=torch.uint8)
    with layout.copies.on_callers_team(len(ids) * layout.block_bytes):
        assert layout.copies.team_now() >= 1  # the team's, though nothing native takes it
        layout.gather(ids, pool, rows, kept=True, checked=True)
    assert all(torch.equal(pool[r], record_of(layout, b)) for r, b in zip(rows, ids))


def test_only_a_timed_inline_job_on_the_team_may_take_it() -> None:
    layout = layout_of("pages")
    copies = layout.copies
    assert copies.team_now() == 0  # not inline: a transfer thread would start a team of its own
    with copies.on_callers_team(PACE_MIN_BYTES - 1):
        assert copies.team_now() == 0  # too small to time
        with copies.on_callers_team(PACE_MIN_BYTES):
            assert copies.team_now() == max(1, torch.get_num_threads())
        assert copies.team_now() == 0  # restored
    copies.pace.until = float("inf")  # the pace sends jobs alone
    with copies.on_callers_team(PACE_MIN_BYTES):
        assert copies.alone_now() and copies.team_now() == 0


SAVED = [3, 9, 0, 5, 21, 7, 12, 1, 18, 2, 15]
LOADED = [4, 6, 8, 10, 11, 13, 14, 16, 17, 19, 20]


def store_round_trip(caches: list[torch.Tensor], cfg: dict[str, object], native_on: bool, call: str) -> tuple[bool, list[int], int]:
    """Blocks ``SAVED`` saved and loaded into ``LOADED`` through a store of ``caches`` (``cfg``
    with a ``cpu`` tier of 24 blocks), the native copy on or off: whether every loaded block is
    its saved one, what each call of the layout's native ``call`` returned, and the store's
    count of inline jobs."""

    async def run() -> tuple[bool, list[int], int]:
        block_bytes = sum(c[0].numel() for c in caches)
        async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 24 * block_bytes}], **cfg}, kv_caches=caches) as store:
            layout = store.layout
            assert layout is not None and layout.native is not None
            layout.native.enabled = native_on
            used: list[int] = []
            inner = getattr(layout.native, call)
            setattr(layout.native, call, lambda *a: used.append(n := inner(*a)) or n)
            keys = [bytes([i]) * 32 for i in range(len(SAVED))]
            assert await store.save(keys, SAVED) == len(SAVED)
            assert await store.load(keys, LOADED) == len(SAVED)
            assert store.transfers is not None
            same = all(torch.equal(c[s], c[d]) for c in caches for s, d in zip(SAVED, LOADED))
            return same, used, store.transfers.counters["inline_jobs"]

    return asyncio.run(run())


@native
@pytest.mark.parametrize("native_on", [False, True])
def test_a_stores_larger_inline_jobs_save_and_load_the_bytes_of_the_general_path(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the store: inline jobs of 11 blocks (past the small jobs' 8) saved and loaded on
    the caller's team, natively (threads > 1 where the team is reachable) and with the native
    copy off (torch's index ops): the blocks loaded are the blocks saved."""
    monkeypatch.setattr(copies, "PACE_MIN_BYTES", 0)  # these blocks are small: time every job
    g = torch.Generator().manual_seed(5)
    caches = [torch.randint(0, 256, (24, 3, 5 + i), dtype=torch.uint8, generator=g) for i in range(7)]
    same, threads, inline_jobs = store_round_trip(caches, {}, native_on, "copy")
    assert same and inline_jobs == 2
    team = max(1, torch.get_num_threads()) if block_copy.TEAM else 1
    assert threads == ([min(team, 11)] * 2 if native_on else [0, 0])


def split_path(layout: KVLayout, ids: list[int], rows: list[int], back: list[int], threads: int) -> tuple[torch.Tensor, list[torch.Tensor], set[int]]:
    """The same as a transfer thread's job, split over ``threads`` copy threads (each share one
    native call); also the shares each call used."""
    nb = layout.native
    assert nb is not None
    split = CopySplitter(threads, min_bytes=0)
    return native_path(layout, ids, rows, back, lambda *a: nb.copy_split(*a, threads, split.run))


@native
@odd_jobs
def test_a_split_over_the_copy_threads_matches_the_general_path(name: str, blocks: int, threads: int) -> None:
    ids, rows, back = job_of(blocks)
    want_pool, want_loaded = general_path(layout_of(name), ids, rows, back)
    pool, loaded, used = split_path(layout_of(name), ids, rows, back, threads)
    assert used == {min(threads, blocks)}
    assert torch.equal(pool, want_pool)
    assert all(torch.equal(a, b) for a, b in zip(loaded, want_loaded))


@native
def test_a_split_refuses_a_bad_id_or_row_before_any_share_copies() -> None:
    layout = layout_of("pages")
    nb = layout.native
    assert nb is not None
    split = CopySplitter(2, min_bytes=0)
    pool = torch.zeros((BLOCKS, layout.block_bytes), dtype=torch.uint8)
    cache = record_of(layout, 0).clone()
    with pytest.raises(IndexError, match=r"ids\[3\]: 12 is out of range"):
        nb.copy_split(True, [0, 1, 2, 12], pool, [0, 1, 2, 3], 2, split.run)
    with pytest.raises(IndexError, match=r"rows\[2\]: 12 is out of range"):
        nb.copy_split(False, [0, 1, 2, 3], pool, [0, 1, 12, 3], 2, split.run)
    with pytest.raises(TypeError, match=r"rows\[1\]: expected an int"):
        nb.copy_split(True, [0, 1], pool, [0, 1.0], 2, split.run)  # type: ignore[list-item]
    assert not pool.any() and torch.equal(record_of(layout, 0), cache)
    assert nb.copy_split(True, [3, 5, 7], pool, [2, 4, 2], 2, split.run) == 1  # a repeated row: in order
    assert torch.equal(pool[2], record_of(layout, 7))


@native
@pytest.mark.parametrize("native_on", [False, True])
def test_a_stores_larger_threaded_jobs_save_and_load_the_bytes_of_the_general_path(native_on: bool) -> None:
    """Through the store with every job on the transfer threads: jobs of 11 blocks of 1 MiB (past
    the small jobs' 8 and the 8 MiB split) split over two copy threads natively, and with the
    native copy off (torch's per-tensor shares): the blocks loaded are the blocks saved."""
    g = torch.Generator().manual_seed(6)
    caches = [torch.randint(0, 256, (24, 1 << 17), dtype=torch.uint8, generator=g) for _ in range(8)]
    same, shares, inline_jobs = store_round_trip(caches, {"inline_max_bytes": 0, "copy_threads": 2}, native_on, "copy_split")
    assert same and inline_jobs == 0
    assert shares == ([2, 2] if native_on else [0, 0])


_FORKED = r"""
import os, signal, numpy as np, torch
from kvtier.transfer import block_copy
from kvtier.transfer.layout import KVLayout
caches = [torch.randint(0, 256, (24, 1 << 16), dtype=torch.uint8) for _ in range(2)]
layout = KVLayout(caches)
pool = torch.zeros((24, layout.block_bytes), dtype=torch.uint8)
ids = list(range(20))
print("parent", layout.native.copy(True, ids, pool, ids, 2), flush=True)  # this thread's team, used
pool.zero_()
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: the parent's team is inherited without its threads
    signal.alarm(30)  # a copy waiting for ever on them: killed, and the parent says so
    used = layout.native.copy(True, ids, pool, ids, 2)
    rows, blocks = pool.numpy(), [c.numpy() for c in caches]  # (numpy: torch's ops would wait on the team too)
    same = all((rows[i] == np.concatenate([b[i] for b in blocks])).all() for i in ids)
    os.write(write, f"child {used} {same}".encode())
    os._exit(0)
os.close(write)
_, status = os.waitpid(pid, 0)
print(os.read(read, 100).decode() or f"child killed by signal {os.WTERMSIG(status)}", flush=True)
"""


@native
def test_a_forked_child_copies_on_its_own_thread_not_on_the_parents_team() -> None:
    """A child forked by a thread whose team copied inherits the OpenMP runtime's record of the
    team without its threads: a team job there would wait for them for ever (as torch's own
    parallel ops on that thread do). The child's jobs copy on the calling thread, the same
    bytes (child process, fork in a fresh interpreter)."""
    child = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    lines = child.stdout.split("\n")
    assert lines[0] == f"parent {2 if block_copy.TEAM else 1}", child.stdout
    assert lines[1] == "child 1 True", child.stdout
