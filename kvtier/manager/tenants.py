"""Tenants in the manager: who owns each block, usage per tenant per tier, and quotas.

Every block belongs to one tenant: the one named by the store that first put it in a tier (an
engine's cache salt, the ``tenant=`` argument of the store facade), or :data:`DEFAULT_TENANT`
when none was named. :class:`TenantBook` holds the owner of each block (only blocks of a named
tenant take an entry) and one :class:`TierTenancy` per tier, which counts blocks, bytes, hits
and evictions per tenant and keeps the tier's quotas.

Quotas, per tier, in bytes (:class:`TenantRules`):

* a tenant named in ``quotas`` has that much of the tier *reserved*: it never holds more (a
  store over its cap evicts its own blocks first, in the policy's order), and no other tenant's
  store evicts its blocks while it holds no more than its quota;
* the ``default`` entry caps every other tenant (those not named), without a reservation: their
  blocks, and those of a named tenant above its quota (after a quota was lowered), are what
  another tenant's store may evict, in the policy's order;
* a tier without quotas behaves exactly as without tenants.

The policy keeps its order within each tenant: a victim is always the first block of the
policy's order among those the rules let go. Nothing here fails a store: a store that finds no
room under the rules gets a smaller plan, or none, as when a tier is full.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from kvtier.errors import ConfigError, QuotaError

__all__ = ["DEFAULT_TENANT", "TenantBook", "TenantRules", "TierTenancy", "check_tenant"]

#: The tenant of blocks stored without one, and the quota entry for tenants not named.
DEFAULT_TENANT = "default"
#: Longest tenant id accepted (a cache salt may be long; ids are kept per block).
MAX_TENANT_LEN = 256


def check_tenant(tenant: object, *, what: str = "tenant") -> str:
    """``tenant`` if it is a valid tenant id (a non-empty string of at most 256 characters)."""
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_LEN:
        raise ConfigError(f"{what}: expected a non-empty string of at most {MAX_TENANT_LEN} characters, got {tenant!r}")
    return tenant


@dataclass(frozen=True, slots=True)
class TenantRules:
    """Quotas and pin budgets, by tier index.

    ``quotas[tenant][tier]`` is the tenant's byte cap (and reservation) in that tier; the entry
    :data:`DEFAULT_TENANT` caps each tenant not named, without a reservation.
    ``pin_budget[tier]`` bounds the bytes pinned in a tier (absent: half the tier).
    ``top_n``: how many tenants (by bytes) usage reports name; the rest are summed as ``other``.
    """

    quotas: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    pin_budget: Mapping[int, int] = field(default_factory=dict)
    top_n: int = 10

    def check(self, names: Sequence[str], capacities: Sequence[int]) -> None:
        """Raise naming the field when a quota names no tier, exceeds its tier, or the named
        quotas of a tier reserve more than it holds."""
        if isinstance(self.top_n, bool) or not isinstance(self.top_n, int) or self.top_n < 1:
            raise ConfigError(f"tenancy.top_n: expected a positive integer, got {self.top_n!r}")
        reserved = [0] * len(names)
        for tenant, caps in self.quotas.items():
            check_tenant(tenant, what="tenants")
            for tier, nbytes in caps.items():
                where = f"tenants.{tenant}.{names[tier] if 0 <= tier < len(names) else tier}"
                _check_size(where, tier, nbytes, names, capacities)
                if tenant != DEFAULT_TENANT:
                    reserved[tier] += nbytes
        for tier, total in enumerate(reserved):
            if total > capacities[tier]:
                raise QuotaError(
                    f"tenants: the quotas of tier {names[tier]!r} reserve {total} bytes, more than the tier holds "
                    f"({capacities[tier]} bytes)"
                )
        for tier, nbytes in self.pin_budget.items():
            _check_size(f"tenancy.pin_budget.{names[tier] if 0 <= tier < len(names) else tier}", tier, nbytes, names, capacities)


def _check_size(where: str, tier: object, nbytes: object, names: Sequence[str], capacities: Sequence[int]) -> None:
    if not isinstance(tier, int) or not 0 <= tier < len(names):
        raise ConfigError(f"{where}: no such tier; the tiers are {list(names)}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ConfigError(f"{where}: expected a byte size >= 0, got {nbytes!r}")
    if nbytes > capacities[tier]:
        raise QuotaError(f"{where}: {nbytes} bytes is larger than the tier ({capacities[tier]} bytes)")


class _Guard:
    """What a policy must not evict: ``base`` (pinned keys, the batch) and whatever ``test``
    refuses. A policy asks once about each key it picks (the built-in ones do), so ``test`` may
    count what it lets go."""

    __slots__ = ("base", "test")

    def __init__(self, base: Container[bytes], test: Callable[[bytes], bool]) -> None:
        self.base = base
        self.test = test

    def __contains__(self, key: object) -> bool:
        return key in self.base or self.test(key)  # type: ignore[arg-type]


class TierTenancy:
    """One tier's usage per tenant and its quotas. ``owners`` is the book's (shared by tiers)."""

    __slots__ = ("active", "blocks", "book", "bytes", "default_cap", "evictions", "hits", "owners", "quotas")

    def __init__(self, book: TenantBook) -> None:
        self.book = book
        self.owners = book.owners
        self.bytes: dict[str, int] = {}
        self.blocks: dict[str, int] = {}
        self.hits: dict[str, int] = {}
        self.evictions: dict[str, int] = {}
        #: named tenants' caps (and reservations) in this tier
        self.quotas: dict[str, int] = {}
        self.default_cap: int | None = None
        #: whether any quota applies in this tier (else room is made as without tenants)
        self.active = False

    def tenant(self, key: bytes) -> str:
        return self.owners.get(key, DEFAULT_TENANT)

    def cap(self, tenant: str) -> int | None:
        """The byte cap of ``tenant`` in this tier (``None``: none)."""
        return self.quotas.get(tenant, self.default_cap)

    def _tally(self, keys: Iterable[bytes]) -> Counter[str]:
        return Counter(map(self.owners.get, keys, repeat(DEFAULT_TENANT)))

    # -- accounting ------------------------------------------------------------------------
    def add(self, keys: Collection[bytes], size: int) -> None:
        """``keys`` entered the tier, ``size`` bytes each."""
        nbytes, blocks = self.bytes, self.blocks
        if not self.owners:  # no named tenant yet: one count
            nbytes[DEFAULT_TENANT] = nbytes.get(DEFAULT_TENANT, 0) + size * len(keys)
            blocks[DEFAULT_TENANT] = blocks.get(DEFAULT_TENANT, 0) + len(keys)
            return
        for tenant, n in self._tally(keys).items():
            nbytes[tenant] = nbytes.get(tenant, 0) + size * n
            blocks[tenant] = blocks.get(tenant, 0) + n

    def add_sized(self, sized: Iterable[tuple[bytes, int]]) -> None:
        nbytes, blocks, get = self.bytes, self.blocks, self.owners.get
        for key, size in sized:
            tenant = get(key, DEFAULT_TENANT)
            nbytes[tenant] = nbytes.get(tenant, 0) + size
            blocks[tenant] = blocks.get(tenant, 0) + 1

    def resize(self, key: bytes, delta: int) -> None:
        tenant = self.owners.get(key, DEFAULT_TENANT)
        self.bytes[tenant] = self.bytes.get(tenant, 0) + delta

    def remove(self, keys: Collection[bytes], size: int) -> None:
        """``keys`` left the tier, ``size`` bytes each."""
        if not self.owners:
            self.bytes[DEFAULT_TENANT] -= size * len(keys)
            self.blocks[DEFAULT_TENANT] -= len(keys)
            return
        self.remove_sized(zip(keys, repeat(size)))

    def remove_sized(self, sized: Iterable[tuple[bytes, int]]) -> None:
        nbytes, blocks, owners = self.bytes, self.blocks, self.owners
        gone = self.book.gone
        for key, size in sized:
            tenant = owners.get(key)
            if tenant is None:
                tenant = DEFAULT_TENANT
            else:
                gone.append(key)  # the book forgets its owner once no tier holds it
            nbytes[tenant] -= size
            blocks[tenant] -= 1

    def count(self, counter: dict[str, int], keys: Iterable[bytes]) -> None:
        for tenant, n in self._tally(keys).items():
            counter[tenant] = counter.get(tenant, 0) + n

    # -- quotas ----------------------------------------------------------------------------
    def own_guard(self, base: Container[bytes], tenant: str) -> _Guard:
        """Only ``tenant``'s blocks may go."""
        get = self.owners.get
        return _Guard(base, lambda key: get(key, DEFAULT_TENANT) != tenant)

    def others_guard(self, base: Container[bytes], tenant: str, size_of: Callable[[bytes], int]) -> _Guard:
        """``tenant``'s blocks, those of tenants without a reservation, and those of reserved
        tenants above their quota (down to it) may go."""
        get, quotas = self.owners.get, self.quotas
        above = {u: self.bytes.get(u, 0) - q for u, q in quotas.items() if u != tenant}

        def refused(key: bytes) -> bool:
            owner = get(key, DEFAULT_TENANT)
            left = above.get(owner)
            if left is None:  # the storing tenant itself, or one without a reservation
                return False
            if left <= 0:
                return True
            above[owner] = left - size_of(key)
            return False

        return _Guard(base, refused)

    def fits_cap(self, tenant: str, nbytes: int) -> bool:
        cap = self.cap(tenant)
        return cap is None or self.bytes.get(tenant, 0) + nbytes <= cap

    def rows(self, top_n: int, pinned: Mapping[str, int]) -> dict[str, dict[str, int]]:
        """Usage by tenant: the ``top_n`` tenants by bytes, the rest summed under ``other``."""
        names = {*self.bytes, *self.hits, *self.evictions}
        ranked = sorted(names, key=lambda u: (-self.bytes.get(u, 0), u))
        out: dict[str, dict[str, int]] = {}
        for i, tenant in enumerate(ranked):
            row = {
                "blocks": self.blocks.get(tenant, 0),
                "bytes": self.bytes.get(tenant, 0),
                "hits": self.hits.get(tenant, 0),
                "evictions": self.evictions.get(tenant, 0),
                "pinned": pinned.get(tenant, 0),
            }
            cap = self.cap(tenant)
            if i >= top_n:
                into = out.setdefault("other", dict.fromkeys(row, 0))
                for name, value in row.items():
                    into[name] += value
                continue
            if cap is not None:
                row["quota_bytes"] = cap
            out[tenant] = row
        return out


