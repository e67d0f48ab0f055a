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

__all__ = ["LoadRunFn", "load_run"]

LoadRunFn = Callable[[Sequence[bytes]], "LoadPlan | None"]


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

    def prepare_load_run(keys: Sequence[bytes]) -> LoadPlan | None:
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
        return LoadPlan(tuple(run), (0,) * hits)

    return prepare_load_run
