"""The tiers' index in C (``kvtier.manager._probe.KeyIndex``): a dict in every respect, whose
membership filter never says "absent" for a key the dict holds, whatever mutated it (its own
methods, dict's methods called past it, keys of other types), and which the single-key lookup
consults on a miss with the same answers, counts and errors as the closure over the same index."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import pytest
from refcheck import runs_without_leaks

from kvtier.errors import InvalidKeyError
from kvtier.manager import TierManager, TierSpec, lookups
from kvtier.manager.lookups import new_index, single_key_lookup
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key

native = pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")
UNIVERSE = [make_key(i) for i in range(600)]


def _general(keys: Any) -> int:
    raise AssertionError("lookup_key never takes the general path")


def _covers(index: Any, universe: list[bytes]) -> None:
    """The filter's promise: it says absent only for a key the dict does not hold."""
    for key in universe:
        if not index.maybe(key):
            assert key not in index, key


def _outcome(call: Any, key: Any) -> tuple[Any, ...]:
    try:
        return ("value", call(key))
    except Exception as exc:
        return ("error", type(exc), str(exc))


@native
def test_random_mutations_keep_it_a_dict_and_its_filter_exact() -> None:
    rng = random.Random(7)
    index, model = new_index(), {}
    index.maybe(UNIVERSE[0])  # built: from here every counted mutation keeps it synced
    counted = ("set", "del", "pop", "pop_default", "update_new", "clear")
    for step in range(6000):
        op = rng.choice([*counted, "set", "set", "del", "setdefault", "popitem", "update_any", "ior"])
        key = rng.choice(UNIVERSE)
        synced = index.filter_state()["synced"]
        if op == "set":
            index[key] = model[key] = step
        elif op == "del" and key in model:
            del index[key], model[key]
        elif op == "pop":
            assert index.pop(key, None) == model.pop(key, None)
        elif op == "pop_default":
            with pytest.raises(KeyError) if key not in model else contextlib.nullcontext():
                assert index.pop(key) == model.pop(key)
        elif op == "update_new":
            new = {k: step for k in rng.sample(UNIVERSE, 5) if k not in model}
            index.update(new)
            model.update(new)
        elif op == "clear" and rng.random() < 0.02:
            index.clear()
            model.clear()
        elif op == "setdefault":  # dict's own method: past the counts, caught by the version
            assert index.setdefault(key, step) == model.setdefault(key, step)
        elif op == "popitem" and model:
            assert index.popitem() == model.popitem()
        elif op == "update_any":
            more = [(k, step) for k in rng.sample(UNIVERSE, 3)]
            index.update(more)
            model.update(more)
        elif op == "ior":
            more2 = {k: step for k in rng.sample(UNIVERSE, 3)}
            index |= more2
            model |= more2
        assert index == model and list(index) == list(model) and len(index) == len(model)
        if op in counted and synced:
            assert index.filter_state()["synced"], op  # a counted mutation needs no rebuild
        if step % 50 == 0:
            _covers(index, UNIVERSE)
    _covers(index, UNIVERSE)
    assert type(index).__name__ == "KeyIndex" and isinstance(index, dict)


@native
def test_a_mutation_past_the_type_is_caught_before_the_filter_answers() -> None:
    """dict's own methods and C calls change the table without the filter's counts; the dict's
    version tag says so, and the filter is rebuilt before it answers. Without that check the
    filter would call most of these keys absent."""
    index = new_index()
    index.update(dict.fromkeys(UNIVERSE[:100], 1))
    probe = single_key_lookup([index.get], _general, native=True)
    for key in UNIVERSE[300:400]:  # misses: the filter is consulted from here on
        assert probe.lookup_key(key) is False
    assert index.filter_state()["synced"]
    late = UNIVERSE[100:300]
    for key in late[:100]:
        dict.__setitem__(index, key, 1)
    dict.update(index, dict.fromkeys(late[100:], 1))
    assert not index.filter_state()["synced"]
    assert all(probe.lookup_key(key) for key in late)
    assert index.filter_state()["synced"]
    dict.clear(index)
    assert not any(probe.lookup_key(key) for key in UNIVERSE[:300])


@native
def test_keys_of_other_types_turn_the_filter_off_until_they_are_gone() -> None:
    index = new_index()
    index.update(dict.fromkeys(UNIVERSE[:50], 1))
    probe = single_key_lookup([index.get], _general, native=True)
    key = UNIVERSE[60]
    index[memoryview(key)] = 1  # equal to the bytes key, hashed alike: the dict finds it
    assert index.filter_state()["synced"] is False
    for k in UNIVERSE[100:200]:  # misses: the filter is consulted (and rebuilt, counting the foreign key)
        assert probe.lookup_key(k) is False
    assert probe.lookup_key(key) is True
    assert index.filter_state()["foreign"] == 1 and probe.lookup_key.filtered() == 0  # type: ignore[attr-defined]
    assert all(index.maybe(k) for k in UNIVERSE)  # no filter while a foreign key is held
    del index[key]  # removes the memoryview entry
    assert probe.lookup_key(key) is False and index.filter_state()["foreign"] == 0
    for k in UNIVERSE[100:200]:
        assert probe.lookup_key(k) is False
    assert probe.lookup_key.filtered() > 0  # type: ignore[attr-defined]
    assert not all(index.maybe(k) for k in UNIVERSE[100:200])  # the filter answers again


