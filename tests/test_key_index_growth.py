"""The key index's filter grows a few dict entries per mutation: no single store recounts the
whole dict when the keys outgrow the slots, and while it grows (the dict resizing under it,
keys removed and added again) the filter still never calls a held key absent, and the lookups
answer as the closure over a plain dict does."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvtier.manager import lookups
from kvtier.manager.lookups import new_index, single_key_lookup
from kvtier.testing import make_key

native = pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")
STEP = 8  # entries a key added or removed counts into a growing filter (_keygrow.c's GROW_STEP)


def _general(keys: Any) -> int:
    raise AssertionError("lookup_key never takes the general path")


def _same_as_a_dict(index: Any, universe: list[bytes]) -> None:
    """The filter says absent only for keys the dict does not hold, and the filtered lookup
    answers every key as the closure over a plain copy of the dict does."""
    plain = dict(index)
    c = single_key_lookup([index.get], _general, native=True).lookup_key
    py = single_key_lookup([plain.get], _general, native=False).lookup_key
    for key in universe:
        if not index.maybe(key):
            assert key not in index, key
        assert c(key) is py(key), key


@native
@pytest.mark.parametrize("ready", [False, True])
def test_no_store_counts_more_than_a_few_entries_per_key_as_the_keys_outgrow_the_slots(ready: bool) -> None:
    """Filled 32 keys a call to 60,000 (the filter's slots double eight to ten times on the way),
    no call counts more than STEP entries per key it adds: the recount of the whole dict that
    each doubling cost one call (60,000 entries in the last) is spread over the calls after."""
    index = new_index(ready_table=ready)
    start = index.filter_state()["slots"]
    worst = last = 0
    grew = 0
    keys = [make_key(i) for i in range(60_000)]
    for i in range(0, len(keys), 32):
        index.assign(keys[i : i + 32], 1)
        state = index.filter_state()
        assert state["synced"]
        worst, last = max(worst, state["recounted"] - last), state["recounted"]
        grew += state["growing"]
    assert 0 < worst <= 32 * STEP
    assert grew > 0 and index.filter_state()["slots"] >= 2**8 * start  # it grew, a call at a time
    assert index.filter_state()["recounted"] >= len(keys)
    _same_as_a_dict(index, [*keys[::7], *(make_key(i) for i in range(10**6, 10**6 + 20_000))])


@native
@pytest.mark.parametrize("ready", [False, True])
def test_a_filter_growing_while_keys_come_and_go_and_the_dict_resizes_stays_true(ready: bool) -> None:
    """Keys added and removed at random around the growth's thresholds: the dict drops its
    deleted entries (a resize: every entry moves, so the growing count starts over) while the
    filter grows. Against a model dict at every step; the filter and the lookups at every
    50th. The growth's start-over path runs (asserted)."""
    rng = random.Random(11)
    universe = [make_key(i) for i in range(4000)]
    index, model = new_index(ready_table=ready), {}
    moved_while_growing = 0
    size = 60
    for step in range(12_000):
        if step % 3000 == 2999:
            size *= 3  # the next thresholds
        state = index.filter_state()
        table = dict.__sizeof__(index)
        key = rng.choice(universe)
        op = rng.random()
        if len(model) < size and op < 0.6:
            index[key] = model[key] = step % 2
        elif op < 0.8 and key in model:
            del index[key], model[key]
        elif op < 0.9:
            assert index.pop(key, None) == model.pop(key, None)
        else:
            new = {k: 1 for k in rng.sample(universe, 4) if k not in model}
            index.update(new)
            model.update(new)
        after = index.filter_state()
        assert after["synced"] and index == model and list(index) == list(model)
        moved_while_growing += state["growing"] and after["growing"] and dict.__sizeof__(index) != table
        if step % 50 == 0:
            _same_as_a_dict(index, universe)
    _same_as_a_dict(index, universe)
    assert moved_while_growing > 0


@native
def test_an_update_of_many_new_keys_counts_them_as_it_adds_them() -> None:
    """One update far past the slots' limit: the growth is budgeted by the keys added, so the
    filter is again of the size the keys need, and exact, without a later call paying for it."""
    index = new_index()
    keys = [make_key(i) for i in range(5000)]
    index.update(dict.fromkeys(keys[:10], 1))
    index.update(dict.fromkeys(keys[10:], 1))
    state = index.filter_state()
    assert state["synced"] and state["slots"] >= 2 * len(keys)
    assert state["recounted"] <= STEP * len(keys)
    _same_as_a_dict(index, [*keys, *(make_key(i) for i in range(10**6, 10**6 + 5000))])


@native
def test_a_dict_resize_in_the_middle_of_the_growth_starts_its_count_over() -> None:
    """The growth walks the dict's entries by position. Sixteen deleted entries ahead of the
    live ones, and the dict drops them (a resize) two mutations into the walk: every later
    entry moves sixteen places back, behind the walk's position. Walked on from there, the new
    filter would miss those keys and call held keys absent once it took over."""
    index = new_index(ready_table=True)  # 256 slots, 32 keys: the growth starts past 24
    first, later = [make_key(i) for i in range(24)], [make_key(100 + i) for i in range(40)]
    index.assign(first, 1)
    for key in first[:16]:
        del index[key]
    moved_while_growing = False
    for key in later:
        growing, table = index.filter_state()["growing"], dict.__sizeof__(index)
        index[key] = 1
        moved_while_growing |= growing and index.filter_state()["growing"] and dict.__sizeof__(index) != table
    assert moved_while_growing  # the case this is about happened
    assert not index.filter_state()["growing"] and index.filter_state()["slots"] > 256  # the new filter took over
    assert [key for key in index if not index.maybe(key)] == []
    _same_as_a_dict(index, [*first, *later, *(make_key(i) for i in range(1000, 3000))])
