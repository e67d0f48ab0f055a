"""Admission: which blocks a lower tier accepts.

A tier with ``admit_after: k`` takes a block (by demotion or write-through) only once the block
has been seen ``k`` times, stored or loaded, so an SSD is spared one-off prefixes. The use
counts are bounded: the oldest are forgotten past a few times the blocks the tiers can hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtier.manager.tiers import TierSpec

__all__ = ["Admission"]


class Admission:
    """Use counts of recent keys, and the rule of each tier."""

    def __init__(self, tiers: Sequence[TierSpec]) -> None:
        self._need = [t.admit_after for t in tiers]
        #: False when every tier admits everything: then nothing is counted at all.
        self.enabled = any(n > 1 for n in self._need)
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._cap = 4 * sum(max(1, t.capacity_bytes // t.block_reserve) for t in tiers)

    def note(self, keys: Iterable[bytes]) -> None:
        """The keys were stored or loaded once more."""
        if not self.enabled:
            return
        seen = self._seen
        for key in keys:
            seen[key] = seen.pop(key, 0) + 1
        while len(seen) > self._cap:
            seen.popitem(last=False)

    def unnote(self, keys: Iterable[bytes]) -> None:
        """Take back one use of each key (a partial store that did not cover them after all)."""
        if not self.enabled:
            return
        seen = self._seen
        for key in keys:
            n = seen.get(key, 0)
            if n > 1:
                seen[key] = n - 1
            elif n:
                del seen[key]

    def admitted(self, tier: int, keys: list[bytes]) -> list[bytes]:
        """The keys of ``keys`` that ``tier`` accepts, in order."""
        need = self._need[tier]
        if need <= 1:
            return keys
        get = self._seen.get
        return [key for key in keys if get(key, 0) >= need]
