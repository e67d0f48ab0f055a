"""A one-tier LRU manager's ``touch`` in C (``HeldTouch``, kvtier/manager/_heldtouch.c) against
the Python closure it hands the rest to and against the manager's general method: same outcome,
same errors, same order left behind, the manager's lock taken around every move, and nothing
of the caller's kept."""

from __future__ import annotations

import gc
import random
import sys
import threading
from collections import OrderedDict
from typing import Any

import pytest

from kvtier.manager import TierManager, TierSpec, lookups
from kvtier.manager.policies import ARCPolicy, LRUPolicy
from kvtier.manager.touch_calls import touch_call
from kvtier.testing import make_key
from tests.test_manager_fast_paths import _outcome  # (a call's value, or its error's type and message)

native = pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")

BLOCK = 100
K = [make_key(i) for i in range(24)]


class _BytesLike(bytes):
    """Not a valid key type, though it hashes and compares like one."""


def _manager(touch_native: bool, policy: type = LRUPolicy) -> TierManager:
    """Keys 0-7 stored and ready, oldest first; key 8 pending."""
    m = TierManager([TierSpec(name="t", capacity_bytes=12 * BLOCK, block_reserve=BLOCK, policy=policy(12))])
    if not touch_native:  # the closure alone, as where the extension is not built
        m._touch = touch_call(m._lock, m._one_policy, TierManager.touch.__get__(m), native=False)
        m.touch = m._touch.touch  # type: ignore[method-assign]
    for keys in ([K[0], K[1], K[2]], [K[3], K[4]], [K[5], K[6], K[7]]):
        plan = m.prepare_store(keys)
        assert plan is not None
        m.complete_store(plan.keys)
    assert m.prepare_store([K[8]]) is not None
    return m


INPUTS: list[Any] = [
    [K[0], K[1]],
    (K[2], K[0]),
    [K[1], K[1]],  # a repeat
    [],
    (),
    [K[8]],  # pending
    [K[0], K[8]],
    [K[0], K[9]],  # absent
    (K[9], K[0]),
    [K[0], K[9][:31]],  # too short
    [K[0], bytearray(K[9])],  # unhashable
    [K[0], _BytesLike(K[3])],  # wrong type, equal to a stored key
    [K[0], K[9].hex()],
    {K[0], K[1]},  # not a list or tuple
    iter([K[0]]),
    b"x" * 32,
    "x",
    [None],
    None,
]


@native
@pytest.mark.parametrize("keys", INPUTS, ids=repr)
def test_native_touch_matches_the_closure_and_the_general_method(keys: Any) -> None:
    fast, closure, general = _manager(True), _manager(False), _manager(False)
    assert type(fast.touch).__name__ == "HeldTouch" and type(closure.touch).__name__ == "function"
    before = fast.tier_keys(0)
    got = _outcome(fast.touch, keys)
    assert got == _outcome(closure.touch, keys)
    assert fast.tier_keys(0) == closure.tier_keys(0)
    assert fast.counters == closure.counters
    if got[0] == "error":
        assert fast.tier_keys(0) == before
    want = _outcome(lambda k: TierManager.touch(general, k), keys)
    if isinstance(keys, list) and any(type(k) is _BytesLike for k in keys):
        assert want[0] == "error" and got == ("value", None)  # the LRU's one exception (touch_calls)
    else:
        assert got == want and fast.tier_keys(0) == general.tier_keys(0)


@native
def test_native_touch_matches_the_closure_over_random_batches() -> None:
    """Random batches of held, repeated, pending and absent keys, lists and tuples, on twin
    managers: the same order after every call (and the same victims when it is full)."""
    rng = random.Random(7)
    fast, closure = _manager(True), _manager(False)
    for step in range(400):
        batch = [K[rng.randrange(10)] for _ in range(rng.randrange(5))]
        keys = tuple(batch) if step % 2 else batch
        assert _outcome(fast.touch, keys) == _outcome(closure.touch, keys)
        assert fast.tier_keys(0) == closure.tier_keys(0)
    for extra in K[10:20]:  # full: stores now evict in the order the touches left
        plans = [m.prepare_store([extra]) for m in (fast, closure)]
        assert plans[0] == plans[1]


@native
def test_native_touch_of_cold_keys_goes_to_the_general_path() -> None:
    """Keys adopted at an open are not in the LRU's ordered dict until used: the C call hands
    them over, and the general path moves them, as without the extension."""
    runs = []
    for touch_native in (True, False):
        m = _manager(touch_native)
        m.adopt(0, [(K[20], BLOCK, 1.0), (K[21], BLOCK, 2.0)])
        m.touch([K[20], K[0]])
        runs.append(m.tier_keys(0))
    assert runs[0] == runs[1] and runs[0][-2:] == [K[20], K[0]]


