"""Group commit across store jobs: the write-through copies of the jobs the tiers thread takes
together are written with one ``write_blocks`` call per byte tier.

The tiers thread takes every store job waiting for it (up to :data:`MAX_GROUP_JOBS`) as one
group. It runs each job's tier phase in order (evictions, demotions, the first tier's write) and
collects the jobs' write-through copies to byte tiers here; then one call per tier writes them
all, so the tier commits them together (one durable commit for the whole group in ``lmdb``);
then the jobs are reported, in order. No job is reported before its copies were written, so a
save still returns only once its blocks are on stable storage, and concurrent savers that wait
together share one commit instead of falling behind one commit each.

Only rows that stay put until the group's write are collected: a host pool's rows (the job's
keys are pending, so nothing evicts them) and the job's own staging. Rows read into the shared
staging buffer are written at once, as before.

A job staged on a device (its first tier a ``gpu`` tier) hands its byte tiers host rows: the
rows they need come out of the device staging in one gather and one DMA per job
(:func:`host_rows`), where each device row would otherwise cost the tier's record encoder one
blocking copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.backend import Backend
from kvtier.devices import copy_rows, wait_for_copies
from kvtier.pool_rows import PoolRows

__all__ = ["MAX_GROUP_JOBS", "WriteGroup", "host_rows"]

log = logging.getLogger("kvtier.transfer")

#: Store jobs the tiers thread takes as one group at most.
MAX_GROUP_JOBS = 16


def host_rows(staging: torch.Tensor, positions: Sequence[int]) -> dict[int, torch.Tensor]:
    """``staging[p]`` for each of ``positions`` (rows of a job's device staging) as rows of one
    pinned host tensor, copied with one gather and one DMA and waited for."""
    want = sorted(set(positions))
    if not want:
        return {}
    host = torch.empty((len(want), staging.shape[1]), dtype=staging.dtype, pin_memory=True)
    copy_rows(staging, want, host)
    wait_for_copies((staging, host))
    return {p: host[i] for i, p in enumerate(want)}


@dataclass(slots=True, eq=False)
class _Copy:
    job: int
    tier: int
    keys: list[bytes]
    rows: Sequence[torch.Tensor]  # a PoolRows where the tier takes one (kvtier.transfer.tier_rows)
    ok: list[bool]  # False: the source no longer held the key (its row is a placeholder)
    failed: dict[int, list[bytes]]
    sizes: dict[int, dict[bytes, int]]
    fail_job: Callable[[str], None]


class WriteGroup:
    """The collected write-through copies of a group of store jobs (see the module doc)."""

    def __init__(self) -> None:
        self._copies: list[_Copy] = []

    def add(
        self,
        job: int,
        tier: int,
        keys: Sequence[bytes],
        rows: Sequence[torch.Tensor],
        ok: Sequence[bool],
        failed: dict[int, list[bytes]],
        sizes: dict[int, dict[bytes, int]],
        fail_job: Callable[[str], None],
    ) -> None:
        """Collect job ``job``'s copy of ``keys`` (from ``rows``) into ``tier``; its outcome goes
        into ``failed``/``sizes`` as a direct write's would, and ``fail_job`` is called with the
        error if the tier's write raises."""
        self._copies.append(_Copy(job, tier, list(keys), rows if isinstance(rows, PoolRows) else list(rows), list(ok), failed, sizes, fail_job))

    def discard(self, job: int) -> None:
        """Drop job ``job``'s copies (it failed or was stopped before the group's write)."""
        self._copies = [c for c in self._copies if c.job != job]

    def write(self, backends: Sequence[Backend]) -> None:
        """One ``write_blocks`` per tier for every collected copy, in collection order."""
        by_tier: dict[int, list[_Copy]] = {}
        for c in self._copies:
            by_tier.setdefault(c.tier, []).append(c)
        self._copies = []
        for tier, copies in by_tier.items():
            keys = [k for c in copies for k in c.keys]
            try:
                got = backends[tier].write_blocks(keys, _joined([c.rows for c in copies]))
                if len(got) != len(keys):
                    raise RuntimeError(f"write_blocks answered {len(got)} sizes for {len(keys)} keys")
            except BaseException as exc:  # as a direct write that raised (an interrupt too): each job of the group fails
                log.warning("write-through of %d blocks from %d jobs to tier %d failed: %s", len(keys), len(copies), tier, exc)
                for c in copies:
                    c.fail_job(repr(exc))
                continue
            at = 0
            for c in copies:
                for key, size, ok in zip(c.keys, got[at : at + len(c.keys)], c.ok):
                    if size is None or not ok:
                        c.failed.setdefault(tier, []).append(key)
                    else:
                        c.sizes.setdefault(tier, {})[key] = size
                at += len(c.keys)


def _joined(parts: list[Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
    """The rows of ``parts`` in order, as one sequence: one part as it is; parts that are all
    :class:`PoolRows` of one pool as one :class:`PoolRows` of it (a tier takes a :class:`PoolRows`
    only where it said so: ``add`` got one only then); else a list."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, PoolRows) and all(isinstance(p, PoolRows) and p.pool is first.pool for p in parts):
        return PoolRows(first.pool, [i for p in parts for i in p.numbers])  # type: ignore[attr-defined]
    return [r for p in parts for r in p]
