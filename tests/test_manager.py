"""TierManager scenarios, each run for every eviction policy."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvtier.errors import ClosedError, ConfigError, InvalidKeyError, LifecycleError
from kvtier.keys import check_keys
from kvtier.manager import CacheEvent, Demotion, KeyState, KeyStatus, TierManager, TierSpec
from kvtier.manager.policies import ARCPolicy, LRUPolicy
from kvtier.testing import make_key

BLOCK = 100
K = [make_key(i) for i in range(64)]
POLICY = {"lru": LRUPolicy, "arc": ARCPolicy}


@pytest.fixture(params=sorted(POLICY))
def policy_name(request: pytest.FixtureRequest) -> str:
    return request.param


def tier(name: str, blocks: int, policy: str, **kw: Any) -> TierSpec:
    return TierSpec(name=name, capacity_bytes=blocks * BLOCK, block_reserve=BLOCK, policy=POLICY[policy](blocks), **kw)


def one_tier(policy: str, blocks: int = 4, **kw: Any) -> TierManager:
    return TierManager([tier("cpu", blocks, policy, **kw)])


def two_tiers(policy: str, fast: int = 2, slow: int = 3, write: str = "back") -> TierManager:
    return TierManager([tier("cpu", fast, policy), tier("disk", slow, policy, persistent=True)], write=write)  # type: ignore[arg-type]


def store(m: TierManager, keys: list[bytes], success: bool = True) -> Any:
    plan = m.prepare_store(keys)
    assert plan is not None
    m.complete_store(plan.keys, success)
    return plan


def snapshot(m: TierManager) -> Any:
    """Everything observable about the manager except monotonic counters."""
    keys = K
    return (
        m.stats()["tiers"],
        [m.tier_keys(i) for i in range(m.num_tiers)],
        [s for s in m.lookup_detail(keys)],
        [(kind, tuple(keys), tier) for kind, keys, tier in m._events._batches],
        m._events._skip,
        copy.deepcopy({ti: (dict(t.index), dict(t.pins)) for ti, t in enumerate(m._tiers)}),
    )


def used(m: TierManager, ti: int = 0) -> int:
    return m.stats()["tiers"][ti]["used_bytes"]


# -- single tier ------------------------------------------------------------------------------
def test_eviction_order(policy_name: str) -> None:
    m = one_tier(policy_name, 3)
    for key in K[:3]:
        store(m, [key])
    assert m.tier_keys(0) == K[:3]
    m.take_events()
    plan = store(m, [K[3]])
    assert plan.drops == ((0, (K[0],)),)
    assert m.take_events() == [CacheEvent("removed", K[0], "cpu"), CacheEvent("stored", K[3], "cpu")]
    assert m.lookup([K[0]]) == 0 and m.lookup(K[1:4]) == 3
    assert m.tier_keys(0) == K[1:4]
    assert used(m) == 3 * BLOCK


def test_pending_keys_are_invisible(policy_name: str) -> None:
    m = one_tier(policy_name)
    store(m, [K[0]])
    plan = m.prepare_store([K[1], K[2]])
    assert plan is not None and plan.keys == (K[1], K[2])
    assert m.lookup([K[1]]) == 0
    m.complete_store([K[2]])
    # A pending key ends the run even though the keys around it are ready.
    assert m.lookup([K[0], K[1], K[2]]) == 1
    assert m.lookup([K[2]]) == 1
    detail = m.lookup_detail([K[0], K[1], K[9]])
    assert [d.state for d in detail] == [KeyState.READY, KeyState.PENDING, KeyState.MISS]
    assert [d.tier for d in detail] == [0, 0, None]
    # Pending keys cannot be loaded, and a second store of them is skipped.
    with pytest.raises(LifecycleError, match="not ready"):
        m.prepare_load([K[1]])
    again = m.prepare_store([K[1]])
    assert again is not None and again.empty and again.skipped == (K[1],)
    m.complete_store([K[1]])
    assert m.lookup([K[0], K[1], K[2]]) == 3


def test_events_only_after_complete_store(policy_name: str) -> None:
    m = one_tier(policy_name)
    plan = m.prepare_store([K[0], K[1]])
    assert plan is not None
    assert m.take_events() == []
    m.complete_store([K[1]])
    assert m.take_events() == [CacheEvent("stored", K[1], "cpu")]
    m.complete_store([K[0]], success=False)
    assert m.take_events() == []
    assert m.take_events() == []


def test_failed_store_frees_its_slots(policy_name: str) -> None:
    m = one_tier(policy_name, 2)
    plan = m.prepare_store([K[0], K[1]])
    assert plan is not None and used(m) == 2 * BLOCK
    m.complete_store(plan.keys, success=False)
    assert used(m) == 0 and len(m) == 0
    assert m.lookup_detail([K[0]])[0].state is KeyState.MISS
    assert m.stats()["store_failed"] == 2
    # The room is really free: a full batch fits again without evicting anything.
    plan = store(m, [K[2], K[3]])
    assert plan.drops == () and m.lookup([K[2], K[3]]) == 2
    assert m.stats()["open_plans"] == 0


def test_rejected_store_changes_nothing(policy_name: str) -> None:
    m = one_tier(policy_name, 3)
    for key in K[:3]:
        store(m, [key])
    m.touch([K[0]])
    m.prepare_load([K[0], K[1]])
    before = snapshot(m)
    # Two new blocks need two victims but only one key is unpinned.
    assert m.prepare_store([K[5], K[6]]) is None
    # A batch larger than the tier can never fit.
    assert m.prepare_store(K[10:14]) is None
    assert snapshot(m) == before
    assert m.stats()["store_rejected"] == 2
    assert m.stats()["open_plans"] == 0


def test_batch_keys_and_pinned_keys_are_never_evicted(policy_name: str) -> None:
    m = one_tier(policy_name, 4)
    for key in K[:4]:
        store(m, [key])
    m.prepare_load([K[0]])
    plan = m.prepare_store([K[4], K[5]])
    assert plan is not None
    dropped = set(plan.drops[0][1])
    assert dropped == {K[1], K[2]}
    assert m.lookup([K[0]]) == 1
    # The pending keys of a batch are not victims for the next batch either.
    assert m.prepare_store([K[6], K[7], K[8]]) is None
    m.complete_store(plan.keys)
    # A batch with a present key skips it, and never evicts its own new keys.
    plan2 = m.prepare_store([K[4], K[9], K[10]])
    assert plan2 is not None and plan2.skipped == (K[4],) and plan2.positions == (1, 2)
    assert K[4] not in set(plan2.drops[0][1]) and K[0] not in set(plan2.drops[0][1])
    m.complete_store(plan2.keys)
    assert m.lookup([K[0], K[4], K[9], K[10]]) == 4


def test_batch_larger_than_room_is_rejected_not_self_evicting(policy_name: str) -> None:
    m = one_tier(policy_name, 2)
    assert m.prepare_store(K[:3]) is None
    assert len(m) == 0


def test_touch_reorders(policy_name: str) -> None:
    m = one_tier(policy_name, 3)
    for key in K[:3]:
        store(m, [key])
    m.touch([K[0], K[9]])
    plan = store(m, [K[3]])
    assert plan.drops == ((0, (K[1],)),)
    assert m.lookup([K[0]]) == 1


def test_prepare_load_pins_until_complete_load(policy_name: str) -> None:
    m = one_tier(policy_name, 2)
    store(m, [K[0], K[1]])
    load = m.prepare_load([K[0], K[0]])  # two pins on one key
    assert load.keys == (K[0], K[0]) and load.tiers == (0, 0)
    assert m.stats()["tiers"][0]["pinned"] == 1
    m.complete_load([K[0]])
    assert m.prepare_store([K[2], K[3]]) is None  # still pinned once
    m.complete_load([K[0]])
    with pytest.raises(LifecycleError, match="not pinned"):
        m.complete_load([K[0]])
    assert m.prepare_store([K[2], K[3]]) is not None


def test_complete_store_of_unknown_keys_changes_nothing(policy_name: str) -> None:
    m = one_tier(policy_name)
    store(m, [K[0]])
    plan = m.prepare_store([K[1]])
    assert plan is not None
    before = snapshot(m)
    with pytest.raises(LifecycleError, match=r"keys\[1\]"):
        m.complete_store([K[1], K[7]])
    with pytest.raises(LifecycleError, match=r"keys\[0\]"):
        m.complete_store([K[0]])  # already complete
    assert snapshot(m) == before
    m.complete_store([K[1]])
    with pytest.raises(LifecycleError):
        m.complete_store([K[1]])


def test_complete_load_of_unpinned_keys_changes_nothing(policy_name: str) -> None:
    m = one_tier(policy_name)
    store(m, [K[0], K[1]])
    m.prepare_load([K[0]])
    before = snapshot(m)
    with pytest.raises(LifecycleError, match=r"keys\[1\]"):
        m.complete_load([K[0], K[1]])
    with pytest.raises(LifecycleError, match=r"keys\[1\]"):
        m.complete_load([K[0], K[0]])  # one pin, two unpins
    with pytest.raises(LifecycleError):
        m.complete_load([K[5]])
    assert snapshot(m) == before


@pytest.mark.parametrize("bad", [[b"short"], [K[0], b"\x00" * 33], ["x" * 32], K[0]])
def test_bad_keys_raise_before_any_change(policy_name: str, bad: Any) -> None:
    m = one_tier(policy_name, 2)
    store(m, [K[0]])
    m.prepare_load([K[0]])
    before = snapshot(m)
    calls = [
        m.lookup,
        m.lookup_detail,
        m.prepare_store,
        m.complete_store,
        m.prepare_load,
        m.complete_load,
        m.touch,
        lambda keys: m.remove(keys, 0),
    ]
    for call in calls:
        with pytest.raises(InvalidKeyError):
            call(bad)
    assert snapshot(m) == before


def test_remove_forgets_ready_unpinned_keys(policy_name: str) -> None:
    m = one_tier(policy_name)
    store(m, [K[0], K[1], K[2]])
    m.prepare_load([K[1]])
    m.take_events()
    assert m.remove([K[0], K[1], K[9]], 0) == [K[0]]
    assert m.take_events() == [CacheEvent("removed", K[0], "cpu")]
    assert m.lookup([K[0]]) == 0 and m.lookup([K[1]]) == 1
    assert used(m) == 2 * BLOCK


# -- two tiers ---------------------------------------------------------------------------------
def test_write_back_demotes_victims(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=2, slow=2)
    store(m, [K[0], K[1]])
    m.take_events()
    plan = m.prepare_store([K[2]])
    assert plan is not None
    assert plan.demotions == (Demotion(0, 1, (K[0],)),)
    assert plan.drops == ()
    # The demoted key is pending in tier 1 until the plan completes.
    assert m.lookup_detail([K[0]])[0].state is KeyState.PENDING
    assert m.lookup([K[0]]) == 0
    assert m.take_events() == [CacheEvent("removed", K[0], "cpu")]
    m.complete_store([K[2]])
    status = m.lookup_detail([K[0], K[2]])
    assert (status[0].state, status[0].tier) == (KeyState.READY, 1)
    assert (status[1].state, status[1].tier) == (KeyState.READY, 0)
    assert m.take_events() == [CacheEvent("stored", K[2], "cpu"), CacheEvent("stored", K[0], "disk")]
    store(m, [K[3]])  # demotes K[1]; tier 1 now full with K[0], K[1]
    assert m.tier_keys(1) == [K[0], K[1]]
    m.take_events()
    plan = m.prepare_store([K[4]])  # demotes K[2] into tier 1, whose victim K[0] is dropped
    assert plan is not None
    assert plan.demotions == (Demotion(0, 1, (K[2],)),)
    assert plan.drops == ((1, (K[0],)),)
    events = m.take_events()
    assert CacheEvent("removed", K[0], "disk") in events
    m.complete_store([K[4]])
    assert m.lookup([K[0]]) == 0
    assert set(m.tier_keys(1)) == {K[1], K[2]} and set(m.tier_keys(0)) == {K[3], K[4]}
    for ti in (0, 1):
        assert used(m, ti) == 2 * BLOCK
    load = m.prepare_load([K[3], K[1]])
    assert load.tiers == (0, 1)
    m.complete_load(load.keys)


def test_demotion_failure_drops_the_key(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=1, slow=2)
    store(m, [K[0]])
    plan = m.prepare_store([K[1]])
    assert plan is not None and plan.demotions == (Demotion(0, 1, (K[0],)),)
    m.complete_store([K[1]], failed={1: [K[0]]})
    assert m.lookup([K[0]]) == 0 and m.lookup([K[1]]) == 1
    assert used(m, 1) == 0
    assert m.stats()["tiers"][1]["dropped"] == 1


def test_demotions_complete_with_the_last_key_of_the_plan(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=2, slow=4)
    store(m, [K[0], K[1]])
    plan = m.prepare_store([K[2], K[3]])
    assert plan is not None and plan.demotions == (Demotion(0, 1, (K[0], K[1])),)
    m.complete_store([K[2]])
    assert m.lookup_detail([K[0]])[0].state is KeyState.PENDING
    m.complete_store([K[3]], success=False)
    assert m.lookup([K[0], K[1]]) == 2
    assert m.lookup([K[3]]) == 0


def test_write_through_keeps_keys_in_both_tiers(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=2, slow=4, write="through")
    plan = m.prepare_store([K[0], K[1]])
    assert plan is not None and plan.write_through == ((1, (K[0], K[1])),)
    assert [s.state for s in m.lookup_detail(plan.keys)] == [KeyState.PENDING] * 2
    m.complete_store(plan.keys)
    assert set(m.tier_keys(0)) == set(m.tier_keys(1)) == {K[0], K[1]}
    assert {(e.key, e.tier) for e in m.take_events()} == {(K[0], "cpu"), (K[1], "cpu"), (K[0], "disk"), (K[1], "disk")}
    plan = m.prepare_store([K[2]])  # evicting K[0] from tier 0 is a drop: tier 1 still has it
    assert plan is not None and plan.drops == ((0, (K[0],)),) and plan.demotions == ()
    m.complete_store([K[2]])
    status = m.lookup_detail([K[0]])[0]
    assert (status.state, status.tier) == (KeyState.READY, 1)
    # A failed write-through store leaves the key in neither tier.
    plan = m.prepare_store([K[5]])
    assert plan is not None
    m.complete_store([K[5]], success=False)
    assert m.lookup_detail([K[5]])[0].state is KeyState.MISS
    assert used(m, 1) == 3 * BLOCK


def test_variable_size_tier_accounting(policy_name: str) -> None:
    m = one_tier(policy_name, 3, variable_size=True)
    for i in range(4):
        plan = m.prepare_store([K[i]])
        assert plan is not None and plan.drops == ()
        assert used(m) == i * 40 + BLOCK
        m.complete_store([K[i]], sizes={0: {K[i]: 40}})
        assert used(m) == (i + 1) * 40
    # Two new blocks reserve 200 bytes: 360 > 300, so 60 bytes must go: two 40-byte victims.
    plan = m.prepare_store([K[4], K[5]])
    assert plan is not None and plan.drops == ((0, (K[0], K[1])),)
    assert used(m) == 2 * 40 + 2 * BLOCK
    m.complete_store(plan.keys, sizes={0: {K[4]: 10, K[5]: 90}})
    assert used(m) == 2 * 40 + 10 + 90


def test_variable_size_rejection_keeps_the_order(policy_name: str) -> None:
    m = one_tier(policy_name, 3, variable_size=True)
    for i in range(4):
        plan = m.prepare_store([K[i]])
        assert plan is not None
        m.complete_store([K[i]], sizes={0: {K[i]: 40}})
    m.prepare_load([K[1], K[2], K[3]])
    before = snapshot(m)
    before_p = getattr(m.tier_spec(0).policy, "p", None)
    # 60 bytes must go, but K[0] alone frees only 40 and every other key is pinned.
    assert m.prepare_store([K[4], K[5]]) is None
    assert snapshot(m) == before
    assert getattr(m.tier_spec(0).policy, "p", None) == before_p


def test_adopt_orders_by_stamp_and_returns_excess(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=2, slow=3)
    records = [(K[0], BLOCK, 5.0), (K[1], BLOCK, 1.0), (K[2], BLOCK, 3.0), (K[3], BLOCK, 4.0)]
    excess = m.adopt(1, records)
    assert excess == [K[1]]
    assert m.tier_keys(1) == [K[2], K[3], K[0]]
    assert used(m, 1) == 3 * BLOCK
    assert m.lookup([K[2], K[3], K[0]]) == 3 and m.lookup([K[1]]) == 0


def test_adopt_of_records_that_all_fit_equals_the_record_by_record_path(policy_name: str) -> None:
    """A store's open adopts every record in one batch when they fit and none is held; the same
    records with one listed twice take the record-by-record path. Both end in the same state."""
    stamps = [7.0, 2.0, 9.0, 1.0, 5.0, 3.0, 8.0, 4.0]
    records = [(K[i], BLOCK, s) for i, s in enumerate(stamps)]
    batch, each = two_tiers(policy_name, fast=2, slow=10), two_tiers(policy_name, fast=2, slow=10)
    assert batch.adopt(1, records) == []
    assert each.adopt(1, [*records, (K[2], BLOCK, 9.0)]) == [K[2]]  # the repeat is not adopted twice
    assert snapshot(batch) == snapshot(each)
    assert batch.tier_keys(1) == [K[i] for i in sorted(range(8), key=stamps.__getitem__)]
    assert used(batch, 1) == used(each, 1) == 8 * BLOCK
    assert batch.tier_spec(1).policy.order() == each.tier_spec(1).policy.order()
    # A key already held is never adopted again (its place in the order stays).
    assert batch.adopt(1, [(K[3], BLOCK, 99.0), (K[20], BLOCK, 0.5)]) == [K[3]]
    assert batch.lookup([K[20]]) == 1 and used(batch, 1) == 9 * BLOCK


def test_persistent_tier_records_stamps() -> None:
    now = [100.0]
    m = TierManager([tier("cpu", 1, "lru"), tier("disk", 4, "lru", persistent=True)], clock=lambda: now[0])
    store(m, [K[0]])
    store(m, [K[1]])  # K[0] demoted to the persistent tier, stamped at completion
    assert m.take_stamps(1) == [(K[0], 100.0)]
    now[0] = 200.0
    m.touch([K[0]])
    assert m.take_stamps(1) == [(K[0], 200.0)]
    assert m.take_stamps(1) == []
    assert m.take_stamps(0) == []


def test_calls_after_close_raise(policy_name: str) -> None:
    m = one_tier(policy_name)
    store(m, [K[0]])
    m.close()
    for call in (m.lookup, m.lookup_detail, m.prepare_store, m.complete_store, m.prepare_load, m.complete_load, m.touch):
        with pytest.raises(ClosedError):
            call([K[0]])
    with pytest.raises(ClosedError):
        m.remove([K[0]], 0)


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="tiers"):
        TierManager([])
    with pytest.raises(ConfigError, match="unique"):
        TierManager([tier("a", 1, "lru"), tier("a", 1, "lru")])
    with pytest.raises(ConfigError, match="write"):
        TierManager([tier("a", 1, "lru")], write="sideways")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="below one block"):
        TierSpec(name="a", capacity_bytes=BLOCK - 1, block_reserve=BLOCK, policy=LRUPolicy())


def test_event_buffer_is_bounded() -> None:
    m = TierManager([tier("cpu", 8, "lru")], max_events=3)
    store(m, K[:5])
    assert [e.key for e in m.take_events()] == K[2:5]
    assert m.stats()["events_dropped"] == 2


def test_a_big_batch_at_the_head_of_the_event_log_is_trimmed_without_copies() -> None:
    """Events past the bound drop the oldest keys of the head batch by skipping them: a copy of
    the rest at every trim made each store cost the big batch's length."""
    from kvtier.manager.eventlog import EventLog

    log = EventLog(limit=40)
    big = tuple(K[:40])
    log.add("stored", big, "cpu")
    for i in range(3):
        log.add("removed", (K[40 + 2 * i], K[41 + 2 * i]), "cpu")
        assert log._batches[0][1] is big  # the head batch is the one recorded, not a copy
    assert len(log) == 40 and log.dropped == 6
    events = log.take()
    assert [(e.kind, e.key) for e in events] == [("stored", k) for k in K[6:40]] + [("removed", k) for k in K[40:46]]
    log.add("stored", (K[50],), "cpu")  # a fresh log after take: nothing skipped
    assert [e.key for e in log.take()] == [K[50]]


