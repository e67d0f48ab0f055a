"""The bookkeeping of vLLM's ``OffloadingManager`` side, without vLLM: plans handed out, the
results every rank reports for them, and the deletes the workers owe.

vLLM's scheduler calls ``complete_store`` / ``complete_load`` once every worker has reported a
job (it counts them); kvtier's results of that job, one per rank, arrive just before, in the
same worker metadata (:meth:`SchedulerSide.receive`). A job is applied to the manager with the
ranks' results combined (:func:`~kvtier.transfer.jobs.combine_results`: a key that failed on
any rank failed), through :func:`~kvtier.transfer.jobs.apply_result`, the one place that does
so. A rank whose result is missing counts as failed. The copies that ranks may hold of keys the
manager then released go to the :class:`~kvtier.connector.DeleteLedger`, whose deletes travel
to every worker with the next step's metadata (:meth:`SchedulerSide.take_deletes`).

A job that some rank never reports at all is given up after a deadline
(:class:`~.deadlines.ResultDeadlines`, :meth:`SchedulerSide.worker_output`): the silent ranks
settle it on notice, and it is applied as failed like any other.

A load is never left open. It is *done* once every rank has reported it, or once vLLM has
counted it done on every rank (a rank's kvtier result lost on the way: counted failed): no rank
reads its source any more, so its pins may go. A done load is settled by vLLM's
``complete_load`` and otherwise without it: when its request ends (finished or aborted,
:meth:`SchedulerSide.request_finished`), when ``complete_load`` came before it was done, or when
more than :data:`MAX_DONE_LOADS` done loads wait. A load still running is never settled (its
source could be evicted while read); a load whose request ended before it was handed to any
rank is released at once (nothing reads for it).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace

from kvtier.connector.ledger import DeleteLedger, Deletes
from kvtier.errors import ClosedError, LifecycleError
from kvtier.integrations.vllm.deadlines import Abandoned, ResultDeadlines
from kvtier.integrations.vllm.engines import SchedulerEngine
from kvtier.manager import KeyState, LoadPlan, StorePlan, TierManager
from kvtier.manager.plan import TagWrites
from kvtier.transfer.jobs import JobResult, apply_result, combine_results

log = logging.getLogger("kvtier.vllm")

PlanKey = tuple[str, int]  # ("store", plan id) or ("load", load id)

#: seconds the scheduler side waits for every rank's result of a job when nothing else is set
DEFAULT_RESULT_DEADLINE_S = 300.0

#: done loads kept for vLLM's ``complete_load``; past this the oldest is settled without it
MAX_DONE_LOADS = 1 << 14


class SchedulerSide:
    """Plans handed out by vLLM's ``OffloadingManager`` and their per-rank results, by id."""

    def __init__(self, engine: SchedulerEngine, manager: TierManager, deadlines: ResultDeadlines | None = None) -> None:
        self._engine = engine
        self._mgr = manager
        self._world = engine.world_size
        self._store_plans: dict[int, StorePlan] = {}
        self._plan_of: dict[bytes, int] = {}
        self._loads: dict[int, LoadPlan] = {}
        self._pinned: dict[int, LoadPlan] = {}  # load id -> what the manager pinned, where it is less than the plan
        self._load_ids = itertools.count(1)
        self._results: dict[PlanKey, dict[int, JobResult]] = {}
        self._finished_loads: OrderedDict[int, None] = OrderedDict()  # load ids every rank finished, in order
        self._owed: set[int] = set()  # open loads to settle as soon as they are done (see the module doc)
        self._request_of: dict[int, str] = {}  # load id -> vLLM request id
        self._loads_of: dict[str, list[int]] = {}  # vLLM request id -> its open load ids
        self.ledger = DeleteLedger()
        self.deadlines = deadlines if deadlines is not None else ResultDeadlines(self._world, DEFAULT_RESULT_DEADLINE_S)

    def worker_output(
        self, results: Iterable[tuple[int, str, int, JobResult]], counts: Mapping[int, int]
    ) -> dict[int, int]:
        """One step's worker output: every rank's kvtier results (rank, kind, id, result) and
        vLLM's completion counts by job id. Returns the counts vLLM may apply (see
        :meth:`~.deadlines.ResultDeadlines.completed`), then gives up on the jobs past the
        deadline (their notices go out with :meth:`take_notices`)."""
        for rank, kind, plan_id, result in results:
            self.deadlines.reported(rank, kind, plan_id)
            self.receive(rank, kind, plan_id, result)
        allowed = self.deadlines.completed(counts)
        for kind, plan_id in self.deadlines.take_done():
            if kind == "load":  # every rank counted it: none reads its source any more
                self._load_done(plan_id)
        expired = self.deadlines.expire()
        if expired:
            self._engine.counters["results_expired"] += len(expired)
            for notice in expired:
                log.warning(
                    "kvtier: %s job %d: no result from rank(s) %s within %.3g s; those ranks settle it as failed",
                    notice.kind,
                    notice.job_id,
                    list(notice.ranks),
                    self.deadlines.deadline_s,
                )
        return allowed

    def take_notices(self) -> tuple[Abandoned, ...]:
        """The jobs given up since the last call, for every worker (connector metadata)."""
        return self.deadlines.take_notices()

    def receive(self, rank: int, kind: str, plan_id: int, result: JobResult) -> None:
        """Rank ``rank``'s result of one job (a duplicate replaces the earlier one)."""
        key = (kind, plan_id)
        if plan_id not in (self._store_plans if kind == "store" else self._loads):
            return  # a plan this side no longer tracks (settled after a missing result)
        per_rank = self._results.setdefault(key, {})
        per_rank[rank] = result
        if kind == "load" and len(per_rank) == self._world:
            self._load_done(plan_id)

    def _load_done(self, load_id: int) -> None:
        """No rank reads for load ``load_id`` any more: settle it if that is owed, else keep it
        for vLLM's ``complete_load`` (within :data:`MAX_DONE_LOADS`)."""
        if load_id not in self._loads or load_id in self._finished_loads:
            return
        if load_id in self._owed:
            self._settle(load_id)
            return
        self._finished_loads[load_id] = None
        if len(self._finished_loads) > MAX_DONE_LOADS:
            oldest = next(iter(self._finished_loads))
            log.warning("kvtier: load %d was done on every rank but never completed by vLLM; settled", oldest)
            self._settle(oldest)

    def take_deletes(self) -> Deletes:
        """The deletes every worker runs before this step's stores (see the module doc)."""
        return self.ledger.take(self._mgr)

    def take_tags(self) -> TagWrites:
        """The tenant tags and pin changes of persistent tiers since the last call, for every
        worker to save with its tiers (with the step's deletes), so a restart finds them."""
        mgr = self._mgr
        out = []
        for tier in range(mgr.num_tiers):
            owners, pins = mgr.tenants.take_tags(tier)  # a memory tier's are dropped: it keeps none
            if (owners or pins) and mgr.tier_spec(tier).persistent:
                out.append((tier, tuple(owners), tuple(pins)))
        return tuple(out)

    def _combined(self, key: PlanKey, keys: tuple[bytes, ...]) -> JobResult:
        per_rank = self._results.pop(key, {})
        missing = [r for r in range(self._world) if r not in per_rank]
        results = [per_rank[r] for r in sorted(per_rank)]
        if missing:
            self._engine.counters["results_missing"] += 1
            log.warning("kvtier: %s job %d: no result from rank(s) %s; counted as failed", key[0], key[1], missing)
            results.append(JobResult(0, key[0], False, keys, error=f"no result from rank(s) {missing}"))  # type: ignore[arg-type]
        return results[0] if len(results) == 1 else combine_results(results)

    def prepare_load(self, kkeys: list[bytes], request_id: str | None = None) -> tuple[int, LoadPlan]:
        """Pin ``kkeys`` for a load of vLLM request ``request_id`` (when known: its end settles
        the load, see :meth:`request_finished`)."""
        try:
            plan = pinned = self._mgr.prepare_load(kkeys)
        except ClosedError:
            raise
        except LifecycleError:  # a key a shared tier's follower forgot since vLLM's lookup
            plan, pinned = self._vanished_load(kkeys)
        load_id = next(self._load_ids)
        self._loads[load_id] = plan
        if pinned is not plan:
            self._pinned[load_id] = pinned
        if request_id is not None:
            self.attach(load_id, request_id)
        return load_id, plan

    def _vanished_load(self, kkeys: list[bytes]) -> tuple[LoadPlan, LoadPlan]:
        """vLLM loads only what its lookup found, but a shared tier's follower may forget a key
        in between (another engine deleted it, the server evicted it): never an error in vLLM's
        step. The keys still ready are pinned; the ranks are asked for every key, a forgotten one
        from the last tier, where the read finds its record (checked) or misses (a load error:
        vLLM recomputes the block). Returns the ranks' plan and the one pinned."""
        mgr, last = self._mgr, self._mgr.num_tiers - 1
        for _ in range(3):  # (the follower may forget another key meanwhile)
            held = [key for key in kkeys if mgr.status(key).state is KeyState.READY]  # (status: no lookup counted)
            try:
                pinned = mgr.prepare_load(held) if held else LoadPlan((), ())
                break
            except ClosedError:
                raise
            except LifecycleError:
                continue
        else:
            pinned = LoadPlan((), ())
        where = dict(zip(pinned.keys, pinned.tiers))
        log.info("kvtier: load of %d blocks: %d forgotten since the lookup, read anyway", len(kkeys), len(kkeys) - len(pinned.keys))
        return LoadPlan(tuple(kkeys), tuple(where.get(key, last) for key in kkeys), pinned.promote), pinned

    def attach(self, load_id: int, request_id: str) -> None:
        """Load ``load_id`` is for vLLM request ``request_id`` (once; an open load only)."""
        if load_id in self._loads and load_id not in self._request_of:
            self._request_of[load_id] = request_id
            self._loads_of.setdefault(request_id, []).append(load_id)

    def complete_load(self, kkeys: Collection[bytes]) -> None:
        """Settle the load of ``kkeys`` that every rank has finished (the earliest such).

        vLLM names a load by its keys only. Only a load every rank has finished is settled:
        unpinning a load still in flight would let its source be evicted while it is read. When
        none is done yet, the earliest open load of these keys is settled once it is."""
        wanted = set(kkeys)
        load_id = next((i for i in self._finished_loads if set(self._loads[i].keys) == wanted), None)
        if load_id is not None:
            self._settle(load_id)
            return
        self._engine.counters["complete_load_unmatched"] += 1
        waiting = next((i for i, p in self._loads.items() if i not in self._owed and set(p.keys) == wanted), None)
        if waiting is None:
            log.warning("complete_load: no open load of these %d keys; ignored", len(wanted))
            return
        self._owed.add(waiting)
        log.info("complete_load: load %d is not done on every rank yet; settled once it is", waiting)

    def request_finished(self, request_id: str) -> None:
        """vLLM request ``request_id`` ended (finished or aborted): vLLM may never complete its
        open loads, so each is settled once done (now, if it is; at once if no rank ever got it)."""
        for load_id in self._loads_of.pop(request_id, ()):
            self._request_of.pop(load_id, None)
            plan = self._loads.get(load_id)
            if plan is None:
                continue
            if load_id in self._finished_loads:
                self._settle(load_id)
            elif self.deadlines.watches("load", load_id) or self._results.get(("load", load_id)):
                self._owed.add(load_id)
            else:  # never handed to a rank: nothing reads for it
                self._settle(load_id, JobResult(0, "load", False, plan.keys, error="request ended before the load ran"))

    def table_sizes(self) -> dict[str, int]:
        """Entries of every table this side keeps (all 0 on an idle engine)."""
        return {
            "store_plans": len(self._store_plans),
            "keys_in_plans": len(self._plan_of),
            "loads": len(self._loads),
            "partly_pinned_loads": len(self._pinned),
            "results": len(self._results),
            "done_loads": len(self._finished_loads),
            "owed_loads": len(self._owed),
            "requests": len(self._loads_of),
            "open_jobs": len(self.deadlines),
            "notices": self.deadlines.notices_owed,
            "deletes": len(self.ledger),
        }

    def _settle(self, load_id: int, result: JobResult | None = None) -> None:
        """Apply load ``load_id`` (every rank's results combined, unless ``result``): unpin."""
        self._finished_loads.pop(load_id, None)
        self._owed.discard(load_id)
        plan = self._loads.pop(load_id)
        request_id = self._request_of.pop(load_id, None)
        if request_id is not None:
            mine = self._loads_of.get(request_id, [])
            if load_id in mine:
                mine.remove(load_id)
            if not mine:
                self._loads_of.pop(request_id, None)
        if result is None:
            result = self._combined(("load", load_id), plan.keys)
        else:
            self._results.pop(("load", load_id), None)
        pinned = self._pinned.pop(load_id, None)
        if pinned is not None:  # only what was pinned is settled; the forgotten keys stay forgotten
            result = _restricted(result, pinned.keys)
            plan = pinned
        applied = apply_result(self._mgr, plan, result)
        if self._world > 1:
            # A key one rank found missing or corrupt is forgotten; the other ranks' copies go.
            for key, tier in applied.removed:
                self.ledger.remember(tier, [key])
            if applied.failed_promotions:
                self.ledger.remember(0, applied.failed_promotions)

    def prepare_store(self, kkeys: list[bytes], tenant: str | None = None) -> StorePlan | None:
        plan = self._mgr.prepare_store(kkeys, tenant=tenant)
        if plan is None:
            self._engine.counters["store_rejected"] += 1
            return None
        if plan.keys:
            self._store_plans[plan.plan_id] = plan
            for k in plan.keys:
                self._plan_of[k] = plan.plan_id
        return plan

    def complete_store(self, kkeys: Collection[bytes], success: bool = True) -> list[bytes]:
        """Settle the store plans of ``kkeys``; returns the keys that became ready."""
        stored: list[bytes] = []
        plan_ids = {self._plan_of.get(k) for k in kkeys}
        for plan_id in plan_ids:
            if plan_id is None:
                continue
            plan = self._store_plans.pop(plan_id)
            for k in plan.keys:
                self._plan_of.pop(k, None)
            result = self._combined(("store", plan_id), plan.keys)
            if not success:
                result = JobResult(result.job_id, "store", False, plan.keys, error="failed in vLLM")
            applied = apply_result(self._mgr, plan, result)
            if not applied.ok or (self._world > 1 and any(result.failed.values())):
                # Some rank may hold what the manager released (even alone: a store given up
                # on after its device read goes on writing its tiers).
                self.ledger.remember_plan(plan)
            self._engine.counters["blocks_stored"] += applied.done
            self._engine.counters["blocks_store_failed"] += applied.lost
            if applied.done:
                stored.extend(k for k in plan.keys if self._mgr.status(k).tier is not None)
        return stored


def _restricted(result: JobResult, keys: tuple[bytes, ...]) -> JobResult:
    """``result`` of a load for only ``keys`` (those its manager pinned), in their order."""
    mine = set(keys)
    missed = [(key, tier) for key, tier in zip(result.missed, result.missed_tiers) if key in mine]
    failed = {tier: tuple(k for k in ks if k in mine) for tier, ks in result.failed.items()}
    return replace(result, keys=keys, missed=tuple(k for k, _ in missed), missed_tiers=tuple(t for _, t in missed), failed=failed)
