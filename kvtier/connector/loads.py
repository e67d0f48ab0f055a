"""Load jobs of the scheduler side: what kvtier can serve a request, and the job that loads it.

An offer never includes the last prompt token (the engine must compute at least one). It is
deferred (``(None, False)``: ask again next step) while the request still has jobs (its stores,
e.g. flushed at preemption, are pending) or while another request is loading the same blocks
(they are loaded once, then served by the engine's own prefix cache). A load may start in the
middle of an offloaded block: the engine blocks of that block the engine already holds are
rewritten with the stored bytes of the same prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.connector.config import ConnectorConfig
from kvtier.connector.jobtable import JobTable, TrackedJob
from kvtier.connector.state import KeyChain, RequestState
from kvtier.connector.types import ConnectorError, LoadJob
from kvtier.errors import LifecycleError
from kvtier.manager import LoadPlan, TierManager
from kvtier.transfer.jobs import Applied

__all__ = ["LoadBuilder"]


class LoadBuilder:
    """Offers, builds and settles load jobs in a :class:`JobTable`."""

    def __init__(
        self, manager: TierManager, keys: KeyChain, jobs: JobTable, counters: dict[str, int], config: ConnectorConfig
    ) -> None:
        self.manager = manager
        self._keys = keys
        self._jobs = jobs
        self._counters = counters
        self._n = config.engine_blocks_per_block
        self._block_tokens = config.block_tokens
        # With a step loop, lower-tier hits are promoted after the load by a store job; without
        # one, only into free room, by the load job itself.
        self._promote_in_load = config.promote and not config.step_loop
        self.new_loads: list[LoadJob] = []  # built, to be shipped by the next metadata
        self.ready: dict[str, int] = {}  # loads settled without a job: request id -> valid tokens

    def _prefix(self, st: RequestState, num_computed_tokens: int) -> tuple[int, list[bytes]]:
        """(first offloaded block past ``num_computed_tokens``, keys up to the last prompt token)."""
        max_blocks = (len(st.request.token_ids) - 1) // self._block_tokens
        start = num_computed_tokens // self._block_tokens
        if max_blocks <= start:
            return start, []
        self._keys.extend(st, max_blocks)
        return start, st.keys[start:max_blocks]

    def offer(self, st: RequestState, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` for ``st``; remembers the offer in ``st.intent``."""
        st.intent = None
        if st.jobs:
            self._counters["deferred_lookups"] += 1
            return None, False
        start, keys = self._prefix(st, num_computed_tokens)
        hits = self.manager.lookup(keys) if keys else 0
        if hits == 0:
            return 0, False
        if self._jobs.any_loading(keys[:hits]):
            self._counters["deferred_lookups"] += 1
            return None, False
        end = start + hits
        external = end * self._block_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        st.intent = (start, end, num_computed_tokens)
        return external, True

    def prefix_stores(self, st: RequestState, num_computed_tokens: int) -> tuple[int, ...]:
        """Unacknowledged store jobs writing the blocks right after what kvtier holds for ``st``."""
        if not self._jobs.any_storing:
            return ()
        _, keys = self._prefix(st, num_computed_tokens)
        hits = self.manager.lookup(keys) if keys else 0
        found: list[int] = []
        for key in keys[hits:]:
            jid = self._jobs.storing(key)
            if jid is None:
                break
            if jid not in found:
                found.append(jid)
        return tuple(found)

    def build(self, st: RequestState, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """``update_state_after_alloc``: queue the load job ``st``'s offer promised."""
        intent, st.intent = st.intent, None
        if num_external_tokens <= 0 or intent is None:
            return
        rid = st.request.request_id
        start, end, base = intent
        bt, n = self._block_tokens, self._n
        if end * bt - base != num_external_tokens:
            raise ConnectorError(
                f"request {rid!r}: num_external_tokens={num_external_tokens}, but "
                f"get_num_new_matched_tokens offered {end * bt - base}"
            )
        ids = tuple(int(b) for b in block_ids[start * n : end * n])
        if len(ids) != (end - start) * n:
            raise ConnectorError(
                f"request {rid!r}: block_ids has {len(block_ids)} blocks, "
                f"a load up to offloaded block {end} needs {end * n}"
            )
        try:
            plan = self.manager.prepare_load(st.keys[start:end], promote=self._promote_in_load)
        except LifecycleError:
            self.ready[rid] = base  # evicted between lookup and allocation: a miss, recomputed
            return
        job = self._jobs.add_load(rid, plan, ids, start, base, end * bt)
        st.jobs.add(job.job_id)
        st.load_job = job.job_id
        self.new_loads.append(LoadJob(job.job_id, rid, plan, ids))
        self._counters["load_jobs"] += 1
        self._counters["load_blocks"] += len(plan.keys)

    def valid_tokens(self, job: TrackedJob, applied: Applied) -> int:
        """Leading tokens of the request valid after the settled load ``job``."""
        plan = job.plan
        assert isinstance(plan, LoadPlan)
        valid = applied.done
        tokens = job.end_tokens if valid == len(plan.keys) else (job.first_block + valid) * self._block_tokens
        return max(job.base_tokens, tokens)