def test_a_skipped_key_in_a_lower_tier_is_not_evicted_by_its_own_batch(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=1, slow=1)
    store(m, [K[0]])
    store(m, [K[1]])  # K[0] demoted to tier 1
    plan = m.prepare_store([K[2], K[0]])
    assert plan is not None and plan.skipped == (K[0],)
    # Tier 1 holds only K[0], which this batch asked to keep: K[1] is dropped instead.
    assert plan.demotions == () and plan.drops == ((0, (K[1],)),)
    m.complete_store(plan.keys)
    assert m.lookup([K[2], K[0]]) == 2


def test_prepare_promote_evicts_like_a_store_and_keeps_the_lower_copy_readable(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=2, slow=4)
    store(m, [K[0], K[1]])
    store(m, [K[2], K[3]])  # K0, K1 demoted
    assert [s.tier for s in m.lookup_detail(K[:4])] == [1, 1, 0, 0]
    m.take_events()
    # K2 is in the first tier already, K9 nowhere: both skipped (and K2 protected as batch).
    plan = m.prepare_promote([K[2], K[0], K[9]])
    assert plan is not None
    assert plan.keys == (K[0],) and plan.positions == (1,) and set(plan.skipped) == {K[2], K[9]}
    assert plan.demotions == (Demotion(0, 1, (K[3],)),)
    # Pending in the first tier, still served from the lower one meanwhile.
    assert m.lookup([K[0]]) == 1 and m.status(K[0]) == KeyStatus(KeyState.READY, 1)
    assert m.prepare_promote([K[0]]) == type(plan)(plan.plan_id + 1, (), (), skipped=(K[0],))
    m.complete_store(plan.keys)
    assert [s.tier for s in m.lookup_detail(K[:4])] == [0, 1, 0, 1]
    assert m.holds(K[0], 1)  # the lower copy stays: evicting the promoted one just drops it
    assert m.counters["promotions"] == 1 and m.counters["store_completed"] == 4
    assert m.stats()["tiers"][1]["promotions"] == 1
    assert ("stored", K[0], "cpu") in [(e.kind, e.key, e.tier) for e in m.take_events()]
    m.touch([K[2]])
    plan = m.prepare_store([K[5]])  # the promoted copy is the victim: dropped, no write-back
    assert plan is not None and plan.drops == ((0, (K[0],)),) and plan.demotions == ()
    assert m.status(K[0]) == KeyStatus(KeyState.READY, 1)


