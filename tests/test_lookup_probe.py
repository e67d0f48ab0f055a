"""The single-key lookup in C (``kvtier.manager._probe.KeyProbe``: ``lookup_key(key)`` and
``lookup`` of a tuple or list of one key) against the Python closures it stands in for: the same answers, counts and errors (type and message) over hits, misses,
pending keys and malformed keys, on one tier and several, dict indexes and other getters, open
and closed; no reference kept or lost; and the extension is built wherever a C compiler is."""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig
from typing import Any

import pytest
from refcheck import runs_without_leaks

from kvtier.errors import InvalidKeyError
from kvtier.manager import TierManager, TierSpec, lookups
from kvtier.manager.lookups import single_key_lookup
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key

K = [make_key(i) for i in range(16)]
native = pytest.mark.skipif(not lookups.NATIVE, reason="kvtier.manager._probe not built (no C compiler)")


class _Truthy:
    """A value whose truthiness is its own: the probe must ask it, not assume an int."""

    def __init__(self, truth: bool) -> None:
        self.truth = truth

    def __bool__(self) -> bool:
        return self.truth


class _Odd:
    """Not a valid value for truthiness: ``bool()`` of it raises."""

    def __bool__(self) -> bool:
        raise RuntimeError("no truth here")


def _general(keys: Any) -> int:
    raise AssertionError("lookup_key never takes the general path")


def _indexes() -> list[dict[bytes, Any]]:
    """Three tiers: ready (1), pending (0), and values whose truthiness is theirs."""
    return [
        {K[0]: 1, K[1]: 0, K[2]: True},
        {K[3]: 1, K[1]: 2, K[4]: 0},
        {K[5]: _Truthy(True), K[6]: _Truthy(False), K[7]: 3},
    ]


def _getters(indexes: list[dict[bytes, Any]], shape: str) -> list[Any]:
    if shape == "dict.get":  # probed directly by the C path
        return [d.get for d in indexes]
    if shape == "callable":  # called by the C path
        return [(lambda k, d=d: d.get(k)) for d in indexes]
    return [d.get if i % 2 else (lambda k, d=d: d.get(k)) for i, d in enumerate(indexes)]  # mixed


KEYS: list[Any] = [*K[:9], _Odd(), "a" * 32, K[0][:31], K[0] + b"x", b"", bytearray(K[0]), bytearray(K[9]), memoryview(K[0]), [1], {K[0]}, None, 7, (K[0],)]


def _is_c_lookup(call: Any) -> bool:
    """Whether ``call`` is the C ``lookup`` (a KeyProbe's bound method)."""
    return type(getattr(call, "__self__", None)).__name__ == "KeyProbe"


def _outcome(call: Any, key: Any) -> tuple[Any, ...]:
    try:
        return ("value", call(key))
    except Exception as exc:  # the error must match too: type and message
        return ("error", type(exc), str(exc))


@native
@pytest.mark.parametrize("tiers", [1, 2, 3])
@pytest.mark.parametrize("shape", ["dict.get", "callable", "mixed"])
def test_c_and_python_answer_count_and_refuse_alike(tiers: int, shape: str) -> None:
    indexes = _indexes()
    indexes[0][_Odd.__name__.encode()] = _Odd()  # hashable, equal to nothing asked: never probed
    odd = {K[8]: _Odd()}  # a value whose truthiness raises: the error propagates as it is
    gets = _getters([*indexes[:tiers], odd], shape) if tiers == 3 else _getters(indexes[:tiers], shape)
    c, py = single_key_lookup(gets, _general, native=True), single_key_lookup(gets, _general, native=False)
    assert type(c.lookup_key).__name__ == "KeyProbe" and type(py.lookup_key).__name__ == "function"
    for key in KEYS * 2:
        got, want = _outcome(c.lookup_key, key), _outcome(py.lookup_key, key)
        assert got == want, key
        assert c.counts() == py.counts()
    assert c.counts()[0] > 0 and c.counts()[1] > 0
    c.close()
    py.close()
    for key in (K[0], K[9], "x", [1]):
        assert _outcome(c.lookup_key, key) == _outcome(py.lookup_key, key) == ("error", lookups.ClosedError, "the tier manager is closed")


