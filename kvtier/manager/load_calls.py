"""The store facade's load preparation in one call, made once per manager as a closure (as
:mod:`.store_calls` makes the common store's calls).

``KVStore.load`` asks the manager twice for the same keys: ``lookup(keys)`` for the leading run
that is ready, then ``prepare_load`` of that run (without in-load promotion), which finds every
key again before it pins them. For a job of a few blocks the second pass, and the lookup's way
through the one-key closure to the batched path, cost more than the pins: right after a job's
copy has pushed the interpreter's working set out of the caches, each step costs several
microseconds. ``prepare_load_run(keys)`` is the two calls in one: the lookup as the batched
path makes it (the same answer, counters and checks), then, where the manager has one tier and
every key of the run is exactly ``bytes``, the run is pinned at once (the lookup found it ready
there); anything else goes to ``prepare_load``. A test compares the two
(``tests/test_manager_store_paths.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvtier.keys import exact_bytes
from kvtier.manager.admission import Admission
from kvtier.manager.plan import LoadPlan
from kvtier.manager.tiers import TierState

__all__ = ["LoadRunFn", "departures", "load_run", "vanished"]

LoadRunFn = Callable[[Sequence[bytes]], "LoadPlan | None"]
_NONE: frozenset[bytes] = frozenset()


def departures(tiers: Sequence[TierState]) -> list[int]:
    """One cell, shared by ``tiers``, that counts the ready keys that left any of them."""
    cell = [0]
    for t in tiers:
        t.departed = cell
    return cell


def vanished(gets: Sequence[Callable[[bytes], object]], keys: Sequence[bytes], where: Sequence[int]) -> frozenset[bytes]:
    """Of ``keys``, found ready in tiers ``where`` without the manager's lock, those that tier
    no longer holds ready: a shared tier's follower forgot them before the pin. Called under the
    lock as they are pinned (once pinned, nothing forgets them), and only when the tiers'
    :func:`departures` moved since the find; ``gets`` are the tiers' ``index.get``."""
    if len(gets) == 1:
        get = gets[0]
        return _NONE if all(map(get, keys)) else frozenset(key for key in keys if not get(key))
    gone = [key for key, ti in zip(keys, where) if not gets[ti](key)]
    return frozenset(gone) if gone else _NONE


def load_run(
    tiers: Sequence[TierState],
    lock: threading.Lock,
    counts: dict[str, int],
    admission: Admission,
    now: Callable[[], float],
    lookup: Callable[[Sequence[bytes]], int],
    prepare_load: Callable[..., LoadPlan],
) -> LoadRunFn:
    """``prepare_load_run`` over a manager's ``tiers`` (see the module doc): ``lookup`` is its
    batched lookup (it counts, checks the keys and raises once the manager is closed),
    ``prepare_load`` its general method; ``lock``, ``counts``, ``admission`` and ``now`` what
    that method uses to pin."""
    first = tiers[0] if len(tiers) == 1 else None
    get, departed = tiers[0].index.get, tiers[0].departed

    def prepare_load_run(keys: Sequence[bytes]) -> LoadPlan | None:
        seen = departed[0]  # (before the find: see vanished)
        hits = lookup(keys)
        if not hits:
            return None
        run = keys[:hits]
        if first is None or not exact_bytes(run):  # several tiers, or a key to check: the general path
            return prepare_load(list(run), promote=False)
        with lock:  # (a key a follower forgot since the lookup is pinned too: as in prepare_load)
            first.pin(run, now())
            counts["load_prepared"] += hits
            admission.note(run)
            gone = _NONE if departed[0] == seen else vanished((get,), run, ())
        return LoadPlan(tuple(run), (0,) * hits, (), gone)

    return prepare_load_run
