"""One tier's key state, as the tier manager keeps it.

:class:`TierSpec` is what the manager is told about a tier; :class:`TierState` is what it
tracks: for every key, whether it is *pending* (being written) or *ready*, how many loads pin
it, how many bytes it is accounted for, and the tier's counters. Every change of state goes
through a handful of batch methods (``reserve``, ``settle``, ``release``, ``evict``,
``forget``), so the byte and key counts behind :meth:`TierState.row` stay exact without ever
walking the index: ``stats()`` costs the same with ten keys or ten million.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from kvtier.errors import ConfigError
from kvtier.manager.policies import EvictionPolicy

__all__ = ["PENDING", "READY", "TierSpec", "TierState", "unpin"]

#: Index entries: a pending key maps to ``PENDING`` (falsy), a ready one to ``READY`` (truthy),
#: so ``index.get(key)`` is true exactly when the key can be read. Pins live in ``pins``.
PENDING = 0
READY = 1


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


class TierState:
    """Key state of one tier: ``index`` (key -> ``PENDING``/``READY``), ``pins`` (key -> pin
    count, ready keys only), ``sizes`` (variable-size tiers), ``stamps`` (persistent tiers:
    access times not yet saved), byte accounting and counters. The policy orders exactly the
    ready keys."""

    __slots__ = (
        "block",
        "capacity",
        "demotions_in",
        "dropped",
        "evictions",
        "index",
        "name",
        "pending",
        "persistent",
        "pins",
        "policy",
        "promotions_out",
        "sizes",
        "spec",
        "stamps",
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
        self.index: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}
        self.sizes: dict[bytes, int] = {}
        self.stamps: dict[bytes, float] = {}
        self.used = 0
        self.pending = 0  # entries of ``index`` that are PENDING
        self.evictions = 0
        self.demotions_in = 0
        self.dropped = 0
        self.promotions_out = 0

    def free(self) -> int:
        return self.capacity - self.used

    # -- pending entries -------------------------------------------------------------------
    def reserve(self, keys: Collection[bytes]) -> None:
        """New pending entries for ``keys`` (absent from this tier), one ``block_reserve`` each."""
        index = self.index
        for key in keys:  # a plain loop beats dict.update(dict.fromkeys(...)) at batch sizes
            index[key] = PENDING
        self.used += self.block * len(keys)
        self.pending += len(keys)
        if self.variable:
            self.sizes.update(dict.fromkeys(keys, self.block))

    def settle(self, keys: Collection[bytes], sizes: Mapping[bytes, int] | None, now: float) -> None:
        """Pending -> ready. ``sizes`` holds the stored size of keys of a variable-size tier."""
        if not keys:
            return
        index = self.index
        for key in keys:
            index[key] = READY
        self.pending -= len(keys)
        if self.variable and sizes:
            own = self.sizes
            for key in keys:
                actual = sizes.get(key)
                if actual is not None:
                    self.used += actual - own[key]
                    own[key] = actual
        self.policy.insert_many(keys)
        if self.persistent:
            self.stamps.update(dict.fromkeys(keys, now))

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

    def blocks_that_fit(self, protected: AbstractSet[bytes]) -> int:
        """How many blocks ``evict`` and the free room could make space for, never evicting a
        pinned key nor one of ``protected``: the room free plus every ready key's bytes that
        may go. Costs the batch and the pins, never a walk of the index."""
        index, pins = self.index, self.pins
        kept = pins.keys() | {key for key in protected if index.get(key)}
        if self.variable:
            sizes = self.sizes
            ready_bytes = self.used - self.pending * self.block  # pending entries count one block each
            movable = ready_bytes - sum(sizes.get(key, 0) for key in kept)
        else:
            movable = (len(index) - self.pending - len(kept)) * self.block
        return max(0, (self.free() + movable) // self.block)

    def evict(self, nbytes: int, protected: AbstractSet[bytes]) -> list[bytes] | None:
        """Remove ready, unpinned keys not in ``protected`` that free at least ``nbytes``, in
        the policy's order; ``None`` and no change (the policy's order included) if impossible."""
        policy = self.policy
        guard = protected | self.pins.keys() if self.pins else protected
        victims: list[bytes] = []
        freed = 0
        while freed < nbytes:
            got = policy.evict(max(1, -(-(nbytes - freed) // self.block)), guard)
            if got is None:
                policy.restore(victims)
                return None
            victims += got
            freed += sum(map(self.sizes.__getitem__, got)) if self.variable else len(got) * self.block
        index = self.index
        for key in victims:
            del index[key]
        self._unaccount(victims)
        self.evictions += len(victims)
        return victims

    def forget(self, keys: Collection[bytes]) -> None:
        """Remove ready, unpinned keys for another reason than eviction (found gone or corrupt)."""
        index, remove = self.index, self.policy.remove
        for key in keys:
            del index[key]
            remove(key)
        self._unaccount(keys)

    def adopt(self, records: Iterable[tuple[bytes, int, float]]) -> list[bytes]:
        """Ready entries for stored records ``(key, stored_bytes, stamp)``, oldest stamp first;
        those beyond the capacity (the oldest) or already present are returned, not adopted."""
        ordered = sorted(records, key=itemgetter(2))
        if not self.variable and self.used + len(ordered) * self.block <= self.capacity:
            # A store's open: every record fits. When none is held yet or listed twice, the
            # loop below would adopt them all, in this order; built in C instead (a test
            # compares the two).
            keys = [record[0] for record in ordered]
            fresh = dict.fromkeys(keys, READY)
            if len(fresh) == len(keys) and (not self.index or self.index.keys().isdisjoint(fresh)):
                self.index.update(fresh)
                self.used += len(keys) * self.block
                self.policy.insert_many(keys)
                return []
        sizes = [n if self.variable else self.block for _, n, _ in ordered]
        total = self.used + sum(sizes)
        excess: list[bytes] = []
        adopted: list[bytes] = []
        for (key, _, _), size in zip(ordered, sizes):
            if total > self.capacity or key in self.index:
                excess.append(key)
                total -= size
                continue
            self.index[key] = READY
            self.used += size
            if self.variable:
                self.sizes[key] = size
            adopted.append(key)
        self.policy.insert_many(adopted)
        return excess

    def _unaccount(self, keys: Collection[bytes]) -> None:
        if self.variable:
            pop = self.sizes.pop
            self.used -= sum(pop(key) for key in keys)
        else:
            self.used -= self.block * len(keys)

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
            "evictions": self.evictions,
            "demotions_in": self.demotions_in,
            "dropped": self.dropped,
            "promotions": self.promotions_out,
        }


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
