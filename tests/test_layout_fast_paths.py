"""KVLayout's fast paths for small host jobs against its general ones: views of long-lived pools
made once (``kept=True``) and a job whose pool rows are one run (one ``index_select`` per
tensor, no index slices). Same bytes in every row, nothing else written, the right pool
every time, and nothing held once the views are forgotten."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Sequence

import pytest
import torch

import kvtier
from kvtier.transfer import layout as layout_module
from kvtier.transfer import pool_views
from kvtier.transfer.layout import KVLayout
from kvtier.transfer.pool_views import host_index

BLOCKS = 12


def _caches(seed: int, uniform: bool = False) -> list[torch.Tensor]:
    """Three tensors of different block sizes, or (``uniform``) four of the same: then every
    tensor's share of a record is as wide, and a run's views come from one ``unbind``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(BLOCKS, 4, 2, 8)] * 4 if uniform else [(BLOCKS, 4, 2, 8), (BLOCKS, 4, 3, 4), (BLOCKS, 2, 4, 2, 8)]
    return [torch.randint(0, 256, (BLOCKS, *s[1:]), dtype=torch.uint8, generator=g).view(torch.uint8) for s in shapes]


ROWS = [
    [0, 1, 2],  # one run, in order
    [5, 3, 4],  # one run, out of order
    [7],  # one row
    [4, 0, 2],  # three runs
    [1, 2, 6, 7],  # two runs
]


@pytest.mark.parametrize("rows", ROWS, ids=str)
@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("here", [False, True], ids=["parts", "callers-loop"])
@pytest.mark.parametrize("uniform", [False, True], ids=["mixed", "uniform"])
def test_gather_and_scatter_match_the_pairwise_copy(rows: list[int], kept: bool, here: bool, uniform: bool) -> None:
    """The index strategy (one run or several, views kept or not, part by part or in the
    caller's own loop as an inline job copies, tensors of one block size or several) writes
    the bytes the per-block ``foreach`` strategy writes, and only into the rows named."""
    caches = _caches(1, uniform)
    fast = KVLayout([c.clone() for c in caches], strategy="index")
    slow = KVLayout([c.clone() for c in caches], strategy="foreach")
    team = fast.copies.on_callers_team() if here else contextlib.nullcontext()
    ids = [9, 2, 11, 5][: len(rows)]
    pools = [torch.zeros((8, fast.block_bytes), dtype=torch.uint8) for _ in range(2)]
    with team:
        assert fast.copies.on_this_thread() is here
        for _ in range(2):  # a second time through the kept views
            fast.gather(ids, pools[0], rows, kept=kept)
    slow.gather(ids, pools[1], rows)
    assert torch.equal(pools[0], pools[1])
    others = [r for r in range(8) if r not in rows]
    assert not pools[0][others].any()
    dst = [0, 3, 6, 10][: len(rows)]
    for layout in (fast, slow):
        for c in layout.kv_caches:
            c.zero_()
    with fast.copies.on_callers_team() if here else contextlib.nullcontext():
        fast.scatter(pools[0], rows, dst, kept=kept)
    slow.scatter(pools[1], rows, dst)
    for a, b, orig in zip(fast.kv_caches, slow.kv_caches, caches):
        assert torch.equal(a, b)
        assert torch.equal(a[dst], orig[ids])


def test_kept_views_follow_the_pool_they_were_made_for() -> None:
    """Two long-lived pools of the same shape (a tier's pool and the staging): each job writes
    into its own pool, never into the other's through a view kept for it."""
    caches = _caches(2)
    layout = KVLayout(caches, strategy="index")
    a = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
    b = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
    layout.gather([1, 2], a, [0, 1], kept=True)
    layout.gather([3, 4], b, [0, 1], kept=True)
    layout.gather([5], a, [2], kept=True)
    ref = KVLayout(caches, strategy="foreach")
    want_a = torch.zeros_like(a)
    want_b = torch.zeros_like(b)
    ref.gather([1, 2, 5], want_a, [0, 1, 2])
    ref.gather([3, 4], want_b, [0, 1])
    assert torch.equal(a, want_a) and torch.equal(b, want_b)


