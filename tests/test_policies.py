"""Eviction policies: ordering, atomic eviction, protection, ARC adaptation."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.manager.policies import ARCPolicy, EvictionPolicy, LRUPolicy
from kvtier.testing import make_key

POLICIES = [LRUPolicy, ARCPolicy]
K = [make_key(i) for i in range(64)]


@pytest.fixture(params=POLICIES, ids=lambda c: c.name)
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return request.param(capacity=8)


def fill(policy: EvictionPolicy, n: int) -> list[bytes]:
    for key in K[:n]:
        policy.insert(key)
    return K[:n]


def test_eviction_order_is_insertion_order(policy: EvictionPolicy) -> None:
    keys = fill(policy, 5)
    assert policy.order() == keys
    assert policy.evict(2) == keys[:2]
    assert policy.order() == keys[2:]
    assert len(policy) == 3 and keys[0] not in policy and keys[2] in policy


def test_touch_moves_a_key_last(policy: EvictionPolicy) -> None:
    keys = fill(policy, 4)
    policy.touch(keys[0])
    assert policy.order()[-1] == keys[0]
    assert policy.evict(1) == [keys[1]]
    policy.touch(make_key(999))  # unknown keys are ignored
    assert len(policy) == 3


@pytest.mark.parametrize(
    "batch",
    [[2, 0, 4], [2, 60, 0], [60], [0, 0, 3], [], [4, 3, 2, 1, 0, 61]],
    ids=["known", "one unknown", "only unknown", "a repeat", "none", "unknown last"],
)
def test_touch_many_orders_as_touch_one_by_one(policy: EvictionPolicy, batch: list[int]) -> None:
    """The batch form (a loop in C while every key is known) leaves the order one ``touch``
    per key would, unknown keys included (they are ignored)."""
    keys = [K[i] for i in batch]
    one_by_one = type(policy)(capacity=8)
    fill(policy, 5)
    fill(one_by_one, 5)
    for target in (policy, one_by_one):
        target.touch(K[1])  # ARC: one key in T2 already
    policy.touch_many(keys)
    for key in keys:
        one_by_one.touch(key)
    assert policy.order() == one_by_one.order()
    policy.touch_many(iter(keys))  # any iterable, read once
    for key in keys:
        one_by_one.touch(key)
    assert policy.order() == one_by_one.order()


def test_remove(policy: EvictionPolicy) -> None:
    keys = fill(policy, 4)
    policy.remove(keys[1])
    policy.remove(make_key(999))
    assert policy.order() == [keys[0], keys[2], keys[3]]
    assert keys[1] not in policy


def test_evict_is_atomic(policy: EvictionPolicy) -> None:
    keys = fill(policy, 4)
    policy.touch(keys[1])
    before = policy.order()
    assert policy.evict(5) is None
    assert policy.order() == before
    assert policy.evict(3, protected={keys[0], keys[2]}) is None
    assert policy.order() == before
    assert policy.evict(0) == []
    assert policy.order() == before


def test_protected_keys_are_never_chosen(policy: EvictionPolicy) -> None:
    keys = fill(policy, 6)
    protected = {keys[0], keys[2], keys[3]}
    victims = policy.evict(3, protected=protected)
    assert victims is not None and set(victims) == {keys[1], keys[4], keys[5]}
    assert set(policy.order()) == protected


def test_bad_capacity() -> None:
    for cls in POLICIES:
        with pytest.raises(ConfigError):
            cls(capacity=-1)
        assert cls(capacity=3).to_dict() == {"policy": cls.name}


def test_lru_reinsert_moves_to_end() -> None:
    policy = LRUPolicy()
    keys = fill(policy, 3)
    policy.insert(keys[0])
    assert policy.order() == [keys[1], keys[2], keys[0]]


def run_cache(policy: EvictionPolicy, capacity: int, accesses: list[bytes]) -> None:
    """Drive ``policy`` as a cache of ``capacity`` keys: a hit touches, a miss evicts and inserts."""
    for key in accesses:
        if key in policy:
            policy.touch(key)
            continue
        if len(policy) >= capacity:
            assert policy.evict(1) is not None
        policy.insert(key)


def test_arc_scan_does_not_evict_a_key_used_twice() -> None:
    hot = make_key(1000)
    scan = [make_key(2000 + i) for i in range(50)]
    arc = ARCPolicy(capacity=4)
    run_cache(arc, 4, [hot, hot, *scan])
    assert hot in arc
    # LRU has no such protection: the same scan flushes the hot key.
    lru = LRUPolicy(capacity=4)
    run_cache(lru, 4, [hot, hot, *scan])
    assert hot not in lru


def test_arc_ghost_hits_adapt_p() -> None:
    arc = ARCPolicy(capacity=4)
    keys = fill(arc, 4)
    assert arc.p == 0.0
    assert arc.evict(1) == [keys[0]]
    assert keys[0] not in arc
    arc.insert(keys[0])  # a hit in the recency ghost list: favour recency
    assert arc.p > 0.0
    assert keys[0] in arc
    # It came back as a frequent key, and T1 (the once-seen keys) goes first while it is over p.
    assert keys[0] in arc._t2
    assert arc.order()[0] == keys[1]
    grown = arc.p
    # Now a frequency ghost hit moves p back down.
    for k in keys[1:]:
        arc.touch(k)  # all in T2
    victim = arc.evict(1)
    assert victim is not None
    arc.insert(victim[0])
    assert arc.p < grown


def test_arc_ghost_lists_are_bounded() -> None:
    arc = ARCPolicy(capacity=4)
    run_cache(arc, 4, [make_key(i) for i in range(200)])
    assert len(arc) == 4
    assert len(arc._b1) + len(arc._b2) <= 8


def test_restore_undoes_an_evict(policy: EvictionPolicy) -> None:
    keys = fill(policy, 6)
    policy.touch(keys[1])
    policy.touch(keys[4])
    before = policy.order()
    p_before = getattr(policy, "p", None)
    victims = policy.evict(3)
    assert victims is not None
    policy.restore(victims)
    assert policy.order() == before
    assert getattr(policy, "p", None) == p_before
    # With protected keys skipped, the victims come back as the next victims, in their order.
    protected = {keys[2]}
    victims = policy.evict(3, protected=protected)
    assert victims is not None and keys[2] not in victims
    policy.restore(victims)
    assert [k for k in policy.order() if k not in protected] == [k for k in before if k not in protected]
    assert policy.evict(3, protected=protected) == victims
    assert getattr(policy, "p", None) == p_before