def test_prepare_promote_is_atomic_and_a_failed_promotion_leaves_the_lower_copy(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=2, slow=4)
    store(m, [K[0], K[1]])
    store(m, [K[2], K[3]])
    m.prepare_load([K[2]], promote=False)
    m.prepare_load([K[3]], promote=False)
    before = (m.stats(), [m.tier_keys(i) for i in range(2)])
    m.take_events()
    assert m.prepare_promote([K[0]]) is None  # every first-tier key is pinned
    assert (m.stats()["tiers"], [m.tier_keys(i) for i in range(2)]) == (before[0]["tiers"], before[1])
    assert m.take_events() == [] and m.counters["promotions_rejected"] == 1
    m.complete_load([K[2], K[3]])
    plan = m.prepare_promote([K[0], K[1]])
    assert plan is not None and plan.keys == (K[0], K[1])
    m.complete_store(plan.keys, failed={0: [K[1]]})
    assert [s.tier for s in m.lookup_detail([K[0], K[1]])] == [0, 1]
    assert (m.counters["promotions"], m.counters["promotions_failed"]) == (1, 1)
    assert m.counters["store_failed"] == 0


def test_in_load_promotion_settles_only_with_the_load_that_copies_it(policy_name: str) -> None:
    """Two loads read a block from the lower tier; the first one also copies it up. If the
    second completed first, the block became ready in the first tier before its bytes were
    written there (a later load would have read garbage), and the copier's failure was lost."""
    m = two_tiers(policy_name, fast=4, slow=4)
    store(m, [K[0], K[1], K[2], K[3]])
    store(m, [K[4], K[5]])  # K0, K1 demoted; two slots of the first tier free again after...
    m.remove([K[2], K[3]], 0)  # ...these are dropped (say, found corrupt)
    assert m.status(K[0]) == KeyStatus(KeyState.READY, 1)
    copier = m.prepare_load([K[0], K[1]])
    assert copier.promote == (K[0], K[1])
    reader = m.prepare_load([K[0], K[1]])
    assert reader.promote == () and reader.tiers == (1, 1)
    m.complete_load(reader.keys)
    # The copier has not finished: both are still served from the lower tier.
    assert [m.status(k) for k in (K[0], K[1])] == [KeyStatus(KeyState.READY, 1)] * 2
    assert m.holds(K[0], 0) and m.stats()["tiers"][0]["pending"] == 2
    m.complete_load(copier.keys, failed_promotions=[K[1]])
    assert m.status(K[0]) == KeyStatus(KeyState.READY, 0)
    assert m.status(K[1]) == KeyStatus(KeyState.READY, 1) and not m.holds(K[1], 0)
    assert (m.counters["promotions"], m.counters["promotions_failed"]) == (1, 1)
    assert m.stats()["tiers"][0]["pending"] == 0 and m.stats()["tiers"][1]["pinned"] == 0


