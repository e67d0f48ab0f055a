"""The scheduler side's table of jobs built and not yet acknowledged by every worker.

It owns, for those jobs: their records and ids, the :class:`~kvtier.connector.fence.FenceIndex`
of the engine blocks that store jobs read, which key each store writes (``storing``), and how
many loads fill each key (``loading``). A job is settled when all ``world_size`` workers have
reported it: :meth:`JobTable.settle` removes it everywhere and returns the one
:class:`~kvtier.transfer.jobs.JobResult` of its ranks (:func:`~kvtier.transfer.jobs.combine_results`), which the connector applies to the manager.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, cast

from kvtier.connector.fence import FenceIndex
from kvtier.connector.types import JobReport
from kvtier.manager import LoadPlan, StorePlan
from kvtier.transfer.jobs import JobResult, combine_results

__all__ = ["JobTable", "TrackedJob"]


@dataclass(slots=True, eq=False)
class TrackedJob:
    """One connector job and the reports of the ranks that finished it so far."""

    job_id: int
    kind: Literal["store", "load"]
    request_id: str
    plan: StorePlan | LoadPlan
    block_ids: tuple[int, ...]
    reports: dict[int, JobReport] = field(default_factory=dict)  # rank -> report
    released: set[int] | None = None  # stores: ranks done reading the engine blocks
    promotion: bool = False  # stores: a promotion of keys a load served from a lower tier
    first_block: int = 0  # loads: offloaded block index of plan.keys[0]
    base_tokens: int = 0  # loads: tokens valid before the load
    end_tokens: int = 0  # loads: tokens valid if every key loads


class JobTable:
    """Jobs in flight, their fence, and the keys they write or fill."""

    __slots__ = (
        "_ack_deadline_s",
        "_ids",
        "_jobs",
        "_lingering",
        "_loading",
        "_storing",
        "_waiting",
        "fence",
        "generation",
        "world_size",
    )

    def __init__(self, world_size: int, ack_deadline_s: float | None = None) -> None:
        self.world_size = world_size
        self._ack_deadline_s = ack_deadline_s
        # store job id -> monotonic time past which the ranks that have not reported are given up
        self._waiting: dict[int, float] = {}
        # given-up store jobs whose fence stays up until every rank is done reading their blocks
        self._lingering: dict[int, TrackedJob] = {}
        self._jobs: dict[int, TrackedJob] = {}
        self._ids = itertools.count(1)
        self.fence = FenceIndex()
        self._storing: dict[bytes, int] = {}  # key -> the unacknowledged store job writing it
        self._loading: dict[bytes, int] = {}  # key -> loads in flight that fill it
        #: bumped by every settled job: the manager may have room again (refused stores retry).
        self.generation = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __iter__(self) -> Iterator[int]:
        return iter(self._jobs)

    def get(self, job_id: int) -> TrackedJob | None:
        return self._jobs.get(job_id)

    def kind(self, job_id: int) -> str:
        return self._jobs[job_id].kind

    # -- building ----------------------------------------------------------------------------
    def add_store(
        self, request_id: str, plan: StorePlan, block_ids: tuple[int, ...], *, promotion: bool = False
    ) -> TrackedJob:
        """Track a new store job and fence the engine blocks it reads."""
        job = TrackedJob(next(self._ids), "store", request_id, plan, block_ids, promotion=promotion)
        self._jobs[job.job_id] = job
        if not promotion:  # a promotion's keys are already ready in a lower tier
            for key in plan.keys:
                self._storing[key] = job.job_id
        self.fence.add(job.job_id, block_ids)
        return job

    def add_load(
        self, request_id: str, plan: LoadPlan, block_ids: tuple[int, ...], first_block: int, base: int, end: int
    ) -> TrackedJob:
        """Track a new load job filling ``block_ids``."""
        job = TrackedJob(next(self._ids), "load", request_id, plan, block_ids, first_block=first_block)
        job.base_tokens, job.end_tokens = base, end
        self._jobs[job.job_id] = job
        loading = self._loading
        for key in plan.keys:
            loading[key] = loading.get(key, 0) + 1
        return job

    def storing(self, key: bytes) -> int | None:
        """The unacknowledged store job writing ``key``, if any."""
        return self._storing.get(key)

    @property
    def any_storing(self) -> bool:
        return bool(self._storing)

    def any_loading(self, keys: list[bytes]) -> bool:
        """Whether a load in flight fills one of ``keys``."""
        loading = self._loading
        return bool(loading) and any(k in loading for k in keys)

    # -- completion --------------------------------------------------------------------------
    def acknowledge(self, job: TrackedJob, rank: int, report: JobReport, unfenced: list[int]) -> bool:
        """Record ``rank``'s report; true once every rank has reported (a duplicate counts once).
        A rank that finished a store is done reading its blocks too (see :meth:`release`)."""
        if rank not in job.reports:
            job.reports[rank] = report
        if len(job.reports) == self.world_size:
            return True
        if job.kind == "store":
            self.release(job, rank, unfenced)
            if self._ack_deadline_s is not None and job.job_id not in self._waiting:
                self._waiting[job.job_id] = time.monotonic() + self._ack_deadline_s
        return False

    def release(self, job: TrackedJob, rank: int, unfenced: list[int]) -> None:
        """``rank`` no longer reads ``job``'s engine blocks (its tier writes may go on); once no
        rank does, lift its fence and append the blocks no job reads any more to ``unfenced``."""
        if job.released is None:
            job.released = set()
        job.released.add(rank)
        if len(job.released) == self.world_size:
            unfenced.extend(self.fence.release(job.job_id, job.block_ids))
            self._lingering.pop(job.job_id, None)

    def lingering(self, job_id: int) -> TrackedJob | None:
        """A store job given up by :meth:`expire` whose blocks a rank may still read."""
        return self._lingering.get(job_id)

    @property
    def waiting(self) -> bool:
        """Whether a store job has some ranks' reports and waits for the others."""
        return bool(self._waiting)

    def expire(self, now: float, unfenced: list[int]) -> list[tuple[TrackedJob, JobResult]]:
        """Give up the store jobs whose missing ranks did not report by the ack deadline: each
        is settled as failed (with the ranks that never reported); its fence stays up until
        every rank is done reading its blocks (a late report or release lifts it)."""
        out: list[tuple[TrackedJob, JobResult]] = []
        for job_id, deadline in list(self._waiting.items()):
            if now < deadline:
                continue
            job = self._jobs[job_id]
            missing = tuple(r for r in range(self.world_size) if r not in job.reports)
            error = f"rank(s) {list(missing)} did not report within {self._ack_deadline_s} s"
            job.reports.update((r, JobReport(job_id, job.kind, False, error=error)) for r in missing)
            released = job.released or set()
            keep = len(released) < self.world_size
            out.append((job, self.settle(job, unfenced, keep_fence=keep)))
            if keep:
                self._lingering[job_id] = job
        return out

    def settle(self, job: TrackedJob, unfenced: list[int], *, keep_fence: bool = False) -> JobResult:
        """Remove a fully acknowledged job; append the blocks no job reads any more to
        ``unfenced``; return its ranks' results as one (a key that failed anywhere failed)."""
        del self._jobs[job.job_id]
        self._waiting.pop(job.job_id, None)
        self.generation += 1
        keys = job.plan.keys
        if job.kind == "store":
            if not keep_fence:
                unfenced.extend(self.fence.release(job.job_id, job.block_ids))
            storing = self._storing
            for key in keys:
                if storing.get(key) == job.job_id:
                    del storing[key]
        else:
            loading = self._loading
            for key in keys:
                left = loading.get(key, 0) - 1
                if left > 0:
                    loading[key] = left
                else:
                    loading.pop(key, None)
        if len(job.reports) == 1:  # one worker: its result as it is
            (report,) = job.reports.values()
            return _result(job.job_id, keys, report)
        return combine_results([_result(job.job_id, keys, job.reports[rank]) for rank in sorted(job.reports)])


def _result(job_id: int, keys: tuple[bytes, ...], r: JobReport) -> JobResult:
    return JobResult(
        job_id=job_id,
        kind=r.kind,
        success=r.success,
        keys=keys,
        nbytes=r.nbytes,
        failed=r.failed if isinstance(r.failed, dict) else dict(r.failed),
        missed=r.missed,
        missed_tiers=r.missed_tiers,
        # Decoded reports hold plain dicts already (read only from here on): no copies.
        sizes=cast(dict, r.sizes) if isinstance(r.sizes, dict) else {t: dict(per) for t, per in r.sizes.items()},
        error=r.error,
    )
