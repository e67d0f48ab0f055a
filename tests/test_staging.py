"""StagedCopier on the CUDA stand-in: exact bytes, chunking, the two-halves ordering, fallbacks."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import pytest
import torch

from kvtier.transfer.layout import KVLayout

if TYPE_CHECKING:
    from cuda_standin import CudaStandIn, Op

pytest_plugins = ("cuda_standin",)


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int, *, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(shape)
    return t.to(device) if device != "cpu" else t


# (name, per-layer shape after the block dim, dtype, layers, blocks in the cache)
SHAPES = [
    ("fused-bf16", (2, 4, 2, 16), torch.bfloat16, 4, 48),
    ("small-pages-8KiB-x80", (2, 16, 128), torch.float16, 80, 48),  # 8 KiB per layer and block
    ("odd-bytes", (3, 5), torch.uint8, 3, 48),  # 15-byte slices: uint8 words
]


def make_layout(
    shape: tuple[int, ...], dtype: torch.dtype, layers: int, blocks: int, n: int, staging: int, seed: int = 0
) -> tuple[KVLayout, list[torch.Tensor]]:
    caches = [random_bytes((blocks, *shape), dtype, seed + i, device="cuda") for i in range(layers)]
    return KVLayout(caches, engine_blocks_per_block=n, staging_bytes=staging), caches


def expected_records(caches: list[torch.Tensor], ids: list[int], n: int) -> torch.Tensor:
    """The records of ``ids`` (``n`` per block), built the slow obvious way."""
    rows = []
    for j in range(len(ids) // n):
        # tensor by tensor, n slices each
        per_tensor = [torch.cat([c[ids[j * n + m]].reshape(-1).view(torch.uint8) for m in range(n)]) for c in caches]
        rows.append(torch.cat(per_tensor))
    return torch.stack(rows)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("case", SHAPES, ids=[c[0] for c in SHAPES])
def test_staged_round_trip_is_byte_exact(cuda_standin: CudaStandIn, case: tuple, n: int) -> None:
    _, shape, dtype, layers, blocks = case
    probe, _ = make_layout(shape, dtype, layers, blocks, n, 0)
    # Staging for 3 blocks per chunk: a 7-block job takes 3 chunks and reuses both halves.
    layout, caches = make_layout(shape, dtype, layers, blocks, n, 4 * 3 * probe.block_bytes)
    assert layout.staging.chunk_blocks == 3
    k = 7
    g = torch.Generator().manual_seed(n)
    ids = torch.randperm(blocks // 2, generator=g)[: k * n].tolist()
    pool = torch.zeros((12, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    rows = [9, 2, 3, 4, 0, 11, 6]  # runs and gaps, not in order
    layout.gather(ids, pool, rows)
    want = expected_records(caches, ids, n)
    for j, row in enumerate(rows):
        assert torch.equal(pool[row], want[j]), f"block {j} (pool row {row})"
    assert not pool[[1, 5, 7, 8, 10]].any(), "rows not named were written"
    dst = list(range(blocks // 2, blocks // 2 + k * n))
    before = [c.clone() for c in caches]
    layout.scatter(pool, rows, dst)
    for c, b in zip(caches, before):
        cb, bb = c.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(cb[dst], bb[ids]), "loaded bytes differ"
        untouched = [i for i in range(blocks) if i not in dst]
        assert torch.equal(cb[untouched], bb[untouched]), "blocks not named were written"
    st = layout.staging.stats()
    assert st["save_mode"] == st["load_mode"] == "staged"
    assert st["staged_jobs"] == 2 and st["chunks"] == 6
    assert st["device_staging_allocated"] == 2 * 2 * 3 * layout.block_bytes


def gathers_into(s: CudaStandIn, half: torch.Tensor) -> list[Op]:
    return [o for o in s.ops("index_select", writes=half)]


def test_save_chunks_one_gather_per_tensor_and_the_two_halves_ordering(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    layers = 5
    layout, caches = make_layout((2, 8, 16), torch.bfloat16, layers, 32, 1, 0)
    layout.staging.configure(4 * 3 * layout.block_bytes)  # 3 blocks per chunk
    ids = [5, 9, 1, 30, 2, 7, 11, 4]  # 8 blocks: chunks of 3, 3, 2
    calls: list[tuple[int, int, Op]] = []
    device_done: list[Op] = []

    def sink(first: int, rows: torch.Tensor) -> None:
        read = s.mark("disk-write", reads=[rows], on_host=True)
        assert torch.equal(rows, expected_records(caches, ids[first : first + len(rows)], 1))
        calls.append((first, len(rows), read))

    s.clear()
    layout.gather_chunks(ids, sink, on_device_done=lambda: device_done.append(s.mark("device-done", on_host=True)))
    assert [(f, k) for f, k, _ in calls] == [(0, 3), (3, 3), (6, 2)]
    lane = layout.staging._lanes["save"]
    halves = [lane.buf()[0], lane.buf()[1]]
    host = lane.host
    assert host is not None
    gathers = [o for o in s.ops("index_select") if o.writes and any(s.overlaps(w, lane.buf()) for w in o.writes)]
    assert len(gathers) == 3 * layers, "one index op per KV tensor and chunk"
    dmas = [o for o in s.ops("copy_", writes=host) if o.stream is not None]
    assert len(dmas) == 3, "one DMA per chunk"
    assert all(d.stream is lane.stream for d in dmas) and all(g.stream is not lane.stream for g in gathers)
    by_chunk = [gathers[i * layers : (i + 1) * layers] for i in range(3)]
    for i, dma in enumerate(dmas):
        half = halves[i % 2]
        assert all(s.touches(g, half) for g in by_chunk[i])
        assert all(s.happens_before(g, dma) for g in by_chunk[i]), f"DMA {i} may start before its gather"
    # Half 0 is reused by chunk 2 only after chunk 0's DMA out of it ...
    assert all(s.happens_before(dmas[0], g) for g in by_chunk[2])
    # ... while chunk 1's gather may overlap chunk 0's DMA (no false dependency).
    assert not any(s.happens_before(dmas[0], g) for g in by_chunk[1])
    # The disk sees each chunk only after its DMA; device-done follows every DMA.
    for (_, _, read), dma in zip(calls, dmas):
        assert s.happens_before(dma, read)
    assert len(device_done) == 1 and all(s.happens_before(d, device_done[0]) for d in dmas)
    # The caller's stream covers the whole job.
    after = s.mark("after", reads=[caches[0]])
    assert all(s.happens_before(d, after) for d in dmas)


def test_load_ordering_dma_after_earlier_scatter_and_scatter_after_dma(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    layers = 3
    layout, caches = make_layout((4, 64), torch.float16, layers, 40, 1, 0)
    layout.staging.configure(4 * 2 * layout.block_bytes)  # 2 blocks per chunk
    pool = torch.empty((10, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    src_ids = [1, 2, 3, 4, 5, 6]
    layout.gather(src_ids, pool, range(6))
    s.clear()
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        layout.scatter(pool, range(6), [20, 21, 22, 23, 24, 25], non_blocking=True)
    lane = layout.staging._lanes["load"]
    dmas = [o for o in s.ops("copy_", writes=lane.buf())]
    scatters = [o for o in s.ops("index_copy_") if o.stream is side]
    assert len(dmas) == 3 and len(scatters) == 3 * layers
    by_chunk = [scatters[i * layers : (i + 1) * layers] for i in range(3)]
    for i, dma in enumerate(dmas):
        assert dma.stream is lane.stream
        assert all(s.happens_before(dma, sc) for sc in by_chunk[i]), f"scatter {i} may read before its DMA"
    assert all(s.happens_before(sc, dmas[2]) for sc in by_chunk[0]), "half 0 refilled before its scatter finished"
    assert not any(s.happens_before(sc, dmas[1]) for sc in by_chunk[0]), "DMA 1 needlessly waits for scatter 0"
    assert compute is not side
    for c in caches:
        assert torch.equal(c.view(torch.uint8)[20:26], c.view(torch.uint8)[1:7])


def test_load_chunks_with_misses_fills_only_found_blocks(cuda_standin: CudaStandIn) -> None:
    layout, caches = make_layout((2, 4, 32), torch.bfloat16, 3, 30, 2, 0)
    layout.staging.configure(4 * 3 * layout.block_bytes)
    src = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # 7 blocks of 2 engine blocks
    records = expected_records(caches, src, 2)
    present = [True, False, True, True, False, False, True]
    before = [c.clone() for c in caches]
    dst = list(range(15, 29))

    def source(first: int, rows: torch.Tensor) -> list[bool]:
        out = []
        for j in range(len(rows)):
            ok = present[first + j]
            rows[j].copy_(records[first + j] if ok else torch.full_like(rows[j], 0xEE))
            out.append(ok)
        return out

    found = layout.scatter_chunks(dst, source)
    assert found == present
    for c, b in zip(caches, before):
        cb, bb = c.view(torch.uint8), b.view(torch.uint8)
        for j, ok in enumerate(present):
            want = bb[src[2 * j : 2 * j + 2]] if ok else bb[dst[2 * j : 2 * j + 2]]
            assert torch.equal(cb[dst[2 * j : 2 * j + 2]], want), f"block {j} (found={ok})"


def memmove_batch(calls: list[int]):  # type: ignore[no-untyped-def]
    def batch(dsts: list[int], srcs: list[int], sizes: list[int], stream: object) -> None:
        calls.append(len(sizes))
        for d, src, n in zip(dsts, srcs, sizes):
            ctypes.memmove(d, src, n)

    return batch


@pytest.mark.parametrize("n", [1, 2])
def test_no_staging_memory_falls_back_to_one_batched_copy(cuda_standin: CudaStandIn, n: int) -> None:
    layout, caches = make_layout((2, 4, 16), torch.float16, 4, 20, n, 1 << 20)
    cuda_standin.device_memory_free = layout.block_bytes  # the staging cannot be allocated
    calls: list[int] = []
    layout.staging.batch_copy = memmove_batch(calls)
    ids = list(range(3, 3 + 4 * n))
    pool = torch.zeros((6, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    layout.gather(ids, pool, [5, 0, 2, 3])
    assert torch.equal(pool[[5, 0, 2, 3]], expected_records(caches, ids, n))
    assert calls == [4 * 4 * n], "one batch of every (block, tensor, engine block) slice"
    before = [c.clone() for c in caches]
    dst = list(range(12, 12 + 4 * n))
    layout.scatter(pool, [5, 0, 2, 3], dst)
    for c, b in zip(caches, before):
        assert torch.equal(c.view(torch.uint8)[dst], b.view(torch.uint8)[ids])
    st = layout.staging.stats()
    assert st["save_mode"] == "batched" and st["batched_jobs"] == 2
    assert st["device_staging_allocated"] == 0
    assert not cuda_standin.ops("index_select", kind="device"), "no staging gather ran"


def test_without_batch_bindings_the_fallback_is_foreach(cuda_standin: CudaStandIn) -> None:
    layout, caches = make_layout((8, 16), torch.bfloat16, 3, 10, 1, 0)  # staging_bytes=0: disabled
    layout.staging.batch_copy = None
    layout.staging._batch_checked = True  # as if cuda-python were not installed
    pool = torch.zeros((4, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    layout.gather([7, 1], pool, [3, 1])
    assert torch.equal(pool[[3, 1]], expected_records(caches, [7, 1], 1))
    assert layout.staging.stats()["save_mode"] == "foreach"
    assert len(cuda_standin.ops("_foreach_copy_")) == 1


def test_a_failing_batch_binding_is_dropped_for_foreach(cuda_standin: CudaStandIn) -> None:
    layout, caches = make_layout((8, 16), torch.bfloat16, 2, 10, 1, 0)

    def broken(*args: object) -> None:
        raise RuntimeError("cudaErrorInvalidValue")

    layout.staging.batch_copy = broken
    layout.staging._batch_checked = True
    pool = torch.zeros((4, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    layout.gather([4, 2], pool, [0, 1])
    assert torch.equal(pool[[0, 1]], expected_records(caches, [4, 2], 1))
    assert layout.staging.stats()["save_mode"] == "foreach"


def test_same_device_pool_is_one_index_op_per_tensor(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    layout, caches = make_layout((2, 8, 16), torch.bfloat16, 6, 20, 1, 1 << 20)
    pool = torch.zeros((16, layout.block_bytes), dtype=torch.uint8, device="cuda")
    ids = [3, 9, 1, 14, 6]
    rows = [4, 5, 6, 7, 8]
    s.clear()
    layout.gather(ids, pool, rows)
    assert torch.equal(pool[rows], expected_records(caches, ids, 1))
    assert len(s.ops("index_select")) == 6 and not s.ops("index_copy_"), "gather straight into the pool"
    before = [c.clone() for c in caches]
    s.clear()
    layout.scatter(pool, [8, 5, 6, 7, 4], [10, 11, 12, 13, 15])
    assert len(s.ops("index_copy_")) == 6 and not s.ops("index_select")
    for c, b in zip(caches, before):
        cb, bb = c.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(cb[[10, 11, 12, 13, 15]], bb[[6, 9, 1, 14, 3]])
    assert layout.staging.stats()["device_staging_allocated"] == 0, "no staging on one device"
    # Three runs of rows: one index op per (run, tensor).
    s.clear()
    layout.gather([2, 4, 6, 8, 10], pool, [10, 11, 3, 4, 14])
    assert torch.equal(pool[[10, 11, 3, 4, 14]], expected_records(caches, [2, 4, 6, 8, 10], 1))
    assert len(s.ops("index_select")) == 3 * 6 and not s.ops("index_copy_")
    # Fragmented rows: a gather and a scatter per tensor, still exact.
    frag = [0, 2, 9, 11, 13, 15]
    layout.gather([1, 2, 3, 4, 5, 6], pool, frag)
    assert torch.equal(pool[frag], expected_records(caches, [1, 2, 3, 4, 5, 6], 1))


def test_host_layout_chunks_use_the_index_path() -> None:
    caches = [random_bytes((12, 4, 8), torch.float16, i) for i in range(3)]
    layout = KVLayout(caches, staging_bytes=4 * 2 * 3 * 64)
    assert layout.staging.chunk_blocks == 2
    got: list[tuple[int, torch.Tensor]] = []
    layout.gather_chunks([3, 1, 4, 1, 5], lambda first, rows: got.append((first, rows.clone())))
    assert [f for f, _ in got] == [0, 2, 4]
    assert torch.equal(torch.cat([r for _, r in got]), expected_records(caches, [3, 1, 4, 1, 5], 1))
    recs = torch.cat([r for _, r in got])

    def source(first: int, rows: torch.Tensor) -> list[bool]:
        rows.copy_(recs[first : first + len(rows)])
        return [True] * len(rows)

    before = [c.clone() for c in caches]
    assert layout.scatter_chunks([6, 7, 8, 9, 10], source) == [True] * 5
    for c, b in zip(caches, before):
        assert torch.equal(c.view(torch.uint8)[6:11], b.view(torch.uint8)[[3, 1, 4, 1, 5]])
    assert layout.staging.stats()["host_jobs"] == 2


def test_staging_bytes_is_checked() -> None:
    from kvtier.errors import LayoutError

    with pytest.raises(LayoutError, match="staging_bytes"):
        KVLayout([torch.zeros((2, 8))], staging_bytes=-1)


def test_save_into_pool_rows_reuses_a_half_only_after_its_dma(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    layers = 2
    layout, caches = make_layout((4, 32), torch.bfloat16, layers, 30, 1, 0)
    layout.staging.configure(4 * 2 * layout.block_bytes)  # 2 blocks per chunk
    pool = torch.zeros((8, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    s.clear()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        layout.gather([1, 2, 3, 4, 5, 6], pool, [0, 1, 2, 3, 4, 5], non_blocking=True)
    lane = layout.staging._lanes["save"]
    gathers = [
        o for o in s.ops("index_select") if o.stream is side and any(s.overlaps(w, lane.buf()) for w in o.writes)
    ]
    dmas = s.ops("copy_", writes=pool)
    assert len(gathers) == 3 * layers and len(dmas) == 3, "rows 0-5 are one run: one DMA per chunk"
    by_chunk = [gathers[i * layers : (i + 1) * layers] for i in range(3)]
    assert all(s.happens_before(dmas[0], g) for g in by_chunk[2]), "half 0 overwritten before its DMA finished"
    assert not any(s.happens_before(dmas[0], g) for g in by_chunk[1])
    with torch.cuda.stream(side):
        later = s.mark("caller's next op")
    assert all(s.happens_before(d, later) for d in dmas), "the caller's stream does not cover the DMAs"
    assert torch.equal(pool[:6], expected_records(caches, [1, 2, 3, 4, 5, 6], 1))


def test_load_chunks_refills_a_host_half_only_after_its_dma(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    layout, caches = make_layout((4, 32), torch.bfloat16, 2, 30, 1, 0)
    layout.staging.configure(4 * 2 * layout.block_bytes)  # 2 blocks per chunk
    records = expected_records(caches, [1, 2, 3, 4, 5, 6], 1)
    fills: list[Op] = []

    def source(first: int, rows: torch.Tensor) -> list[bool]:
        fills.append(s.mark("disk-read", writes=[rows], on_host=True))
        rows.copy_(records[first : first + len(rows)])
        return [True] * len(rows)

    s.clear()
    layout.scatter_chunks([20, 21, 22, 23, 24, 25], source)
    lane = layout.staging._lanes["load"]
    assert lane.host is not None
    dmas = [o for o in s.ops("copy_", reads=lane.host) if o.stream is lane.stream]
    assert len(dmas) == 3 and len(fills) == 3
    assert s.happens_before(dmas[0], fills[2]), "host half 0 refilled while its DMA may still read it"
    assert not s.happens_before(dmas[1], fills[2])
    for c in caches:
        assert torch.equal(c.view(torch.uint8)[20:26], c.view(torch.uint8)[1:7])


async def test_store_config_staging_bytes_reaches_the_layout_and_stats(cuda_standin: CudaStandIn) -> None:
    import kvtier
    from kvtier.testing import make_key

    caches = [random_bytes((16, 2, 8, 16), torch.bfloat16, i, device="cuda") for i in range(4)]
    block = 4 * 2 * 8 * 16 * 2
    cfg = {"tiers": [{"backend": "cpu", "capacity": 16 * block}], "staging_bytes": 4 * 2 * block}
    async with kvtier.open(cfg, kv_caches=caches) as store:
        assert store.stats()["staging"]["device_staging_allocated"] == 0, "allocated lazily"
        keys = [make_key(i) for i in range(5)]
        writer = cuda_standin.mark("compute kernel writing the cache", writes=caches)
        assert await store.save(keys, [1, 2, 3, 4, 5]) == 5
        reads = [o for c in caches for o in cuda_standin.ops("index_select", reads=c)]
        assert len(reads) == len(caches) * 3, "one gather per tensor and chunk (2 + 2 + 1 blocks)"
        assert all(cuda_standin.happens_before(writer, o) for o in reads), "a save read bytes still being written"
        before = [c.clone() for c in caches]
        reader = cuda_standin.mark("compute kernel reading the cache", reads=caches)
        assert await store.load(keys, [10, 11, 12, 13, 14]) == 5
        writes = [o for c in caches for o in cuda_standin.ops("index_copy_", writes=c)]
        assert len(writes) == len(caches) * 3
        assert all(cuda_standin.happens_before(reader, o) for o in writes), "a load overwrote blocks still being read"
        done = cuda_standin.mark("engine reads the loaded blocks", reads=caches)
        assert all(cuda_standin.happens_before(o, done) for o in writes), "finished before its copies completed"
        for c, b in zip(caches, before):
            assert torch.equal(c.view(torch.uint8)[10:15], b.view(torch.uint8)[1:6])
        st = store.stats()["staging"]
    assert store.layout is not None and store.layout.staging.stats()["device_staging_allocated"] == 0, (
        "kept after close"
    )
    assert st["staging_bytes"] == 4 * 2 * block and st["chunk_blocks"] == 2
    assert st["save_mode"] == st["load_mode"] == "staged" and st["staged_jobs"] == 2
    assert st["device_staging_allocated"] == 2 * 2 * 2 * block


def test_reconfiguring_releases_and_resizes_the_staging(cuda_standin: CudaStandIn) -> None:
    layout, caches = make_layout((4, 32), torch.bfloat16, 2, 20, 1, 0)
    layout.staging.configure(4 * 3 * layout.block_bytes)
    pool = torch.zeros((8, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    layout.gather([1, 2, 3, 4, 5], pool, range(5))
    assert layout.staging.stats()["device_staging_allocated"] == 2 * 3 * layout.block_bytes
    layout.staging.configure(4 * 2 * layout.block_bytes)
    assert layout.staging.stats()["device_staging_allocated"] == 0
    layout.gather([6, 7, 8, 9, 10], pool, range(5))
    assert layout.staging.stats()["device_staging_allocated"] == 2 * 2 * layout.block_bytes
    assert torch.equal(pool[:5], expected_records(caches, [6, 7, 8, 9, 10], 1))


@pytest.mark.parametrize("where", ["cpu-pool", "gpu-pool"])
def test_queued_copies_never_make_the_host_wait(cuda_standin: CudaStandIn, where: str) -> None:
    """A job's copies are queued behind the compute stream; the host thread that queues them
    must not wait for that stream (a pageable index copy would)."""
    layout, caches = make_layout((4, 32), torch.bfloat16, 3, 20, 1, 1 << 20)
    if where == "cpu-pool":
        pool = torch.zeros((8, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    else:
        pool = torch.zeros((8, layout.block_bytes), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    cuda_standin.clear()
    with torch.cuda.stream(side):
        layout.gather([3, 1, 4], pool, [0, 1, 2], non_blocking=True)
        layout.scatter(pool, [0, 1, 2], [10, 11, 12], non_blocking=True)
    assert not cuda_standin.ops("synchronize", stream=None), cuda_standin.ops(stream=None)
    torch.cuda.synchronize()
    for c in caches:
        assert torch.equal(c.view(torch.uint8)[10:13], c.view(torch.uint8)[[3, 1, 4]])
