"""The ready-key table grows without a pause (``kvtier/manager/_keymirror.c``): past half full a
table of twice the slots is zeroed a part a mutation, then the old one is moved into it a few
slots a mutation, and while it is moved a lookup asks both. It answers hits, so it must stay
exact through the move: never "ready" for a key the dict does not map to READY, never "absent"
for one it does. Also: an ``update()`` goes on with the filter's growth instead of starting it
over, so updates at a steady rate do not keep the filter from growing."""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest

from kvtier.bulk import READY
from kvtier.manager import lookups
from kvtier.manager.lookups import new_index, single_key_lookup
from kvtier.testing import make_key

native = pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")
MOVE_STEP = 4  # old slots moved per mutation (_keymirror.c)
MOVE_PART = 32  # moved in parts of this many slots: the first part after 8 mutations
LOAD = 2  # the filter's slots per key, at least, in an index without a ready table (_keyindex.h)


def _general(keys: Any) -> int:
    raise AssertionError("lookup_key never takes the general path")


def _exact(index: Any, keys: list[bytes]) -> None:
    """The table holds exactly the keys the dict maps to READY, asked by the same object or by
    another of the same bytes, and the C lookup answers each key as the closure over a plain
    copy of the dict does."""
    assert index.filter_state()["ready"] == sum(1 for v in dict.values(index) if v is READY)
    plain = dict(index)
    c = single_key_lookup([index.get], _general, native=True).lookup_key
    py = single_key_lookup([plain.get], _general, native=False).lookup_key
    for key in keys:
        ready = dict.get(index, key, None) is READY
        assert index.held_ready(key) == ready, key
        assert index.held_ready(bytes(bytearray(key))) == ready, key
        assert c(key) is py(key), key


def _keys_homed(slot: int, mask: int, n: int, start: int) -> list[bytes]:
    """``n`` keys whose hash puts them at ``slot`` of a table of ``mask`` + 1 slots first."""
    out, i = [], start
    while len(out) < n:
        key = make_key(i)
        if hash(key) & mask == slot:
            out.append(key)
        i += 1
    return out


def _filled_to_a_move(first: list[bytes], rest_homes: range) -> tuple[Any, list[bytes]]:
    """An index whose 64-slot table holds ``first`` (in order, from their homes on) and keys homed
    in ``rest_homes`` up to 33 keys: the 33rd passes half full, the larger table is made and
    zeroed in that one mutation (2 KiB), and the move starts at the next. The keys, in order."""
    index = new_index(ready_table=True)
    assert index.filter_state()["ready_slots"] == 64
    keys = list(first)
    i = 5_000_000
    while len(keys) < 33:
        key = make_key(i)
        if hash(key) & 63 in rest_homes:
            keys.append(key)
        i += 1
    for key in keys[:32]:
        index[key] = READY
    assert not index.filter_state()["ready_moving"]
    index[keys[32]] = READY
    state = index.filter_state()
    assert state["ready_moving"] and state["ready_slots"] == 128 and state["ready_moved"] == 0
    return index, keys


@native
def test_no_call_moves_more_than_a_few_slots_per_key_as_the_table_grows() -> None:
    """Filled 32 ready keys a call to 50,000 (the table doubles ten times on the way, the last
    time from 65,536 slots), no call moves more than MOVE_STEP keys per key it stores: the
    move of the whole table that each doubling cost one call (39,322 keys in the last) is
    spread over the calls after. Exact at every step of the way it is checked."""
    index = new_index(ready_table=True)
    keys = [make_key(i) for i in range(50_000)]
    worst = last = 0
    moving = 0
    for i in range(0, len(keys), 32):
        index.assign(keys[i : i + 32], READY)
        state = index.filter_state()
        worst, last = max(worst, state["ready_moved"] - last), state["ready_moved"]
        moving += state["ready_moving"]
        assert state["ready"] == min(i + 32, len(keys)) and state["synced"]
        if i % 4096 == 0:
            _exact(index, keys[: i + 64 : 7])
    state = index.filter_state()
    assert 0 < worst <= 32 * MOVE_STEP + MOVE_PART  # a part's worth earned by the call before
    assert moving > 100 and state["ready_slots"] == 131_072  # it grew, a call at a time
    assert state["ready_moved"] >= 39_000  # the last doubling's keys alone
    _exact(index, [*keys[::5], *(make_key(i) for i in range(10**6, 10**6 + 5000))])