def test_remove_names_each_key_once(policy_name: str) -> None:
    """A repeated key was returned (and announced removed) twice: a router counting events saw
    a key leave a tier twice. Found by the state machine's ``remove`` rule."""
    m = one_tier(policy_name)
    store(m, [K[0], K[1]])
    m.take_events()
    assert m.remove([K[0], K[0], K[1], K[0]], 0) == [K[0], K[1]]
    assert m.take_events() == [CacheEvent("removed", K[0], "cpu"), CacheEvent("removed", K[1], "cpu")]
    assert used(m) == 0 and m.stats()["tiers"][0]["blocks"] == 0


def test_one_complete_store_call_may_span_plans(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=4, slow=4)
    store(m, [K[0], K[1], K[2], K[3]])
    first = m.prepare_store([K[4], K[5]])  # demotes K0, K1
    second = m.prepare_store([K[6], K[7]])  # demotes K2, K3
    assert first is not None and second is not None
    m.complete_store([K[4], K[6], K[5]])  # all of the first plan, half of the second
    assert [m.status(k).tier for k in K[:4]] == [1, 1, 1, 1]
    assert [m.status(k).state for k in K[:4]] == [KeyState.READY] * 2 + [KeyState.PENDING] * 2
    assert m.stats()["open_plans"] == 1
    m.complete_store([K[7]])
    assert m.lookup(K[:8]) == 8 and m.stats()["open_plans"] == 0


