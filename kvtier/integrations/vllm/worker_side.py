"""The bookkeeping of vLLM's ``OffloadingWorker`` side, without vLLM: submitting plans, reporting
jobs, and running the deletes the scheduler side ships.

Every finished job leaves its :class:`~kvtier.transfer.JobResult` in the rank's outbox; the
connector sends the outbox to the scheduler side in the same worker metadata as vLLM's count of
finished jobs, so the scheduler side has every rank's result when vLLM settles the job."""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from kvtier.connector.ledger import Deletes
from kvtier.integrations.vllm.deadlines import Abandoned
from kvtier.integrations.vllm.engines import RankEngine
from kvtier.integrations.vllm.recent import RecentIds
from kvtier.integrations.vllm.replicated import for_reader, without_tiers
from kvtier.manager import LoadPlan, StorePlan
from kvtier.manager.plan import TagWrites
from kvtier.transfer import JobResult
from kvtier.transfer.flush import FlushReport, flush_listed_groups
from kvtier.transfer.offloop import off_loop

log = logging.getLogger("kvtier.vllm")


class WorkerSide:
    """Submits plans to the store's transfer engine; never raises into vLLM's step loop.

    A job that cannot be submitted (bad block ids, a closed store) is reported as a failed
    job by ``finished`` (counted in ``submit_failed``, logged), so the scheduler side releases
    its keys as for any failed job."""

    def __init__(self, engine: RankEngine) -> None:
        self._engine = engine
        transfers = engine.store.transfers
        assert transfers is not None
        self._transfers = transfers
        self._n = transfers.layout.engine_blocks_per_block
        # kvtier job id -> (vLLM job id, plan key, the engine block ids of each key)
        self._jobs: dict[int, tuple[int, tuple[str, int], list[list[int]]]] = {}
        self._refused: list[tuple[int, tuple[str, int], list[list[int]], JobResult]] = []
        self._failed_blocks: set[int] = set()
        self._failed_loads: set[int] = set()  # vLLM job ids of loads with a block not brought back
        #: vLLM job ids reported (recent ones) or settled on the scheduler side's notice
        self._reported = RecentIds()
        self._abandoned = RecentIds()
        self._lock = threading.Lock()

    def submit_store(self, job_id: int, plan: StorePlan, block_ids: Collection[Any]) -> None:
        self._submit(job_id, ("store", plan.plan_id), plan, block_ids)

    def submit_load(
        self, job_id: int, load_id: int, plan: LoadPlan, block_ids: Collection[Any], first_index: int = 0
    ) -> None:
        """``block_ids`` are the engine blocks to fill, from the request's block ``first_index``
        on. A load that starts (or ends) inside a chunk of several engine blocks has fewer ids
        than its keys' chunks: the leading (trailing) blocks of the chunk, which the engine
        already holds (recomputes), are read into vLLM's null block instead (see ``chunk_block_ids``)."""
        self._submit(job_id, ("load", load_id), plan, block_ids, first_index)

    def _submit(
        self,
        job_id: int,
        plan_key: tuple[str, int],
        plan: StorePlan | LoadPlan,
        block_ids: Collection[Any],
        first_index: int | None = None,
    ) -> None:
        per_key: list[list[int]] = []
        if job_id in self._abandoned:
            return  # already reported, settled on the scheduler side's notice
        try:
            ids = [int(b) for b in block_ids]
            per_key = [ids[i : i + self._n] for i in range(0, len(ids), self._n)]
            if isinstance(plan, StorePlan):
                if self._engine.skip_tiers:  # the shared tiers' writes are the writer rank's
                    plan, ids = for_reader(plan, ids, self._engine.skip_tiers)
                kid = self._transfers.submit_store(plan, ids)
            else:
                if first_index is not None and self._n > 1:
                    ids, per_key = chunk_block_ids(ids, first_index, self._n, len(plan.keys))
                    self._engine.counters["mid_chunk_loads"] += first_index % self._n != 0
                kid = self._transfers.submit_load(plan, ids)
        except Exception as exc:  # reported as a failed job, never raised into vLLM
            self._engine.counters["submit_failed"] += 1
            log.warning("kvtier: %s job %d could not be submitted: %s", plan_key[0], job_id, exc)
            kind: Any = plan_key[0]
            with self._lock:
                self._refused.append((job_id, plan_key, per_key, JobResult(0, kind, False, plan.keys, error=repr(exc))))
            return
        with self._lock:
            self._jobs[kid] = (job_id, plan_key, per_key)

    def finished(self) -> list[tuple[int, bool, int, float]]:
        """(vLLM job id, success, bytes, seconds) of every job finished since the last call."""
        with self._lock:
            entries, self._refused = self._refused, []
        for result in self._transfers.poll_finished():
            with self._lock:
                entry = self._jobs.pop(result.job_id, None)
            if entry is not None:
                entries.append((*entry, result))
        out = []
        for job_id, plan_key, per_key, result in entries:
            success = True
            if result.kind == "load":
                failed_keys = _failed_load_keys(result, len(per_key))
                bad = [b for i in failed_keys for b in per_key[i]]
                counters = self._engine.counters
                counters["blocks_load_failed"] += len(failed_keys)
                counters["blocks_loaded"] += len(result.keys) - len(failed_keys)
                if bad:
                    if self._engine.reports_load_errors:
                        with self._lock:
                            self._failed_blocks.update(bad)
                            self._failed_loads.add(job_id)
                    else:
                        # vLLM's stock connector cannot recompute a failed load: fail loudly.
                        success = False
                    log.warning(
                        "kvtier: %d of %d blocks of load job %d could not be read", len(failed_keys), len(per_key), job_id
                    )
            self._engine.outbox.append((plan_key[0], plan_key[1], result))
            out.append((job_id, success, result.nbytes, result.seconds))
            self._reported.add(job_id)
        return out

    def wait_for_load(self, timeout: float) -> bool:
        """Block, without the GIL, until the oldest load job in flight has finished or
        ``timeout`` seconds have passed (see :mod:`.idle_steps`); ``False`` at once when no load
        is in flight. Stores are never waited for. Never raises."""
        with self._lock:
            oldest = next((kid for kid, (_, plan_key, _) in self._jobs.items() if plan_key[0] == "load"), None)
        if oldest is None:
            return False
        try:
            self._transfers.wait([oldest], timeout=timeout)
        except TimeoutError:
            pass
        except Exception as exc:  # never raised into vLLM's step
            log.warning("kvtier: waiting for load job %d failed: %s", oldest, exc)
        return True

    def take_outbox(self) -> list[tuple[str, int, JobResult]]:
        """The results of the jobs reported by ``finished`` since the last call."""
        outbox = self._engine.outbox
        return [outbox.popleft() for _ in range(len(outbox))]

    def submit_deletes(self, deletes: Deletes, tags: TagWrites = ()) -> int | None:
        """Delete keys the scheduler side released from this rank's tiers, and save the tenant
        tags and pins it shipped (``tags``), in one job on the store queue (after the stores
        submitted so far, before those submitted later: build order). Returns the transfer job
        id, or None (nothing to do, or it could not be submitted)."""
        deletes = without_tiers(deletes, self._engine.skip_tiers)
        skip = self._engine.skip_tiers
        tags = tuple(t for t in tags if t[0] not in skip)  # the writer rank saves a shared tier's
        if not deletes and not tags:
            return None
        try:
            plan = StorePlan(plan_id=0, keys=(), positions=(), drops=tuple(deletes), tags=tags)
            kid = self._transfers.submit_store(plan, [])
        except Exception as exc:  # a delete that cannot run leaves an orphan record, never wrong data
            log.warning("kvtier: delete of %d keys could not be submitted: %s", sum(len(k) for _, k in deletes), exc)
            return None
        self._engine.counters["keys_deleted"] += sum(len(k) for _, k in deletes)
        return kid

    def take_failed_block_ids(self) -> set[int]:
        with self._lock:
            bad, self._failed_blocks = self._failed_blocks, set()
        return bad

    def take_failed_loads(self) -> set[int]:
        """vLLM job ids of the loads reported by ``finished`` that did not bring every block back."""
        with self._lock:
            bad, self._failed_loads = self._failed_loads, set()
        return bad

    def wait(self, job_ids: Collection[int]) -> None:
        """The fence: until these jobs no longer touch engine blocks (a store's device read has
        ended; its tier writes go on)."""
        with self._lock:
            mine = [kid for kid, (jid, _, _) in self._jobs.items() if jid in job_ids]
        try:
            self._transfers.wait_device(mine)
        except Exception as exc:  # never raised into vLLM
            log.warning("kvtier: waiting for jobs %s failed: %s", sorted(job_ids), exc)

    def abandon(self, notices: Iterable[Abandoned]) -> int:
        """Settle the jobs the scheduler side stopped waiting for (see :mod:`.deadlines`) that
        this rank has not reported: stop each (from then on it never touches an engine block),
        and report it with the next ``finished`` as failed, a load's blocks as load errors.
        Returns how many jobs were settled here; never raises."""
        rank = self._engine.rank
        settled = 0
        for notice in notices:
            if rank not in notice.ranks or notice.job_id in self._reported or notice.job_id in self._abandoned:
                continue
            with self._lock:
                kid = next((k for k, entry in self._jobs.items() if entry[0] == notice.job_id), None)
                entry = self._jobs.pop(kid) if kid is not None else None
            if kid is not None:
                try:
                    self._transfers.cancel(kid)  # a store past its device read is left to finish its tier writes
                except Exception as exc:  # the job is reported failed either way
                    log.warning("kvtier: cancelling %s job %d failed: %s", notice.kind, notice.job_id, exc)
            per_key = entry[2] if entry is not None else [[int(b)] for b in notice.block_ids]
            kind: Any = notice.kind
            result = JobResult(0, kind, False, (), error="abandoned: no result before the scheduler side's deadline")
            with self._lock:
                self._refused.append((notice.job_id, (notice.kind, notice.plan_id), per_key, result))
            self._abandoned.add(notice.job_id)
            self._engine.counters["jobs_abandoned"] += 1
            settled += 1
            log.warning(
                "kvtier: rank %d had no result for %s job %d before the scheduler side's deadline; reported failed",
                rank,
                notice.kind,
                notice.job_id,
            )
        return settled


    async def close(self) -> FlushReport | None:
        """Shut this rank's store down (vLLM's worker ``shutdown``); see :func:`close_sides`.
        Returns the flush report (``None``: none ran); never raises."""
        return (await close_sides([self]))[0]