@native
@pytest.mark.parametrize("seed", range(3))
def test_random_churn_through_several_moves_matches_a_dict_and_the_python_lookup(seed: int) -> None:
    """Keys set ready and pending, deleted, popped, added by update() and looked up, at random,
    while the index grows past five doublings of its table and shrinks and grows again: the
    table against a model dict after every step, the C lookup against the Python closure at
    every step. Removals land inside moves and the dict resizes inside them (both asserted)."""
    rng = random.Random(seed)
    universe = [make_key(seed * 100_000 + i) for i in range(6000)]
    index, model = new_index(ready_table=True), {}
    c = single_key_lookup([index.get], _general, native=True)
    py = single_key_lookup([model.get], _general, native=False)
    removed_in_move = resized_in_move = 0
    targets = [100, 400, 1500, 4000, 5800, 1500, 400, 5800]  # up, down and up again
    for step in range(16_000):
        target = targets[step // 2000]
        state = index.filter_state()
        table = dict.__sizeof__(index)
        key = rng.choice(universe)
        op = rng.random()
        if len(model) < target and op < 0.55:
            value = READY if rng.random() < 0.8 else 0
            index[key] = model[key] = value
        elif op < 0.75 and key in model:
            del index[key], model[key]
            removed_in_move += state["ready_moving"]
        elif op < 0.85:
            assert index.pop(key, None) == model.pop(key, None)
            removed_in_move += state["ready_moving"]
        elif op < 0.95:
            new = {k: READY for k in rng.sample(universe, 6) if k not in model}
            index.update(new)
            model.update(new)
        else:
            batch = rng.sample(universe, 16)
            index.assign(batch, READY)
            model.update(dict.fromkeys(batch, READY))
        after = index.filter_state()
        resized_in_move += state["ready_moving"] and after["ready_moving"] and dict.__sizeof__(index) != table
        assert after["ready"] == sum(1 for v in model.values() if v is READY), step
        for k in (key, *rng.sample(universe, 6)):
            assert c.lookup_key(k) is py.lookup_key(k), (step, k)
            assert index.held_ready(k) == (model.get(k) is READY), (step, k)
        if step % 500 == 0:
            assert index == model
            _exact(index, universe[::3])
    assert index == model and c.counts() == py.counts()
    _exact(index, universe)
    assert index.filter_state()["ready_moved"] > 3000
    assert removed_in_move > 50 and resized_in_move > 0


@native
def test_a_key_shifted_back_behind_the_move_is_moved_too() -> None:
    """A and B both homed at slot 31 of the old table (A at 31, B at 32). The move passes slots
    0-31 (A moved, B not), then A is deleted: B shifts back into slot 31, behind the move. Left
    there, B would never be moved, and once the old table is let go the lookup would call a
    ready key absent (the table holds every key of the dict, so a key it lacks is answered a
    miss)."""
    a, b = _keys_homed(31, 63, 2, 0)
    index, keys = _filled_to_a_move([a, b], range(36, 60))
    pending = [make_key(9_000_000 + i) for i in range(40)]
    for key in pending[:8]:  # eight mutations: the move passes slots 0-31
        index[key] = 0
    assert index.filter_state()["ready_moved"] >= 1
    del index[a]
    for key in pending[8:]:  # the move goes on to the end
        index[key] = 0
    assert not index.filter_state()["ready_moving"]
    assert index.held_ready(b)
    _exact(index, [*keys, *pending, *(make_key(i) for i in range(10**6, 10**6 + 2000))])


@native
def test_a_moved_key_shifted_back_ahead_of_the_move_is_not_held_twice() -> None:
    """A homed at slot 63, B homed there too and wrapped to slot 0. The move passes slot 0 (B
    moved); deleting A (not moved yet) shifts B back to slot 63, ahead of the move, which
    meets it again there. Held twice, one deletion of B would leave the other copy: a hit for
    a key no longer in the index."""
    a, b = _keys_homed(63, 63, 2, 0)
    index, keys = _filled_to_a_move([a, b], range(16, 40))
    pending = [make_key(9_000_000 + i) for i in range(40)]
    for key in pending[:8]:  # the move passes slots 0-31
        index[key] = 0
    del index[a]
    for key in pending[8:]:
        index[key] = 0
    assert not index.filter_state()["ready_moving"]
    assert index.filter_state()["ready"] == 32
    del index[b]
    assert not index.held_ready(b)
    c = single_key_lookup([index.get], _general, native=True)
    assert not c.lookup_key(b) and c.lookup((b,)) == 0
    _exact(index, [*keys, *pending])


@native
@pytest.mark.parametrize("how", ["clear", "past_the_type", "dealloc", "finished"])
def test_a_table_dropped_or_finished_mid_move_keeps_one_reference_a_key(how: str) -> None:
    """Mid-move, some keys are in the old table only, some in both (moved), one in both after a
    shift put it back ahead of the move: dropping the tables (``clear``, a mutation past the
    type, the index freed) or finishing the move releases each key's one reference once."""
    a, b = _keys_homed(63, 63, 2, 0)
    first = [bytes(bytearray(a)), bytes(bytearray(b))]
    index, keys = _filled_to_a_move(first, range(16, 40))
    keys = keys[1:]  # A is deleted below: its reference goes then
    counts = [sys.getrefcount(k) for k in keys]
    for i in range(8):  # the move passes slots 0-31 (B moved)
        index[make_key(9_000_000 + i)] = 0
    del index[first[0]]
    assert index.filter_state()["ready_moving"]
    if how == "clear":
        index.clear()
    elif how == "past_the_type":
        dict.__delitem__(index, keys[5])
        index[make_key(9_000_100)] = 0  # the table follows no more: dropped
        assert index.filter_state()["ready"] == -1
        index.clear()
    elif how == "dealloc":
        del index
    else:
        for i in range(40):
            index[make_key(9_000_100 + i)] = 0
        assert not index.filter_state()["ready_moving"]
        index.clear()
    assert [sys.getrefcount(k) for k in keys] == [n - 2 for n in counts]  # the dict's and the table's


@native
@pytest.mark.parametrize("ready", [False, True])
def test_updates_at_a_steady_rate_let_the_filter_grow(ready: bool) -> None:
    """32 keys a call through ``assign`` and an update() of two new keys every third call (one
    update in about a hundred mutations), to 40,000 keys: the filter keeps growing to the size
    the keys need. Before, each update started the growth over (zeroing the new filter again,
    the walk from the first entry), so once the walk took more than about a hundred mutations
    it never finished, and the filter stayed at its size for about a thousand keys, its counters
    stuck at "maybe"."""
    index = new_index(ready_table=ready)
    keys = [make_key(i) for i in range(40_000)]
    extra = iter(make_key(10**6 + i) for i in range(10**5))
    grown = 0
    for n, i in enumerate(range(0, len(keys), 32)):
        slots = index.filter_state()["slots"]
        index.assign(keys[i : i + 32], READY)
        if n % 3 == 2:
            index.update({next(extra): READY, next(extra): READY})
        state = index.filter_state()
        assert state["synced"]
        grown += state["slots"] > slots
    state = index.filter_state()
    per_key = 8 if ready else LOAD
    assert state["slots"] >= per_key * len(index), state
    assert grown >= 7
    assert state["saturated"] <= state["slots"] // 32
    absent = [make_key(2 * 10**6 + i) for i in range(4000)]
    assert sum(not index.maybe(k) for k in absent) > 0.5 * len(absent)
    assert all(index.maybe(k) for k in keys[::11])


@native
def test_one_update_of_many_ready_keys_grows_the_table_as_it_adds_them() -> None:
    """One update() of 20,000 ready keys into a table of 64 slots: it steps the growth once a key,
    as item sets do, so the table doubles ten times inside the call, each move keeping pace
    with the keys (none done whole at the limit), and ends exact."""
    index = new_index(ready_table=True)
    keys = [make_key(i) for i in range(20_000)]
    index.update(dict.fromkeys(keys[:10], READY))
    index.update(dict.fromkeys(keys[10:], READY))
    state = index.filter_state()
    assert state["ready"] == len(keys) and state["ready_slots"] == 65_536
    assert state["ready_moving"]  # the last doubling (at 16,385 keys) still moving: not done whole
    assert state["ready_moved"] <= 33_000  # each doubling moves at most the keys of its half-full table
    _exact(index, [*keys[::3], *(make_key(i) for i in range(10**6, 10**6 + 3000))])
