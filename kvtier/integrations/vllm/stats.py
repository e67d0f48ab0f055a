"""kvtier's counters in vLLM's KV connector stats, without vLLM.

vLLM gathers connector stats from every process it runs a connector in: each worker rank's
``get_kv_connector_stats()`` rides in that rank's model-runner output, the executor adds the
ranks' up (``KVOutputAggregator``, with the stats' ``aggregate``), the engine core adds the
scheduler side's own, and the result reaches the front end in ``SchedulerStats``, where vLLM's
stat loggers log it (``KV Transfer metrics: ...``, with ``reduce``) and count it into
Prometheus (``vllm:kvtier_*``, readable with ``LLM.get_metrics()``).

``KvtierConnector`` reports kvtier's counters there as increments since its previous report
(:class:`CounterDeltas`), in vLLM's offloading stats type, so they add up over steps and ranks
exactly like vLLM's own offload counters. Only the counters named in :data:`METRICS` are sent:
vLLM registers a Prometheus metric for each of them (the spec's
``build_metric_definitions``) and refuses a name it has not registered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["METRICS", "PREFIX", "CounterDeltas", "scheduler_counters", "worker_counters"]

#: the prefix of every kvtier metric (vLLM's ``LLM.get_metrics()`` lists ``vllm:`` names only)
PREFIX = "vllm:kvtier_"

#: counter name (without :data:`PREFIX`) -> what it counts, summed over the ranks
METRICS: dict[str, str] = {
    "lookup_hits": "Blocks kvtier's scheduler side found ready in a tier (vLLM lookups).",
    "lookup_misses": "Blocks kvtier's scheduler side did not find ready in any tier.",
    "blocks_loaded": "Block shards loaded into vLLM's KV cache, over all ranks.",
    "blocks_load_failed": "Block shards whose load failed (missing or corrupt record, or given up), over all ranks.",
    "mid_chunk_loads": "Loads that started inside an offloaded chunk, over all ranks.",
    "blocks_stored": "Blocks every rank stored (ready in a tier).",
    "blocks_store_failed": "Blocks whose store failed on some rank (released).",
    "store_rejected": "Store requests the tiers had no room for.",
    "blocks_adopted": "Blocks adopted from persistent tiers at start.",
    "blocks_announced": "Adopted blocks announced to routers as KV events at start.",
    "keys_deleted": "Keys deleted on worker ranks on the scheduler side's word, over all ranks.",
    "submit_failed": "Jobs a rank could not submit (reported failed), over all ranks.",
    "complete_load_unmatched": "vLLM load completions that came before every rank finished the load (it settles when done) or matched no load.",
    "results_missing": "Jobs settled without some rank's kvtier result (counted failed).",
    "results_expired": "Jobs some rank never reported within the result deadline (given up, failed).",
    "jobs_abandoned": "Jobs a rank settled as failed on the scheduler side's notice, over all ranks.",
    "corrupt_records": "Records deleted after a failed checksum, over all ranks.",
    "transfer_jobs": "Transfer jobs submitted, over all ranks.",
    "transfer_failed_jobs": "Transfer jobs that failed, over all ranks.",
    "transfer_bytes_stored": "Bytes copied out of vLLM's KV cache, over all ranks.",
    "transfer_bytes_loaded": "Bytes copied into vLLM's KV cache, over all ranks.",
    "transfer_rejected_jobs": "Transfer jobs refused because their queue was full, over all ranks.",
    "transfer_staging_full": "Store jobs failed because host staging was full, over all ranks.",
    "transfer_cancelled_jobs": "Transfer jobs cancelled, over all ranks.",
    "transfer_expired_jobs": "Transfer jobs past job_deadline_s, over all ranks.",
    "transfer_read_errors": "Tier reads that raised during a load, over all ranks.",
    "transfer_write_through_deferred": "Blocks whose write-through was deferred to write-back, over all ranks.",
}


class CounterDeltas:
    """The increments of a set of counters since the previous :meth:`take`."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, current: Mapping[str, int]) -> dict[str, int]:
        """Counters of :data:`METRICS` that grew since the previous call, by how much."""
        out: dict[str, int] = {}
        for name, value in current.items():
            if name not in METRICS:
                continue
            grown = value - self._last.get(name, 0)
            if grown > 0:
                out[name] = grown
            self._last[name] = value
        return out


def worker_counters(engine: Any) -> dict[str, int]:
    """One worker rank's counters (an ``RankEngine``): its own, its transfer engine's, and the
    corrupt records its tiers found."""
    out = dict(engine.counters)
    transfers = engine.store.transfers
    if transfers is not None:
        out.update((f"transfer_{name}", value) for name, value in transfers.counters.items())
    out["corrupt_records"] = sum(b.counters.corrupt_records for b in engine.store.backends)
    return out


def scheduler_counters(engine: Any) -> dict[str, int]:
    """The scheduler side's counters (a ``SchedulerEngine``)."""
    return dict(engine.counters)
