"""KVStore through ``kvtier.open``: save / load round trips, capacity, errors, lifecycle."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvtier
from kvtier.errors import ClosedError, ConfigError, LayoutError
from kvtier.manager import CacheEvent
from kvtier.store import KVStore
from kvtier.testing import make_key

NUM_BLOCKS = 16
K = [make_key(i) for i in range(32)]
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32]


def make_caches(dtype: torch.dtype = torch.bfloat16, seed: int = 0, layers: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(layers):
        raw = torch.randint(0, 256, (NUM_BLOCKS * 2 * 4 * 2 * 8 * torch.empty((), dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
        caches.append(raw.view(dtype).view(NUM_BLOCKS, 2, 4, 2, 8))
    return caches


def block_bytes(caches: list[torch.Tensor]) -> int:
    return sum(c[0].numel() * c.element_size() for c in caches)


def config(caches: list[torch.Tensor], blocks: int, **extra: Any) -> dict[str, Any]:
    return {"tiers": [{"backend": "cpu", "capacity": blocks * block_bytes(caches)}], **extra}


def engine_block(caches: list[torch.Tensor], i: int) -> list[torch.Tensor]:
    return [c[i].view(torch.uint8).clone() for c in caches]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def zero(caches: list[torch.Tensor]) -> None:
    for c in caches:
        c.view(torch.uint8).zero_()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
async def test_save_zero_load_elsewhere_is_byte_exact(dtype: torch.dtype) -> None:
    caches = make_caches(dtype)
    async with kvtier.open(config(caches, 8), kv_caches=caches) as store:
        want = [engine_block(caches, i) for i in (3, 0, 7, 12)]
        assert await store.save(K[:4], [3, 0, 7, 12]) == 4
        zero(caches)
        assert await store.load(K[:4], [9, 1, 2, 15]) == 4
        for i, b in enumerate((9, 1, 2, 15)):
            assert same(engine_block(caches, b), want[i])
        assert not any(c[[0, 3, 7, 12]].view(torch.uint8).any() for c in caches)


async def test_n_engine_blocks_per_block() -> None:
    caches = make_caches()
    cfg = {**config(caches, 8), "engine_blocks_per_block": 2}
    cfg["tiers"][0]["capacity"] = 8 * 2 * block_bytes(caches)
    async with kvtier.open(cfg, kv_caches=caches) as store:
        want = [engine_block(caches, i) for i in (5, 2, 11, 8)]
        assert await store.save(K[:2], [5, 2, 11, 8]) == 2
        zero(caches)
        assert await store.load(K[:2], [0, 1, 14, 15]) == 2
        for i, b in enumerate((0, 1, 14, 15)):
            assert same(engine_block(caches, b), want[i])
        with pytest.raises(LayoutError, match="expected 4 engine block ids"):
            await store.save(K[2:4], [0, 1, 2])


async def test_save_counts_only_new_blocks() -> None:
    caches = make_caches()
    async with kvtier.open(config(caches, 8), kv_caches=caches) as store:
        assert await store.save(K[:4], [0, 1, 2, 3]) == 4
        original = engine_block(caches, 4)
        assert await store.save(K[2:6], [9, 9, 4, 5]) == 2  # K[2], K[3] are present: skipped
        assert await store.save(K[:6], list(range(6))) == 0
        zero(caches)
        assert await store.load([K[4]], [10]) == 1
        assert same(engine_block(caches, 10), original)
        assert store.stats()["store_skipped"] == 8


async def test_load_returns_the_leading_run() -> None:
    caches = make_caches()
    async with kvtier.open(config(caches, 8), kv_caches=caches) as store:
        await store.save([K[0], K[1], K[3]], [0, 1, 3])
        zero(caches)
        assert await store.load(K[:4], [8, 9, 10, 11]) == 2
        assert caches[0][8].view(torch.uint8).any() and caches[0][9].view(torch.uint8).any()
        assert not caches[0][[10, 11]].view(torch.uint8).any()
        assert await store.load([K[5], K[0]], [12, 13]) == 0
        assert not caches[0][[12, 13]].view(torch.uint8).any()
        # Loads unpin: nothing stays pinned after the call.
        assert all(t["pinned"] == 0 for t in store.stats()["tiers"])


async def test_capacity_eviction_through_save() -> None:
    caches = make_caches()
    async with kvtier.open(config(caches, 4), kv_caches=caches) as store:
        for i in range(6):
            assert await store.save([K[i]], [i]) == 1
        assert await store.lookup(K[:2]) == 0
        assert await store.lookup(K[2:6]) == 4
        want = engine_block(caches, 5)
        zero(caches)
        assert await store.load(K[2:6], [8, 9, 10, 11]) == 4
        assert same(engine_block(caches, 11), want)
        assert store.stats()["backends"][0]["used_slots"] == 4


async def test_full_pinned_tier_rejects_and_loses_nothing() -> None:
    caches = make_caches()
    async with kvtier.open(config(caches, 2), kv_caches=caches) as store:
        want = [engine_block(caches, i) for i in (0, 1)]
        assert await store.save(K[:2], [0, 1]) == 2
        plan = await store.prepare_load(K[:2])
        assert await store.save([K[5]], [5]) == 0
        assert await store.lookup([K[5]]) == 0
        assert store.stats()["store_rejected"] == 1
        await store.complete_load(plan.keys)
        zero(caches)
        assert await store.load(K[:2], [6, 7]) == 2
        assert same(engine_block(caches, 6), want[0]) and same(engine_block(caches, 7), want[1])


@pytest.mark.parametrize(
    ("ids", "match"),
    [([0, 1], "expected 3 engine block ids"), ([0, 1, NUM_BLOCKS], "out of range"), ([0, -1, 2], "out of range")],
)
async def test_bad_block_ids_raise_before_any_change(ids: list[int], match: str) -> None:
    caches = make_caches()
    async with kvtier.open(config(caches, 8), kv_caches=caches) as store:
        await store.save([K[9]], [9])
        before = store.stats()
        with pytest.raises(LayoutError, match=match):
            await store.save(K[:3], ids)
        with pytest.raises(LayoutError, match=match):
            await store.load([K[9], K[1], K[2]], ids)
        assert store.stats() == before
        assert await store.lookup(K[:3]) == 0


async def test_capacity_below_one_block_is_a_config_error() -> None:
    caches = make_caches()
    cfg = {"tiers": [{"backend": "cpu", "capacity": block_bytes(caches) - 1}]}
    with pytest.raises(ConfigError, match="capacity"):
        await kvtier.open(cfg, kv_caches=caches)


async def test_calls_after_close_raise() -> None:
    caches = make_caches()
    store = await kvtier.open(config(caches, 4), kv_caches=caches)
    await store.save([K[0]], [0])
    await store.aclose()
    await store.aclose()  # idempotent
    with pytest.raises(ClosedError):
        await store.save([K[1]], [1])
    with pytest.raises(ClosedError):
        await store.load([K[0]], [0])
    with pytest.raises(ClosedError):
        await store.lookup([K[0]])
    with pytest.raises(ClosedError):
        store.take_events()


async def test_take_events() -> None:
    caches = make_caches()
    async with kvtier.open(config(caches, 2), kv_caches=caches) as store:
        await store.save(K[:2], [0, 1])
        assert store.take_events() == [CacheEvent("stored", K[0], "cpu"), CacheEvent("stored", K[1], "cpu")]
        assert store.take_events() == []
        await store.save([K[2]], [2])
        assert store.take_events() == [CacheEvent("removed", K[0], "cpu"), CacheEvent("stored", K[2], "cpu")]


async def test_open_forms() -> None:
    caches = make_caches()
    opener = kvtier.open(config(caches, 4), kv_caches=caches)
    async with opener as store:
        assert isinstance(store, KVStore)
        assert await store.save([K[0]], [0]) == 1
    with pytest.raises(ClosedError):
        await store.lookup([K[0]])
    store2 = await kvtier.open(config(caches, 4), kv_caches=caches)
    try:
        assert isinstance(store2, KVStore)
        assert await store2.lookup([K[0]]) == 0  # a fresh store: memory tiers start empty
        assert await store2.save([K[0]], [0]) == 1
    finally:
        await store2.aclose()


async def test_store_without_kv_cache_cannot_move_blocks() -> None:
    async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 4096}], "block_bytes": 1024}) as store:
        plan = await store.prepare_store([K[0]])
        assert plan is not None
        await store.complete_store(plan.keys)
        assert await store.lookup([K[0]]) == 1
        with pytest.raises(LayoutError, match="kv_caches"):
            await store.save([K[1]], [0])
    with pytest.raises(ConfigError, match="block_bytes"):
        kvtier.open({"tiers": [{"backend": "cpu", "capacity": 4096}]})


@pytest.mark.parametrize("write", ["back", "through"])
async def test_save_larger_than_the_first_tier_stores_it_all_through_the_lower_tiers(tmp_path: Any, write: str) -> None:
    """12 blocks into an 8-slot host tier in front of LMDB: every block is stored (the lower
    tier takes what the first cannot hold) and loads back byte-exact."""
    caches = make_caches()
    cfg = config(caches, 8, write=write)
    cfg["tiers"].append({"backend": "lmdb", "path": str(tmp_path / "kv"), "capacity": "64MiB"})
    async with kvtier.open(cfg, kv_caches=caches) as store:
        want = [engine_block(caches, i) for i in range(12)]
        assert await store.save(K[:12], list(range(12))) == 12
        assert await store.lookup(K[:12]) == 12
        assert store.stats()["store_partial"] >= 1
        zero(caches)
        assert await store.load(K[:12], list(range(12)), promote=False) == 12
        assert all(same(engine_block(caches, i), want[i]) for i in range(12))


async def test_save_larger_than_every_tier_stores_the_leading_run_that_fits(tmp_path: Any) -> None:
    caches = make_caches()
    cfg = config(caches, 4)
    cfg["tiers"].append({"backend": "cpu", "capacity": 4 * block_bytes(caches)})
    async with kvtier.open(cfg, kv_caches=caches) as store:
        # 4 + 4 blocks; a third run would push the first out of the bottom tier: not stored.
        assert await store.save(K[:12], list(range(12))) == 8
        assert await store.lookup(K[:12]) == 8
    async with kvtier.open(config(caches, 8), kv_caches=caches) as store:
        assert await store.save(K[:2], [0, 1]) == 2
        pinned = await store.prepare_load(K[:2])  # pinned: 6 slots can be made free
        assert await store.save(K[2:12], list(range(2, 12))) == 6  # the leading run that fits
        assert await store.lookup(K[:12]) == 8
        await store.complete_load(pinned.keys)
