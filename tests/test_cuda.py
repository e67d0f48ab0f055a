"""On a real CUDA device: staged copies are byte-exact, loads and stores are ordered against the
compute stream, the fence does not wait for a stalled lower tier.

Every test here is marked ``cuda`` (``pytest -m cuda`` selects them; ``scripts/gpu_check.sh``
runs them on a GPU machine). Without a device they are skipped, with the reason in the summary.
The same code paths run on CPU in ``test_staging.py`` through the CUDA stand-in.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Any

import pytest
import torch

import kvtier
from kvtier.testing import make_key
from kvtier.transfer.layout import KVLayout

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA TESTS NOT RUN: no CUDA device here"),
]

SLEEP_CYCLES = 50_000_000  # a spinning kernel of some tens of ms: the compute stream is busy


def random_cache(blocks: int, shape: tuple[int, ...], dtype: torch.dtype, layers: int) -> list[torch.Tensor]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = blocks * itemsize
    for d in shape:
        numel *= d
    return [
        torch.randint(0, 256, (numel,), dtype=torch.uint8, device="cuda").view(dtype).view(blocks, *shape)
        for _ in range(layers)
    ]


def records(caches: list[torch.Tensor], ids: list[int], n: int) -> torch.Tensor:
    rows = []
    for j in range(len(ids) // n):
        rows.append(
            torch.cat([torch.cat([c[ids[j * n + m]].reshape(-1).view(torch.uint8) for m in range(n)]) for c in caches])
        )
    return torch.stack(rows).cpu()


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize(
    "shape, dtype, layers",
    [((2, 16, 8, 128), torch.bfloat16, 4), ((2, 16, 1, 128), torch.float16, 80), ((3, 5), torch.uint8, 3)],
    ids=["64KiB-pages", "8KiB-pages-x80", "odd-bytes"],
)
def test_staged_round_trip_on_the_device(shape: tuple[int, ...], dtype: torch.dtype, layers: int, n: int) -> None:
    caches = random_cache(64, shape, dtype, layers)
    probe = KVLayout(caches, engine_blocks_per_block=n)
    layout = KVLayout(caches, engine_blocks_per_block=n, staging_bytes=4 * 3 * probe.block_bytes)  # 3 blocks a chunk
    k = 10
    ids = torch.randperm(32)[: k * n].tolist()
    pool = torch.zeros((16, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    rows = [15, 2, 3, 4, 0, 11, 6, 7, 8, 1]
    layout.gather(ids, pool, rows)
    assert torch.equal(pool[rows], records(caches, ids, n))
    before = [c.clone() for c in caches]
    dst = list(range(32, 32 + k * n))
    layout.scatter(pool, rows, dst)
    torch.cuda.synchronize()
    for c, b in zip(caches, before):
        assert torch.equal(c.view(torch.uint8)[dst], b.view(torch.uint8)[ids])
        rest = [i for i in range(64) if i not in dst]
        assert torch.equal(c.view(torch.uint8)[rest], b.view(torch.uint8)[rest])
    assert layout.staging.stats()["save_mode"] == "staged"


def test_gpu_pool_round_trip_on_the_device() -> None:
    caches = random_cache(32, (2, 16, 8, 128), torch.bfloat16, 4)
    layout = KVLayout(caches)
    pool = torch.zeros((20, layout.block_bytes), dtype=torch.uint8, device="cuda")
    for rows in ([3, 4, 5, 6], [0, 9, 2, 17]):
        ids = [7, 1, 12, 30]
        layout.gather(ids, pool, rows)
        assert torch.equal(pool[rows].cpu(), records(caches, ids, 1))
        layout.scatter(pool, rows, [20, 21, 22, 23])
        torch.cuda.synchronize()
        for c in caches:
            assert torch.equal(c.view(torch.uint8)[20:24], c.view(torch.uint8)[ids])


def test_batched_fallback_on_the_device() -> None:
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed: the batched fallback is not checked")
    caches = random_cache(16, (2, 16, 8, 128), torch.bfloat16, 4)
    layout = KVLayout(caches, staging_bytes=0)
    pool = torch.zeros((6, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
    layout.gather([5, 2, 9], pool, [4, 0, 1])
    assert layout.staging.stats()["save_mode"] == "batched", "cudaMemcpyBatchAsync was not usable"
    assert torch.equal(pool[[4, 0, 1]], records(caches, [5, 2, 9], 1))


async def test_store_and_load_are_ordered_after_the_compute_stream() -> None:
    caches = random_cache(64, (2, 16, 8, 128), torch.bfloat16, 2)
    cfg = {"tiers": [{"backend": "cpu", "capacity": 64 * 2 * 65536}]}
    store_wrong = load_wrong = 0
    async with kvtier.open(cfg, kv_caches=caches) as store:
        backend: Any = store.backends[0]
        for t in range(10):
            b, c = t, 32 + t
            value = float(t + 1)
            caches[0][b].zero_()
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            caches[0][b].fill_(value)  # still queued when the save is submitted
            key = [make_key(t)]
            assert await store.save(key, [b]) == 1
            row = backend.pool[backend.slots(key)[0]]
            store_wrong += not bool((row[:65536].view(torch.bfloat16) == value).all())
            caches[0][c].zero_()
            snapshot = torch.empty_like(caches[0][c])
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            snapshot.copy_(caches[0][c])  # still queued when the load into c is submitted
            assert await store.load(key, [c]) == 1
            # Done means done: the compute stream may read the block at once.
            after = caches[0][c].clone()
            torch.cuda.synchronize()
            load_wrong += bool((snapshot != 0).any())
            assert bool((after == value).all()), "the engine read the block before the load had landed"
    assert store_wrong == 0, f"{store_wrong}/10 saves read bytes still being written"
    assert load_wrong == 0, f"{load_wrong}/10 loads overwrote a block still being read"


async def test_fence_does_not_wait_for_a_stalled_lower_tier() -> None:
    caches = random_cache(16, (2, 16, 8, 128), torch.bfloat16, 4)
    block = 4 * 65536
    with tempfile.TemporaryDirectory() as root:
        cfg = {
            "write": "through",
            "tiers": [
                {"backend": "cpu", "capacity": 16 * block},
                {"backend": "lmdb", "capacity": 64 * block, "path": f"{root}/db"},
            ],
        }
        async with kvtier.open(cfg, kv_caches=caches) as store:
            lower: Any = store.backends[1]
            write = lower.write_blocks
            lower.write_blocks = lambda keys, blocks: (time.sleep(1.0), write(keys, blocks))[1]
            keys = [make_key(100 + i) for i in range(4)]
            plan = await store.prepare_store(keys)
            assert plan is not None and store.transfers is not None
            job = store.transfers.submit_store(plan, [0, 1, 2, 3])
            await asyncio.to_thread(store.transfers.wait_device, [job])
            assert store.transfers.result(job) is None, "the device read ended only after the stalled tier write"
            result = await store.transfers.wait_async(job)
            store.transfers.forget([job])
            store.finish_store(plan, result)
            assert result.success
