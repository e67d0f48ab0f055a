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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat, RecordInfo
from kvtier.errors import ConfigError, LayoutError
from kvtier.keys import Namespace, check_keys
from kvtier.records.counts import counts_add
from kvtier.records.head_groups import HeadAxis, HeadGroupLayout, HeadGroups, block_key_of

__all__ = ["MAX_SCRATCH_BYTES", "GroupIndex", "HeadGroupTier", "group_tiers"]

log = logging.getLogger("kvtier")
_MAX_PENDING = 1 << 20
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
        #: the blocks the last ``scan`` listed -> their records (the index view starts from it)
        self._listed: dict[bytes, list[bytes]] = {}
        self._local = threading.local()
        #: the block-key view of a shared tier's index (set by ``bind_index``)
        self.index: GroupIndex | None = None

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
        need = self._per_block() * self.layout.group_bytes
        if self.capacity_bytes < need:
            raise ConfigError(f"capacity: {self.capacity_bytes} bytes is below one block's head-group records ({need} bytes)")
        await super().open(fmt)
        want = self.record_format(fmt)
        if self.inner.is_open:  # one in-process tier under the views of several ranks
            if self.inner.format != want:
                raise LayoutError(f"{self.inner.name}: open for records of another format than this rank's head groups")
            return
        await self.inner.open(want)
        self._owns_inner = True
        if self.usable_bytes() < self.reserve_bytes():
            await self.inner.aclose()
            raise ConfigError(
                f"capacity: {self.capacity_bytes} bytes hold no block's {self._per_block()} head-group records "
                f"({self.reserve_bytes()} bytes in the {self.inner.name} tier)"
            )

    async def aclose(self) -> None:
        try:
            if self._owns_inner:
                await self.inner.aclose()
        finally:
            await super().aclose()

    def to_dict(self) -> dict[str, Any]:
        """The inner tier's options and, under ``head_groups``, the layout and namespace."""
        axis = self.layout.axis
        ns = self.record_namespace.to_dict()
        return {
            **self.inner.to_dict(),
            "head_groups": {
                "groups": self.layout.groups.to_dict(),
                "axis": {"heads": axis.heads, "segments": [list(seg) for seg in axis.segments], "tag": axis.tag},
                "namespace": {k: v for k, v in ns.items() if k != "tenant_salt" or v},
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadGroupTier:
        options = dict(data)
        spec = options.pop("head_groups", None)
        if not isinstance(spec, dict):
            raise ConfigError("head_groups: a head-group tier's options need its layout (head_groups: {groups, axis, namespace})")
        if spec["namespace"].get("tenant_salt"):
            raise ConfigError("head_groups.namespace.tenant_salt: not kept by to_dict(); build the tier with its namespace")
        inner = registry.backends.get(options["backend"]).from_dict(options)
        axis = spec["axis"]
        layout = HeadGroupLayout(
            HeadGroups.from_dict(dict(spec["groups"])),
            HeadAxis(heads=axis["heads"], segments=tuple((int(o), int(i)) for o, i in axis["segments"]), tag=axis["tag"]),
        )
        return cls(inner, layout, Namespace.from_dict({k: v for k, v in spec["namespace"].items() if k != "tenant_salt"}))

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
    def _check_io(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor], what: str) -> None:
        size = self._check_open().block_bytes
        check_keys(keys)
        if len(tensors) != len(keys):
            raise LayoutError(f"{self.name}: {len(keys)} keys but {len(tensors)} {what}")
        for i, t in enumerate(tensors):
            if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != size:
                raise LayoutError(
                    f"{self.name}: {what}[{i}] must be a 1-D uint8 tensor of {size} bytes, got {tuple(t.shape)} {t.dtype}"
                )

    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        self._check_io(keys, blocks, "blocks")
        written = self._written
        if not keys:
            return []
        if not written:  # another rank writes this replicated group
            return [self.reserve_bytes()] * len(keys)
        if self.layout.whole:
            records = list(blocks)
        else:
            buf, records = self._scratch(len(keys) * len(written), blocks[0].device)
            self.layout.split_into(blocks, written, buf.view(len(keys), len(written), self.layout.group_bytes))
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
        self._check_io(keys, out, "out")
        if not keys:
            return []
        held = self._held
        rkeys = self.layout.record_keys(keys, held)
        if self.layout.whole:
            found = self.inner.read_blocks(rkeys, out)
        else:
            buf, rows = self._scratch(len(rkeys), out[0].device)
            buffers = buf.view(len(keys), len(held), self.layout.group_bytes)
            got = self.inner.read_blocks(rkeys, rows)
            k = len(held)
            found = [all(got[i * k : (i + 1) * k]) for i in range(len(keys))]
            if all(found):
                self.layout.join(buffers, out)
            else:  # a missing block's row is left as it was
                for i in (i for i, ok in enumerate(found) if ok):
                    self.layout.join(buffers[i : i + 1], out[i : i + 1])
        self._count(found=found)
        follower = getattr(self.inner, "follower", None)
        if follower is not None and any(found):  # shared hits are counted by block, as adopted
            follower.count_served([key for key, ok in zip(keys, found) if ok])
        return found

    def _scratch(self, records: int, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This thread's buffer for ``records`` group records, and its rows (both kept between
        jobs up to :data:`MAX_SCRATCH_BYTES`: a fresh buffer costs a page fault per 4 KiB, which
        at jobs of 32 MiB made the split several times slower than the copy itself, and making
        a tensor per row costs 1.5-2.5 µs per record, as much as the rest of this layer)."""
        width = self.layout.group_bytes
        size = records * width
        local = self._local
        buf: torch.Tensor | None = getattr(local, "buf", None)
        if buf is not None and buf.numel() >= size and buf.device == device:
            return buf[:size], local.rows[:records]
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        rows = list(buf.view(records, width))
        if size <= MAX_SCRATCH_BYTES:
            local.buf, local.rows = buf, rows
        return buf, rows

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        check_keys(keys)  # a longer key would name the records of the key it starts with
        if keys and self._written:
            self.inner.delete_blocks(self.layout.record_keys(keys, self._written))
            counts_add(self.counters, "deleted", len(keys))

    def scan(self) -> Iterator[RecordInfo]:
        listed = {r.key: r for r in self.inner.scan()}
        self._listed = self.layout.blocks_present(listed)
        held = self.layout.held_slice
        blocks = []
        for block, recs in self._listed.items():
            infos = [listed[r] for r in recs[held]]
            blocks.append(RecordInfo(block, sum(r.stored_bytes for r in infos), max(r.stamp for r in infos)))
        return iter(blocks)

    def bind_index(self, manager: Any, tier: int) -> None:
        """A shared tier's index view (``inner.bind_index``) follows the server's record keys;
        :class:`GroupIndex` turns them into the manager's block keys."""
        bind = getattr(self.inner, "bind_index", None)
        if bind is not None:
            self.index = GroupIndex(manager, self.layout, listed=self._listed)
            self._listed = {}
            bind(self.index, tier)

    @property
    def follower(self) -> Any:
        """The inner shared tier's follower (its changes name blocks: :class:`GroupIndex`
        returns block keys), or ``None``."""
        return getattr(self.inner, "follower", None)

    def forget_blocks(self, keys: Sequence[bytes]) -> None:
        """An eviction in a shared tier: the inner tier forgets this rank's records."""
        forget = getattr(self.inner, "forget_blocks", None)
        if forget is not None and keys and self._written:
            forget(self.layout.record_keys(keys, self._written))

    def stored_keys(self) -> list[bytes] | None:
        keys = self.inner.stored_keys()
        if keys is None:
            return None
        order = {k: i for i, k in enumerate(keys)}
        blocks = self.layout.blocks_present(order)
        held = self.layout.held_slice
        return sorted(blocks, key=lambda b: max(order[r] for r in blocks[b][held]))

    def touch_stamps(self, stamps: Sequence[tuple[bytes, float]]) -> None:
        held = self._held
        self.inner.touch_stamps(
            [(rk, stamp) for key, stamp in stamps for rk in self.layout.record_keys([key], held)]
        )

    def write_tags(
        self, tenants: Sequence[tuple[bytes, str]], pins: Sequence[tuple[bytes, bool]], *, whole: bool = False, sync: bool = True
    ) -> None:
        # Every group's record carries its block's tag (whatever groups this rank writes), so
        # offline tools see each record's tenant and any rank reads its blocks' tags back.
        every = range(self.layout.groups.num_groups)
        keys = self.layout.record_keys
        self.inner.write_tags(
            [(rk, tenant) for key, tenant in tenants for rk in keys([key], every)],
            [(rk, on) for key, on in pins for rk in keys([key], every)],
            whole=whole,
            sync=sync,
        )

    def read_tags(self) -> tuple[dict[bytes, str], list[bytes]] | None:
        tags = self.inner.read_tags()
        if tags is None:
            return None
        owners, pins = tags
        # A block's group-0 record is tagged too: each tag names its block as if it were that
        # record (the other records give keys no block has, which the store drops).
        return {block_key_of(rk, 0): tenant for rk, tenant in owners.items()}, list(dict.fromkeys(block_key_of(rk, 0) for rk in pins))

    def _count(self, *, written: list[int | None] | None = None, found: list[bool] | None = None) -> None:
        c, size = self.counters, self.format.block_bytes
        if written is not None:
            ok = sum(s is not None for s in written)
            counts_add(c, "blocks_written", ok, "bytes_written", ok * size, "write_failures", len(written) - ok)
        if found is not None:
            hits = sum(found)
            counts_add(c, "blocks_read", hits, "bytes_read", hits * size, "read_misses", len(found) - hits)

    def stats(self) -> dict[str, Any]:
        """The inner tier's stats with this rank's block counters; the inner tier's record
        counters under ``head_groups.records``."""
        inner = self.inner.stats()
        data = {**inner, **self.counters.as_dict()}
        groups = self.layout.groups
        data["head_groups"] = {
            "records": {k: inner[k] for k in self.counters.as_dict() if k in inner},
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


class GroupIndex:
    """The manager's index of block keys, as a shared tier's index view (which lists, adopts
    and forgets *record* keys) sees it: the view's ``IndexTarget``.

    A record the view offers is held once its block is; a block is adopted once every one of
    its groups is on the server (the view offers the records of an incomplete block again at
    every sweep, so a block completes as its last group lands); a vanished record removes its
    block. Thread-safe: the view calls it from its thread, under its own lock here."""

    def __init__(self, manager: Any, layout: HeadGroupLayout, *, listed: Mapping[bytes, Sequence[bytes]] | None = None) -> None:
        """``listed``: the blocks the store adopted at open, with their records of every group
        (what :meth:`HeadGroupLayout.blocks_present` found in the tier's listing)."""
        self._manager = manager
        self._layout = layout
        self._lock = threading.Lock()
        #: record key -> its block, for the records of blocks the manager holds from this index
        self._block_of: dict[bytes, bytes] = {rk: block for block, recs in (listed or {}).items() for rk in recs}
        #: records offered whose block is not complete yet (a view offers records in chunks)
        self._pending: dict[bytes, tuple[int, float]] = {}
        self._every = range(layout.groups.num_groups)

    def holds(self, key: bytes, tier: int) -> bool:
        with self._lock:
            block = self._block_of.get(key)
        return block is not None and self._manager.holds(block, tier)

    def _complete(self, tier: int, records: Iterable[tuple[bytes, int, float]]) -> tuple[dict[bytes, list[bytes]], list[tuple[bytes, int, float]]]:
        """Take ``records`` into the pending pool; the blocks now complete (block -> its held
        records) and, of them, the ones the manager does not hold, as block records. The blocks
        :meth:`HeadGroupLayout.blocks_present` finds share no record, so each takes its own
        records out of the pool."""
        held = self._layout.held_slice
        new: list[tuple[bytes, int, float]] = []
        with self._lock:
            pending = self._pending
            if len(pending) > _MAX_PENDING:  # records of blocks that never complete: offered again
                pending.clear()
            pending.update((k, (size, stamp)) for k, size, stamp in records)
            blocks = self._layout.blocks_present(pending)
            for block, recs in blocks.items():
                parts = [pending.pop(rk) for rk in recs][held]
                self._block_of.update(dict.fromkeys(recs, block))
                if not self._manager.holds(block, tier):
                    new.append((block, sum(p[0] for p in parts), max(p[1] for p in parts)))
        return {block: recs[held] for block, recs in blocks.items()}, new

    def adopt(self, tier: int, records: Iterable[tuple[bytes, int, float]]) -> list[bytes]:
        """The manager's ``adopt`` for complete blocks; the records of blocks it had no room for."""
        blocks, new = self._complete(tier, records)
        excess = self._manager.adopt(tier, new) if new else []
        return [rk for block in excess for rk in blocks[block]]

    def adopt_live(self, tier: int, records: Iterable[tuple[bytes, int, float]]) -> list[bytes]:
        """The manager's ``adopt_live`` for complete blocks; the *block* keys adopted (what a
        follower tells its listeners: KV events name blocks, not records)."""
        _, new = self._complete(tier, records)
        if not new:
            return []
        live = getattr(self._manager, "adopt_live", None)
        if live is not None:
            return list(live(tier, new))
        excess = set(self._manager.adopt(tier, new))
        return [b for b, _, _ in new if b not in excess]

    def ready_keys(self, tier: int) -> list[bytes]:
        """The record keys of the blocks held from this index (what the view checks against
        the server: a vanished one removes its block)."""
        with self._lock:
            return list(self._block_of)

    def remove(self, keys: list[bytes], tier: int) -> list[bytes]:
        """Forget the blocks of vanished records; the *block* keys forgotten."""
        with self._lock:
            blocks = {self._block_of[k]: None for k in keys if k in self._block_of}
        removed = set(self._manager.remove(list(blocks), tier)) if blocks else set()
        with self._lock:
            for rk in self._layout.record_keys(list(removed), self._every):
                self._block_of.pop(rk, None)
        return list(removed)
