"""What each worker rank opened, and the scheduler side's manager built from all of them.

Under vLLM the scheduler side and the workers may live in different processes (vLLM's
default), so the scheduler side cannot look at the tiers. Each rank opens its own tiers for its
own shard of every block (see :func:`~kvtier.integrations.vllm.engines.rank_tiers`) and
describes them in a :class:`RankTiers`: the room of each tier and the records its persistent
tiers hold. vLLM carries these to the scheduler side before the first step (the connector's
handshake metadata: ``get_handshake_metadata`` on every worker, ``set_xfer_handshake_metadata``
on the scheduler). :func:`build_manager` then builds the one :class:`~kvtier.manager.TierManager`
that decides for every rank:

* a tier's room is the smallest any rank has (a plan the manager makes fits on every rank);
* a persistent tier adopts only the keys that *every* rank holds (a key some rank lacks
  would be served with a shard missing); the others are *orphans*, deleted on the ranks that
  hold them through the scheduler side's delete ledger, as are records beyond the room
  (except in a shared tier, where another host may be writing them: they are ignored);
* the adopted keys keep the tenant and the pins the ranks saved with them (the scheduler side
  ships its tags and pin changes to the ranks with each step's deletes,
  :meth:`~kvtier.integrations.vllm.scheduler_side.SchedulerSide.take_tags`), so usage per
  tenant, quotas and pins hold across a restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.config import StoreConfig
from kvtier.config.tenants import TenancyConfig, tenant_rules
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.manager import TierManager, TierSpec
from kvtier.records.head_groups import HeadGroupLayout
from kvtier.store import KVStore

__all__ = ["RankTiers", "TierRoom", "build_manager", "describe_rank"]

Record = tuple[bytes, int, float]  # key, stored bytes, access stamp


@dataclass(frozen=True)
class TierRoom:
    """One tier of one rank: its room, as its backend counts it, and its persistent records."""

    name: str
    capacity_bytes: int
    block_reserve: int
    max_blocks: int
    memory: bool
    persistent: bool
    #: a tier other hosts write too (Redis): its orphans may be another host's, never deleted
    shared: bool
    variable_size: bool
    admit_after: int
    records: tuple[Record, ...] = ()
    #: the tenant of each record saved with one (the rest are the default tenant's), and the
    #: pinned keys, as the rank's store read them back at open
    tenants: tuple[tuple[bytes, str], ...] = ()
    pins: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class RankTiers:
    """What worker ``rank`` of ``world_size`` opened; sent to the scheduler side by vLLM."""

    engine_id: str
    rank: int
    world_size: int
    block_bytes: int
    #: the rank's KV layout fingerprint: part of the key namespace (ranks of one engine agree)
    layout: str
    tiers: tuple[TierRoom, ...]
    #: the key namespace when it does not depend on the rank or TP size (head-group records):
    #: the scheduler side folds vLLM's keys with it, so engines of every TP size share keys
    key_namespace: Namespace | None = None
    #: the rank's head groups and its store's block format (head-group records; see .follow)
    head_groups: HeadGroupLayout | None = None
    block_format: BlockFormat | None = None


def describe_rank(
    engine_id: str, rank: int, world_size: int, store: KVStore, layout: str, *, together: frozenset[int] = frozenset()
) -> RankTiers:
    """The :class:`RankTiers` of an open worker store (its persistent tiers scanned again:
    what they hold after the store's own clean-up at open). With head-group records the key
    namespace goes along, and the tiers in ``together`` count as shared (other engines write
    the same place: records some rank lacks may be another engine's writes in progress)."""
    mgr = store.manager
    assert mgr is not None
    rooms = []
    for i, backend in enumerate(store.backends):
        spec = mgr.tier_spec(i)
        records: tuple[Record, ...] = ()
        owners: dict[bytes, str] = {}
        pins: list[bytes] = []
        if backend.persistent:
            records = tuple((r.key, r.stored_bytes, r.stamp) for r in backend.scan())
            owners, pins = mgr.tenants.tags(i)
        rooms.append(
            TierRoom(
                name=spec.name,
                capacity_bytes=spec.capacity_bytes,
                block_reserve=spec.block_reserve,
                max_blocks=backend.max_blocks,
                memory=backend.is_memory,
                persistent=backend.persistent,
                shared=bool(getattr(backend, "shared", False)) or (i in together and store.head_groups is not None),
                variable_size=spec.variable_size,
                admit_after=spec.admit_after,
                records=records,
                tenants=tuple(owners.items()),
                pins=tuple(pins),
            )
        )
    hg = store.head_groups
    return RankTiers(
        engine_id,
        rank,
        world_size,
        store.format.block_bytes,
        layout,
        tuple(rooms),
        key_namespace=store.namespace if hg is not None else None,
        head_groups=hg,
        block_format=store.format if hg is not None else None,
    )


def build_manager(
    ranks: Mapping[int, RankTiers], config: StoreConfig
) -> tuple[TierManager, dict[int, list[bytes]], dict[int, list[bytes]]]:
    """The manager of all ``ranks`` (rank -> what it opened), the orphans per tier (records
    that are not adopted: held by some ranks only, or beyond the room), and the keys adopted
    per tier. Raises ConfigError when the ranks do not describe one engine."""
    if not ranks:
        raise ConfigError("kvtier: no worker rank described its tiers")
    world = next(iter(ranks.values())).world_size
    if sorted(ranks) != list(range(world)):
        raise ConfigError(f"kvtier: tiers described by ranks {sorted(ranks)}, expected ranks 0..{world - 1}")
    first = ranks[0]
    for r, desc in ranks.items():
        if desc.world_size != world or len(desc.tiers) != len(first.tiers) or desc.layout != first.layout:
            raise ConfigError(
                f"kvtier: rank {r} opened {len(desc.tiers)} tiers with layout {desc.layout!r} in a world of "
                f"{desc.world_size}; rank 0 opened {len(first.tiers)} with {first.layout!r} in a world of {world}"
            )
    specs = []
    for i, room in enumerate(first.tiers):
        rooms = [ranks[r].tiers[i] for r in range(world)]
        max_blocks = min(t.max_blocks for t in rooms)
        policy_cls = registry.policies.get(config.tiers[i].policy or config.policy)
        specs.append(
            TierSpec(
                name=room.name,
                capacity_bytes=min(t.capacity_bytes for t in rooms),
                block_reserve=max(t.block_reserve for t in rooms),
                policy=policy_cls(capacity=max_blocks),
                persistent=room.persistent,
                variable_size=any(t.variable_size for t in rooms),
                admit_after=room.admit_after,
            )
        )
    rules = None
    if config.tenants is not None or config.tenancy != TenancyConfig():
        rules = tenant_rules(config.tenants, config.tenancy, [s.name for s in specs])
    manager = TierManager(specs, write=config.write, tenants=rules)
    orphans: dict[int, list[bytes]] = {}
    adopted: dict[int, list[bytes]] = {}
    for i, room in enumerate(first.tiers):
        if not room.persistent:
            continue
        held = [{rec[0]: rec for rec in ranks[r].tiers[i].records} for r in range(world)]
        common = set(held[0]).intersection(*held[1:])
        records = [
            (key, max(h[key][1] for h in held), min(h[key][2] for h in held)) for key in held[0] if key in common
        ]
        owners = {key: tenant for r in range(world) for key, tenant in ranks[r].tiers[i].tenants if key in common}
        excess = manager.adopt(i, records, owners)
        gone = set(excess)
        pins = {key for r in range(world) for key in ranks[r].tiers[i].pins if key in common and key not in gone}
        if pins:
            manager.tenants.adopt_pins(i, sorted(pins))
        adopted[i] = [rec[0] for rec in records if rec[0] not in gone]
        lost = set().union(*held) - common | set(excess)
        if lost and not room.shared:
            orphans[i] = sorted(lost)
    return manager, orphans, adopted