@native
@pytest.mark.parametrize("tiers", [1, 2, 3])
def test_the_filtered_lookup_answers_counts_and_refuses_as_the_closure(tiers: int) -> None:
    """The same indexes, probed through the filter (C) and by ``get`` (closure): hits, misses
    the filter answers, misses it leaves to the dict, pending keys, malformed keys, closed."""
    indexes: list[Any] = [new_index(), {}, new_index()][:tiers]
    for i, index in enumerate(indexes):
        index.update({k: (n + i) % 3 for n, k in enumerate(UNIVERSE[i * 100 : i * 100 + 150])})  # 0: pending
    gets = [d.get for d in indexes]
    c, py = single_key_lookup(gets, _general, native=True), single_key_lookup(gets, _general, native=False)
    probe = c.lookup_key
    asked: list[Any] = [*UNIVERSE, "k" * 32, UNIVERSE[0][:31], bytearray(UNIVERSE[0]), [1], None]
    rng = random.Random(3)
    for _ in range(3):
        rng.shuffle(asked)
        for key in asked:
            assert _outcome(probe, key) == _outcome(py.lookup_key, key), key
            assert _outcome(c.lookup, (key,)) == _outcome(py.lookup, (key,)), key
    assert c.counts() == py.counts() and c.counts()[0] > 0 and c.counts()[1] > 0
    assert probe.filtered() > 0  # the filter answered some misses: the fast path ran
    c.close()
    py.close()
    assert _outcome(probe, UNIVERSE[0]) == _outcome(py.lookup_key, UNIVERSE[0])


@native
def test_the_filter_is_consulted_only_while_misses_are_common() -> None:
    index = new_index()
    index.update(dict.fromkeys(UNIVERSE[:100], 1))
    probe = single_key_lookup([index.get], _general, native=True).lookup_key
    for key in UNIVERSE[:100] * 3:  # hits only: the filter is left out
        assert probe(key)
    assert not probe(UNIVERSE[500]) and probe.filtered() == 0
    for key in UNIVERSE[300:500]:  # misses: consulted
        assert not probe(key)
    assert probe.filtered() > 100


@native
def test_no_reference_is_kept_or_lost_through_the_filter() -> None:
    hit, miss, bad = make_key(1000), make_key(1001), "k" * 32
    value = 10**30
    index = new_index()
    index[hit] = value
    c = single_key_lookup([index.get], _general, native=True)
    one, lst = (hit,), [miss]
    watched = (hit, miss, bad, value, index, one, lst)
    for _ in range(10_000):
        c.lookup_key(miss)
        c.lookup_key(hit)
    filtered = c.lookup_key.filtered()  # type: ignore[attr-defined]

    def one_round() -> None:
        c.lookup_key(miss)
        c.lookup_key(miss)
        c.lookup_key(hit)
        c.lookup(one)
        c.lookup(lst)
        with contextlib.suppress(InvalidKeyError):
            c.lookup_key(bad)

    runs_without_leaks(watched, one_round, 50_000)
    assert c.lookup_key.filtered() > filtered  # type: ignore[attr-defined]


@native
def test_every_index_mutation_of_the_manager_keeps_the_filter_exact() -> None:
    """Random stores (done, failed), loads, touches, removals, evictions, adoptions (bulk and
    one by one, at open and live) and tenant deletes: after each, every tier's filter still
    matches its dict with no rebuild (no site goes past the counts) and covers every key held."""
    rng = random.Random(11)
    specs = [TierSpec("a", 40 * 10, 10, LRUPolicy(40)), TierSpec("b", 120 * 10, 10, LRUPolicy(120), persistent=True)]
    m = TierManager(specs)
    m.adopt(1, [(k, 10, float(i)) for i, k in enumerate(UNIVERSE[500:560])])
    m.adopt(1, [(k, 10, float(i)) for i, k in enumerate(UNIVERSE[555:565])])  # overlapping: one by one
    indexes = [t.index for t in m._tiers]
    for index in indexes:
        index.maybe(UNIVERSE[0])
    for step in range(1500):
        op = rng.choice(["store", "store", "fail", "load", "touch", "remove", "live", "forget", "lookup"])
        keys = list(dict.fromkeys(rng.choice(UNIVERSE[:400]) for _ in range(rng.randint(1, 6))))
        if op in ("store", "fail"):
            plan = m.prepare_store(keys)
            if plan is not None:
                m.complete_store(plan.keys, success=op == "store")
        elif op == "load":
            ready = keys[: m.lookup(keys)]
            if ready:
                m.prepare_load(ready)
                m.complete_load(ready)
        elif op == "touch":
            m.touch(keys)
        elif op == "remove":
            m.remove(keys, rng.randrange(2))
        elif op == "live":
            m.adopt_live(1, [(k, 10, float(step)) for k in keys])
        elif op == "forget":
            m.tenants.forget(keys)
        else:
            for key in keys:
                m.lookup_key(key)
        for ti, index in enumerate(indexes):
            assert index.filter_state()["synced"], (step, op, ti)
        if step % 25 == 0:
            for index in indexes:
                _covers(index, UNIVERSE)
    assert m.lookup_key.filtered() >= 0  # type: ignore[attr-defined]


