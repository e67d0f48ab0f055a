"""The ``head_groups:`` section of a store config: how byte tiers lay out their records.

``record_layout: head_groups`` (the default) stores one record per (block, head group), so
engines of every TP size share a tier (:mod:`kvtier.records.head_groups`). It takes effect where
kvtier knows where the KV heads are: an engine integration tells it, or the config does
(``kv_heads`` and ``head_dim``, for caches whose tensors have a heads dimension). ``per_rank``
keeps one record per rank's block (readable only by engines of the same TP size and rank) and
needs a ``reason``: it is the exception a fleet must explain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtier.errors import ConfigError
from kvtier.keys import Namespace

if TYPE_CHECKING:  # torch loads only when a store is built (``import kvtier`` stays light)
    import torch

    from kvtier.records.head_groups import HeadAxis, HeadGroupLayout

__all__ = ["HeadGroupsConfig"]


class HeadGroupsConfig(BaseModel):
    """Head-group records (see the module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    record_layout: Literal["head_groups", "per_rank"] = "head_groups"
    #: why this store keeps the per-rank layout (required with ``record_layout: per_rank``)
    reason: str | None = None
    #: KV heads per record, fleet-wide (None: one head, or the fewest heads whose record reaches
    #: 64 KiB that ``max_tp_size`` allows)
    group_size: int | None = Field(default=None, ge=1)
    #: the largest TP size of the fleet (bounds the group size at kv_heads / max_tp_size)
    max_tp_size: int | None = Field(default=None, ge=1)
    #: the model's KV heads, over all ranks (integrations fill it in)
    kv_heads: int | None = Field(default=None, ge=1)
    #: the dimension of each KV-cache tensor that counts heads (a store given plain tensors)
    head_dim: int | None = Field(default=None, ge=1)
    #: an MLA cache: one latent head, the same on every rank, one record for all of them
    mla: bool = False

    @model_validator(mode="after")
    def _reason_for_per_rank(self) -> HeadGroupsConfig:
        if self.record_layout == "per_rank" and not (self.reason or "").strip():
            raise ValueError(
                "record_layout per_rank needs a reason: its records stay apart from engines of other TP sizes; "
                "say why this store needs it (head_groups.reason)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.record_layout == "head_groups"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude_defaults=True)

    def for_engine(self, axis: HeadAxis, *, kv_heads: int, tp_size: int, rank: int, mla: bool = False) -> HeadGroupLayout | None:
        """What an engine integration calls: the head groups of ``rank`` of a ``tp_size``
        engine over a model of ``kv_heads`` KV heads, whose cache's heads are where ``axis``
        says (``axis.tag`` naming the engine's layout and KV-cache group); ``None`` for the
        ``per_rank`` layout. The group size is this section's, or :func:`default_group_size`
        with its ``max_tp_size`` and the axis's bytes per head."""
        from kvtier.records.head_groups import HeadGroupLayout, HeadGroups, default_group_size

        if not self.enabled:
            return None
        if mla or self.mla:
            return HeadGroupLayout(HeadGroups.for_rank(1, tp_size, rank, mla=True), axis)
        size = self.group_size or default_group_size(kv_heads, max_tp_size=self.max_tp_size, head_record_bytes=axis.head_bytes)
        return HeadGroupLayout(HeadGroups.for_rank(kv_heads, tp_size, rank, size), axis)

    def layout(
        self, kv_caches: Sequence[torch.Tensor] | torch.Tensor, namespace: Namespace, *, engine_blocks_per_block: int = 1
    ) -> HeadGroupLayout | None:
        """The head groups of a store given plain ``kv_caches``: ``None`` unless this section
        turns them on and says where the heads are (``kv_heads`` and ``head_dim``, or ``mla``).
        The rank and TP size are the namespace's."""
        import torch

        from kvtier.records.head_groups import HeadAxis, HeadGroupLayout, HeadGroups, default_group_size

        if not self.enabled:
            return None
        if self.mla:
            caches = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
            size = sum(t[0].numel() * t.element_size() for t in caches) * engine_blocks_per_block
            axis = HeadAxis(heads=1, segments=((1, size),), tag="mla")
            return HeadGroupLayout(HeadGroups.for_rank(1, namespace.tp_size, namespace.tp_rank, mla=True), axis)
        if self.kv_heads is None or self.head_dim is None:
            if self.kv_heads is not None or self.head_dim is not None or self.group_size is not None:
                missing = "head_dim" if self.kv_heads is not None else "kv_heads"
                raise ConfigError(f"head_groups.{missing}: needed (with kv_heads and head_dim kvtier knows where the heads are)")
            return None
        axis = HeadAxis.from_caches(kv_caches, head_dim=self.head_dim, engine_blocks_per_block=engine_blocks_per_block)
        size = self.group_size or default_group_size(self.kv_heads, max_tp_size=self.max_tp_size, head_record_bytes=axis.head_bytes)
        groups = HeadGroups.for_rank(self.kv_heads, namespace.tp_size, namespace.tp_rank, size)
        return HeadGroupLayout(groups, axis)
