"""How many filter slots a tier's index keeps a key: a memory tier's index (the one with a
ready-key table) counts its keys in 8-16 slots each, so its filter answers about nine misses in
ten without a probe of the table or the dict; a persistent tier's index, which may hold millions
of records, keeps 2-4. The size changes only which path answers: every answer, count and error
stays the dict's and the general lookup's."""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_key_index import _outcome

from kvtier.manager import TierManager, TierSpec, lookups
from kvtier.manager.lookups import new_index, single_key_lookup
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key

native = pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")
STORED = 20_000


def _manager(persistent: bool, n: int = STORED) -> TierManager:
    m = TierManager([TierSpec("t", n, 1, LRUPolicy(n), persistent=persistent)])
    keys = [make_key(i) for i in range(n)]
    for i in range(0, n, 16):
        plan = m.prepare_store(keys[i : i + 16])
        assert plan is not None
        m.complete_store(plan.keys, True)
    return m


def _absent(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


@native
@pytest.mark.parametrize(("persistent", "per_key", "least_filtered"), [(False, 8, 0.85), (True, 2, 0.6)])
def test_a_memory_tier_s_filter_answers_most_misses_itself(persistent: bool, per_key: int, least_filtered: float) -> None:
    """At 2-4 slots a key a third of the misses went on to a probe of the table (a hash and a
    cache miss each, most of a miss's time at 10^5 keys); at 8-16, about a tenth."""
    m = _manager(persistent)
    index = m._tiers[0].index
    absent = _absent(STORED, 3)
    assert [m.lookup((k,)) for k in absent] == [0] * STORED
    slots = index.filter_state()["slots"]
    assert per_key * STORED <= slots < 2 * per_key * (STORED + 1)
    filtered = m.lookup_key.filtered()  # type: ignore[attr-defined]
    assert filtered >= least_filtered * (STORED - 8)  # a few misses come before the filter is consulted
    if persistent:
        assert filtered < 0.85 * STORED  # the small filter: more of its misses get through


@native
def test_keep_ready_on_a_counted_index_recounts_it_in_more_slots() -> None:
    """An index whose filter was counted before it was asked to keep the table is recounted in
    the larger filter when next consulted, and says absent only for keys it does not hold."""
    index = new_index()
    keys = [make_key(i) for i in range(5000)]
    for key in keys:
        index[key] = 1
    assert index.maybe(keys[0])
    small = index.filter_state()["slots"]
    assert 2 * 5000 <= small < 4 * 5001
    index.keep_ready()
    assert index.maybe(keys[1])
    state = index.filter_state()
    assert state["synced"] and state["ready"] == 5000
    assert 8 * 5000 <= state["slots"] < 16 * 5001
    for key in keys:
        assert index.maybe(key) and index.held_ready(key)


@native
@pytest.mark.parametrize("seed", [1, 2])
def test_the_larger_filter_s_answers_are_the_general_lookup_s(seed: int) -> None:
    """The C lookup over a memory tier's index (filter, table, dict) against the Python closure
    over a plain dict of the same items: same answers and errors for hits, misses, pending keys
    and bad keys, through a mix of stores and removals that grows and shrinks the filter."""
    rng = random.Random(seed)
    index, model = new_index(ready_table=True), {}
    fast = single_key_lookup([index.get], lambda ks: 0)
    general = single_key_lookup([model.get], lambda ks: 0, native=False)
    universe = [make_key(i) for i in range(3000)]
    for step in range(20_000):
        key = rng.choice(universe)
        op = rng.random()
        if op < 0.45:
            index[key] = model[key] = 1  # ready
        elif op < 0.5:
            index[key] = model[key] = 0  # pending
        elif key in model:
            del index[key], model[key]
        if step % 7 == 0:
            probe: Any = rng.choice([key, rng.randbytes(32), b"short", "text", 5, [1]])
            assert _outcome(fast.lookup, (probe,)) == _outcome(general.lookup, (probe,))
            assert _outcome(fast.lookup_key, probe) == _outcome(general.lookup_key, probe)
    assert all(fast.lookup((k,)) == general.lookup((k,)) for k in universe)
    assert fast.counts() == general.counts()
    assert index.filter_state()["synced"]