def _one_key_inputs() -> list[Any]:
    """Inputs of ``lookup(keys)``, made fresh for each side (an iterator is used up)."""
    many = [K[0], K[1]]
    return [
        *[(k,) for k in K[:9]], *[[k] for k in K[:9]], (), [], tuple(many), many, {K[0]}, {K[9]: 1}, iter([K[0]]), iter([K[9]]),
        ("a" * 32,), (K[0][:31],), (bytearray(K[0]),), [bytearray(K[9])], ([1],), [{K[0]}], (_Odd(),), (None,),
        "a", "ab", b"a", K[0], None, 7,
    ]  # fmt: skip


@native
@pytest.mark.parametrize("tiers", [1, 2, 3])
@pytest.mark.parametrize("shape", ["dict.get", "callable", "mixed"])
def test_lookup_of_one_key_in_c_matches_the_closure(tiers: int, shape: str) -> None:
    """``lookup(keys)``: a tuple or list of one key is answered in C, anything else by the closure
    (and through it the general path); both sides answer, count, refuse and hand on alike."""
    indexes = [*_indexes()[: min(tiers, 2)], {K[8]: _Odd()}][:tiers]
    gets = _getters(indexes, shape)
    handed: dict[str, list[str]] = {"c": [], "py": []}

    def general(side: str) -> Any:
        def run(keys: Any) -> int:
            handed[side].append(type(keys).__name__)
            return 7

        return run

    c = single_key_lookup(gets, general("c"), native=True)
    py = single_key_lookup(gets, general("py"), native=False)
    assert _is_c_lookup(c.lookup) and type(py.lookup).__name__ == "function"
    for a, b in zip(_one_key_inputs(), _one_key_inputs(), strict=True):
        got, want = _outcome(c.lookup, a), _outcome(py.lookup, b)
        assert got == want and type(got[1]) is type(want[1]), a
        assert c.counts() == py.counts(), a
    assert handed["c"] == handed["py"] and handed["c"]
    assert c.counts()[0] > 0 and c.counts()[1] > 0
    c.close()
    py.close()
    for a, b in zip(_one_key_inputs()[:20], _one_key_inputs()[:20], strict=True):
        assert _outcome(c.lookup, a) == _outcome(py.lookup, b)


@native
def test_the_errors_name_the_key() -> None:
    c = single_key_lookup([{}.get], _general, native=True)
    with pytest.raises(InvalidKeyError, match="key: expected bytes, got str"):
        c.lookup_key("k")
    with pytest.raises(InvalidKeyError, match="key: expected bytes, got list"):
        c.lookup_key([1])  # unhashable
    with pytest.raises(InvalidKeyError, match="key: expected 32 bytes, got 3"):
        c.lookup_key(b"abc")
    with pytest.raises(InvalidKeyError, match="key: expected bytes, got bytearray"):
        c.lookup_key(bytearray(32))
    with pytest.raises(TypeError, match="exactly one positional argument"):
        c.lookup_key()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="exactly one positional argument"):
        c.lookup_key(K[0], K[1])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="exactly one positional argument"):
        c.lookup_key(key=K[0])  # type: ignore[call-arg]
    assert c.counts() == (0, 0)


@native
def test_a_getter_error_that_is_not_a_type_error_propagates() -> None:
    def broken(key: bytes) -> int:
        raise OSError("index unreadable")

    for native_path in (True, False):
        s = single_key_lookup([{}.get, broken], _general, native=native_path)
        with pytest.raises(OSError, match="index unreadable"):
            s.lookup_key(K[0])


