"""A key that a shared tier's follower forgets while a load is being prepared.

``prepare_load`` (and the store's ``prepare_load_run``) find the keys without the manager's lock
and pin them under it. A follower's thread may ``remove`` a key in between (another engine
deleted it, the server evicted it). The load then pins a key its tier no longer holds and names
that tier in its plan; the read finds the record or not. These tests drive that interleaving
deterministically (the remove runs as the load takes the manager's lock, on the same thread)
and check what follows: the bytes served are exactly the stored ones or a miss, the miss is
counted, no pin outlives the load, and the key stays forgotten until it is stored again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import torch
from test_feed_tiers import file_config, make_caches, rows

import kvtier
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.load_calls import load_run
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key
from kvtier.transfer.jobs import JobResult, apply_result

BLOCK = 100
K = [make_key(i) for i in range(8)]


class _RemoveOnLock:
    """The manager's lock, which runs ``hook`` once just before it is first taken: the moment
    between a load's find and its pin."""

    def __init__(self, real: threading.Lock, hook: Callable[[], None]) -> None:
        self._real = real
        self._hook: Callable[[], None] | None = hook

    def __enter__(self) -> bool:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        return self._real.__enter__()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._real.__exit__(kind, exc, tb)


def _remove_before_pin(monkeypatch: pytest.MonkeyPatch, m: TierManager, hook: Callable[[], None]) -> None:
    """Make both load preparations of ``m`` run ``hook`` between their find and their pin."""
    lock = _RemoveOnLock(m._lock, hook)
    monkeypatch.setattr(m, "_lock", lock)
    monkeypatch.setattr(m, "prepare_load_run", load_run(m._tiers, lock, m._counts, m._admission, m._now, m._lookup_run, m.prepare_load))  # type: ignore[arg-type]


def _manager(tiers: int) -> tuple[TierManager, int]:
    specs = [TierSpec(name="cpu", capacity_bytes=4 * BLOCK, block_reserve=BLOCK, policy=LRUPolicy())] if tiers == 2 else []
    specs.append(TierSpec(name="shared", capacity_bytes=8 * BLOCK, block_reserve=BLOCK, policy=LRUPolicy(), persistent=True))
    m = TierManager(specs, clock=lambda: 1.0)
    shared = len(specs) - 1
    m.adopt(shared, [(key, BLOCK, 0.0) for key in K[:3]])
    return m, shared


@pytest.mark.parametrize("tiers", [1, 2])
@pytest.mark.parametrize("call", ["prepare_load", "prepare_load_run"])
def test_a_key_forgotten_between_find_and_pin_is_a_counted_miss_and_leaves_no_pin(
    monkeypatch: pytest.MonkeyPatch, tiers: int, call: str
) -> None:
    m, shared = _manager(tiers)
    m.take_events()
    removed: list[bytes] = []
    _remove_before_pin(monkeypatch, m, lambda: removed.extend(m.remove([K[1]], shared)))
    plan = m.prepare_load(K[:3]) if call == "prepare_load" else m.prepare_load_run(K[:3])
    assert plan is not None and removed == [K[1]]
    # The plan still names the key in the tier it was found in, pinned there though no
    # longer held: the read decides (the record may still be on the server, or not).
    assert plan.keys == tuple(K[:3]) and plan.tiers == (shared,) * 3
    assert K[1] not in m._tiers[shared].index and m._tiers[shared].pins[K[1]] == 1
    assert m.counters["load_prepared"] == 3
    # The read misses it (the record is gone): the load is its leading run, the pin goes.
    # (as the load mover reports it: a missed key's in-load promotion failed with it)
    failed = {0: (K[1],)} if K[1] in plan.promote else {}
    result = JobResult(1, "load", False, plan.keys, failed=failed, missed=(K[1],), missed_tiers=(shared,))
    applied = apply_result(m, plan, result)
    assert (applied.done, applied.lost) == (1, 2)
    assert applied.removed == ()  # already forgotten by the follower: not forgotten twice
    assert all(not t.pins for t in m._tiers)
    assert m.lookup(K[:3]) == 1
    assert [e.key for e in m.take_events() if e.kind == "removed"] == [K[1]]  # one removed event
    assert all(row["pinned"] == 0 for row in m.stats()["tiers"])
    assert m.stats()["tiers"][shared]["blocks"] == 2
    if tiers == 2 and call == "prepare_load":  # its in-load promotion of the key was released
        assert plan.promote and K[1] in plan.promote and not m.holds(K[1], 0)
    # Stored again, the key is ready and loads like any other.
    assert m.prepare_store([K[1]]) is not None
    m.complete_store([K[1]], True)
    assert m.lookup(K[:3]) == 3


