"""Calls that keep the keys they are given (``prepare_load`` pins them, ``touch`` orders and
stamps them) refuse an object that only compares equal to a stored key: finding it proves its
value, not that it is a key. Before, such an object was pinned in the key's place, and a pin held
by an object that later compares unequal could never be released: the block stayed pinned."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.errors import InvalidKeyError, LifecycleError
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import EvictionPolicy, LRUPolicy
from kvtier.testing import make_key

BLOCK = 100
K = [make_key(i) for i in range(8)]


class _Sub(bytes):
    """A bytes subclass: equal to, and hashed like, the key it copies."""


class _Fickle:
    """Not bytes: hashes like a key and compares equal to it until told otherwise."""

    def __init__(self, key: bytes) -> None:
        self.key, self.equal = key, True

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return self.equal and other == self.key

    def __len__(self) -> int:
        return len(self.key)


def _manager(tiers: int, persistent: bool) -> TierManager:
    m = TierManager(
        [TierSpec(name=f"t{i}", capacity_bytes=2 * BLOCK, block_reserve=BLOCK, policy=LRUPolicy(), persistent=persistent) for i in range(tiers)]
    )
    for key in K[:2]:
        assert m.prepare_store([key]) is not None
        m.complete_store([key])
    return m


SHAPES = [(1, False), (1, True), (2, False), (2, True)]


@pytest.mark.parametrize(("tiers", "persistent"), SHAPES)
@pytest.mark.parametrize("kind", [_Sub, _Fickle])
@pytest.mark.parametrize("first", [True, False])
def test_prepare_load_refuses_an_equal_non_key_and_pins_nothing(tiers: int, persistent: bool, kind: Any, first: bool) -> None:
    m = _manager(tiers, persistent)
    odd = kind(K[0])
    keys = [odd, K[1]] if first else [K[1], odd]
    with pytest.raises(InvalidKeyError, match=rf"keys\[{0 if first else 1}\]: expected bytes, got {kind.__name__}"):
        m.prepare_load(keys)
    if isinstance(odd, _Fickle):
        odd.equal = False
    for key in K[:2]:  # nothing was pinned: the keys can be unpinned by no one, and evicted
        with pytest.raises(LifecycleError, match="is not pinned"):
            m.complete_load([key])
    assert m.prepare_store(K[2:4]) is not None  # a full first tier makes room from both keys
    assert m.status(K[0]).tier != 0 and m.status(K[1]).tier != 0


@pytest.mark.parametrize(("tiers", "persistent"), [s for s in SHAPES if s != (1, False)])
@pytest.mark.parametrize("kind", [_Sub, _Fickle])
def test_touch_refuses_an_equal_non_key_and_changes_nothing(tiers: int, persistent: bool, kind: Any) -> None:
    m = _manager(tiers, persistent)
    before = m.tier_keys(0)
    for keys in ([kind(K[0])], [K[1], kind(K[0])]):
        with pytest.raises(InvalidKeyError, match=f"expected bytes, got {kind.__name__}"):
            m.touch(keys)
        assert m.tier_keys(0) == before
    assert all(type(key) is bytes for key in m.tier_keys(0))


def test_a_key_pinned_and_touched_as_itself_still_works() -> None:
    m = _manager(1, False)
    plan = m.prepare_load([K[1], K[0]])
    assert plan.keys == (K[1], K[0])
    m.touch([K[1]])
    m.complete_load([K[0], K[1]])
    assert m.tier_keys(0) == [K[0], K[1]]


class _Keeper(LRUPolicy):
    """An LRU that keeps the objects its ``touch_many`` is given (as a plugin policy may)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Any] = []

    def touch_many(self, keys: Any) -> None:
        self.kept.extend(keys)
        super().touch_many(keys)

    touch_held = EvictionPolicy.touch_held  # the general one, which hands keys to touch_many


@pytest.mark.parametrize("kind", [_Sub, _Fickle])
def test_one_lru_tier_touches_the_stored_key_for_an_equal_value_and_keeps_nothing_of_it(kind: Any) -> None:
    # One tier without stamps: the LRU moves its own key object, so a value found equal to a
    # stored key touches that key (the same order as touching the key itself) and is not kept.
    m, twin = _manager(1, False), _manager(1, False)
    for keys in ([kind(K[0])], [K[1], kind(K[0])]):
        m.touch(keys)
        twin.touch([bytes(k) if isinstance(k, bytes) else k.key for k in keys])
        assert m.tier_keys(0) == twin.tier_keys(0)
        assert all(type(key) is bytes for key in m.tier_keys(0))
    assert m.tier_keys(0) == [K[1], K[0]]


@pytest.mark.parametrize("kind", [_Sub, _Fickle])
def test_a_policy_that_keeps_what_it_is_touched_with_is_never_handed_an_equal_value(kind: Any) -> None:
    policy = _Keeper()
    m = TierManager([TierSpec(name="t0", capacity_bytes=2 * BLOCK, block_reserve=BLOCK, policy=policy)])
    for key in K[:2]:
        assert m.prepare_store([key]) is not None
        m.complete_store([key])
    with pytest.raises(InvalidKeyError, match=f"expected bytes, got {kind.__name__}"):
        m.touch([K[1], kind(K[0])])
    assert all(type(key) is bytes for key in policy.kept)
    m.touch([K[0]])
    assert policy.kept == [K[0]] and m.tier_keys(0) == [K[1], K[0]]
