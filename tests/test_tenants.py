"""Tenants in the manager: usage per tenant, quotas, operator pins and deletes.

The property test runs random schedules of stores, loads and evictions for several tenants and
checks, after every step, that usage sums to the tiers' totals, that no tenant holds more than
its cap, that no pinned block was evicted, and that no block of a tenant within its reserved
quota was evicted for another tenant.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError, InvalidKeyError, QuotaError
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import ARCPolicy, LRUPolicy
from kvtier.manager.tenants import DEFAULT_TENANT, TenantRules
from kvtier.testing import make_key

BLOCK = 100
POLICY = {"lru": LRUPolicy, "arc": ARCPolicy}


def tier(name: str, blocks: int, policy: str = "lru", **kw: Any) -> TierSpec:
    return TierSpec(name=name, capacity_bytes=blocks * BLOCK, block_reserve=BLOCK, policy=POLICY[policy](blocks), **kw)


def keys(tag: int, n: int) -> list[bytes]:
    return [make_key(tag * 1000 + i) for i in range(n)]


def store(m: TierManager, ks: list[bytes], tenant: str | None = None, *, partial: bool = False) -> int:
    plan = m.prepare_store(ks, tenant=tenant, partial=partial)
    if plan is None:
        return 0
    m.complete_store(plan.keys)
    return len(plan.keys)


def usage(m: TierManager, tier: str = "cpu") -> dict[str, dict[str, int]]:
    return m.tenants.usage()[tier]


def held(m: TierManager, ks: list[bytes], ti: int = 0) -> int:
    return sum(1 for k in ks if m.holds(k, ti))


# -- usage -----------------------------------------------------------------------------------
def test_usage_counts_blocks_bytes_hits_and_evictions_per_tenant() -> None:
    m = TierManager([tier("cpu", 4)])
    a, b = keys(1, 2), keys(2, 3)
    assert store(m, a, "alice") == 2
    assert store(m, b, "bob") == 3  # evicts alice's oldest block
    plan = m.prepare_load(b[:2])
    m.complete_load(plan.keys)
    u = usage(m)
    assert u["alice"] == {"blocks": 1, "bytes": BLOCK, "hits": 0, "evictions": 1, "pinned": 0}
    assert u["bob"] == {"blocks": 3, "bytes": 3 * BLOCK, "hits": 2, "evictions": 0, "pinned": 0}
    assert m.stats()["tenants"]["cpu"] == u


def test_blocks_stored_before_the_first_tenant_are_the_default_tenants() -> None:
    m = TierManager([tier("cpu", 8)])
    store(m, keys(1, 3))
    assert "tenants" not in m.stats()  # nothing is counted per tenant until a tenant is named
    store(m, keys(2, 2), "alice")
    u = usage(m)
    assert u[DEFAULT_TENANT]["blocks"] == 3 and u["alice"]["blocks"] == 2


def test_usage_names_the_top_n_tenants_and_sums_the_rest_as_other() -> None:
    m = TierManager([tier("cpu", 20)], tenants=TenantRules(top_n=2))
    for i, n in enumerate([5, 4, 1, 2]):
        store(m, keys(i + 1, n), f"t{i}")
    u = usage(m)
    assert set(u) == {"t0", "t1", "other"}
    assert u["other"]["blocks"] == 3 and u["other"]["bytes"] == 3 * BLOCK


def test_a_tenant_id_must_be_a_non_empty_string() -> None:
    m = TierManager([tier("cpu", 4)])
    for bad in ("", 7, "x" * 300):
        with pytest.raises(ConfigError, match="tenant"):
            m.prepare_store(keys(1, 1), tenant=bad)  # type: ignore[arg-type]
    assert len(m) == 0


# -- quotas ----------------------------------------------------------------------------------
def test_a_tenant_over_its_cap_evicts_its_own_blocks_first() -> None:
    rules = TenantRules(quotas={"alice": {0: 2 * BLOCK}})
    m = TierManager([tier("cpu", 6)], tenants=rules)
    a, b = keys(1, 4), keys(2, 2)
    store(m, b, "bob")
    assert store(m, a[:2], "alice") == 2
    assert store(m, a[2:], "alice") == 2  # the tier has room, but alice's cap does not
    assert held(m, a) == 2 and held(m, a[2:]) == 2  # her two oldest went
    assert held(m, b) == 2  # bob's blocks were not touched
    assert usage(m)["alice"]["bytes"] == 2 * BLOCK


def test_a_tenant_within_its_reserved_quota_is_not_flushed_by_another() -> None:
    rules = TenantRules(quotas={"chat": {0: 3 * BLOCK}})
    m = TierManager([tier("cpu", 6)], tenants=rules)
    chat = keys(1, 3)
    store(m, chat, "chat")
    for round_ in range(10):  # a batch tenant floods the tier with unique prompts
        store(m, keys(100 + round_, 2), "batch")
    assert held(m, chat) == 3
    assert usage(m)["batch"]["blocks"] == 3  # the unreserved room, used in LRU order


def test_without_quotas_the_flood_evicts_the_other_tenant() -> None:
    m = TierManager([tier("cpu", 6)])
    chat = keys(1, 3)
    store(m, chat, "chat")
    for round_ in range(10):
        store(m, keys(100 + round_, 2), "batch")
    assert held(m, chat) == 0


def test_the_policy_keeps_its_order_within_a_tenant() -> None:
    rules = TenantRules(quotas={"chat": {0: 3 * BLOCK}})
    m = TierManager([tier("cpu", 6)], tenants=rules)
    mine = keys(1, 3)
    store(m, mine, "chat")
    m.touch([mine[0]])  # now mine[1] is chat's least recently used block
    store(m, keys(2, 1), "chat")
    assert [m.holds(k, 0) for k in mine] == [True, False, True]


def test_a_store_that_does_not_fit_under_the_rules_is_a_smaller_store() -> None:
    rules = TenantRules(quotas={"chat": {0: 4 * BLOCK}})
    m = TierManager([tier("cpu", 6)], tenants=rules)
    store(m, keys(1, 4), "chat")
    plan = m.prepare_store(keys(2, 4), tenant="batch", partial=True)
    assert plan is not None and len(plan.keys) == 2  # the unreserved room only
    assert m.prepare_store(keys(3, 4), tenant="batch") is None  # atomic: nothing, and no change
    assert m.counters["store_rejected"] == 1


def test_default_caps_each_unnamed_tenant_without_a_reservation() -> None:
    rules = TenantRules(quotas={DEFAULT_TENANT: {0: 2 * BLOCK}})
    m = TierManager([tier("cpu", 6)], tenants=rules)
    assert store(m, keys(1, 4), "x") == 0  # atomic: more than the cap at once is no store
    assert store(m, keys(1, 4), "x", partial=True) == 2  # the leading run that fits the cap
    assert store(m, keys(2, 4), "y", partial=True) == 2
    u = usage(m)
    assert u["x"]["bytes"] == u["y"]["bytes"] == 2 * BLOCK


def test_quotas_apply_to_lower_tiers_too() -> None:
    rules = TenantRules(quotas={"chat": {1: 2 * BLOCK}})
    m = TierManager([tier("cpu", 2), tier("disk", 4, persistent=True)], write="back", tenants=rules)
    for i in range(4):
        store(m, keys(1 + i, 1), "chat")  # demoted down: at most 2 of chat's blocks below
    assert usage(m, "disk")["chat"]["bytes"] <= 2 * BLOCK


def test_a_quota_can_change_at_runtime() -> None:
    m = TierManager([tier("cpu", 6)])
    store(m, keys(1, 4), "chat")
    m.tenants.set_quota("chat", "cpu", 2 * BLOCK)
    assert usage(m)["chat"]["quota_bytes"] == 2 * BLOCK
    store(m, keys(2, 1), "chat")  # over its new cap: its own oldest blocks go first
    assert usage(m)["chat"]["bytes"] == 2 * BLOCK
    m.tenants.set_quota("chat", 0, None)
    assert "quota_bytes" not in usage(m)["chat"]


def test_bad_quotas_are_refused_and_change_nothing() -> None:
    m = TierManager([tier("cpu", 6)], tenants=TenantRules(quotas={"chat": {0: 3 * BLOCK}}))
    before = m.tenants.rules()
    with pytest.raises(QuotaError, match=r"tenants\.x\.cpu: 700 bytes is larger than the tier \(600 bytes\)"):
        m.tenants.set_quota("x", "cpu", 7 * BLOCK)
    with pytest.raises(QuotaError, match="reserve 700 bytes, more than the tier holds"):
        m.tenants.set_quota("x", "cpu", 4 * BLOCK)
    with pytest.raises(ConfigError, match=r"no tier 'ssd'; the tiers are \['cpu'\]"):
        m.tenants.set_quota("x", "ssd", BLOCK)
    with pytest.raises(ConfigError, match="tenant"):
        m.tenants.set_quota("", "cpu", BLOCK)
    with pytest.raises(ConfigError, match="no such tier"):
        TierManager([tier("cpu", 6)], tenants=TenantRules(quotas={"chat": {3: BLOCK}}))
    assert m.tenants.rules() == before


# -- pins ------------------------------------------------------------------------------------
def test_pinned_blocks_are_never_evicted() -> None:
    m = TierManager([tier("cpu", 4)])
    sys_prompt = keys(1, 2)
    store(m, sys_prompt)
    assert m.tenants.pin(sys_prompt) == 2
    for i in range(10):
        store(m, keys(10 + i, 2))
    assert held(m, sys_prompt) == 2
    assert m.tenants.unpin(sys_prompt) == 2
    store(m, keys(50, 2))
    assert held(m, sys_prompt) == 0


def test_a_pin_over_the_budget_is_refused_and_pins_nothing() -> None:
    m = TierManager([tier("cpu", 8)], tenants=TenantRules(pin_budget={0: 3 * BLOCK}))
    ks = keys(1, 4)
    store(m, ks)
    with pytest.raises(QuotaError, match="over its pin budget of 300 bytes"):
        m.tenants.pin(ks)
    assert m.tenants.pinned("cpu") == []
    assert m.tenants.pin(ks[:3]) == 3
    assert m.tenants.pin(ks[:3]) == 0  # already pinned
    with pytest.raises(QuotaError):
        m.tenants.pin(ks[3:])


def test_pins_skip_keys_not_held_and_reject_bad_keys() -> None:
    m = TierManager([tier("cpu", 4)])
    assert m.tenants.pin(keys(1, 2)) == 0  # a no-op
    with pytest.raises(InvalidKeyError):
        m.tenants.pin([b"short"])
    with pytest.raises(ConfigError, match="no tier"):
        m.tenants.pin(keys(1, 1), tier=5)


def test_pins_hold_in_a_lower_tier() -> None:
    m = TierManager([tier("cpu", 2), tier("disk", 4, persistent=True)], write="through")
    ks = keys(1, 2)
    store(m, ks)
    assert m.tenants.pin(ks, tier="disk") == 2
    for i in range(6):
        store(m, keys(10 + i, 2))
    assert held(m, ks, 1) == 2


# -- deletes ---------------------------------------------------------------------------------
def test_forget_skips_blocks_a_load_reads_and_those_being_written() -> None:
    m = TierManager([tier("cpu", 8)])
    ks = keys(1, 3)
    store(m, ks)
    load = m.prepare_load(ks[:1])
    pending = m.prepare_store(keys(2, 1))
    assert pending is not None
    gone = m.tenants.forget([*ks, *pending.keys, make_key(999_999)])
    assert gone.removed == {0: ks[1:]}
    assert set(gone.busy) == {ks[0], pending.keys[0]}
    m.complete_load(load.keys)
    assert m.tenants.forget(ks).removed == {0: ks[:1]}
    assert [e.kind for e in m.take_events()][-2:] == ["removed", "removed"]


def test_forget_by_tenant_leaves_the_others() -> None:
    m = TierManager([tier("cpu", 8)])
    store(m, keys(1, 2), "alice")
    store(m, keys(2, 3), "bob")
    gone = m.tenants.forget(m.tenants.keys_of("alice"))
    assert gone.keys == set(keys(1, 2))
    assert usage(m)["alice"]["blocks"] == 0 and usage(m)["bob"]["blocks"] == 3
    assert not m._book.owners.keys() & set(keys(1, 2))  # type: ignore[union-attr]


def test_a_deleted_pinned_block_is_unpinned() -> None:
    m = TierManager([tier("cpu", 4)])
    ks = keys(1, 2)
    store(m, ks)
    m.tenants.pin(ks)
    m.tenants.forget(ks[:1])
    assert m.tenants.pinned(0) == ks[1:]
    assert m.stats()["tiers"][0]["kept_bytes"] == BLOCK


# -- the property test -----------------------------------------------------------------------
TENANTS = ["chat", "batch", "x", "y"]
QUOTA = {"chat": 3, "batch": 2}  # blocks, in the first tier; "x" and "y" are capped by default


class Model:
    """The invariants, checked against the manager after each step."""

    def __init__(self, m: TierManager, cap_default: int) -> None:
        self.m = m
        self.cap_default = cap_default

    def check(self) -> None:
        m = self.m
        for ti, t in enumerate(m._tiers):
            assert t.tenancy is not None
            assert sum(t.tenancy.bytes.values()) == t.used
            assert sum(t.tenancy.blocks.values()) == len(t.index)
            assert t.kept_bytes == len(t.kept) * BLOCK <= t.pin_budget
            if ti == 0:
                for tenant, nbytes in t.tenancy.bytes.items():
                    cap = QUOTA.get(tenant, self.cap_default) * BLOCK
                    assert nbytes <= cap, (tenant, nbytes, cap)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(sorted(POLICY)),
    write=st.sampled_from(["back", "through"]),
    steps=st.lists(
        st.tuples(st.sampled_from(["store"] * 4 + ["load", "pin", "unpin", "delete"]), st.sampled_from(TENANTS), st.integers(0, 12), st.integers(1, 4)),
        min_size=1,
        max_size=60,
    ),
)
@example(policy="lru", write="back", steps=[("store", "chat", 0, 3), ("store", "x", 0, 2), ("store", "y", 0, 2)])
def test_quotas_and_pins_hold_under_random_schedules(policy: str, write: str, steps: list[tuple[str, str, int, int]]) -> None:
    cap_default = 2
    rules = TenantRules(
        quotas={**{u: {0: n * BLOCK} for u, n in QUOTA.items()}, DEFAULT_TENANT: {0: cap_default * BLOCK}},
        pin_budget={0: 2 * BLOCK, 1: 2 * BLOCK},
    )
    m = TierManager([tier("cpu", 6, policy), tier("disk", 6, policy, persistent=True)], write=write, tenants=rules)  # type: ignore[arg-type]
    model = Model(m, cap_default)
    owner: dict[bytes, str] = {}
    for op, tenant, start, n in steps:
        ks = [make_key(hash((tenant, i)) & 0xFFFFFFF) for i in range(start, start + n)]
        if op == "store":
            before = {k: m.holds(k, 0) for k in owner}
            first = m._tiers[0]
            assert first.tenancy is not None
            within = {u for u, q in QUOTA.items() if first.tenancy.bytes.get(u, 0) <= q * BLOCK}
            kept = set(first.kept)
            plan = m.prepare_store(ks, tenant=tenant)
            if plan is not None:
                for k in plan.keys:
                    owner.setdefault(k, tenant)
                m.complete_store(plan.keys)
            for k, was in before.items():
                if was and not m.holds(k, 0):  # evicted from the first tier by this store
                    assert k not in kept, "a pinned block was evicted"
                    u = owner[k]
                    assert u == tenant or u not in within, f"{u}'s block evicted for {tenant} within its quota"
        elif op == "load":
            run = m.lookup(ks)
            if run:
                plan = m.prepare_load(ks[:run], promote=False)
                m.complete_load(plan.keys)
        elif op == "pin":
            try:
                m.tenants.pin(ks, tier=0)
            except QuotaError:
                pass
        elif op == "unpin":
            m.tenants.unpin(ks)
        else:
            m.tenants.forget(ks)
        model.check()


def test_a_tiers_tags_are_the_same_whichever_side_is_walked() -> None:
    """``tags`` walks the smaller of the tier's index and its tenants' tags (at open: 10^6
    records, few or no tags); both give the tags of the held keys."""
    few = TierManager([tier("cpu", 10)])
    a, d = keys(1, 3), keys(2, 5)
    store(few, a, "alice")
    store(few, d)
    t = few._tiers[0]
    assert t.tenancy is not None and len(t.tenancy.owners) < len(t.index)
    assert few.tenants.tags(0)[0] == dict.fromkeys(a, "alice")
    every = TierManager([tier("cpu", 4)])
    store(every, a, "alice")
    store(every, keys(3, 2), "bob")  # evicts one of alice's keys
    t = every._tiers[0]
    assert t.tenancy is not None and len(t.tenancy.owners) >= len(t.index)
    assert every.tenants.tags(0)[0] == {k: v for k, v in t.tenancy.owners.items() if k in t.index}
