"""The LRU policy's order in C (``KeyOrder``, kvtier/manager/_keyorder.c) against the
``OrderedDict`` it stands in for where the extension is not built: random sequences of the
order's calls, of the policy's, and of a one-tier manager's (stores, loads and their pins,
touches, evictions, removals, tenants with quotas and pins, close), each run on both and
compared step by step: same answers, same errors, same order left behind."""

from __future__ import annotations

import gc
import random
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.manager import TierManager, TierSpec, lookups
from kvtier.manager import policies as policies_module
from kvtier.manager.key_order import new_order
from kvtier.manager.policies import LRUPolicy
from kvtier.manager.tenants import TenantRules
from kvtier.testing import make_key

native = pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")

POOL = [make_key(i) for i in range(300)]


def _outcome(call: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    try:
        return ("value", call(*args))
    except Exception as exc:  # the error must match too: its type and its key
        return ("error", type(exc), exc.args[:1] if isinstance(exc, KeyError) else ())


def _step(rng: random.Random, pool: list[bytes]) -> tuple[str, tuple[Any, ...]]:
    key = rng.choice(pool)
    op = rng.choices(
        ["set", "del", "pop", "pop_default", "move", "move_first", "contains", "get", "len", "clear"],
        [30, 8, 8, 6, 14, 6, 10, 6, 4, 0.3],
    )[0]
    return op, (key,)


def _apply(order: Any, op: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    key = args[0]
    calls: dict[str, Callable[[], Any]] = {
        "set": lambda: order.__setitem__(key, None),
        "del": lambda: order.__delitem__(key),
        "pop": lambda: order.pop(key),
        "pop_default": lambda: order.pop(key, "absent"),
        "move": lambda: order.move_to_end(key),
        "move_first": lambda: order.move_to_end(key, last=False),
        "contains": lambda: key in order,
        "get": lambda: order[key],
        "len": lambda: len(order),
        "clear": lambda: order.clear(),
    }
    return _outcome(calls[op])


@native
@pytest.mark.parametrize("seed", range(6))
def test_key_order_matches_an_ordered_dict_over_random_calls(seed: int) -> None:
    """Pools small and large: keys come and go, the table grows and its runs shift back on
    deletion, with wrap-around at the table's end."""
    rng = random.Random(seed)
    pool = POOL[: rng.choice([3, 20, 300])]
    fast, slow = new_order(), OrderedDict[bytes, None]()
    assert type(fast).__name__ == "KeyOrder"
    for _ in range(4000):
        op, args = _step(rng, pool)
        assert _apply(fast, op, args) == _apply(slow, op, args), (op, args)
        assert len(fast) == len(slow)
    assert list(fast) == list(slow)
    for key in pool:  # every key still found where it should be after all the shifting
        assert (key in fast) == (key in slow)


@native
def test_key_order_keeps_every_key_through_growth_and_deletions() -> None:
    rng = random.Random(7)
    keys = [make_key(i) for i in range(20_000)]
    fast, slow = new_order(), OrderedDict[bytes, None]()
    for key in keys:
        fast[key] = slow[key] = None
    for key in rng.sample(keys, 15_000):
        del fast[key]
        del slow[key]
    for key in rng.sample(keys, 5_000):
        fast[key] = slow[key] = None
        last = rng.random() < 0.5
        fast.move_to_end(key, last=last)
        slow.move_to_end(key, last=last)
    assert list(fast) == list(slow)
    assert all((key in fast) == (key in slow) for key in keys)


@native
def test_move_to_end_takes_its_arguments_as_an_ordered_dict_does() -> None:
    fast, slow = new_order(), OrderedDict[bytes, None]()
    for key in POOL[:5]:
        fast[key] = slow[key] = None
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((POOL[3],), {}),
        ((POOL[3], False), {}),
        ((POOL[1],), {"last": False}),
        ((POOL[0],), {"last": 0}),
        ((POOL[2],), {"last": "yes"}),
        ((POOL[4], True), {}),
        ((POOL[9],), {"last": False}),  # not held: KeyError
        ((), {}),
        ((POOL[1], True, True), {}),
        ((POOL[1],), {"first": True}),
        ((POOL[1], True), {"last": True}),
    ]
    for args, kwargs in calls:
        got = _outcome(lambda: fast.move_to_end(*args, **kwargs))  # noqa: B023 (called at once)
        want = _outcome(lambda: slow.move_to_end(*args, **kwargs))  # noqa: B023
        assert got[:2] == want[:2], (args, kwargs)
        assert list(fast) == list(slow), (args, kwargs)


@native
def test_key_order_refuses_what_it_cannot_hold_by_name() -> None:
    order = new_order()
    with pytest.raises(TypeError, match="KeyOrder key: expected bytes, got str"):
        order["x"] = None  # type: ignore[index]
    with pytest.raises(TypeError, match="KeyOrder key: expected bytes, got bytearray"):
        order[bytearray(b"x")] = None  # type: ignore[index]
    with pytest.raises(TypeError, match="KeyOrder value: expected None, got int"):
        order[b"x"] = 1  # type: ignore[assignment]
    with pytest.raises(TypeError, match="takes no arguments"):
        type(order)([b"x"])
    with pytest.raises(TypeError, match="pop expected 1 or 2 arguments"):
        order.pop()  # type: ignore[call-arg]
    assert len(order) == 0


class _BytesLike(bytes):
    """Bytes' own hash and equality: an ordered dict finds a stored key equal to it."""


class _Odd:
    """Hashes as a stored key does; equal to it or not, as told; may change the order."""

    def __init__(self, key: bytes, equal: bool, hook: Callable[[], None] | None = None) -> None:
        self.key, self.equal, self.hook = key, equal, hook

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        if self.hook is not None:
            self.hook()
        return self.equal


@native
def test_key_order_looks_up_other_key_types_as_an_ordered_dict_does() -> None:
    fast, slow = new_order(), OrderedDict[bytes, None]()
    for key in POOL[:8]:
        fast[key] = slow[key] = None
    probes: list[Any] = [
        _BytesLike(POOL[3]),
        _BytesLike(POOL[20]),
        POOL[3].hex(),
        3,
        None,
        _Odd(POOL[4], True),
        _Odd(POOL[4], False),
    ]
    for probe in probes:
        assert _outcome(fast.__contains__, probe) == _outcome(slow.__contains__, probe), probe
        assert _outcome(fast.move_to_end, probe) == _outcome(slow.move_to_end, probe), probe
    assert list(fast) == list(slow)
    for probe in (bytearray(POOL[1]), [POOL[1]]):  # unhashable: TypeError, as a dict's probe
        assert _outcome(fast.__contains__, probe)[:2] == _outcome(slow.__contains__, probe)[:2] == ("error", TypeError)
    assert _outcome(fast.pop, _BytesLike(POOL[5])) == _outcome(slow.pop, _BytesLike(POOL[5])) == ("value", None)
    assert list(fast) == list(slow)


@native
def test_a_compare_that_changes_the_order_is_an_error_not_a_wrong_answer() -> None:
    order = new_order()
    for key in POOL[:8]:
        order[key] = None
    probe = _Odd(POOL[2], True, hook=lambda: order.pop(POOL[7], None))
    with pytest.raises(RuntimeError, match="changed during a key's comparison"):
        probe in order  # noqa: B015
    assert list(order) == POOL[:7]


@native
def test_iteration_over_a_changed_order_raises_as_an_ordered_dict_does() -> None:
    for change in (lambda o: o.__setitem__(POOL[9], None), lambda o: o.move_to_end(POOL[0]), lambda o: o.pop(POOL[1])):
        fast, slow = new_order(), OrderedDict[bytes, None]()
        for key in POOL[:4]:
            fast[key] = slow[key] = None
        for order in (fast, slow):
            it = iter(order)
            assert next(it) == POOL[0]
            change(order)
            with pytest.raises(RuntimeError, match="mutated during iteration"):
                next(it)
    fast = new_order()
    fast[POOL[0]] = None
    it = iter(fast)
    assert list(it) == [POOL[0]] and list(it) == []
    fast.move_to_end(POOL[0])  # already the newest: no change, as in an ordered dict
    assert list(fast) == [POOL[0]]


@native
def test_an_iteration_past_its_last_key_ends_after_a_change_as_an_ordered_dict_does() -> None:
    # An ordered dict's iterator whose next node is none ends (StopIteration) before it looks
    # for a change: a loop whose last body changes the order ends, it does not raise.
    for change in (lambda o: o.__setitem__(POOL[9], None), lambda o: o.move_to_end(POOL[0]), lambda o: o.pop(POOL[3])):
        outcomes = []
        for order in (new_order(), OrderedDict[bytes, None]()):
            for key in POOL[:4]:
                order[key] = None
            it = iter(order)
            assert [next(it) for _ in range(4)] == POOL[:4]
            change(order)
            outcomes.append((_outcome(next, it), _outcome(next, it)))
        assert outcomes[0] == outcomes[1] and outcomes[1][0][1] is StopIteration


@native
def test_key_order_keeps_no_reference_it_should_not() -> None:
    keys = [make_key(1000 + i) for i in range(50)]
    probe = make_key(1000)
    gc.collect()
    before = [sys.getrefcount(k) for k in keys], sys.getrefcount(probe), sys.getrefcount(None)
    for _ in range(200):
        order = new_order()
        for key in keys:
            order[key] = None
        order[keys[0]] = None
        order.move_to_end(probe, last=False)
        list(order)
        for key in keys[:20]:
            order.pop(key)
        order.pop(probe, None)
        for key in keys[20:30]:
            del order[key]
        order.clear()
        for key in keys[30:]:
            order[key] = None
        del order, key  # (the loop's name holds the last key)
    gc.collect()
    assert ([sys.getrefcount(k) for k in keys], sys.getrefcount(probe), sys.getrefcount(None)) == before


def _policy_step(rng: random.Random, pool: list[bytes], policies: list[LRUPolicy], taken: list[list[bytes]]) -> None:
    op = rng.choice(["insert", "insert_many", "touch", "touch_many", "touch_held", "remove", "evict", "restore"])
    keys = rng.sample(pool, rng.randint(1, 5))
    protected = set(rng.sample(pool, rng.randint(0, 4)))
    n = rng.randint(0, 4)

    def call(policy: LRUPolicy) -> Any:
        if op == "insert":
            return policy.insert(keys[0])
        if op == "insert_many":
            return policy.insert_many(keys)
        if op == "touch":
            return policy.touch(keys[0])
        if op == "touch_many":
            return policy.touch_many(keys)
        if op == "touch_held":
            return policy.touch_held(keys)
        if op == "remove":
            return policy.remove(keys[0])
        if op == "evict":
            return policy.evict(n, protected)
        return policy.restore(taken[-1]) if taken else None

    outs = [_outcome(call, policy) for policy in policies]
    assert outs[0] == outs[1], op
    if op == "evict" and outs[0][1]:
        taken.append(outs[0][1])
    elif op == "restore" and taken:
        taken.pop()
    assert policies[0].order() == policies[1].order()
    assert len(policies[0]) == len(policies[1])


@native
@pytest.mark.parametrize("seed", range(4))
def test_lru_policy_on_key_order_matches_it_on_an_ordered_dict(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With cold keys adopted at open (taken and restored by evictions) half the time."""
    rng = random.Random(seed)
    pool = POOL[:40]
    fast = LRUPolicy(40)
    monkeypatch.setattr(policies_module, "new_order", lambda: OrderedDict())
    slow = LRUPolicy(40)
    assert type(fast.ordered()).__name__ == "KeyOrder" and type(slow.ordered()) is OrderedDict
    if seed % 2:
        ready = dict.fromkeys(pool[:20], 1)
        fast.adopt(list(pool[:20]), ready)
        slow.adopt(list(pool[:20]), ready)
    taken: list[list[bytes]] = []
    for _ in range(1500):
        _policy_step(rng, pool, [fast, slow], taken)


def _manager(fast: bool, monkeypatch: pytest.MonkeyPatch, tenants: bool) -> TierManager:
    if not fast:
        monkeypatch.setattr(policies_module, "new_order", lambda: OrderedDict())
    rules = TenantRules(quotas={"a": {0: 4}, "b": {0: 6}}) if tenants else None
    m = TierManager([TierSpec(name="t", capacity_bytes=12, block_reserve=1, policy=LRUPolicy(12))], tenants=rules)
    monkeypatch.undo()
    expect = "KeyOrder" if fast else "OrderedDict"
    assert type(m._one_policy.ordered()).__name__ == expect if m._one_policy is not None else True
    return m


def _manager_step(rng: random.Random, m: TierManager, op: str, keys: list[bytes], arg: Any) -> Any:
    if op == "store":
        plan = m.prepare_store(keys, tenant=arg[0])
        if plan is not None:
            m.complete_store(plan.keys, success=arg[1])
        return repr(plan)
    if op == "load":
        load = m.prepare_load(keys, promote=False)
        if arg[1]:
            m.complete_load(keys)
        return repr(load)
    if op == "touch":
        return m.touch(keys)
    if op == "lookup":
        return m.lookup(keys)
    if op == "remove":
        return m.remove(keys, 0)
    if op == "pin":
        return m.tenants.pin(keys, 0)
    if op == "unpin":
        return m.tenants.unpin(keys, 0)
    if op == "forget":
        return repr(m.tenants.forget(keys))
    raise AssertionError(op)


@native
@pytest.mark.parametrize("seed", range(6))
def test_manager_on_key_order_matches_it_on_an_ordered_dict(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-tier LRU manager (the native touch on each order), stores that evict, loads that
    pin, touches, removals, tenants with quotas and pins, then a close: the same answers, events
    and order."""
    rng = random.Random(seed)
    tenants = seed % 2 == 1
    managers = [_manager(True, monkeypatch, tenants), _manager(False, monkeypatch, tenants)]
    pool = [make_key(i) for i in range(30)]
    ops = ["store", "store", "store", "load", "touch", "touch", "lookup", "remove"] + (
        ["pin", "unpin", "forget"] if tenants else []
    )
    for step in range(600):
        op = rng.choice(ops)
        keys = rng.sample(pool, rng.randint(1, 4))
        ready = managers[0].tier_keys(0)
        if op == "load" and ready and rng.random() < 0.8:  # mostly keys all ready: a load that pins
            keys = rng.sample(ready, min(len(ready), rng.randint(1, 3)))
        arg = (rng.choice(["a", "b", None]) if tenants else None, rng.random() < 0.9)
        if step == 550:
            for m in managers:
                m.close()
        outs = [_outcome(_manager_step, rng, m, op, keys, arg) for m in managers]
        assert outs[0] == outs[1], (step, op)
        assert managers[0].tier_keys(0) == managers[1].tier_keys(0), (step, op)
        assert managers[0].take_events() == managers[1].take_events(), (step, op)


@native
def test_native_touch_on_key_order_is_taken_under_the_lock_and_whole() -> None:
    order = new_order()
    for key in POOL[:4]:
        order[key] = None
    handed: list[Any] = []
    lock = threading.Lock()
    call = lookups.native_module().HeldTouch(order, lock, handed.append)
    call([POOL[2], POOL[0]])
    assert list(order) == [POOL[1], POOL[3], POOL[2], POOL[0]] and handed == []
    call([POOL[1], POOL[9]])  # one not held: nothing moved, handed over whole
    assert list(order) == [POOL[1], POOL[3], POOL[2], POOL[0]] and handed == [[POOL[1], POOL[9]]]
    call([POOL[1], _BytesLike(POOL[3])])  # not exact bytes: handed over
    assert list(order) == [POOL[1], POOL[3], POOL[2], POOL[0]] and len(handed) == 2
    assert not lock.locked()


def test_without_the_extension_the_order_is_an_ordered_dict() -> None:
    assert type(new_order(native=False)) is OrderedDict
