"""The small-job hot path's shortcuts against the general code they stand for: a job's result
built slot by slot (:func:`kvtier.transfer.jobs.result_of`) is the dataclass's own, and the
manager's leading run of ready keys in one tier (one pass in C) is the loop's answer."""

from __future__ import annotations

import random
from dataclasses import FrozenInstanceError, fields

import pytest

from kvtier.manager.lookups import leading_run
from kvtier.testing import make_key
from kvtier.transfer.jobs import JobResult, result_of

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
        assert leading_run([t.get for t in index], keys) == _loop(index, keys), (index, keys)
    with pytest.raises(TypeError):
        leading_run([{}.get] * tiers, [bytearray(32)])  # unhashable: the caller names it
