"""The tier manager's lookups of one key, and the lookup counters.

An engine's scheduler asks for blocks one at a time, every step, for every waiting request:
``lookup((key,))`` is the manager's hottest call, and at a fraction of a microsecond its cost
is the interpreter's, not the dictionary's. :func:`single_key_lookup` builds that call as a
closure over the tiers' index getters, made once per manager: no attribute lookups, no method
binding, the counters in closure cells. Anything but exactly one key goes to the general path
the manager hands in, which answers, counts and validates the same way (a test compares the
two). ``lookup_key(key)`` is the same question for a caller that holds one key (vLLM's
scheduler asks ``lookup(key, ...)``): building and unpacking the one-key tuple costs such a
caller about 55 ns of a 210 ns call, so it has a closure of its own, with the same answers,
counts and checks.

Counters: batched calls are counted as three fields of one int (calls, keys asked, keys found,
:func:`lookup_counts`), single-key calls as hits and misses apart. Every lookup changes exactly
one of the three and they only grow, so a reader on another thread that sees the same three
values twice in a row has seen one moment (:func:`read_counters`).

A single-key call counts by taking one item from a countdown (``itertools.repeat`` of a huge
count, read back with ``operator.length_hint``): ``next`` changes a C integer in place, where
``hits += 1`` on a closure cell builds a new int object once the count passes 256 and frees the
old one, about 15 ns more per call. The countdown would run out after ``sys.maxsize`` calls
(2**63 - 1 on the 64-bit builds kvtier runs on: centuries at any lookup rate).

``lookup_key`` in C: where the package's extension ``kvtier.manager._probe`` is built (at
install, where a C compiler exists; :data:`NATIVE`), ``lookup_key`` is its ``KeyProbe``, which
does what the closure does with no interpreter between the call and the dict (and its
``lookup`` method is ``lookup`` for a tuple or list of one key, handing anything else, and a key
it would refuse, to the closure, which answers, counts and raises as without it): a getter that is
the bound ``get`` of an exact ``dict`` (every tier's index) is probed directly
(``PyDict_GetItemWithError``, then the value's truthiness), any other getter is called; hits
and misses are C integers, added to the closures' counts by ``counts``; a malformed key raises
through :func:`bad_key` and a closed manager through :func:`_closed`, so the errors are the
same objects' errors. Without the extension the closure runs, with the same answers, counts
and errors (a test compares the two).

The index: every tier's index is made by :func:`new_index`, the extension's ``KeyIndex`` where it
is built (a ``dict`` subclass whose reads are dict's own, keeping a membership filter through
every mutation, checked against the dict's version tag), else a plain ``dict``. ``KeyProbe``
consults the filter while misses are common and answers most misses from it, with no hash and no
dict probe; the filter never says absent for a key the dict holds, so the answers, counts and
errors are the same either way (``tests/test_key_index.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from itertools import filterfalse, repeat
from operator import length_hint
from typing import Any, NoReturn

from kvtier.errors import ClosedError, InvalidKeyError
from kvtier.keys import KEY_BYTES, check_keys

try:
    import kvtier.manager._probe as _probe  # type: ignore[import-not-found]
except ImportError:  # built without a C compiler: the closures below
    _probe = None

__all__ = [
    "NATIVE",
    "assign_keys",
    "KeyLookupFn",
    "LookupFn",
    "SingleKeyLookup",
    "leading_run",
    "lookup_counts",
    "native_module",
    "new_index",
    "probe_source",
    "read_counters",
    "reserve_keys",
    "single_key_lookup",
]

LookupFn = Callable[[Sequence[bytes]], int]
KeyLookupFn = Callable[[bytes], bool]
Getter = Callable[[bytes], "int | None"]

_FIELD = 64
_MASK = (1 << _FIELD) - 1
_READS = 8  # a reader's tries for two equal readings (then it takes the last)
_COUNTDOWN = sys.maxsize  # a single-key counter's start: calls counted = start - items left
_ALL_READY = object()  # leading_run's "no key missing" (a key itself may be anything)
_DICT_GET: type = type({}.get)  # a builtin method: a dict's bound ``get`` is one

#: Whether ``lookup_key`` runs in C (the extension ``kvtier.manager._probe`` is built).
NATIVE: bool = _probe is not None
#: The tiers' index type: the C ``KeyIndex`` (a dict that keeps a membership filter) where the
#: extension is built, else ``dict`` (also where an extension built before it is still installed:
#: a test fails on that, the import does not).
_INDEX: type = getattr(_probe, "KeyIndex", dict)


def native_module() -> Any:
    """The extension ``kvtier.manager._probe``; ``RuntimeError`` where it is not built (a caller
    asked for a native path that :data:`NATIVE` says is absent)."""
    if _probe is None:
        raise RuntimeError("kvtier.manager._probe is not built: no native path")
    return _probe


def new_index(ready_table: bool = False) -> dict[bytes, int]:
    """An empty index for one tier: a ``dict`` in every respect, and where the extension is built
    one whose membership filter lets ``lookup_key`` answer most misses without a dict probe.
    ``ready_table``: it also keeps a table of its ready keys, which a hit reads in one cache line
    where the dict takes two (27-53 bytes a key: for a tier whose blocks are in memory, not for
    a disk tier's index of millions of records)."""
    index: dict[bytes, int] = _INDEX()
    if ready_table and hasattr(index, "keep_ready"):
        index.keep_ready()
    return index


#: The native index type, whose ``reserve`` and ``assign`` set a batch's items in one C loop;
#: ``None`` where the extension is not built or was built before them. Its own name, not
#: :data:`_INDEX`: an index of any other type (a plain ``dict``) takes the Python loops.
_SET_MANY: type | None = _INDEX if hasattr(_INDEX, "reserve") and hasattr(_INDEX, "assign") else None


def reserve_keys(index: dict[bytes, int], keys: Sequence[bytes], value: int) -> bool:
    """``index[key] = value`` for each of ``keys`` in order, stopping at the first key that is
    not exactly ``bytes`` of the key length: whether it set every key (those before a bad one
    stay set). One C loop for a list or tuple on the native index, else a Python one."""
    if type(index) is _SET_MANY and (type(keys) is list or type(keys) is tuple):
        return bool(index.reserve(keys, value, KEY_BYTES))  # type: ignore[attr-defined]
    for key in keys:
        if type(key) is not bytes or len(key) != KEY_BYTES:
            return False
        index[key] = value
    return True


def assign_keys(index: dict[bytes, int], keys: Iterable[bytes], value: int) -> None:
    """``index[key] = value`` for each of ``keys`` in order (as :func:`reserve_keys`, no check)."""
    if type(index) is _SET_MANY and (type(keys) is list or type(keys) is tuple):
        index.assign(keys, value)  # type: ignore[attr-defined]
        return
    for key in keys:
        index[key] = value


def lookup_counts(calls: int, asked: int, found: int) -> int:
    """One batched lookup's counts packed into one int (add it to the running total)."""
    return calls | asked << _FIELD | found << 2 * _FIELD


def leading_run(gets: Sequence[Getter], keys: Sequence[bytes]) -> int:
    """Length of the leading run of ``keys`` ready in some tier, ``gets`` the tiers' index
    getters (fastest first). Keys are not checked (the caller checks them on a short run); an
    unhashable one raises ``TypeError``. In one tier the run is found in C: the first key not
    ready (``filterfalse``), then, in a list or tuple, its place (``index``: the first key
    equal to it, which is that one, since equal keys are equally ready); any other collection
    takes the loop. A test compares it with the loop."""
    if len(gets) == 1:
        missing = next(filterfalse(gets[0], keys), _ALL_READY)
        if missing is _ALL_READY:
            return len(keys)
        if type(keys) is tuple or type(keys) is list:
            return keys.index(missing)
    hits = 0
    for key in keys:
        for get in gets:
            if get(key):
                break
        else:
            break
        hits += 1
    return hits


def closed_error() -> ClosedError:
    return ClosedError("the tier manager is closed")


def _closed(key: object) -> int | None:
    """The index getter of a closed manager."""
    raise closed_error()


def bad_key(key: object) -> NoReturn:
    """Raise :class:`InvalidKeyError` naming what is wrong with ``key`` (one key, not a sequence)."""
    if type(key) is not bytes:
        raise InvalidKeyError(f"key: expected bytes, got {type(key).__name__}")
    raise InvalidKeyError(f"key: expected {KEY_BYTES} bytes, got {len(key)}")


class SingleKeyLookup:
    """The closures' handles: ``lookup`` and ``lookup_key`` (the calls), ``counts`` (single-key
    hits and misses so far, of both) and ``close`` (every later call raises :class:`ClosedError`)."""

    __slots__ = ("close", "counts", "lookup", "lookup_key")

    def __init__(
        self,
        lookup: LookupFn,
        lookup_key: KeyLookupFn,
        counts: Callable[[], tuple[int, int]],
        close: Callable[[], None],
    ) -> None:
        self.lookup = lookup
        self.lookup_key = lookup_key
        self.counts = counts
        self.close = close


def probe_source(get: Getter) -> Any:
    """What the C lookup probes for the getter ``get``: the dict itself where ``get`` is the
    bound ``get`` of an exact ``dict`` or of the index type (the same answers, no call), else
    ``get``."""
    owner = getattr(get, "__self__", None)
    if type(get) is _DICT_GET and isinstance(owner, dict) and type(owner) in (dict, _INDEX) and get == owner.get:
        return owner
    return get


def single_key_lookup(gets: Sequence[Getter], general: LookupFn, *, native: bool = NATIVE) -> SingleKeyLookup:
    """``lookup`` over the tiers whose index getters are ``gets`` (fastest first; a getter
    answers truthy for a ready key): one key is answered here, any other input by ``general``;
    and ``lookup_key``, the same answer for one key passed as it is: in C where ``native``
    (the default where the extension is built), else a closure.

    A miss checks its key's type and length (``check_keys`` names what is wrong); a hit does
    not need to: a key found was checked when it was stored."""
    hits, misses = repeat(None, _COUNTDOWN), repeat(None, _COUNTDOWN)  # see the module's note
    tiers: tuple[Getter, ...] = tuple(gets)
    first: Getter = tiers[0]

    def one_tier(keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` ready in the tier (see ``TierManager.lookup``)."""
        try:
            (key,) = keys
        except (TypeError, ValueError):  # not one key
            return general(keys)
        try:
            if first(key):
                next(hits)
                return 1
        except TypeError:  # an unhashable key: check_keys names it
            check_keys(keys)
        if type(key) is not bytes or len(key) != KEY_BYTES:
            check_keys(keys)
        next(misses)
        return 0

    def any_tier(keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` ready in some tier (see ``TierManager.lookup``)."""
        try:
            (key,) = keys
        except (TypeError, ValueError):  # not one key
            return general(keys)
        try:
            for get in tiers:
                if get(key):
                    next(hits)
                    return 1
        except TypeError:  # an unhashable key: check_keys names it
            check_keys(keys)
        if type(key) is not bytes or len(key) != KEY_BYTES:
            check_keys(keys)
        next(misses)
        return 0

    def one_tier_key(key: bytes) -> bool:
        """Whether ``key`` is ready in the tier: ``one_tier((key,)) == 1``, without the tuple."""
        try:
            if first(key):
                next(hits)
                return True
        except TypeError:  # unhashable: not a key
            bad_key(key)
        if type(key) is not bytes or len(key) != KEY_BYTES:
            bad_key(key)
        next(misses)
        return False

    def any_tier_key(key: bytes) -> bool:
        """Whether ``key`` is ready in some tier: ``any_tier((key,)) == 1``, without the tuple."""
        try:
            for get in tiers:
                if get(key):
                    next(hits)
                    return True
        except TypeError:  # unhashable: not a key
            bad_key(key)
        if type(key) is not bytes or len(key) != KEY_BYTES:
            bad_key(key)
        next(misses)
        return False

    def counts() -> tuple[int, int]:
        return _COUNTDOWN - length_hint(hits), _COUNTDOWN - length_hint(misses)

    def close() -> None:
        nonlocal first, tiers
        first, tiers = _closed, (_closed,)

    lookup, lookup_key = (one_tier, one_tier_key) if len(tiers) == 1 else (any_tier, any_tier_key)
    if not native:
        return SingleKeyLookup(lookup, lookup_key, counts, close)
    if _probe is None:
        raise RuntimeError("native: kvtier.manager._probe is not built (no C compiler at install)")
    probe = _probe.KeyProbe(tuple(map(probe_source, tiers)), KEY_BYTES, bad_key, _closed, lookup)
    probe_counts = probe.counts

    def both_counts() -> tuple[int, int]:
        (h, m), (ph, pm) = counts(), probe_counts()
        return h + ph, m + pm

    def close_both() -> None:
        close()
        probe.close()

    return SingleKeyLookup(probe.lookup, probe, both_counts, close_both)


def read_counters(packed: Callable[[], int], single: Callable[[], tuple[int, int]]) -> tuple[int, int, int]:
    """(calls, keys asked, keys found) at one moment, read without stopping lookups: ``packed``
    reads the batched calls' int, ``single`` the single-key hits and misses."""
    seen = (packed(), *single())
    for _ in range(_READS):
        again = (packed(), *single())
        if again == seen:
            break
        seen = again
    total, hits, misses = seen
    ones = hits + misses
    return (total & _MASK) + ones, (total >> _FIELD & _MASK) + ones, (total >> 2 * _FIELD) + hits
