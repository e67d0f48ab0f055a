"""KVLayout: byte-exact gather / scatter for every dtype, layout and strategy, and its errors."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import LayoutError
from kvtier.transfer.layout import KVLayout

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32]
NUM_BLOCKS = 12


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    # Random bytes, not random values: every bit pattern (NaNs included) must survive.
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def make_caches(dtype: torch.dtype, fused: bool, layers: int = 3, seed: int = 0) -> list[torch.Tensor]:
    if fused:  # one [blocks, 2, tokens, heads, dim] tensor per layer
        return [random_cache((NUM_BLOCKS, 2, 4, 2, 8), dtype, seed + i) for i in range(layers)]
    # K and V split, with different shapes per tensor to catch offset mistakes
    out = []
    for i in range(layers):
        out.append(random_cache((NUM_BLOCKS, 4, 2, 8), dtype, seed + 2 * i))
        out.append(random_cache((NUM_BLOCKS, 4, 3, 4), dtype, seed + 2 * i + 1))
    return out


@pytest.mark.parametrize("strategy", ["index", "foreach", "auto"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_byte_exact(dtype: torch.dtype, fused: bool, n: int, strategy: str) -> None:
    caches = make_caches(dtype, fused)
    original = [c.clone() for c in caches]
    layout = KVLayout(caches, engine_blocks_per_block=n, strategy=strategy)  # type: ignore[arg-type]
    per_engine_block = sum(c[0].numel() * c.element_size() for c in caches)
    assert layout.block_bytes == n * per_engine_block
    blocks = 3
    src_ids = [7, 2, 9, 0, 11, 4][: blocks * n]
    dst_ids = [1, 10, 3, 6, 5, 8][: blocks * n]
    pool = torch.zeros((5, layout.block_bytes), dtype=torch.uint8)
    rows = [4, 0, 2]
    layout.gather(src_ids, pool, rows)
    assert not pool[[1, 3]].any(), "rows not named were written"
    # The record is the engine blocks' slices, tensor by tensor.
    for j, row in enumerate(rows):
        views = layout.record_views(pool[row])
        for c, view in zip(original, views):
            want = c[src_ids[j * n : (j + 1) * n]]
            assert torch.equal(view.view(torch.uint8), want.view(torch.uint8))
    for c in caches:
        c.view(torch.uint8).zero_()
    layout.scatter(pool, rows, dst_ids)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_ids))
    for c, o in zip(caches, original):
        cb, ob = c.view(torch.uint8), o.view(torch.uint8)
        assert torch.equal(cb[dst_ids], ob[src_ids])
        assert not cb[untouched].any()


def test_mixed_dtypes_and_odd_sizes() -> None:
    caches = [random_cache((NUM_BLOCKS, 3), torch.uint8, 1), random_cache((NUM_BLOCKS, 5), torch.float16, 2)]
    original = [c.clone() for c in caches]
    layout = KVLayout(caches)
    assert layout.dtype == "uint8" and layout.block_bytes == 13
    pool = torch.zeros((2, 13), dtype=torch.uint8)
    layout.gather([5, 1], pool, [1, 0])
    for c in caches:
        c.zero_()
    layout.scatter(pool, [0, 1], [2, 3])
    for c, o in zip(caches, original):
        assert torch.equal(c[2].view(torch.uint8), o[1].view(torch.uint8))
        assert torch.equal(c[3].view(torch.uint8), o[5].view(torch.uint8))


def test_empty_jobs_do_nothing() -> None:
    caches = make_caches(torch.float16, True)
    layout = KVLayout(caches)
    pool = torch.zeros((2, layout.block_bytes), dtype=torch.uint8)
    layout.gather([], pool, [])
    layout.scatter(pool, [], [])
    assert not pool.any()


def test_fingerprint_describes_shapes_and_dtypes() -> None:
    a = KVLayout(make_caches(torch.float16, True))
    b = KVLayout(make_caches(torch.bfloat16, True))
    c = KVLayout(make_caches(torch.float16, True), engine_blocks_per_block=2)
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3
    assert a.fingerprint() == KVLayout(make_caches(torch.float16, True, seed=9)).fingerprint()
    assert "float16" in repr(a)


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(make_caches(torch.bfloat16, False), engine_blocks_per_block=2)


def test_wrong_block_id_count(layout: KVLayout) -> None:
    pool = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
    with pytest.raises(LayoutError, match="expected 4 engine block ids"):
        layout.gather([0, 1, 2], pool, [0, 1])
    with pytest.raises(LayoutError, match="expected 2 engine block ids"):
        layout.scatter(pool, [0], [0, 1, 2])


def test_block_id_out_of_range(layout: KVLayout) -> None:
    pool = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
    before = [c.clone() for c in layout.kv_caches]
    with pytest.raises(LayoutError, match=r"block_ids\[1\].*out of range"):
        layout.scatter(pool, [0], [0, NUM_BLOCKS])
    with pytest.raises(LayoutError, match="out of range"):
        layout.gather([-1, 0], pool, [0])
    with pytest.raises(LayoutError, match=r"rows\[0\]"):
        layout.gather([0, 1], pool, [4])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(layout.kv_caches, before))
    assert not pool.any()


def test_bad_pool(layout: KVLayout) -> None:
    with pytest.raises(LayoutError, match="pool"):
        layout.gather([0, 1], torch.zeros((2, layout.block_bytes + 1), dtype=torch.uint8), [0])
    with pytest.raises(LayoutError, match="pool"):
        layout.gather([0, 1], torch.zeros((2, layout.block_bytes // 2), dtype=torch.int16), [0])


def test_non_contiguous_tensor() -> None:
    t = torch.zeros((2, NUM_BLOCKS, 8), dtype=torch.float16).transpose(0, 1)
    with pytest.raises(LayoutError, match=r"kv_caches\[0\].*contiguous"):
        KVLayout([t])


def test_mismatched_block_counts() -> None:
    with pytest.raises(LayoutError, match=r"kv_caches\[1\].*5 blocks"):
        KVLayout([torch.zeros((NUM_BLOCKS, 8)), torch.zeros((5, 8))])


@pytest.mark.parametrize(
    ("caches", "kwargs", "match"),
    [
        ([], {}, "at least one"),
        ([torch.zeros(())], {}, "block dimension"),
        ([torch.zeros((4, 0))], {}, "empty"),
        (["not a tensor"], {}, "torch.Tensor"),
        ([torch.zeros((4, 2))], {"engine_blocks_per_block": 0}, "engine_blocks_per_block"),
        ([torch.zeros((4, 2))], {"strategy": "magic"}, "strategy"),
    ],
)
def test_other_construction_errors(caches: list[object], kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        KVLayout(caches, **kwargs)  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA TESTS NOT RUN: no CUDA device here")
def test_mismatched_devices() -> None:
    with pytest.raises(LayoutError, match="kv_caches\\[1\\]: on cuda"):
        KVLayout([torch.zeros((4, 8)), torch.zeros((4, 8), device="cuda")])


@pytest.mark.parametrize(
    "rows",
    [[4], [5, 6, 7, 8], [7, 5, 8, 6], [9, 0, 1, 4, 5], [0, 2, 4, 6, 8, 10]],  # one block, one run, shuffled, three runs, six (too many)
    ids=["one-block", "one-run", "one-run-shuffled", "three-runs", "six-runs"],
)
def test_row_runs_on_the_host_match_the_per_slice_copies(rows: list[int]) -> None:
    """Consecutive pool rows take one ``index_select`` / ``index_copy_`` per (run, tensor),
    straight into (or out of) the pool; the bytes are those of the general per-slice copies."""
    caches = make_caches(torch.bfloat16, fused=False, seed=5)
    ids = [11, 3, 0, 7, 9, 2][: len(rows)]
    fast, general = KVLayout(caches, strategy="index"), KVLayout(caches, strategy="foreach")
    assert (fast._row_runs(torch.empty(0), rows) is None) == (len(rows) == 6)
    assert_same_copies(fast, general, caches, ids, rows)


def assert_same_copies(a: KVLayout, b: KVLayout, caches: list[torch.Tensor], ids: list[int], rows: list[int]) -> None:
    """``a`` and ``b`` (two layouts of ``caches``) gather engine blocks ``ids`` into the same
    pool bytes at ``rows``, and scatter them back into the same cache bytes."""
    pools = []
    for layout in (a, b):
        pool = torch.zeros((12, layout.block_bytes), dtype=torch.uint8)
        layout.gather(ids, pool, rows)
        pools.append(pool)
    assert torch.equal(pools[0], pools[1]) and pools[0][rows].any()
    back = []
    for layout in (a, b):
        for c in caches:
            c.view(torch.uint8).zero_()
        layout.scatter(pools[0], rows, ids)
        back.append([c.clone() for c in caches])
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(*back))
    assert all(x[ids].view(torch.uint8).any() for x in back[0])
