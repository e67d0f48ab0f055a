"""A store plan's work between tiers, whichever phase of the job runs it.

:class:`PlanWrites` carries out what a :class:`~kvtier.manager.StorePlan` asks of the tiers
beside writing its new blocks: the evictions (``drops``), the write-back demotions (read from
one tier, written to the next, then freed at the source), the tenant tags, copies from a memory
tier to another tier, and, for a job that failed or was stopped, the undo (its new blocks
deleted; everything it may have written deleted). :class:`~kvtier.transfer.movers.StoreMover`
calls it from the device thread (a job all in memory tiers) and from the tiers thread.

A job reported failed while this runs raises :class:`Expired` at the next check
(:func:`check_alive`): the mover stops and cleans up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.backend import Backend, MemoryBackend
from kvtier.devices import tensor_device
from kvtier.errors import LifecycleError
from kvtier.manager import StorePlan
from kvtier.pool_rows import PoolRows
from kvtier.transfer.jobs import JobRecord, StoreRecord
from kvtier.transfer.tier_rows import gives_pool_rows, kept_rows, rows_at, rows_for

__all__ = ["Expired", "Failed", "PlanHost", "PlanWrites", "Sizes", "TierWork", "check_alive", "delete_from", "note_sizes", "rows_of"]

log = logging.getLogger("kvtier.transfer")

#: keys whose write to a tier failed, by tier
Failed = dict[int, list[bytes]]
#: stored sizes of the keys written to a variable-size tier, by tier
Sizes = dict[int, dict[bytes, int]]


class PlanHost(Protocol):
    """What :class:`PlanWrites` and :func:`delete_from` use of the transfer engine."""

    backends: list[Backend]
    counters: dict[str, int]
    _lock: threading.Lock


#: Reasons for a delete that are the engine's choice alone (never a bad record, never an
#: operator's delete, never the cleanup of its own failed write): in a shared tier, a forget.
_LOCAL_CHOICES = frozenset({"eviction", "demotion"})


def delete_from(engine: PlanHost, tier: int, keys: Sequence[bytes], what: str) -> None:
    """Delete ``keys`` from tier ``tier`` for a job (``what`` says why, for the log); a failed
    delete is logged, never raised: an orphan costs room, never correctness."""
    if not keys:
        return
    backend = engine.backends[tier]
    if what in _LOCAL_CHOICES and getattr(backend, "shared", False):
        # Other engines may serve these records: this engine's own LRU (or a demotion out
        # of the tier) only forgets them; the server's policy evicts in a shared tier.
        with engine._lock:  # (the jobs of several threads evict at once)
            engine.counters["shared_forgotten"] += len(keys)
        forget = getattr(backend, "forget_blocks", None)
        if forget is not None:
            forget(keys)
        return
    try:
        backend.delete_blocks(keys)
    except Exception as exc:  # an orphan costs room, never correctness: go on
        log.warning("%s: deleting %d blocks from tier %d failed: %s", what, len(keys), tier, exc)


@dataclass(slots=True, eq=False)
class TierWork:
    """A store job's phase 2, handed from the device thread to the tiers thread."""

    rec: StoreRecord
    mode: str  # "staged" | "rest" (byte write-through after a direct device phase) | "degraded" | "cleanup"
    start: float
    staging: torch.Tensor | None = None
    staged_bytes: int = 0
    failed: Failed = field(default_factory=dict)
    sizes: Sizes = field(default_factory=dict)
    nbytes: int = 0
    error: str | None = None


class Expired(Exception):
    """The job was reported failed while its tier work ran: stop and clean up."""


def check_alive(rec: JobRecord) -> None:
    """Raise :class:`Expired` when ``rec`` was reported (failed) already."""
    if rec.result is not None:
        raise Expired


def note_sizes(tier: int, keys: Sequence[bytes], got: Sequence[int | None], failed: Failed, sizes: Sizes) -> None:
    for k, size in zip(keys, got):
        if size is None:
            failed.setdefault(tier, []).append(k)
        else:
            sizes.setdefault(tier, {})[k] = size


def rows_of(backend: Backend, keys: Sequence[bytes], staging: torch.Tensor, target: Backend) -> tuple[Sequence[torch.Tensor], list[bool]]:
    """Blocks of ``keys`` as CPU-readable rows for ``target``'s ``write_blocks``: pool rows of a
    host pool, else read into staging; one :class:`~kvtier.pool_rows.PoolRows` where the tier
    that takes them says it takes one (:mod:`kvtier.transfer.tier_rows`)."""
    if isinstance(backend, MemoryBackend) and tensor_device(backend.pool).type == "cpu":
        pool = backend.pool
        try:  # every key there (the usual copy): one call, the rows as one sequence
            return rows_at(target, pool, backend.slots(keys)), [True] * len(keys)
        except LifecycleError:  # one by one, to tell the missing ones
            pass
        found = []
        rows = []
        for key in keys:
            try:
                rows.append(pool[backend.slots([key])[0]])
                found.append(True)
            except LifecycleError:
                rows.append(staging[0])
                found.append(False)
        return rows, found
    out = rows_for(backend, staging, len(keys))
    found = backend.read_blocks(keys, out)
    # The rows read are the rows written: the same sequence where both tiers take one form.
    return (out if isinstance(out, PoolRows) is gives_pool_rows(target, staging) else rows_for(target, staging, len(keys))), found


