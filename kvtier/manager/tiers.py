"""One tier's key state, as the tier manager keeps it.

:class:`TierSpec` is what the manager is told about a tier; :class:`TierState` is what it
tracks: for every key, whether it is *pending* (being written) or *ready*, how many loads pin
it, how many bytes it is accounted for, and the tier's counters. Every change of state goes
through a handful of batch methods (``reserve``, ``settle``, ``release``, ``evict``,
``forget``), so the byte and key counts behind :meth:`TierState.row` stay exact without ever
walking the index: ``stats()`` costs the same with ten keys or ten million.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from kvtier.bulk import READY
from kvtier.errors import ConfigError, QuotaError
from kvtier.manager.lookups import assign_keys, new_index
from kvtier.manager.policies import EvictionPolicy
from kvtier.manager.tenants import DEFAULT_TENANT, TenantBook, TierTenancy

__all__ = ["PENDING", "READY", "TierSpec", "TierState", "check_specs", "tenant_book", "unpin"]

#: Index entries: a pending key maps to ``PENDING`` (falsy), a ready one to ``READY`` (truthy),
#: so ``index.get(key)`` is true exactly when the key can be read. Pins live in ``pins``.
#: (``READY`` is defined in :mod:`kvtier.bulk`, where a tier's listing builds a table of it.)
PENDING = 0


@dataclass(frozen=True, slots=True)
class TierSpec:
    """What the manager needs to know about one tier."""

    name: str
    capacity_bytes: int
    block_reserve: int
    policy: EvictionPolicy
    persistent: bool = False
    #: Stored sizes may be smaller than ``block_reserve`` (compressed tiers).
    variable_size: bool = False
    #: Admission rule: a block enters this tier (by demotion or write-through) only once it has
    #: been seen this many times (stored or loaded), which spares an SSD one-off prefixes.
    admit_after: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.admit_after, int) or self.admit_after < 1:
            raise ConfigError(f"tiers[{self.name}].admit_after: expected an integer >= 1, got {self.admit_after!r}")
        if self.block_reserve <= 0:
            raise ConfigError(f"tiers[{self.name}]: block_reserve must be positive")
        if self.capacity_bytes < self.block_reserve:
            raise ConfigError(
                f"tiers[{self.name}].capacity: {self.capacity_bytes} bytes is below one block ({self.block_reserve} bytes)"
            )


def check_specs(specs: Sequence[TierSpec], write: str) -> None:
    """A manager's tiers and write mode: a ``ConfigError`` naming what is wrong."""
    if not specs:
        raise ConfigError("tiers: at least one tier is required")
    if write not in ("back", "through"):
        raise ConfigError(f"write: expected 'back' or 'through', got {write!r}")
    names = [t.name for t in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"tiers: names must be unique, got {names}")