# -- the single-key lookup path against the general one -----------------------------------------
class _BytesLike(bytes):
    """A bytes subclass: not a valid key type, though it hashes like one."""


SINGLE_INPUTS: list[Any] = [
    (K[0],),  # ready in the first tier
    [K[2]],  # ready only in the second tier
    (K[4],),  # pending
    (K[9],),  # absent
    {K[0]},  # any sized collection
    {K[9]: None},
    (K[9][:31],),  # too short
    (bytearray(K[9]),),  # unhashable
    (_BytesLike(K[9]),),  # wrong type
    (K[9].hex(),),
    (7,),
    b"x",  # a bytes object is not a sequence of keys
    "x",
    (None,),
]


def _outcome(call: Any, keys: Any) -> tuple[Any, ...]:
    try:
        return ("value", call(keys))
    except Exception as exc:  # the error must match too: type and message
        return ("error", type(exc), str(exc))


@pytest.mark.parametrize("keys", SINGLE_INPUTS, ids=repr)
def test_single_key_lookup_matches_the_general_path(policy_name: str, keys: Any) -> None:
    """One key takes its own fast path through ``lookup``; the answer, the error and the
    counters are those of the general path over the same input."""
    pair = []
    for _ in range(2):
        m = two_tiers(policy_name, fast=2, slow=4)
        store(m, [K[2], K[3]])
        store(m, [K[0], K[1]])  # K[2], K[3] demoted to the second tier
        assert m.prepare_store([K[4]]) is not None  # pending
        pair.append(m)
    fast, general = pair
    assert fast.status(K[2]).tier == 1 and fast.status(K[4]).state is KeyState.PENDING
    got = _outcome(fast.lookup, keys)
    want = _outcome(general._lookup_run, keys)
    assert got == want
    assert fast.counters == general.counters
    assert got[0] == "error" or fast.counters["lookups"] == 1


