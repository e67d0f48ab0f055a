"""KV that is the same on every rank (MLA models): one copy in a tier all ranks share.

With multi-head latent attention every tensor-parallel rank holds the whole latent KV of a
block, byte for byte the same (vLLM's ``use_mla``; the KV-cache spec is an
``MLAAttentionSpec``). Storing it once per rank would multiply the bytes by the TP size for
nothing, where a tier is one store that every rank reaches:

* a **shared tier** (its backend declares ``shared``: Redis) holds one record per block, under
  a name without the rank (``<prefix>.all-of-<world>``), with the whole ``capacity`` of the
  config (it holds one copy, not a shard per rank). Only rank 0 writes it and deletes from it
  (:func:`for_reader` takes those steps out of the plans of the other ranks, so no rank deletes
  a record rank 0 has just written again); every rank reads the same record, which carries
  rank 0's namespace (every rank's store uses it: the bytes are rank 0's);
* every **other tier** stays per rank (``<path>/r<rank>-of-<world>``, ``capacity / world``),
  so no rank ever waits for bytes only another rank holds; a load from a per-rank tier reads
  that rank's own copy.

A per-rank tier below a shared one is refused (:func:`shared_tiers`): a demotion out of the
shared tier would have every rank read a record that rank 0 deletes in the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvtier import registry
from kvtier.connector.ledger import Deletes
from kvtier.errors import ConfigError
from kvtier.manager import StorePlan

__all__ = ["WRITER_RANK", "for_reader", "namespace_rank", "shared_tiers", "without_tiers"]

#: the rank that writes (and deletes from) the tiers every rank shares
WRITER_RANK = 0


def namespace_rank(rank: int, replicated: bool) -> int:
    """The rank in the key namespace of rank ``rank``'s records: the writer's when every rank
    holds the same KV (a rank reads the writer's records, checked against its namespace)."""
    return WRITER_RANK if replicated else rank


def shared_tiers(cfg: Mapping[str, Any]) -> frozenset[int]:
    """The tiers of store config ``cfg`` whose backend every rank reaches as one store.
    Raises ConfigError when a tier that is not shared follows a shared one."""
    shared: list[int] = []
    for i, tier in enumerate(cfg.get("tiers") or ()):
        backend = tier.get("backend") if isinstance(tier, Mapping) else None
        cls = registry.backends.get(backend) if isinstance(backend, str) else None
        if cls is not None and getattr(cls, "shared", False):
            shared.append(i)
        elif shared:
            raise ConfigError(
                f"kv_connector_extra_config.kvtier.tiers[{i}] ({backend}): with KV that is the same on every rank "
                f"(MLA), a per-rank tier cannot follow the shared tier tiers[{shared[0]}]; put shared tiers last"
            )
    return frozenset(shared)


def for_reader(plan: StorePlan, block_ids: Sequence[Any], skip: frozenset[int]) -> tuple[StorePlan, list[Any]]:
    """Store ``plan`` (and its engine blocks) as a rank that does not write the tiers in
    ``skip`` runs it: their writes and deletes are left to the writer rank; a demotion into one
    of them only frees this rank's own copy; keys that go only into them need no block read."""
    drops = [(tier, keys) for tier, keys in plan.drops if tier not in skip]
    demotions = []
    for d in plan.demotions:
        if d.src in skip:
            raise ConfigError(f"store plan {plan.plan_id}: a demotion out of shared tier {d.src}; shared tiers must be last")
        if d.dst in skip:
            drops.append((d.src, d.keys))  # the writer keeps the one shared copy
        else:
            demotions.append(d)
    through = tuple((tier, keys) for tier, keys in plan.write_through if tier not in skip)
    ids = list(block_ids)
    if plan.tier in skip:  # the shared tier comes last: nothing below it, nothing to write here
        view = replace(plan, keys=(), positions=(), write_through=(), drops=tuple(drops), demotions=tuple(demotions))
        return view, []
    view = replace(plan, write_through=through, drops=tuple(drops), demotions=tuple(demotions))
    return view, ids


def without_tiers(deletes: Deletes, skip: frozenset[int]) -> Deletes:
    """``deletes`` less those in the tiers ``skip`` (the writer rank deletes there)."""
    return tuple((tier, keys) for tier, keys in deletes if tier not in skip)
