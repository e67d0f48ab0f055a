"""LRU's cold keys (records adopted at open, one list slot each) against the general path.

An ``LRUPolicy`` fed by ``adopt`` must order, evict, restore and report exactly as one fed the
same keys by ``insert_many`` (every key in the ordered dict), under any mix of uses, stores,
removals and evictions, driven the way ``TierState`` drives it (the index is changed first).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key

KEYS = [make_key(i) for i in range(400)]


class Pair:
    """The same operations on a cold-adopting policy and on the general one, each with its index."""

    def __init__(self, adopted: list[bytes]) -> None:
        self.cold, self.plain = LRUPolicy(), LRUPolicy()
        self.index: dict[bytes, int] = dict.fromkeys(adopted, 1)
        self.plain_index = dict(self.index)
        self.cold.adopt(adopted, self.index)
        self.plain.insert_many(adopted)

    def same(self) -> None:
        assert self.cold.order() == self.plain.order()
        assert len(self.cold) == len(self.plain) == len(self.index)
        assert sorted(self.cold.order()) == sorted(self.index)

    def store(self, keys: list[bytes]) -> None:
        keys = [k for k in keys if k not in self.index]
        for index in (self.index, self.plain_index):
            index.update(dict.fromkeys(keys, 1))
        self.cold.insert_many(keys)
        self.plain.insert_many(keys)

    def touch(self, keys: list[bytes], one: bool) -> None:
        for policy in (self.cold, self.plain):
            if one:
                for key in keys:
                    policy.touch(key)
            else:
                policy.touch_many(keys)

    def evict(self, n: int, protected: set[bytes], drop: bool = True) -> list[bytes] | None:
        got = self.cold.evict(n, protected)
        assert got == self.plain.evict(n, protected)
        if got is not None and drop:
            for key in got:
                del self.index[key]
                del self.plain_index[key]
        return got

    def remove(self, key: bytes) -> None:
        for index in (self.index, self.plain_index):
            index.pop(key, None)
        self.cold.remove(key)
        self.plain.remove(key)


@pytest.mark.parametrize("seed", range(12))
def test_cold_adoption_orders_and_evicts_as_the_general_path(seed: int) -> None:
    rng = random.Random(seed)
    pair = Pair(KEYS[:150])
    for _ in range(400):
        op = rng.randrange(7)
        some = rng.sample(KEYS[:260], rng.randrange(1, 8))
        if op == 0:
            pair.store(some)
        elif op in (1, 2):
            pair.touch(some, one=op == 1)
        elif op == 3:
            pair.evict(rng.randrange(1, 6), set(rng.sample(sorted(pair.index), min(3, len(pair.index)))) if rng.random() < 0.5 else set())
        elif op == 4:
            pair.remove(rng.choice(KEYS[:260]))
        else:  # an eviction in steps, undone (a store that finds no room): no change at all
            before = pair.cold.order()
            first = pair.evict(rng.randrange(1, 4), set(), drop=False)
            second = pair.evict(rng.randrange(1, 4), set(), drop=False) if first is not None else None
            victims = (first or []) + (second or [])
            pair.cold.restore(victims)
            pair.plain.restore(victims)
            assert pair.cold.order() == before
        pair.same()


def test_an_evict_that_cannot_be_done_changes_nothing() -> None:
    pair = Pair(KEYS[:10])
    pair.touch([KEYS[3]], one=True)
    before = pair.cold.order()
    assert pair.evict(10, {KEYS[0]}) is None
    assert pair.cold.order() == before
    assert pair.evict(9, {KEYS[0]}) == [k for k in before if k != KEYS[0]]
    pair.same()


def test_protected_cold_keys_are_walked_once_not_at_every_eviction() -> None:
    """A key pinned at the head of the cold list stays there, and the slots freed behind it
    are not walked again: the cursor moves past them."""
    pair = Pair(KEYS[:300])
    for _ in range(50):
        assert pair.evict(2, {KEYS[0]}) is not None
    assert pair.cold._at == 100  # 100 slots freed, the pinned key sits in the last one walked
    assert pair.cold.order()[0] == KEYS[0]
    pair.same()


def test_restore_with_a_protected_key_skipped_makes_the_victims_next_again() -> None:
    policy, index = LRUPolicy(), dict.fromkeys(KEYS[:8], 1)
    policy.adopt(KEYS[:8], index)
    victims = policy.evict(3, {KEYS[1]})
    assert victims == [KEYS[0], KEYS[2], KEYS[3]]
    policy.restore(victims)
    assert policy.evict(3, {KEYS[1]}) == victims
    assert sorted(policy.order()) == sorted(k for k in KEYS[:8] if k not in victims)


def test_a_second_adoption_while_cold_keys_remain_is_most_recent() -> None:
    policy, index = LRUPolicy(), dict.fromkeys(KEYS[:4], 1)
    policy.adopt(KEYS[:4], index)
    index.update(dict.fromkeys(KEYS[4:6], 1))
    policy.adopt(KEYS[4:6], index)
    assert policy.order() == KEYS[:6]
    assert policy.evict(5) == KEYS[:5]
    index.pop(KEYS[0])
    assert policy.order() == [KEYS[5]]


def test_a_managers_adopted_tier_uses_the_compact_list_and_matches_a_stored_one() -> None:
    """The manager's adoption keeps the records in the cold list (no ordered-dict node each);
    loads, stores and evictions then go as in a tier whose keys were all stored."""

    def manager() -> TierManager:
        return TierManager([TierSpec("disk", capacity_bytes=64 * 10, block_reserve=10, policy=LRUPolicy(), persistent=True)])

    adopted, stored = manager(), manager()
    assert adopted.adopt(0, [(k, 10, float(i)) for i, k in enumerate(KEYS[:60])]) == []
    for k in KEYS[:60]:
        plan = stored.prepare_store([k])
        assert plan is not None
        stored.complete_store([k])
    policy = adopted.tier_spec(0).policy
    assert isinstance(policy, LRUPolicy) and len(policy._order) == 0 and len(policy._cold) == 60
    for m in (adopted, stored):
        m.touch([KEYS[5], KEYS[9]])
        load = m.prepare_load([KEYS[1], KEYS[2]])
        assert load is not None
        plan = m.prepare_store(KEYS[60:70])
        assert plan is not None
        m.complete_store(plan.keys)
        m.complete_load([KEYS[1], KEYS[2]])
    assert adopted.tier_keys(0) == stored.tier_keys(0)
    assert KEYS[1] in adopted.tier_keys(0) and KEYS[0] not in adopted.tier_keys(0)


@pytest.mark.parametrize("with_table", [False, True])
def test_a_listing_adopted_as_columns_hands_its_key_list_over(with_table: bool) -> None:
    """The key column of a listing adopted as columns becomes the cold list itself, not a copy
    (a copy made on the adopting thread left the listing thread's list free, and resident, at
    the top of that thread's heap); the index, order and evictions are those of the same
    records adopted as tuples (the general path), before and after the keys are used."""
    from kvtier.bulk import READY, RecordColumns

    def manager() -> TierManager:
        return TierManager([TierSpec("disk", capacity_bytes=100 * 10, block_reserve=10, policy=LRUPolicy(), persistent=True)])

    rng = random.Random(7)
    stamps = sorted(rng.uniform(0, 1e9) for _ in range(80))
    keys = rng.sample(KEYS, 80)
    listed = list(keys)  # the adoption's order (``keys`` is handed over, and changes as keys are used)
    columns = RecordColumns(keys, np.full(80, 10, dtype=np.int64), np.array(stamps), oldest_first=True,
                            table=dict.fromkeys(keys, READY) if with_table else None)
    by_columns, by_tuples = manager(), manager()
    assert by_columns.adopt(0, columns) == [] and by_tuples.adopt(0, list(zip(listed, [10] * 80, stamps))) == []
    policy = by_columns.tier_spec(0).policy
    assert isinstance(policy, LRUPolicy) and policy._cold is keys
    assert by_columns.tier_keys(0) == by_tuples.tier_keys(0) == listed
    for m in (by_columns, by_tuples):
        m.touch([listed[3], listed[40]])
        plan = m.prepare_store([make_key(5000 + i) for i in range(30)])  # 10 adopted records evicted
        assert plan is not None
        m.complete_store(plan.keys)
    assert by_columns.tier_keys(0) == by_tuples.tier_keys(0)
    assert by_columns.stats()["tiers"][0]["evictions"] == by_tuples.stats()["tiers"][0]["evictions"] == 10
