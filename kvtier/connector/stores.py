"""Store jobs of the scheduler side: a request's completed blocks, and promotions.

A store covers the request's offloaded blocks ``[st.stored, target)``. ``st.stored`` advances
only over blocks the manager made a plan for: when ``prepare_store`` refuses (a full tier whose
room is held by pending or pinned keys), the same blocks are asked for again, from the first one, once
a job has settled (the manager may have room then), together with the blocks completed
meanwhile; and at finish, where the leading half is tried, and so on down to one block, if the
whole run does not fit. So a request's stored blocks are always a prefix: nothing is stored
past a gap that no prefix lookup could reach, and a run longer than the room ever left still
stores its leading blocks.

Promotions: a load that served keys from a lower tier queues them here; the next build turns
them into an ordinary store job with :meth:`TierManager.prepare_promote`, reading the engine
blocks the load just filled.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvtier.connector.jobtable import JobTable
from kvtier.connector.state import KeyChain, RequestState
from kvtier.connector.types import ConnectorError, StoreJob
from kvtier.manager import TierManager

__all__ = ["StoreBuilder"]


class StoreBuilder:
    """Builds store and promotion jobs into a :class:`JobTable`."""

    def __init__(
        self, manager: TierManager, keys: KeyChain, jobs: JobTable, counters: dict[str, int], n: int, block_tokens: int
    ) -> None:
        self.manager = manager
        self._keys = keys
        self._jobs = jobs
        self._counters = counters
        self._n = n
        self._block_tokens = block_tokens
        #: finished loads with keys served from a lower tier: (request id, keys, engine blocks)
        self.promotions: list[tuple[str, tuple[bytes, ...], tuple[int, ...]]] = []

    def build(
        self, st: RequestState, computed: int, block_ids: Sequence[int], *, final: bool = False
    ) -> StoreJob | None:
        """A store of ``st``'s blocks completed by ``computed`` tokens not yet stored, or ``None``.

        ``final`` (the finish walk) retries a refused store even if no job settled since."""
        first = st.stored
        target = computed // self._block_tokens
        if target <= first or (not final and st.refused_at == self._jobs.generation):
            return None
        self._keys.extend(st, target)
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
        plan = self.manager.prepare_store(keys)
        while plan is None and final and len(keys) > 1:
            # The last chance (the blocks are freed after it) and no room for all of them
            # (prepare_store changed nothing): the leading half may fit. Not while the request
            # runs: a whole run that waits for room costs one write, halves churn the tier.
            keys = keys[: len(keys) // 2]
            plan = self.manager.prepare_store(keys)
        if plan is None or first + len(keys) < target:
            # The rest is asked for again (from its first block) once a job has settled.
            st.refused_at = self._jobs.generation
            self._counters["store_rejected_blocks"] += target - first - (0 if plan is None else len(keys))
            if plan is None:
                return None
        else:
            st.refused_at = -1
        st.stored = first + len(keys)
        if not plan.keys:
            return None
        ids: list[int] = []
        for p in plan.positions:
            b = (first + p) * n
            ids.extend(int(x) for x in block_ids[b : b + n])
        job = self._jobs.add_store(st.request.request_id, plan, tuple(ids))
        st.jobs.add(job.job_id)
        self._counters["store_jobs"] += 1
        self._counters["store_blocks"] += len(plan.keys)
        return StoreJob(job.job_id, job.request_id, plan, job.block_ids)

    def promotion(self, request_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> StoreJob | None:
        """A store job that promotes ``keys`` (just loaded into ``block_ids``, ``n`` per key)
        into the first tier, or ``None`` (nothing left to promote, or no room could be made)."""
        plan = self.manager.prepare_promote(keys)
        if plan is None:
            self._counters["promotion_rejected_jobs"] += 1
            return None
        if not plan.keys:
            return None
        n = self._n
        ids = tuple(b for p in plan.positions for b in block_ids[p * n : (p + 1) * n])
        job = self._jobs.add_store(request_id, plan, ids, promotion=True)
        self._counters["promotion_jobs"] += 1
        self._counters["promotion_blocks"] += len(plan.keys)
        return StoreJob(job.job_id, request_id, plan, ids)

    def run_promotions(
        self,
        states: dict[str, RequestState],
        allocated: Collection[int],
        preempted: Collection[str],
        flush: set[int],
    ) -> list[StoreJob]:
        """Build the queued promotions. One whose blocks are handed out again in this step, or
        whose request is preempted in it, is flushed: it runs before this step's compute."""
        stores: list[StoreJob] = []
        queued, self.promotions = self.promotions, []
        for rid, keys, ids in queued:
            job = self.promotion(rid, keys, ids)
            if job is None:
                continue
            st = states.get(rid)
            if st is not None:
                st.jobs.add(job.job_id)
            stores.append(job)
            if rid in preempted or any(b in allocated for b in job.block_ids):
                flush.add(job.job_id)
        return stores
