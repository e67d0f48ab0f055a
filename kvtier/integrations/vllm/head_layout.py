"""Head-group records under vLLM: where the KV heads are in vLLM's pages, and which tiers the
ranks then share (nothing here imports vLLM).

With head-group records (:mod:`kvtier.records.head_groups`, the default ``head_groups:``
section of a store config) a byte tier holds one record per (block, head group) under a
namespace without the TP rank or size, so engines of every TP size read each other's blocks.
kvtier needs to know where the heads are in a rank's page. vLLM hands the offloading worker
``(num_blocks, page)`` byte views; the connector looks at the per-layer KV tensors before that
(:func:`page_head_shape`, from their shapes and strides) and hands the spec one
:class:`HeadShape` per KV-cache group. Recognised pages (the same as vLLM's canonical page
mapping): K and V packed per (head, token), ``(num_blocks, heads, block_size, 2 * head_size)``
in head-major (HND) or token-major (NHD) strides; K and V in page halves,
``(num_blocks, 2, block_size, heads, head_size)``, either stride order. A page of any other
shape keeps the per-rank layout (logged): records a reader of another TP size cannot read are
a miss, never wrong bytes.

Where the records live: with head groups every rank of every engine writes the groups it
computed and reads the ones it holds in **one** place per tier (:func:`together_tiers`: the
``file`` tier, whose instances share a directory, and tiers every process reaches as one store,
such as Redis), ``<path>/head-groups`` and ``<prefix>.hg``. An LMDB environment has one writer
process, so LMDB tiers stay per rank (``<path>/r<rank>-of-<world>``), holding head-group
records all the same.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier import registry
from kvtier.config.head_groups import HeadGroupsConfig
from kvtier.records.head_groups import HeadAxis, HeadGroupLayout, HeadGroups, default_group_size

__all__ = ["TOGETHER_SUFFIX", "HeadShape", "head_shapes", "page_head_shape", "rank_head_groups", "together_tiers"]

log = logging.getLogger("kvtier.vllm")

#: the location of head-group records that every rank of every TP size shares
TOGETHER_SUFFIX = "head-groups"


@dataclass(frozen=True)
class HeadShape:
    """Where the KV heads are in one vLLM page of a KV-cache group: ``[outer, heads, inner]``
    (``inner`` in bytes), ``heads`` of the model's ``kv_heads`` on this rank."""

    outer: int
    heads: int
    inner: int
    kv_heads: int


def page_head_shape(tensor: Any, num_blocks: int, heads: int, head_size: int) -> tuple[int, int] | None:
    """``(outer, inner bytes)`` of one block's page of a vLLM per-layer KV tensor with ``heads``
    KV heads of ``head_size``, or None when the layout is not one kvtier knows (see the module
    doc)."""
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    elem = int(tensor.element_size())
    if len(shape) < 4 or shape[0] != num_blocks or stride[-1] != 1:
        return None
    page = heads * shape[2] * 2 * head_size  # elements of one block (block_size is dimension 2)
    if stride[0] != page:
        return None  # not one contiguous page per block
    if len(shape) == 4 and shape[1] == heads and shape[3] == 2 * head_size:
        bs = shape[2]
        if stride[1] == bs * 2 * head_size and stride[2] == 2 * head_size:  # HND: [H, N, 2C]
            return 1, bs * 2 * head_size * elem
        if stride[1] == 2 * head_size and stride[2] == heads * 2 * head_size:  # NHD: [N, H, 2C]
            return bs, 2 * head_size * elem
        return None
    if len(shape) == 5 and shape[1] == 2 and shape[3] == heads and shape[4] == head_size:
        bs = shape[2]
        if stride[1] != bs * heads * head_size:
            return None
        if stride[2] == heads * head_size and stride[3] == head_size:  # NHD halves: [2, N, H, C]
            return 2 * bs, head_size * elem
        if stride[3] == bs * head_size and stride[2] == head_size:  # HND halves: [2, H, N, C]
            return 2, bs * head_size * elem
    return None


def rank_head_groups(
    settings: Mapping[str, Any] | None,
    shape: HeadShape | None,
    num_tensors: int,
    *,
    tp_size: int,
    rank: int,
    blocks_per_chunk: int,
    tag: str,
) -> HeadGroupLayout | None:
    """The head groups of rank ``rank`` for one KV-cache group whose ``num_tensors`` page views
    all have ``shape``, or None (the per-rank layout): the store config's ``head_groups``
    section says ``per_rank``, or the page layout is unknown (``shape`` None, logged)."""
    cfg = HeadGroupsConfig.model_validate(dict(settings or {}))
    if not cfg.enabled:
        return None
    if shape is None:
        log.warning("kvtier: vLLM's KV pages have a layout kvtier's head groups do not know; records stay per rank")
        return None
    axis = HeadAxis(heads=shape.heads, segments=((shape.outer * blocks_per_chunk, shape.inner),) * num_tensors, tag=tag)
    size = cfg.group_size or default_group_size(shape.kv_heads, max_tp_size=cfg.max_tp_size, head_record_bytes=axis.head_bytes)
    return HeadGroupLayout(HeadGroups.for_rank(shape.kv_heads, tp_size, rank, size), axis)


def together_tiers(cfg: Mapping[str, Any]) -> frozenset[int]:
    """The tiers of a store config where every rank of every engine keeps its head-group
    records in one place: ``file`` tiers and tiers whose backend is shared (Redis)."""
    out = []
    for i, tier in enumerate(cfg.get("tiers") or ()):
        backend = tier.get("backend") if isinstance(tier, Mapping) else None
        if not isinstance(backend, str):
            continue
        cls = registry.backends.get(backend)
        if backend == "file" or (cls is not None and getattr(cls, "shared", False)):
            out.append(i)
    return frozenset(out)


def head_shapes(groups: Sequence[tuple[int, Any, Sequence[Any]]], num_blocks: int, kv_heads: int) -> dict[int, HeadShape | None]:
    """Per KV-cache group id: the :class:`HeadShape` of its layers (``groups``: group id, its
    attention spec, its per-layer KV tensors), or None when a layer's page is unknown or the
    layers disagree."""
    out: dict[int, HeadShape | None] = {}
    for gid, spec, tensors in groups:
        heads, head_size = getattr(spec, "num_kv_heads", None), getattr(spec, "head_size", None)
        found = None
        if isinstance(heads, int) and isinstance(head_size, int) and tensors:
            shapes = {page_head_shape(t, num_blocks, heads, head_size) for t in tensors}
            only = shapes.pop() if len(shapes) == 1 else None
            if only is not None:
                found = HeadShape(outer=only[0], heads=heads, inner=only[1], kv_heads=kv_heads)
        out[gid] = found
    return out