@native
def test_an_index_counts_its_keys_from_the_first_so_no_miss_pays_a_rebuild() -> None:
    """A new index, and a cleared one, is counted at once (no lookup consulted it yet): the
    stores that fill a manager keep the counts exact, so the first misses after a run of hits
    find the filter synced instead of counting the whole tier inside one lookup. The ready-key
    table of a memory tier is kept from the first key too. Answers are the closure's."""
    specs = [TierSpec("a", 300 * 10, 10, LRUPolicy(300)), TierSpec("b", 300 * 10, 10, LRUPolicy(300), persistent=True)]
    m = TierManager(specs)
    indexes = [t.index for t in m._tiers]
    for index in indexes:
        assert index.filter_state()["synced"]
    for i in range(0, 300, 12):
        keys = UNIVERSE[i : i + 12]
        m.complete_store(m.prepare_store(keys).keys, success=True)  # type: ignore[union-attr]
    state = indexes[0].filter_state()
    assert state["synced"] and state["slots"] >= 8 * 300 and state["ready"] == 300
    assert all(m.lookup_key(k) for k in UNIVERSE[:300])
    assert indexes[0].filter_state()["synced"] and indexes[1].filter_state()["synced"]
    closure = single_key_lookup([t.index.get for t in m._tiers], _general, native=False)
    for key in UNIVERSE[300:]:
        assert m.lookup_key(key) is closure.lookup_key(key) is False
    assert m.lookup_key.filtered() > 0  # type: ignore[attr-defined]
    index = new_index(ready_table=True)
    index.update(dict.fromkeys(UNIVERSE[:100], 1))
    index.clear()
    state = index.filter_state()
    assert state["synced"] and state["slots"] == 256 and state["ready"] == 0
    index.assign(UNIVERSE[:50], 1)
    assert index.filter_state()["synced"] and index.filter_state()["ready"] == 50
    _covers(index, UNIVERSE)


def test_without_the_extension_the_index_is_a_plain_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookups, "_INDEX", dict)
    assert type(new_index()) is dict
    m = TierManager([TierSpec("t", 400, 100, LRUPolicy(4))])
    assert type(m._tiers[0].index) is dict
    plan = m.prepare_store([UNIVERSE[0]])
    assert plan is not None
    m.complete_store(plan.keys)
    assert m.lookup_key(UNIVERSE[0]) is True and m.lookup_key(UNIVERSE[1]) is False


class _Planter:
    """A value whose release puts ``key`` in ``index`` past the type (dict's own method)."""

    def __init__(self, index: Any, key: bytes) -> None:
        self.index, self.key = index, key

    def __del__(self) -> None:
        dict.__setitem__(self.index, self.key, 1)


@native
@pytest.mark.parametrize("how", ["set", "del", "update"])
def test_a_value_released_mid_mutation_cannot_hide_a_key_from_the_filter(how: str) -> None:
    """Replacing or deleting a value releases it inside the dict's mutation, and its release can
    run Python code that mutates the index past the type (here: one more key, which keeps the
    size the type expects). The filter must still never call that key absent."""
    held, planted, other = UNIVERSE[0], UNIVERSE[1], UNIVERSE[2]
    index = new_index()
    index[held] = _Planter(index, planted)
    index.maybe(UNIVERSE[3])  # the filter built and synced
    assert index.filter_state()["synced"]
    if how == "set":
        index[held] = 1
    elif how == "del":
        del index[held]
    else:
        index.update({held: 1, other: 1})
    assert planted in index
    assert index.maybe(planted), "the filter calls a held key absent"
    probe = single_key_lookup([index.get], _general, native=True)
    assert probe.lookup_key(planted) is True
    _covers(index, UNIVERSE[:50])


@native
def test_the_collector_walks_an_index_only_while_it_holds_objects_it_follows() -> None:
    """As an exact dict: an index of bytes keys and int values is not tracked by the cycle
    collector (else every full collection walks all of a tier's keys, a pause that grows with
    the tier); one that holds a container is tracked, and a cycle through it is collected."""
    import gc
    import weakref

    index = new_index()
    assert not gc.is_tracked(index)
    for key in UNIVERSE:
        index[key] = 1
    index.update({make_key(1000): 0})
    assert not gc.is_tracked(index) and not gc.is_tracked(type(index)({make_key(1001): 1}))
    _covers(index, UNIVERSE)

    class Holder:
        pass

    cyclic = new_index()
    holder = Holder()
    holder.index = cyclic  # type: ignore[attr-defined]
    cyclic[make_key(1)] = holder  # type: ignore[assignment]
    assert gc.is_tracked(cyclic)
    gone = weakref.ref(holder)
    del holder, cyclic
    gc.collect()
    assert gone() is None