@native
def test_only_an_exact_dicts_get_is_probed_directly() -> None:
    class Index(dict):  # a subclass may answer differently from its table
        def get(self, key: Any, default: Any = None) -> Any:
            return 1

    d, sub = {K[0]: 1}, Index()
    assert lookups.probe_source(d.get) is d
    assert lookups.probe_source(sub.get) == sub.get
    assert lookups.probe_source(d.__contains__) == d.__contains__  # a dict's other method: called
    assert single_key_lookup([sub.get], _general, native=True).lookup_key(K[9]) is True
    assert single_key_lookup([d.__contains__], _general, native=True).lookup_key(K[0]) is True


@native
def test_the_manager_takes_the_c_lookup_and_its_counts_are_exact() -> None:
    m = TierManager([TierSpec(name="t", capacity_bytes=400, block_reserve=100, policy=LRUPolicy(4))])
    plan = m.prepare_store([K[0], K[1]])
    assert plan is not None
    m.complete_store(plan.keys)
    assert type(m.lookup_key).__name__ == "KeyProbe" and _is_c_lookup(m.lookup)
    answers = [m.lookup_key(K[0]), m.lookup((K[9],)), m.lookup_key(K[4]), m.lookup_key(K[1]), m.lookup([K[0], K[1]])]
    assert answers == [True, 0, False, True, 2]
    c = m.counters
    assert (c["lookups"], c["lookup_keys"], c["lookup_hits"]) == (5, 6, 4)
    m.close()
    with pytest.raises(lookups.ClosedError):
        m.lookup_key(K[0])


@native
@pytest.mark.parametrize("shape", ["dict.get", "callable"])
def test_no_reference_is_kept_or_lost(shape: str) -> None:
    hit, hit_obj, miss, bad = make_key(100), make_key(102), make_key(101), "k" * 32
    value, obj = 10**30, _Truthy(True)  # values no other code shares: an int, and one asked for its truth
    index = {hit: value, hit_obj: obj}
    c = single_key_lookup(_getters([index], shape), _general, native=True)
    one, lst, bad_list = (hit,), [miss], [bad]  # lookup's tuple and list forms
    watched = (hit, hit_obj, miss, bad, value, obj, index, one, lst, bad_list)
    for _ in range(10_000):  # warm (and any lazily made objects made)
        c.lookup_key(hit)
        c.lookup_key(miss)
    def one_round() -> None:
        c.lookup_key(hit)
        c.lookup_key(hit_obj)
        c.lookup_key(miss)
        c.lookup(one)
        c.lookup(lst)
        with contextlib.suppress(InvalidKeyError):
            c.lookup_key(bad)
        with contextlib.suppress(InvalidKeyError):
            c.lookup(bad_list)

    runs_without_leaks(watched, one_round, 100_000)
    assert c.counts() == (310_000, 210_000)


def test_a_compiler_means_the_extension_is_built() -> None:
    """An install with a C compiler must build the C lookup: a silent fallback would keep every
    manager on the slower closure unnoticed."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if shutil.which(cc) is None or not os.path.exists(header):
        pytest.skip(f"NO C COMPILER ({cc}) OR NO Python.h: kvtier.manager._probe NOT BUILT, the closure runs")
    assert lookups.NATIVE, "kvtier.manager._probe did not build although a C compiler exists (reinstall: pip install -e .)"
    m = TierManager([TierSpec(name="t", capacity_bytes=400, block_reserve=100, policy=LRUPolicy(4))])
    assert type(m.lookup_key).__name__ == "KeyProbe"
    assert type(m._tiers[0].index).__name__ == "KeyIndex", "a stale kvtier.manager._probe (reinstall: pip install -e .)"


def test_without_the_extension_the_closure_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookups, "_probe", None)
    s = single_key_lookup([{K[0]: 1}.get], _general, native=False)
    assert s.lookup_key(K[0]) is True and s.lookup_key(K[1]) is False and s.counts() == (1, 1)
    with pytest.raises(RuntimeError, match="not built"):
        single_key_lookup([{}.get], _general, native=True)
