"""The bookkeeping of vLLM's ``OffloadingManager`` side, without vLLM: plans handed out and their results."""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Collection

from kvtier.integrations.vllm.engines import _Engine
from kvtier.manager import LoadPlan, StorePlan, TierManager
from kvtier.transfer import JobResult

log = logging.getLogger("kvtier.vllm")


class _SchedulerSide:
    """Plans handed out by vLLM's ``OffloadingManager`` and their results, by id.

    Finished jobs are applied to the manager through :func:`kvtier.transfer.jobs.apply_result` (via the
    store's ``finish_store`` / ``finish_load``), the one place that does so."""

    def __init__(self, engine: _Engine) -> None:
        self._engine = engine
        assert engine.store.manager is not None
        self._mgr: TierManager = engine.store.manager
        self._store_plans: dict[int, StorePlan] = {}
        self._plan_of: dict[bytes, int] = {}
        self._loads: dict[int, LoadPlan] = {}
        self._load_ids = itertools.count(1)
        self._results: dict[tuple[str, int], JobResult] = {}
        self._finished_loads: OrderedDict[int, None] = OrderedDict()  # load ids with a result, in order

    def drain(self) -> None:
        results = self._engine.results
        while results:
            plan_key, result = results.popleft()
            self._results[plan_key] = result
            if plan_key[0] == "load":
                self._finished_loads[plan_key[1]] = None

    def prepare_load(self, kkeys: list[bytes]) -> tuple[int, LoadPlan]:
        plan = self._mgr.prepare_load(kkeys)
        load_id = next(self._load_ids)
        self._loads[load_id] = plan
        return load_id, plan

    def complete_load(self, kkeys: Collection[bytes]) -> None:
        """Settle the load of ``kkeys`` whose job has finished (the earliest such load id).

        vLLM names a load by its keys only. Only a load whose job has finished, or that was
        never submitted, is settled: unpinning a load still in flight would let its source be
        evicted while it is read."""
        self.drain()
        wanted = set(kkeys)
        load_id = next((i for i in self._finished_loads if set(self._loads[i].keys) == wanted), None)
        if load_id is None:
            submitted = self._engine.submitted_loads
            load_id = next((i for i, p in self._loads.items() if i not in submitted and set(p.keys) == wanted), None)
        if load_id is None:
            self._engine.counters["complete_load_unmatched"] += 1
            log.warning("complete_load: no finished load of these %d keys; ignored", len(wanted))
            return
        self._finished_loads.pop(load_id, None)
        self._engine.submitted_loads.discard(load_id)
        plan = self._loads.pop(load_id)
        result = self._results.pop(("load", load_id), None)
        if result is None:  # never submitted: nothing was read, unpin
            result = JobResult(0, "load", False, plan.keys, error="the load was never submitted")
        self._engine.store.finish_load(plan, result)

    def prepare_store(self, kkeys: list[bytes]) -> StorePlan | None:
        plan = self._mgr.prepare_store(kkeys)
        if plan is None:
            self._engine.counters["store_rejected"] += 1
            return None
        if plan.keys:
            self._store_plans[plan.plan_id] = plan
            for k in plan.keys:
                self._plan_of[k] = plan.plan_id
        return plan

    def complete_store(self, kkeys: Collection[bytes], success: bool) -> None:
        self.drain()
        plan_ids = {self._plan_of.get(k) for k in kkeys}
        for plan_id in plan_ids:
            if plan_id is None:
                continue
            plan = self._store_plans.pop(plan_id)
            for k in plan.keys:
                self._plan_of.pop(k, None)
            result = self._results.pop(("store", plan_id), None)
            if result is None:
                result = JobResult(0, "store", success, plan.keys, error=None if success else "failed in vLLM")
            stored = self._engine.store.finish_store(plan, result)
            self._engine.counters["blocks_stored"] += stored
            self._engine.counters["blocks_store_failed"] += len(plan.keys) - stored