class TenantBook:
    """Owners of the blocks of named tenants, across tiers, and the rules in force."""

    __slots__ = ("gone", "owners", "rules", "tiers")

    def __init__(self, num_tiers: int, rules: TenantRules | None = None) -> None:
        self.owners: dict[bytes, str] = {}
        #: keys of named tenants that left some tier since the last sweep
        self.gone: list[bytes] = []
        self.tiers = [TierTenancy(self) for _ in range(num_tiers)]
        self.rules = rules or TenantRules()
        self.apply(self.rules)

    def apply(self, rules: TenantRules) -> None:
        """Put ``rules`` (already checked) in force."""
        self.rules = rules
        for ti, tier in enumerate(self.tiers):
            tier.quotas = {u: caps[ti] for u, caps in rules.quotas.items() if ti in caps and u != DEFAULT_TENANT}
            tier.default_cap = rules.quotas.get(DEFAULT_TENANT, {}).get(ti)
            tier.active = bool(tier.quotas) or tier.default_cap is not None

    def claim(self, keys: Iterable[bytes], tenant: str) -> None:
        """``tenant`` owns ``keys`` (new in every tier)."""
        if tenant != DEFAULT_TENANT:
            self.owners.update(zip(keys, repeat(tenant)))
        elif self.owners:  # an entry left by a block that is gone must not claim these
            pop = self.owners.pop
            for key in keys:
                pop(key, None)

    def sweep(self, indexes: Sequence[Container[bytes]]) -> None:
        """Forget the owner of blocks no tier holds any more."""
        if not self.gone:
            return
        owners = self.owners
        for key in self.gone:
            if not any(key in index for index in indexes):
                owners.pop(key, None)
        self.gone = []

    def keys_of(self, tenant: str, held: Iterable[bytes]) -> list[bytes]:
        """The keys of ``held`` that belong to ``tenant``."""
        get = self.owners.get
        return [key for key in held if get(key, DEFAULT_TENANT) == tenant]

    def to_dict(self) -> dict[str, Any]:
        return {"quotas": {u: dict(c) for u, c in self.rules.quotas.items()}, "top_n": self.rules.top_n}
