"""The small-job hot path's shortcuts against the general code they stand for: a job's result
and what applying it did, built slot by slot (:func:`kvtier.transfer.jobs.result_of`,
``_applied``), are the dataclasses' own, the manager's leading run of ready keys in one tier
(found in C) is the loop's answer, and distinct block ids pass the load's check in one pass
while a repeat is named as the loop names it."""

from __future__ import annotations

import random
from dataclasses import FrozenInstanceError, fields

import pytest

from kvtier.errors import LayoutError
from kvtier.manager.lookups import leading_run
from kvtier.testing import make_key
from kvtier.transfer.jobs import Applied, JobResult, _applied, result_of
from kvtier.transfer.layout_checks import check_distinct_block_ids

K = [make_key(9000 + i) for i in range(12)]


@pytest.mark.parametrize(
    "fields_",
    [
        (3, "store", True, tuple(K[:2]), 64, 0.5, {}, (), (), {}, None),
        (4, "store", False, tuple(K[:3]), 0, 0.25, {1: (K[2],)}, (), (), {1: {K[0]: 10}}, "boom"),
        (5, "load", False, tuple(K[:3]), 32, 0.125, {0: (K[1],)}, (K[1],), (1,), {}, None),
    ],
)
def test_a_result_built_slot_by_slot_is_the_dataclass_result(fields_: tuple[object, ...]) -> None:
    made = result_of(*fields_)  # type: ignore[arg-type]
    want = JobResult(*fields_)  # type: ignore[arg-type]
    assert type(made) is JobResult and made == want and repr(made) == repr(want)
    assert [getattr(made, f.name) for f in fields(JobResult)] == list(fields_)
    with pytest.raises(FrozenInstanceError):
        made.success = not made.success  # type: ignore[misc]


@pytest.mark.parametrize(
    "fields_", [("store", True, 4, 0, (), ()), ("load", False, 0, 3, (K[0],), ()), ("load", True, 1, 2, (), ((K[1], 1),))]
)
def test_an_applied_built_slot_by_slot_is_the_dataclass_applied(fields_: tuple[object, ...]) -> None:
    made = _applied(*fields_)  # type: ignore[arg-type]
    want = Applied(*fields_)  # type: ignore[arg-type]
    assert type(made) is Applied and made == want and hash(made) == hash(want) and repr(made) == repr(want)
    assert [getattr(made, f.name) for f in fields(Applied)] == list(fields_)
    with pytest.raises(FrozenInstanceError):
        made.ok = not made.ok  # type: ignore[misc]


def _loop(tiers: list[dict[bytes, int]], keys: list[bytes]) -> int:
    hits = 0
    for key in keys:
        if not any(t.get(key) for t in tiers):
            break
        hits += 1
    return hits


@pytest.mark.parametrize("tiers", [1, 2, 3])
def test_the_leading_run_is_the_loops_answer(tiers: int) -> None:
    rng = random.Random(tiers)
    for _ in range(300):
        # ready (1), pending (0) or absent, per tier
        index = [{k: rng.choice((0, 1, 1, 1)) for k in K if rng.random() < 0.8} for _ in range(tiers)]
        keys = rng.sample(K, rng.randint(0, 6)) if rng.random() < 0.5 else [k for k in K if any(t.get(k) for t in index)][:5]
        if keys and rng.random() < 0.3:  # a key repeated (the one-tier run places the first key missing by value)
            keys.insert(rng.randint(0, len(keys)), rng.choice(keys))
        assert leading_run([t.get for t in index], keys) == _loop(index, keys), (index, keys)
        assert leading_run(tuple(t.get for t in index), tuple(keys)) == _loop(index, keys), (index, keys)
        assert leading_run(tuple(t.get for t in index), dict.fromkeys(keys)) == _loop(index, list(dict.fromkeys(keys))), (index, keys)
    with pytest.raises(TypeError):
        leading_run([{}.get] * tiers, [bytearray(32)])  # unhashable: the caller names it


def test_distinct_block_ids_pass_at_a_glance_and_a_repeat_is_named_as_before() -> None:
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(12) for _ in range(rng.randint(0, 8))]
        first = next(((i, b) for i, b in enumerate(ids) if b in ids[:i]), None)
        if first is None:
            check_distinct_block_ids(ids)
            continue
        i, b = first
        with pytest.raises(LayoutError, match=rf"block_ids\[{i}\]: engine block id {b} appears twice \(also at block_ids\[{ids.index(b)}\]\)"):
            check_distinct_block_ids(ids)
