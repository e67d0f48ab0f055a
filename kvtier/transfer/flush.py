"""Write-back on a clean close: blocks held only in memory tiers go to the persistent tier.

In write-back mode a block reaches a lower tier only when it is evicted from the one above it,
so without a flush everything still in the memory tiers at exit is lost: a new process finds an
empty cache. :func:`flush_to_persistent` writes those blocks back to the first persistent tier
(``KVStore.aclose()`` calls it, and ``KVStore.flush()`` lets an engine do it earlier), bounded
by a time and a byte budget, most recently used first, skipping blocks that tier already holds.
What survives a crash is what reached a persistent tier before it; what survives a clean exit is
everything that fits in the persistent tier and the budget.

How: the blocks are pinned in the tier that serves them (``prepare_load``), so nothing evicts
or reuses them meanwhile, copied out in chunks (rows of a memory pool, or ``read_blocks`` of a
byte tier), written with the persistent backend's ``write_blocks`` off the event loop, adopted
into the manager's index of that tier (``adopt``: within its capacity, so a mid-run flush keeps
the accounting exact; blocks beyond it are deleted again), then unpinned. A failed write or read
is a block left unflushed, logged and counted, never an exception.

A store that only executes plans made by a manager elsewhere (a vLLM worker rank: the
scheduler side decides) has an empty index of its own; :func:`flush_listed_to_persistent`
lists the blocks from the backends instead (``stored_keys`` of the tiers above, ``scan`` of the
persistent one) and writes what the latter lacks, with the same budgets, chunks and counting.
Nothing pins the blocks there, so it runs only once nothing else writes the tiers.
:func:`flush_listed_groups` does that for several such stores (a vLLM rank's KV-cache groups)
within one budget, newest first across them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvtier.backend import Backend, MemoryBackend
from kvtier.devices import tensor_device
from kvtier.manager import KeyState, TierManager
from kvtier.transfer.offloop import off_loop
from kvtier.transfer.tier_rows import rows_for

__all__ = ["FlushReport", "first_persistent", "flush_listed_groups", "flush_listed_to_persistent", "flush_to_persistent"]

log = logging.getLogger("kvtier.transfer.flush")

#: Blocks copied and written per step (bounds the host memory a flush takes).
CHUNK_BLOCKS = 32
#: Seconds between progress lines.
PROGRESS_EVERY_S = 5.0


@dataclass(slots=True)
class FlushReport:
    """What a flush did. ``left`` counts blocks it had to leave (budget, room or failures)."""

    target: str | None = None
    candidates: int = 0
    already_there: int = 0
    flushed: int = 0
    flushed_bytes: int = 0
    failed: int = 0
    left: int = 0
    seconds: float = 0.0
    stopped_by: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def flush_to_persistent(
    manager: TierManager,
    backends: Sequence[Backend],
    *,
    budget_s: float | None = None,
    budget_bytes: int | None = None,
) -> FlushReport:
    """Write blocks ready only in non-persistent tiers back to the first persistent tier below
    them, most recently used first, within ``budget_s`` seconds and ``budget_bytes`` bytes
    (``None``: no limit). Safe to call while the store runs."""
    report = FlushReport()
    started = time.monotonic()
    target = first_persistent(backends)
    if target is None:
        return report
    report.target = manager.tier_spec(target).name
    listed = [reversed(manager.tier_keys(tier)) for tier in range(target)]  # tier_keys: next victim first
    keys = list(_candidates(listed, lambda key: manager.holds(key, target), report))

    async def write(chunk: list[bytes]) -> None:
        await _flush_chunk(manager, backends, target, chunk, report)

    await _write_within(keys, _room(manager, target, backends[target]), backends[target], report, started, budget_s, budget_bytes, write)
    return report


async def flush_listed_to_persistent(
    backends: Sequence[Backend],
    *,
    budget_s: float | None = None,
    budget_bytes: int | None = None,
    skip: Collection[int] = (),
) -> FlushReport:
    """:func:`flush_to_persistent` without a manager, for a store that only executes plans a
    manager elsewhere makes (a vLLM worker rank): the blocks the tiers above the first
    persistent tier list (``Backend.stored_keys``, newest first) that its ``scan`` lacks, within
    its free room and the budgets. Nothing pins them: call it only once nothing else writes the
    tiers (the transfer engine closed). The index of the persistent tier is rebuilt from its
    records at the next open. A persistent tier in ``skip`` (another rank writes it) is left
    alone (``stopped_by`` "skipped")."""
    (report,) = await flush_listed_groups([backends], budget_s=budget_s, budget_bytes=budget_bytes, skip=skip)
    return report


async def flush_listed_groups(
    groups: Sequence[Sequence[Backend]],
    *,
    budget_s: float | None = None,
    budget_bytes: int | None = None,
    skip: Collection[int] = (),
) -> list[FlushReport]:
    """:func:`flush_listed_to_persistent` of several stores (``groups``: each store's backends;
    under vLLM one per KV-cache group of a rank) within **one** time and byte budget, newest
    first across them: the newest chunk of every store, then the next newest of every store,
    and so on. vLLM stores a block of every group in the same job, so the ``i``-th newest blocks
    of the groups are about as recent, and a budget cut short leaves the oldest of every group.
    One report per store, in order."""
    started = time.monotonic()
    listed = [await _listed(backends, skip) for backends in groups]
    reports = [item if isinstance(item, FlushReport) else item.report for item in listed]
    todo = [item for item in listed if isinstance(item, _Listed)]
    bytes_left = budget_bytes
    last_log = started
    out_of_time = False
    while not out_of_time and any(item.done < item.limit for item in todo):
        for item in todo:
            if item.done >= item.limit:
                continue
            if budget_s is not None and time.monotonic() - started > budget_s:
                out_of_time = True
                break
            n = min(CHUNK_BLOCKS, item.limit - item.done)
            block = item.persistent.format.block_bytes
            if bytes_left is not None:
                n = min(n, bytes_left // block)
                if n == 0:  # this store's next block no longer fits the shared byte budget
                    item.limit, item.report.stopped_by = item.done, "bytes"
                    continue
                bytes_left -= n * block
            chunk = item.keys[item.done : item.done + n]
            item.done += n
            await item.write(chunk)
            now = time.monotonic()
            if now - last_log > PROGRESS_EVERY_S:
                last_log = now
                log.info("kvtier flush: %d blocks written (%.0f s)", sum(r.flushed for r in reports), now - started)
    for item in todo:
        if out_of_time and item.done < item.limit:
            item.report.stopped_by = "time"
        _close_report(item.report, len(item.keys), started)
    return reports


@dataclass(eq=False)
class _Listed:
    """One store's blocks to write back to its persistent tier, best first, as far as its room goes."""

    backends: Sequence[Backend]
    target: int
    report: FlushReport
    source: dict[bytes, int]  # key -> the tier that lists it
    keys: list[bytes]
    limit: int
    done: int = 0

    @property
    def persistent(self) -> Backend:
        return self.backends[self.target]

    async def write(self, chunk: list[bytes]) -> None:
        rows, ok = await off_loop(_copy_out, self.backends, chunk, [self.source[k] for k in chunk], self.target)
        self.report.failed += len(chunk) - len(ok)
        stored = await _write_rows(self.persistent, self.report, ok, rows)
        self.report.flushed += len(stored)
        self.report.flushed_bytes += len(stored) * self.persistent.format.block_bytes


