"""The recent job ids the vLLM sides remember take a fixed amount of memory, however many jobs
an engine runs (the 10-minute soak's RSS grew 8.8 % while ordered dicts of them filled)."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable

import pytest
from vllm_world import World, cpu, open_world

from kvtier.integrations.vllm.deadlines import Abandoned, ResultDeadlines
from kvtier.integrations.vllm.recent import RecentIds
from kvtier.transfer import JobResult

JOBS = 120_000
MIB = 1 << 20


def test_recent_ids_remember_exactly_the_newest_span_of_ids() -> None:
    rng = random.Random(4)
    span = 16
    recent = RecentIds(span)
    added: set[int] = set()
    top = -1
    assert 0 not in recent and "x" not in recent
    job = 0
    for _ in range(5000):
        job += rng.choice([1, 1, 1, 2, 5, span - 1, span, 3 * span])  # counted up, now and then a jump
        late = job - rng.randrange(2 * span)  # a late add of an older id
        for j in (job, late):
            recent.add(j)
            added.add(j)
            top = max(top, j)
        for j in range(job - 3 * span, job + 3):
            assert (j in recent) == (j in added and top - span < j <= top), (j, top)


def test_recent_ids_refuse_an_empty_span() -> None:
    with pytest.raises(ValueError, match="span"):
        RecentIds(0)


def _traced_growth(run: Callable[[], None]) -> int:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_the_scheduler_side_s_settled_jobs_take_fixed_memory() -> None:
    deadlines = ResultDeadlines(2, 10.0, clock=lambda: 0.0)
    first = 10_000

    def run(start: int, end: int) -> None:
        for job in range(start, end):
            deadlines.issued(job, "store", job)
            assert deadlines.completed({job: 2}) == {job: 2}
        deadlines.take_done()

    run(0, first)  # warm: the fixed part is there
    assert _traced_growth(lambda: run(first, JOBS)) < MIB
    assert deadlines.completed({JOBS - 1: 1}) == {}  # a late report of a settled job is still dropped
    assert len(deadlines) == 0


class _Finished:
    """Stands in for a rank's transfer engine: every job it is handed has finished."""

    def __init__(self) -> None:
        self.done: list[JobResult] = []

    def poll_finished(self) -> list[JobResult]:
        done, self.done = self.done, []
        return done


async def test_a_rank_s_reported_jobs_take_fixed_memory() -> None:
    w: World = await open_world(1, [cpu(4, 1)])
    worker = w.workers[0]
    real, stand_in = worker._transfers, _Finished()
    worker._transfers = stand_in  # type: ignore[assignment]
    try:

        def run(start: int, end: int) -> None:
            for base in range(start, end, 1000):
                for job in range(base, base + 1000):
                    worker._jobs[job] = (job, ("store", job), [[0]])
                    stand_in.done.append(JobResult(job, "store", True, ()))
                assert len(worker.finished()) == 1000
                worker.take_outbox()

        run(0, 10_000)
        assert _traced_growth(lambda: run(10_000, JOBS)) < MIB
        # a notice of a job this rank reported is still ignored
        assert worker.abandon([Abandoned(JOBS - 1, "store", JOBS - 1, (0,))]) == 0 and not worker._jobs
    finally:
        worker._transfers = real
        await w.close()