TOUCH_INPUTS: list[Any] = [
    [K[0], K[1]],  # ready in the first tier
    (K[2], K[0]),  # one ready only in the second tier
    [K[4]],  # pending
    [K[0], K[9]],  # one absent
    [K[0], K[0]],  # a repeat
    [],
    [K[0], K[9][:31]],  # too short
    [K[0], bytearray(K[9])],  # unhashable
    [K[0], _BytesLike(K[0])],  # wrong type, equal to a stored key
    [K[0], K[9].hex()],
    b"x" * 32,  # a bytes object is not a sequence of keys
    "x",
    [None],
]


@pytest.mark.parametrize("keys", TOUCH_INPUTS, ids=repr)
def test_touch_validated_by_finding_matches_a_checked_touch(policy_name: str, keys: Any) -> None:
    """``touch`` checks its keys only when one is not ready in any one tier; the answer, the
    error and the order it leaves are those of a touch that checks every call first."""
    outcomes = []
    for checked in (False, True):
        m = two_tiers(policy_name, fast=2, slow=4)
        store(m, [K[2], K[3]])
        store(m, [K[0], K[1]])  # K[2], K[3] demoted to the second tier
        assert m.prepare_store([K[4]]) is not None  # pending

        def touch(ks: Any, m: TierManager = m, checked: bool = checked) -> None:
            if checked:
                check_keys(ks)
            m.touch(ks)

        outcome = _outcome(touch, keys)
        outcomes.append((outcome, [m.tier_keys(i) for i in range(m.num_tiers)]))
    assert outcomes[0] == outcomes[1]


