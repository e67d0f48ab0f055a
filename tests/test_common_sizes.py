"""A variable-size tier keeps a size per key only where it differs from the tier's block
reservation: the accounting, eviction and tenancy must be those of a size for every key."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.bulk import RecordColumns
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import ARCPolicy, LRUPolicy
from kvtier.manager.record_sync import adopt_records
from kvtier.manager.tiers import TierState
from kvtier.testing import make_key

BLOCK = 100
K = [make_key(i) for i in range(400)]


def _state(blocks: int) -> TierState:
    return TierState(TierSpec("disk", blocks * BLOCK, BLOCK, LRUPolicy(blocks), persistent=True, variable_size=True))


@pytest.mark.parametrize("as_columns", [True, False])
def test_adoption_keeps_only_the_sizes_that_differ(as_columns: bool) -> None:
    sizes = [BLOCK if i % 10 else 40 + i % 7 for i in range(300)]
    records = [(K[i], sizes[i], float(i)) for i in range(300)]
    state = _state(1000)
    listing = RecordColumns([r[0] for r in records], np.array(sizes, dtype=np.int64), np.arange(300.0)) if as_columns else records
    assert adopt_records(state, listing) == []
    assert state.sizes == {K[i]: sizes[i] for i in range(300) if sizes[i] != BLOCK}
    assert state.used == sum(sizes)
    assert [state.size_of(K[i]) for i in range(300)] == sizes


def test_a_common_size_fleet_keeps_no_entry_per_key() -> None:
    state = _state(10_000)
    n = 5000
    columns = RecordColumns([make_key(10_000 + i) for i in range(n)], np.full(n, BLOCK, dtype=np.int64), np.arange(float(n)))
    assert adopt_records(state, columns) == []
    assert state.sizes == {} and state.used == n * BLOCK and len(state.index) == n


@pytest.mark.parametrize("policy", [LRUPolicy, ARCPolicy])
@pytest.mark.parametrize("seed", range(6))
def test_random_stores_loads_and_evictions_account_as_a_size_per_key(policy: type, seed: int) -> None:
    """The model keeps every key's size; the manager must agree on the bytes used, each key's
    size, and hold an entry exactly for the keys whose size is not the block reservation."""
    rnd = random.Random(seed)
    m = TierManager([TierSpec("disk", 30 * BLOCK, BLOCK, policy(30), persistent=True, variable_size=True)])
    state = m._tiers[0]
    model: dict[bytes, int] = {}
    if rnd.random() < 0.5:  # start from an adopted listing, as a store's open does
        listed = [(K[300 + i], rnd.choice([BLOCK, BLOCK, 30, 70]), float(i)) for i in range(20)]
        assert m.adopt(0, listed) == []
        model.update((k, s) for k, s, _ in listed)
    for _ in range(300):
        op = rnd.random()
        if op < 0.6:
            keys = rnd.sample(K[:120], rnd.randint(1, 4))
            plan = m.prepare_store(keys)
            if plan is None:
                continue
            for _, victims in plan.drops:
                for key in victims:
                    del model[key]
            stored = {key: rnd.choice([BLOCK, BLOCK, BLOCK, 20, 60, 90]) for key in plan.keys}
            ok = rnd.random() < 0.9
            m.complete_store(plan.keys, ok, sizes={0: stored})
            if ok:
                model.update(stored)
        elif op < 0.8 and model:
            keys = rnd.sample(sorted(model), min(len(model), rnd.randint(1, 3)))
            load = m.prepare_load(keys)
            m.complete_load(load.keys)
        elif model:
            key = rnd.choice(sorted(model))
            assert m.remove([key], 0) == [key]
            del model[key]
        assert state.used == sum(model.values())
        assert set(state.index) == set(model)
        assert state.sizes == {k: s for k, s in model.items() if s != BLOCK}
        assert all(state.size_of(k) == s for k, s in model.items())
