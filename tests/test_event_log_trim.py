"""The event log trims once its slack past the bound is used, not at every add: every reader
(``take``, ``len``, ``dropped``) sees what a trim at every add would have left."""

from __future__ import annotations

import random

import pytest

from kvtier.manager.eventlog import EventLog
from kvtier.testing import make_key

K = [make_key(i) for i in range(400)]


class _EveryAdd(EventLog):
    """The log as it was: a trim at every add past the bound."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self._slack = 0


@pytest.mark.parametrize("limit", [1, 15, 16, 40, 100, 333])
def test_readers_see_what_a_trim_at_every_add_leaves(limit: int) -> None:
    rng = random.Random(limit)
    lazy, eager = EventLog(limit), _EveryAdd(limit)
    for _ in range(1500):
        roll = rng.random()
        if roll < 0.8:
            start = rng.randrange(len(K))
            batch = tuple(K[start : start + rng.randrange(0, 40)])
            kind = rng.choice(("stored", "removed"))
            lazy.add(kind, batch, "cpu")
            eager.add(kind, batch, "cpu")
        elif roll < 0.87:
            assert lazy.take() == eager.take()
        elif roll < 0.94:
            assert len(lazy) == len(eager) <= limit
        else:
            assert lazy.dropped == eager.dropped
    assert (lazy.dropped, len(lazy), lazy.take()) == (eager.dropped, len(eager), eager.take())


def test_a_log_at_its_bound_trims_once_per_slack() -> None:
    """At its bound, a log of 160 keeps up to 10 events more and trims them together; an add
    that fits the slack trims nothing."""
    log = EventLog(160)
    log.add("stored", tuple(K[:160]), "cpu")
    trims = 0
    trim = log._trim

    def counted() -> None:
        nonlocal trims
        trims += 1
        trim()

    log._trim = counted  # type: ignore[method-assign]
    for i in range(100):
        log.add("stored", (K[160 + i],), "cpu")
    assert trims == 9  # every 11th add: past 160 + 10
    assert log._count <= 170
    assert len(log) == 160 and log.dropped == 100 and trims == 10
    assert [e.key for e in log.take()] == K[100:260]