def test_touch_changes_nothing_before_it_raises(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=3, slow=4)
    store(m, [K[0], K[1], K[2]])
    before = m.tier_keys(0)
    with pytest.raises(InvalidKeyError, match=r"keys\[1\]"):
        m.touch([K[0], K[9][:31]])
    assert m.tier_keys(0) == before
    m.touch([K[0]])
    assert m.tier_keys(0) == [K[1], K[2], K[0]]


def test_lookup_counters_read_at_one_moment_while_lookups_run(policy_name: str) -> None:
    """Single-key lookups count apart from batched ones, without a lock; a reader on another
    thread still sees counters that agree with each other and only grow."""
    import threading

    m = one_tier(policy_name)
    store(m, [K[0]])
    stop = threading.Event()

    def lookups() -> None:
        while not stop.is_set():
            m.lookup([K[0]])
            m.lookup([K[9]])
            m.lookup([K[0], K[9]])

    worker = threading.Thread(target=lookups)
    worker.start()
    try:
        last = (0, 0, 0)
        for _ in range(2000):
            c = m.counters
            now = (c["lookups"], c["lookup_keys"], c["lookup_hits"])
            assert all(a >= b for a, b in zip(now, last)) and now[2] <= now[1]
            last = now
    finally:
        stop.set()
        worker.join()
    c = m.counters
    calls = c["lookups"]
    assert calls % 3 == 0 and c["lookup_keys"] == calls // 3 * 4 and c["lookup_hits"] == calls // 3 * 2


def test_single_key_lookup_counts_like_a_batch() -> None:
    m = one_tier("lru")
    store(m, [K[0]])
    assert [m.lookup((K[0],)), m.lookup([K[1]]), m.lookup([K[0], K[1]]), m.lookup([])] == [1, 0, 1, 0]
    c = m.counters
    assert (c["lookups"], c["lookup_keys"], c["lookup_hits"]) == (4, 4, 2)


def test_partial_store_reserves_the_leading_run_that_fits(policy_name: str) -> None:
    m = one_tier(policy_name, blocks=4)
    store(m, K[:2])
    m.prepare_load(K[:1])  # pinned: 3 slots can be made
    assert m.prepare_store(K[10:16]) is None  # atomic by default: no change
    assert m.counters["store_partial"] == 0
    plan = m.prepare_store([K[0], *K[10:16]], partial=True)
    assert plan is not None
    assert plan.keys == tuple(K[10:13]) and plan.positions == (1, 2, 3) and plan.skipped == (K[0],)
    assert m.counters["store_partial"] == 1
    m.complete_store(plan.keys)
    assert m.lookup(K[10:16]) == 3 and m.lookup(K[:1]) == 1
    m.complete_load(K[:1])


def test_partial_store_counts_a_use_only_of_the_keys_it_covers(policy_name: str) -> None:
    """A key left out of a partial plan is counted as seen when a later call stores it, once."""
    m = TierManager([tier("fast", 2, policy_name), tier("slow", 8, policy_name, admit_after=2)], write="through")
    plan = m.prepare_store(K[:4], partial=True)
    assert plan is not None and plan.keys == tuple(K[:2])
    m.complete_store(plan.keys)
    plan = m.prepare_store(K[2:4], partial=True)
    assert plan is not None and plan.keys == tuple(K[2:4])
    assert plan.write_through == ()  # seen once: the slow tier does not admit them yet


