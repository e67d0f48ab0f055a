"""The tier manager: key state across an ordered list of tiers (fastest first).

The manager decides; it never moves bytes. It owns, for every key in every tier, whether the
key is *pending* (being written, invisible to ``lookup``) or *ready*, and how many loads pin it.
The policy of each tier orders its ready keys and picks victims; backends own the bytes and are
driven by the transfer engine, which executes the plans the manager hands out.

Lifecycle (the contract engine authors know from vLLM's offloading manager):

===========================  ===================================================================
``lookup(keys)``             leading run of keys that are ready in some tier (pending ends it);
                             ``lookup_key(key)``: whether one key is ready, without a tuple
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

Lifecycle calls come from one thread (or one event loop). ``stats()`` and ``counters`` may be
read from any thread (a metrics scrape): every call that changes state holds the manager's lock
while it does, and the readers copy under it, so a snapshot is one consistent moment and costs
the same however many keys the tiers hold.

Collaborators, each in its own module: :class:`~kvtier.manager.tiers.TierState` (one tier's keys, pins
and byte accounting), :class:`~kvtier.manager.plan.PlanBuilder` (eviction, demotion and reservation
for one store or promotion plan), :class:`~kvtier.manager.admission.Admission` (``admit_after``),
:class:`~kvtier.manager.promotion.Promotions` (both forms of promotion),
:class:`~kvtier.manager.record_sync.RecordSync` (adoption of stored records, removal, stamps),
:class:`~kvtier.manager.readout.Readout` (counters and stats) and
:class:`~kvtier.manager.tenant_ops.TenantControl` (the ``tenants`` attribute). Each manager's
``lookup``, ``prepare_store``, ``complete_store`` and ``touch`` are closures made for it
(:mod:`~kvtier.manager.lookups`, :mod:`~kvtier.manager.store_calls`,
:mod:`~kvtier.manager.touch_calls`): the common case in one
step, anything else by the methods of the class, which give the same answers (tests compare).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from kvtier.errors import LifecycleError
from kvtier.keys import KEY_BYTES, check_keys, exact_bytes
from kvtier.manager.admission import Admission
from kvtier.manager.eventlog import CacheEvent, EventLog
from kvtier.manager.load_calls import LoadRunFn, departures, load_run, vanished
from kvtier.manager.lookups import closed_error as _closed
from kvtier.manager.lookups import leading_run, lookup_counts, single_key_lookup
from kvtier.manager.plan import Completion, Demotion, LoadPlan, PlanBook, StorePlan
from kvtier.manager.promotion import Promotions
from kvtier.manager.readout import COUNTERS, Readout
from kvtier.manager.record_sync import RecordSync
from kvtier.manager.store_calls import store_calls
from kvtier.manager.tenant_ops import TenantControl
from kvtier.manager.tenants import DEFAULT_TENANT, TenantBook, TenantRules, check_tenant
from kvtier.manager.tiers import TierSpec, TierState, check_specs, tenant_book, unpin
from kvtier.manager.touch_calls import touch_call

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



class KeyState(str, Enum):
    MISS = "miss"
    PENDING = "pending"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class KeyStatus:
    """Where a key stands: ``tier`` is the fastest tier that holds it (``None`` on a miss)."""

    state: KeyState
    tier: int | None = None


_MISS = KeyStatus(KeyState.MISS)
_NOTHING: frozenset[bytes] = frozenset()


def _check(keys: Sequence[bytes]) -> None:
    """Validate ``keys``. One well-formed key (engines look blocks up one at a time) is accepted
    at once; anything else goes through :func:`check_keys` and its precise errors.

    Calls that only accept keys the manager already holds (a pinned key, a pending one, a ready
    one) validate by finding them, and call this only when one is not found: a key that is found
    is one that was validated when it was stored."""
    if len(keys) != 1 or type(keys) not in (tuple, list) or type(keys[0]) is not bytes or len(keys[0]) != KEY_BYTES:
        check_keys(keys)


class TierManager:
    """Key state over ``tiers`` (fastest first) with write-back or write-through chaining."""

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        *,
        write: WriteMode = "back",
        max_events: int = 100_000,
        clock: Callable[[], float] = time.time,
        tenants: TenantRules | None = None,
    ) -> None:
        check_specs(tiers, write)
        self.write_mode: WriteMode = write
        self._tiers = [TierState(spec) for spec in tiers]
        self._departed = departures(self._tiers)  # ready keys that left a tier (kvtier.manager.load_calls)
        self._indexes = tuple(t.index for t in self._tiers)
        self._ready_gets = tuple(enumerate(t.index.get for t in self._tiers))
        self._gets = tuple(t.index.get for t in self._tiers)
        self._pins = tuple(t.pins for t in self._tiers)
        self._persistent = any(t.persistent for t in tiers)
        #: the policy of the only tier, when it is not persistent: ``touch`` goes to it directly
        self._one_policy = tiers[0].policy if len(tiers) == 1 and not self._persistent else None
        self._plan_ids = itertools.count(1)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self.unpins_begun = 0  # complete_load calls that reached the unpin: see JobRuns.finish_load
        # (calls, keys, hits) of batched lookups, packed by lookup_counts and replaced whole;
        # single-key lookups count in the call made below (C or closure): lookups stay lock-free.
        self._lookups = 0
        self._single = single_key_lookup(self._gets, self._lookup_run)
        self.lookup, self.lookup_key = self._single.lookup, self._single.lookup_key  # type: ignore[method-assign,assignment]
        self._admission = Admission(tiers)
        self._events = EventLog(max_events)
        self._promotions = Promotions(self._tiers, self._counts, self._events)
        self._plans = PlanBook(
            self._tiers, write_back=write == "back", admission=self._admission, promotions=self._promotions, events=self._events
        )
        self._clock = clock
        self._lock = threading.Lock()
        self._closed = False
        self._stores = store_calls(self._plans, self._lock, self._counts, self._plan_ids, clock, self.prepare_store, self.complete_store)  # the methods below: their general path
        self.prepare_store, self.complete_store = self._stores.prepare, self._stores.complete  # type: ignore[method-assign]
        #: ``lookup`` and ``prepare_load(run, promote=False)`` of the leading run, one call (kvtier.manager.load_calls)
        self._touch = touch_call(self._lock, self._one_policy, self.touch)  # the method below: its general path
        self.touch = self._touch.touch  # type: ignore[method-assign,assignment]
        self.prepare_load_run: LoadRunFn = load_run(self._tiers, self._lock, self._counts, self._admission, self._now, self._lookup_run, self.prepare_load)
        self._ready_status = tuple(KeyStatus(KeyState.READY, i) for i in range(len(tiers)))
        self._pending_status = tuple(KeyStatus(KeyState.PENDING, i) for i in range(len(tiers)))
        #: usage per tenant, quotas: from the first call that names a tenant (or ``tenants``)
        self._book: TenantBook | None = None
        #: pins, deletes, quotas and usage (:mod:`kvtier.manager.tenant_ops`)
        self.tenants = TenantControl(self._tiers, self._lock, self._events, self._tenant_book)
        if tenants is not None:
            self.tenants.set_rules(tenants)
        self._records = RecordSync(self._tiers, self._lock, self._events, lambda: self._book, self._tenant_book)
        self._readout = Readout(
            self._tiers, self._lock, self._counts, self._events, lookups=lambda: self._lookups, single=self._single.counts,
            plans=self._plans, book=lambda: self._book, tenants=self.tenants,
        )  # fmt: skip

    def _tenant_book(self) -> TenantBook:
        """The tenant book, made on first use: every block held so far is the default tenant's."""
        if self._book is None:
            self._book = tenant_book(self._tiers)
        return self._book

    # -- introspection ---------------------------------------------------------------------
    @property
    def num_tiers(self) -> int:
        return len(self._tiers)

    def tier_spec(self, tier: int) -> TierSpec:
        return self._tiers[tier].spec

    def tier_keys(self, tier: int) -> list[bytes]:
        """Ready keys of ``tier`` in eviction order (next victim first)."""
        return self._tiers[tier].policy.order()

    def __len__(self) -> int:
        return sum(map(len, self._indexes))

    def close(self) -> None:
        self._closed = True
        self._single.close()
        self._stores.close()
        self._touch.close()

    def _ready_tier(self, key: bytes) -> int | None:
        """The fastest tier that holds ``key`` ready, or ``None``."""
        for ti, get in self._ready_gets:
            if get(key):
                return ti
        return None

    def _now(self) -> float:
        return self._clock() if self._persistent else 0.0

    # -- lookup ----------------------------------------------------------------------------
    def status(self, key: bytes) -> KeyStatus:
        ti = self._ready_tier(key)
        if ti is not None:
            return self._ready_status[ti]
        for ti, index in enumerate(self._indexes):
            if key in index:
                return self._pending_status[ti]
        return _MISS

    def holds(self, key: bytes, tier: int) -> bool:
        """Whether ``tier`` has ``key`` at all (pending or ready): its bytes may be there."""
        return key in self._indexes[tier]

    def ready_keys(self, tier: int) -> list[bytes]:
        """The keys ``tier`` holds ready, in no particular order: a snapshot (a shared tier's
        index view looks there for keys its server lost)."""
        with self._lock:
            index = self._tiers[tier].index.copy()  # a copy of the table, not a walk, under the lock
        return [key for key, state in index.items() if state]

    def lookup_detail(self, keys: Sequence[bytes]) -> list[KeyStatus]:
        """Per key: hit (with the fastest ready tier), pending, or miss."""
        if self._closed:
            raise _closed()
        _check(keys)
        return list(map(self.status, keys))

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` ready in some tier; a pending key ends it. One key
        takes a call made for this manager (:mod:`kvtier.manager.lookups`: in C where the
        extension is built, else a closure) that answers, counts and validates as the general
        path does."""
        return self._single.lookup(keys)

    def lookup_key(self, key: bytes) -> bool:
        """``lookup((key,)) == 1`` for a caller that asks key by key, without the tuple."""
        return self._single.lookup_key(key)

    def _lookup_run(self, keys: Sequence[bytes]) -> int:
        """:meth:`lookup` of any number of keys (the single-key call takes one key itself)."""
        if self._closed:
            raise _closed()
        try:
            hits = leading_run(self._gets, keys)
        except TypeError:  # an unhashable key: check_keys names it
            hits = -1
        if hits != len(keys) or not hits:  # a key not found (or no key): is the input valid?
            _check(keys)
        self._lookups += lookup_counts(1, len(keys), hits)
        return hits

    # -- store -----------------------------------------------------------------------------
    def prepare_store(
        self, keys: Sequence[bytes], *, partial: bool = False, keep_below: Iterable[bytes] = (), tenant: str | None = None
    ) -> StorePlan | None:
        """Reserve room in the first tier for the keys not yet present; see the module doc.

        ``partial=True`` gives up atomicity for a batch larger than the first tier can take:
        the plan then covers the leading run of the new keys that fits (in the order given), and
        ``None`` comes only when not one fits. The keys left out are neither reserved nor
        counted as seen; the caller stores them with a later call once the plan's keys are
        ready, naming the keys stored by the earlier calls in ``keep_below``: the plan may move
        those out of the first tier (demoted, or dropped where a lower tier has their copy) but
        never evicts them from a lower tier, so the batch's head is not cut for its tail.

        ``tenant`` names whose the new blocks are (default: :data:`DEFAULT_TENANT`): they are
        counted as its usage and stored under its quotas (:mod:`kvtier.manager.tenants`)."""
        if self._closed:
            raise _closed()
        _check(keys)
        if tenant is not None:
            check_tenant(tenant)
        with self._lock:
            book = self._book if tenant is None else self._tenant_book()
            batch = set(keys)
            new = list(keys) if len(batch) == len(keys) else list(dict.fromkeys(keys))
            for index in self._indexes:
                if not index.keys().isdisjoint(batch):  # (a pass in C finds none held: the common store)
                    new = [key for key in new if key not in index]
            admission, counts = self._admission, self._counts
            if admission.enabled:
                admission.note(batch)
            counts["store_skipped"] += len(batch) - len(new)
            keep = frozenset(keep_below) if keep_below else _NOTHING
            if book is not None:
                book.claim(new, tenant or DEFAULT_TENANT)
            plan = self._plans.prepare(next(self._plan_ids), keys, batch, new, partial=partial, keep_below=keep, tenant=tenant)
            if book is not None:
                if plan is None or len(plan.keys) < len(new):
                    book.gone += new  # the keys left out are in no tier: their claim goes
                book.sweep(self._indexes)
            if plan is None:
                counts["store_rejected"] += 1
            else:
                counts["store_prepared"] += len(plan.keys)
                if len(plan.keys) + len(plan.skipped) < len(batch):
                    covered = {*plan.keys, *plan.skipped}
                    admission.unnote(key for key in batch if key not in covered)
                    counts["store_partial"] += 1
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
        if self._closed:
            raise _closed()
        _check(keys)
        with self._lock:
            sources = self._promotions.sources(dict.fromkeys(keys), self._ready_tier)
            plan = self._plans.prepare(next(self._plan_ids), keys, set(keys), list(sources), sources)
            if self._book is not None:
                self._book.sweep(self._indexes)
            if plan is None:
                self._counts["promotions_rejected"] += 1
            else:
                self._counts["promotions_prepared"] += len(plan.keys)
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
        if self._closed:
            raise _closed()
        with self._lock:
            # Distinct keys, each of an open plan (every store's own plan.keys): taken out of
            # the book in one pass. Anything else takes the general path, which validates and
            # names the first key that is not open (a test compares the two).
            owners = self._plans.take(keys) if keys else None
            if owners is None:
                i = self._plans.unknown(keys)
                if i is not None or not keys:
                    _check(keys)
                if i is not None:
                    raise LifecycleError(f"complete_store: keys[{i}] ({keys[i].hex()[:16]}…) was never prepared or is already complete")
            if owners is not None and success and not failed and not sizes and self._plans.complete_plain(keys, owners, self._now()):
                self._counts["store_completed"] += len(owners)
                return
            failed_sets = {ti: set(ks) for ti, ks in failed.items()} if failed else {}
            done, lost = self._plans.complete(keys, Completion(success, failed_sets, sizes, self._now()), owners)
            self._counts["store_completed"] += done
            self._counts["store_failed"] += lost

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
        if self._closed:
            raise _closed()
        seen = self._departed[0]
        try:
            if len(self._gets) == 1:  # one tier: no call per key (a test compares the two)
                ready = list(map(self._gets[0], keys))
                found: list[int | None] = [0] * len(ready) if all(ready) else [0 if r else None for r in ready]
            else:
                found = list(map(self._ready_tier, keys))
        except TypeError:  # unhashable: not a key
            found = [None]
        if None in found or not found or not exact_bytes(keys):
            _check(keys)
        if None in found:
            i = found.index(None)
            raise LifecycleError(f"prepare_load: keys[{i}] ({keys[i].hex()[:16]}…) is not ready in any tier")
        where: list[int] = found  # type: ignore[assignment]  # (no None in it: checked above)
        # Found without the lock: a shared tier's follower may forget a key before the pin
        # below. The pin and the plan stand (the key named ``vanished``); the read finds the
        # record or misses (counted, forgetting nothing): docs/architecture.md, shared tiers.
        with self._lock:
            now = self._now()
            used = set(where)
            for ti in used:
                mine = keys if len(used) == 1 else [key for key, w in zip(keys, where) if w == ti]
                self._tiers[ti].pin(mine, now)
            self._counts["load_prepared"] += len(keys)
            self._admission.note(keys)
            promoted = self._promotions.reserve_in_load(keys, where) if promote and len(self._tiers) > 1 else []
            gone = _NOTHING if self._departed[0] == seen else vanished(self._gets, keys, where)
        return LoadPlan(tuple(keys), tuple(where), tuple(promoted), gone)

    def complete_load(self, keys: Sequence[bytes], *, failed_promotions: Iterable[bytes] = ()) -> None:
        """Unpin keys pinned by ``prepare_load`` (once per pin) and settle their promotions:
        ready in the first tier, or released if named in ``failed_promotions``."""
        if self._closed:
            raise _closed()
        with self._lock:
            self.unpins_begun += 1  # (before the unpin: an interrupt between says it may have run)
            failed_at = unpin(self._pins, keys)
            if failed_at is not None:
                _check(keys)
                raise LifecycleError(f"complete_load: keys[{failed_at}] ({keys[failed_at].hex()[:16]}…) is not pinned")
            if self._promotions.loading:
                self._promotions.settle_in_load(keys, set(failed_promotions), self._now())

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark keys as recently used in every tier that holds them ready.

        Validated by finding, like ``complete_store``: a key ready in a tier was checked when it
        was stored, so only a call with a key that no one tier holds ready, or one that is not
        exactly ``bytes`` where the call could keep it, pays for :func:`check_keys`. This is the
        general path: a manager of one tier without stamps asks its policy's ``touch_held``
        first (:mod:`kvtier.manager.touch_calls`; its LRU reorders its own key objects, so a
        value found equal to a stored key touches that key; tests compare both paths)."""
        if self._closed:
            raise _closed()
        with self._lock:
            n = len(keys)
            every = False  # one tier holds every key ready
            found = []
            try:
                for get in self._gets:
                    mine = list(filter(get, keys))
                    found.append(mine)
                    every = every or len(mine) == n
            except TypeError:  # an unhashable key: check_keys names it
                found = []
            if not every or not exact_bytes(keys):
                _check(keys)
            for t, mine in zip(self._tiers, found):
                if mine:
                    t.policy.touch_many(mine)
                    if t.persistent:
                        t.stamps.update(dict.fromkeys(mine, self._now()))

    def remove(self, keys: Sequence[bytes], tier: int) -> list[bytes]:
        """Forget ready, unpinned ``keys`` in ``tier`` (after a failed read found them gone or
        corrupt). Returns the keys removed; the caller deletes their bytes."""
        if self._closed:
            raise _closed()
        _check(keys)
        return self._records.remove(keys, tier)

    # -- persistence (kvtier.manager.record_sync) ------------------------------------------
    def adopt(self, tier: int, records: Iterable[tuple[bytes, int, float]], owners: Mapping[bytes, str] | None = None) -> list[bytes]:
        """Rebuild ``tier``'s index from stored records ``(key, stored_bytes, stamp)`` at open.

        Records are inserted oldest stamp first, so eviction order survives a restart. Records
        beyond the tier's capacity (oldest first) are not adopted and are returned for deletion.
        ``owners`` names the tenant of records saved with one (the rest are the default's).
        """
        return self._records.adopt(tier, records, owners)

    def adopt_live(self, tier: int, records: Iterable[tuple[bytes, int, float]]) -> list[bytes]:
        """Adopt records another engine stored in shared tier ``tier`` while this one runs (a
        follower's feed or sweep): ready at once and announced as ``stored`` events. Keys
        already held are skipped. When the tier is full, its least recent ready, unpinned keys
        are forgotten to make room (``removed`` events; their records stay: a shared tier's
        server evicts); when even that cannot make room, what fits is adopted. Returns the
        keys adopted."""
        return self._records.adopt_live(tier, records)

    def take_stamps(self, tier: int) -> list[tuple[bytes, float]]:
        """Access stamps recorded since the last call, for a persistent tier to save."""
        return self._records.take_stamps(tier)

    # -- events and stats ------------------------------------------------------------------
    def take_events(self) -> list[CacheEvent]:
        """Stored / removed events since the last call, oldest first."""
        with self._lock:
            return self._events.take()

    @property
    def counters(self) -> dict[str, int]:
        """The manager's counters, copied at one moment."""
        return self._readout.counters()

    def stats(self) -> dict[str, Any]:
        """Counters and per-tier figures, copied at one moment; safe from any thread."""
        return self._readout.stats()