def _engine_rows(caches: list[torch.Tensor], ids: range) -> list[list[torch.Tensor]]:
    return [rows(caches, i) for i in ids]


@pytest.mark.parametrize("record_gone", [True, False])
async def test_a_store_load_racing_a_followers_remove_serves_the_stored_bytes_or_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_gone: bool
) -> None:
    """Through a store on a shared ``file`` tier: the follower forgets ``K[1]`` (its record
    deleted by another engine, or still there) as the load pins it."""
    caches = make_caches(5)
    async with kvtier.open(file_config(tmp_path, caches), kv_caches=caches) as store:
        assert await store.save(K[:3], [0, 1, 2]) == 3
        stored = _engine_rows(caches, range(3))
        mgr: Any = store.manager
        backend: Any = store.backends[0]

        def follower() -> None:
            if record_gone:
                backend.delete_blocks([K[1]])
            assert mgr.remove([K[1]], 0) == [K[1]]

        _remove_before_pin(monkeypatch, mgr, follower)
        got = await store.load(K[:3], [4, 5, 6])
        after = _engine_rows(caches, range(4, 7))
        if record_gone:
            assert got == 1
            assert all(torch.equal(a, b) for a, b in zip(after[0], stored[0]))
            assert store.metrics.snapshot()["tiers"][0]["misses"] == 1
        else:  # the record was still there: exactly its bytes
            assert got == 3
            assert all(torch.equal(a, b) for r, s in zip(after, stored) for a, b in zip(r, s))
        assert store.stats()["tiers"][0]["pinned"] == 0
        assert await store.lookup(K[:3]) == 1  # forgotten until stored again
        assert await store.save(K[1:2], [1]) == 1
        assert await store.lookup(K[:3]) == 3
        assert await store.load(K[:3], [4, 5, 6]) == 3
        assert all(torch.equal(a, b) for r, s in zip(_engine_rows(caches, range(4, 7)), stored) for a, b in zip(r, s))


@pytest.mark.parametrize(("tiers", "call"), [(1, "prepare_load"), (1, "prepare_load_run"), (2, "prepare_load_run")])
@pytest.mark.parametrize("again", ["stored", "adopted"])
def test_a_key_stored_again_while_its_vanished_load_is_in_flight_stays_held_after_the_miss(
    monkeypatch: pytest.MonkeyPatch, tiers: int, call: str, again: str
) -> None:
    """The follower forgets ``K[1]`` as the load pins it; while the load reads (and misses its
    old record), this engine stores the key again (write-through, so the shared tier holds the
    new copy too) or the follower adopts another engine's new record. The load's miss says
    nothing about that new copy: it stays held, ready and loadable, with no removed event."""
    m, shared = _manager(tiers)
    if tiers == 2:  # write-through: the store puts the new copy in the shared tier as well
        m = TierManager([m.tier_spec(0), m.tier_spec(1)], write="through", clock=lambda: 1.0)
        m.adopt(shared, [(key, BLOCK, 0.0) for key in K[:3]])
    _remove_before_pin(monkeypatch, m, lambda: m.remove([K[1]], shared))
    plan = m.prepare_load(K[:3]) if call == "prepare_load" else m.prepare_load_run(K[:3])
    assert plan is not None and plan.tiers == (shared,) * 3
    m.take_events()
    if again == "stored":
        store = m.prepare_store([K[1]])
        assert store is not None and store.keys == (K[1],)
        m.complete_store([K[1]], True)
    else:
        assert m.adopt_live(shared, [(K[1], BLOCK, 2.0)]) == [K[1]]
    assert m.lookup(K[:3]) == 3 and m.holds(K[1], shared)
    before = m.counters
    result = JobResult(1, "load", False, plan.keys, missed=(K[1],), missed_tiers=(shared,))
    applied = apply_result(m, plan, result)
    assert m.counters == before  # settling a load counts nothing: its miss is the tier's to count
    assert (applied.done, applied.lost, applied.removed) == (1, 2, ())
    assert all(not t.pins for t in m._tiers)
    assert m.lookup(K[:3]) == 3 and m.holds(K[1], shared) and m.status(K[1]).state.value == "ready"
    assert [e for e in m.take_events() if e.kind == "removed"] == []
    assert m.stats()["tiers"][shared]["blocks"] == 3
    assert plan.vanished == {K[1]}  # the plan named it: forgotten before its pin
    again_plan = m.prepare_load(K[:3], promote=False)
    assert again_plan.vanished == frozenset() and again_plan.keys == tuple(K[:3])
    m.complete_load(again_plan.keys)


