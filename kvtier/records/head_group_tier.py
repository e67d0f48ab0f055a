"""A byte tier that stores one record per (block, head group): :class:`HeadGroupTier`.

It wraps any byte backend (``lmdb``, ``file``, ``redis``, ``compressed``, plugins) and shows the
manager and the transfer engine the rank's whole blocks, under block keys, as before. Below it
the inner backend holds head-group records (:mod:`kvtier.records.head_groups`) of the format
:meth:`HeadGroupLayout.namespace` names, so ranks of any TP size read and write each other's.

* ``write_blocks``: the job's blocks are split into the groups this rank writes (one copy per
  segment and job; none when one group is the whole block) and handed to the inner backend in
  **one** call: one transaction, one ``pwritev`` batch, one pipeline per node. A block whose
  group failed is a failure, and its other groups are deleted again, so no partial block stays.
* ``read_blocks``: the groups this rank holds, for every block of the job, in **one** inner
  call, then joined into the blocks (one copy per segment and job). A block is found only when
  every group it needs was: a writer killed between groups leaves a miss, never a partial load.
* ``scan`` / ``stored_keys``: the blocks every held group of which is stored.
* ``delete_blocks``: the groups this rank writes (a rank that only reads a replicated group
  leaves it to its writer).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from kvtier.backend import Backend, BlockFormat, RecordInfo
from kvtier.errors import LayoutError
from kvtier.keys import Namespace
from kvtier.records.group_follow import GroupFollower, GroupIndexTarget
from kvtier.records.head_groups import HeadGroupLayout

__all__ = ["MAX_SCRATCH_BYTES", "HeadGroupTier", "group_tiers"]

log = logging.getLogger("kvtier")
#: The largest group-record buffer a thread keeps between jobs.
MAX_SCRATCH_BYTES = 256 << 20


class HeadGroupTier(Backend):
    """``inner``'s records, one per (block, head group), shown as whole blocks of this rank."""

    name: ClassVar[str] = "head-groups"

    def __init__(self, inner: Backend, layout: HeadGroupLayout, namespace: Namespace) -> None:
        if inner.is_memory:
            raise LayoutError(f"{inner.name}: a memory tier holds the rank's blocks whole; head groups are for byte tiers")
        super().__init__(capacity=inner.capacity_bytes)
        self.inner = inner
        self.layout = layout
        #: the records' namespace (no TP rank or size)
        self.record_namespace = layout.namespace(namespace)
        self._held = layout.groups.held
        self._written = layout.groups.written
        # The tier answers to its backend's name and traits (logs, stats, the store's checks).
        self.name = inner.name  # type: ignore[misc]
        self.persistent = inner.persistent  # type: ignore[misc]
        self.shared = bool(getattr(inner, "shared", False))
        self.variable_size = True
        self._owns_inner = False
        self._local = threading.local()
        #: the block-key view of a shared tier's index (set by ``bind_index``)
        self.index: GroupIndexTarget | None = None
        self._follower: GroupFollower | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def record_format(self, fmt: BlockFormat) -> BlockFormat:
        ns = self.record_namespace
        return BlockFormat(block_bytes=self.layout.group_bytes, dtype=fmt.dtype, namespace_digest=ns.digest, namespace=ns.to_dict())

    async def open(self, fmt: BlockFormat) -> None:
        if fmt.block_bytes != self.layout.axis.block_bytes:
            raise LayoutError(
                f"head_groups: the head axis describes blocks of {self.layout.axis.block_bytes} bytes, but the "
                f"store's blocks are {fmt.block_bytes} bytes"
            )
        await super().open(fmt)
        want = self.record_format(fmt)
        if self.inner.is_open:  # one in-process tier under the views of several ranks
            if self.inner.format != want:
                raise LayoutError(f"{self.inner.name}: open for records of another format than this rank's head groups")
            return
        await self.inner.open(want)
        self._owns_inner = True

    async def aclose(self) -> None:
        try:
            if self._owns_inner:
                await self.inner.aclose()
        finally:
            await super().aclose()

    def to_dict(self) -> dict[str, Any]:
        return self.inner.to_dict()

    # -- capacity --------------------------------------------------------------------------------
    def _per_block(self) -> int:
        """Records a block of this rank takes in the tier (a replica that writes nothing counts
        the records it reads, so the manager's room stays that of the writers)."""
        return len(self._written) or len(self._held)

    def reserve_bytes(self) -> int:
        return self.inner.reserve_bytes() * self._per_block()

    def usable_bytes(self) -> int:
        return self.inner.usable_bytes()

    # -- bulk I/O --------------------------------------------------------------------------------
    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        self._check_open()
        if len(keys) != len(blocks):
            raise LayoutError(f"{self.name}: {len(keys)} keys but {len(blocks)} blocks")
        written = self._written
        if not keys:
            return []
        if not written:  # another rank writes this replicated group
            return [self.reserve_bytes()] * len(keys)
        records = self.layout.split(blocks, written, self._scratch(len(keys) * len(written), blocks[0].device))
        rkeys = self.layout.record_keys(keys, written)
        sizes = self.inner.write_blocks(rkeys, records)
        k = len(written)
        out: list[int | None] = []
        orphans: list[bytes] = []
        for i in range(len(keys)):
            part = sizes[i * k : (i + 1) * k]
            if None in part:
                out.append(None)
                orphans.extend(rk for rk, s in zip(rkeys[i * k : (i + 1) * k], part) if s is not None)
            else:
                out.append(sum(s for s in part if s is not None))
        if orphans:
            self._drop(orphans)
        self._count(written=out)
        return out

    def _drop(self, record_keys: list[bytes]) -> None:
        """Delete the groups of a block that did not store whole; a failure leaves a miss only."""
        try:
            self.inner.delete_blocks(record_keys)
        except Exception as exc:  # the block already failed; an orphan group is never read alone
            log.debug("%s: deleting %d groups of failed blocks: %s", self.name, len(record_keys), exc)

    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        self._check_open()
        if len(keys) != len(out):
            raise LayoutError(f"{self.name}: {len(keys)} keys but {len(out)} blocks")
        if not keys:
            return []
        held = self._held
        rkeys = self.layout.record_keys(keys, held)
        if self.layout.whole:
            found = self.inner.read_blocks(rkeys, out)
        else:
            shape = (len(keys), len(held), self.layout.group_bytes)
            buffers = self._scratch(len(keys) * len(held), out[0].device).view(shape)
            got = self.inner.read_blocks(rkeys, list(buffers.view(len(rkeys), self.layout.group_bytes)))
            k = len(held)
            found = [all(got[i * k : (i + 1) * k]) for i in range(len(keys))]
            if any(found):
                self.layout.join(buffers, out)
        self._count(found=found)
        return found

    def _scratch(self, records: int, device: torch.device) -> torch.Tensor:
        """This thread's buffer for ``records`` group records (kept between jobs up to
        :data:`MAX_SCRATCH_BYTES`: a fresh buffer costs a page fault per 4 KiB, which at jobs of
        32 MiB made the split several times slower than the copy itself)."""
        size = records * self.layout.group_bytes
        buf: torch.Tensor | None = getattr(self._local, "buf", None)
        if buf is not None and buf.numel() >= size and buf.device == device:
            return buf[:size]
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        if size <= MAX_SCRATCH_BYTES:
            self._local.buf = buf
        return buf

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        if keys and self._written:
            self.inner.delete_blocks(self.layout.record_keys(keys, self._written))
            self.counters.deleted += len(keys)

    def _blocks(self, records: list[RecordInfo]) -> Iterator[RecordInfo]:
        by_key = {r.key: r for r in records}
        for block, recs in self.layout.blocks_present(by_key).items():
            infos = [by_key[r] for r in recs]
            yield RecordInfo(block, sum(r.stored_bytes for r in infos), max(r.stamp for r in infos))

    def scan(self) -> Iterator[RecordInfo]:
        return self._blocks(list(self.inner.scan()))

    def forget_blocks(self, keys: Sequence[bytes]) -> None:
        """An eviction in a shared tier: the inner tier forgets this rank's records."""
        forget = getattr(self.inner, "forget_blocks", None)
        if forget is not None and keys and self._written:
            forget(self.layout.record_keys(keys, self._written))

    # -- live following (kvtier.records.group_follow) ------------------------------------------
    def bind_index(self, manager: Any, tier: int) -> None:
        """A shared tier's follower (``inner.bind_index``) sees the server's record keys;
        :class:`~kvtier.records.group_follow.GroupIndexTarget` turns them into the manager's
        block keys (a block is adopted once every group of it is in)."""
        bind = getattr(self.inner, "bind_index", None)
        if bind is None:
            return
        self.index = GroupIndexTarget(manager, self.layout, self.reserve_bytes())
        inner_follower = getattr(self.inner, "follower", None)
        if inner_follower is not None:
            self._follower = GroupFollower(inner_follower, self.index)
        bind(self.index, tier)

    @property
    def follower(self) -> GroupFollower | None:
        """The inner shared tier's follower, telling its changes in block keys."""
        return self._follower

    def stored_keys(self) -> list[bytes] | None:
        keys = self.inner.stored_keys()
        if keys is None:
            return None
        order = {k: i for i, k in enumerate(keys)}
        blocks = self.layout.blocks_present(keys)
        return sorted(blocks, key=lambda b: max(order[r] for r in blocks[b]))

    def touch_stamps(self, stamps: Sequence[tuple[bytes, float]]) -> None:
        held = self._held
        self.inner.touch_stamps(
            [(rk, stamp) for key, stamp in stamps for rk in self.layout.record_keys([key], held)]
        )

    def _count(self, *, written: list[int | None] | None = None, found: list[bool] | None = None) -> None:
        c, size = self.counters, self.format.block_bytes
        if written is not None:
            ok = sum(s is not None for s in written)
            c.blocks_written += ok
            c.bytes_written += ok * size
            c.write_failures += len(written) - ok
        if found is not None:
            hits = sum(found)
            c.blocks_read += hits
            c.bytes_read += hits * size
            c.read_misses += len(found) - hits

    def stats(self) -> dict[str, Any]:
        data = self.inner.stats()
        groups = self.layout.groups
        data["head_groups"] = {
            **self.counters.as_dict(),
            "group_size": groups.group_size,
            "kv_heads": groups.kv_heads,
            "held": list(self._held),
            "written": list(self._written),
            "record_bytes": self.layout.group_bytes,
        }
        return data


def group_tiers(backends: Sequence[Backend], layout: HeadGroupLayout, namespace: Namespace) -> list[Backend]:
    """``backends`` with every byte tier wrapped in a :class:`HeadGroupTier` (memory tiers hold
    the rank's blocks whole). A tier with a ``path`` keeps its records in
    ``<path>/<layout.location>``, so records of the per-rank layout, another model or another
    group layout at that path are never met: a miss, never an error. (Remote tiers keep
    namespaces apart by the records' namespace digest already.)"""
    location = layout.location(namespace)
    out: list[Backend] = []
    for backend in backends:
        if backend.is_memory:
            out.append(backend)
            continue
        path = getattr(backend, "path", None)
        if isinstance(path, str) and path:  # constructors do no I/O: the path is not used yet
            setattr(backend, "path", os.path.join(path, location))  # noqa: B010
        out.append(HeadGroupTier(backend, layout, namespace))
    return out

