"""A world of vLLM worker ranks without vLLM, for the adapter's tests: each rank its own store
over its own KV cache and its worker side, and the scheduler side over a manager built from
what the ranks describe. Results reach the scheduler side as vLLM's worker metadata would
carry them (:meth:`World.deliver`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import kvtier
from kvtier.config import load_config
from kvtier.integrations.vllm.engines import _Engine, _SchedulerEngine, rank_tiers
from kvtier.integrations.vllm.ranks import build_manager, describe_rank
from kvtier.integrations.vllm.scheduler_side import _SchedulerSide
from kvtier.integrations.vllm.worker_side import _WorkerSide

BB = 2 * 4 * 8 * 4  # bytes per block of each rank: two (16, 4, 8) float32 tensors
HANG_GUARD = 60.0  # seconds a test waits for a job before it fails


def _kv(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5 + rank)
    return [torch.randn(16, 4, 8, generator=g) + 1000.0 * rank for _ in range(2)]


class World:
    """``world`` ranks (store, KV cache, worker side) and the scheduler side over them."""

    def __init__(self, stores: list[Any], caches: list[list[torch.Tensor]], config: Any) -> None:
        self.world = len(stores)
        self.stores = stores
        self.caches = caches
        self.engines = [_Engine("e", s, rank=r) for r, s in enumerate(stores)]
        self.workers = [_WorkerSide(e) for e in self.engines]
        ranks = {r: describe_rank("e", r, self.world, s, "layout") for r, s in enumerate(stores)}
        self.manager, self.orphans, adopted = build_manager(ranks, config)
        self.adopted = sum(len(keys) for keys in adopted.values())
        self.sched_engine = _SchedulerEngine("e", self.world)
        self.side = _SchedulerSide(self.sched_engine, self.manager)
        for tier, keys in self.orphans.items():
            self.side.ledger.remember(tier, keys)

    def deliver(self, ranks: Any = None) -> None:
        """Every (or these) rank's finished jobs, and their results to the scheduler side."""
        for r in range(self.world) if ranks is None else ranks:
            w = self.workers[r]
            w._transfers.wait(list(w._jobs), timeout=HANG_GUARD)
            w.finished()
            for kind, plan_id, result in w.take_outbox():
                self.side.receive(r, kind, plan_id, result)

    def store(self, keys: list[bytes], blocks: list[int], *, deliver: Any = None) -> None:
        plan = self.side.prepare_store(keys)
        assert plan is not None
        for w in self.workers:
            w.submit_store(1, plan, blocks)
        self.deliver(deliver)
        self.side.complete_store(keys)

    def run_deletes(self) -> int:
        """Ship the scheduler side's deletes to every rank and wait for them; the keys sent."""
        deletes = self.side.take_deletes()
        for w in self.workers:
            kid = w.submit_deletes(deletes)
            if kid is not None:
                w._transfers.wait([kid], timeout=HANG_GUARD)
        return sum(len(k) for _, k in deletes)

    def held(self, rank: int, tier: int = 0) -> int:
        """Blocks rank ``rank`` keeps in ``tier`` (as its backend has them, not the manager)."""
        backend = self.stores[rank].backends[tier]
        return len(backend) if backend.is_memory else sum(1 for _ in backend.scan())

    async def close(self) -> None:
        for s in self.stores:
            await s.aclose()


async def open_world(
    world: int, tiers: list[dict[str, Any]], *, reports_load_errors: bool = True, n: int = 1
) -> World:
    """``n``: engine blocks per record (vLLM's ``blocks_per_chunk``)."""
    cfg = {"tiers": tiers, "job_deadline_s": None, "engine_blocks_per_block": n}
    stores, caches = [], []
    for r in range(world):
        kv = _kv(r)
        stores.append(await kvtier.open(rank_tiers(cfg, r, world), kv_caches=kv))
        caches.append(kv)
    w = World(stores, caches, load_config(rank_tiers(cfg, 0, world), block_bytes=BB * n))
    for e in w.engines:
        e.reports_load_errors = reports_load_errors
    return w


def cpu(blocks: int, world: int) -> dict[str, Any]:
    """A memory tier of ``blocks`` blocks (the config's capacity is the engine's, all ranks)."""
    return {"backend": "cpu", "capacity": blocks * BB * world}


def lmdb(path: Path) -> dict[str, Any]:
    return {"backend": "lmdb", "path": str(path), "capacity": "32MiB"}


