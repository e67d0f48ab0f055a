"""Records that do not depend on the writer's tensor-parallel size: head groups.

Under tensor parallelism each rank holds some of the model's KV heads, so a rank's share of a
block depends on the TP size that wrote it. A *head group* is a fixed run of ``group_size``
KV heads; a head-group record holds one block of one group, for every layer. Any rank of any
TP size holds whole groups, reads exactly the groups it holds and writes the ones it computed,
so engines of different TP sizes share one tier.

* :class:`HeadGroups` answers, from (model KV heads, TP size, rank, group size), which groups a
  rank holds (reads) and which it writes. When TP exceeds the KV heads, vLLM replicates each
  head on ``tp_size / kv_heads`` ranks: every holder reads the group, and only the first of them
  writes it. MLA (one latent vector per token, the same on every rank): one group, one record
  for every rank, written by rank 0.
* :class:`HeadAxis` says where the heads are in a rank's block: runs of bytes (*segments*), each
  ``[outer, heads, inner]`` (for a ``(num_blocks, block_size, heads, head_size)`` cache: outer
  the tokens, inner the bytes of one head's vector).
* :class:`HeadGroupLayout` puts them together: the group record's bytes, the key of each
  (block, group) record, the namespace of the records (model, revision, dtype, block size,
  head size, the group layout; never the TP rank or size), and the split of a job's blocks into
  its group records and the join back, one batched copy per segment and job.

For an engine integration (vLLM, for instance, whose per-layer pages are ``[block_size, heads,
head_size]`` for K and again for V, concatenated into a rank's block)::

    axis = HeadAxis(heads=local_heads, segments=((2 * layers * block_size, head_size * itemsize),),
                    tag="vllm:NHD;group0")        # the engine's layout and the KV-cache group
    layout = store_config.head_groups.for_engine(axis, kv_heads=model_kv_heads, tp_size=tp, rank=rank)
    store = KVStore(store_config, kv_caches=pages, namespace=namespace, head_groups=layout)

(an ``HND`` page, ``[heads, block_size, head_size]``, is ``((2 * layers, block_size * head_size *
itemsize),)``); the store's ``namespace`` then has no TP rank or size, and keys built from it are
the same at every TP size.

A group record's key is the block key with a fixed pseudo-random 64-bit offset per group added
to its last eight bytes (modulo 2**64): keys stay 32 bytes, a reader finds every group of a block
without an index, and a listing of records maps back to block keys (a block is present only when
all its groups are). Addition, not XOR: with XOR masks a block's two group records were also the
two records of the key ``k ^ m0 ^ m1``, so a listing saw a phantom block for every real one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.devices import one_intra_op_thread
from kvtier.errors import ConfigError, LayoutError
from kvtier.keys import KEY_BYTES, Namespace

__all__ = [
    "MIN_GROUP_RECORD_BYTES",
    "HeadAxis",
    "HeadGroupLayout",
    "HeadGroups",
    "block_key_of",
    "default_group_size",
    "group_key",
    "rows_view",
]

#: A group record this size or larger costs about what a whole-block record does per byte
#: (see ``benchmarks/bench_head_groups.py``); below it per-record costs start to show.
MIN_GROUP_RECORD_BYTES = 64 << 10
_TAIL = KEY_BYTES - 8
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _positive(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"head_groups.{name}: expected a positive integer, got {value!r}")
    return value


@functools.lru_cache(maxsize=4096)
def _offset(group: int) -> int:
    """A fixed pseudo-random 64-bit offset per group. Offsets are added, so the records of one
    block are never all the records of another key: that would need ``o_j - o_0 + o_g`` to be an
    offset for every group ``g``, which random offsets never give (XOR masks did, for two groups)."""
    return int.from_bytes(hashlib.blake2b(b"kvtier-head-group" + group.to_bytes(4, "little"), digest_size=8).digest(), "little")


_MOD = 1 << 64


def group_key(key: bytes, group: int) -> bytes:
    """The key of ``key``'s record for head group ``group``."""
    tail = (int.from_bytes(key[_TAIL:], "little") + _offset(group)) % _MOD
    return key[:_TAIL] + tail.to_bytes(8, "little")


def block_key_of(record_key: bytes, group: int) -> bytes:
    """The block key whose group ``group`` record is ``record_key``."""
    tail = (int.from_bytes(record_key[_TAIL:], "little") - _offset(group)) % _MOD
    return record_key[:_TAIL] + tail.to_bytes(8, "little")