async def _listed(backends: Sequence[Backend], skip: Collection[int]) -> _Listed | FlushReport:
    """What one store's flush without a manager would write, or its finished report (nothing to
    write: no persistent tier below a memory one, one in ``skip``, or one that cannot list)."""
    report = FlushReport()
    target = first_persistent(backends)
    if target is None:
        return report
    persistent = backends[target]
    report.target = persistent.name
    if target in skip:
        report.stopped_by = "skipped"
        return report
    try:
        held = {r.key: r.stored_bytes for r in await off_loop(lambda: list(persistent.scan()))}
    except Exception as exc:  # a tier that cannot list its records is not written blindly
        log.warning("kvtier flush: listing the records of %s failed: %s", report.target, exc)
        report.stopped_by = "scan"
        return report
    # stored_keys: oldest first (None: a tier that cannot list its blocks)
    listed = [reversed(backends[tier].stored_keys() or ()) for tier in range(target)]
    source = _candidates(listed, held.__contains__, report)
    keys = list(source)
    report.candidates = len(keys) + report.already_there
    room = max(0, (persistent.usable_bytes() - sum(held.values())) // max(1, persistent.reserve_bytes()))
    limit = len(keys)
    if room < limit:
        limit, report.stopped_by = room, "room"
    return _Listed(backends, target, report, source, keys, limit)


def first_persistent(backends: Sequence[Backend]) -> int | None:
    """The first persistent tier below a non-persistent one (what a flush writes to), or None."""
    target = next((i for i, b in enumerate(backends) if b.persistent), None)
    return None if target == 0 else target  # nothing above a persistent tier to flush


async def _write_within(
    keys: list[bytes],
    room: int | None,
    persistent: Backend,
    report: FlushReport,
    started: float,
    budget_s: float | None,
    budget_bytes: int | None,
    write: Callable[[list[bytes]], Awaitable[None]],
) -> None:
    """Write ``keys`` (best first) with ``write``, one chunk at a time, as far as the room and
    the budgets allow; fill in ``report`` and log the outcome."""
    report.candidates = len(keys) + report.already_there
    limit = len(keys)
    if room is not None and room < limit:
        limit, report.stopped_by = room, "room"
    block = persistent.format.block_bytes
    if budget_bytes is not None and budget_bytes // block < limit:
        limit, report.stopped_by = budget_bytes // block, "bytes"
    last_log = started
    done = 0
    while done < limit:
        if budget_s is not None and time.monotonic() - started > budget_s:
            report.stopped_by = "time"
            break
        chunk = keys[done : min(limit, done + CHUNK_BLOCKS)]
        done += len(chunk)
        await write(chunk)
        now = time.monotonic()
        if now - last_log > PROGRESS_EVERY_S:
            last_log = now
            log.info("kvtier flush: %d of %d blocks written to %s (%.0f s)", report.flushed, limit, report.target, now - started)
    _close_report(report, len(keys), started)


def _close_report(report: FlushReport, candidates: int, started: float) -> None:
    """Fill in what a flush of ``candidates`` blocks left, its time, and log the outcome."""
    report.left = candidates - report.flushed
    report.seconds = round(time.monotonic() - started, 3)
    if report.candidates:
        log.info(
            "kvtier flush: wrote %d blocks (%d bytes) from memory tiers to %s in %.2f s; %d already there, %d left%s, %d failed",
            report.flushed, report.flushed_bytes, report.target, report.seconds, report.already_there, report.left,
            f" (stopped by {report.stopped_by})" if report.stopped_by and report.left else "", report.failed,
        )


async def _write_rows(backend: Backend, report: FlushReport, keys: list[bytes], rows: list[torch.Tensor]) -> list[tuple[bytes, int]]:
    """Write ``rows`` under ``keys`` to ``backend`` off the event loop: the (key, stored bytes)
    written; a failed key or call is counted in ``report.failed`` and logged, never raised."""
    if not keys:
        return []
    try:
        sizes = await off_loop(backend.write_blocks, keys, rows)
    except Exception as exc:  # a failing disk leaves the blocks unflushed, never raises
        log.warning("kvtier flush: writing %d blocks to %s failed: %s", len(keys), report.target, exc)
        report.failed += len(keys)
        return []
    written = [(k, s) for k, s in zip(keys, sizes) if s is not None]
    report.failed += len(keys) - len(written)
    return written


def _candidates(listed: Sequence[Iterable[bytes]], held: Callable[[bytes], bool], report: FlushReport) -> dict[bytes, int]:
    """The keys of each tier above the target (``listed[tier]``, best first) that the target
    lacks (``held``), each with the first tier that lists it; those it has are counted."""
    seen: set[bytes] = set()
    keys: dict[bytes, int] = {}
    for tier, tier_keys in enumerate(listed):
        for key in tier_keys:
            if key in seen:
                continue
            seen.add(key)
            if held(key):
                report.already_there += 1
            else:
                keys[key] = tier
    return keys


def _room(manager: TierManager, target: int, backend: Backend) -> int | None:
    row = manager.stats()["tiers"][target]
    free = int(row["capacity_bytes"]) - int(row["used_bytes"])
    return max(0, free // max(1, backend.reserve_bytes()))


async def _flush_chunk(manager: TierManager, backends: Sequence[Backend], target: int, keys: list[bytes], report: FlushReport) -> None:
    # Pin: nothing evicts or reuses these blocks while they are copied. A key that went away
    # since the candidates were listed (evicted, or stored below meanwhile) is skipped.
    live = [k for k in keys if manager.status(k).state is KeyState.READY and not manager.holds(k, target)]
    if not live:
        return
    plan = manager.prepare_load(live, promote=False)
    try:
        rows, ok_keys = await off_loop(_copy_out, backends, plan.keys, plan.tiers, target)
        report.failed += len(plan.keys) - len(ok_keys)
        written = await _write_rows(backends[target], report, ok_keys, rows)
        if not written:
            return
        now = time.time()
        records = [(k, s, now) for k, s in written]
        excess = set(manager.adopt(target, records))
        # Adopt refuses a key the tier got meanwhile (its bytes are these) and keys beyond its
        # capacity: delete only the latter.
        drop = [k for k, _, _ in records if k in excess and not manager.holds(k, target)]
        if drop:
            await off_loop(backends[target].delete_blocks, drop)
        stored = len(records) - len(drop)
        report.flushed += stored
        report.flushed_bytes += stored * backends[target].format.block_bytes
    finally:
        manager.complete_load(plan.keys)


def _copy_out(backends: Sequence[Backend], keys: Sequence[bytes], tiers: Sequence[int], target: int) -> tuple[list[torch.Tensor], list[bytes]]:
    """Host copies of ``keys`` from the tiers that serve them; keys that cannot be read are left out."""
    rows: list[torch.Tensor] = []
    ok: list[bytes] = []
    by_tier: dict[int, list[int]] = {}
    for i, tier in enumerate(tiers):
        if tier != target:
            by_tier.setdefault(tier, []).append(i)
    for tier, positions in by_tier.items():
        backend = backends[tier]
        tier_keys = [keys[i] for i in positions]
        try:
            if isinstance(backend, MemoryBackend):
                slots = torch.tensor(backend.slots(tier_keys), dtype=torch.long, device=tensor_device(backend.pool))
                got = backend.pool.index_select(0, slots).cpu()
                rows.extend(got.unbind(0))
                ok.extend(tier_keys)
            else:
                out = torch.empty(len(tier_keys), backend.format.block_bytes, dtype=torch.uint8)
                found = backend.read_blocks(tier_keys, rows_for(backend, out, len(tier_keys)))
                for key, hit, row in zip(tier_keys, found, out.unbind(0)):
                    if hit:
                        rows.append(row)
                        ok.append(key)
        except Exception as exc:
            log.warning("kvtier flush: reading %d blocks from %s failed: %s", len(tier_keys), backend.name, exc)
    return rows, ok