async def test_a_save_while_a_vanished_load_is_in_flight_keeps_the_new_record_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a store on a shared ``file`` tier: the follower forgets ``K[1]`` and another
    engine deletes its record as the load pins it; the read misses; before the load's result is
    applied, this engine saves ``K[1]`` again (a real store job). The new copy stays indexed and
    loads with exactly the stored bytes; the miss is counted once."""
    caches = make_caches(6)
    async with kvtier.open(file_config(tmp_path, caches), kv_caches=caches) as store:
        assert await store.save(K[:3], [0, 1, 2]) == 3
        stored = _engine_rows(caches, range(3))
        mgr: Any = store.manager
        backend: Any = store.backends[0]
        runs: Any = store._runs
        real_finish = runs.finish_load
        saved: list[int] = []

        def follower() -> None:
            backend.delete_blocks([K[1]])
            assert mgr.remove([K[1]], 0) == [K[1]]

        def save_then_finish(plan: Any, result: JobResult) -> Any:
            if not saved:  # the read has missed K[1]: this engine stores it again meanwhile
                again = mgr.prepare_store([K[1]])
                assert again is not None and again.keys == (K[1],)
                transfers = store._xfer()
                job = transfers.submit_store(again, [1], checked=True)
                (done,) = transfers.wait([job])
                transfers.forget([job])
                assert done.error is None
                saved.append(store.finish_store(again, done))
            return real_finish(plan, result)

        _remove_before_pin(monkeypatch, mgr, follower)
        monkeypatch.setattr(runs, "finish_load", save_then_finish)
        assert await store.load(K[:3], [4, 5, 6]) == 1
        assert saved == [1]
        assert store.metrics.snapshot()["tiers"][0]["misses"] == 1
        assert store.stats()["tiers"][0]["pinned"] == 0
        assert await store.lookup(K[:3]) == 3  # the new copy is held
        assert await store.load(K[:3], [4, 5, 6]) == 3
        assert all(torch.equal(a, b) for r, s in zip(_engine_rows(caches, range(4, 7)), stored) for a, b in zip(r, s))
        assert store.metrics.snapshot()["tiers"][0]["misses"] == 1


@pytest.mark.parametrize("call", ["prepare_load", "prepare_load_run"])
@pytest.mark.parametrize("how", ["remove", "tenant_forget", "adopt_live_evicts", "store_evicts", "tenant_quota_evicts", "other_key", "nothing"])
def test_a_plans_vanished_keys_are_exactly_those_gone_at_the_pin_whatever_made_them_leave(
    monkeypatch: pytest.MonkeyPatch, call: str, how: str
) -> None:
    """A load looks again only when a ready key left a tier between its find and its pin (the
    tiers' shared departure count moved): each way a ready key leaves moves it, and the plan's
    ``vanished`` is then exactly the keys of the load no longer ready at the pin (none when
    nothing left, or only a key outside the load)."""
    m, shared = _manager(1)
    m.adopt(shared, [(key, BLOCK, 0.0) for key in K[3:5]])  # K[:5] held; the load is K[:3]
    m.touch(K[1:5])  # K[0] is the least recent: the one an eviction takes
    if how == "tenant_quota_evicts":  # quotas on: the tier evicts through its tenants' path
        m.tenants.set_quota("t", shared, 2 * BLOCK)
        assert m._tiers[shared].quotas_apply()
    before = m._departed[0]

    def leave() -> None:
        if how == "remove":
            m.remove([K[1]], shared)
        elif how == "tenant_forget":
            m.tenants.forget([K[2]])
        elif how == "adopt_live_evicts":  # a full tier: the follower's adoption forgets the least recent
            m.adopt_live(shared, [(make_key(100 + i), BLOCK, 1.0) for i in range(4)])
        elif how == "other_key":
            m.remove([K[4]], shared)
        elif how in ("store_evicts", "tenant_quota_evicts"):  # the tier full: a store evicts
            plan = m.prepare_store([make_key(200 + i) for i in range(4)])
            assert plan is not None and plan.drops
            m.complete_store(plan.keys, True)

    _remove_before_pin(monkeypatch, m, leave)
    plan = m.prepare_load(K[:3]) if call == "prepare_load" else m.prepare_load_run(K[:3])
    assert plan is not None and plan.keys == tuple(K[:3])
    gone_now = [k for k in K[:3] if k not in m._tiers[shared].index]  # (pinned now: nothing else goes)
    assert plan.vanished == frozenset(gone_now)
    if how in ("remove", "tenant_forget", "adopt_live_evicts", "store_evicts", "tenant_quota_evicts"):
        assert gone_now and m._departed[0] > before  # the case did make a key of the load leave
    elif how == "other_key":
        assert not gone_now and m._departed[0] == before + 1
    elif how == "nothing":
        assert not gone_now and m._departed[0] == before
    m.complete_load(plan.keys)
