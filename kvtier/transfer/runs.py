"""The store facade's ``save`` and ``load``: prepare -> transfer -> complete, for engines that
want no connector, and the jobs of callers cancelled while they ran.

:class:`JobRuns` does the work of :meth:`kvtier.store.KVStore.save` and
:meth:`~kvtier.store.KVStore.load` (their docstrings say what each promises): a save stored in
runs in prefix order, a failed write releasing what was stored behind it, a load promoting what
it served from a lower tier. Every job is awaited by :meth:`JobRuns.run`: when the caller is
cancelled (or interrupted while it waits) the job is stopped first (after that it never touches the caller's blocks) and its
plan is applied to the manager whenever it ends, so no pin or reservation is left behind; a
job that goes up as an interrupt (``KeyboardInterrupt``, say), or that the engine refuses, has
its plan released at once (:meth:`JobRuns.release`); an interrupt once the job has ended (its
result in hand, not yet applied) applies the result first (:meth:`JobRuns.abandon`).
The store checks its input and that it is open before it calls in, and saves the tenant tags.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvtier.errors import ClosedError, ConfigError
from kvtier.manager import KeyState, LoadPlan, StorePlan, TierManager
from kvtier.metrics import StoreMetrics
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.jobs import Applied, JobResult, apply_result, plan_failed

__all__ = ["JobRuns"]

log = logging.getLogger("kvtier")


class JobRuns:
    """Save and load jobs of one store: ``manager`` answers its manager (raising once it is
    closed), ``closed`` whether it is closing, ``n`` engine blocks make one block.

    ``memory_only`` counts the blocks saves stored in memory tiers only; ``unsettled`` holds the
    jobs of cancelled callers (job id -> plan) until they are applied, ``settlers`` the tasks
    that wait for them."""

    def __init__(
        self, manager: Callable[[], TierManager], metrics: StoreMetrics, block_bytes: int, n: int, closed: Callable[[], bool]
    ) -> None:
        self._mgr = manager
        self._metrics = metrics
        self._block_bytes = block_bytes
        self._n = n
        self._closed = closed
        self.memory_only = 0
        self.unsettled: dict[int, StorePlan | LoadPlan] = {}
        self.settlers: set[asyncio.Task[None]] = set()
        # (manager, its persistent tiers, the blocks its tiers below the first hold at most)
        self._tiers: tuple[TierManager, list[int], int] | None = None

    def _tier_facts(self, mgr: TierManager) -> tuple[TierManager, list[int], int]:
        """``mgr``, its persistent tiers and the blocks its tiers below the first hold, at
        most: fixed for a manager's life, so worked out on its first save and kept
        (``self._tiers``, which a save reads first)."""
        specs = [mgr.tier_spec(t) for t in range(mgr.num_tiers)]
        below = sum(spec.capacity_bytes // spec.block_reserve for spec in specs[1:])
        facts = self._tiers = (mgr, [t for t, spec in enumerate(specs) if spec.persistent], below)
        return facts

    def finish_store(self, plan: StorePlan, result: JobResult) -> int:
        """Apply a finished store job to the manager; return how many blocks became ready. An
        interrupt before the manager completed the plan applies it again, then goes on up: a
        plan the manager already completed is refused with no change (``complete_store``
        checks every key first), so nothing is applied twice and no key stays pending."""
        try:
            applied = apply_result(self._mgr(), plan, result)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                try:
                    apply_result(self._mgr(), plan, result)
                except Exception as again:  # completed already, or a closed manager
                    log.debug("kvtier: an interrupted store not applied again: %s", again)
            raise
        self._metrics.record_store(plan, result, self._block_bytes)
        return applied.done

    def finish_load(self, plan: LoadPlan, result: JobResult) -> Applied:
        """Apply a finished load job: unpin, and forget keys that turned out missing or corrupt.
        An interrupt before the manager's unpin began (``unpins_begun`` unmoved) applies it
        again, then goes on up; once it may have begun, or where another thread's unpin moved
        the count too, nothing is applied again (a second unpin could release another load's
        pin: the pin stays instead)."""
        began = -1
        try:
            mgr = self._mgr()
            began = mgr.unpins_begun
            applied = apply_result(mgr, plan, result)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                try:
                    mgr = self._mgr()
                    if began < 0 or mgr.unpins_begun == began:
                        apply_result(mgr, plan, result)
                except Exception as again:  # a closed manager
                    log.debug("kvtier: an interrupted load not applied again: %s", again)
            raise
        self._metrics.record_load(plan, result, self._block_bytes)
        return applied

    # -- save ------------------------------------------------------------------------------
    async def save(
        self, transfers: TransferEngine, keys: Sequence[bytes], ids: Sequence[int], *, durable: bool, tenant: str | None
    ) -> tuple[int, int]:
        """``KVStore.save`` of checked ``keys`` and engine ``ids`` (a list from
        ``layout.check_block_ids``: its jobs are submitted ``checked``): (blocks newly stored,
        those of them on a persistent tier)."""
        if self.unsettled:  # (tested here: a call less per job, right after a cache flush)
            self.settle_finished(transfers)
        n = self._n
        mgr = self._mgr()
        facts = self._tiers
        if facts is None or facts[0] is not mgr:
            facts = self._tier_facts(mgr)
        _, persistent, below = facts
        if durable and not persistent:
            raise ConfigError("save(durable=True): the store has no persistent tier (tiers: an lmdb, file or redis tier)")
        kept = 0  # newly stored blocks on a persistent tier
        stored = 0
        rest: Sequence[bytes] = keys
        offset = 0  # rest[i] is keys[offset + i]
        while rest:
            # A later run pushes the earlier ones out of the first tier: go on only while the
            # lower tiers could hold all of them, and while they still hold every one, so the
            # batch's leading run is never cut to make room for its tail.
            if offset and (offset > below or mgr.lookup(keys[:offset]) < offset):
                break
            plan = mgr.prepare_store(rest, partial=True, keep_below=keys[:offset], tenant=tenant)
            if plan is None or (not plan.keys and plan.empty):  # (a plan with keys is not empty)
                break
            whole = len(plan.keys) == len(rest)  # every key of the rest is new: positions 0, 1, ...
            chosen = ids if whole and not offset else [b for p in plan.positions for b in ids[(offset + p) * n : (offset + p + 1) * n]]
            result: JobResult | None = None
            job = -1
            try:
                result = transfers.store_now(plan, chosen)  # a plain job: run here, no job record
                if result is None:
                    job = transfers.submit_store(plan, chosen, durable=durable, inline=True, checked=True)
                    result = transfers.take(job)  # it ran inline, or None
            except BaseException:
                self._interrupted(transfers, plan, job, result)
                raise
            if result is None:
                result = await self.run(transfers, job, plan)
            if self._closing(plan, result):  # closed while the job ran: nothing is left to apply it to
                return stored, kept
            done = self.finish_store(plan, result)
            if done < len(plan.keys):  # a failed write: the rest would only fail behind it
                done = await self._keep_the_leading_run(transfers, plan)
            stored += done
            on_disk = sum(1 for key in plan.keys[:done] if any(mgr.holds(key, t) for t in persistent)) if persistent else 0
            kept += on_disk
            self.memory_only += max(0, done - on_disk)
            if done < len(plan.keys) or not plan.keys or whole or len(plan.keys) + len(plan.skipped) == len(rest):
                break  # (the last two: the plan covered the whole rest, each key once)
            covered = {*plan.keys, *plan.skipped}
            taken = next((i for i, key in enumerate(rest) if key not in covered), len(rest))
            if taken < len(rest):
                log.debug("kvtier: save of %d blocks: the first tier took %d; storing the next run", len(keys), taken)
            rest, offset = rest[taken:], offset + taken
        return stored, kept

    async def _keep_the_leading_run(self, transfers: TransferEngine, plan: StorePlan) -> int:
        """After a store run whose writes failed in part: how many of its keys lie before the
        first one that is now in no tier. Those stored behind it are released: the manager
        forgets them, and a store job queued behind every earlier one deletes their records (so
        a later store of the same keys, queued after it, is never deleted by it)."""
        mgr = self._mgr()
        keys = plan.keys
        hole = next((i for i, key in enumerate(keys) if mgr.status(key).state is not KeyState.READY), len(keys))
        behind = keys[hole + 1 :]
        if behind:
            drops = tuple((tier, tuple(gone)) for tier in range(mgr.num_tiers) if (gone := mgr.remove(behind, tier)))
            if drops:
                released = len({key for _, gone in drops for key in gone})
                log.info("kvtier: save: %d blocks stored behind one that failed are released", released)
                release = StorePlan(0, (), (), drops=drops)
                try:
                    job = transfers.submit_store(release, [])
                except ClosedError:  # closing: the records stay, as orphans the next open adopts
                    return hole
                except BaseException:  # an interrupt: queued again (a second delete of them is none)
                    try:
                        transfers.submit_store(release, [])
                    except Exception as exc:
                        log.debug("kvtier: the release of blocks behind a failed one not queued: %s", exc)
                    raise
                await self.run(transfers, job, release)
        return hole

    # -- load ------------------------------------------------------------------------------
    async def load(self, transfers: TransferEngine, keys: Sequence[bytes], ids: Sequence[int], *, promote: bool) -> int:
        """``KVStore.load`` of checked ``keys`` into distinct engine ``ids`` (as for
        :meth:`save`): the leading blocks filled with the right bytes."""
        if self.unsettled:
            self.settle_finished(transfers)
        n = self._n
        mgr = self._mgr()
        plan = mgr.prepare_load_run(keys)  # lookup, then prepare_load(keys[:hits], promote=False)
        if plan is None:
            return 0
        hits = len(plan.keys)
        chosen = ids[: hits * n]
        result: JobResult | None = None
        job = -1
        try:
            result = transfers.load_now(plan, chosen)  # a plain job: run here, no job record
            if result is None:
                job = transfers.submit_load(plan, chosen, inline=True, checked=True)
                result = transfers.take(job)  # it ran inline, or None
        except BaseException:
            self._interrupted(transfers, plan, job, result)
            raise
        if result is None:
            result = await self.run(transfers, job, plan)
        if self._closing(plan, result):
            return 0
        self.finish_load(plan, result)
        if result.error is not None:
            return 0
        filled = hits
        if result.missed:
            missed = set(result.missed)
            filled = next(i for i, key in enumerate(plan.keys) if key in missed)
        if promote and filled and max(plan.tiers[:filled]) > 0:  # some were served from a lower tier
            await self._promote(plan.keys[:filled], ids, transfers)
        return filled

    async def _promote(self, keys: Sequence[bytes], ids: Sequence[int], transfers: TransferEngine) -> None:
        """Store ``keys`` (just loaded into ``ids``, ``n`` per key) into the first tier."""
        plan = self._mgr().prepare_promote(keys)
        if plan is None or not plan.keys:
            return
        n = self._n
        chosen = [b for p in plan.positions for b in ids[p * n : (p + 1) * n]]
        try:
            job = transfers.submit_store(plan, chosen, inline=True, checked=True)
        except BaseException:
            self._interrupted(transfers, plan, -1, None)  # released, its evictions still queued
            raise
        result = await self.run(transfers, job, plan)
        if not self._closing(plan, result):
            self.finish_store(plan, result)

    # -- jobs and cancelled callers --------------------------------------------------------
    def release(self, plan: StorePlan | LoadPlan) -> None:
        """Apply ``plan`` as failed as a whole, for a job that never ran or went up as an
        interrupt, the engine having undone its writes (:func:`plan_failed`): no pin or
        reservation of it is left behind in the manager."""
        try:
            apply_result(self._mgr(), plan, plan_failed(0, plan, "interrupted or refused"))
        except Exception as exc:  # a closed manager: nothing is left to release
            log.debug("kvtier: a plan of an interrupted call not released: %s", exc)

    def _interrupted(self, transfers: TransferEngine, plan: StorePlan | LoadPlan, job: int, result: JobResult | None) -> None:
        """For a call an interrupt stopped once its job was submitted (``job``; -1 before)
        but before it held the result: a job that ended (it ran inline) is taken now and
        applied (:meth:`abandon`); one still queued or running is stopped if it can be and
        applied when it ends, as for a cancelled caller; one whose result the interrupted
        ``take`` took with it is released, and what a store may have written is deleted by a
        job queued behind it (its outcome is lost: a miss, never a block the manager forgot)."""
        if result is None and job >= 0:
            try:
                try:
                    ended = transfers.wait([job], 0)  # [] for a job no longer known
                except TimeoutError:  # still queued or running
                    transfers.cancel(job)
                    self._settle_later(transfers, job, plan)
                    return
                if ended:
                    result = ended[0]
                    transfers.forget([job])
                elif isinstance(plan, StorePlan) and plan.keys:
                    self._release_and_drop(transfers, plan)
                    return
            except Exception as exc:  # (an engine that cannot answer, or closed: released as never run)
                log.debug("kvtier: the job of an interrupted call not settled: %s", exc)
        elif result is None and isinstance(plan, StorePlan) and plan.drops:
            # Stopped before its job was submitted, or as it was (its id not yet in hand): the
            # evictions the manager made at prepare may never have reached the tier.
            self._release_and_drop(transfers, plan)
            return
        self.abandon(plan, result)

    def _release_and_drop(self, transfers: TransferEngine, plan: StorePlan) -> None:
        """Release ``plan`` and queue a job that runs its evictions and deletes what it may have
        written, for a store whose outcome is unknown. Each delete is harmless where nothing
        was written: the keys were this plan's (pending) or its victims (forgotten at
        prepare), and any later store of them queues behind this job."""
        written = plan_failed(0, plan, "interrupted").failed
        self.release(plan)
        drops = tuple(plan.drops) + tuple((t, tuple(ks)) for t, ks in written.items())
        drop = StorePlan(0, (), (), drops=drops)
        try:
            self._settle_later(transfers, transfers.submit_store(drop, []), drop)  # (forgotten once it ends)
        except Exception as exc:  # closing: the records stay, as orphans the next open adopts
            log.debug("kvtier: the deletes of an interrupted store not queued: %s", exc)

    def abandon(self, plan: StorePlan | LoadPlan, result: JobResult | None) -> None:
        """For a call that goes up as an interrupt (or a refusal): a job that has run
        (``result``) is applied to the manager as the call would have applied it (not once the
        store is closing: nothing is left to apply it to), so the manager forgets no block its
        tiers hold; the plan of one that never ran is released (:meth:`release`). An interrupt
        inside :meth:`finish_store` or :meth:`finish_load` is covered there."""
        if result is None:
            self.release(plan)
            return
        try:
            if self._closed():
                return
            if isinstance(plan, StorePlan):
                self.finish_store(plan, result)
            else:
                self.finish_load(plan, result)
        except Exception as exc:  # a closed manager: nothing is left to apply it to
            log.debug("kvtier: the job of an interrupted call not applied: %s", exc)

    def _closing(self, plan: StorePlan | LoadPlan, result: JobResult) -> bool:
        """Whether the store is closing, with ``result`` (of ``plan``'s job) still to apply: an
        interrupt here applies it first (:meth:`abandon`), then goes on up."""
        try:
            return self._closed()
        except BaseException:
            self.abandon(plan, result)
            raise

    async def run(self, transfers: TransferEngine, job: int, plan: StorePlan | LoadPlan) -> JobResult:
        """Await ``job``. When the caller is cancelled (or interrupted), the job is stopped first (after that it
        never touches the caller's blocks; a copy under way is waited for), and its plan is
        applied to the manager whenever it ends, so no pin or reservation is left behind."""
        result = transfers.take(job)  # a job run inline has ended: nothing to wait for
        if result is not None:
            return result
        try:
            result = await transfers.wait_async(job)
        except BaseException:  # cancelled, or an interrupt: the job's plan is applied when it ends
            transfers.cancel(job)
            self._settle_later(transfers, job, plan)
            raise
        try:
            transfers.forget([job])
        except BaseException:  # the job has ended: its result is applied, not lost
            self.abandon(plan, result)
            raise
        return result

    def _settle_later(self, transfers: TransferEngine, job: int, plan: StorePlan | LoadPlan) -> None:
        self.unsettled[job] = plan
        if transfers.result(job) is not None:
            self.settle_finished(transfers)
            return
        try:
            task = asyncio.get_running_loop().create_task(self._settle_when_done(transfers, job))
        except RuntimeError:  # no loop to wait on: settled by the next call or by aclose
            return
        self.settlers.add(task)
        task.add_done_callback(self.settlers.discard)

    async def _settle_when_done(self, transfers: TransferEngine, job: int) -> None:
        try:
            await transfers.wait_async(job)
        except (asyncio.CancelledError, Exception):  # settled by the next call or by aclose
            return
        self.settle_finished(transfers)

    def settle_finished(self, transfers: TransferEngine | None) -> None:
        """Apply the jobs of cancelled callers that have ended since."""
        if not self.unsettled or transfers is None:
            return
        for job, plan in list(self.unsettled.items()):
            result = transfers.result(job)
            if result is None:
                continue
            del self.unsettled[job]
            try:  # applied before the job is forgotten: an interrupt in between loses no plan
                if isinstance(plan, StorePlan):
                    self.finish_store(plan, result)
                else:
                    self.finish_load(plan, result)
            except Exception as exc:  # a closed manager: nothing is left to release
                log.debug("job %d of a cancelled call not applied: %s", job, exc)
            finally:
                transfers.forget([job])
