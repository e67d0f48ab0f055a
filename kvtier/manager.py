"""The tier manager: key state across an ordered list of tiers (fastest first).

The manager decides; it never moves bytes. It owns, for every key in every tier, whether the
key is *pending* (being written, invisible to ``lookup``) or *ready*, and how many loads pin it.
The policy of each tier orders its ready keys and picks victims; backends own the bytes and are
driven by the transfer engine, which executes the plans the manager hands out.

Lifecycle (the contract engine authors know from vLLM's offloading manager):

===========================  ===================================================================
``lookup(keys)``             leading run of keys that are ready in some tier (pending ends it)
``prepare_store(keys)``      skip keys already present, evict (demoting victims to the next
                             tier in write-back mode), reserve; **atomic**: ``None`` and no change
                             when the first tier cannot make room. Never evicts a key of its own
                             batch or a pinned key. New keys are pending.
``complete_store(keys, ok)`` pending -> ready (a *stored* event per tier); on failure the
                             reservations are released
``prepare_load(keys)``       pin each key in the fastest tier that holds it ready
``complete_load(keys)``      unpin
``prepare_promote(keys)``    after a load: bring keys ready only in a lower tier back into the
                             first tier, making room exactly like ``prepare_store`` (atomic,
                             victims demoted); a ``StorePlan`` completed with ``complete_store``
``touch(keys)``              recency for the policies
``take_events()``            stored / removed events with the tier, for KV-aware routers
===========================  ===================================================================

Every call validates its whole input first and raises before changing anything. Lifecycle calls
never block and never await: they are plain dictionary work, callable from an engine's
scheduler thread or from a coroutine alike. Running out of room is not an error: it is ``None``
and a counter.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from kvtier.errors import ConfigError, LifecycleError
from kvtier.keys import check_keys
from kvtier.policies import EvictionPolicy

__all__ = [
    "TierSpec",
    "TierManager",
    "StorePlan",
    "LoadPlan",
    "Demotion",
    "KeyState",
    "KeyStatus",
    "CacheEvent",
]

WriteMode = Literal["back", "through"]

# Entry codes in a tier's index: bit 0 = ready; the rest = pin count. Small ints are shared
# objects in CPython, so an entry costs only its dictionary slot.
_PENDING = 0
_READY = 1
_PIN = 2


class KeyState(str, Enum):
    MISS = "miss"
    PENDING = "pending"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class KeyStatus:
    """Where a key stands: ``tier`` is the fastest tier that holds it (``None`` on a miss)."""

    state: KeyState
    tier: int | None = None


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """A key became ready in (``stored``) or left (``removed``) the tier named ``tier``."""

    kind: Literal["stored", "removed"]
    key: bytes
    tier: str


_RawEvent = tuple[Literal["stored", "removed"], bytes, str]


@dataclass(frozen=True, slots=True)
class Demotion:
    """Move ``keys`` from tier ``src`` to tier ``dst`` (write-back of evicted blocks)."""

    src: int
    dst: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class StorePlan:
    """What one store job must do, in order: ``drops`` (delete evicted keys from a tier),
    ``demotions`` (deepest first; each copies its keys from ``src`` to ``dst`` and then deletes
    them from ``src``), then write ``keys`` into ``tier`` and into every tier of ``write_through``.

    ``positions[i]`` is the index of ``keys[i]`` in the batch given to ``prepare_store``, so the
    caller can pick the matching engine block ids. ``skipped`` are keys already present.
    """

    plan_id: int
    keys: tuple[bytes, ...]
    positions: tuple[int, ...]
    tier: int = 0
    write_through: tuple[tuple[int, tuple[bytes, ...]], ...] = ()
    drops: tuple[tuple[int, tuple[bytes, ...]], ...] = ()
    demotions: tuple[Demotion, ...] = ()
    skipped: tuple[bytes, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.keys and not self.drops and not self.demotions


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The tier each key is read from (``tiers[i]`` for ``keys[i]``); every key is pinned.

    ``promote`` lists keys read from a lower tier that the load job also copies into the first
    tier (reserved, pending until ``complete_load``)."""

    keys: tuple[bytes, ...]
    tiers: tuple[int, ...]
    promote: tuple[bytes, ...] = ()


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