@native
def test_a_closed_manager_refuses_the_native_touch() -> None:
    m = _manager(True)
    before = m.tier_keys(0)
    m.close()
    closed = _manager(False)
    closed.close()
    for keys in ([K[0]], (K[1], K[0]), [K[9]]):
        assert _outcome(m.touch, keys) == _outcome(closed.touch, keys)
        assert _outcome(m.touch, keys)[0] == "error"
    assert m.tier_keys(0) == before


class _CountingLock:
    """A lock that records the policy's order at each acquire and release."""

    def __init__(self, order: OrderedDict[bytes, None]) -> None:
        self._lock = threading.Lock()
        self._order = order
        self.seen: list[tuple[str, list[bytes]]] = []

    def acquire(self) -> bool:
        self._lock.acquire()
        self.seen.append(("acquire", list(self._order)))
        return True

    def release(self) -> None:
        self.seen.append(("release", list(self._order)))
        self._lock.release()


@native
def test_native_touch_moves_keys_only_under_the_lock() -> None:
    policy = LRUPolicy(8)
    policy.insert_many(K[:4])
    lock = _CountingLock(policy.ordered())
    handed: list[Any] = []
    call = lookups.native_module().HeldTouch(policy.ordered(), lock, handed.append)
    call([K[2], K[0]])
    assert lock.seen == [("acquire", K[:4]), ("release", [K[1], K[3], K[2], K[0]])]
    assert handed == []
    lock.seen.clear()
    call([K[1], K[9]])  # not held: released unchanged, then handed over whole
    assert lock.seen == [("acquire", [K[1], K[3], K[2], K[0]]), ("release", [K[1], K[3], K[2], K[0]])]
    assert handed == [[K[1], K[9]]]
    call({K[1]})  # not a list or tuple: handed over without the lock
    assert len(lock.seen) == 2 and handed[-1] == {K[1]}


class _ClosingLock:
    """A lock whose acquire first closes ``call``: a close that lands between the native
    touch's entry and its taking of the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.call: Any = None

    def acquire(self) -> bool:
        self.call.close()
        return self._lock.acquire()

    def release(self) -> None:
        self._lock.release()


@native
def test_native_touch_closed_while_it_waits_for_the_lock_moves_nothing() -> None:
    """The closed flag is read under the lock: a close made before the touch holds the lock
    hands the call to the fallback (which refuses it) and leaves the order as it was."""
    policy = LRUPolicy(8)
    policy.insert_many(K[:4])
    lock = _ClosingLock()
    handed: list[Any] = []
    call = lookups.native_module().HeldTouch(policy.ordered(), lock, handed.append)
    lock.call = call
    call([K[2], K[0]])
    assert list(policy.ordered()) == K[:4]
    assert handed == [[K[2], K[0]]]


@native
def test_held_touch_refuses_what_is_not_an_ordered_dict_or_a_lock() -> None:
    make = lookups.native_module().HeldTouch
    with pytest.raises(TypeError, match=r"order: expected a collections\.OrderedDict or a KeyOrder, got dict"):
        make({}, threading.Lock(), print)
    with pytest.raises(TypeError, match="fallback: expected a callable"):
        make(OrderedDict(), threading.Lock(), 7)
    with pytest.raises(AttributeError, match="acquire"):
        make(OrderedDict(), object(), print)
    call = make(OrderedDict(), threading.Lock(), print)
    with pytest.raises(TypeError, match="exactly one positional argument"):
        call()
    with pytest.raises(TypeError, match="exactly one positional argument"):
        call([], keys=[])


@native
def test_native_touch_keeps_no_reference() -> None:
    m = _manager(True)
    keys = [K[0], K[3], K[5]]
    gc.collect()  # managers of earlier tests that hold these keys go now, not during the loop
    refs = [sys.getrefcount(k) for k in keys], sys.getrefcount(keys)
    for _ in range(10_000):
        m.touch(keys)
        m.touch([K[0], K[9]])  # handed over
    gc.collect()
    assert ([sys.getrefcount(k) for k in keys], sys.getrefcount(keys)) == refs


def test_the_closure_is_used_where_the_policy_is_not_exactly_lru() -> None:
    """Another policy, or an LRU subclass (which may override ``touch_held``), keeps the
    closure; so does ``native=False``."""

    class _MyLRU(LRUPolicy):
        pass

    for policy in (ARCPolicy, _MyLRU):
        assert type(_manager(True, policy).touch).__name__ == "function"
    assert type(_manager(False).touch).__name__ == "function"