def test_forgotten_views_let_the_pool_go() -> None:
    layout = KVLayout(_caches(3), strategy="index")
    pool = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
    layout.gather([1], pool, [0], kept=True)
    gone = weakref.ref(pool)
    del pool
    gc.collect()
    assert gone() is not None  # held by the kept views, as long as the layout serves the tier
    layout.staging.close()  # the store closes its staging, then its tiers
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("uniform", [False, True], ids=["mixed", "uniform"])
async def test_a_closed_store_holds_no_pool(uniform: bool) -> None:
    # one block size: a run's views come from one unbind of the rows; two: they are cut from
    # the kept column views; either way the run's views are kept, with the pool
    shapes = [(8, 4, 2, 8), (8, 4, 2, 8) if uniform else (8, 4, 3, 4)]
    caches = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    store = await kvtier.open({"tiers": [{"backend": "cpu", "capacity": "1MiB"}]}, kv_caches=caches).__aenter__()
    keys = [bytes([i]) * 32 for i in range(2)]
    assert await store.save(keys, [1, 2]) == 2
    assert await store.load(keys, [3, 4]) == 2
    layout = store.layout
    assert layout is not None
    native = layout.native  # (where built, a small job's copy holds the pool's address instead)
    assert layout.pool_views.held() or (native is not None and native.held())
    await store.aclose()
    assert not layout.pool_views.held() and not (native is not None and native.held())