@dataclass(slots=True)
class _Tier:
    spec: TierSpec
    index: dict[bytes, int] = field(default_factory=dict)
    sizes: dict[bytes, int] = field(default_factory=dict)
    used: int = 0
    evictions: int = 0
    demotions_in: int = 0
    dropped: int = 0
    stamps: dict[bytes, float] = field(default_factory=dict)
    #: Keys with a pin count above zero; with the batch, what eviction must step over.
    pinned: set[bytes] = field(default_factory=set)
    #: Blocks promoted from this (lower) tier into the first tier.
    promotions_out: int = 0

    def size_of(self, key: bytes) -> int:
        if self.spec.variable_size:
            return self.sizes.get(key, self.spec.block_reserve)
        return self.spec.block_reserve

    def add(self, key: bytes, code: int, nbytes: int) -> None:
        self.index[key] = code
        self.used += nbytes
        if self.spec.variable_size:
            self.sizes[key] = nbytes

    def discard(self, key: bytes) -> None:
        code = self.index.pop(key, None)
        if code is None:
            return
        self.used -= self.size_of(key)
        if self.spec.variable_size:
            self.sizes.pop(key, None)
        if code & _READY:
            self.spec.policy.remove(key)


@dataclass(slots=True)
class _OpenPlan:
    plan: StorePlan
    remaining: set[bytes]
    pending: list[tuple[int, bytes]]  # demoted / written-through entries to finalise with the plan
    #: Promotion plans only: the lower tier each key was ready in when the plan was made.
    sources: dict[bytes, int] | None = None


