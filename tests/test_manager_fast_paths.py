"""The manager's per-call fast paths against its general paths: same answers, same errors, same
counters, same order left behind.

* ``lookup`` of one key is a closure made per manager (:mod:`kvtier.manager.lookups`), one
  form for a single tier and one for several; so is ``lookup_key`` (one key, no tuple);
* ``touch`` of a single, non-persistent tier is a closure made per manager
  (:mod:`kvtier.manager.touch_calls`) that goes straight to the policy's ``touch_held``;
* ``prepare_load`` of a single tier finds its keys with one ``map`` over the index, no call per key.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.errors import ClosedError
from kvtier.keys import check_keys
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import ARCPolicy, EvictionPolicy, LRUPolicy
from kvtier.testing import make_key

BLOCK = 100
K = [make_key(i) for i in range(16)]


class _BytesLike(bytes):
    """Not a valid key type, though it hashes and compares like one."""


class _PlainLRU(EvictionPolicy):
    """A third-party policy: only the abstract methods, so ``touch_held`` is the base class's."""

    name = "plain"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._inner = LRUPolicy(capacity)

    def insert(self, key: bytes) -> None:
        self._inner.insert(key)

    def touch(self, key: bytes) -> None:
        self._inner.touch(key)

    def remove(self, key: bytes) -> None:
        self._inner.remove(key)

    def evict(self, n: int, protected: Any = ()) -> list[bytes] | None:
        return self._inner.evict(n, protected)

    def __len__(self) -> int:
        return len(self._inner)

    def __contains__(self, key: object) -> bool:
        return key in self._inner

    def order(self) -> list[bytes]:
        return self._inner.order()


POLICIES = {"lru": LRUPolicy, "arc": ARCPolicy, "plain": _PlainLRU}


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> str:
    return request.param


def _tiers(policy: str, count: int, persistent: bool = False) -> TierManager:
    specs = [
        TierSpec(name=f"t{i}", capacity_bytes=4 * BLOCK, block_reserve=BLOCK, policy=POLICIES[policy](4), persistent=persistent)
        for i in range(count)
    ]
    m = TierManager(specs)
    for keys in ([K[0], K[1]], [K[2]]):
        plan = m.prepare_store(keys)
        assert plan is not None
        m.complete_store(plan.keys)
    assert m.prepare_store([K[4]]) is not None  # pending
    return m


def _outcome(call: Any, keys: Any) -> tuple[Any, ...]:
    try:
        return ("value", call(keys))
    except Exception as exc:  # the error must match too: type and message
        return ("error", type(exc), str(exc))


LOOKUP_INPUTS: list[Any] = [
    (K[0],),  # ready
    [K[2]],
    (K[4],),  # pending
    (K[9],),  # absent
    {K[0]},  # any sized collection
    {K[9]: None},
    (K[0], K[1]),  # not one key: the general path
    (K[0], K[9]),
    (),
    (K[9][:31],),  # too short
    (bytearray(K[9]),),  # unhashable
    (_BytesLike(K[9]),),  # wrong type
    (K[9].hex(),),
    (7,),
    7,
    b"x",  # a bytes object is not a sequence of keys
    "x",
    (None,),
]


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("keys", LOOKUP_INPUTS, ids=repr)
def test_one_key_lookup_matches_the_general_path(policy: str, count: int, keys: Any) -> None:
    fast, general = _tiers(policy, count), _tiers(policy, count)
    got = _outcome(fast.lookup, keys)
    want = _outcome(general._lookup_run, keys)
    assert got == want
    assert fast.counters == general.counters
    assert got[0] == "error" or fast.counters["lookups"] == 1
    # the method on the class answers as the instance's closure does
    third = _tiers(policy, count)
    assert _outcome(lambda ks: TierManager.lookup(third, ks), keys) == got


@pytest.mark.parametrize("count", [1, 2])
def test_one_key_lookups_count_hits_and_misses(count: int) -> None:
    m = _tiers("lru", count)
    answers = [m.lookup((K[0],)), m.lookup([K[9]]), m.lookup((K[4],)), m.lookup([K[0], K[1]]), m.lookup([K[2]])]
    assert answers == [1, 0, 0, 2, 1]
    c = m.counters
    assert (c["lookups"], c["lookup_keys"], c["lookup_hits"]) == (5, 6, 4)


@pytest.mark.parametrize("count", [1, 2])
def test_lookups_after_close_raise_whatever_the_input(count: int) -> None:
    m = _tiers("lru", count)
    lookup = m.lookup  # bound before the close, as a caller may keep it
    m.close()
    for keys in ([K[0]], [K[9]], [K[0], K[1]], [bytearray(K[9])], [K[9][:3]], []):
        with pytest.raises(ClosedError):
            lookup(keys)
        with pytest.raises(ClosedError):
            m.lookup(keys)
        with pytest.raises(ClosedError):
            m.lookup_key(keys[0] if keys else keys)