def drop_reason(plan: StorePlan) -> str:
    """Why a plan drops keys: a plan that stores keys evicts to make room for them (this
    engine's own choice: a shared tier only forgets them); one with nothing but drops releases
    keys whose store failed, or that were asked to be deleted (deleted in every tier)."""
    return "eviction" if plan.keys else "release"


class PlanWrites:
    """Drops, demotions, tags, copies between tiers and undo of store plans, over the engine's
    tiers; see the module doc."""

    def __init__(self, engine: PlanHost) -> None:
        self.e = engine

    def delete_new(self, plan: StorePlan) -> None:
        """Release the plan's new blocks (the manager releases their reservations to match)."""
        for tier, keys in ((plan.tier, plan.keys), *plan.write_through):
            delete_from(self.e, tier, keys, "cleanup of a failed store")

    def cleanup(self, plan: StorePlan) -> None:
        """A job reported failed before it ended: run its evictions, and delete everything it
        may have written (the manager released all of it)."""
        for tier, keys in plan.drops:
            delete_from(self.e, tier, keys, drop_reason(plan))
        for d in plan.demotions:
            delete_from(self.e, d.src, d.keys, "eviction")
            delete_from(self.e, d.dst, d.keys, "cleanup of a stopped demotion")
        self.delete_new(plan)

    def drops_and_demotions(self, plan: StorePlan, staging: torch.Tensor, work: TierWork, *, check: bool) -> None:
        # 1. evicted keys that are not moving down from that very tier: their room is needed now.
        moving = {(d.src, k) for d in plan.demotions for k in d.keys} if plan.demotions else None
        for tier, keys in plan.drops:
            delete_from(self.e, tier, [k for k in keys if (tier, k) not in moving] if moving else keys, drop_reason(plan))
        # 2. write-back, deepest first: copy down, then free the source.
        chunk = staging.shape[0]
        for d in plan.demotions:
            src, dst = self.e.backends[d.src], self.e.backends[d.dst]
            for c in range(0, len(d.keys), chunk):
                keys = d.keys[c : c + chunk]
                try:
                    if check:
                        check_alive(work.rec)
                    rows, found = rows_of(src, keys, staging, dst)
                    keep = [i for i, ok in enumerate(found) if ok]
                    work.failed.setdefault(d.dst, []).extend(k for k, ok in zip(keys, found) if not ok)
                    if keep:
                        whole = len(keep) == len(keys)
                        move = list(keys) if whole else [keys[i] for i in keep]
                        got = dst.write_blocks(move, rows if whole else kept_rows(rows, keep))
                        note_sizes(d.dst, move, got, work.failed, work.sizes)
                except Expired:
                    raise
                except Exception as exc:  # the victims are lost (a miss later), the job goes on
                    log.warning("demotion of %d blocks to tier %d failed: %s", len(keys), d.dst, exc)
                    work.failed.setdefault(d.dst, []).extend(keys)
                finally:
                    # The manager already counts these keys as gone from the source: free them
                    # whatever happened, or the source's slots would leak.
                    delete_from(self.e, d.src, keys, "demotion")
        # 3. tenant tags and pins: one write per tier per job (bookkeeping: a failure is logged).
        for tier, owners, pins in plan.tags:
            try:
                self.e.backends[tier].write_tags(owners, pins, sync=False)
            except Exception as exc:  # a tier that cannot keep them still serves its blocks
                log.warning("tenant tags of %d blocks for tier %d not saved: %s", len(owners) + len(pins), tier, exc)

    def write_from(
        self,
        source: MemoryBackend,
        tier: int,
        keys: Sequence[bytes],
        staging: torch.Tensor,
        failed: Failed,
        sizes: Sizes,
    ) -> None:
        """Copy ``keys`` from the memory tier ``source`` to ``tier``, a chunk of ``staging`` at
        a time; failures and stored sizes go to ``failed`` and ``sizes``."""
        chunk = staging.shape[0]
        for c in range(0, len(keys), chunk):
            part = keys[c : c + chunk]
            target = self.e.backends[tier]
            rows, found = rows_of(source, part, staging, target)
            got = target.write_blocks(list(part), rows)
            # A key the source no longer held was written from a placeholder row: failed.
            note_sizes(tier, part, [s if ok else None for s, ok in zip(got, found)], failed, sizes)
