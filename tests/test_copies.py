"""Splitting a job's host copy over threads (kvtier.transfer.copies): the bytes are those of
the single-thread copy, every share runs on its own thread, and a failing share is raised only
once every other share has ended."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

import pytest
import torch

import kvtier
from kvtier.backend import BlockFormat
from kvtier.devices import confines_intra_op
from kvtier.errors import ConfigError, LayoutError
from kvtier.transfer import block_copy, copies
from kvtier.transfer.copies import CopySplitter, auto_copy_threads, one_intra_op_thread
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
    assert [auto_copy_threads(c) for c in (1, 2, 3, 7, 8, 12, 16, 64)] == [1, 2, 2, 2, 2, 3, 4, 4]
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


async def _save_then_load(
    caches: list[torch.Tensor], keys: list[bytes], threads: int, between: Callable[[], None] = lambda: None, *, inline: bool = False
) -> None:
    """Save four blocks (engine ids 1, 3, 5, 7) through a store whose copies are split over
    ``threads`` threads even when small, then (after ``between()``) load them into 0, 2, 4, 6.
    The jobs run on the store's threads unless ``inline`` (then on this thread, unsplit)."""
    cfg = {
        "tiers": [{"backend": "cpu", "capacity": 8 * KVLayout(caches).block_bytes}],
        "copy_threads": threads,
        "inline_max_bytes": (32 << 20) if inline else 0,
    }
    async with kvtier.open(cfg, kv_caches=caches) as store:
        assert store.layout is not None
        store.layout.copies.min_bytes = 0
        assert await store.save(keys, [1, 3, 5, 7]) == 4
        between()
        assert await store.load(keys, [0, 2, 4, 6]) == 4


def test_a_store_saves_and_loads_exact_bytes_with_split_copies() -> None:
    """Through the store and its mover thread: blocks saved and loaded back with copies split
    over three threads are the bytes of the cache."""
    caches = make_caches(torch.bfloat16, fused=False, layers=6, seed=9)
    want = [c.clone() for c in caches]
    keys = [bytes([i]) * 32 for i in range(4)]

    def wipe() -> None:
        for c in caches:
            c[[0, 2, 4, 6]] = 0

    asyncio.run(_save_then_load(caches, keys, 3, between=wipe))
    for c, w in zip(caches, want):
        assert torch.equal(c[[0, 2, 4, 6]].view(torch.uint8), w[[1, 3, 5, 7]].view(torch.uint8))


needs_openmp = pytest.mark.skipif(
    not confines_intra_op() or torch.get_num_threads() < 2, reason="needs torch with a reachable OpenMP runtime and two intra-op threads"
)


@needs_openmp
def test_one_intra_op_thread_is_the_calling_threads_alone() -> None:
    """Inside the block torch's ops on this thread run on it alone; after it, the thread's
    count is back, and no other thread's count (nor the process default) ever changed."""
    before = torch.get_num_threads()
    seen: list[int] = []
    with one_intra_op_thread():
        assert torch.get_num_threads() == 1
        other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        other.start()
        other.join()
    assert torch.get_num_threads() == before
    assert seen == [before]


@needs_openmp
def test_every_share_of_a_split_copy_runs_on_one_intra_op_thread() -> None:
    """Each thread a job's copy uses, the calling one included, copies without an OpenMP team
    of its own: a team on a second thread made libgomp stop spinning, and every copy in the
    process (the engine's own among them) slowed by a quarter (see kvtier.transfer.copies)."""
    counts: dict[str, int] = {}

    def part() -> None:
        time.sleep(0.01)  # long enough that the pool thread takes its own share
        counts[threading.current_thread().name] = torch.get_num_threads()

    before = torch.get_num_threads()
    CopySplitter(2, min_bytes=0).run([part, part], 1 << 30)
    CopySplitter(1).run([part], 1 << 30)
    assert len(counts) == 2 and set(counts.values()) == {1}
    assert torch.get_num_threads() == before


