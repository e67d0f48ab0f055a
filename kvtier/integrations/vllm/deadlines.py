"""A scheduler-side deadline for jobs that some rank never reported, without vLLM.

vLLM's offloading scheduler settles a job only once every worker has counted it done
(``OffloadingWorkerMetadata.completed_jobs`` summed over the ranks). A rank that keeps stepping
but never reports a job (its job lost, or stuck on a tier with no ``job_deadline_s``) leaves
that count short forever: the keys stay pending in the manager, a load's request waits for its
KV forever, vLLM keeps stepping for the job (``has_pending_push_work``), and the job's GPU
blocks stay fenced.

:class:`ResultDeadlines` watches every job the scheduler hands out. Once a job is older than
the deadline and some rank's result is still missing, it is *abandoned*: an
:class:`Abandoned` notice names the silent ranks and travels to every worker in the next
step's connector metadata. Each silent rank then settles the job itself (the worker side's
``abandon``): it stops the transfer (after that it never touches an engine block again),
reports the job to vLLM as done and to kvtier as failed, and for a load names the job's GPU
blocks as load errors, so vLLM recomputes them on every rank
(``get_block_ids_with_load_errors``). The scheduler side then settles the job as failed as for
any failed job: a store's keys are released and the copies other ranks wrote are deleted
through the delete ledger. A rank that has stopped stepping cannot be helped by any connector:
vLLM's executor waits for every rank's output each step.

Counts from the ranks pass through :meth:`ResultDeadlines.completed` before vLLM sees them:
a job is counted never past the number of ranks, and not at all once settled, so a rank that reports a
job twice (its late report racing the notice) never makes vLLM look up a job it already
settled (a ``KeyError`` in vLLM's step loop) or count a job done before every rank is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvtier.integrations.vllm.recent import RecentIds

__all__ = ["Abandoned", "ResultDeadlines"]



@dataclass(frozen=True)
class Abandoned:
    """Job ``job_id`` (vLLM's id) that ``ranks`` never reported: each of them settles it."""

    job_id: int
    kind: str  # "store" or "load"
    plan_id: int  # the store plan's id, or the load's id
    ranks: tuple[int, ...]
    #: a load's GPU block ids (reported as load errors by a rank that lost the job)
    block_ids: tuple[int, ...] = ()


@dataclass
class _Open:
    kind: str
    plan_id: int
    issued: float
    block_ids: tuple[int, ...]
    counted: int = 0  # completions vLLM has been told of, over all ranks
    ranks: set[int] = field(default_factory=set)  # ranks whose kvtier result arrived
    abandoned: bool = False


class ResultDeadlines:
    """Open jobs by vLLM job id, the ranks that reported them, and their deadline."""

    def __init__(self, world_size: int, deadline_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if deadline_s <= 0:
            raise ValueError(f"result deadline: expected a positive number of seconds, got {deadline_s}")
        self._world = world_size
        self.deadline_s = deadline_s
        self._clock = clock
        self._open: dict[int, _Open] = {}
        self._by_plan: dict[tuple[str, int], int] = {}
        self._notices: list[Abandoned] = []
        self._settled = RecentIds()  # recently settled job ids (a late report comes within a few steps)
        self._done: list[tuple[str, int]] = []  # (kind, plan id) of jobs every rank counted, not yet taken

    def __len__(self) -> int:
        return len(self._open)

    def issued(self, job_id: int, kind: str, plan_id: int, block_ids: tuple[int, ...] = ()) -> None:
        """vLLM hands job ``job_id`` (kvtier's store plan or load ``plan_id``) to every rank."""
        self._open[job_id] = _Open(kind, plan_id, self._clock(), tuple(block_ids) if kind == "load" else ())
        self._by_plan[(kind, plan_id)] = job_id

    def reported(self, rank: int, kind: str, plan_id: int) -> None:
        """Rank ``rank``'s kvtier result of a job arrived."""
        job_id = self._by_plan.get((kind, plan_id))
        if job_id is not None:
            self._open[job_id].ranks.add(rank)

    def completed(self, counts: Mapping[int, int]) -> dict[int, int]:
        """The ranks' completion counts vLLM may see: open jobs only, never more than the ranks
        that are still due (a job whose count is full is settled by vLLM and forgotten here)."""
        out: dict[int, int] = {}
        for job_id, count in counts.items():
            job = self._open.get(job_id)
            if job is None:
                if job_id not in self._settled:
                    out[job_id] = count  # not one of kvtier's: vLLM's own bookkeeping applies
                continue
            count = min(count, self._world - job.counted)
            if count <= 0:
                continue
            out[job_id] = count
            job.counted += count
            if job.counted >= self._world:
                del self._open[job_id]
                self._by_plan.pop((job.kind, job.plan_id), None)
                self._done.append((job.kind, job.plan_id))
                self._settled.add(job_id)
        return out

    def take_done(self) -> list[tuple[str, int]]:
        """(kind, plan id) of the jobs every rank has counted done since the last call: no rank
        touches them any more, whether or not each rank's kvtier result arrived."""
        done, self._done = self._done, []
        return done

    def watches(self, kind: str, plan_id: int) -> bool:
        """Whether a job of this plan was handed out and is still open."""
        return (kind, plan_id) in self._by_plan

    def expire(self) -> list[Abandoned]:
        """Abandon the jobs past the deadline that some rank has not reported (once each);
        their notices are also kept for :meth:`take_notices`."""
        now = self._clock()
        out = []
        for job_id, job in self._open.items():
            if job.abandoned or now - job.issued < self.deadline_s:
                continue
            silent = tuple(r for r in range(self._world) if r not in job.ranks)
            if not silent:
                continue  # every result is in; vLLM's count follows in the same output
            job.abandoned = True
            out.append(Abandoned(job_id, job.kind, job.plan_id, silent, job.block_ids))
        self._notices.extend(out)
        return out

    @property
    def notices_owed(self) -> int:
        """Notices not yet taken by :meth:`take_notices`."""
        return len(self._notices)

    def take_notices(self) -> tuple[Abandoned, ...]:
        """The notices not yet sent to the workers (the next step's connector metadata)."""
        notices, self._notices = tuple(self._notices), []
        return notices
