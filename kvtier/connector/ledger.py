"""The delete ledger: copies that workers may hold although the manager released them.

With ``world_size > 1`` every worker holds its own shard of a block under the same key in its
own tiers, but there is one manager. A job that failed (wholly, or for some keys in some tier)
on one worker may have succeeded on another; when the manager then releases those keys
(``complete_store`` with ``failed`` or ``success=False``, a failed promotion, ``remove`` after
a missed load), the workers where the write succeeded still hold the bytes: pool slots the
manager believes free, orphan records that a persistent tier would re-adopt at restart.

So the (tier, key) pairs such a job touched are :meth:`DeleteLedger.remember`-ed, and the next
metadata build :meth:`DeleteLedger.take`-s those the manager does not hold (pending or ready)
in that tier at that moment. The take runs before the build prepares any store, so a key stored
again in that build or later is written after the delete on every worker (workers run deletes
on their store queue in build order), and a key the manager holds again is never deleted.
"""

from __future__ import annotations

from collections.abc import Collection

from kvtier.manager import StorePlan, TierManager

__all__ = ["DeleteLedger"]

Deletes = tuple[tuple[int, tuple[bytes, ...]], ...]


class DeleteLedger:
    """Tier -> keys whose bytes workers may hold although the manager may not."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: dict[int, dict[bytes, None]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __len__(self) -> int:
        """Keys remembered (per tier) and not yet taken."""
        return sum(len(ks) for ks in self._pending.values())

    def remember(self, tier: int, keys: Collection[bytes]) -> None:
        """Workers may hold ``keys`` in ``tier`` although the manager may not."""
        if keys:
            self._pending.setdefault(tier, {}).update(dict.fromkeys(keys))

    def remember_plan(self, plan: StorePlan) -> None:
        """Every pair a failed store plan touched: a worker that failed may have stopped
        anywhere in it (even before its drops and demotions), another may have run all of it."""
        self.remember(plan.tier, plan.keys)
        for tier, keys in (*plan.write_through, *plan.drops):
            self.remember(tier, keys)
        for d in plan.demotions:
            self.remember(d.src, d.keys)
            self.remember(d.dst, d.keys)

    def take(self, manager: TierManager) -> Deletes:
        """The remembered pairs ``manager`` does not hold now, per tier in a deterministic
        order; clears the ledger (a key held again is dropped from it: its bytes are wanted)."""
        if not self._pending:
            return ()
        pending, self._pending = self._pending, {}
        out: list[tuple[int, tuple[bytes, ...]]] = []
        for tier in sorted(pending):
            if not 0 <= tier < manager.num_tiers:
                continue
            keys = tuple(sorted(k for k in pending[tier] if not manager.holds(k, tier)))
            if keys:
                out.append((tier, keys))
        return tuple(out)