@needs_openmp
def test_the_stores_threads_copy_on_one_intra_op_thread_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a store: every copy of a save and a load runs on threads with one intra-op
    thread, and the caller's own count is untouched. (Torch's copies: a job this small is
    otherwise one native call on the job's thread, which starts no OpenMP team at all.)"""
    monkeypatch.setattr(block_copy, "_blockcopy", None)
    caches = make_caches(torch.bfloat16, fused=False, layers=4, seed=2)
    keys = [bytes([i]) * 32 for i in range(4)]
    counts: list[tuple[str, int]] = []
    real = copies._run_all

    def run_all(parts):  # type: ignore[no-untyped-def]
        def noted() -> None:
            counts.append((threading.current_thread().name, torch.get_num_threads()))

        real([noted, *parts])

    before = torch.get_num_threads()
    copies._run_all = run_all  # type: ignore[assignment]
    try:
        asyncio.run(_save_then_load(caches, keys, 2))
    finally:
        copies._run_all = real  # type: ignore[assignment]
    names = {name for name, _ in counts}
    assert {"kvtier-store", "kvtier-load"} <= names, names
    assert all(n == 1 for _, n in counts), counts
    assert torch.get_num_threads() == before
    # Inline (kvtier.transfer.inline): unsplit on the caller's thread, with its own team.
    counts.clear()
    copies._run_all = run_all  # type: ignore[assignment]
    try:
        asyncio.run(_save_then_load(caches, keys, 2, inline=True))
    finally:
        copies._run_all = real  # type: ignore[assignment]
    assert counts == [], "an inline job's copy was dealt out to the copy threads"
    assert torch.get_num_threads() == before