async def close_sides(sides: Sequence[WorkerSide]) -> list[FlushReport | None]:
    """Shut a rank's stores down (one per KV-cache group; vLLM's worker ``shutdown``): finish
    their queued jobs, write back the blocks their memory tiers hold that their first persistent
    tier lacks, within **one** ``flush_on_close_s`` / ``flush_on_close_bytes`` budget shared by
    the groups, newest first across them (:func:`~kvtier.transfer.flush.flush_listed_groups`),
    then close them. A store with a job still running writes nothing back (a row could be
    reused while read); its tiers are left to that job's thread.

    A store's own close writes back from its manager, which under vLLM knows nothing: the
    scheduler side's manager decides, a rank only executes. So the blocks are listed from the
    backends; every rank writes its own, so the next start's adoption (the keys every rank
    holds) finds them. A shared tier a rank leaves to the writer is not written. Returns each
    store's flush report (``None``: none ran); never raises."""
    reports: list[FlushReport | None] = [None] * len(sides)
    flushing: list[int] = []
    for i, side in enumerate(sides):
        try:
            await off_loop(side._transfers.close)
        except Exception as exc:  # a shutdown goes on
            log.warning("kvtier: rank %d: closing the transfers failed: %s", side._engine.rank, exc)
        if not side._engine.store.config.flush_on_close_s:
            continue
        if side._transfers.stopped:
            flushing.append(i)
        else:  # a job still running could reuse a row being read
            log.warning("kvtier: rank %d: jobs still running at shutdown; no write-back", side._engine.rank)
    if flushing:
        config = sides[flushing[0]]._engine.store.config  # the groups' stores share the engine's settings
        try:
            done = await flush_listed_groups(
                [sides[i]._engine.store.backends for i in flushing],
                budget_s=config.flush_on_close_s,
                budget_bytes=config.flush_on_close_bytes,
                skip=sides[flushing[0]]._engine.skip_tiers,
            )
        except Exception as exc:  # a shutdown never fails over the write-back
            log.warning("kvtier: rank %d: write-back at shutdown failed: %s", sides[flushing[0]]._engine.rank, exc)
            done = []
        for i, report in zip(flushing, done):
            reports[i] = report
            sides[i]._engine.counters["blocks_flushed_at_close"] += report.flushed
            sides[i]._engine.counters["blocks_flush_failed_at_close"] += report.failed
    for side in sides:
        try:
            await side._engine.store.aclose()
        except Exception as exc:
            log.warning("kvtier: rank %d: closing the store failed: %s", side._engine.rank, exc)
    return reports


