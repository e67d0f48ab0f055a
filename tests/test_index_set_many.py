"""The native index's batch sets, ``KeyIndex.reserve`` and ``KeyIndex.assign`` (one C loop of
item sets), against the Python loops they replace on a plain dict: same result or error, same
items in the same order, and a membership filter that still knows every key held."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvtier.keys import KEY_BYTES
from kvtier.manager import lookups
from kvtier.testing import make_key

native = pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")

K = [make_key(i) for i in range(64)]


class _BytesLike(bytes):
    """Not a valid key type, though it hashes and compares like one."""


def _python_reserve(index: dict[Any, Any], keys: Any, value: Any) -> bool:
    for key in keys:
        if type(key) is not bytes or len(key) != KEY_BYTES:
            return False
        index[key] = value
    return True


def _python_assign(index: dict[Any, Any], keys: Any, value: Any) -> None:
    for key in keys:
        index[key] = value


def _outcome(call: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("value", call(*args))
    except Exception as exc:  # the error must match too: type and message
        return ("error", type(exc), str(exc))


def _filled(kind: type, n: int) -> Any:
    index = kind()
    for key in K[:n]:
        index[key] = 1
    return index


BATCHES: list[Any] = [
    [K[40], K[41]],
    (K[42],),
    [],
    [K[1], K[40]],  # one held: replaced
    [K[43], K[43]],  # a repeat
    [K[44], K[45][:31], K[46]],  # too short: stops there
    [K[47], _BytesLike(K[48]), K[49]],  # not exactly bytes
    [K[50], bytearray(K[51])],  # unhashable (and not bytes)
    [K[52], "x" * 32],
    [None],
]


@native
@pytest.mark.parametrize("keys", BATCHES, ids=repr)
def test_reserve_and_assign_match_the_python_loops(keys: Any) -> None:
    kind = lookups._INDEX
    for value in (0, 1, None):
        c, py = _filled(kind, 30), _filled(dict, 30)
        assert _outcome(c.reserve, keys, value, KEY_BYTES) == _outcome(_python_reserve, py, keys, value)
        assert list(c.items()) == list(py.items())
        c, py = _filled(kind, 30), _filled(dict, 30)
        got = _outcome(c.assign, keys, value)
        want = _outcome(_python_assign, py, keys, value)
        assert got[0] == want[0] and (got[0] == "value" or got[1] is want[1])
        assert list(c.items()) == list(py.items())
        assert all(c.maybe(key) for key in c if type(key) is bytes)


@native
def test_random_batches_keep_the_filter_exact() -> None:
    """Reserves, assigns and deletes at random across the filter's rebuilds: the index's items
    match a dict's, and the filter never says absent for a key held."""
    rng = random.Random(3)
    keys = [make_key(i) for i in range(3000)]
    c, py = lookups._INDEX(), {}
    for _ in range(600):
        batch = [rng.choice(keys) for _ in range(rng.randrange(1, 20))]
        roll = rng.random()
        if roll < 0.5:
            assert c.reserve(batch, 0, KEY_BYTES) == _python_reserve(py, batch, 0)
        elif roll < 0.8:
            c.assign(tuple(batch), 1)
            _python_assign(py, batch, 1)
        else:
            for key in batch:
                c.pop(key, None)
                py.pop(key, None)
        assert list(c.items()) == list(py.items())
    assert all(c.maybe(key) for key in py)
    assert sum(not c.maybe(key) for key in keys if key not in py) > 0  # the filter does answer


@native
def test_reserve_and_assign_refuse_bad_arguments() -> None:
    index = lookups._INDEX()
    with pytest.raises(TypeError, match="keys: expected a list or tuple, got set"):
        index.reserve({K[0]}, 0, KEY_BYTES)
    with pytest.raises(TypeError, match="keys: expected a list or tuple, got generator"):
        index.assign((k for k in K[:2]), 0)
    with pytest.raises(ValueError, match="key_bytes: expected a length >= 0, got -1"):
        index.reserve([K[0]], 0, -1)
    with pytest.raises(TypeError, match="reserve expected 3 arguments"):
        index.reserve([K[0]], 0)
    with pytest.raises(TypeError, match="assign expected 2 arguments"):
        index.assign([K[0]])
    assert dict(index) == {}


def test_the_helpers_take_any_iterable_and_any_index() -> None:
    """``reserve_keys`` and ``assign_keys`` hand what the C loop does not take (another
    sequence, a plain dict) to the Python loop."""
    for kind in {dict, lookups._INDEX}:
        index = kind()
        assert lookups.reserve_keys(index, [K[0], K[1]], 0) is True
        assert lookups.reserve_keys(index, [K[2], K[3][:5], K[4]], 0) is False
        lookups.assign_keys(index, iter([K[0], K[5]]), 1)
        lookups.assign_keys(index, {K[6]: None}.keys(), 1)
        assert list(index.items()) == [(K[0], 1), (K[1], 0), (K[2], 0), (K[5], 1), (K[6], 1)]
