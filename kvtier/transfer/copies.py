"""One job's host copy, dealt out to a few threads.

A job between a host KV cache and a host pool is one ``index_select`` (or ``index_copy_``) per
KV tensor. :class:`CopySplitter` deals a job's per-tensor copies out to ``threads`` threads: the
calling thread runs one share and a process-wide pool (``kvtier-copy-*`` threads, created on
first use and again in a forked child) the others. The ops release the GIL, so the shares
overlap.

**Each share runs on its thread alone** (:func:`one_intra_op_thread`): torch splits a copy this
wide over its OpenMP intra-op threads, and OpenMP gives every thread that starts a parallel
region a team of its own. So a copy on the mover thread made a second team beside the
engine's. With more OpenMP threads than CPUs, libgomp stops spinning between regions, and every
region of either team then waits for its helpers to be woken. Measured on 2 CPUs
(``benchmarks/bench_core.py``): one thread copies at 6.4 GB/s and the calling thread with its
team of two at 12.8. A copy on another thread with a team of its own reached 9.7, and the
calling thread's own copies then fell to 9.7 as well. Two threads with one OpenMP thread each
reached 12.7 and left the calling thread's copies at 13.2. So ``copy_threads`` is exactly the
threads a job's copy uses.

Where the native block copy is built (:mod:`kvtier.transfer.block_copy`), a job of more than 8
blocks on a transfer thread is split by blocks instead (:meth:`CopySplitter.native_copy`): each
share one native call without the GIL, run by :meth:`CopySplitter.run` all the same.

The split never changes what is copied, only which thread copies it: every share writes
rows no other share writes. :meth:`CopySplitter.run` returns only once every share has ended,
failed or not, so no copy of the job is still running when the caller reports it (or a
cancellation waits for it). Jobs under :data:`MIN_SPLIT_BYTES` stay on the calling thread,
where a hop would cost more than it saves.

**A job run on its caller's team** (:meth:`CopySplitter.on_callers_team`, an inline job) copies
with that thread's OpenMP team: on 2 CPUs a 4-block job of 2 MiB blocks in about 1.0-1.2 ms
against 1.2-1.4 ms on the thread alone. But each piece of the copy is a parallel region that
waits for every thread of the team, and where the CPUs are oversubscribed (other processes
runnable) the helper waits its turn on a run queue at every region: measured here 5-480 ms for
the same job, against 1.2-1.4 ms alone (at most 5-13 ms where the caller's own thread was
preempted). :class:`TeamPace` tells when the thread alone is faster by the caller's thread
itself: a job on the team whose thread ran for less than three quarters of the job's wall time
(``thread_time`` against ``perf_counter``; undisturbed it runs or spins the whole time) has
waited for CPUs, and if it also took longer per byte than the jobs alone lately (or none has
run alone yet), it lost. After :data:`SOLO_AFTER` such jobs in a row (one is a lone
disturbance, not a loaded host), the jobs of the next :data:`SOLO_HOLD_S` seconds copy on the
thread alone (and are timed: a moving average per byte). The first job after that tries the
team again; if it loses too, the hold doubles (up to :data:`SOLO_HOLD_MAX_S`), so a loaded host pays one slow
job per hold. A job on the team that ran undisturbed, or waited and still beat the thread
alone, resets the hold. A quiet host never leaves the team. Jobs under :data:`PACE_MIN_BYTES`
are neither timed nor moved off the team. Either way the same bytes are copied.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Literal

import torch

from kvtier.devices import one_intra_op_thread, usable_cpus
from kvtier.errors import LayoutError
from kvtier.shares import run_all

if TYPE_CHECKING:
    from kvtier.transfer.block_copy import NativeBlocks

__all__ = [
    "MIN_SPLIT_BYTES",
    "PACE_MIN_BYTES",
    "SOLO_AFTER",
    "SOLO_HOLD_MAX_S",
    "SOLO_HOLD_S",
    "THREAD_PREFIX",
    "CopySplitter",
    "CopyThreads",
    "TeamPace",
    "auto_copy_threads",
    "one_intra_op_thread",
]

#: Jobs with fewer bytes than this are copied on the calling thread alone.
MIN_SPLIT_BYTES = 8 << 20
#: Name prefix of the copy threads (process-wide: they outlive every store).
THREAD_PREFIX = "kvtier-copy"
#: ``auto`` uses at most this many threads: a few saturate a socket's memory bandwidth, and
#: the engine's own compute (CPU inference) needs the other cores.
AUTO_MAX = 4
#: ``auto`` uses at least this many threads where there are as many CPUs: torch's own copy on
#: the calling thread uses every core with its intra-op threads.
AUTO_MIN = 2

#: After a job on the caller's team waited for CPUs, the jobs of this many seconds copy on the
#: caller's thread alone (see the module doc); each later such job doubles it, up to the most.
SOLO_HOLD_S = 1.0
SOLO_HOLD_MAX_S = 32.0
#: Team jobs that must lose in a row before the first hold (a lone disturbance is not a load).
SOLO_AFTER = 2
#: Smaller inline jobs are not timed and stay on the team: their copy is too short for a wait
#: to matter, and too short to time (two ``thread_time`` calls cost 0.6 µs here).
PACE_MIN_BYTES = 1 << 20

CopyThreads = int | Literal["auto"]

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_pid = 0
_lock = threading.Lock()


def auto_copy_threads(cpus: int | None = None) -> int:
    """Threads per job copy for ``copy_threads: auto``: a quarter of the CPUs this process may
    run on, between :data:`AUTO_MIN` and :data:`AUTO_MAX`, and never more than the CPUs."""
    if cpus is None:
        cpus = usable_cpus()
    return max(1, min(cpus, max(AUTO_MIN, min(AUTO_MAX, cpus // 4))))


def resolve_copy_threads(value: CopyThreads) -> int:
    """``value`` as a thread count (``auto``: :func:`auto_copy_threads`); a clear error otherwise."""
    if value == "auto":
        return auto_copy_threads()
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"copy_threads: expected 'auto' or an integer >= 1, got {value!r}")
    return value


def _pool(workers: int) -> ThreadPoolExecutor:
    global _pools_pid
    with _lock:
        if _pools_pid != os.getpid():  # a forked child: the parent's pools have no threads here
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=THREAD_PREFIX)
        return pool


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # it may have been held by a thread that does not exist here


os.register_at_fork(after_in_child=_after_fork_in_child)


def _run_all(parts: Sequence[Callable[[], None]]) -> None:
    with one_intra_op_thread():
        for part in parts:
            part()


class TeamPace:
    """Whether a job run on its caller's thread copies with the thread's OpenMP team or on the
    thread alone (see the module doc). ``clock`` gives seconds (monotonic)."""

    __slots__ = ("_clock", "alone", "hold", "lost", "until")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.hold = SOLO_HOLD_S  # the next hold, in seconds
        self.until = 0.0  # jobs copy on their thread alone until then
        self.alone = 0.0  # wall ns per byte of the recent jobs alone (0: none yet)
        self.lost = 0  # team jobs lost in a row

    def solo(self) -> bool:
        """Whether the next job copies on its thread alone."""
        return self.until != 0.0 and self._clock() < self.until

    def note(self, solo: bool, wall_ns: int, cpu_ns: int, nbytes: int) -> None:
        """A job moving ``nbytes`` ended that ran alone (``solo``) or on the team, taking
        ``wall_ns`` of which its thread ran ``cpu_ns``."""
        per = wall_ns / max(nbytes, 1)
        alone = self.alone
        if solo:  # a moving average, a quarter to the newest
            self.alone = per if alone == 0.0 else alone + (per - alone) / 4
            return
        if 4 * cpu_ns < 3 * wall_ns and (alone == 0.0 or per > alone):
            # off its CPU for a quarter of the job, and slower than alone lately (or not known)
            self.lost += 1
            if self.lost >= SOLO_AFTER:
                self.until = self._clock() + self.hold
                self.hold = min(2 * self.hold, SOLO_HOLD_MAX_S)
        else:
            self.lost = 0
            self.until = 0.0
            self.hold = SOLO_HOLD_S


class _CallersTeam:
    """:meth:`CopySplitter.on_callers_team`'s context: sets the thread's flag, then restores it;
    times the job for ``pace`` and, where it says so, confines the thread's copies to it."""

    __slots__ = ("_alone", "_before", "_callers", "_cpu", "_nbytes", "_pace", "_timed", "_wall")

    def __init__(self, callers: threading.local, pace: TeamPace | None, nbytes: int) -> None:
        self._callers = callers
        self._pace = pace  # None: not timed, on the team
        self._nbytes = nbytes
        self._before = self._timed = False
        self._alone: contextlib.AbstractContextManager[None] | None = None
        self._wall = self._cpu = 0

    def __enter__(self) -> None:
        callers = self._callers
        self._before = getattr(callers, "on", False)
        self._timed = getattr(callers, "timed", False)
        callers.on = True
        callers.timed = False  # whether a native copy may take the team (the pace times it)
        pace = self._pace
        if pace is not None:
            if pace.until != 0.0 and pace._clock() < pace.until:  # (pace.solo(), inline)
                self._alone = one_intra_op_thread()
                self._alone.__enter__()
                callers.alone = True
            else:
                callers.timed = True
            self._wall, self._cpu = time.perf_counter_ns(), time.thread_time_ns()

    def __exit__(self, *exc: object) -> None:
        pace = self._pace
        callers = self._callers
        callers.timed = self._timed
        if pace is None:
            callers.on = self._before
            return
        wall, cpu = time.perf_counter_ns() - self._wall, time.thread_time_ns() - self._cpu
        alone = self._alone
        if alone is not None:
            self._alone = None
            callers.alone = False
            alone.__exit__(None, None, None)
        callers.on = self._before
        if getattr(callers, "native", False):  # copied without the team: says nothing of it
            callers.native = False
            return
        pace.note(alone is not None, wall, cpu, self._nbytes)


