"""Random schedules against the TierManager, checked against a simple model after every step."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.manager import KeyState, TierManager, TierSpec
from kvtier.manager.policies import ARCPolicy, LRUPolicy
from kvtier.testing import make_key

BLOCK = 10
UNIVERSE = [make_key(i) for i in range(8)]
keys_st = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=3)


class ManagerMachine(RuleBasedStateMachine):
    """The model: open plans, pins, and per-tier ready sets rebuilt from the event stream."""

    def __init__(self) -> None:
        super().__init__()
        self.m: TierManager
        self.open: dict[int, set[bytes]] = {}  # plan id -> keys not yet completed
        self.promotions: set[int] = set()  # open plans made by prepare_promote
        # In-load promotions: key -> loads that read it since one began copying it up; the
        # promotion settles when the last of them completes.
        self.load_promoting: dict[bytes, int] = {}
        self.pins: dict[bytes, list[int]] = {}  # key -> tier of each pin
        self.ready: list[set[bytes]] = []  # per tier, from stored / removed events
        self.filters_built: set[int] = set()  # tiers whose index filter was built (KeyIndex)

    @initialize(
        tiers=st.lists(st.integers(1, 4), min_size=1, max_size=2),
        policy=st.sampled_from([LRUPolicy, ARCPolicy]),
        write=st.sampled_from(["back", "through"]),
    )
    def setup(self, tiers: list[int], policy: Any, write: str) -> None:
        specs = [TierSpec(f"t{i}", n * BLOCK, BLOCK, policy(n)) for i, n in enumerate(tiers)]
        self.m = TierManager(specs, write=write)  # type: ignore[arg-type]
        self.ready = [set() for _ in tiers]

    def _apply_events(self) -> None:
        for event in self.m.take_events():
            ti = next(i for i in range(self.m.num_tiers) if self.m.tier_spec(i).name == event.tier)
            if event.kind == "stored":
                assert event.key not in self.ready[ti], "stored twice without a removal"
                self.ready[ti].add(event.key)
            else:
                assert event.key in self.ready[ti], "removed a key that was never stored"
                self.ready[ti].discard(event.key)

    def _pending(self) -> set[bytes]:
        """Keys of open store plans (promotions excluded: their lower copy stays visible)."""
        return set().union(*(ks for pid, ks in self.open.items() if pid not in self.promotions))

    def _promoting(self) -> set[bytes]:
        return set().union(*(self.open[pid] for pid in self.promotions))

    def _check_evictions(self, plan: Any, batch: list[bytes]) -> None:
        evicted: dict[int, set[bytes]] = {}
        for ti, ks in plan.drops:
            evicted.setdefault(ti, set()).update(ks)
        for d in plan.demotions:
            evicted.setdefault(d.src, set()).update(d.keys)
        for ti, ks in evicted.items():
            assert not ks & set(batch), f"a key of the batch was evicted from tier {ti}"
            assert not {k for k in ks if ti in self.pins.get(k, ())}, f"a pinned key was evicted from tier {ti}"

    @rule(keys=keys_st)
    def prepare_store(self, keys: list[bytes]) -> None:
        before = (self.m.stats()["tiers"], [self.m.tier_keys(i) for i in range(self.m.num_tiers)])
        plan = self.m.prepare_store(keys)
        if plan is None:
            after = (self.m.stats()["tiers"], [self.m.tier_keys(i) for i in range(self.m.num_tiers)])
            assert after == before
            assert self.m.take_events() == []
            return
        assert set(plan.keys) | set(plan.skipped) == set(keys)
        assert not set(plan.keys) & (self._pending() | self._promoting())
        self._check_evictions(plan, keys)
        self._apply_events()
        if plan.keys:
            self.open[plan.plan_id] = set(plan.keys)

    @rule(keys=keys_st)
    def prepare_promote(self, keys: list[bytes]) -> None:
        before = (self.m.stats()["tiers"], [self.m.tier_keys(i) for i in range(self.m.num_tiers)])
        # Model: promoted = ready in a lower tier, absent from the first (neither ready nor in
        # any open plan that holds it there).
        in_first = set(self.ready[0]) | self._pending() | self._promoting() | set(self.load_promoting)
        want = {k for k in keys if k not in in_first and any(k in r for r in self.ready[1:])}
        plan = self.m.prepare_promote(keys)
        if plan is None:
            assert want, "refused a promotion with nothing to promote"
            after = (self.m.stats()["tiers"], [self.m.tier_keys(i) for i in range(self.m.num_tiers)])
            assert after == before
            assert self.m.take_events() == []
            return
        assert set(plan.keys) == want and set(plan.skipped) == set(keys) - want
        assert all(keys[p] == k for p, k in zip(plan.positions, plan.keys))
        self._check_evictions(plan, keys)
        self._apply_events()
        for key in plan.keys:  # still served from the lower tier meanwhile
            assert self.m.lookup_detail([key])[0].state is KeyState.READY
        if plan.keys:
            self.open[plan.plan_id] = set(plan.keys)
            self.promotions.add(plan.plan_id)

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), success=st.booleans(), whole=st.booleans(), copies_fail=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool, whole: bool, copies_fail: bool) -> None:
        plan_id = data.draw(st.sampled_from(sorted(self.open)))
        remaining = sorted(self.open[plan_id])
        keys = remaining if whole else [data.draw(st.sampled_from(remaining))]
        # The plan's demoted and written-through copies may fail to be written (dropped then).
        failed = {ti: UNIVERSE for ti in range(1, self.m.num_tiers)} if copies_fail else None
        self.m.complete_store(keys, success, failed=failed)
        self.open[plan_id] -= set(keys)
        promotion = plan_id in self.promotions
        if not self.open[plan_id]:
            del self.open[plan_id]
            self.promotions.discard(plan_id)
        for status in self.m.lookup_detail(keys):
            if success:
                assert (status.state, status.tier) == (KeyState.READY, 0)
            elif promotion:
                # Released from the first tier; the lower copy (unless evicted since) remains.
                assert status.tier != 0
            elif plan_id in self.open:
                # A write-through copy settles with the whole plan; it is never ready before.
                assert status.state in (KeyState.MISS, KeyState.PENDING) and status.tier != 0
            else:
                assert status.state is KeyState.MISS
        self._apply_events()

    @rule()
    def complete_every_plan(self) -> None:
        """Settle everything: without it, full tiers of pending keys rarely let a demotion (and
        so a lower-tier-only key to promote) happen within a schedule."""
        for plan_id in sorted(self.open):
            keys = sorted(self.open.pop(plan_id))
            self.promotions.discard(plan_id)
            self.m.complete_store(keys)
            for status in self.m.lookup_detail(keys):
                assert (status.state, status.tier) == (KeyState.READY, 0)
        self._apply_events()

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=2, max_size=6, unique=True))
    def store_one_by_one(self, keys: list[bytes]) -> None:
        """Store and complete keys one at a time: the steady state of a full first tier, with
        victims demoted (write-back), which is what promotions need."""
        for key in keys:
            self.prepare_store([key])
            self.complete_every_plan()
        self.prepare_promote(keys[:2])  # the oldest: demoted, if the first tier is small

    @rule(keys=keys_st)
    def prepare_load(self, keys: list[bytes]) -> None:
        hits = self.m.lookup(keys)
        if hits == 0:
            return
        plan = self.m.prepare_load(keys[:hits])
        assert set(plan.promote) <= {k for k, ti in zip(plan.keys, plan.tiers) if ti > 0}
        assert not set(plan.promote) & set(self.load_promoting), "a block copied up by two loads at once"
        for key in plan.keys:
            if key in self.load_promoting:
                self.load_promoting[key] += 1
            elif key in plan.promote:
                self.load_promoting[key] = 1
        for key, ti in zip(plan.keys, plan.tiers):
            assert key in self.ready[ti]
            self.pins.setdefault(key, []).append(ti)

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data(), fail=st.booleans())
    def complete_load(self, data: st.DataObject, fail: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.m.complete_load([key], failed_promotions=[key] if fail else [])
        if key in self.load_promoting:
            self.load_promoting[key] -= 1
            if not self.load_promoting[key]:
                del self.load_promoting[key]
            else:  # not settled while another load that reads it is still open
                assert self.m.holds(key, 0) and self.m.status(key).tier != 0
        self.pins[key].pop()
        if not self.pins[key]:
            del self.pins[key]

    @rule(keys=keys_st)
    def touch(self, keys: list[bytes]) -> None:
        self.m.touch(keys)

    @rule(keys=keys_st, data=st.data())
    def remove(self, keys: list[bytes], data: st.DataObject) -> None:
        """A failed read found blocks gone: only ready, unpinned copies in that tier go."""
        tier = data.draw(st.integers(0, self.m.num_tiers - 1))
        self._apply_events()
        expected = [k for k in dict.fromkeys(keys) if k in self.ready[tier] and tier not in self.pins.get(k, ())]
        assert self.m.remove(keys, tier) == expected
        self._apply_events()
        assert not set(expected) & self.ready[tier]

    @rule(keys=keys_st)
    def lookup(self, keys: list[bytes]) -> None:
        hits = self.m.lookup(keys)
        pending = self._pending()
        expected = 0
        for key in keys:
            if key in pending or not any(key in r for r in self.ready):
                break
            expected += 1
        assert hits == expected
        # one key asked as it is: the same answer as the model's for that key
        assert self.m.lookup_key(keys[0]) is (keys[0] not in pending and any(keys[0] in r for r in self.ready))

    @invariant()
    def capacity_is_respected(self) -> None:
        for t in self.m.stats()["tiers"]:
            assert 0 <= t["used_bytes"] <= t["capacity_bytes"]
            assert t["used_bytes"] == t["blocks"] * BLOCK

    @invariant()
    def stats_count_what_the_tiers_hold(self) -> None:
        """stats() keeps running counts (it never walks the index): they must stay exact."""
        for ti, t in enumerate(self.m.stats()["tiers"] if self.ready else []):
            assert t["ready"] == len(self.m.tier_keys(ti)) and t["pending"] == t["blocks"] - t["ready"] >= 0
            assert t["pinned"] == len({k for k, tiers in self.pins.items() if ti in tiers})

    @invariant()
    def pinned_keys_stay_where_they_were_pinned(self) -> None:
        for key, tiers in self.pins.items():
            # A load may also promote the key into the first tier; the pinned copy stays put.
            assert self.m.lookup_detail([key])[0].state is KeyState.READY
            for ti in tiers:
                assert key in self.m.tier_keys(ti)
                assert key in self.ready[ti]

    @invariant()
    def pending_keys_are_invisible(self) -> None:
        for key in self._pending():
            assert self.m.lookup([key]) == 0
            assert self.m.lookup_detail([key])[0].state is KeyState.PENDING

    @invariant()
    def events_match_the_ready_sets(self) -> None:
        if not self.ready:
            return
        self._apply_events()
        for ti in range(self.m.num_tiers):
            assert set(self.m.tier_keys(ti)) == self.ready[ti]

    @invariant()
    def every_index_filter_covers_its_keys(self) -> None:
        """Where the index is the C ``KeyIndex``: once built, every step keeps its filter's counts
        matching the dict with no rebuild (no mutation went past them), and the filter says
        absent only for keys the dict does not hold."""
        for ti, t in enumerate(self.m._tiers if self.ready else []):
            index = t.index
            if not hasattr(index, "filter_state"):  # no extension: a plain dict
                return
            if ti in self.filters_built:
                assert index.filter_state()["synced"]
            for key in UNIVERSE:
                if not index.maybe(key):  # (builds the filter the first time)
                    assert key not in index
            self.filters_built.add(ti)

    @invariant()
    def no_leaked_plans(self) -> None:
        if self.ready:
            assert self.m.stats()["open_plans"] == len(self.open)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=120, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