@needs_openmp
def test_a_cpu_pools_first_fill_runs_on_one_intra_op_thread_per_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill that touches a fresh pool's pages at open runs in shares off the event loop's
    thread, each share on one intra-op thread, and fills the whole pool."""
    from kvtier.backends import memory

    seen: list[tuple[str, int]] = []
    real = memory.one_intra_op_thread

    @contextlib.contextmanager
    def noted():  # type: ignore[no-untyped-def]
        with real():
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            yield

    monkeypatch.setattr(memory, "one_intra_op_thread", noted)
    backend = memory.CpuBackend(capacity=8 << 20)
    asyncio.run(backend.open(BlockFormat(block_bytes=1 << 20, dtype="bfloat16")))
    try:
        assert backend.pool is not None and not backend.pool.any()
        assert seen and all(n == 1 for _, n in seen) and threading.current_thread().name not in {t for t, _ in seen}
        assert len(seen) == min(4, memory.usable_cpus())
    finally:
        asyncio.run(backend.aclose())


class _Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_team_pace_goes_alone_after_a_job_that_waited_and_backs_off_on_each_retry() -> None:
    """A job on the team whose thread ran less than three quarters of its wall time, and took
    longer per byte than the jobs alone lately (or none ran alone yet), lost; two in a row send
    the jobs of the next hold to the thread alone; the first job after the hold retries the
    team, and the hold doubles each time the retry loses too (up to the most), and starts over
    once a job on the team runs undisturbed or beats the thread alone."""
    clock = _Clock()
    pace = copies.TeamPace(clock)
    assert not pace.solo()
    pace.note(False, 4000, 3990, 4)  # undisturbed: stays on the team
    pace.note(False, 4000, 3000, 4)  # exactly three quarters: still undisturbed
    assert not pace.solo()
    pace.note(False, 4000, 1200, 4)  # waited for CPUs, nothing known of the thread alone: lost
    assert not pace.solo()  # once is a lone disturbance
    pace.note(False, 4000, 4000, 4)  # undisturbed: the count starts over
    pace.note(False, 4000, 1200, 4)
    assert not pace.solo()
    pace.note(False, 4000, 1200, 4)  # twice in a row
    assert pace.solo()
    pace.note(True, 2000, 2000, 2)  # alone: 1000 ns a byte
    pace.note(True, 2000, 2000, 1)  # a quarter of the way to 2000
    assert pace.alone == 1250.0
    clock.now += copies.SOLO_HOLD_S - 0.01
    assert pace.solo()
    clock.now += 0.02
    assert not pace.solo()  # the retry
    pace.note(False, 4800, 1000, 4)  # waited, but 1200 ns a byte beats 1250 alone
    assert not pace.solo() and pace.hold == copies.SOLO_HOLD_S
    holds = []
    for i in range(8):
        pace.note(False, 8000, 1000, 4)  # waited and lost (2000 ns a byte)
        if i == 0:
            assert not pace.solo()  # the first loss after a win is a lone one
            pace.note(False, 8000, 1000, 4)
        assert pace.solo()  # later, a retry that loses goes alone at once
        start = clock.now
        while pace.solo():
            clock.now += 0.25
        holds.append(clock.now - start)
    assert holds == [copies.SOLO_HOLD_S, 2.0, 4.0, 8.0, 16.0, copies.SOLO_HOLD_MAX_S, 32.0, 32.0]
    pace.note(False, 8000, 8000, 4)  # undisturbed (slow or not): back on the team, the hold starts over
    assert not pace.solo()
    pace.note(False, 8000, 0, 4)
    pace.note(False, 8000, 0, 4)
    assert pace.solo() and pace.hold == 2 * copies.SOLO_HOLD_S


def test_a_job_on_the_callers_team_is_timed_and_copies_alone_while_the_pace_says_so() -> None:
    """Inside ``on_callers_team`` the thread copies unsplit either way; while the pace holds,
    torch's ops on the thread run on it alone, and its count is back after the block. A job
    under ``PACE_MIN_BYTES`` is not timed and stays on the team."""
    seen: list[tuple[bool, int, int, int]] = []

    class Noted(copies.TeamPace):
        def note(self, solo: bool, wall_ns: int, cpu_ns: int, nbytes: int) -> None:
            seen.append((solo, wall_ns, cpu_ns, nbytes))
            super().note(solo, wall_ns, cpu_ns, nbytes)

    splitter = CopySplitter(2)
    clock = _Clock()
    splitter.pace = Noted(clock)
    before = torch.get_num_threads()
    big = copies.PACE_MIN_BYTES
    with splitter.on_callers_team(big):
        assert splitter.on_this_thread() and torch.get_num_threads() == before
    splitter.pace.until, splitter.pace.hold = clock.now + 1.0, 2.0  # as after a job that waited
    with splitter.on_callers_team(3 * big):
        assert splitter.on_this_thread()
        assert torch.get_num_threads() == (1 if confines_intra_op() else before)
    assert torch.get_num_threads() == before and not splitter.on_this_thread()
    for small in (0, big - 1):  # not timed, on the team, while the pace still holds
        with splitter.on_callers_team(small):
            assert splitter.on_this_thread() and torch.get_num_threads() == before
    assert splitter.pace.solo() and not splitter.on_this_thread()
    assert [(s, n) for s, _, _, n in seen] == [(False, big), (True, 3 * big)]
    assert all(wall > 0 and cpu >= 0 for _, wall, cpu, _ in seen)


@pytest.mark.parametrize("native", [False, True])
def test_an_inline_job_copied_alone_writes_the_bytes_of_one_on_the_team(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's small jobs run inline; with the pace holding them alone they save and load
    exactly what the jobs on the caller's team do (these blocks are small: every job is paced).
    A small job copied in one native call (kvtier.transfer.block_copy, where built) does not use
    the team: the pace counts it only as a job alone (the thread alone's pace), when it sent it so."""
    monkeypatch.setattr(copies, "PACE_MIN_BYTES", 0)
    notes: list[bool] = []

    class Held(copies.TeamPace):
        def note(self, solo: bool, wall_ns: int, cpu_ns: int, nbytes: int) -> None:
            notes.append(solo)

    got = []
    natively = False
    for alone in (False, True):

        async def run(alone: bool = alone) -> list[torch.Tensor]:
            nonlocal natively
            caches = make_caches(torch.bfloat16, fused=False, layers=3, seed=11)
            block_bytes = sum(c[0].numel() * c.element_size() for c in caches)
            cfg = {"tiers": [{"backend": "cpu", "capacity": 16 * block_bytes}]}
            async with kvtier.open(cfg, kv_caches=caches) as store:
                assert store.layout is not None
                if store.layout.native is not None:
                    store.layout.native.enabled = native
                    natively = native
                store.layout.copies.pace = Held()
                if alone:
                    store.layout.copies.pace.until = float("inf")
                keys = [bytes([i]) * 32 for i in range(4)]
                assert await store.save(keys, [3, 9, 0, 5]) == 4
                assert await store.load(keys, [1, 2, 4, 6]) == 4
                assert store.transfers.counters["inline_jobs"] == 2
                # as bytes: random bit patterns hold NaNs, which torch.equal never finds equal
                return [c[[1, 2, 4, 6]].view(torch.uint8) for c in caches] + [c[[3, 9, 0, 5]].view(torch.uint8) for c in caches]

        got.append(asyncio.run(run()))
    # the save and the load on the team, then alone; natively (small jobs: one thread), those on the team are not counted
    assert notes == ([] if natively else [False, False]) + [True, True]
    for a, b in zip(*got):
        assert torch.equal(a, b)
    half = len(got[0]) // 2
    assert all(torch.equal(x, y) for x, y in zip(got[1][:half], got[1][half:]))
