"""Scheduler side of the connector: turns engine scheduler steps into load and store jobs.

Contract (the calls engine authors know from vLLM's KV connector):

``get_num_new_matched_tokens(request, num_computed_tokens)``
    How many tokens past the engine's own prefix cache hit can be loaded from kvtier, and
    whether the load is asynchronous. ``(None, False)`` means "ask again next step": the
    request still has jobs outstanding (re-admitted after a preemption) or another request is
    loading the same blocks right now (they are loaded once, then served by the engine's own
    prefix cache). The last prompt token is never loaded: the engine must compute at least one.
``update_state_after_alloc(request, block_ids, num_external_tokens)``
    The engine allocated ``block_ids``; if ``num_external_tokens > 0`` a load job is built
    (pinning the keys) and shipped with the next :class:`StepMetadata`. A load may start in
    the middle of an offloaded block; the engine blocks of that block that the engine already
    holds are rewritten with the stored bytes of the same prefix.
``build_connector_meta(step)``
    Builds store jobs for every block whose every slot is computed by the end of this step
    (``num_computed_tokens + scheduled``; the final sampled token's slot is never computed, so
    never stored), walks the requests that finished since the last step to store their last
    block through the same path, and computes ``jobs_to_flush`` from the fence.
``request_finished(request, block_ids) -> (delay_free, None)``
    Refreshes the request's keys and keeps its state for the next step's walk. Blocks can be
    freed at once (the fence protects pending stores); ``delay_free`` is true only while a load
    is still writing into the request's blocks.
``update_connector_output(worker_output)``
    Counts acknowledgements; once all ``world_size`` workers reported a job it is applied to
    the manager. Returns a :class:`ConnectorUpdate` (tokens now valid per loaded request,
    requests whose delayed blocks may now be freed, engine blocks no longer read by any store).

Engines without a step loop (synchronous engines: a prefix match must be complete when it
returns, the engine frees a finished request's blocks at once and does not schedule while
idle) use ``ConnectorConfig(step_loop=False)`` and three more calls:

``build_immediate_meta()``
    A :class:`StepMetadata` with everything due *now*: the loads queued by
    ``update_state_after_alloc`` and the stores of the requests finished since the last build
    (the finish walk, run at once instead of at the next step). The worker runs it with
    :meth:`~kvtier.connector.WorkerConnector.run_now` (submitted at once, loads waited for), and
    ``update_connector_output`` of what that returns reports the load's valid tokens. A stepping
    engine may call it too, e.g. when it goes idle with finished requests to store.
``pending_prefix_stores(request, num_computed_tokens)``
    Store jobs, built and not yet acknowledged, that write the blocks right after what kvtier
    can serve the request now (typically the previous turn of the same conversation, finished a
    moment ago). A synchronous engine waits for them
    (:meth:`~kvtier.connector.WorkerConnector.wait_for`), applies the output, then asks
    ``get_num_new_matched_tokens``: a store is cheaper to wait for than a prefill to redo.
With ``step_loop=False``, ``request_finished`` trusts ``request.num_computed_tokens`` (no
step reports told the connector that the request ran), and every block of a request is stored
by the finish walk. The fence then works by reference count, since such an engine cannot list
the blocks it allocates: the engine pins every block of ``meta.stores`` (once per block) before
it frees them, and unpins the blocks of ``ConnectorUpdate.unfenced``. A fenced block also still
goes into ``jobs_to_flush`` if a later ``build_connector_meta`` reports it allocated.

The fence: every engine block read by a store job that is built and not yet acknowledged maps
to that job. A job goes into ``jobs_to_flush`` when one of its source blocks is handed out again
in a step (new allocation or copy-on-write destination) or when its request is preempted. A
request's state is freed as soon as it is finished and has no jobs: the tables are empty
whenever the engine is idle.

Deletes, for ``world_size > 1``: every worker holds its own shard of a block under the same key
in its own tiers, but there is one manager. A job that failed (wholly or for some keys in some
tier) on one worker may have succeeded on another; when the manager then releases those keys
(``complete_store`` with ``failed``/``success=False``, a failed promotion, ``remove`` after a
missed load), the workers where the write succeeded still hold the bytes - leaked pool slots
that the manager believes free (a later store on that rank fails), orphan records on disk that
a persistent tier would re-adopt at restart. So when a job completes that was not a clean
success everywhere, the (tier, key) pairs it touched are remembered, and the next
``build_connector_meta`` / ``build_immediate_meta`` ships, in ``StepMetadata.deletes``, those
the manager does not hold (pending or ready) in that tier at build time. The check runs before
the build prepares any store, so a key stored again in that same build or later is written
after the delete on every worker (the worker runs deletes on its store queue in build order),
and a key the manager already holds again (re-stored, or being promoted) is never deleted.
``has_pending_work`` is true while deletes wait for a build.

Promotion: a load that served keys from a lower tier (e.g. disk) leaves them there; in steady
state the first tier is full, so they would be served from the slow tier at every later hit.
When such a load completes (``update_connector_output``) for a request that is still live, its
valid keys and engine blocks are queued, and the next ``build_connector_meta`` (or
``build_immediate_meta``) turns them into a store job with :meth:`TierManager.prepare_promote`:
room is made in the first tier as for any store (victims demoted, the batch and pinned keys
never evicted), and the job copies the keys from the request's engine blocks, which hold exactly
the loaded bytes. It is an ordinary store job: in build order on the store queue (so the load
never waits for the write-backs), fenced (flushed at once if one of its blocks is handed out
again, or its request preempted, in that very step), and completed with ``complete_store``.
Between the load and the build no compute or load writes those blocks: a block handed out again
shows up in the build's ``allocated_block_ids``. Without a step loop the engine may free loaded
blocks right after the load, so there the load job itself promotes, into free room only
(``prepare_load(promote=True)``).

All calls are plain dictionary work on the scheduler thread; none blocks or awaits.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.connector.types import (
    ConnectorError,
    ConnectorUpdate,
    LoadJob,
    Request,
    SchedulerStep,
    StepMetadata,
    StoreJob,
    WorkerOutput,
)
from kvtier.errors import LifecycleError
from kvtier.keys import Namespace, block_keys, fold_block_hashes
from kvtier.manager import LoadPlan, StorePlan, TierManager

__all__ = ["ConnectorConfig", "SchedulerConnector"]


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """How the engine's cache is cut into offloaded blocks.

    ``block_size`` is the engine's tokens per engine block; one offloaded block spans
    ``engine_blocks_per_block`` engine blocks. ``key_source="block_hashes"`` folds the engine's
    own chained block hashes (``request.block_hashes``, one per engine block) instead of
    hashing token ids. ``store_last_block_at_finish=False`` disables the finish walk (for
    measurement only: it loses every block completed by a request's last steps).
    ``step_loop=False`` is for engines that never call ``build_connector_meta`` (see the module
    docstring): ``request_finished`` then trusts ``request.num_computed_tokens``.
    ``promote=False`` turns off promotion of lower-tier hits into the first tier (see the
    module docstring; for measurement).
    """

    block_size: int
    engine_blocks_per_block: int = 1
    world_size: int = 1
    store_last_block_at_finish: bool = True
    key_source: Literal["tokens", "block_hashes"] = "tokens"
    step_loop: bool = True
    promote: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "engine_blocks_per_block", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConnectorError(f"connector.{name}: expected a positive integer, got {value!r}")
        if self.key_source not in ("tokens", "block_hashes"):
            raise ConnectorError(f"connector.key_source: expected 'tokens' or 'block_hashes', got {self.key_source!r}")

    @property
    def block_tokens(self) -> int:
        """Tokens per offloaded block."""
        return self.block_size * self.engine_blocks_per_block


@dataclass(slots=True, eq=False)
class _RequestState:
    request: Request
    keys: list[bytes] = field(default_factory=list)
    stored: int = 0  # offloaded blocks [0, stored) already had their store decision
    jobs: set[int] = field(default_factory=set)
    load_job: int | None = None
    intent: tuple[int, int, int] | None = None  # (first block, end block, tokens already valid)
    scheduled: bool = False
    finished: bool = False
    delay_free: bool = False
    final_block_ids: tuple[int, ...] = ()
    final_computed: int = 0


@dataclass(slots=True, eq=False)
class _Job:
    job_id: int
    kind: Literal["store", "load"]
    request_id: str
    plan: StorePlan | LoadPlan
    block_ids: tuple[int, ...]
    acked: set[int] = field(default_factory=set)
    error: str | None = None
    failed: dict[int, set[bytes]] = field(default_factory=dict)
    missed: dict[bytes, int] = field(default_factory=dict)
    sizes: dict[int, dict[bytes, int]] = field(default_factory=dict)
    nbytes: int = 0
    promotion: bool = False  # stores: a promotion (see _build_promotion)
    first_block: int = 0  # loads: offloaded block index of plan.keys[0]
    base_tokens: int = 0  # loads: tokens valid before the load
    end_tokens: int = 0  # loads: tokens valid if every key loads


class SchedulerConnector:
    """The scheduler half; see the module docstring for the contract."""

    def __init__(self, manager: TierManager, namespace: Namespace, config: ConnectorConfig) -> None:
        self.manager = manager
        self.namespace = namespace
        self.config = config
        self._n = config.engine_blocks_per_block
        self._block_tokens = config.block_tokens
        self._states: dict[str, _RequestState] = {}
        self._jobs: dict[int, _Job] = {}
        self._fence: dict[int, set[int]] = {}
        self._loading: dict[bytes, int] = {}  # key -> loads in flight that fill it
        self._storing: dict[bytes, int] = {}  # key -> the unacknowledged store job writing it
        self._last_step = 0
        self._walk: list[_RequestState] = []
        self._new_loads: list[LoadJob] = []
        self._ready_loads: dict[str, int] = {}  # loads settled without a job (see update_state_after_alloc)
        self._job_ids = itertools.count(1)
        # tier -> keys whose bytes workers may hold although the manager released them in that
        # tier (jobs that were not a clean success everywhere); shipped by the next build.
        self._deletes: dict[int, dict[bytes, None]] = {}
        # Finished loads with keys served from a lower tier: (request id, keys, engine blocks
        # that hold them), promoted into the first tier by the next build.
        self._promotions: list[tuple[str, tuple[bytes, ...], tuple[int, ...]]] = []
        self.counters: dict[str, int] = {
            "store_jobs": 0,
            "store_blocks": 0,
            "store_rejected_blocks": 0,
            "store_failed_blocks": 0,
            "stored_blocks": 0,
            "load_jobs": 0,
            "load_blocks": 0,
            "load_missed_blocks": 0,
            "load_failed_jobs": 0,
            "flushed_jobs": 0,
            "deferred_lookups": 0,
            "last_block_jobs": 0,
            "unknown_reports": 0,
            "deleted_blocks": 0,
            "promotion_jobs": 0,
            "promotion_blocks": 0,
            "promotion_rejected_jobs": 0,
            "promoted_blocks": 0,
            "promotion_failed_blocks": 0,
            "bytes_stored": 0,
            "bytes_loaded": 0,
        }

    @classmethod
    def from_store(cls, store: Any, *, block_size: int, world_size: int = 1, **options: Any) -> SchedulerConnector:
        """Build the scheduler half over an open :class:`kvtier.KVStore`."""
        if store.manager is None:
            raise LifecycleError("the store is not open; use 'await kvtier.open(...)' first")
        config = ConnectorConfig(
            block_size=block_size,
            engine_blocks_per_block=store.config.engine_blocks_per_block,
            world_size=world_size,
            **options,
        )
        return cls(store.manager, store.namespace, config)

    # -- introspection ---------------------------------------------------------------------
    @property
    def num_request_states(self) -> int:
        return len(self._states)

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    @property
    def num_fenced_blocks(self) -> int:
        return len(self._fence)

    def fenced_blocks(self) -> set[int]:
        """Engine blocks that pending store jobs still read."""
        return set(self._fence)

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping (jobs outstanding or a finish walk due)."""
        return bool(
            self._jobs or self._walk or self._new_loads or self._ready_loads or self._deletes or self._promotions
        )

    @property
    def num_pending_deletes(self) -> int:
        """Keys waiting for the next build to be shipped as deletes."""
        return sum(len(ks) for ks in self._deletes.values())

    # -- keys ------------------------------------------------------------------------------
    def _extend_keys(self, st: _RequestState, want: int) -> None:
        """Make sure ``st.keys`` covers ``want`` offloaded blocks where the tokens allow it."""
        have = len(st.keys)
        if have >= want:
            return
        req = st.request
        bt = self._block_tokens
        if self.config.key_source == "block_hashes":
            hashes = getattr(req, "block_hashes", None)
            if hashes is None:
                raise ConnectorError(
                    f"request {req.request_id!r}: key_source='block_hashes' needs request.block_hashes"
                )
            want = min(want, len(hashes) // self._n)
            if want > have:
                picked = [hashes[(i + 1) * self._n - 1] for i in range(have, want)]
                st.keys.extend(fold_block_hashes(picked, namespace=self.namespace))
            return
        tokens = req.token_ids
        want = min(want, len(tokens) // bt)
        if want > have:
            parent = st.keys[-1] if have else None
            st.keys.extend(
                block_keys(list(tokens[have * bt : want * bt]), block_size=bt, namespace=self.namespace, parent=parent)
            )

    def _state(self, request: Request) -> _RequestState:
        rid = request.request_id
        st = self._states.get(rid)
        if st is None:
            st = self._states[rid] = _RequestState(request)
        else:
            st.request = request
        return st

    # -- loads -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can load, and whether asynchronously."""
        st = self._state(request)
        st.intent = None
        if st.jobs:
            # Its stores (e.g. flushed at preemption) are not acknowledged yet: their keys are
            # still pending, and loading around them would just recompute them. Try again.
            self.counters["deferred_lookups"] += 1
            return None, False
        bt = self._block_tokens
        max_blocks = (len(request.token_ids) - 1) // bt
        start = num_computed_tokens // bt
        if max_blocks <= start:
            return 0, False
        self._extend_keys(st, max_blocks)
        keys = st.keys[start:max_blocks]
        hits = self.manager.lookup(keys) if keys else 0
        if hits == 0:
            return 0, False
        if self._loading and any(k in self._loading for k in keys[:hits]):
            # Another request is filling these blocks now; once it is done the engine's own
            # prefix cache serves them, so the prefix is loaded once, not once per request.
            self.counters["deferred_lookups"] += 1
            return None, False
        end = start + hits
        external = end * bt - num_computed_tokens
        if external <= 0:
            return 0, False
        st.intent = (start, end, num_computed_tokens)
        return external, True

    def pending_prefix_stores(self, request: Request, num_computed_tokens: int) -> tuple[int, ...]:
        """Unacknowledged store jobs writing the blocks right after the prefix kvtier holds for
        ``request`` now (past ``num_computed_tokens``); empty when there is nothing to wait for."""
        if not self._storing:
            return ()
        st = self._state(request)
        bt = self._block_tokens
        max_blocks = (len(request.token_ids) - 1) // bt
        start = num_computed_tokens // bt
        if max_blocks <= start:
            return ()
        self._extend_keys(st, max_blocks)
        keys = st.keys[start:max_blocks]
        hits = self.manager.lookup(keys) if keys else 0
        jobs: list[int] = []
        for key in keys[hits:]:
            jid = self._storing.get(key)
            if jid is None:
                break
            if jid not in jobs:
                jobs.append(jid)
        return tuple(jobs)

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Record the allocation; build the load job promised by ``get_num_new_matched_tokens``."""
        st = self._state(request)
        intent, st.intent = st.intent, None
        if num_external_tokens <= 0 or intent is None:
            return
        start, end, base = intent
        if end * self._block_tokens - base != num_external_tokens:
            raise ConnectorError(
                f"request {request.request_id!r}: num_external_tokens={num_external_tokens}, but "
                f"get_num_new_matched_tokens offered {end * self._block_tokens - base}"
            )
        n = self._n
        ids = tuple(int(b) for b in block_ids[start * n : end * n])
        if len(ids) != (end - start) * n:
            raise ConnectorError(
                f"request {request.request_id!r}: block_ids has {len(block_ids)} blocks, "
                f"a load up to offloaded block {end} needs {end * n}"
            )
        keys = st.keys[start:end]
        try:
            # With a step loop, lower-tier hits are promoted after the load by a store job
            # (_build_promotion); without one, only into free room, by the load job itself.
            plan = self.manager.prepare_load(keys, promote=self.config.promote and not self.config.step_loop)
        except LifecycleError:
            # Evicted between lookup and allocation: a miss, the engine recomputes.
            self._ready_loads[request.request_id] = base
            return
        job = _Job(
            next(self._job_ids),
            "load",
            request.request_id,
            plan,
            ids,
            first_block=start,
            base_tokens=base,
            end_tokens=end * self._block_tokens,
        )
        self._jobs[job.job_id] = job
        st.jobs.add(job.job_id)
        st.load_job = job.job_id
        for key in plan.keys:
            self._loading[key] = self._loading.get(key, 0) + 1
        self._new_loads.append(LoadJob(job.job_id, request.request_id, plan, ids))
        self.counters["load_jobs"] += 1
        self.counters["load_blocks"] += len(plan.keys)

    # -- stores ----------------------------------------------------------------------------
    def _build_store(self, st: _RequestState, computed: int, block_ids: Sequence[int]) -> StoreJob | None:
        first = st.stored
        target = computed // self._block_tokens
        if target <= first:
            return None
        self._extend_keys(st, target)
        target = min(target, len(st.keys))
        if target <= first:
            return None
        n = self._n
        if len(block_ids) < target * n:
            raise ConnectorError(
                f"request {st.request.request_id!r}: {computed} computed tokens need {target * n} engine blocks, "
                f"the block table has {len(block_ids)}"
            )
        keys = st.keys[first:target]
        st.stored = target
        plan = self.manager.prepare_store(keys)
        if plan is None:
            self.counters["store_rejected_blocks"] += len(keys)
            return None
        if not plan.keys:
            return None
        ids: list[int] = []
        for p in plan.positions:
            b = (first + p) * n
            ids.extend(int(x) for x in block_ids[b : b + n])
        job = _Job(next(self._job_ids), "store", st.request.request_id, plan, tuple(ids))
        for key in plan.keys:
            self._storing[key] = job.job_id
        self._register_store(job, st)
        self.counters["store_jobs"] += 1
        self.counters["store_blocks"] += len(plan.keys)
        return StoreJob(job.job_id, job.request_id, plan, job.block_ids)

    def _register_store(self, job: _Job, st: _RequestState | None) -> None:
        """Track a built store job and fence the engine blocks it reads."""
        self._jobs[job.job_id] = job
        if st is not None:
            st.jobs.add(job.job_id)
        fence = self._fence
        for b in job.block_ids:
            holders = fence.get(b)
            if holders is None:
                fence[b] = {job.job_id}
            else:
                holders.add(job.job_id)

    def _build_promotion(self, request_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> StoreJob | None:
        """A store job that promotes ``keys`` (just loaded into ``block_ids``, ``n`` per key)
        into the first tier, or ``None`` (nothing left to promote, or no room could be made)."""
        plan = self.manager.prepare_promote(keys)
        if plan is None:
            self.counters["promotion_rejected_jobs"] += 1
            return None
        if not plan.keys:
            return None
        n = self._n
        ids = tuple(b for p in plan.positions for b in block_ids[p * n : (p + 1) * n])
        job = _Job(next(self._job_ids), "store", request_id, plan, ids, promotion=True)
        self._register_store(job, self._states.get(request_id))
        self.counters["promotion_jobs"] += 1
        self.counters["promotion_blocks"] += len(plan.keys)
        return StoreJob(job.job_id, request_id, plan, ids)

    def _run_promotions(self, allocated: Collection[int], preempted: Collection[str], flush: set[int]) -> list[StoreJob]:
        """Build the queued promotions. One whose blocks are handed out again in this step, or
        whose request is preempted in it, is flushed: it runs before this step's compute."""
        stores: list[StoreJob] = []
        queued, self._promotions = self._promotions, []
        for rid, keys, ids in queued:
            job = self._build_promotion(rid, keys, ids)
            if job is None:
                continue
            stores.append(job)
            if rid in preempted or any(b in allocated for b in job.block_ids):
                flush.add(job.job_id)
        return stores

    def _mark_finished(self, st: _RequestState, block_ids: Sequence[int] | None) -> None:
        st.finished = True
        st.intent = None
        if self.config.store_last_block_at_finish and (st.scheduled or not self.config.step_loop):
            req = st.request
            st.final_block_ids = tuple(int(b) for b in (req.block_ids if block_ids is None else block_ids))
            st.final_computed = int(req.num_computed_tokens)
            # Refresh now: the tokens that completed the last block are known only at finish.
            self._extend_keys(st, st.final_computed // self._block_tokens)
            if st.final_computed // self._block_tokens > st.stored:
                self._walk.append(st)

    def _maybe_free(self, st: _RequestState) -> None:
        if st.finished and not st.jobs and st not in self._walk:
            rid = st.request.request_id
            if self._states.get(rid) is st:
                del self._states[rid]

    def build_connector_meta(self, step: SchedulerStep) -> StepMetadata:
        """Turn one scheduler step into the metadata every worker executes."""
        states = self._states
        flush: set[int] = set()
        allocated = set(step.allocated_block_ids)
        for rid in step.preempted_request_ids:
            st = states.get(rid)
            if st is None:
                continue
            flush.update(j for j in st.jobs if self._jobs[j].kind == "store")
            # Its blocks are gone; after re-admission it starts over (present keys are skipped).
            st.stored = 0
            st.scheduled = False
        # Jobs built in earlier steps whose source blocks are handed out again now.
        fence = self._fence
        if fence:
            for b in allocated:
                holders = fence.get(b)
                if holders:
                    flush.update(holders)
        for rid in step.finished_request_ids:
            st = states.get(rid)
            if st is not None and not st.finished:
                self._mark_finished(st, None)
                self._maybe_free(st)
        self._last_step = step.step
        deletes = self._take_deletes()  # before any prepare_store of this build (see the docstring)
        stores: list[StoreJob] = []
        # Finished requests first: workers submit stores in build order, and flushing one of
        # these must not drag along a job that reads blocks this step's compute still fills.
        for walked in self._run_walk():
            stores.append(walked)
            # Its blocks were freed at finish; handed out in this very step, the job must run
            # before this step's compute overwrites them.
            if not allocated.isdisjoint(walked.block_ids):
                flush.add(walked.job_id)
        if self._promotions:
            # Their blocks are complete (loaded): built before this step's stores, like the walk.
            stores.extend(self._run_promotions(allocated, step.preempted_request_ids, flush))
        bt = self._block_tokens
        for rid, count in step.num_scheduled_tokens.items():
            st = states.get(rid)
            if st is None or st.finished:
                continue  # never announced through update_state_after_alloc: nothing to store
            st.scheduled = True
            req = st.request
            computed = req.num_computed_tokens + count
            if computed // bt <= st.stored:
                continue  # the common decode step: no block completed (kept inline: hot path)
            job = self._build_store(st, computed, req.block_ids)
            if job is not None:
                stores.append(job)
        loads, self._new_loads = self._new_loads, []
        self.counters["flushed_jobs"] += len(flush)
        return StepMetadata(step.step, tuple(stores), tuple(loads), tuple(sorted(flush)), deletes)

    def _run_walk(self) -> list[StoreJob]:
        """Build the stores of the requests finished since the last walk (their last blocks)."""
        if not self._walk:
            return []
        stores: list[StoreJob] = []
        walk, self._walk = self._walk, []
        for st in walk:
            job = self._build_store(st, st.final_computed, st.final_block_ids)
            if job is not None:
                stores.append(job)
                self.counters["last_block_jobs"] += 1
            self._maybe_free(st)
        return stores

    def build_immediate_meta(self) -> StepMetadata:
        """Everything due now, for an engine without a step loop: the loads queued by
        ``update_state_after_alloc`` and the finish walk's stores. Run it with
        :meth:`WorkerConnector.run_now`; its stores are submitted at once (not deferred), so
        the engine must fence their blocks (see the module docstring)."""
        deletes = self._take_deletes()
        stores = self._run_walk()
        if self._promotions:
            stores.extend(self._run_promotions((), (), set()))
        loads, self._new_loads = self._new_loads, []
        return StepMetadata(self._last_step, tuple(stores), tuple(loads), (), deletes)

    # -- deletes ---------------------------------------------------------------------------
    def _forget_on_workers(self, tier: int, keys: Collection[bytes]) -> None:
        """Remember that workers may hold ``keys`` in ``tier`` although the manager may not."""
        if keys:
            self._deletes.setdefault(tier, {}).update(dict.fromkeys(keys))

    def _take_deletes(self) -> tuple[tuple[int, tuple[bytes, ...]], ...]:
        """The remembered (tier, key) pairs the manager does not hold now; clears the record.

        A key the manager holds again (re-stored everywhere, or pending in a job or promotion
        that has its own completion) is dropped from the record: its bytes are wanted."""
        if not self._deletes:
            return ()
        pending, self._deletes = self._deletes, {}
        out: list[tuple[int, tuple[bytes, ...]]] = []
        num_tiers = self.manager.num_tiers
        for tier in sorted(pending):
            if not 0 <= tier < num_tiers:
                continue
            keys = tuple(sorted(k for k in pending[tier] if not self.manager.holds(k, tier)))  # deterministic
            if keys:
                out.append((tier, keys))
                self.counters["deleted_blocks"] += len(keys)
        return tuple(out)

    # -- finish ----------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, None]:
        """The request finished (or was aborted); returns ``(delay_free, None)``."""
        st = self._states.get(request.request_id)
        if st is None:
            return False, None
        st.request = request
        if not st.finished:
            self._mark_finished(st, block_ids)
        st.delay_free = st.load_job is not None
        self._maybe_free(st)
        return st.delay_free, None

    # -- completions -----------------------------------------------------------------------
    def update_connector_output(
        self, worker_output: WorkerOutput | bytes | Iterable[WorkerOutput | bytes]
    ) -> ConnectorUpdate:
        """Apply worker reports; a job completes once every one of ``world_size`` workers reported it."""
        outputs: Iterable[WorkerOutput | bytes | bytearray | memoryview]
        if isinstance(worker_output, (WorkerOutput, bytes, bytearray, memoryview)):
            outputs = (worker_output,)
        else:
            outputs = worker_output
        loaded: dict[str, int] = {}
        freed: list[str] = []
        unfenced: list[int] = []
        world = self.config.world_size
        for out in outputs:
            if not isinstance(out, WorkerOutput):
                out = WorkerOutput.from_bytes(bytes(out))
            if not 0 <= out.rank < world:
                raise ConnectorError(f"worker output: rank {out.rank} is outside world_size {world}")
            for report in out.finished:
                job = self._jobs.get(report.job_id)
                if job is None or job.kind != report.kind:
                    self.counters["unknown_reports"] += 1
                    continue
                if out.rank in job.acked:
                    continue  # a duplicate report must not count as another worker's ack
                job.acked.add(out.rank)
                if report.error is not None and job.error is None:
                    job.error = report.error
                for tier, keys in report.failed.items():
                    job.failed.setdefault(tier, set()).update(keys)
                for key, tier in zip(report.missed, report.missed_tiers):
                    job.missed.setdefault(key, tier)
                for tier, per in report.sizes.items():
                    mine = job.sizes.setdefault(tier, {})
                    for key, size in per.items():
                        mine[key] = max(size, mine.get(key, 0))
                job.nbytes += report.nbytes
                if len(job.acked) == world:
                    self._complete(job, loaded, freed, unfenced)
        if self._ready_loads:
            loaded.update(self._ready_loads)
            self._ready_loads.clear()
        return ConnectorUpdate(loaded, tuple(freed), tuple(unfenced))

    def _complete(self, job: _Job, loaded: dict[str, int], freed: list[str], unfenced: list[int]) -> None:
        del self._jobs[job.job_id]
        st = self._states.get(job.request_id)
        if job.kind == "store":
            plan = job.plan
            assert isinstance(plan, StorePlan)
            fence = self._fence
            for b in job.block_ids:
                holders = fence.get(b)
                if holders is not None:
                    holders.discard(job.job_id)
                    if not holders:
                        del fence[b]
                        unfenced.append(b)
            for key in plan.keys:
                if self._storing.get(key) == job.job_id:
                    del self._storing[key]
            ok = job.error is None
            failed = {t: list(ks) for t, ks in job.failed.items()}
            self.manager.complete_store(plan.keys, ok, sizes=job.sizes, failed=failed)
            for tier, failed_keys in job.failed.items():
                self._forget_on_workers(tier, failed_keys)
            if not ok:
                # A worker that failed may have stopped anywhere in the plan (even before its
                # drops and demotions); another may have run all of it. Every pair the plan
                # touched is a candidate; the build ships those the manager does not hold.
                self._forget_on_workers(plan.tier, plan.keys)
                for tier, ks in (*plan.write_through, *plan.drops):
                    self._forget_on_workers(tier, ks)
                for d in plan.demotions:
                    self._forget_on_workers(d.src, d.keys)
                    self._forget_on_workers(d.dst, d.keys)
            lost = len(plan.keys) if not ok else len(job.failed.get(plan.tier, ()))
            if job.promotion:
                self.counters["promotion_failed_blocks"] += lost
                self.counters["promoted_blocks"] += len(plan.keys) - lost
            else:
                self.counters["store_failed_blocks"] += lost
                self.counters["stored_blocks"] += len(plan.keys) - lost
            self.counters["bytes_stored"] += job.nbytes
        else:
            plan = job.plan
            assert isinstance(plan, LoadPlan)
            if job.error is not None:
                bad: Collection[bytes] = plan.promote
            else:
                bad = job.failed.get(0, ())
            self.manager.complete_load(plan.keys, failed_promotions=bad)
            # A promotion that failed on one worker may have been written on another.
            self._forget_on_workers(0, bad)
            if job.error is None:
                for key, tier in job.missed.items():
                    # Gone or corrupt in that tier: forget it, so it is never offered again, and
                    # drop the other workers' shards of it (they would never be read).
                    self.manager.remove([key], tier)
                    self._forget_on_workers(tier, (key,))
            for key in plan.keys:
                left = self._loading.get(key, 0) - 1
                if left > 0:
                    self._loading[key] = left
                else:
                    self._loading.pop(key, None)
            if job.error is not None:
                valid = 0
                self.counters["load_failed_jobs"] += 1
            else:
                valid = len(plan.keys)
                for i, key in enumerate(plan.keys):
                    if key in job.missed:
                        valid = i
                        break
            self.counters["load_missed_blocks"] += len(plan.keys) - valid
            self.counters["bytes_loaded"] += job.nbytes
            if (
                valid
                and self.config.promote
                and self.config.step_loop
                and st is not None
                and not st.finished  # aborted while loading: its blocks are freed now
                and any(tier > 0 for tier in plan.tiers[:valid])
            ):
                self._promotions.append((job.request_id, plan.keys[:valid], job.block_ids[: valid * self._n]))
            tokens = job.end_tokens if valid == len(plan.keys) else (job.first_block + valid) * self._block_tokens
            loaded[job.request_id] = max(job.base_tokens, tokens)
            if st is not None:
                st.load_job = None
                if st.delay_free:
                    st.delay_free = False
                    freed.append(job.request_id)
        if st is not None:
            st.jobs.discard(job.job_id)
            self._maybe_free(st)