#: vLLM's null block: the placeholder block of its block pool, whose bytes no request reads.
NULL_BLOCK = 0


def chunk_block_ids(ids: list[int], first_index: int, n: int, num_keys: int) -> tuple[list[int], list[list[int]]]:
    """The ``n`` engine block ids per key of a load into ``ids`` (the request's blocks from
    ``first_index`` on) and the real ones per key. vLLM's keys start at the chunk that holds
    block ``first_index``: its leading ``first_index % n`` blocks (on the engine already) and
    the blocks past ``ids`` in the last chunk (a hit that ends inside it) go to the null block,
    so no block the engine holds or computes is written."""
    skip = first_index % n
    tail = num_keys * n - skip - len(ids)
    if not 0 <= tail < n:
        raise ValueError(f"{len(ids)} engine blocks from block {first_index} do not fill {num_keys} chunks of {n}")
    padded = [NULL_BLOCK] * skip + ids + [NULL_BLOCK] * tail
    real = [ids[max(0, k * n - skip) : max(0, (k + 1) * n - skip)] for k in range(num_keys)]
    return padded, real


def _failed_load_keys(result: JobResult, num_keys: int) -> list[int]:
    """Positions of the keys a load did not bring back (all of them when the job failed)."""
    if result.error is not None:
        return list(range(num_keys))
    if not result.missed:
        return []
    missed = set(result.missed)
    return [i for i, k in enumerate(result.keys) if k in missed]
