"""Plans: what a transfer job must do, and how the manager builds and settles them.

:class:`StorePlan`, :class:`LoadPlan` and :class:`Demotion` are the value objects the manager
hands out (also exported by :mod:`kvtier.manager`). :class:`PlanBuilder` makes one store plan
for ``prepare_store`` and ``prepare_promote`` alike: ``make_room`` evicts down the chain,
``reserve`` adds pending entries, ``build`` freezes the result. :class:`OpenPlan` is what the
manager keeps of a plan until its last key completes, and :class:`PlanBook` keeps the open
ones and settles them in ``complete_store``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import repeat
from types import MappingProxyType
from typing import cast

from kvtier.manager.admission import Admission
from kvtier.manager.eventlog import EventBatch, EventLog
from kvtier.manager.lookups import reserve_keys
from kvtier.manager.promotion import Promotions
from kvtier.manager.tiers import PENDING, TierState

__all__ = ["Completion", "Demotion", "LoadPlan", "OpenPlan", "PlanBook", "PlanBuilder", "StorePlan", "TagWrites"]

#: tenant tags and pin changes for persistent tiers to save: (tier, ((key, tenant), ...),
#: ((key, pinned), ...)) per tier (see ``Backend.write_tags``)
TagWrites = tuple[tuple[int, tuple[tuple[bytes, str], ...], tuple[tuple[bytes, bool], ...]], ...]


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
    them from ``src``), then write ``keys`` into ``tier`` and into every tier of ``write_through``;
    last, ``tags`` are saved with their tiers (tenant tags and pins a scheduler ships to ranks).

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
    tags: TagWrites = ()

    @property
    def empty(self) -> bool:
        return not self.keys and not self.drops and not self.demotions and not self.tags


class _PlainPlan:
    """A :class:`StorePlan`'s slots, set by plain attribute stores (a frozen dataclass's own
    ``__init__`` goes through ``object.__setattr__`` once per field: twice the cost of the
    rest of the common store's ``prepare_store``). :func:`plain_plan` turns one into a
    :class:`StorePlan`, frozen from then on; the layouts are the same, slot for slot."""

    __slots__ = StorePlan.__slots__

    def __init__(self, plan_id: int, keys: tuple[bytes, ...], positions: tuple[int, ...], drops: tuple[tuple[int, tuple[bytes, ...]], ...]) -> None:
        self.plan_id = plan_id
        self.keys = keys
        self.positions = positions
        self.tier = 0
        self.write_through = ()
        self.drops = drops
        self.demotions = ()
        self.skipped = ()
        self.tags = ()


def plain_plan(plan_id: int, keys: tuple[bytes, ...], positions: tuple[int, ...], drops: tuple[tuple[int, tuple[bytes, ...]], ...] = ()) -> StorePlan:
    """``StorePlan(plan_id, keys, positions, drops=drops)``, made as :class:`_PlainPlan` (a test
    compares the two, and checks the result is as frozen as the dataclass's own)."""
    plan = _PlainPlan(plan_id, keys, positions, drops)
    plan.__class__ = StorePlan  # type: ignore[assignment]
    return plan  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The tier each key is read from (``tiers[i]`` for ``keys[i]``); every key is pinned.

    ``promote`` lists keys read from a lower tier that the load job also copies into the first
    tier (reserved, pending until ``complete_load``). ``vanished`` lists keys a shared tier's
    follower forgot between the load's find and its pin: a miss of one forgets nothing, since
    what the tier holds under that key by then is a later store or adoption (``apply_result``).
    It is the pinning side's to know; the workers' copy of the plan does not carry it."""

    keys: tuple[bytes, ...]
    tiers: tuple[int, ...]
    promote: tuple[bytes, ...] = ()
    vanished: frozenset[bytes] = frozenset()


class PlanBuilder:
    """Accumulates one store plan into the first tier over ``tiers``.

    Keys of ``protected`` (the caller's whole batch) and pinned keys are never evicted. Victims
    of a tier are demoted to the next one in write-back mode (when it admits them and can make
    room) and dropped otherwise. ``make_room`` returns ``False`` only before anything changed,
    so a caller that gets ``False`` for the first tier simply drops the builder.
    """

    __slots__ = (
        "admission", "demoted", "demotions", "drops", "events", "keys", "protected", "protected_below", "through", "tiers", "write_back"
    )

    def __init__(
        self,
        tiers: Sequence[TierState],
        protected: AbstractSet[bytes],
        *,
        write_back: bool,
        admission: Admission,
        keep_below: AbstractSet[bytes] = frozenset(),
    ) -> None:
        self.tiers = tiers
        self.protected = protected
        #: what lower tiers never evict: the batch, and ``keep_below`` (keys that may leave the
        #: first tier, but must stay stored: earlier runs of a save larger than the first tier)
        self.protected_below = protected | keep_below if keep_below else protected
        self.write_back = write_back and len(tiers) > 1
        self.admission = admission
        self.keys: list[bytes] = []  # reserved in the first tier: the plan's own keys
        self.through: dict[int, list[bytes]] = {}  # write-through copies, by tier
        self.drops: dict[int, list[bytes]] = {}
        self.demotions: list[Demotion] = []
        self.demoted: dict[int, list[bytes]] = {}  # demoted keys pending in their new tier
        self.events: list[EventBatch] = []

    def make_room(self, tier: int, nbytes: int, tenant: str | None = None) -> bool:
        """Free ``nbytes`` in ``tier`` for ``tenant``'s blocks (its quota there included),
        demoting or dropping victims; ``False`` (no change) if impossible."""
        t = self.tiers[tier]
        victims = t.make_room(nbytes, self.protected if tier == 0 else self.protected_below, tenant)
        if not victims:
            return victims is not None
        # Every victim leaves this tier now; routers that track tiers must hear of it.
        self.events.append(("removed", victims, t.name))
        dropped = victims
        if self.write_back and tier + 1 < len(self.tiers):
            moved = self._demote(tier, victims)
            if moved:
                gone = set(moved)
                dropped = [key for key in victims if key not in gone]
        if dropped:
            # Still readable below (write-through, or a copy already there), or gone.
            self.drops.setdefault(tier, []).extend(dropped)
            t.dropped += len(dropped)
        return True

    def _demote(self, tier: int, victims: list[bytes]) -> list[bytes]:
        """Reserve ``victims`` of ``tier`` in the next tier; return the keys moved there."""
        nxt = tier + 1
        dst = self.tiers[nxt]
        index = dst.index
        keys = self.admission.admitted(nxt, [key for key in victims if key not in index])
        if not keys:
            return keys
        if dst.quotas_apply():  # each victim goes under its own tenant's quota below, if it can
            assert dst.tenancy is not None
            owner = dst.tenancy.tenant
            fit: list[bytes] = []
            for key in keys:
                if self.make_room(nxt, dst.block, owner(key)):
                    dst.reserve((key,))
                    fit.append(key)
            keys = fit
        elif self.make_room(nxt, dst.block * len(keys)):
            dst.reserve(keys)
        else:  # not all of them fit (pinned or protected keys below): as many as can, in order
            fit = []
            for key in keys:
                if not self.make_room(nxt, dst.block):
                    break
                dst.reserve((key,))
                fit.append(key)
            keys = fit
        if not keys:
            return keys
        dst.demotions_in += len(keys)
        self.demoted.setdefault(nxt, []).extend(keys)
        # Deeper demotions were appended by make_room above: the plan lists them first.
        self.demotions.append(Demotion(tier, nxt, tuple(keys)))
        return keys

    def reserve(self, tier: int, keys: list[bytes]) -> None:
        """Pending entries for ``keys`` in ``tier`` (after ``make_room``): the plan's own keys in
        the first tier, write-through copies in a lower one."""
        self.tiers[tier].reserve(keys)
        if tier == 0:
            self.keys += keys
        else:
            self.through.setdefault(tier, []).extend(keys)

    def build(self, plan_id: int, positions: tuple[int, ...], skipped: tuple[bytes, ...]) -> StorePlan:
        # (The empty cases skip building generators: a plan without evictions or copies is
        # the common store, and this runs once per batch.)
        return StorePlan(
            plan_id,
            tuple(self.keys),
            positions,
            0,
            tuple((ti, tuple(ks)) for ti, ks in self.through.items()) if self.through else (),
            tuple((ti, tuple(ks)) for ti, ks in sorted(self.drops.items(), reverse=True)) if self.drops else (),
            tuple(self.demotions),
            skipped,
        )

    def open(self, sources: dict[bytes, int] | None = None) -> OpenPlan:
        """What the manager keeps of the built plan until its last key completes."""
        return OpenPlan(len(self.keys), self.demoted, self.through, sources)


@dataclass(slots=True)
class Completion:
    """What ``complete_store`` was told: whether the job succeeded, the keys whose write to a
    tier failed, and the sizes stored in variable-size tiers."""

    success: bool
    failed: Mapping[int, Collection[bytes]]
    sizes: Mapping[int, Mapping[bytes, int]] | None
    now: float

    def split(self, tier: int, keys: Sequence[bytes], *, all_lost: bool = False) -> tuple[Sequence[bytes], Sequence[bytes]]:
        """``keys`` written to ``tier``, and those that were not."""
        lost = self.failed.get(tier)
        if all_lost:
            return [], keys
        if not lost:
            return keys, []
        return [key for key in keys if key not in lost], [key for key in keys if key in lost]

    def sizes_in(self, tier: int) -> Mapping[bytes, int] | None:
        return self.sizes.get(tier) if self.sizes else None


@dataclass(slots=True)
class OpenPlan:
    """A plan with ``remaining`` keys not completed yet (each completes once: completing it
    takes it out of the book). Its lower-tier copies (demoted keys and write-through copies)
    settle together when the last key completes."""

    remaining: int
    demoted: Mapping[int, list[bytes]] = field(default_factory=dict)
    through: Mapping[int, list[bytes]] = field(default_factory=dict)
    #: Promotion plans only: the lower tier each key was ready in when the plan was made.
    sources: dict[bytes, int] | None = None

    def copying(self, ready: Collection[bytes]) -> list[bytes]:
        """The keys of ``ready`` (just ready above) whose write-through copy is pending below."""
        through = set().union(*self.through.values())
        return [key for key in ready if key in through]

    def settle(self, tiers: Sequence[TierState], result: Completion, out: list[EventBatch]) -> None:
        """Copies become ready, except those whose write failed, which are dropped; a failed
        store fails its write-through copies too."""
        if not self.demoted and not self.through:
            return
        for copies, all_lost in ((self.demoted, False), (self.through, not result.success)):
            for ti, keys in copies.items():
                t = tiers[ti]
                index = t.index
                good, lost = result.split(ti, [key for key in keys if index.get(key) == PENDING], all_lost=all_lost)
                t.settle(good, result.sizes_in(ti), result.now)
                out.append(("stored", good, t.name))
                if lost:
                    t.release(lost)
                    t.dropped += len(lost)


class PlanBook:
    """The open plans over ``tiers``: how a plan is made (``prepare``), the plan of each pending
    first-tier key, and what settles when a plan's last key completes (``complete``)."""

    def __init__(self, tiers: Sequence[TierState], *, write_back: bool, admission: Admission, promotions: Promotions, events: EventLog) -> None:
        self._tiers = tiers
        self._write_back = write_back
        #: no write-through copies below the first tier (write-back, or a single tier): a
        #: store that fits in the free room of the first tier needs no builder (``prepare``)
        self._no_copies = write_back or len(tiers) == 1
        self._admission = admission
        self._promotions = promotions
        self._events = events
        self._plans: dict[int, OpenPlan] = {}
        self._plan_of: dict[bytes, int] = {}
        self._first = tiers[0]
        self._below = tuple(t.index for t in tiers[1:])
        #: Keys ready above whose write-through copy below is still pending (completed ahead
        #: of the rest of their plan). A pending copy is not a copy: if it fails, evicting
        #: the key would leave it in no tier, so no plan evicts these until their plan settles.
        self._copying: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._plans)

    def prepare(
        self,
        plan_id: int,
        keys: Sequence[bytes],
        protected: AbstractSet[bytes],
        new: list[bytes],
        sources: dict[bytes, int] | None = None,
        *,
        partial: bool = False,
        keep_below: AbstractSet[bytes] = frozenset(),
        tenant: str | None = None,
    ) -> StorePlan | None:
        """Make room for ``new`` (keys of ``keys``, ``tenant``'s) in the first tier, reserve, and open the plan;
        ``None`` and no change when the first tier cannot make room. ``sources`` marks a
        promotion (no write-through copies). Keys of ``protected`` are never evicted. With
        ``partial``, a first tier without room for all of ``new`` takes the leading run of it
        that fits (``None`` only when not one block fits). Keys of ``keep_below`` may be moved
        out of the first tier but are never evicted from a lower one."""
        skipped: tuple[bytes, ...] = ()
        if len(new) != len(protected):
            fresh = set(new)
            skipped = tuple(key for key in dict.fromkeys(keys) if key not in fresh)
        if not new:
            return StorePlan(plan_id, (), (), skipped=skipped)
        tiers = self._tiers
        first = tiers[0]
        tenancy = first.tenancy
        if (
            sources is None
            and self._no_copies
            and (tenancy is None or not tenancy.active)
            and first.used + first.block * len(new) <= first.capacity
        ):
            # The common store: the keys fit in the first tier's free room and no copy goes
            # below. What the builder does then (no victim, no event, no copy), without it: a
            # test compares the two.
            first.reserve(new)
            self._plans[plan_id] = OpenPlan(len(new))
            plan_of = self._plan_of
            for key in new:
                plan_of[key] = plan_id
            return StorePlan(plan_id, tuple(new), _positions(keys, new), 0, (), (), (), skipped)
        # Write-through plans demote too: a victim without a copy below (its write-through was
        # deferred, refused or failed) falls back to write-back; one with a copy is dropped.
        guarded = protected | self._copying if self._copying else protected
        builder = PlanBuilder(tiers, guarded, write_back=True, admission=self._admission, keep_below=keep_below)
        if sources is not None and tiers[0].quotas_apply():
            new = _promote_by_tenant(builder, new)  # blocks of several tenants, each under its quota
            if not new:
                return None
        elif not builder.make_room(0, tiers[0].block * len(new), tenant):
            fit = min(len(new) - 1, tiers[0].blocks_that_fit(guarded)) if partial else 0
            # blocks_that_fit is exact for fixed-size tiers without quotas; a variable-size one
            # may free less, and a tenant's quota may allow less.
            while fit > 0 and not builder.make_room(0, tiers[0].block * fit, tenant):
                fit -= 1
            if fit <= 0:
                return None
            new = new[:fit]
        if not builder.keys:
            builder.reserve(0, new)
        if sources is None and not self._write_back:
            for ti, t in enumerate(tiers[1:], start=1):
                room = self._admission.admitted(ti, [key for key in new if key not in t.index])
                # Best effort: a lower tier that cannot make room simply does not get the copy.
                if room and builder.make_room(ti, t.block * len(room), tenant):
                    builder.reserve(ti, room)
        self._plans[plan_id] = builder.open(sources)
        plan_of = self._plan_of
        for key in new:
            plan_of[key] = plan_id
        if builder.events:
            self._events.extend(builder.events)
        return builder.build(plan_id, _positions(keys, new), skipped)

    def open_new(self, ids: Iterator[int], keys: Sequence[bytes]) -> StorePlan | None:
        """The common store in one step: ``keys`` (a list or tuple), each a well-formed key,
        none repeated and none held by any tier, fit in the first tier's free room (or, when it
        is the only tier, in the room its policy's victims free: they are dropped) and no copy
        goes below (write-back, or one tier) and no tenant is counted. Its plan (numbered by
        ``ids``), or ``None`` and no change otherwise: the caller then takes :meth:`prepare`,
        which gives the same plan here (a test compares the two)."""
        if type(keys) is not list and type(keys) is not tuple:
            return None
        first = self._first
        n = len(keys)
        over = first.used + first.block * n - first.capacity  # > 0: the victims to drop first
        if not self._no_copies or self._admission.enabled or first.tenancy is not None or not n:
            return None
        if over > 0 and (self._below or first.block * n > first.capacity):
            return None
        index = first.index
        try:  # (a pass in C each: none held is the common store)
            if not index.keys().isdisjoint(keys) or (self._below and any(not below.keys().isdisjoint(keys) for below in self._below)):
                return None
        except TypeError:  # an unhashable key: prepare names it
            return None
        before = len(index)
        if reserve_keys(index, keys, PENDING):  # the check of each key, in the loop that reserves it
            # (The new keys are pending: not in the policy, so never victims of their own batch.)
            victims = first.evict(over, _NOTHING) if over > 0 and len(index) - before == n else []
            if victims is not None and len(index) - before + len(victims) == n:
                first.used += first.block * n
                first.pending += n
                plan_id = next(ids)
                plan_of = self._plan_of
                for key in keys:
                    plan_of[key] = plan_id
                self._plans[plan_id] = OpenPlan(n, _NO_COPIES, _NO_COPIES)
                positions = _RANGES[n] if n < len(_RANGES) else tuple(range(n))  # (_leading, inline)
                if not victims:
                    return plain_plan(plan_id, keys if type(keys) is tuple else tuple(keys), positions)
                first.dropped += len(victims)  # dropped, as the builder does: counted, announced
                self._events.add("removed", victims, first.name)
                return plain_plan(plan_id, keys if type(keys) is tuple else tuple(keys), positions, ((0, tuple(victims)),))
        for key in keys:  # a bad or repeated key: none was held before, so each one reserved goes
            index.pop(key, None)
        return None

    def unknown(self, keys: Sequence[bytes]) -> int | None:
        """The index of the first of ``keys`` that no open plan holds, or ``None``."""
        plan_of = self._plan_of
        try:
            if all(map(plan_of.__contains__, keys)):
                return None
        except TypeError:  # unhashable: not a key
            pass
        for i, key in enumerate(keys):
            try:
                if key not in plan_of:
                    return i
            except TypeError:
                return i
        return None

    def take(self, keys: Sequence[bytes]) -> list[int] | None:
        """Take ``keys`` out of the book when each is open and none repeats (the common
        ``complete_store``): their plan ids, in order. ``None`` and no change otherwise (a key
        not open, a repeat, an unhashable key): the caller then takes the general path,
        :meth:`unknown` and :meth:`complete` without ``owners``."""
        plan_of = self._plan_of
        owners: list[int | None] = []
        try:
            # One pass that takes the keys out; anything unusual puts back what it took. (On an
            # error, ``extend`` keeps what it appended before it: the keys before an unhashable
            # one, which a test checks are put back.)
            owners.extend(map(plan_of.pop, keys, repeat(None)))
        except TypeError:
            plan_of.update((key, owner) for key, owner in zip(keys, owners) if owner is not None)
            return None
        if None in owners:  # a key not open, or a repeat (its second pop found nothing): put back
            plan_of.update((key, owner) for key, owner in zip(keys, owners) if owner is not None)
            return None
        return cast("list[int]", owners)

    def complete_plain(self, keys: Sequence[bytes], owners: list[int], now: float) -> bool:
        """:meth:`complete` of a successful store with nothing failed and no sizes, when every
        key is of one plan that copies nothing below and promotes nothing (the common store):
        ``True`` once done, ``False`` (no change) for any other plan. ``owners`` is what
        :meth:`take` returned for ``keys``. A test compares the two paths."""
        plan_id = owners[0]
        plan = self._plans[plan_id]
        if plan.sources is not None or plan.demoted or plan.through or owners.count(plan_id) != len(owners):
            return False
        ok = keys if type(keys) is tuple else list(keys)  # the event log keeps the sequence
        first = self._tiers[0]
        first.settle(ok, None, now)
        plan.remaining -= len(ok)
        if not plan.remaining:
            del self._plans[plan_id]
        self._events.add("stored", ok, first.name)
        return True

    def complete_new(self, keys: Sequence[bytes], now: Callable[[], float]) -> int:
        """The common ``complete_store`` in one step: ``keys`` succeeded, each open and none
        repeated, all of one plan that copies nothing below and promotes nothing. The number of
        keys made ready, or 0 and no change otherwise (the caller then takes the general path:
        :meth:`take`, :meth:`complete_plain`, :meth:`complete`; a test compares the two).
        ``now`` stamps them in a persistent first tier."""
        plan_of = self._plan_of
        try:
            plan_id = plan_of.get(keys[0], 0)  # (plans are numbered from 1)
        except Exception:  # no key, or not a key: the general path names it
            return 0
        plan = self._plans.get(plan_id)
        if plan is None or plan.sources is not None or plan.demoted or plan.through:
            return 0
        owners: list[int | None] = []
        try:
            owners.extend(map(plan_of.pop, keys, repeat(None)))
        except TypeError:  # an unhashable key: put back what was taken before it
            plan_of.update((key, owner) for key, owner in zip(keys, owners) if owner is not None)
            return 0
        n = len(owners)
        if owners.count(plan_id) != n:  # a key not open, of another plan, or repeated: put back
            plan_of.update((key, owner) for key, owner in zip(keys, owners) if owner is not None)
            return 0
        ok = keys if type(keys) is tuple else list(keys)  # the event log keeps the sequence
        first = self._first
        first.settle(ok, None, now() if first.persistent else 0.0)
        plan.remaining -= n
        if not plan.remaining:
            del self._plans[plan_id]
        self._events.add("stored", ok, first.name)
        return n

    def complete(self, keys: Sequence[bytes], result: Completion, owners: list[int] | None = None) -> tuple[int, int]:
        """Settle ``keys`` (every one open) and the plans they complete; return the stores that
        succeeded and failed (promotions are counted by :class:`Promotions`). ``owners``: the
        plan ids :meth:`take` took ``keys`` out with (else they are taken here, repeats
        once)."""
        unique: Sequence[bytes]
        if owners is None:
            unique = list(dict.fromkeys(keys))
            owners = list(map(self._plan_of.pop, unique))
        else:  # distinct keys; a copy unless immutable (the event log keeps the sequence)
            unique = keys if type(keys) is tuple else list(keys)
        plan_ids = set(owners)
        ok, bad = result.split(0, unique, all_lost=not result.success)
        first = self._tiers[0]
        first.settle(ok, result.sizes_in(0), result.now)
        out: list[EventBatch] = [("stored", ok, first.name)]
        if bad:
            first.release(bad)
        done, lost = len(ok), len(bad)
        for plan_id in plan_ids:
            plan = self._plans[plan_id]
            if plan.sources is not None:  # promotions are counted as such, not as stores
                promoted, not_promoted = self._promotions.plan_completed(plan.sources, ok, bad)
                done -= promoted
                lost -= not_promoted
            plan.remaining -= len(owners) if len(plan_ids) == 1 else owners.count(plan_id)
            if not plan.remaining:
                del self._plans[plan_id]
                plan.settle(self._tiers, result, out)
                if self._copying and plan.through:
                    self._copying.difference_update(*plan.through.values())
            elif plan.through and ok:
                self._copying.update(plan.copying(ok))
        self._events.extend(out)
        return done, lost


def _promote_by_tenant(builder: PlanBuilder, new: list[bytes]) -> list[bytes]:
    """Reserve in the first tier the keys of ``new`` (of several tenants) it makes room for,
    each tenant's under its quota, tenant by tenant in order of first appearance; return them
    in the order reserved."""
    first = builder.tiers[0]
    assert first.tenancy is not None
    owner = first.tenancy.tenant
    groups: dict[str, list[bytes]] = {}
    for key in new:
        groups.setdefault(owner(key), []).append(key)
    for tenant, group in groups.items():
        if builder.make_room(0, first.block * len(group), tenant):
            builder.reserve(0, group)
    return list(builder.keys)


#: positions of plans whose every key is new, by length (a plan of up to 64 keys shares one)
_RANGES = tuple(tuple(range(n)) for n in range(65))
_NOTHING: frozenset[bytes] = frozenset()
#: the copies below of a plan that has none
_NO_COPIES: Mapping[int, list[bytes]] = MappingProxyType({})


def _leading(n: int) -> tuple[int, ...]:
    """``tuple(range(n))``"""
    return _RANGES[n] if n < len(_RANGES) else tuple(range(n))


def _positions(keys: Sequence[bytes], new: list[bytes]) -> tuple[int, ...]:
    """The index in ``keys`` of each key of ``new`` (its first occurrence)."""
    if len(new) == len(keys):  # every key is new, and none repeats
        return _leading(len(keys))
    first = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1)))
    return tuple(map(first.__getitem__, new))