class _SameAs:
    """Not a key: hashes and compares equal to the key it wraps (a custom ``__eq__``)."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return other == self.key

    def __repr__(self) -> str:
        return f"_SameAs({self.key[:2]!r})"


ONE_KEYS: list[Any] = [
    K[0],  # ready
    K[2],
    K[4],  # pending
    K[9],  # absent
    K[9][:31],  # too short
    K[9] + b"x",  # too long
    b"",
    bytearray(K[9]),  # unhashable
    _BytesLike(K[9]),  # wrong type
    _BytesLike(K[0]),  # wrong type, equal to a stored key: found as that key
    _SameAs(K[0]),  # not bytes, equal to a stored key: found as that key
    _SameAs(K[9]),
    K[9].hex(),
    7,
    None,
    (K[0],),  # a sequence of keys where one key is expected
    [K[0]],
]


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("key", ONE_KEYS, ids=repr)
def test_lookup_key_matches_the_general_path(policy: str, count: int, key: Any) -> None:
    """``lookup_key(key)`` answers, counts and rejects as the general path over ``(key,)``. Both
    validate by finding: whatever the index finds equal to a stored key (which was checked when
    it was stored) is that key; anything not found must be a well-formed key."""
    fast, general = _tiers(policy, count), _tiers(policy, count)
    got = _outcome(fast.lookup_key, key)
    want = _outcome(general._lookup_run, (key,))
    if want[0] == "value":
        assert got == ("value", want[1] == 1) and type(got[1]) is bool
    else:  # the same error, naming the one key
        assert got == (want[0], want[1], want[2].replace("keys[0]", "key"))
    assert fast.counters == general.counters
    assert got[0] == "error" or fast.counters["lookups"] == 1
    third = _tiers(policy, count)  # the method on the class answers as the instance's closure does
    assert _outcome(lambda k: TierManager.lookup_key(third, k), key) == got


def test_lookup_key_and_lookup_share_the_counters() -> None:
    m = _tiers("lru", 2)
    answers = [m.lookup_key(K[0]), m.lookup((K[9],)), m.lookup_key(K[4]), m.lookup_key(K[2]), m.lookup([K[0], K[1]])]
    assert answers == [True, 0, False, True, 2]
    c = m.counters
    assert (c["lookups"], c["lookup_keys"], c["lookup_hits"]) == (5, 6, 4)


TOUCH_INPUTS: list[Any] = [
    [K[0], K[1]],
    (K[2], K[0]),
    [K[1], K[1]],  # a repeat
    [],
    [K[4]],  # pending
    [K[0], K[4]],
    [K[0], K[9]],  # absent
    [K[0], K[9][:31]],  # too short
    [K[0], bytearray(K[9])],  # unhashable
    [K[0], _BytesLike(K[0])],  # wrong type, equal to a stored key
    [K[0], K[9].hex()],
    {K[0], K[1]},  # not a list or tuple: the general path
    b"x" * 32,
    "x",
    [None],
]


@pytest.mark.parametrize("keys", TOUCH_INPUTS, ids=repr)
def test_one_tier_touch_matches_the_general_path(policy: str, keys: Any) -> None:
    """A one-tier manager touches through its policy's ``touch_held``; a persistent one (whose
    touches stamp keys) takes the general path. Same outcome, same order left behind; and a
    touch that raises changes nothing."""
    runs = []
    for persistent in (False, True):
        m = _tiers(policy, 1, persistent=persistent)
        before = m.tier_keys(0)
        outcome = _outcome(m.touch, keys)
        after = m.tier_keys(0)
        if outcome[0] == "error":
            assert after == before
        runs.append((outcome, after))
    if policy == "lru" and isinstance(keys, list) and any(type(k) is _BytesLike for k in keys):
        # The one exception (docs/architecture.md): the LRU moves its own key objects and keeps
        # nothing of the caller's, so a value equal to a stored key touches that key, where the
        # stamping path, which would keep it, refuses it.
        assert runs[1][0][0] == "error" and runs[0] == (("value", None), _touched(policy, keys))
    else:
        assert runs[0] == runs[1]
    assert (m._one_policy is None) and (_tiers(policy, 1)._one_policy is not None)


@pytest.mark.parametrize("keys", TOUCH_INPUTS, ids=repr)
def test_one_tier_touch_closure_matches_the_method_of_the_class(policy: str, keys: Any) -> None:
    """A one-tier manager's ``touch`` is a closure (``kvtier/manager/touch_calls.py``) over its
    policy's ``touch_held``; the method of the class is its general path. Same outcome, order and
    counters on twin managers, but for the LRU's one exception (a value equal to a stored key
    touches that key, where the general path refuses it); a touch that raises changes nothing."""
    fast, general = _tiers(policy, 1), _tiers(policy, 1)
    assert fast.touch != TierManager.touch.__get__(fast)  # the closure, not the method
    before = fast.tier_keys(0)
    got, want = _outcome(fast.touch, keys), _outcome(lambda k: TierManager.touch(general, k), keys)
    if policy == "lru" and isinstance(keys, list) and any(type(k) is _BytesLike for k in keys):
        assert got == ("value", None) and want[0] == "error" and fast.tier_keys(0) == _touched(policy, keys)
    else:
        assert got == want and fast.tier_keys(0) == general.tier_keys(0)
    if got[0] == "error":
        assert fast.tier_keys(0) == before
    assert fast.counters == general.counters


def test_a_closed_one_tier_manager_refuses_touch_and_changes_nothing() -> None:
    m = _tiers("lru", 1)
    before = m.tier_keys(0)
    m.close()
    for keys in ([K[0]], (K[1], K[0]), [K[9]]):
        with pytest.raises(ClosedError):
            m.touch(keys)
    assert m.tier_keys(0) == before


def _touched(policy: str, keys: list[Any]) -> list[bytes]:
    """The order a one-tier manager is left in by touching the stored keys equal to ``keys``."""
    m = _tiers(policy, 1)
    m.touch([bytes(k) for k in keys])
    return m.tier_keys(0)


def test_touch_held_changes_nothing_unless_it_holds_every_key(policy: str) -> None:
    p = POLICIES[policy](4)
    for key in K[:3]:
        p.insert(key)
    assert p.touch_held([K[0], K[9]]) is False
    assert p.order() == K[:3] or policy == "arc"
    order = p.order()
    assert p.touch_held([K[0], K[9]]) is False and p.order() == order
    assert p.touch_held([K[0]]) is True
    q = POLICIES[policy](4)
    for key in K[:3]:
        q.insert(key)
    q.touch_many([K[0]])
    assert p.order() == q.order()


def test_touch_of_a_valid_stored_key_list_is_checked_by_finding() -> None:
    """The fast path accepts exactly what a checked touch accepts for stored, ready keys."""
    m = _tiers("lru", 1)
    check_keys([K[2], K[0]])
    m.touch([K[2], K[0]])
    assert m.tier_keys(0) == [K[1], K[2], K[0]]


LOAD_INPUTS: list[Any] = [
    [K[0], K[1]],
    (K[2],),
    [K[0], K[0]],  # a repeat: pinned twice
    [],
    [K[4]],  # pending
    [K[0], K[9]],  # absent
    [K[0], K[9][:31]],  # too short
    [K[0], bytearray(K[9])],  # unhashable
    [K[0], K[9].hex()],
    b"x" * 32,
    [None],
]


@pytest.mark.parametrize("keys", LOAD_INPUTS, ids=repr)
def test_one_tier_prepare_load_matches_the_general_path(policy: str, keys: Any) -> None:
    """One tier takes its own path through ``prepare_load``; the same plan or error, pins,
    order and counters as a manager whose second tier is empty (the general path)."""
    runs = []
    for count in (1, 2):
        m = _tiers(policy, count)
        outcome = _outcome(lambda ks, m=m: (lambda p: (p.keys, p.tiers, p.promote))(m.prepare_load(ks)), keys)
        runs.append((outcome, dict(m._tiers[0].pins), m.tier_keys(0), m.counters["load_prepared"]))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kept", [False, True])
def test_an_eviction_frees_its_victims_bytes_with_or_without_kept_keys(kept: bool) -> None:
    """``evict``'s own accounting of a plain tier (fixed-size blocks, no kept key, no tenant)
    against ``_unaccount`` (taken with a kept key): either way the tier's ``used`` is its held
    blocks' bytes after every store that evicts."""
    m = TierManager([TierSpec(name="t0", capacity_bytes=4 * BLOCK, block_reserve=BLOCK, policy=LRUPolicy(4))])
    tier = m._tiers[0]
    if kept:
        tier.kept[K[15]] = 1  # (a kept key no store names: the general accounting is taken)
    for i in range(0, 12, 2):
        plan = m.prepare_store(K[i : i + 2])
        assert plan is not None
        m.complete_store(plan.keys, True)
        assert tier.used == BLOCK * len(tier.index)
    assert tier.evictions == 8 and len(tier.index) == 4