class TierManager:
    """Key state over ``tiers`` (fastest first) with write-back or write-through chaining."""

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        *,
        write: WriteMode = "back",
        max_events: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not tiers:
            raise ConfigError("tiers: at least one tier is required")
        if write not in ("back", "through"):
            raise ConfigError(f"write: expected 'back' or 'through', got {write!r}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tiers: names must be unique, got {names}")
        self._tiers = [_Tier(spec) for spec in tiers]
        self.write_mode: WriteMode = write
        self._plans: dict[int, _OpenPlan] = {}
        self._plan_of: dict[bytes, int] = {}
        self._promoting: dict[bytes, int] = {}  # in-load promotions (prepare_load(promote=True))
        self._promotion_plans = 0  # open plans made by prepare_promote
        # Use counts for admission rules, bounded to a few times the blocks the tiers hold.
        self._admission = any(t.admit_after > 1 for t in tiers)
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._seen_cap = 4 * sum(max(1, t.capacity_bytes // t.block_reserve) for t in tiers)
        self._plan_ids = itertools.count(1)
        # Events are kept as plain tuples and become CacheEvent objects in take_events():
        # building a frozen dataclass per key would dominate the cost of a store.
        self._events: deque[_RawEvent] = deque(maxlen=max_events)
        self._clock = clock
        self._closed = False
        self.counters: dict[str, int] = {
            "lookups": 0,
            "lookup_keys": 0,
            "lookup_hits": 0,
            "store_prepared": 0,
            "store_skipped": 0,
            "store_rejected": 0,
            "store_completed": 0,
            "store_failed": 0,
            "load_prepared": 0,
            "promotions": 0,
            "promotions_failed": 0,
            "promotions_prepared": 0,
            "promotions_rejected": 0,
            "events_dropped": 0,
        }

    # -- introspection ---------------------------------------------------------------------
    @property
    def num_tiers(self) -> int:
        return len(self._tiers)

    def tier_spec(self, tier: int) -> TierSpec:
        return self._tiers[tier].spec

    def tier_keys(self, tier: int) -> list[bytes]:
        """Ready keys of ``tier`` in eviction order (next victim first)."""
        return self._tiers[tier].spec.policy.order()

    def __len__(self) -> int:
        return sum(len(t.index) for t in self._tiers)

    def close(self) -> None:
        self._closed = True

    def _check(self) -> None:
        if self._closed:
            from kvtier.errors import ClosedError

            raise ClosedError("the tier manager is closed")

    # -- lookup ----------------------------------------------------------------------------
    def status(self, key: bytes) -> KeyStatus:
        pending_at: int | None = None
        for i, t in enumerate(self._tiers):
            code = t.index.get(key)
            if code is None:
                continue
            if code & _READY:
                return KeyStatus(KeyState.READY, i)
            if pending_at is None:
                pending_at = i
        if pending_at is not None:
            return KeyStatus(KeyState.PENDING, pending_at)
        return KeyStatus(KeyState.MISS)

    def holds(self, key: bytes, tier: int) -> bool:
        """Whether ``tier`` has ``key`` at all (pending or ready): its bytes may be there."""
        return key in self._tiers[tier].index

    def lookup_detail(self, keys: Sequence[bytes]) -> list[KeyStatus]:
        """Per key: hit (with the fastest ready tier), pending, or miss."""
        self._check()
        check_keys(keys)
        return [self.status(k) for k in keys]

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` ready in some tier; a pending key ends it."""
        self._check()
        check_keys(keys)
        tiers = [t.index for t in self._tiers]
        hits = 0
        for key in keys:
            for index in tiers:
                code = index.get(key)
                if code is not None and code & _READY:
                    break
            else:
                break
            hits += 1
        self.counters["lookups"] += 1
        self.counters["lookup_keys"] += len(keys)
        self.counters["lookup_hits"] += hits
        return hits

    # -- store -----------------------------------------------------------------------------
    def _note_seen(self, keys: Iterable[bytes]) -> None:
        if not self._admission:
            return
        seen = self._seen
        for key in keys:
            seen[key] = seen.pop(key, 0) + 1
        while len(seen) > self._seen_cap:
            seen.popitem(last=False)

    def _admits(self, tier: int, key: bytes) -> bool:
        need = self._tiers[tier].spec.admit_after
        return need <= 1 or self._seen.get(key, 0) >= need

    def _make_room(
        self,
        tier: int,
        nbytes: int,
        protected: set[bytes],
        drops: dict[int, list[bytes]],
        demotions: list[Demotion],
        pending: list[tuple[int, bytes]],
        events: list[_RawEvent],
    ) -> bool:
        """Free ``nbytes`` in ``tier``, demoting victims down the chain; ``False`` if impossible.

        ``False`` is only ever returned before anything changed (the policy's partial choice is
        restored), so callers need no undo log: once victims are chosen, every later step either
        succeeds or degrades to dropping a victim instead of demoting it.
        """
        t = self._tiers[tier]
        deficit = t.used + nbytes - t.spec.capacity_bytes
        if deficit <= 0:
            return True
        if nbytes > t.spec.capacity_bytes:
            return False
        policy = t.spec.policy
        # Pending keys are not in the policy; pinned ones and the batch are stepped over.
        guard = protected | t.pinned if t.pinned else protected
        victims: list[bytes] = []
        freed = 0
        while freed < deficit:
            want = max(1, -(-(deficit - freed) // t.spec.block_reserve))
            got = policy.evict(want, guard)
            if got is None:
                policy.restore(victims)  # roll back this tier's partial choice, order included
                return False
            victims.extend(got)
            freed += sum(t.size_of(k) for k in got) if t.spec.variable_size else len(got) * t.spec.block_reserve
        moved: list[bytes] = []
        dropped: list[bytes] = []
        index, sizes, name = t.index, t.sizes, t.spec.name
        nxt = tier + 1
        dst = self._tiers[nxt] if nxt < len(self._tiers) and self.write_mode == "back" else None
        if t.spec.variable_size:
            t.used -= sum(sizes.pop(k, t.spec.block_reserve) for k in victims)
        else:
            t.used -= freed
        for key in victims:
            del index[key]
        t.evictions += len(victims)
        if dst is None:  # the last tier, or write-through: victims are simply dropped
            dropped = victims
            events.extend([("removed", key, name) for key in victims])
        else:
            for key in victims:
                if key not in dst.index and self._admits(nxt, key):
                    reserve = dst.spec.block_reserve
                    if self._make_room(nxt, reserve, protected, drops, demotions, pending, events):
                        dst.add(key, _PENDING, reserve)
                        dst.demotions_in += 1
                        moved.append(key)
                        pending.append((nxt, key))
                        # The key leaves this tier now; routers that track tiers must hear of it.
                        events.append(("removed", key, name))
                        continue
                # Dropped from this tier: still readable elsewhere (write-through) or gone.
                dropped.append(key)
                events.append(("removed", key, name))
        if dropped:
            drops.setdefault(tier, []).extend(dropped)
            t.dropped += len(dropped)
        if moved:
            # Deeper demotions were appended first by the recursive calls: deepest first.
            demotions.append(Demotion(tier, tier + 1, tuple(moved)))
        return True

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Reserve room in the first tier for the keys not yet present; see the module doc."""
        self._check()
        check_keys(keys)
        new: list[bytes] = []
        positions: list[int] = []
        skipped: list[bytes] = []
        seen: set[bytes] = set()
        indexes = [t.index for t in self._tiers]
        if len(indexes) == 1 and len(set(keys)) == len(keys):  # the common shape, kept tight
            index = indexes[0]
            seen = set(keys)
            for i, key in enumerate(keys):
                if key in index:
                    skipped.append(key)
                else:
                    new.append(key)
                    positions.append(i)
        else:
            for i, key in enumerate(keys):
                if key in seen:
                    continue
                seen.add(key)
                for index in indexes:
                    if key in index:
                        skipped.append(key)
                        break
                else:
                    new.append(key)
                    positions.append(i)
        self._note_seen(seen)
        plan_id = next(self._plan_ids)
        self.counters["store_skipped"] += len(skipped)
        if not new:
            return StorePlan(plan_id, (), (), skipped=tuple(skipped))
        drops: dict[int, list[bytes]] = {}
        demotions: list[Demotion] = []
        pending: list[tuple[int, bytes]] = []
        events: list[_RawEvent] = []
        first = self._tiers[0]
        # The whole batch is protected, skipped keys included: evicting a key the caller just
        # asked to keep would undo part of this very store.
        batch = seen
        reserve0 = first.spec.block_reserve
        if not self._make_room(0, reserve0 * len(new), batch, drops, demotions, pending, events):
            self.counters["store_rejected"] += 1
            return None
        index0 = first.index
        for key in new:
            index0[key] = _PENDING
        first.used += reserve0 * len(new)
        if first.spec.variable_size:
            first.sizes.update(dict.fromkeys(new, reserve0))
        through: list[tuple[int, tuple[bytes, ...]]] = []
        if self.write_mode == "through":
            for ti in range(1, len(self._tiers)):
                t = self._tiers[ti]
                room = [k for k in new if k not in t.index and self._admits(ti, k)]
                # Best effort: a lower tier that cannot make room simply does not get the copy.
                if room and self._make_room(ti, t.spec.block_reserve * len(room), batch, drops, demotions, pending, events):
                    for key in room:
                        t.add(key, _PENDING, t.spec.block_reserve)
                        pending.append((ti, key))
                    through.append((ti, tuple(room)))
        plan = StorePlan(
            plan_id=plan_id,
            keys=tuple(new),
            positions=tuple(positions),
            tier=0,
            write_through=tuple(through),
            drops=tuple((ti, tuple(ks)) for ti, ks in sorted(drops.items(), reverse=True)),
            demotions=tuple(demotions),
            skipped=tuple(skipped),
        )
        self._plans[plan_id] = _OpenPlan(plan, set(new), pending)
        self._plan_of.update(dict.fromkeys(new, plan_id))
        self._emit(events)
        self.counters["store_prepared"] += len(new)
        return plan

    def prepare_promote(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Bring ``keys`` just loaded from a lower tier back into the first tier.

        Only keys ready in a lower tier and absent from the first tier (neither pending nor
        ready there) are promoted; the others are ``skipped``. Room is made exactly as for
        ``prepare_store``: tier-0 victims are demoted down the chain (write-back) or dropped,
        never a key of this batch (skipped ones included) nor a pinned key; **atomic**, ``None``
        and no change when the first tier cannot make room. Promoted keys are pending in the
        first tier and stay ready in their lower tier meanwhile, so lookups and loads keep
        hitting them; the lower copy is kept afterwards too (evicting the promoted copy later
        then just drops it, with no write-back).

        The returned plan is executed as an ordinary store job whose source is the engine
        blocks the load just filled (they hold exactly the stored bytes; ``positions`` index
        ``keys``), on the store direction, so a load never waits for the write-backs; it is
        finished with ``complete_store``.
        """
        self._check()
        check_keys(keys)
        new: list[bytes] = []
        positions: list[int] = []
        sources: list[int] = []
        skipped: list[bytes] = []
        seen: set[bytes] = set()
        first = self._tiers[0]
        lower = [(ti, t.index) for ti, t in enumerate(self._tiers) if ti > 0]
        for i, key in enumerate(keys):
            if key in seen:
                continue
            seen.add(key)
            src = None
            if key not in first.index:
                for ti, index in lower:
                    code = index.get(key)
                    if code is not None and code & _READY:
                        src = ti
                        break
            if src is None:
                skipped.append(key)
            else:
                new.append(key)
                positions.append(i)
                sources.append(src)
        plan_id = next(self._plan_ids)
        if not new:
            return StorePlan(plan_id, (), (), skipped=tuple(skipped))
        drops: dict[int, list[bytes]] = {}
        demotions: list[Demotion] = []
        pending: list[tuple[int, bytes]] = []
        events: list[_RawEvent] = []
        reserve0 = first.spec.block_reserve
        # The batch is protected in every tier: the promoted keys' lower copies stay readable,
        # and the load's other keys (already in the first tier) are not evicted for them.
        if not self._make_room(0, reserve0 * len(new), seen, drops, demotions, pending, events):
            self.counters["promotions_rejected"] += 1
            return None
        for key in new:
            first.add(key, _PENDING, reserve0)
        plan = StorePlan(
            plan_id=plan_id,
            keys=tuple(new),
            positions=tuple(positions),
            tier=0,
            drops=tuple((ti, tuple(ks)) for ti, ks in sorted(drops.items(), reverse=True)),
            demotions=tuple(demotions),
            skipped=tuple(skipped),
        )
        self._plans[plan_id] = _OpenPlan(plan, set(new), pending, dict(zip(new, sources)))
        self._plan_of.update(dict.fromkeys(new, plan_id))
        self._promotion_plans += 1
        self._emit(events)
        self.counters["promotions_prepared"] += len(new)
        return plan

    def complete_store(
        self,
        keys: Sequence[bytes],
        success: bool = True,
        *,
        sizes: Mapping[int, Mapping[bytes, int]] | None = None,
        failed: Mapping[int, Iterable[bytes]] | None = None,
    ) -> None:
        """Finish the store of ``keys`` (pending -> ready, or released on failure).

        ``sizes`` gives the stored size per tier for variable-size tiers; ``failed`` names
        keys whose write to a given tier (a demotion or a write-through copy) failed, which are
        then dropped from that tier. When the last key of a plan completes, the plan's
        demotions and write-through copies become ready too.
        """
        self._check()
        check_keys(keys)
        keys = list(dict.fromkeys(keys))
        plan_of = self._plan_of
        for i, key in enumerate(keys):
            if key not in plan_of:
                raise LifecycleError(f"complete_store: keys[{i}] ({key.hex()[:16]}…) was never prepared or is already complete")
        failed_sets = {ti: set(ks) for ti, ks in (failed or {}).items()}
        events: list[_RawEvent] = []
        first = self._tiers[0]
        failed0 = failed_sets.get(0, ())
        plan_ids = {plan_of.pop(key) for key in keys}
        if success and not failed0 and not first.spec.variable_size and not first.spec.persistent:
            # The common case, kept tight: every key became ready in a fixed-size memory tier.
            index0, insert0, name0 = first.index, first.spec.policy.insert, first.spec.name
            for key in keys:
                index0[key] = _READY
                insert0(key)
            events.extend([("stored", key, name0) for key in keys])
            done, bad = len(keys), 0
        else:
            done = bad = 0
            for key in keys:
                if success and key not in failed0:
                    self._finish_entry(0, key, sizes, events)
                    done += 1
                else:
                    first.discard(key)
                    bad += 1
        if self._promotion_plans:
            done, bad = self._count_promotions(keys, plan_ids, success, failed0, done, bad)
        for plan_id in plan_ids:
            open_plan = self._plans[plan_id]
            open_plan.remaining.difference_update(keys)
            if open_plan.remaining:
                continue
            del self._plans[plan_id]
            if open_plan.sources is not None:
                self._promotion_plans -= 1
            through_tiers = {wt for wt, _ in open_plan.plan.write_through}
            plan_keys = set(open_plan.plan.keys) if through_tiers else set()
            for ti, pkey in open_plan.pending:
                t = self._tiers[ti]
                if t.index.get(pkey) != _PENDING:
                    continue
                written_through = ti in through_tiers and pkey in plan_keys
                if pkey in failed_sets.get(ti, ()) or (written_through and not success):
                    t.discard(pkey)
                    t.dropped += 1
                else:
                    self._finish_entry(ti, pkey, sizes, events)
        self.counters["store_completed"] += done
        self.counters["store_failed"] += bad
        self._emit(events)

    def _count_promotions(
        self, keys: list[bytes], plan_ids: set[int], success: bool, failed0: Collection[bytes], done: int, bad: int
    ) -> tuple[int, int]:
        """Count the promotion keys among ``keys`` as promotions, not stores; return the
        store counts (``done``, ``bad``) without them."""
        for plan_id in plan_ids:
            sources = self._plans[plan_id].sources
            if sources is None:
                continue
            for key in keys:
                src = sources.get(key)
                if src is None:
                    continue
                if success and key not in failed0:
                    self.counters["promotions"] += 1
                    self._tiers[src].promotions_out += 1
                    done -= 1
                else:
                    self.counters["promotions_failed"] += 1
                    bad -= 1
        return done, bad

    def _finish_entry(self, ti: int, key: bytes, sizes: Mapping[int, Mapping[bytes, int]] | None, events: list[_RawEvent]) -> None:
        t = self._tiers[ti]
        if t.spec.variable_size and sizes and key in sizes.get(ti, {}):
            actual = sizes[ti][key]
            t.used += actual - t.size_of(key)
            t.sizes[key] = actual
        t.index[key] = _READY
        t.spec.policy.insert(key)
        if t.spec.persistent:
            t.stamps[key] = self._clock()
        events.append(("stored", key, t.spec.name))

    # -- load ------------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes], *, promote: bool = True) -> LoadPlan:
        """Pin every key in the fastest tier that holds it ready.

        With ``promote`` (in-load promotion), keys served from a lower tier are also reserved in
        the first tier when it has *free* room, and the load job copies them up as it reads
        them (listed in ``LoadPlan.promote``, settled by ``complete_load``). This never evicts,
        so in steady state, with the first tier full, it promotes nothing. Callers that can run
        a store job on the loaded engine blocks afterwards (``KVStore.load``, the connector with
        a step loop) pass ``promote=False`` and use :meth:`prepare_promote` instead, which
        evicts and demotes like a store; the in-load form stays for callers that cannot (an
        engine's own offloading manager, engines without a step loop)."""
        self._check()
        check_keys(keys)
        where: list[int] = []
        indexes = list(enumerate(t.index for t in self._tiers))
        for i, key in enumerate(keys):
            for ti, index in indexes:
                code = index.get(key)
                if code is not None and code & _READY:
                    where.append(ti)
                    break
            else:
                raise LifecycleError(f"prepare_load: keys[{i}] ({key.hex()[:16]}…) is not ready in any tier")
        now = self._clock()
        for key, ti in zip(keys, where):
            t = self._tiers[ti]
            t.index[key] += _PIN
            t.pinned.add(key)
            t.spec.policy.touch(key)
            if t.spec.persistent:
                t.stamps[key] = now
        self.counters["load_prepared"] += len(keys)
        self._note_seen(keys)
        promoted: list[bytes] = []
        if promote and len(self._tiers) > 1:
            first = self._tiers[0]
            reserve = first.spec.block_reserve
            for key, ti in zip(keys, where):
                if ti == 0 or key in first.index or first.used + reserve > first.spec.capacity_bytes:
                    continue
                first.add(key, _PENDING, reserve)
                self._promoting[key] = self._promoting.get(key, 0) + 1
                promoted.append(key)
        return LoadPlan(tuple(keys), tuple(where), tuple(promoted))

    def complete_load(self, keys: Sequence[bytes], *, failed_promotions: Iterable[bytes] = ()) -> None:
        """Unpin keys pinned by ``prepare_load`` (once per pin) and settle their promotions:
        ready in the first tier, or released if named in ``failed_promotions``."""
        self._check()
        check_keys(keys)
        located: list[_Tier] = []
        tiers = self._tiers
        if len(set(keys)) == len(keys):  # the common case: each key once
            for i, key in enumerate(keys):
                for t in tiers:
                    code = t.index.get(key)
                    if code is not None and code >= _PIN:
                        located.append(t)
                        break
                else:
                    raise LifecycleError(f"complete_load: keys[{i}] ({key.hex()[:16]}…) is not pinned")
        else:
            counts: dict[tuple[int, bytes], int] = {}
            for i, key in enumerate(keys):
                for ti, t in enumerate(tiers):
                    code = t.index.get(key)
                    if code is not None and code >= _PIN and counts.get((ti, key), 0) < code // _PIN:
                        counts[(ti, key)] = counts.get((ti, key), 0) + 1
                        located.append(t)
                        break
                else:
                    raise LifecycleError(f"complete_load: keys[{i}] ({key.hex()[:16]}…) is not pinned")
        for key, t in zip(keys, located):
            code = t.index[key] - _PIN
            t.index[key] = code
            if code < _PIN:
                t.pinned.discard(key)
        if not self._promoting:
            return
        bad = set(failed_promotions)
        events: list[_RawEvent] = []
        first = self._tiers[0]
        for key in keys:
            if key not in self._promoting:
                continue
            del self._promoting[key]
            if first.index.get(key) != _PENDING:
                continue
            if key in bad:
                first.discard(key)
                self.counters["promotions_failed"] += 1
            else:
                self._finish_entry(0, key, None, events)
                self.counters["promotions"] += 1
                for t in tiers[1:]:
                    code = t.index.get(key)
                    if code is not None and code & _READY:
                        t.promotions_out += 1
                        break
        self._emit(events)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark keys as recently used in every tier that holds them ready."""
        self._check()
        check_keys(keys)
        now = self._clock()
        for t in self._tiers:
            index, policy = t.index, t.spec.policy
            for key in keys:
                code = index.get(key)
                if code is not None and code & _READY:
                    policy.touch(key)
                    if t.spec.persistent:
                        t.stamps[key] = now

    def remove(self, keys: Sequence[bytes], tier: int) -> list[bytes]:
        """Forget ready, unpinned ``keys`` in ``tier`` (after a failed read found them gone or
        corrupt). Returns the keys removed; the caller deletes their bytes."""
        self._check()
        check_keys(keys)
        t = self._tiers[tier]
        removed = [k for k in keys if t.index.get(k) == _READY]
        for key in removed:
            t.discard(key)
            self._events_append(("removed", key, t.spec.name))
        return removed

    # -- persistence -----------------------------------------------------------------------
    def adopt(self, tier: int, records: Iterable[tuple[bytes, int, float]]) -> list[bytes]:
        """Rebuild ``tier``'s index from stored records ``(key, stored_bytes, stamp)`` at open.

        Records are inserted oldest stamp first, so eviction order survives a restart. Records
        beyond the tier's capacity (oldest first) are not adopted and are returned for deletion.
        """
        t = self._tiers[tier]
        ordered = sorted(records, key=lambda r: r[2])
        total = sum(r[1] if t.spec.variable_size else t.spec.block_reserve for r in ordered)
        excess: list[bytes] = []
        for key, nbytes, _stamp in ordered:
            size = nbytes if t.spec.variable_size else t.spec.block_reserve
            if total > t.spec.capacity_bytes or key in t.index:
                excess.append(key)
                total -= size
                continue
            t.add(key, _READY, size)
            t.spec.policy.insert(key)
        return excess

    def take_stamps(self, tier: int) -> list[tuple[bytes, float]]:
        """Access stamps recorded since the last call, for a persistent tier to save."""
        t = self._tiers[tier]
        stamps = [(k, s) for k, s in t.stamps.items() if k in t.index]
        t.stamps.clear()
        return stamps

    # -- events and stats ------------------------------------------------------------------
    def _events_append(self, event: _RawEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.counters["events_dropped"] += 1
        self._events.append(event)

    def _emit(self, events: list[_RawEvent]) -> None:
        if not events:
            return
        limit = self._events.maxlen
        if limit is not None:
            self.counters["events_dropped"] += max(0, len(self._events) + len(events) - limit)
        self._events.extend(events)

    def take_events(self) -> list[CacheEvent]:
        """Stored / removed events since the last call, oldest first."""
        events = [CacheEvent(kind, key, tier) for kind, key, tier in self._events]
        self._events.clear()
        return events

    def stats(self) -> dict[str, Any]:
        tiers = []
        for t in self._tiers:
            ready = sum(1 for c in t.index.values() if c & _READY)
            tiers.append(
                {
                    "name": t.spec.name,
                    "capacity_bytes": t.spec.capacity_bytes,
                    "used_bytes": t.used,
                    "blocks": len(t.index),
                    "ready": ready,
                    "pending": len(t.index) - ready,
                    "pinned": sum(1 for c in t.index.values() if c >= _PIN),
                    "evictions": t.evictions,
                    "demotions_in": t.demotions_in,
                    "dropped": t.dropped,
                    "promotions": t.promotions_out,
                }
            )
        return {**self.counters, "open_plans": len(self._plans), "tiers": tiers}