def default_group_size(
    kv_heads: int, *, max_tp_size: int | None = None, head_record_bytes: int | None = None,
    min_record_bytes: int = MIN_GROUP_RECORD_BYTES,
) -> int:
    """A fleet-wide group size. Every TP size up to ``max_tp_size`` must hold whole groups, so a
    group has at most ``kv_heads / max_tp_size`` heads (1 when ``max_tp_size`` is not given: any
    TP size). Within that bound: the fewest heads whose record reaches ``min_record_bytes`` when
    ``head_record_bytes`` (one head of one block, every layer) is known, else the bound itself
    (fewer, larger records)."""
    _positive(kv_heads, "kv_heads")
    most = kv_heads if max_tp_size is None else _positive(max_tp_size, "max_tp_size")
    base = max(1, kv_heads // most) if most <= kv_heads else 1
    while kv_heads % base:
        base -= 1
    if head_record_bytes is None:
        return base
    for size in range(1, base + 1):
        if base % size == 0 and size * head_record_bytes >= min_record_bytes:
            return size
    return base


@dataclass(frozen=True, slots=True)
class HeadGroups:
    """Which head groups one rank holds and writes. Build it with :meth:`for_rank`."""

    kv_heads: int
    tp_size: int = 1
    rank: int = 0
    group_size: int = 1
    mla: bool = False

    def __post_init__(self) -> None:
        _positive(self.kv_heads, "kv_heads")
        _positive(self.tp_size, "tp_size")
        _positive(self.group_size, "group_size")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.tp_size:
            raise ConfigError(f"head_groups.rank: expected 0 <= rank < tp_size {self.tp_size}, got {self.rank!r}")
        if self.mla:
            if self.kv_heads != 1 or self.group_size != 1:
                raise ConfigError("head_groups.kv_heads: an MLA cache has one latent head (kv_heads 1, group_size 1)")
            return
        if self.kv_heads % self.group_size:
            raise ConfigError(
                f"head_groups.group_size: {self.group_size} does not divide the model's {self.kv_heads} KV heads"
            )
        if self.tp_size <= self.kv_heads:
            if self.kv_heads % self.tp_size:
                raise ConfigError(f"head_groups.tp_size: {self.tp_size} does not divide the model's {self.kv_heads} KV heads")
            local = self.kv_heads // self.tp_size
            if local % self.group_size:
                raise ConfigError(
                    f"head_groups.group_size: {self.group_size} heads per group do not fit the {local} KV heads a rank "
                    f"holds at TP {self.tp_size}; choose a group size that divides kv_heads / the largest TP size "
                    f"of the fleet (here at most {math.gcd(local, self.group_size)})"
                )
        else:
            if self.tp_size % self.kv_heads:
                raise ConfigError(f"head_groups.tp_size: {self.tp_size} is not a multiple of the model's {self.kv_heads} KV heads")
            if self.group_size != 1:
                raise ConfigError(
                    f"head_groups.group_size: at TP {self.tp_size} each rank holds one of the {self.kv_heads} KV heads, "
                    f"so a group of {self.group_size} spans ranks; use group_size 1"
                )

    @classmethod
    def for_rank(
        cls, kv_heads: int, tp_size: int, rank: int, group_size: int | None = None, *, mla: bool = False
    ) -> HeadGroups:
        """The groups rank ``rank`` of a ``tp_size`` engine holds for a model of ``kv_heads`` KV
        heads (``group_size`` None: :func:`default_group_size` for this TP size)."""
        if mla:
            return cls(kv_heads=1, tp_size=tp_size, rank=rank, group_size=1, mla=True)
        if group_size is None:  # fleet-wide, so never this engine's TP size: one head per group
            group_size = default_group_size(kv_heads)
        return cls(kv_heads=kv_heads, tp_size=tp_size, rank=rank, group_size=group_size)

    @property
    def num_groups(self) -> int:
        return self.kv_heads // self.group_size

    @property
    def replicas(self) -> int:
        """Ranks that hold each head (1 unless TP exceeds the KV heads; every rank for MLA)."""
        if self.mla:
            return self.tp_size
        return max(1, self.tp_size // self.kv_heads)

    @property
    def local_heads(self) -> range:
        """The model's KV heads (global numbers) this rank holds, in the order of its cache."""
        if self.mla:
            return range(1)
        if self.tp_size <= self.kv_heads:
            per = self.kv_heads // self.tp_size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank // self.replicas
        return range(head, head + 1)

    @property
    def held(self) -> tuple[int, ...]:
        """The groups this rank holds: the records it reads."""
        heads = self.local_heads
        return tuple(range(heads.start // self.group_size, heads.stop // self.group_size))

    @property
    def written(self) -> tuple[int, ...]:
        """The groups this rank writes: those it holds, unless a lower rank holds them too."""
        return self.held if self.rank % self.replicas == 0 else ()

    def layout_tag(self) -> str:
        """The group layout, as the records' namespace records it (no TP rank or size)."""
        return "mla" if self.mla else f"heads{self.group_size}of{self.kv_heads}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadGroups:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"head_groups: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class HeadAxis:
    """Where the KV heads are in a rank's block: ``segments`` in byte order, each
    ``(outer, inner)``: ``outer * heads * inner`` bytes laid out ``[outer, heads, inner]``.

    ``tag`` names what else decides the bytes of a group (the engine's cache layout, the KV-cache
    group) and goes into the records' namespace; two caches whose group records could differ
    must not share a tag and segments."""

    heads: int
    segments: tuple[tuple[int, int], ...]
    tag: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.heads, int) or self.heads < 1:
            raise LayoutError(f"head axis: expected a positive number of heads, got {self.heads!r}")
        if not self.segments:
            raise LayoutError("head axis: expected at least one segment")
        merged: list[tuple[int, int]] = []
        for i, seg in enumerate(self.segments):
            outer, inner = seg
            if outer < 1 or inner < 1:
                raise LayoutError(f"head axis: segments[{i}]: expected positive (outer, inner), got {seg!r}")
            if merged and merged[-1][1] == inner:  # [a, H, i] then [b, H, i] is [a + b, H, i]
                merged[-1] = (merged[-1][0] + outer, inner)
            else:
                merged.append((int(outer), int(inner)))
        object.__setattr__(self, "segments", tuple(merged))

    @classmethod
    def from_caches(
        cls, kv_caches: Sequence[torch.Tensor] | torch.Tensor, *, head_dim: int,
        engine_blocks_per_block: int = 1, tag: str = "",
    ) -> HeadAxis:
        """The axis of a cache whose tensors are ``(num_blocks, ..., heads, ...)`` with the
        heads in dimension ``head_dim`` of every tensor (the record is, tensor by tensor, the
        ``engine_blocks_per_block`` slices of each)."""
        caches = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
        heads: int | None = None
        segments = []
        for i, t in enumerate(caches):
            if not 1 <= head_dim < t.dim():
                raise LayoutError(f"kv_caches[{i}]: head_dim {head_dim} is not a dimension after the block dimension of shape {tuple(t.shape)}")
            if heads is None:
                heads = int(t.shape[head_dim])
            elif t.shape[head_dim] != heads:
                raise LayoutError(f"kv_caches[{i}]: {t.shape[head_dim]} heads in dimension {head_dim}, but kv_caches[0] has {heads}")
            outer = math.prod(t.shape[1:head_dim]) * engine_blocks_per_block
            inner = math.prod(t.shape[head_dim + 1 :]) * t.element_size()
            segments.append((outer, inner))
        if heads is None:
            raise LayoutError("kv_caches: expected at least one tensor")
        return cls(heads=heads, segments=tuple(segments), tag=tag)

    @property
    def block_bytes(self) -> int:
        return sum(outer * self.heads * inner for outer, inner in self.segments)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one block (every segment)."""
        return sum(outer * inner for outer, inner in self.segments)

    def describe(self) -> str:
        """The axis without its head count (which depends on the TP size)."""
        segs = ",".join(f"{o}x{i}" for o, i in self.segments)
        return f"{self.tag};seg={segs}" if self.tag else f"seg={segs}"


def rows_view(rows: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``rows`` (1-D, contiguous, equal length) as one ``[len(rows), length]`` view when they lie
    evenly spaced in one storage (rows of a staging buffer or pool), else ``None``."""
    if not rows:
        return None
    first = rows[0]
    if first.dim() != 1 or not first.is_contiguous():
        return None
    n = first.numel()
    if len(rows) == 1:
        return first.view(1, n)
    step = rows[1].data_ptr() - first.data_ptr()
    if step < n:
        return None
    base, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for i, row in enumerate(rows):
        if (
            row.data_ptr() != base + i * step or row.numel() != n or row.dim() != 1
            or row.dtype != first.dtype or row.untyped_storage().data_ptr() != storage
        ):
            return None
    if step % first.element_size():
        return None
    return first.as_strided((len(rows), n), (step // first.element_size(), 1))


@dataclass(frozen=True, slots=True)
class HeadGroupLayout:
    """One rank's head groups over its cache's head axis: the records it reads and writes."""

    groups: HeadGroups
    axis: HeadAxis

    def __post_init__(self) -> None:
        held = len(self.groups.local_heads)
        if self.axis.heads != held:
            raise LayoutError(
                f"head_groups: the KV cache holds {self.axis.heads} heads per block, but kv_heads "
                f"{self.groups.kv_heads} at TP {self.groups.tp_size} gives rank {self.groups.rank} {held}"
            )

    @property
    def group_bytes(self) -> int:
        """Bytes of one group record's payload."""
        return self.axis.head_bytes * self.groups.group_size

    @property
    def whole(self) -> bool:
        """One group is the rank's whole block: records are the blocks themselves, no copy."""
        return len(self.groups.held) == 1

    def layout_string(self) -> str:
        return f"head-groups:{self.groups.layout_tag()};{self.axis.describe()}"

    def namespace(self, namespace: Namespace) -> Namespace:
        """``namespace`` for group records: no TP rank or size, the group layout as its KV layout."""
        return dataclasses.replace(namespace, tp_rank=0, tp_size=1, kv_layout=self.layout_string())

    def location(self, namespace: Namespace) -> str:
        """A name for where this layout's records live inside a tier (a subdirectory, a key
        prefix), so records of another layout or model are never met (a miss, never an error)."""
        return "hg-" + self.namespace(namespace).digest[:8].hex()

    # -- keys ----------------------------------------------------------------------------------
    @staticmethod
    def record_keys(keys: Sequence[bytes], groups: Sequence[int]) -> list[bytes]:
        """Block-major: every group of ``keys[0]``, then of ``keys[1]``, ..."""
        offsets = [_offset(g) for g in groups]
        out: list[bytes] = []
        append = out.append
        for key in keys:
            head, tail = key[:_TAIL], int.from_bytes(key[_TAIL:], "little")
            for o in offsets:
                append(head + ((tail + o) % _MOD).to_bytes(8, "little"))
        return out

    @property
    def held_slice(self) -> slice:
        """Where this rank's held groups are in a block's records of every group (group order)."""
        held = self.groups.held
        return slice(held[0], held[-1] + 1) if held else slice(0, 0)

    def blocks_present(self, record_keys: Iterable[bytes]) -> dict[bytes, list[bytes]]:
        """The mapping from a listing of a tier's records back to blocks: block key -> the
        record keys of *every* group of it (group order; :attr:`held_slice` picks this rank's),
        for the blocks every group of which is in ``record_keys``.

        A block another engine stored is adopted only once all of its writer's ranks stored
        their groups, and a record key, whose group a listing cannot tell, is never taken for
        another block's: each candidate block must show all its groups, and each record belongs
        to one block at most. Keys ``b`` and ``b + o_g - o_h`` (offsets of groups ``g``, ``h``)
        share a record key (about 2**-64 for hashed keys): that record could hold either's
        bytes, so both blocks are left out (a miss, never the other block's data)."""
        present = record_keys if isinstance(record_keys, (set, dict)) else set(record_keys)
        every = range(self.groups.num_groups)
        out: dict[bytes, list[bytes]] = {}
        claimed: set[bytes] = set()
        shared: set[bytes] = set()
        for rk in present:
            block = block_key_of(rk, 0)
            recs = self.record_keys([block], every)
            if all(r in present for r in recs):
                out[block] = recs
                shared.update(r for r in recs if r in claimed)
                claimed.update(recs)
        if shared:
            for block in [b for b, recs in out.items() if not shared.isdisjoint(recs)]:
                del out[block]
        return out

    # -- bytes ---------------------------------------------------------------------------------
    def _width(self) -> int:
        """The widest element (bytes) that every head's run of bytes is a whole number of:
        the copies move int64 words where they can, not bytes (each element costs a step)."""
        inner = math.gcd(*(i for _, i in self.axis.segments))
        return next(w for w in (8, 4, 2, 1) if inner % w == 0)

    def _views(self, rows: torch.Tensor, first: int, count: int, w: int) -> list[torch.Tensor]:
        """Per segment, ``[N, count, outer, gs, inner / w]`` views of the groups ``first ..`` of
        ``rows`` (``[N, block_bytes / w]`` of ``w``-byte words), group-major: what records hold."""
        n, gs, heads = rows.shape[0], self.groups.group_size, self.axis.heads
        h0 = first * gs
        out, off = [], 0
        for outer, inner in self.axis.segments:
            size = outer * heads * inner // w
            seg = rows[:, off : off + size].view(n, outer, heads, inner // w)[:, :, h0 : h0 + count * gs, :]
            out.append(seg.unflatten(2, (count, gs)).permute(0, 2, 1, 3, 4))
            off += size
        return out

    def _record_views(self, records: torch.Tensor, w: int) -> list[torch.Tensor]:
        """Per segment, ``[N, count, outer, gs, inner / w]`` views of ``records`` (``[N, count, group_bytes / w]``)."""
        n, count = records.shape[0], records.shape[1]
        gs = self.groups.group_size
        out, off = [], 0
        for outer, inner in self.axis.segments:
            size = outer * gs * inner // w
            out.append(records[:, :, off : off + size].view(n, count, outer, gs, inner // w))
            off += size
        return out

    def _copy(self, rows: torch.Tensor, records: torch.Tensor, first: int, to_records: bool) -> None:
        """One copy per segment between blocks ``rows`` (``[N, block_bytes]``) and their records
        (``[N, count, group_bytes]``), on the calling thread alone (an OpenMP team per copy
        stalls on a busy host: :mod:`kvtier.transfer.copies`)."""
        w = self._width()
        wide = _WORDS[w]
        try:
            rows_w, records_w = rows.view(wide), records.view(wide)
        except RuntimeError:  # rows not aligned to the word: move bytes
            w, rows_w, records_w = 1, rows, records
        pairs = zip(self._views(rows_w, first, records.shape[1], w), self._record_views(records_w, w))
        with one_intra_op_thread():
            for block_view, record_view in pairs:
                if to_records:
                    record_view.copy_(block_view)
                else:
                    block_view.copy_(record_view)

    def split(
        self, blocks: Sequence[torch.Tensor], groups: Sequence[int], scratch: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The records of ``groups`` (held, consecutive) of every block, block-major: the
        blocks themselves when one group is the whole block, else one copy per segment per job
        (into ``scratch``, at least ``len(blocks) * len(groups) * group_bytes`` bytes, when given:
        fresh memory for every job costs a page fault per 4 KiB)."""
        if not blocks or not groups:
            return []
        if self.whole:
            return list(blocks)
        shape = (len(blocks), len(groups), self.group_bytes)
        if scratch is None:
            records = torch.empty(shape, dtype=torch.uint8, device=blocks[0].device)
        else:
            records = scratch[: math.prod(shape)].view(shape)
        self.split_into(blocks, groups, records)
        return list(records.view(len(blocks) * len(groups), self.group_bytes))

    def split_into(self, blocks: Sequence[torch.Tensor], groups: Sequence[int], records: torch.Tensor) -> None:
        """Copy the records of ``groups`` (held, consecutive) of every block into ``records``
        (``[len(blocks), len(groups), group_bytes]``): one copy per segment per job when the
        blocks lie evenly spaced in one storage (rows of a staging buffer), else per block."""
        first = groups[0] - self.groups.held[0]
        stacked = rows_view(blocks)
        for rows, dst in ((stacked, records),) if stacked is not None else (
            (b.view(1, -1), records[i : i + 1]) for i, b in enumerate(blocks)
        ):
            self._copy(rows, dst, first, to_records=True)

    def read_buffers(self, n: int, device: torch.device | None = None) -> torch.Tensor:
        """A ``[n, held groups, group_bytes]`` buffer for the held records of ``n`` blocks."""
        return torch.empty((n, len(self.groups.held), self.group_bytes), dtype=torch.uint8, device=device)

    def join(self, records: torch.Tensor, out: Sequence[torch.Tensor]) -> None:
        """Copy the held records ``records`` (``[N, held, group_bytes]``) into the blocks ``out``."""
        stacked = rows_view(out)
        pairs = ((stacked, records),) if stacked is not None else (
            (b.view(1, -1), records[i : i + 1]) for i, b in enumerate(out)
        )
        for rows, src in pairs:
            self._copy(rows, src, 0, to_records=False)