def _state(m: TierManager) -> Any:
    """Everything a completion can change, comparable between two managers."""
    tiers = [
        (dict(t.index), dict(t.pins), t.policy.order(), t.used, t.pending, t.dropped) for t in m._tiers
    ]
    plans = {pid: (p.remaining, p.demoted, p.through) for pid, p in m._plans._plans.items()}
    return tiers, plans, dict(m._plans._plan_of), m.counters


# complete_store inputs, against two open plans (K[0:3] and K[3:5], write-through to the second
# tier) and a ready key (K[9]).
COMPLETE_INPUTS: list[Any] = [
    [K[0], K[1], K[2]],  # one whole plan: the common call
    (K[3], K[4]),  # a tuple
    [K[1]],  # part of a plan
    [K[2], K[3]],  # two plans, neither finished
    [K[0], K[1], K[2], K[3], K[4]],  # two whole plans
    [K[0], K[0], K[1]],  # a repeat
    [K[0], K[9]],  # a ready key: never prepared here
    [K[0], K[20]],  # never seen
    [K[0], bytearray(K[1])],  # unhashable
    [K[0], "x"],
    [],
    [K[2], K[1], K[0]],  # another order
]


@pytest.mark.parametrize("success", [True, False])
@pytest.mark.parametrize("keys", COMPLETE_INPUTS, ids=repr)
def test_complete_store_fast_path_matches_the_general_path(policy_name: str, keys: Any, success: bool) -> None:
    """Distinct keys of open plans are taken out of the book in one pass (``PlanBook.take``);
    the state, events, counters and errors after ``complete_store`` are those of the general
    path (``take`` disabled) on the same input."""
    outcomes = []
    for fast in (True, False):
        m = TierManager([tier("fast", 8, policy_name), tier("slow", 8, policy_name)], write="through")
        store(m, [K[9]])
        m.take_events()
        assert m.prepare_store(K[0:3]) is not None and m.prepare_store(K[3:5]) is not None
        if not fast:
            m._plans.take = lambda keys: None  # type: ignore[method-assign]
        given = copy.copy(keys)
        outcome = _outcome(lambda ks, m=m: m.complete_store(ks, success, failed={1: [K[1]]}), given)
        if isinstance(given, list):
            given.clear()  # the caller reuses its list: what was recorded must not change
        outcomes.append((outcome, _state(m), m.take_events()))
    assert outcomes[0] == outcomes[1]
    outcome, (_, _, plan_of, _), events = outcomes[0]
    if outcome[0] != "error" and keys:
        assert all(k not in plan_of for k in keys) and any(e.kind == "stored" for e in events) == success


# -- a pending copy is not a copy ---------------------------------------------------------------
@pytest.mark.parametrize("copy_fails", ["whole_plan", "that_key"])
def test_a_key_whose_copy_below_is_pending_is_never_evicted_without_one(policy_name: str, copy_fails: str) -> None:
    """A key completed ahead of its plan is ready in the first tier while its write-through
    copy below is still pending. Evicting it then must not count on that copy: if the copy
    fails, the key would be in no tier. It stays until the copy settles, then goes as usual
    (demoted when the copy failed, dropped when it landed)."""
    m = two_tiers(policy_name, fast=2, slow=4, write="through")
    plan = m.prepare_store([K[0], K[1]])
    assert plan is not None and plan.write_through == ((1, (K[0], K[1])),)
    m.complete_store([K[0]])  # part of the plan: K[0] ready above, its copy below still pending
    assert m.lookup_detail([K[0]])[0] == KeyStatus(KeyState.READY, 0)
    # The first tier holds K[0] (ready) and K[1] (pending): K[0] is the only candidate victim.
    assert m.prepare_store([K[2]]) is None
    assert m.prepare_store([K[2]], partial=True) is None
    if copy_fails == "whole_plan":
        m.complete_store([K[1]], success=False)
    else:
        m.complete_store([K[1]], failed={1: [K[0]]})
    assert m.lookup_detail([K[0]])[0] == KeyStatus(KeyState.READY, 0)
    assert not m.holds(K[0], 1)
    # Settled: K[0] may go now, and goes below (write-back fallback), since it has no copy there.
    plan = m.prepare_store([K[2], K[3]] if copy_fails == "whole_plan" else [K[2]])
    assert plan is not None and plan.demotions == (Demotion(0, 1, (K[0],)),)
    m.complete_store(plan.keys)
    assert m.lookup([K[0]]) == 1


def test_a_key_whose_pending_copy_lands_is_dropped_from_the_first_tier_afterwards(policy_name: str) -> None:
    m = two_tiers(policy_name, fast=2, slow=4, write="through")
    plan = m.prepare_store([K[0], K[1]])
    assert plan is not None
    m.complete_store([K[0]])
    assert m.prepare_store([K[2]]) is None  # K[0]'s copy below is only pending
    m.complete_store([K[1]])
    plan = m.prepare_store([K[2]])
    assert plan is not None and plan.drops == ((0, (K[0],)),) and plan.demotions == ()
    m.complete_store(plan.keys)
    assert m.lookup_detail([K[0]])[0] == KeyStatus(KeyState.READY, 1)
