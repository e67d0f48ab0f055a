"""The index's ready-key table (``kvtier/manager/_keymirror.c``): the keys the dict maps to
READY, which the C lookup reads before the dict on a hit. It may only ever say "ready" for a key
the dict maps to READY: after every mutation (its own methods, dict's methods past it, values
released mid-mutation, keys asked as other objects of the same bytes, freed keys whose memory
another key takes), the C lookup answers, counts and refuses as the Python closure over a plain
dict, and a manager on it keeps the same answers and the same LRU order as one without it."""

from __future__ import annotations

import contextlib
import functools
import gc
import random
import sys
from typing import Any

import pytest
from refcheck import runs_without_leaks

from kvtier.bulk import READY
from kvtier.manager import TierManager, TierSpec, lookups
from kvtier.manager import tier_manager as tier_manager_module
from kvtier.manager.lookups import new_index, single_key_lookup
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key

native = pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")
UNIVERSE = [make_key(i) for i in range(400)]


def _general(keys: Any) -> int:
    raise AssertionError("lookup_key never takes the general path")


def _outcome(call: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("value", call(*args))
    except Exception as exc:
        return ("error", type(exc), str(exc))


def _exact(index: Any, keys: list[bytes]) -> None:
    """While the counts match the dict, the table holds exactly the keys mapped to READY (by
    their bytes: any object of them is answered); while they do not, it answers nothing."""
    synced = index.filter_state()["ready"] >= 0
    for key in keys:
        ready = dict.get(index, key, None) is READY
        assert index.held_ready(key) == (synced and ready), key
        assert index.held_ready(bytes(bytearray(key))) == (synced and ready), key
    if synced:
        assert index.filter_state()["ready"] == sum(1 for v in dict.values(index) if v is READY)


def _mutate(
    op: str, index: Any, model: dict[Any, Any], key: bytes, value: Any, rng: random.Random, values: list[Any]
) -> None:
    """One mutation of ``index`` (through its type, or past it through dict's own methods), the
    same on ``model``."""
    if op in ("del", "past_del") and key not in model:
        return
    if op.startswith("past_") and rng.random() >= 0.2:
        return
    if op == "pop_default":
        with pytest.raises(KeyError) if key not in model else contextlib.nullcontext():
            assert index.pop(key) == model.pop(key)
        return
    if op == "popitem":
        if model:
            assert index.popitem() == model.popitem()
        return
    if op == "clear":
        if rng.random() < 0.03:
            index.clear()
            model.clear()
        return
    several = {
        "update_new": lambda: {k: rng.choice(values) for k in rng.sample(UNIVERSE, 4) if k not in model},
        "past_update": lambda: {k: rng.choice(values) for k in rng.sample(UNIVERSE, 3)},
        "assign": lambda: dict.fromkeys(rng.sample(UNIVERSE, 5), value),
    }
    if op in several:
        items = several[op]()
        {"update_new": index.update, "past_update": functools.partial(dict.update, index)}.get(
            op, lambda d: index.assign(list(d), value)
        )(items)
        model.update(items)
        return
    one = {
        "set": lambda: index.__setitem__(key, value),
        "past_set": lambda: dict.__setitem__(index, key, value),
        "del": lambda: index.__delitem__(key),
        "past_del": lambda: dict.__delitem__(index, key),
        "pop": lambda: index.pop(key, None),
        "setdefault": lambda: index.setdefault(key, value),
    }
    expect = {
        "set": lambda: model.__setitem__(key, value),
        "past_set": lambda: model.__setitem__(key, value),
        "del": lambda: model.__delitem__(key),
        "past_del": lambda: model.__delitem__(key),
        "pop": lambda: model.pop(key, None),
        "setdefault": lambda: model.setdefault(key, value),
    }
    assert one[op]() == expect[op](), op


@native
@pytest.mark.parametrize("seed", range(3))
def test_random_mutations_keep_the_table_exact_and_the_answers_the_closures(seed: int) -> None:
    rng = random.Random(seed)
    index, model = new_index(ready_table=True), {}
    c = single_key_lookup([index.get], _general, native=True)
    py = single_key_lookup([model.get], _general, native=False)
    values = [0, READY, READY, READY, 2, True]  # PENDING, READY, and truthy values that are not READY
    for step in range(3000):
        op = rng.choice(["set", "set", "set", "del", "pop", "pop_default", "update_new", "assign", "clear",
                         "past_set", "past_update", "past_del", "setdefault", "popitem"])  # fmt: skip
        key = rng.choice(UNIVERSE)
        if rng.random() < 0.3:
            key = bytes(bytearray(key))  # the same bytes, another object
        value = rng.choice(values)
        _mutate(op, index, model, key, value, rng, values)
        assert index == model
        asked = rng.sample(UNIVERSE, 8)
        for k in asked:
            assert _outcome(c.lookup_key, k) == _outcome(py.lookup_key, k), (step, op)
            assert _outcome(c.lookup, (k,)) == _outcome(py.lookup, (k,)), (step, op)
        if rng.random() < 0.05:  # a miss now and then rebuilds stale counts (and the table)
            c.lookup_key(make_key(10_000 + step))
            py.lookup_key(make_key(10_000 + step))
        if step % 100 == 0:
            _exact(index, UNIVERSE)
    assert c.counts() == py.counts() and c.counts()[0] > 0
    _exact(index, UNIVERSE)


@native
def test_the_table_is_built_with_the_index_and_answers_a_fill_s_hits() -> None:
    """A memory tier's index keeps the table from its first key on: after a fill of stores that
    never missed, every stored key is in it (the hit path reads it) and pending ones are not. A
    persistent tier's index (millions of records on disk) keeps none."""
    m = TierManager([TierSpec("t", 300, 1, LRUPolicy(300)), TierSpec("disk", 300, 1, LRUPolicy(300), persistent=True)])
    index = m._tiers[0].index
    assert index.filter_state()["ready"] == 0 and m._tiers[1].index.filter_state()["ready"] == -1
    keys = UNIVERSE[:256]
    for i in range(0, 240, 16):
        plan = m.prepare_store(keys[i : i + 16])
        assert plan is not None
        m.complete_store(plan.keys, True)
    pending = keys[240:256]
    assert m.prepare_store(pending) is not None
    assert index.filter_state()["ready"] == 240
    assert all(index.held_ready(k) for k in keys[:240]) and not any(index.held_ready(k) for k in pending)
    assert all(m.lookup((k,)) == 1 for k in keys[:240]) and m.lookup((pending[0],)) == 0
    assert m.lookup_key.filtered() == 0  # type: ignore[attr-defined]
    m.complete_store(pending, False)  # failed: gone, never ready
    m.remove(keys[:8], 0)
    assert index.filter_state()["ready"] == 232 and not any(index.held_ready(k) for k in keys[:8])
    assert index.__sizeof__() >= 232 * 16


@native
def test_a_freed_key_s_memory_taken_by_other_bytes_is_never_a_hit() -> None:
    """The table holds its keys by reference: a key deleted from the index (through the type or
    past it) and freed cannot leave a slot that names its address, so a new key of other bytes
    made where it lived is a miss. (Without the references, identity would call it a hit.)"""
    index = new_index(ready_table=True)
    c = single_key_lookup([index.get], _general, native=True)
    for rnd in range(20):
        keys = [bytes(bytearray(make_key(rnd * 1000 + i))) for i in range(200)]
        for k in keys:
            index[k] = READY
        assert all(c.lookup_key(k) for k in keys)
        for i, k in enumerate(keys):
            if i % 2:
                del index[k]
            else:
                dict.__delitem__(index, k)  # past the type: stale until a rebuild
        del keys, k
        gc.collect()
        fresh = [bytes(bytearray(make_key(10**6 + rnd * 1000 + i))) for i in range(400)]
        assert not any(c.lookup_key(k) for k in fresh)
        assert not any(index.held_ready(k) for k in fresh)
        assert len(index) == 0
    assert c.counts()[0] == 20 * 200


@native
def test_the_table_keeps_one_reference_a_ready_key_and_none_after() -> None:
    key, other = bytes(bytearray(make_key(1))), bytes(bytearray(make_key(1)))
    index = new_index(ready_table=True)
    base = sys.getrefcount(key) + sys.getrefcount(other)
    index[key] = 0
    pending = sys.getrefcount(key) + sys.getrefcount(other)
    index[other] = READY  # the dict keeps its first object; the table holds one of those bytes
    assert sys.getrefcount(key) + sys.getrefcount(other) == pending + 1
    assert index.held_ready(other) and index.held_ready(key)
    index.pop(other)
    assert sys.getrefcount(key) + sys.getrefcount(other) == base and not index.held_ready(key)
    _churn(index, key, other)
    del index  # the table's references go with it
    assert sys.getrefcount(key) + sys.getrefcount(other) == base


def _churn(index: Any, key: bytes, other: bytes) -> None:
    """Keys made ready, pending and deleted through the table, and looked up: no reference kept
    or lost (the index ends holding ``key`` as READY)."""
    c = single_key_lookup([index.get], _general, native=True)
    index[key] = READY

    def one_round() -> None:
        index[key] = 0
        index[other] = READY
        c.lookup_key(other)
        c.lookup((key,))
        del index[other]
        index[key] = READY

    runs_without_leaks((key, other, index), one_round, 20_000)
    assert index.held_ready(other) and c.counts()[0] == 40_000


def _managers(monkeypatch: pytest.MonkeyPatch) -> list[TierManager]:
    def spec() -> list[TierSpec]:
        return [TierSpec("a", 40, 1, LRUPolicy(40)), TierSpec("b", 100, 1, LRUPolicy(100), persistent=True)]

    fast = TierManager(spec())
    monkeypatch.setattr(lookups, "_INDEX", dict)
    monkeypatch.setattr(tier_manager_module, "single_key_lookup", functools.partial(single_key_lookup, native=False))
    slow = TierManager(spec())
    monkeypatch.undo()
    assert type(fast._tiers[0].index).__name__ == "KeyIndex" and type(slow._tiers[0].index) is dict
    assert type(fast.lookup_key).__name__ == "KeyProbe" and type(slow.lookup_key).__name__ == "function"
    return [fast, slow]


def _step(m: TierManager, op: str, keys: list[bytes], ok: bool) -> Any:
    if op == "store":
        plan = m.prepare_store(keys)
        if plan is not None:
            m.complete_store(plan.keys, success=ok)
        return repr(plan)
    if op == "load":
        load = m.prepare_load(keys)
        m.complete_load(keys)
        return repr(load)
    if op == "touch":
        return m.touch(keys)
    if op == "remove":
        return m.remove(keys, 0)
    if op == "lookup":
        return [m.lookup(keys), m.lookup((keys[0],)), m.lookup_key(keys[0])]
    raise AssertionError(op)


@native
@pytest.mark.parametrize("seed", range(4))
def test_a_manager_on_the_table_matches_one_on_plain_dicts(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tiers, stores that evict and demote, failed stores, loads that promote, touches,
    removals, lookups of every shape (bad keys included), then a close: the same answers,
    counts, errors, events and LRU order, and the table exact after every step."""
    rng = random.Random(seed)
    managers = _managers(monkeypatch)
    pool = UNIVERSE[:160]
    bad: list[Any] = ["k" * 32, pool[0][:31], None, bytearray(pool[1])]
    for step in range(800):
        op = rng.choice(["store", "store", "load", "touch", "remove", "lookup", "lookup", "lookup"])
        keys = rng.sample(pool, rng.randint(1, 5))
        if op == "lookup" and rng.random() < 0.1:
            keys = [rng.choice(bad), *keys]
        if op == "lookup" and rng.random() < 0.5:
            keys = [bytes(bytearray(k)) if isinstance(k, bytes) else k for k in keys]
        ok = rng.random() < 0.9
        if step == 780:
            for m in managers:
                m.close()
        outs = [_outcome(_step, m, op, keys, ok) for m in managers]
        assert outs[0] == outs[1], (step, op)
        for t in range(2):
            assert managers[0].tier_keys(t) == managers[1].tier_keys(t), (step, op, t)
        assert managers[0].take_events() == managers[1].take_events(), (step, op)
        if step < 780:
            for t in managers[0]._tiers:
                assert (t.index.filter_state()["ready"] >= 0) is not t.persistent, (step, op)  # followed every change
                _exact(t.index, pool)
    assert managers[0].stats()["lookups"] == managers[1].stats()["lookups"]


class _Meddler:
    """A key of another type that collides with ``key``'s hash; its ``__eq__`` (run by the dict
    inside a later mutation of ``key``) makes ``key`` READY through the type on call ``when``."""

    def __init__(self, index: Any, key: bytes, when: int) -> None:
        self.index, self.key, self.when, self.calls = index, key, when, 0

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        self.calls += 1
        if self.calls == self.when:
            self.index[self.key] = READY
        return False


@native
@pytest.mark.parametrize("when", [1, 2, 3, 4])
def test_a_key_of_another_type_whose_compare_mutates_midway_cannot_leave_a_wrong_hit(when: int) -> None:
    """Where the dict holds a key of another type, comparing with it can run Python code inside
    a mutation the table follows, and change the same key behind the note's back (here: made
    READY midway through setting it PENDING). So the table is never kept while such a key is
    held: without that, the key would stay in it as ready while the dict maps it to 0."""
    key = make_key(77)
    index = new_index(ready_table=True)
    c = single_key_lookup([index.get], _general, native=True)
    py = single_key_lookup([index.get], _general, native=False)  # the closure over the same dict
    meddler = _Meddler(index, key, when)
    index[meddler] = 0
    for n, k in enumerate(UNIVERSE[:50]):  # misses: the filter's counts are rebuilt (a table would be)
        index[k] = READY
        c.lookup_key(make_key(5000 + n))
    index[key] = 0
    meddler.when = 0  # disarmed: the lookups below compare with it too
    truth = dict.get(index, key)  # whatever the dict made of the set and the meddling
    assert meddler.calls >= 1
    assert index.held_ready(key) is False or truth is READY
    assert _outcome(c.lookup_key, key) == _outcome(py.lookup_key, key) == ("value", bool(truth))
    assert _outcome(c.lookup, (key,)) == _outcome(py.lookup, (key,))
    index[key] = 0
    assert dict.get(index, key) == 0 and c.lookup_key(key) is False
    del index[meddler]
    c.lookup_key(make_key(9999))  # a miss: rebuilt, now that every key is bytes
    assert index.filter_state()["ready"] == 50 and all(index.held_ready(k) for k in UNIVERSE[:50])
    assert not index.held_ready(key) and c.lookup_key(key) is False


@native
def test_a_ready_key_set_through_another_object_which_is_then_freed_is_never_a_wrong_hit() -> None:
    """``index[copy] = READY`` where the dict already holds the key as another object keeps the
    dict's object, not ``copy``; the table notes ``copy``. When the caller frees ``copy``, new
    bytes objects of other keys are made where it lived: the table's reference keeps ``copy``
    alive, so its slot can never name one of them (without it, identity would call them hits)."""
    index = new_index(ready_table=True)
    c = single_key_lookup([index.get], _general, native=True)
    stored = [make_key(i) for i in range(2000)]
    for k in stored:
        index[k] = 0
    for k in stored:
        index[bytes(bytearray(k))] = READY  # the copy is dropped at once
    assert index.filter_state()["ready"] == len(stored)
    made = [bytes(bytearray(make_key(10**6 + i))) for i in range(20_000)]  # fill the freed memory
    assert not any(index.held_ready(k) for k in made)
    assert not any(c.lookup_key(k) for k in made)
    assert all(c.lookup_key(k) for k in stored)


@native
@pytest.mark.parametrize("seed", range(3))
def test_a_miss_the_table_answers_as_absent_is_the_dict_s_answer(seed: int) -> None:
    """While the table holds every key of the dict (all READY), a key it misses is answered absent
    without the dict; once a key maps to something else (PENDING, or a truthy value that is not
    READY) the dict answers again. Either way the C lookup answers, counts and refuses as the
    Python closure over a plain dict: absent keys, wrong lengths, other objects of held bytes."""
    rng = random.Random(seed)
    index, model = new_index(ready_table=True), {}
    c = single_key_lookup([index.get], _general, native=True)
    py = single_key_lookup([model.get], _general, native=False)
    asked = [*UNIVERSE, b"short", make_key(99_999)[:-1] + b"\x00\x00"]
    whole = 0
    for step in range(1500):
        key = rng.choice(UNIVERSE)
        if rng.random() < 0.6:
            value = READY if rng.random() < 0.9 else rng.choice([0, 2, True])
            index[key] = value
            model[key] = value
        elif key in model:
            del index[key]
            del model[key]
        if rng.random() < 0.3:  # everything made ready: the table covers the dict
            for k, v in list(model.items()):
                if v is not READY:
                    index[k] = model[k] = READY
        whole += index.filter_state()["ready"] == len(index) > 0
        for k in rng.sample(asked, 12):
            if rng.random() < 0.3:
                k = bytes(bytearray(k))
            assert _outcome(c.lookup_key, k) == _outcome(py.lookup_key, k), step
            assert _outcome(c.lookup, (k,)) == _outcome(py.lookup, (k,)), step
    assert c.counts() == py.counts() and c.counts()[0] > 0 and c.counts()[1] > 0
    assert whole > 100  # the table's own misses were exercised
