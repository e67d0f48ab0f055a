"""What an operator does to the manager: pins, deletes, quotas and usage per tenant.

:class:`TenantControl` is the manager's ``tenants`` attribute. Every call validates its whole
input first and raises before changing anything; each holds the manager's lock, so it is one
step between two lifecycle calls.

* **Pins** (``pin``/``unpin``): a pinned block is never evicted from the tier it is pinned in.
  The bytes pinned in a tier are bounded by its pin budget; a pin over it is refused with a
  :class:`~kvtier.errors.QuotaError` and pins nothing. Keys not ready in the tier are skipped.
* **Deletes** (``forget``): the manager forgets ready blocks, and the caller deletes their
  bytes. A block a load has pinned, or one still being written, is never forgotten: it is
  returned as *busy*, so the caller waits for the load and tries again, or skips it. Bytes
  being read are therefore never freed.
* **Quotas** (``set_quota``) change the rules at once; blocks above a lowered quota are not
  moved, they become the first victims of their tenant's next store and may be evicted for
  other tenants.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kvtier.errors import ConfigError
from kvtier.keys import check_keys
from kvtier.manager.eventlog import EventLog
from kvtier.manager.tenants import TenantBook, TenantRules, check_tenant
from kvtier.manager.tiers import TierState

__all__ = ["Forgotten", "TenantControl"]


@dataclass(frozen=True, slots=True)
class Forgotten:
    """What ``forget`` did: the keys forgotten in each tier (their bytes are the caller's to
    delete), and the keys left alone because a load reads them or a store writes them."""

    removed: dict[int, list[bytes]]
    busy: tuple[bytes, ...]

    @property
    def keys(self) -> set[bytes]:
        return {key for keys in self.removed.values() for key in keys}


class TenantControl:
    """Pins, deletes, quotas and usage over the manager's ``tiers``."""

    def __init__(
        self, tiers: Sequence[TierState], lock: threading.Lock, events: EventLog, book: Callable[[], TenantBook]
    ) -> None:
        self._tiers = tiers
        self._lock = lock
        self._events = events
        self._book = book
        self._names = [t.name for t in tiers]

    # -- tiers -----------------------------------------------------------------------------
    def tier_index(self, tier: int | str) -> int:
        """The index of ``tier`` (an index or a tier's name); a ``ConfigError`` naming the tiers."""
        if isinstance(tier, str) and tier in self._names:
            return self._names.index(tier)
        if isinstance(tier, int) and not isinstance(tier, bool) and 0 <= tier < len(self._tiers):
            return tier
        raise ConfigError(f"tier: no tier {tier!r}; the tiers are {self._names} (or their indexes)")

    def _where(self, keys: Sequence[bytes], tier: int | str | None) -> dict[int, list[bytes]]:
        """``keys`` by the tier they are pinned in: ``tier``, or the fastest holding each ready."""
        if tier is not None:
            return {self.tier_index(tier): list(keys)}
        out: dict[int, list[bytes]] = {}
        for key in dict.fromkeys(keys):
            for ti, t in enumerate(self._tiers):
                if t.index.get(key):
                    out.setdefault(ti, []).append(key)
                    break
        return out

    # -- pins ------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], tier: int | str | None = None) -> int:
        """Pin ``keys`` in ``tier`` (default: the fastest tier that holds each ready); return
        how many were newly pinned. All or nothing: a pin over a tier's budget pins nothing."""
        check_keys(keys)
        with self._lock:
            where = self._where(keys, tier)
            for ti, mine in where.items():  # every budget is checked before anything is pinned
                self._tiers[ti].check_keep(mine)
            return sum(len(self._tiers[ti].keep(mine)) for ti, mine in where.items())

    def unpin(self, keys: Sequence[bytes], tier: int | str | None = None) -> int:
        """Unpin ``keys`` in ``tier`` (default: every tier); return how many pins went."""
        check_keys(keys)
        with self._lock:
            tiers = range(len(self._tiers)) if tier is None else (self.tier_index(tier),)
            return sum(len(self._tiers[ti].unkeep(keys)) for ti in tiers)

    def pinned(self, tier: int | str) -> list[bytes]:
        with self._lock:
            return list(self._tiers[self.tier_index(tier)].kept)

    def set_pin_budget(self, tier: int | str, nbytes: int) -> None:
        """Bound the bytes pinned in ``tier``; a budget below what is pinned there now is refused."""
        ti = self.tier_index(tier)
        with self._lock:
            t = self._tiers[ti]
            rules = self._book().rules
            new = replace(rules, pin_budget={**rules.pin_budget, ti: nbytes})
            new.check(self._names, [s.capacity for s in self._tiers])
            if nbytes < t.kept_bytes:
                raise ConfigError(f"pin_budget: {nbytes} bytes is below the {t.kept_bytes} bytes pinned in tier {t.name!r} now")
            self._book().apply(new)
            t.pin_budget = nbytes

    # -- deletes ---------------------------------------------------------------------------
    def forget(self, keys: Iterable[bytes]) -> Forgotten:
        """Forget ``keys`` in every tier, except those a load pins or a store writes (busy)."""
        keys = list(keys)
        if keys:
            check_keys(keys)
        with self._lock:
            removed: dict[int, list[bytes]] = {}
            busy: dict[bytes, None] = {}
            for ti, t in enumerate(self._tiers):
                index, pins = t.index, t.pins
                mine = []
                for key in dict.fromkeys(keys):
                    state = index.get(key)
                    if state is None:
                        continue
                    if not state or key in pins:
                        busy[key] = None
                    else:
                        mine.append(key)
                if mine:
                    t.forget(mine)
                    self._events.add("removed", tuple(mine), t.name)
                    removed[ti] = mine
            book = self._book()
            book.sweep([t.index for t in self._tiers])
            return Forgotten(removed, tuple(busy))

    def keys_of(self, tenant: str | None = None) -> list[bytes]:
        """Every key any tier holds (pending too), or only ``tenant``'s."""
        with self._lock:
            held: dict[bytes, None] = {}
            for t in self._tiers:
                held.update(dict.fromkeys(t.index))
            if tenant is None:
                return list(held)
            return self._book().keys_of(check_tenant(tenant), held)

    # -- quotas ----------------------------------------------------------------------------
    def set_rules(self, rules: TenantRules) -> None:
        """Put ``rules`` in force (quotas, pin budgets), checked against the tiers first."""
        rules.check(self._names, [t.capacity for t in self._tiers])
        with self._lock:
            for ti, nbytes in rules.pin_budget.items():
                if nbytes < self._tiers[ti].kept_bytes:
                    raise ConfigError(f"pin_budget: {nbytes} bytes is below the bytes pinned in tier {self._names[ti]!r} now")
            self._book().apply(rules)
            for ti, t in enumerate(self._tiers):
                t.pin_budget = rules.pin_budget.get(ti, t.capacity // 2)

    def set_quota(self, tenant: str, tier: int | str, nbytes: int | None) -> None:
        """Set ``tenant``'s quota in ``tier`` (``None``: none; tenant ``default``: the cap of
        every tenant not named). Checked like the config's: never above the tier, and the named
        quotas of a tier never reserve more than it holds."""
        check_tenant(tenant)
        ti = self.tier_index(tier)
        with self._lock:
            rules = self._book().rules
        quotas = {u: dict(caps) for u, caps in rules.quotas.items()}
        if nbytes is None:
            quotas.get(tenant, {}).pop(ti, None)
        else:
            quotas.setdefault(tenant, {})[ti] = nbytes
        self.set_rules(replace(rules, quotas={u: caps for u, caps in quotas.items() if caps}))

    def rules(self) -> TenantRules:
        with self._lock:
            return self._book().rules

    # -- usage -----------------------------------------------------------------------------
    def usage(self) -> dict[str, dict[str, dict[str, int]]]:
        """Blocks, bytes, hits, evictions and pins per tenant per tier (the top N tenants by
        bytes, the rest as ``other``), by tier name."""
        with self._lock:
            return self.usage_rows()

    def usage_rows(self) -> dict[str, dict[str, dict[str, int]]]:
        """:meth:`usage`, for a caller that holds the manager's lock."""
        book = self._book()
        out = {}
        for t, tenancy in zip(self._tiers, book.tiers):
            pinned: dict[str, int] = {}
            for key in t.kept:
                owner = tenancy.tenant(key)
                pinned[owner] = pinned.get(owner, 0) + 1
            out[t.name] = tenancy.rows(book.rules.top_n, pinned)
        return out

    # -- persistence -----------------------------------------------------------------------
    def take_tags(self, tier: int) -> tuple[list[tuple[bytes, str]], list[tuple[bytes, bool]]]:
        """The tenants of blocks made ready in ``tier`` and its pin changes since the last call
        (for a persistent tier to save)."""
        with self._lock:
            t = self._tiers[tier]
            tagged, t.tagged = t.tagged, []
            changes, t.pin_changes = t.pin_changes, {}
            owners = t.tenancy.owners if t.tenancy is not None else {}
            index = t.index
            return (
                [(key, owners[key]) for key in dict.fromkeys(tagged) if key in index and key in owners],
                list(changes.items()),
            )

    def tags(self, tier: int) -> tuple[dict[bytes, str], list[bytes]]:
        """Every tenant tag and pin of ``tier`` now (to rewrite a tier's tags whole)."""
        with self._lock:
            t = self._tiers[tier]
            t.tagged, t.pin_changes = [], {}
            owners = t.tenancy.owners if t.tenancy is not None else {}
            index = t.index
            if len(owners) < len(index):  # walk the smaller: at open, 10^6 records and no tag
                return {key: owner for key, owner in owners.items() if key in index}, list(t.kept)
            return {key: owners[key] for key in index if key in owners}, list(t.kept)

    def adopt_pins(self, tier: int, keys: Iterable[bytes]) -> int:
        """Pin again, at open, the saved pins of ``tier`` that it holds, within its budget;
        return how many were pinned."""
        with self._lock:
            t = self._tiers[tier]
            room = t.pin_budget - t.kept_bytes
            fit = []
            for key in keys:
                if t.index.get(key) and key not in t.kept:
                    size = t.sizes.get(key, t.block)
                    if size > room:
                        break
                    room -= size
                    fit.append(key)
            t.keep(fit)
            t.pin_changes.clear()
            return len(fit)