class CopySplitter:
    """Runs a job's copies (independent callables writing disjoint rows) on ``threads`` threads."""

    def __init__(self, threads: CopyThreads = 1, *, min_bytes: int = MIN_SPLIT_BYTES) -> None:
        self.threads = resolve_copy_threads(threads)
        self.min_bytes = min_bytes
        self._callers = threading.local()
        #: whether an inline job copies on its caller's team or on the thread alone
        self.pace = TeamPace()

    def on_callers_team(self, nbytes: int = 0) -> _CallersTeam:
        """Inside, this thread's jobs copy on this thread with its own OpenMP team, unsplit: for
        a job run on the engine's own thread (:mod:`kvtier.transfer.inline`), whose team is the
        engine's, so no second team is started. Measured here the fastest host copy (the raw
        ``index_select`` with torch's team of two in ``bench_core.py``). A plain class, not a
        generator: entered once per inline job, right after a copy has flushed the caches, where
        a ``contextlib`` manager cost 43 µs and this one 10. ``nbytes``: what the job moves; from
        :data:`PACE_MIN_BYTES` on it is timed, and copies on the thread alone while
        :attr:`pace` says so."""
        return _CallersTeam(self._callers, self.pace if nbytes >= PACE_MIN_BYTES else None, nbytes)

    def copied_natively(self, on_team: bool = False) -> None:
        """This job's copy ran in one native call (:mod:`kvtier.transfer.block_copy`), on this
        thread's team (``on_team``: a job :meth:`team_now` gave more than one thread, timed by
        :attr:`pace` as any job on the team) or on this thread alone: inside
        :meth:`on_callers_team`, :attr:`pace` then does not count its time for or against the
        team, unless the job was one the pace sent alone (:meth:`alone_now`): that is the
        thread alone's pace (elsewhere nothing is noted)."""
        callers = self._callers
        if not on_team and getattr(callers, "on", False) and not getattr(callers, "alone", False):
            callers.native = True

    def team_now(self) -> int:
        """The threads a native copy of this thread's job may take on its OpenMP team: the
        team's size (at least 1) for a job inside :meth:`on_callers_team` that :attr:`pace`
        times and keeps on the team (from :data:`PACE_MIN_BYTES`), else 0 (a job alone, a
        smaller one, or one not run inline: a thread other than the engine's would start a
        second team)."""
        return max(1, torch.get_num_threads()) if getattr(self._callers, "timed", False) else 0

    def native_copy(self, native: NativeBlocks, save: bool, ids: list[int], pool: torch.Tensor, rows: Sequence[int], small: bool) -> bool:
        """Copy this thread's job with ``native`` (:mod:`kvtier.transfer.block_copy`): a
        ``small`` job in one call on this thread; a larger inline job on this thread's team
        (:meth:`team_now`), or on the thread alone while the pace sends it alone; a larger job
        on a transfer thread split over the copy threads as :meth:`run` splits torch's (each
        share one call without the GIL). ``False``, having copied nothing, where torch copies
        it: a larger inline job not timed (under :data:`PACE_MIN_BYTES`), or the native copy off."""
        if small:
            threads = 1
        elif getattr(self._callers, "on", False):
            threads = self.team_now() or int(self.alone_now())
        else:
            nbytes = len(rows) * native.row_bytes
            return native.copy_split(save, ids, pool, rows, self.threads if nbytes >= self.min_bytes else 1, self.run) > 0
        used = native.copy(save, ids, pool, rows, threads) if threads else 0
        if used:
            self.copied_natively(used > 1)
        return used > 0

    def alone_now(self) -> bool:
        """Whether this thread's job runs inside :meth:`on_callers_team` on the thread alone,
        as :attr:`pace` says (not on the team): a native copy of any size is then faster than
        torch's on one thread (:mod:`kvtier.transfer.block_copy`)."""
        return getattr(self._callers, "alone", False)

    def on_this_thread(self) -> bool:
        """Whether this thread's copies run here, on its own team, unsplit (inside
        :meth:`on_callers_team`): a caller may then copy in a plain loop, as :meth:`run` would."""
        return getattr(self._callers, "on", False)

    def shares(self, parts: Sequence[Callable[[], None]], nbytes: int) -> list[Sequence[Callable[[], None]]]:
        """``parts`` cut into contiguous shares, one per thread used (one share: no split)."""
        n = min(self.threads, len(parts)) if nbytes >= self.min_bytes else 1
        if n <= 1:
            return [parts]
        q, r = divmod(len(parts), n)
        out: list[Sequence[Callable[[], None]]] = []
        start = 0
        for i in range(n):
            end = start + q + (i < r)
            out.append(parts[start:end])
            start = end
        return out

    def run(self, parts: Sequence[Callable[[], None]], nbytes: int) -> None:
        """Run every part once; ``nbytes`` is what they copy in all. Returns (or raises the
        first error) only after every share has ended."""
        if getattr(self._callers, "on", False):
            for part in parts:
                part()
            return
        shares = self.shares(parts, nbytes)
        pool = _pool(self.threads - 1) if len(shares) > 1 else None
        run_all(pool, [partial(_run_all, share) for share in shares])
