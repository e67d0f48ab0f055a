"""The manager's store fast paths against its general paths: same plans, same errors, same
counters, events, key states and order, call after call.

* the common store's two calls (``kvtier/manager/store_calls.py``): ``prepare_store`` of new,
  distinct, well-formed keys that fit in the first tier's free room (or, in a tier that is the
  only one, in the room its victims free: dropped, never a pinned key), with no copy below and
  no tenant, opens its plan in one step (``PlanBook.open_new``), and ``complete_store`` of a
  successful store of keys of one such plan settles them in one step (``PlanBook.complete_new``);
* behind them, in the manager's general methods: ``prepare_store`` of keys that fit in the
  first tier's free room, with no copy below (write-back, or one tier), skips the plan builder
  (``PlanBook.prepare``); ``complete_store`` of a successful store of one plan that copies
  nothing below skips the general settlement (``PlanBook.complete_plain``);
* ``complete_store`` takes its keys out of the book in one pass (``PlanBook.take``), and puts
  back what it took when a key is not open, repeats, or cannot be hashed;
* the store's load, ``prepare_load_run`` (``kvtier/manager/load_calls.py``), against the two
  calls it replaces: ``lookup`` and ``prepare_load`` of the leading run.

A random sequence of calls runs on two managers alike, one of them with the fast paths turned
off, and everything observable is compared after every call.
"""

from __future__ import annotations

import random
from dataclasses import FrozenInstanceError, fields
from types import MethodType
from typing import Any

import pytest

from kvtier.manager import LoadPlan, StorePlan, TierManager, TierSpec, lookups
from kvtier.manager.plan import plain_plan
from kvtier.manager.policies import ARCPolicy, LRUPolicy
from kvtier.manager.tenants import TenantRules
from kvtier.testing import make_key

BLOCK = 100
K = [make_key(i) for i in range(160)]
POLICY = {"lru": LRUPolicy, "arc": ARCPolicy}


def _spec(name: str, blocks: int, policy: str, **kw: Any) -> TierSpec:
    return TierSpec(name=name, capacity_bytes=blocks * BLOCK, block_reserve=BLOCK, policy=POLICY[policy](blocks), **kw)


CONFIGS: dict[str, Any] = {
    "one": lambda p: TierManager([_spec("cpu", 8, p)]),
    "roomy": lambda p: TierManager([_spec("cpu", 200, p)]),  # room for most stores: the common store's path
    "roomy-back": lambda p: TierManager([_spec("cpu", 100, p), _spec("disk", 200, p, persistent=True)], clock=lambda: 5.0),
    "one-persistent": lambda p: TierManager([_spec("disk", 8, p, persistent=True)], clock=lambda: 5.0),
    "one-variable": lambda p: TierManager([_spec("zst", 8, p, variable_size=True)]),
    "one-admit": lambda p: TierManager([_spec("cpu", 8, p, admit_after=2)]),
    "back": lambda p: TierManager([_spec("cpu", 4, p), _spec("disk", 8, p, persistent=True)], clock=lambda: 5.0),
    "through": lambda p: TierManager([_spec("cpu", 4, p), _spec("disk", 8, p)], write="through"),
    "admit": lambda p: TierManager([_spec("cpu", 4, p), _spec("disk", 8, p, admit_after=2)]),
    "quotas": lambda p: TierManager([_spec("cpu", 8, p)], tenants=TenantRules(quotas={"a": {0: 3 * BLOCK}})),
}


#: keys no call has named yet in the current run, next one last
_FRESH: list[bytes] = []
#: whether stores of the current run name tenants (in every other run)
_TENANTS: list[bool] = []


def _general(m: TierManager) -> TierManager:
    """``m`` with its store fast paths off: the store calls are the manager's general methods,
    every store takes the builder, every completion the general settlement."""
    m.prepare_store = MethodType(TierManager.prepare_store, m)  # type: ignore[method-assign]
    m.complete_store = MethodType(TierManager.complete_store, m)  # type: ignore[method-assign]
    m._plans._no_copies = False  # (the general path then adds no copies either: write-back or one tier)
    m._plans.complete_plain = lambda *args: False  # type: ignore[method-assign]

    def load_run(keys: Any) -> LoadPlan | None:  # the two calls the store's load made before
        hits = m.lookup(keys)
        return m.prepare_load(list(keys[:hits]), promote=False) if hits else None

    m.prepare_load_run = load_run
    return m


