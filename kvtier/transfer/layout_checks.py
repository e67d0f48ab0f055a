"""Checks of an engine's KV cache tensors against the namespace a store is opened with.

Nothing here could make wrong data come back (the layout is folded into every key), but a
mismatch means the keys describe other bytes than the engine's, or that the engine's blocks are
not in dimension 0, so a store would only ever miss or fail at its first ``save``. The store
refuses such caches at open, naming the tensor, its shape and what was expected:

* **tokens per block**: a ``block_size`` given (tokens per engine block) must be one of the
  dimensions after the block dimension of every tensor of 3 or more dimensions (2-D caches,
  such as vLLM's byte pages, carry no token dimension and are not checked);
* **K/V first** (always checked): a tensor ``(2, num_blocks, block_size, ...)`` holds K and V in
  dimension 0, not blocks;
* **distinct memory** (always checked, by :class:`~kvtier.transfer.layout.KVLayout`): no two
  tensors share a byte. Views of one allocation that do not overlap (vLLM's and SGLang's layers,
  K and V of one tensor) are fine; overlapping ones would make a load's bytes depend on the
  order of its copies;
* **dtype**: the namespace's ``dtype`` must be the caches' dtype (raw byte caches, ``uint8`` or
  ``int8``, are not checked: their dtype is not the KV's).

A field counts only where it was given: a field of the caller's namespace that differs from
:class:`~kvtier.keys.Namespace`'s default (a default cannot be told from a value left out), or a
field a config's ``namespace`` sets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import torch

from kvtier.errors import LayoutError
from kvtier.keys import Namespace

__all__ = ["check_caches_match_namespace", "check_distinct_block_ids", "check_distinct_memory", "given_fields"]

_RAW_BYTES = (torch.uint8, torch.int8)


def given_fields(namespace: Namespace) -> set[str]:
    """The fields of a caller's ``namespace`` that differ from the defaults."""
    return {f.name for f in dataclasses.fields(Namespace) if f.init and getattr(namespace, f.name) != f.default}


def check_caches_match_namespace(caches: Sequence[torch.Tensor], namespace: Namespace, given: Collection[str]) -> None:
    """Raise :class:`LayoutError` when ``caches`` contradict the ``given`` fields of ``namespace``."""
    tokens = int(namespace.block_size)
    for i, t in enumerate(caches):
        shape = tuple(t.shape)
        if t.dim() < 3 or tokens <= 0:
            continue
        if shape[0] == 2 and shape[1] != tokens and shape[1] > 2 and shape[2] == tokens:
            raise LayoutError(
                f"kv_caches[{i}]: shape {shape} looks K/V-first (2 in dimension 0, {shape[1]} blocks of "
                f"{tokens} tokens after it); kvtier needs the block dimension first: pass K and V as separate "
                f"tensors (kv[0], kv[1]) or a (num_blocks, 2, ...) tensor"
            )
        if "block_size" in given:
            if tokens not in shape[1:]:
                    raise LayoutError(
                        f"kv_caches[{i}]: shape {shape} has no dimension of {tokens} tokens, the namespace's "
                        f"block_size; expected (num_blocks, {tokens}, ...) or (num_blocks, 2, {tokens}, ...): set "
                        f"namespace.block_size to the engine's tokens per block (dimension 1 here is {shape[1]})"
                    )
    if "dtype" in given:
        want = str(namespace.dtype).removeprefix("torch.")
        for i, t in enumerate(caches):
            have = str(t.dtype).removeprefix("torch.")
            if t.dtype not in _RAW_BYTES and have != want:
                raise LayoutError(
                    f"kv_caches[{i}]: dtype {have}, but the namespace says dtype {want!r}; set namespace.dtype to "
                    f"the KV cache's dtype"
                )


def check_distinct_memory(caches: Sequence[torch.Tensor]) -> None:
    """Raise :class:`LayoutError` naming two of ``caches`` whose bytes overlap.

    The tensors are contiguous (the layout checks that first), so each one's bytes are exactly
    ``[data_ptr, data_ptr + nbytes)``; the check is by address, so it also catches two storages
    over the same memory. Tensors without memory (``meta``) are left out."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i) for i, t in enumerate(caches) if t.data_ptr()
    )
    far_end, far = 0, -1  # the span reaching furthest so far, and its tensor
    for start, end, i in spans:
        if start < far_end:
            lo, hi, a, b = start, min(end, far_end), caches[min(i, far)], caches[max(i, far)]
            base = a.untyped_storage().data_ptr()
            where = (
                f"bytes {lo - base}..{hi - base} of one storage"
                if base == b.untyped_storage().data_ptr()
                else f"{hi - lo} bytes at {lo:#x}"
            )
            raise LayoutError(
                f"kv_caches[{max(i, far)}] overlaps kv_caches[{min(i, far)}]: {where}; each tensor of the KV "
                f"cache needs memory of its own (views of one buffer must not share bytes)"
            )
        if end > far_end:
            far_end, far = end, i


def check_distinct_block_ids(ids: Sequence[int], what: str = "block_ids") -> None:
    """Raise :class:`LayoutError` when an engine block id appears twice (a load would fill it twice)."""
    if len(set(ids)) == len(ids):  # (every id distinct, the usual load: one pass in C)
        return
    seen: dict[int, int] = {}
    for i, b in enumerate(ids):
        if b in seen:
            raise LayoutError(
                f"{what}[{i}]: engine block id {b} appears twice (also at {what}[{seen[b]}]); each loaded block "
                f"needs a block of its own"
            )
        seen[b] = i
