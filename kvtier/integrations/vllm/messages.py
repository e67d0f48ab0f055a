"""What kvtier's two sides tell each other inside vLLM's own messages (imports vLLM).

* :class:`KvtierStoreSpec` and :class:`KvtierLoadSpec`: the ``LoadStoreSpec`` of each store
  and load job vLLM's scheduler side hands its workers: kvtier's plans, per KV-cache group;
* :class:`KvtierWorkerMetadata`: vLLM's worker metadata plus each rank's kvtier job results,
  gathered from every rank by vLLM (``aggregate``).

vLLM pickles them between its processes; they hold only plain values and kvtier's frozen plan
and result objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.v1.kv_offload.base import LoadStoreSpec

from kvtier.manager import LoadPlan, StorePlan
from kvtier.transfer import JobResult

__all__ = ["KvtierLoadSpec", "KvtierStoreSpec", "KvtierWorkerMetadata", "RankResult"]

#: one rank's result of one job's part: (rank, group position, kind, plan or load id, result)
RankResult = tuple[int, int, str, int, JobResult]


class KvtierStoreSpec(LoadStoreSpec):
    """Where a store goes: a kvtier store plan (drops, demotions, new keys) per KV-cache
    group with keys to store, as (group position, plan)."""

    def __init__(self, plans: tuple[tuple[int, StorePlan], ...]) -> None:
        self.plans = plans

    def __repr__(self) -> str:
        parts = ", ".join(f"g{g}: plan {p.plan_id}, {len(p.keys)} keys" for g, p in self.plans)
        return f"KvtierStoreSpec({parts})"

class KvtierLoadSpec(LoadStoreSpec):
    """Where a load comes from: a kvtier load plan (the tier of each key) per KV-cache
    group with keys to load, as (group position, load id, plan)."""

    def __init__(self, loads: tuple[tuple[int, int, LoadPlan], ...]) -> None:
        self.loads = loads

    def __repr__(self) -> str:
        parts = ", ".join(f"g{g}: load {i}, {len(p.keys)} keys" for g, i, p in self.loads)
        return f"KvtierLoadSpec({parts})"

@dataclass
class KvtierWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata plus each rank's kvtier results: (rank, group position, kind,
    id, JobResult)."""

    kvtier_results: list[RankResult] = field(default_factory=list)

    def aggregate(self, other: Any) -> Any:
        merged = super().aggregate(other)
        return KvtierWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            kvtier_results=[*self.kvtier_results, *getattr(other, "kvtier_results", ())],
        )
