"""Tier chaining end to end: write-back demotion, write-through copies and promotion on load,
checked byte for byte through a real KV cache."""

from __future__ import annotations

import torch

import kvtier
from kvtier.testing import make_key

BLOCK_SHAPE = (2, 16, 2, 8)  # per layer and engine block: K/V, tokens, heads, head dim


def caches(num_blocks: int = 64, layers: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, *BLOCK_SHAPE, generator=g).to(torch.bfloat16) for _ in range(layers)]


def block_bytes(kv: list[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in kv)


def config(kv: list[torch.Tensor], first: int, second: int, write: str = "back") -> dict:
    bb = block_bytes(kv)
    return {
        "tiers": [
            {"backend": "cpu", "capacity": first * bb, "name": "fast"},
            {"backend": "cpu", "capacity": second * bb, "name": "slow"},
        ],
        "write": write,
    }


def snapshot(kv: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[block].clone() for t in kv]


def assert_block(kv: list[torch.Tensor], block: int, want: list[torch.Tensor]) -> None:
    for t, w in zip(kv, want):
        assert torch.equal(t[block], w)


async def test_write_back_demotes_victims_and_serves_them_exactly() -> None:
    kv = caches()
    keys = [make_key(i) for i in range(6)]
    originals = [snapshot(kv, i) for i in range(6)]
    async with kvtier.open(config(kv, 4, 8), kv_caches=kv) as store:
        assert await store.save(keys[:4], [0, 1, 2, 3]) == 4
        assert await store.save(keys[4:], [4, 5]) == 2
        tiers = store.stats()["tiers"]
        assert (tiers[0]["ready"], tiers[1]["ready"]) == (4, 2)
        detail = await store.lookup_detail(keys)
        assert [d.tier for d in detail] == [1, 1, 0, 0, 0, 0]
        stored = [e for e in store.take_events() if e.kind == "stored"]
        assert sorted(e.tier for e in stored if e.key in keys[:2]) == ["fast", "fast", "slow", "slow"]
        for t in kv:
            t.zero_()
        assert await store.load(keys, [20, 21, 22, 23, 24, 25]) == 6
        for i in range(6):
            assert_block(kv, 20 + i, originals[i])


async def test_last_tier_victims_are_dropped_with_an_event() -> None:
    kv = caches()
    keys = [make_key(i) for i in range(5)]
    async with kvtier.open(config(kv, 2, 2), kv_caches=kv) as store:
        for i, key in enumerate(keys):
            assert await store.save([key], [i]) == 1
        # 2 in the fast tier, 2 in the slow one, the oldest is gone.
        assert await store.lookup(keys) == 0
        assert await store.lookup(keys[1:]) == 4
        removed = [e for e in store.take_events() if e.kind == "removed"]
        assert [(e.key, e.tier) for e in removed if e.tier == "slow"] == [(keys[0], "slow")]


async def test_write_through_keeps_a_copy_in_every_tier() -> None:
    keys = [make_key(i) for i in range(3)]
    kv = caches(seed=1)
    original = snapshot(kv, 1)
    async with kvtier.open(config(kv, 2, 8, write="through"), kv_caches=kv) as store:
        assert await store.save(keys[:2], [0, 1]) == 2
        tiers = store.stats()["tiers"]
        assert (tiers[0]["ready"], tiers[1]["ready"]) == (2, 2)
        assert await store.save(keys[2:], [2]) == 1
        tiers = store.stats()["tiers"]
        # The victim is dropped from the fast tier (its copy below stays): no demotion needed.
        assert (tiers[0]["ready"], tiers[1]["ready"]) == (2, 3)
        assert tiers[1]["demotions_in"] == 0
        for t in kv:
            t.zero_()
        assert await store.load(keys, [30, 31, 32]) == 3
        assert_block(kv, 31, original)


async def test_a_batch_larger_than_the_first_tier_goes_on_into_the_lower_tier() -> None:
    """The manager's plain ``prepare_store`` stays atomic (``None``, no change); ``save``
    stores the batch run by run, the lower tier taking what the first cannot hold."""
    kv = caches()
    keys = [make_key(i) for i in range(3)]
    originals = [snapshot(kv, i) for i in range(3)]
    async with kvtier.open(config(kv, 2, 8), kv_caches=kv) as store:
        assert store.manager is not None and store.manager.prepare_store(keys) is None
        assert store.stats()["store_rejected"] == 1
        assert store.stats()["tiers"][0]["used_bytes"] == 0
        assert await store.save(keys, [0, 1, 2]) == 3
        assert await store.lookup(keys) == 3
        assert await store.load(keys, [10, 11, 12], promote=False) == 3
        for i in range(3):
            assert_block(kv, 10 + i, originals[i])


async def test_lower_tier_hits_are_promoted_when_the_first_tier_has_room() -> None:
    kv = caches()
    keys = [make_key(i) for i in range(4)]
    originals = [snapshot(kv, i) for i in range(4)]
    async with kvtier.open(config(kv, 2, 8), kv_caches=kv) as store:
        assert await store.save(keys[:2], [0, 1]) == 2
        assert await store.save(keys[2:], [2, 3]) == 2  # keys 0 and 1 demoted
        # Make room in the fast tier: forget its two blocks.
        mgr = store.manager
        assert mgr is not None
        removed = mgr.remove(keys[2:], 0)
        store.backends[0].delete_blocks(removed)
        assert [d.tier for d in await store.lookup_detail(keys[:2])] == [1, 1]
        for t in kv:
            t.zero_()
        assert await store.load(keys[:2], [40, 41]) == 2
        assert_block(kv, 40, originals[0])
        assert store.stats()["promotions"] == 2
        assert [d.tier for d in await store.lookup_detail(keys[:2])] == [0, 0]
        # The promoted copy is exact too.
        for t in kv:
            t.zero_()
        assert await store.load(keys[:1], [50]) == 1
        assert_block(kv, 50, originals[0])


def test_admission_rule_keeps_one_off_blocks_out_of_the_lower_tier() -> None:
    from kvtier.manager import TierManager, TierSpec
    from kvtier.manager.policies import LRUPolicy

    mgr = TierManager(
        [TierSpec("fast", 2, 1, LRUPolicy()), TierSpec("disk", 10, 1, LRUPolicy(), admit_after=2)],
    )
    a, b, c, d = (make_key(i) for i in range(4))
    plan = mgr.prepare_store([a, b])
    assert plan is not None
    mgr.complete_store(plan.keys)
    mgr.complete_load(mgr.prepare_load([a]).keys)  # a is used a second time; b is not
    plan = mgr.prepare_store([c, d])
    assert plan is not None
    assert [d_.keys for d_ in plan.demotions] == [(a,)]
    assert plan.drops == ((0, (b,)),)
    mgr.complete_store(plan.keys)
    assert [s.tier for s in mgr.lookup_detail([a, b])] == [1, None]


def lmdb_config(kv: list[torch.Tensor], first: int, path: str) -> dict:
    return {
        "tiers": [
            {"backend": "cpu", "capacity": first * block_bytes(kv), "name": "fast"},
            {"backend": "lmdb", "capacity": "64MiB", "path": path, "name": "disk"},
        ],
        "write": "back",
    }


async def test_steady_state_hits_from_disk_are_promoted_by_evicting_and_demoting(tmp_path) -> None:
    """The first tier is full: a block served from disk comes back into it, the first tier's
    least recent block is demoted (not lost), and a pinned block is never the victim."""
    kv = caches(seed=3)
    keys = [make_key(300 + i) for i in range(6)]
    originals = [snapshot(kv, i) for i in range(6)]
    async with kvtier.open(lmdb_config(kv, 3, str(tmp_path / "db")), kv_caches=kv) as store:
        mgr = store.manager
        assert mgr is not None
        for i, key in enumerate(keys):
            assert await store.save([key], [i]) == 1
        # Steady state: the fast tier is full (keys 3-5), keys 0-2 were demoted to disk.
        assert [d.tier for d in await store.lookup_detail(keys)] == [1, 1, 1, 0, 0, 0]
        pin = mgr.prepare_load([keys[3]], promote=False)  # the next victim, pinned by a load
        for t in kv:
            t.zero_()
        assert await store.load(keys[:1], [40]) == 1
        assert_block(kv, 40, originals[0])
        stats = store.stats()
        assert stats["promotions"] == 1 and stats["tiers"][1]["promotions"] == 1
        # The pinned key stayed; the next least recent (key 4) was demoted to disk.
        assert [d.tier for d in await store.lookup_detail(keys)] == [0, 1, 1, 0, 1, 0]
        assert stats["tiers"][1]["demotions_in"] == 4
        mgr.complete_load(pin.keys)
        # The promoted copy is exact and served from the fast tier; the victim from disk.
        for t in kv:
            t.zero_()
        load = mgr.prepare_load([keys[0], keys[4]], promote=False)
        assert load.tiers == (0, 1)
        mgr.complete_load(load.keys)
        assert await store.load([keys[0]], [50], promote=False) == 1
        assert await store.load([keys[4]], [51], promote=False) == 1
        assert_block(kv, 50, originals[0])
        assert_block(kv, 51, originals[4])


async def test_promotion_never_evicts_pinned_keys_nor_the_loaded_batch(tmp_path) -> None:
    kv = caches(seed=4)
    keys = [make_key(400 + i) for i in range(4)]
    async with kvtier.open(lmdb_config(kv, 2, str(tmp_path / "db")), kv_caches=kv) as store:
        mgr = store.manager
        assert mgr is not None
        for i, key in enumerate(keys):
            assert await store.save([key], [i]) == 1
        assert [d.tier for d in await store.lookup_detail(keys)] == [1, 1, 0, 0]
        pin = mgr.prepare_load([keys[2]], promote=False)
        # keys[3] is in the loaded batch, keys[2] is pinned: no room can be made, no change.
        assert await store.load([keys[3], keys[0]], [20, 21]) == 2
        assert store.stats()["promotions_rejected"] == 1 and store.stats()["promotions"] == 0
        assert [d.tier for d in await store.lookup_detail(keys)] == [1, 1, 0, 0]
        mgr.complete_load(pin.keys)
        assert await store.load([keys[3], keys[0]], [20, 21]) == 2
        assert [d.tier for d in await store.lookup_detail(keys)] == [0, 1, 1, 0]