class TierState:
    """Key state of one tier: ``index`` (key -> ``PENDING``/``READY``), ``pins`` (key -> pin
    count, ready keys only), ``sizes`` (variable-size tiers: the accounted bytes of the keys
    whose size is not ``block``; every other key of the index counts ``block``, so a tier of
    millions of records of the common size keeps no entry per key), ``stamps`` (persistent
    tiers: access times not yet saved), byte accounting and counters. The policy orders exactly
    the ready keys.

    ``kept`` holds the keys an operator pinned (never evicted from this tier, at most
    ``pin_budget`` bytes of them); ``tenancy`` (once tenants are in use) counts usage per tenant
    and holds the tier's quotas, which :meth:`make_room` follows."""

    __slots__ = (
        "block",
        "capacity",
        "demotions_in",
        "departed",
        "dropped",
        "evictions",
        "index",
        "kept",
        "kept_bytes",
        "name",
        "pending",
        "persistent",
        "pin_budget",
        "pin_changes",
        "pins",
        "policy",
        "promotions_out",
        "sizes",
        "spec",
        "stamps",
        "tagged",
        "tenancy",
        "used",
        "variable",
    )

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.policy = spec.policy
        self.capacity = spec.capacity_bytes
        self.block = spec.block_reserve
        self.variable = spec.variable_size
        self.persistent = spec.persistent
        # a dict (with a membership filter where kvtier.manager._probe is built, and a table of
        # its ready keys for a tier whose blocks are in memory: see lookups.new_index)
        self.index = new_index(ready_table=not spec.persistent)
        self.pins: dict[bytes, int] = {}
        self.sizes: dict[bytes, int] = {}
        self.stamps: dict[bytes, float] = {}
        self.used = 0
        self.pending = 0  # entries of ``index`` that are PENDING
        self.evictions = 0
        #: ready keys that left ``index`` (evicted or forgotten), in a cell that the tiers of one
        #: manager share (``TierManager`` makes it): a load reads it before its unlocked find
        #: and again at its pin, to know whether a key may have vanished in between
        self.departed = [0]
        self.demotions_in = 0
        self.dropped = 0
        self.promotions_out = 0
        self.kept: dict[bytes, None] = {}
        self.kept_bytes = 0
        self.pin_budget = self.capacity // 2
        self.tenancy: TierTenancy | None = None
        #: persistent tiers: pins and unpins, and keys of named tenants made ready, not yet saved
        self.pin_changes: dict[bytes, bool] = {}
        self.tagged: list[bytes] = []

    def free(self) -> int:
        return self.capacity - self.used

    # -- pending entries -------------------------------------------------------------------
    def reserve(self, keys: Collection[bytes]) -> None:
        """New pending entries for ``keys`` (absent from this tier), one ``block_reserve`` each."""
        assign_keys(self.index, keys, PENDING)  # (beats dict.update(dict.fromkeys(...)) at batch sizes)
        self.used += self.block * len(keys)
        self.pending += len(keys)
        if self.tenancy is not None:
            self.tenancy.add(keys, self.block)

    def settle(self, keys: Collection[bytes], sizes: Mapping[bytes, int] | None, now: float) -> None:
        """Pending -> ready. ``sizes`` holds the stored size of keys of a variable-size tier."""
        if not keys:
            return
        assign_keys(self.index, keys, READY)
        self.pending -= len(keys)
        if self.variable and sizes:
            own, block = self.sizes, self.block
            tenancy = self.tenancy
            for key in keys:
                actual = sizes.get(key)
                if actual is not None:
                    grown = actual - own.get(key, block)
                    self.used += grown
                    if tenancy is not None:
                        tenancy.resize(key, grown)
                    if actual != block:
                        own[key] = actual
                    else:
                        own.pop(key, None)
        self.policy.insert_many(keys)
        if self.persistent:
            self.stamps.update(dict.fromkeys(keys, now))
            if self.tenancy is not None and self.tenancy.owners:
                owners = self.tenancy.owners
                self.tagged.extend(key for key in keys if key in owners)

    def release(self, keys: Collection[bytes]) -> None:
        """Drop pending entries (a write that failed or was cancelled)."""
        index = self.index
        for key in keys:
            del index[key]
        self.pending -= len(keys)
        self._unaccount(keys)

    # -- ready entries ---------------------------------------------------------------------
    def pin(self, keys: Collection[bytes], now: float) -> None:
        """Pin ready ``keys`` for a load (once per occurrence) and count the use."""
        pins = self.pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        self.policy.touch_many(keys)
        if self.persistent:
            self.stamps.update(dict.fromkeys(keys, now))
        if self.tenancy is not None:
            self.tenancy.count(self.tenancy.hits, keys)

    def blocks_that_fit(self, protected: AbstractSet[bytes]) -> int:
        """How many blocks ``evict`` and the free room could make space for, never evicting a
        pinned key nor one of ``protected``: the room free plus every ready key's bytes that
        may go. Costs the batch and the pins, never a walk of the index."""
        index, pins = self.index, self.pins
        kept = pins.keys() | self.kept.keys() | {key for key in protected if index.get(key)}
        if self.variable:
            ready_bytes = self.used - self.pending * self.block  # pending entries count one block each
            movable = ready_bytes - self._sized(kept)
        else:
            movable = (len(index) - self.pending - len(kept)) * self.block
        return max(0, (self.free() + movable) // self.block)

    def _guard(self, protected: AbstractSet[bytes]) -> AbstractSet[bytes]:
        """``protected`` and the keys pinned by a load or by an operator."""
        guard = protected | self.pins.keys() if self.pins else protected
        return guard | self.kept.keys() if self.kept else guard

    def _take(self, nbytes: int, guard: Container[bytes]) -> tuple[list[bytes], int] | None:
        """Victims not in ``guard`` that free at least ``nbytes``, and the bytes they free,
        taken from the policy; ``None`` and no change (its order included) if impossible."""
        policy = self.policy
        victims: list[bytes] = []
        freed = 0
        while freed < nbytes:
            got = policy.evict(max(1, -(-(nbytes - freed) // self.block)), guard)
            if got is None:
                policy.restore(victims)
                return None
            victims += got
            freed += self._sized(got) if self.variable else len(got) * self.block
        return victims, freed

    def _drop(self, victims: list[bytes]) -> None:
        index = self.index
        for key in victims:
            del index[key]
        self.departed[0] += len(victims)
        if self.tenancy is not None:
            self.tenancy.count(self.tenancy.evictions, victims)
        self._unaccount(victims)
        self.evictions += len(victims)

    def evict(self, nbytes: int, protected: AbstractSet[bytes]) -> list[bytes] | None:
        """Remove ready, unpinned keys not in ``protected`` that free at least ``nbytes``, in
        the policy's order; ``None`` and no change (the policy's order included) if impossible."""
        # (_take and _drop inlined: this runs for every store into a full tier)
        policy = self.policy
        guard = protected | self.pins.keys() if self.pins else protected
        if self.kept:
            guard = guard | self.kept.keys()
        victims: list[bytes] = []
        freed = 0
        while freed < nbytes:
            got = policy.evict(max(1, -(-(nbytes - freed) // self.block)), guard)
            if got is None:
                policy.restore(victims)
                return None
            victims += got
            freed += self._sized(got) if self.variable else len(got) * self.block
        index = self.index
        for key in victims:
            del index[key]
        self.departed[0] += len(victims)
        if self.tenancy is not None:
            self.tenancy.count(self.tenancy.evictions, victims)
            self._unaccount(victims)
        elif self.kept or self.variable:
            self._unaccount(victims)
        else:  # (_unaccount's own plain case: fixed-size blocks, no pins, no tenants)
            self.used -= self.block * len(victims)
        self.evictions += len(victims)
        return victims

    def quotas_apply(self) -> bool:
        t = self.tenancy
        return t is not None and t.active

    def make_room(self, nbytes: int, protected: AbstractSet[bytes], tenant: str | None = None) -> list[bytes] | None:
        """Evict so that ``nbytes`` more of ``tenant``'s blocks fit: the victims (``[]`` when
        they fit already), or ``None`` and no change when the tier or the tenant's quota
        cannot make room. Under quotas a tenant over its cap evicts its own blocks first, and
        the blocks of a reserved tenant within its quota are never taken for another."""
        tenancy = self.tenancy
        if tenancy is None or not tenancy.active:
            over = self.used + nbytes - self.capacity
            if over <= 0:
                return []
            if nbytes > self.capacity:
                return None
            return self.evict(over, protected)
        tenant = tenant or DEFAULT_TENANT
        if nbytes > self.capacity:
            return None
        guard = self._guard(protected)
        victims: list[bytes] = []
        freed = 0
        cap = tenancy.cap(tenant)
        if cap is not None:
            over_cap = tenancy.bytes.get(tenant, 0) + nbytes - cap
            if over_cap > 0:
                got = self._take(over_cap, tenancy.own_guard(guard, tenant)) if nbytes <= cap else None
                if got is None:
                    return None
                victims, freed = got
        over = self.used - freed + nbytes - self.capacity
        if over > 0:
            more = self._take(over, tenancy.others_guard(guard, tenant, self.size_of))
            if more is None:
                self.policy.restore(victims)
                return None
            victims += more[0]
        if victims:
            self._drop(victims)
        return victims

    def size_of(self, key: bytes) -> int:
        """The bytes ``key`` is accounted for (see the class doc)."""
        return self.sizes.get(key, self.block) if self.variable else self.block

    def _sized(self, keys: Collection[bytes]) -> int:
        """The accounted bytes of ``keys`` of a variable-size tier (see the class doc)."""
        sizes = self.sizes
        if not sizes:
            return len(keys) * self.block
        block = self.block
        return sum(sizes.get(key, block) for key in keys)

    def has_room(self, key: bytes) -> bool:
        """Whether ``key`` fits in the free room, its tenant's cap included (never evicts)."""
        if self.used + self.block > self.capacity:
            return False
        tenancy = self.tenancy
        return tenancy is None or tenancy.fits_cap(tenancy.tenant(key), self.block)

    # -- operator pins ---------------------------------------------------------------------
    def check_keep(self, keys: Sequence[bytes]) -> tuple[list[bytes], int]:
        """The keys of ``keys`` :meth:`keep` would pin and their bytes; :class:`QuotaError` if
        that is over the pin budget."""
        index, kept = self.index, self.kept
        new = [key for key in dict.fromkeys(keys) if index.get(key) and key not in kept]
        nbytes = sum(map(self.size_of, new))
        if self.kept_bytes + nbytes > self.pin_budget:
            raise QuotaError(
                f"pin: {len(new)} blocks ({nbytes} bytes) would bring the pins of tier {self.name!r} to "
                f"{self.kept_bytes + nbytes} bytes, over its pin budget of {self.pin_budget} bytes"
            )
        return new, nbytes

    def keep(self, keys: Sequence[bytes]) -> list[bytes]:
        """Pin ready ``keys`` (those not ready here are skipped) against eviction from this
        tier; the keys newly pinned. Over the pin budget: :class:`QuotaError`, no change."""
        new, nbytes = self.check_keep(keys)
        self.kept.update(dict.fromkeys(new))
        self.kept_bytes += nbytes
        if self.persistent:
            self.pin_changes.update(dict.fromkeys(new, True))
        return new

    def unkeep(self, keys: Iterable[bytes]) -> list[bytes]:
        """Unpin ``keys`` (those not pinned are skipped); the keys unpinned."""
        kept = self.kept
        gone = [key for key in dict.fromkeys(keys) if key in kept]
        for key in gone:
            del kept[key]
        self.kept_bytes -= sum(map(self.size_of, gone))
        if self.persistent:
            self.pin_changes.update(dict.fromkeys(gone, False))
        return gone

    def forget(self, keys: Collection[bytes]) -> None:
        """Remove ready, unpinned keys for another reason than eviction (found gone or corrupt)."""
        index, remove = self.index, self.policy.remove
        for key in keys:
            del index[key]
            remove(key)
        self.departed[0] += len(keys)
        self._unaccount(keys)

    def _unaccount(self, keys: Collection[bytes]) -> None:
        if self.kept:  # a pinned key that goes (a delete, a corrupt record) is unpinned
            self.unkeep(key for key in keys if key in self.kept)
        tenancy = self.tenancy
        if self.variable:
            pop, block = self.sizes.pop, self.block
            if tenancy is None:
                self.used -= sum(pop(key, block) for key in keys) if self.sizes else block * len(keys)
            else:
                sized = [(key, pop(key, block)) for key in keys]
                self.used -= sum(size for _, size in sized)
                tenancy.remove_sized(sized)
        else:
            self.used -= self.block * len(keys)
            if tenancy is not None:
                tenancy.remove(keys, self.block)

    # -- reporting -------------------------------------------------------------------------
    def row(self) -> dict[str, Any]:
        blocks = len(self.index)
        return {
            "name": self.name,
            "capacity_bytes": self.capacity,
            "used_bytes": self.used,
            "blocks": blocks,
            "ready": blocks - self.pending,
            "pending": self.pending,
            "pinned": len(self.pins),
            "kept": len(self.kept),
            "kept_bytes": self.kept_bytes,
            "evictions": self.evictions,
            "demotions_in": self.demotions_in,
            "dropped": self.dropped,
            "promotions": self.promotions_out,
        }


def tenant_book(tiers: Sequence[TierState]) -> TenantBook:
    """A tenant book over ``tiers``, made when a manager first needs one: every block they
    hold so far is the default tenant's."""
    book = TenantBook(len(tiers))
    for t, tenancy in zip(tiers, book.tiers):
        tenancy.bytes[DEFAULT_TENANT] = t.used
        tenancy.blocks[DEFAULT_TENANT] = len(t.index)
        t.tenancy = tenancy
    return book


def unpin(pins_by_tier: Sequence[dict[bytes, int]], keys: Iterable[bytes]) -> int | None:
    """Unpin each key once, in the fastest tier that pins it. On a key no tier pins, undo and
    return its index; ``None`` when every key was unpinned."""
    undo: list[dict[bytes, int]] = []
    try:
        for key in keys:
            for pins in pins_by_tier:
                n = pins.get(key)
                if n:
                    if n > 1:
                        pins[key] = n - 1
                    else:
                        del pins[key]
                    undo.append(pins)
                    break
            else:
                break
        else:
            return None
    except TypeError:  # unhashable: not a key
        pass
    for pins, key in zip(undo, keys):
        pins[key] = pins.get(key, 0) + 1
    return len(undo)
