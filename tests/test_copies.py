"""Splitting a job's host copy over threads (kvtier.transfer.copies): the bytes are those of
the single-thread copy, every share runs on its own thread, and a failing share is raised only
once every other share has ended."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import kvtier
from kvtier.errors import ConfigError, LayoutError
from kvtier.transfer import copies
from kvtier.transfer.copies import CopySplitter, auto_copy_threads
from kvtier.transfer.layout import KVLayout
from tests.test_layout import assert_same_copies, make_caches


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("rows", [[4, 5, 6, 7, 8], [9, 1, 5, 0, 3], [2, 3, 7, 8, 11]])
def test_split_copies_match_the_single_thread_copy(threads: int, n: int, rows: list[int]) -> None:
    """Gather and scatter, over row runs and the general path, with 1 to 3 engine blocks per
    block: a layout whose copies are split over threads writes exactly the bytes of one whose
    copies run on the calling thread."""
    caches = make_caches(torch.bfloat16, fused=False, layers=5, seed=3)
    ids = [11, 3, 0, 7, 9, 2, 5, 1, 10, 4][: len(rows) * n]
    single = KVLayout(caches, engine_blocks_per_block=n, strategy="index", copy_threads=1)
    split = KVLayout(caches, engine_blocks_per_block=n, strategy="index", copy_threads=threads)
    split.copies = CopySplitter(threads, min_bytes=0)
    used: set[str] = set()
    real = split.copies.run

    def run(parts, nbytes):  # type: ignore[no-untyped-def]
        shares = split.copies.shares(parts, nbytes)
        assert len(shares) == min(threads, len(parts)) and sum(map(len, shares)) == len(parts)
        wrapped = [lambda p=p: (used.add(threading.current_thread().name), p()) for p in parts]
        real(wrapped, nbytes)

    split.copies.run = run  # type: ignore[method-assign]
    assert_same_copies(single, split, caches, ids, rows)
    # The calling thread's share, and the others on pool threads (an idle one may take two).
    me = threading.current_thread().name
    assert me in used and len(used) >= 2 and all(name.startswith(copies.THREAD_PREFIX) for name in used - {me})


def test_a_failing_share_is_raised_after_every_share_ended() -> None:
    splitter = CopySplitter(3, min_bytes=0)
    done: list[int] = []

    def slow(i: int) -> None:
        time.sleep(0.05)
        done.append(i)

    def boom() -> None:
        raise RuntimeError("copy failed")

    parts = [boom, lambda: slow(1), lambda: slow(2)]  # the calling thread's share fails at once
    with pytest.raises(RuntimeError, match="copy failed"):
        splitter.run(parts, 1 << 30)
    assert sorted(done) == [1, 2]  # nothing of the job still runs once run() has raised


def test_small_jobs_and_one_thread_stay_on_the_calling_thread() -> None:
    names: list[str] = []
    parts = [lambda: names.append(threading.current_thread().name)] * 4
    CopySplitter(4).run(parts, copies.MIN_SPLIT_BYTES - 1)
    CopySplitter(1).run(parts, 1 << 30)
    assert names == [threading.current_thread().name] * 8


def test_copy_threads_auto_and_errors() -> None:
    assert [auto_copy_threads(c) for c in (1, 2, 7, 8, 12, 16, 64)] == [1, 1, 1, 2, 3, 4, 4]
    assert CopySplitter("auto").threads == auto_copy_threads()
    caches = make_caches(torch.bfloat16, fused=False)
    for bad in (0, -1, True, 1.5, "many"):
        with pytest.raises(LayoutError, match="copy_threads"):
            KVLayout(caches, copy_threads=bad)  # type: ignore[arg-type]


def test_the_store_config_sets_the_copy_threads() -> None:
    caches = make_caches(torch.bfloat16, fused=False)
    layout = KVLayout(caches)

    async def threads(**extra: object) -> int:
        cfg = {"tiers": [{"backend": "cpu", "capacity": 8 * layout.block_bytes}], **extra}
        async with kvtier.open(cfg, kv_caches=caches) as store:
            assert store.layout is not None
            return store.layout.copies.threads

    assert asyncio.run(threads(copy_threads=3)) == 3
    assert asyncio.run(threads()) == auto_copy_threads()
    with pytest.raises(ConfigError, match="copy_threads"):
        asyncio.run(threads(copy_threads=0))


def test_a_store_saves_and_loads_exact_bytes_with_split_copies() -> None:
    """Through the store and its mover thread: blocks saved and loaded back with copies split
    over three threads are the bytes of the cache."""
    caches = make_caches(torch.bfloat16, fused=False, layers=6, seed=9)
    want = [c.clone() for c in caches]
    block_bytes = KVLayout(caches).block_bytes
    keys = [bytes([i]) * 32 for i in range(4)]

    async def run() -> None:
        cfg = {"tiers": [{"backend": "cpu", "capacity": 8 * block_bytes}], "copy_threads": 3}
        async with kvtier.open(cfg, kv_caches=caches) as store:
            assert store.layout is not None
            store.layout.copies.min_bytes = 0
            assert await store.save(keys, [1, 3, 5, 7]) == 4
            for c in caches:
                c[[0, 2, 4, 6]] = 0
            assert await store.load(keys, [0, 2, 4, 6]) == 4

    asyncio.run(run())
    for c, w in zip(caches, want):
        assert torch.equal(c[[0, 2, 4, 6]].view(torch.uint8), w[[1, 3, 5, 7]].view(torch.uint8))
