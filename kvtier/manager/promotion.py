"""Promotion: blocks served from a lower tier come back into the first tier.

Two forms, both owned by the manager's :class:`Promotions`:

* A **promotion plan** (``prepare_promote``) is an ordinary store plan, built like a store (it
  evicts and demotes); its keys are counted as promotions, not stores, when they complete.
* **In-load promotion** (``prepare_load(promote=True)``) reserves *free* room in the first tier
  and the load job copies the block up as it reads it; ``complete_load`` settles it. Several
  loads may read a block while one of them promotes it: the promotion settles with the last of
  them to complete (failed if the promoting load says so), never before the promoting load has
  finished writing the first tier's copy.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from kvtier.manager.eventlog import EventLog
from kvtier.manager.tiers import PENDING, TierState

__all__ = ["Promotions"]


class Promotions:
    """Promotion bookkeeping over ``tiers``; counts go to the manager's ``counts``, events to
    its log."""

    def __init__(self, tiers: Sequence[TierState], counts: dict[str, int], events: EventLog) -> None:
        self._tiers = tiers
        self._counts = counts
        self._events = events
        #: In-load promotions: key -> [loads still to complete, failed, source tier].
        self.loading: dict[bytes, list[int]] = {}

    def sources(self, batch: Iterable[bytes], ready_tier: Callable[[bytes], int | None]) -> dict[bytes, int]:
        """Keys of ``batch`` absent from the first tier and ready in a lower one, with that tier."""
        first = self._tiers[0].index
        found: dict[bytes, int] = {}
        for key in batch:
            if key not in first:
                src = ready_tier(key)
                if src is not None:
                    found[key] = src
        return found

    def plan_completed(self, sources: dict[bytes, int], ok: Iterable[bytes], bad: Iterable[bytes]) -> tuple[int, int]:
        """Count the keys of a promotion plan among ``ok`` and ``bad`` (completed and failed);
        return how many of each were promotions, so they are not also counted as stores."""
        tiers = self._tiers
        done = 0
        for key in ok:
            src = sources.get(key)
            if src is not None:
                tiers[src].promotions_out += 1
                done += 1
        lost = sum(1 for key in bad if key in sources)
        self._counts["promotions"] += done
        self._counts["promotions_failed"] += lost
        return done, lost

    # -- in-load promotion -----------------------------------------------------------------
    def reserve_in_load(self, keys: Sequence[bytes], where: Sequence[int]) -> list[bytes]:
        """Reserve free room in the first tier for the keys of a load served from below; return
        the keys this load copies up. Never evicts."""
        first = self._tiers[0]
        loading = self.loading
        promoted: list[bytes] = []
        for key, ti in zip(keys, where):
            if ti == 0:
                continue
            entry = loading.get(key)
            if entry is not None:  # another load is copying it up: settle after this one too
                entry[0] += 1
            elif key not in first.index and first.has_room(key):
                first.reserve((key,))
                loading[key] = [1, 0, ti]
                promoted.append(key)
        return promoted

    def settle_in_load(self, keys: Iterable[bytes], failed: Collection[bytes], now: float) -> None:
        """A load of ``keys`` completed; ``failed`` are promotions its job could not write."""
        loading = self.loading
        first = self._tiers[0]
        ok: list[bytes] = []
        bad: list[bytes] = []
        for key in keys:
            entry = loading.get(key)
            if entry is None:
                continue
            if key in failed:
                entry[1] = 1
            entry[0] -= 1
            if entry[0] > 0:
                continue
            del loading[key]
            if first.index.get(key) != PENDING:
                continue
            if entry[1]:
                bad.append(key)
            else:
                ok.append(key)
                self._tiers[entry[2]].promotions_out += 1
        first.settle(ok, None, now)
        self._events.add("stored", ok, first.name)
        first.release(bad)
        self._counts["promotions"] += len(ok)
        self._counts["promotions_failed"] += len(bad)