@pytest.mark.parametrize("uniform", [False, True], ids=["mixed", "uniform"])
@pytest.mark.parametrize("kept", [False, True])
def test_row_views_are_the_column_views_cut_to_the_rows(uniform: bool, kept: bool) -> None:
    """A run's per-tensor views (one ``unbind`` where every tensor's share is as wide) are
    exactly the kept column views sliced to the run's rows: same memory, shape and strides;
    a pool that is not contiguous takes the slices."""
    layout = KVLayout(_caches(3, uniform), strategy="index")
    assert bool(layout._span) is uniform
    wide = torch.zeros((10, 2 * layout.block_bytes), dtype=torch.uint8)
    for pool in (torch.zeros((10, layout.block_bytes), dtype=torch.uint8), wide[:, : layout.block_bytes]):
        for r0, end in ((0, 10), (3, 7), (9, 10)):
            got = layout._row_views(pool, kept, r0, end)
            want = [v[r0:end] for v in layout._dst_views(pool, kept)]
            assert len(got) == len(want) == len(layout.kv_caches)
            for a, b in zip(got, want):
                assert (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("limit", [0, 16], ids=["per_tensor", "foreach"])
@pytest.mark.parametrize("uniform", [False, True], ids=["mixed", "uniform"])
def test_an_inline_job_of_one_run_moves_the_same_bytes_either_way(
    limit: int, uniform: bool, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An inline job into or out of one run of pool rows copies a small job per (block, tensor)
    (its pieces' views kept on both sides) and a larger one per tensor
    (``_FOREACH_MAX_BLOCKS``): both move the bytes the pairwise copy moves, into the rows and
    blocks named and no other, the second time through the kept views too."""
    monkeypatch.setattr(layout_module, "_FOREACH_MAX_BLOCKS", limit)
    caches = _caches(4, uniform)
    fast = KVLayout([c.clone() for c in caches], strategy="index")
    slow = KVLayout([c.clone() for c in caches], strategy="foreach")
    rows = [3, 4, 5, 6, 7, 8, 9, 10, 11, 2]  # one run, out of order
    ids = [5, 1, 8, 0, 11, 3, 6, 2, 9, 7]
    pools = [torch.zeros((BLOCKS + 2, fast.block_bytes), dtype=torch.uint8) for _ in range(2)]
    for _ in range(2):
        with fast.copies.on_callers_team():
            assert fast.copies.on_this_thread()
            fast.gather(ids, pools[0], rows, kept=kept)
        slow.gather(ids, pools[1], rows)
        assert torch.equal(pools[0], pools[1])
        assert not pools[0][[0, 1, 12, 13]].any()
    pool = torch.randint(0, 256, (BLOCKS, fast.block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    dst = [11, 0, 7, 2, 9, 4, 1, 10, 3, 6]
    for _ in range(2):
        for layout in (fast, slow):
            for c in layout.kv_caches:
                c.zero_()
        with fast.copies.on_callers_team():
            fast.scatter(pool, rows, dst, kept=kept)
        slow.scatter(pool, rows, dst)
        untouched = [b for b in range(BLOCKS) if b not in dst]
        for a, b in zip(fast.kv_caches, slow.kv_caches):
            assert torch.equal(a, b)
            assert not a[untouched].any()


def test_kept_block_views_are_the_views_made_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine block's kept views are the views of its slices made afresh, block-major, in
    the order asked; past ``MAX_KEPT_VIEWS`` the other blocks' views are made each time and
    not kept."""
    monkeypatch.setattr(pool_views, "MAX_KEPT_VIEWS", 7)
    layout = KVLayout(_caches(6), strategy="index")
    views = layout.block_views
    tensors = layout._src
    for blocks in ([4, 1], [1, 9, 4], [0, 2, 3, 4], [9]):
        for _ in range(2):
            got = views.pieces(blocks)
            want = [t[b].view(torch.uint8) for b in blocks for t in tensors]
            assert len(got) == len(want)
            for a, b in zip(got, want):
                assert (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)
    assert sorted(views._kept) == [1, 4]  # 7 views: two blocks of three tensors


@pytest.mark.parametrize("uniform", [False, True], ids=["mixed", "uniform"])
def test_kept_run_views_are_the_views_made_afresh(uniform: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's kept views (and its rows cut one by one) are the views made afresh for the same
    rows: same memory, shape and strides; a pool of the same shape gets its own; past
    ``MAX_KEPT_VIEWS`` the kept runs are dropped and made again, still the right ones."""
    monkeypatch.setattr(pool_views, "MAX_KEPT_VIEWS", 40)
    layout = KVLayout(_caches(3, uniform), strategy="index")
    views = layout.pool_views
    pools = [torch.zeros((10, layout.block_bytes), dtype=torch.uint8) for _ in range(2)]

    def same(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)

    for _ in range(2):  # the second time round from the kept runs (or made again past the cap)
        for pool in pools:
            for r0, end in ((0, 4), (3, 7), (9, 10), (0, 4)):
                same(views.rows(pool, True, r0, end), views.rows(pool, False, r0, end))
                same(views.row_pieces(pool, True, r0, end), views.row_pieces(pool, False, r0, end))
                rows = views.rows(pool, True, r0, end)
                same(views.row_pieces(pool, True, r0, end), [v[j].view(torch.uint8) for j in range(end - r0) for v in rows])
                kept = sum(len(e[1]) + len(e[2] or ()) for e in views._runs.values())  # type: ignore[arg-type]
                assert kept == views._kept <= 40


@pytest.mark.parametrize("values", [[], [0], [7, 3, 3, 11], list(range(40, 0, -3))], ids=str)
def test_host_index_is_the_index_torch_tensor_makes(values: list[int]) -> None:
    got = host_index(values, torch.device("cpu"))
    want = torch.tensor(values, dtype=torch.long)
    assert got.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want)
    del values  # the index holds its own buffer
    gc.collect()
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", ROWS, ids=str)
def test_a_jobs_own_checked_copy_moves_what_the_checked_call_moves(rows: list[int]) -> None:
    """``checked=True`` (a transfer job's own gather and scatter, ids checked at submit) skips
    the checks only: the same bytes into the same rows and blocks as the checking call."""
    caches = _caches(7)
    a = KVLayout([c.clone() for c in caches], strategy="index")
    b = KVLayout([c.clone() for c in caches], strategy="index")
    ids = [9, 2, 11, 5][: len(rows)]
    pools = [torch.zeros((8, a.block_bytes), dtype=torch.uint8) for _ in range(2)]
    a.gather(list(ids), pools[0], rows, kept=True, checked=True)
    b.gather(ids, pools[1], rows, kept=True)
    assert torch.equal(pools[0], pools[1]) and pools[0].any()
    dst = [0, 3, 6, 10][: len(rows)]
    a.scatter(pools[0], rows, list(dst), kept=True, checked=True)
    b.scatter(pools[1], rows, dst, kept=True)
    for x, y, orig in zip(a.kv_caches, b.kv_caches, caches):
        assert torch.equal(x, y) and torch.equal(x[dst], orig[ids])
    with pytest.raises(kvtier.errors.LayoutError):  # not a job's own list: checked as ever
        a.gather((99,) * len(rows), pools[0], rows, checked=True)


@pytest.mark.parametrize(
    "rows", [[0, 1, 2, 3], [5], [3, 5, 4, 6], [2, 3, 4, 1], [4, 5, 7, 6], [1, 2, 4, 5], [7, 6, 5], [0, 2, 4, 6, 8, 10]], ids=str
)
def test_row_runs_of_an_ordered_run_are_the_sorted_split(rows: list[int]) -> None:
    """A job's rows in one ascending run are taken as one run at a glance; every other job is
    sorted and split: either way the runs are the positions sorted by row, cut where a row is
    not the one after the last."""
    layout = KVLayout(_caches(8), strategy="index")
    order = sorted(range(len(rows)), key=rows.__getitem__)
    want: list[tuple[list[int], int, int]] = []
    for p in order:
        if want and rows[p] == want[-1][1] + want[-1][2]:
            want[-1][0].append(p)
            want[-1] = (want[-1][0], want[-1][1], want[-1][2] + 1)
        else:
            want.append(([p], rows[p], 1))
    got = layout._row_runs(torch.empty(0), rows)
    assert got == (want if len(want) <= layout_module._MAX_RUNS else None)