class _Bytes(bytes):
    """Equal to a stored key, hashed as one, and not exactly ``bytes``."""


def _outcome(call: Any, *args: Any, **kw: Any) -> tuple[Any, ...]:
    try:
        return ("value", call(*args, **kw))
    except Exception as exc:  # the error must match too: type and message
        return ("error", type(exc), str(exc))


def _state(m: TierManager) -> tuple[Any, ...]:
    book = m._plans
    return (
        m.stats(),
        [m.tier_keys(i) for i in range(m.num_tiers)],
        m.lookup_detail(K),
        m.take_events(),
        {ti: (dict(t.index), dict(t.pins), dict(t.sizes), dict(t.stamps), t.used, t.pending) for ti, t in enumerate(m._tiers)},
        {pid: (p.remaining, p.demoted, p.through, p.sources) for pid, p in book._plans.items()},
        sorted(book._plan_of.items()),
        sorted(book._copying),
        list(m._admission._seen.items()),
    )


def _call(
    rng: random.Random, open_keys: list[bytes], plans: list[tuple[bytes, ...]], pinned: list[bytes]
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """A random call: mostly well-formed, sometimes not. ``plans``: the keys of the plans
    prepared so far (the common completion names one plan's keys, whole); ``pinned``: the keys
    pinned by loads so far (a store never evicts them)."""
    roll = rng.random()
    if rng.random() < 0.1 and plans:  # pins: loads of stored keys (ready or not), and their end
        if pinned and rng.random() < 0.4:
            return "complete_load", ([pinned.pop(rng.randrange(len(pinned)))],), {}
        if rng.random() < 0.5:  # the store's load: the leading run, pinned in one call
            keys = [*rng.choice(plans)[: rng.randint(1, 4)], *rng.sample(K, rng.randint(0, 2))]
            twist = rng.random()
            if twist < 0.1:
                keys[rng.randrange(len(keys))] = rng.choice([b"short", "x" * 32, bytearray(32), None])
            elif twist < 0.2:
                keys[0] = _Bytes(keys[0])
            elif twist < 0.3:
                keys = tuple(keys)
            elif twist < 0.35:
                keys = []
            return "prepare_load_run", (keys,), {}
        return "prepare_load", (list(rng.choice(plans)[:2]),), {"promote": False}
    if roll < 0.4 or not open_keys:
        # Half the stores are of keys never named before (the common store), half of any keys.
        fresh = rng.random() < 0.5 and len(_FRESH) > 6
        keys: Any = [_FRESH.pop() for _ in range(rng.randint(1, 6))] if fresh else rng.sample(K, rng.randint(1, 6))
        if rng.random() < 0.15:
            keys.append(keys[0])  # a repeat
        bad = rng.random()
        if bad < 0.1:
            keys[rng.randrange(len(keys))] = rng.choice([b"short", "x" * 32, bytearray(32), None])
        elif bad < 0.2:
            keys = tuple(keys)
        elif bad < 0.25:
            keys = rng.choice([b"".join(keys), "k" * 32, None])
        kw: dict[str, Any] = {}
        if rng.random() < 0.1:
            kw["keep_below"] = rng.sample(K, 2)
        if rng.random() < 0.2:
            kw["partial"] = True
        if rng.random() < 0.15 and _TENANTS:  # (once a tenant is named, tenants are counted: no common store)
            kw["tenant"] = rng.choice(["a", "b"])
        return "prepare_store", (keys,), kw
    if roll < 0.55 and plans:
        whole = rng.choice(plans)
        return "complete_store", (whole if rng.random() < 0.5 else list(whole),), {}
    if roll < 0.75:
        keys = rng.sample(open_keys, rng.randint(1, len(open_keys)))
        kw = {}
        twist = rng.random()
        if twist < 0.1:
            kw["success"] = False
        elif twist < 0.15:
            kw["sizes"] = {0: {key: BLOCK // 2 for key in keys}}
        elif twist < 0.2:
            kw["failed"] = {1: keys[:1]}
        elif twist < 0.25:
            keys = [*keys, keys[0]]  # a repeat: an error, nothing taken out
        elif twist < 0.3:
            keys = [*keys[:1], bytearray(keys[-1])]  # unhashable after an open key
        elif twist < 0.35:
            keys = [*keys[:1], rng.choice(K)]  # maybe not open
        elif twist < 0.4:
            keys = tuple(keys)
        return "complete_store", (keys,), kw
    keys = rng.sample(K, rng.randint(1, 4))
    if roll < 0.85:
        return "touch", (keys,), {}
    return "lookup", (keys,), {}


@pytest.mark.parametrize("policy", sorted(POLICY))
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(6))
def test_store_fast_paths_match_the_general_paths(config: str, policy: str, seed: int) -> None:
    fast, general = CONFIGS[config](policy), _general(CONFIGS[config](policy))
    rng = random.Random(f"{config}-{policy}-{seed}")
    open_keys: list[bytes] = []
    plans: list[tuple[bytes, ...]] = []
    pinned: list[bytes] = []
    _FRESH[:] = K[::-1]
    _TENANTS[:] = [True] if seed % 2 else []
    for step in range(160):
        name, args, kw = _call(rng, open_keys, plans, pinned)
        got = _outcome(getattr(fast, name), *args, **kw)
        want = _outcome(getattr(general, name), *args, **kw)
        assert got == want, (step, name, args, kw)
        assert _state(fast) == _state(general), (step, name, args, kw)
        if name == "prepare_load" and got[0] == "value":
            pinned += args[0]
        if name == "prepare_load_run" and got[0] == "value" and got[1] is not None:
            pinned += got[1].keys
        open_keys = sorted(fast._plans._plan_of)
        if name == "prepare_store" and got[0] == "value" and got[1] is not None and got[1].keys:
            plans = [*plans[-5:], got[1].keys]


def test_the_fast_paths_are_taken() -> None:
    """The common store goes through the one-step calls, without the general methods; a plan
    that demotes does not (the comparisons above are not vacuous)."""
    m = CONFIGS["one"]("lru")

    def general(*args: Any) -> Any:
        raise AssertionError("the general path was taken")

    m._plans.prepare = m._plans.take = m._plans.complete = general  # type: ignore[method-assign]
    for keys in (K[:4], tuple(K[4:6])):
        plan = m.prepare_store(keys)
        assert plan is not None and plan.keys == tuple(keys) and plan.positions == tuple(range(len(keys)))
        m.complete_store(keys)
    assert m.lookup(K[:6]) == 6 and len(m._plans) == 0 and m.counters["store_completed"] == 6
    # a full tier that is the only one: the policy's victims are dropped in the same step,
    # never a pinned key
    m.take_events()
    m.prepare_load([K[0]], promote=False)
    plan = m.prepare_store(K[6:10])
    assert plan is not None and plan.keys == tuple(K[6:10]) and plan.drops == ((0, (K[1], K[2])),)
    assert [(e.kind, e.key) for e in m.take_events()] == [("removed", K[1]), ("removed", K[2])] and m.lookup(K[:1]) == 1
    m.complete_store(K[6:10])
    assert m.lookup(K[3:10]) == 7 and m.stats()["tiers"][0]["dropped"] == 2
    # the general paths behind them: a plan that demotes is not plain
    two = CONFIGS["back"]("lru")
    taken = []
    for part in (K[:4], K[4:6]):
        plan = two.prepare_store(part)
        assert plan is not None
        taken.append((bool(plan.demotions), two._plans.complete_new(plan.keys, lambda: 5.0)))
        if not taken[-1][1]:
            two.complete_store(plan.keys)
    assert taken == [(False, 4), (True, 0)]
    assert two.lookup(K[:6]) == 6 and len(two._plans) == 0


def test_a_plain_plan_is_the_dataclass_plan() -> None:
    """``plain_plan`` (attribute stores, then the class) makes the plan the dataclass makes,
    and as frozen."""
    made = plain_plan(7, tuple(K[:3]), (0, 1, 2))
    want = StorePlan(7, tuple(K[:3]), (0, 1, 2))
    assert type(made) is StorePlan and made == want and hash(made) == hash(want) and repr(made) == repr(want)
    assert [getattr(made, f.name) for f in fields(StorePlan)] == [getattr(want, f.name) for f in fields(StorePlan)]
    with pytest.raises(FrozenInstanceError):
        made.keys = ()  # type: ignore[misc]


def test_complete_store_puts_back_what_it_took_before_an_unhashable_key() -> None:
    m = CONFIGS["one"]("lru")
    plan = m.prepare_store(K[:3])
    assert plan is not None
    before = sorted(m._plans._plan_of.items())
    with pytest.raises(Exception, match=r"keys\[2\]"):
        m.complete_store([K[0], K[1], bytearray(K[2])])
    assert sorted(m._plans._plan_of.items()) == before
    m.complete_store(plan.keys)
    assert m.lookup(K[:3]) == 3 and len(m._plans) == 0


def test_the_load_runs_one_step_is_taken_and_pins_what_the_lookup_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare_load_run`` pins the leading run itself in a manager of one tier (without
    ``prepare_load``), counts it as a lookup and a load, and gives ``None`` when no key leads;
    in a manager of several tiers it takes ``prepare_load`` (the comparisons above are not
    vacuous)."""
    general: list[list[bytes]] = []
    inner = TierManager.prepare_load

    def counted(self: TierManager, keys: Any, **kw: Any) -> LoadPlan:
        general.append(list(keys))
        return inner(self, keys, **kw)

    monkeypatch.setattr(TierManager, "prepare_load", counted)  # (the managers below bind this one)
    m = CONFIGS["one"]("lru")
    for keys in (K[:3], K[3:5]):
        m.complete_store(m.prepare_store(keys).keys)  # type: ignore[union-attr]
    m.prepare_store(K[5:6])  # pending: it ends a run
    before = m.counters
    plan = m.prepare_load_run([K[0], K[1], K[5], K[2]])
    assert plan == LoadPlan((K[0], K[1]), (0, 0))
    assert m.prepare_load_run([K[9], K[0]]) is None and m.prepare_load_run([K[5]]) is None
    after = m.counters
    assert after["lookups"] - before["lookups"] == 3 and after["load_prepared"] - before["load_prepared"] == 2
    assert m._tiers[0].pins == {K[0]: 1, K[1]: 1} and m.tier_keys(0)[-2:] == [K[0], K[1]]  # pinned and touched
    assert general == []
    m.complete_load(plan.keys)  # type: ignore[union-attr]
    assert not m._tiers[0].pins
    two = CONFIGS["back"]("lru")
    two.complete_store(two.prepare_store(K[:2]).keys)  # type: ignore[union-attr]
    assert two.prepare_load_run(K[:3]) == LoadPlan(tuple(K[:2]), (0, 0))
    assert general == [K[:2]]


@pytest.mark.parametrize("policy", sorted(POLICY))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_store_paths_match_with_and_without_the_native_index_loops(
    config: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's item sets on a tier's index (``reserve_keys``, ``assign_keys``): one C loop on
    the native index, a Python loop with that turned off, and a Python loop on a plain dict
    index give the same outcomes and states call after call, the index's order included."""
    runs = []
    for variant in ("native", "python", "dict"):
        monkeypatch.setattr(lookups, "_SET_MANY", lookups._SET_MANY if variant == "native" else None)
        if variant == "dict":
            monkeypatch.setattr(lookups, "_INDEX", dict)
        m = CONFIGS[config](policy)
        assert (type(m._tiers[0].index) is dict) == (variant == "dict" or not lookups.NATIVE)
        rng = random.Random(f"{config}-{policy}")
        open_keys: list[bytes] = []
        plans: list[tuple[bytes, ...]] = []
        pinned: list[bytes] = []
        _FRESH[:] = K[::-1]
        _TENANTS[:] = []
        trace = []
        for _ in range(120):
            name, args, kw = _call(rng, open_keys, plans, pinned)
            got = _outcome(getattr(m, name), *args, **kw)
            trace.append((got, _state(m), [list(t.index.items()) for t in m._tiers]))
            if name == "prepare_load" and got[0] == "value":
                pinned += args[0]
            if name == "prepare_load_run" and got[0] == "value" and got[1] is not None:
                pinned += got[1].keys
            open_keys = sorted(m._plans._plan_of)
            if name == "prepare_store" and got[0] == "value" and got[1] is not None and got[1].keys:
                plans = [*plans[-5:], got[1].keys]
        runs.append(trace)
    assert runs[0] == runs[1] == runs[2]
