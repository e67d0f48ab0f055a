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
from kvtier.integrations.vllm.deadlines import Abandoned, ResultDeadlines
from kvtier.integrations.vllm.engines import RankEngine, SchedulerEngine, rank_tiers
from kvtier.integrations.vllm.ranks import build_manager, describe_rank
from kvtier.integrations.vllm.replicated import WRITER_RANK, namespace_rank, shared_tiers
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.integrations.vllm.worker_side import WorkerSide
from kvtier.keys import Namespace

BB = 2 * 4 * 8 * 4  # bytes per block of each rank: two (16, 4, 8) float32 tensors
HANG_GUARD = 60.0  # seconds a test waits for a job before it fails


def _kv(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5 + rank)
    return [torch.randn(16, 4, 8, generator=g) + 1000.0 * rank for _ in range(2)]


class VllmJobs:
    """vLLM's own count of a job's completions over the ranks (its offloading scheduler's
    ``update_connector_output``): a job is settled (``complete_store`` / ``complete_load``)
    once every rank counted it; a count for a job it no longer has is a ``KeyError`` and one
    past the number of ranks an ``AssertionError``, as in vLLM 0.32."""

    def __init__(self, world: int, side: SchedulerSide) -> None:
        self.world = world
        self.side = side
        self.pending: dict[int, tuple[str, list[bytes], int]] = {}
        self.dropped: set[int] = set()  # jobs of requests vLLM dropped: their counts are ignored

    def add(self, job_id: int, kind: str, keys: list[bytes]) -> None:
        self.pending[job_id] = (kind, keys, self.world)

    def drop(self, job_id: int) -> None:
        """vLLM forgets job ``job_id`` (its request was aborted): it never completes it."""
        self.pending.pop(job_id, None)
        self.dropped.add(job_id)

    def count(self, counts: dict[int, int]) -> None:
        for job_id, n in counts.items():
            if job_id in self.dropped:
                continue
            kind, keys, left = self.pending[job_id]
            left -= n
            assert left >= 0, f"job {job_id} counted past the number of ranks"
            if left:
                self.pending[job_id] = (kind, keys, left)
                continue
            del self.pending[job_id]
            if kind == "store":
                self.side.complete_store(keys)
            else:
                self.side.complete_load(keys)


class World:
    """``world`` ranks (store, KV cache, worker side) and the scheduler side over them."""

    def __init__(
        self,
        stores: list[Any],
        caches: list[list[torch.Tensor]],
        config: Any,
        *,
        deadline_s: float = 30.0,
        shared: frozenset[int] = frozenset(),
    ) -> None:
        self.world = len(stores)
        self.stores = stores
        self.caches = caches
        self.engines = [
            RankEngine("e", s, rank=r, skip_tiers=shared if r != WRITER_RANK else frozenset()) for r, s in enumerate(stores)
        ]
        self.workers = [WorkerSide(e) for e in self.engines]
        ranks = {r: describe_rank("e", r, self.world, s, "layout") for r, s in enumerate(stores)}
        self.manager, self.orphans, adopted = build_manager(ranks, config)
        self.adopted = sum(len(keys) for keys in adopted.values())
        self.sched_engine = SchedulerEngine("e", self.world)
        self.now = 0.0  # the scheduler side's clock (seconds), moved by the tests
        deadlines = ResultDeadlines(self.world, deadline_s, clock=lambda: self.now)
        self.side = SchedulerSide(self.sched_engine, self.manager, deadlines)
        self.vllm = VllmJobs(self.world, self.side)
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

    def store(self, keys: list[bytes], blocks: list[int], *, deliver: Any = None, tenant: str | None = None) -> None:
        plan = self.side.prepare_store(keys, tenant)
        assert plan is not None
        for w in self.workers:
            w.submit_store(1, plan, blocks)
        self.deliver(deliver)
        self.side.complete_store(keys)

    def load(self, keys: list[bytes], blocks: list[int]) -> set[int]:
        """Load ``keys`` into ``blocks`` on every rank, settled; the ranks' load-error blocks."""
        load_id, plan = self.side.prepare_load(keys)
        for w in self.workers:
            w.submit_load(2, load_id, plan, blocks)
        self.deliver()
        self.side.complete_load(keys)
        return set().union(*(w.take_failed_block_ids() for w in self.workers))

    def issue_store(self, job_id: int, keys: list[bytes], blocks: list[int], ranks: Any = None) -> Any:
        """vLLM hands store job ``job_id`` to every rank; only ``ranks`` (default all) get it
        (a rank that lost it never reports it)."""
        plan = self.side.prepare_store(keys)
        assert plan is not None and plan.keys
        self.vllm.add(job_id, "store", list(plan.keys))
        self.side.deadlines.issued(job_id, "store", plan.plan_id)
        for r in range(self.world) if ranks is None else ranks:
            self.workers[r].submit_store(job_id, plan, blocks)
        return plan

    def issue_load(
        self, job_id: int, keys: list[bytes], blocks: list[int], ranks: Any = None, request_id: str | None = None
    ) -> Any:
        load_id, plan = self.side.prepare_load(keys, request_id)
        self.vllm.add(job_id, "load", list(keys))
        self.side.deadlines.issued(job_id, "load", load_id, tuple(blocks))
        for r in range(self.world) if ranks is None else ranks:
            self.workers[r].submit_load(job_id, load_id, plan, blocks)
        return plan

    def step(self, ranks: Any = None, notices: tuple[Abandoned, ...] = (), lost: Any = ()) -> set[int]:
        """One engine step as ``KvtierConnector`` runs it: every rank (or only ``ranks``, the
        others silent) settles ``notices`` and reports its finished jobs (waited for); the
        scheduler side takes the results and passes the counts it allows to vLLM's count. The
        kvtier results of the ranks in ``lost`` are lost on the way (their counts arrive).
        Returns the union of the ranks' load-error block ids (what vLLM recomputes)."""
        counts: dict[int, int] = {}
        results = []
        bad: set[int] = set()
        for r in range(self.world) if ranks is None else ranks:
            w = self.workers[r]
            w.abandon(notices)
            w._transfers.wait(list(w._jobs), timeout=HANG_GUARD)
            for job_id, _success, _nbytes, _seconds in w.finished():
                counts[job_id] = counts.get(job_id, 0) + 1
            mine = [(r, kind, plan_id, result) for kind, plan_id, result in w.take_outbox()]
            results += [] if r in lost else mine
            bad |= w.take_failed_block_ids()
            w.take_failed_loads()  # KvtierConnector.get_transfer_results, every step
        self.vllm.count(self.side.worker_output(results, counts))
        self.manager.take_events()  # vLLM's scheduler takes the connector's KV events every step
        return bad

    def run_deletes(self) -> int:
        """Ship the scheduler side's deletes (and its tenant tags and pins, as the connector
        does) to every rank and wait for them; the keys sent to delete."""
        deletes = self.side.take_deletes()
        tags = self.side.take_tags()
        for w in self.workers:
            kid = w.submit_deletes(deletes, tags)
            if kid is not None:
                w._transfers.wait([kid], timeout=HANG_GUARD)
        return sum(len(k) for _, k in deletes)

    def idle(self) -> dict[str, int]:
        """What the scheduler side still holds: its tables, pins, pending keys, vLLM's open jobs;
        and what the ranks hold: jobs not reported, load errors not taken, transfer records
        (all 0 on an idle engine)."""
        tiers = self.manager.stats()["tiers"]
        out = dict(self.side.table_sizes())
        out["pins"] = sum(t["pinned"] for t in tiers)
        out["pending"] = sum(t["pending"] for t in tiers)
        out["vllm_jobs"] = len(self.vllm.pending)
        out["worker_jobs"] = sum(len(w._jobs) for w in self.workers)
        out["worker_unreported"] = sum(len(w._refused) + len(w._engine.outbox) for w in self.workers)
        out["worker_failed_loads"] = sum(len(w._failed_blocks) + len(w._failed_loads) for w in self.workers)
        out["transfer_jobs"] = sum(len(w._transfers._jobs) + len(w._transfers._finished) for w in self.workers)
        return out

    def held(self, rank: int, tier: int = 0) -> int:
        """Blocks rank ``rank`` keeps in ``tier`` (as its backend has them, not the manager)."""
        backend = self.stores[rank].backends[tier]
        return len(backend) if backend.is_memory else sum(1 for _ in backend.scan())

    async def close(self) -> None:
        """Shut every rank down as vLLM does (the worker's ``shutdown``: its store closes)."""
        for w in self.workers:
            await w.close()


def count_writes(w: World, tier: int) -> list[int]:
    """Blocks each rank writes to ``tier`` from now on (a list filled as they write)."""
    written = [0] * w.world
    for r in range(w.world):
        backend = w.stores[r].backends[tier]
        real = backend.write_blocks

        def counted(keys: Any, blocks: Any, r: int = r, real: Any = real) -> Any:
            written[r] += len(keys)
            return real(keys, blocks)

        backend.write_blocks = counted
    return written


async def open_world(
    world: int,
    tiers: list[dict[str, Any]],
    *,
    reports_load_errors: bool = True,
    n: int = 1,
    deadline_s: float = 30.0,
    replicated: bool = False,
    write: str = "through",
    metrics: dict[str, Any] | None = None,
    tenants: dict[str, Any] | None = None,
) -> World:
    """``n``: engine blocks per record (vLLM's ``blocks_per_chunk``); ``deadline_s``: the
    scheduler side's deadline for every rank's result of a job (on the world's clock);
    ``replicated``: every rank's KV cache holds the same bytes (MLA), and the tiers all ranks
    share keep one copy; ``write``: the store's write mode; ``metrics``: the engine's
    ``metrics`` settings."""
    cfg: dict[str, Any] = {"tiers": tiers, "job_deadline_s": None, "engine_blocks_per_block": n, "write": write}
    if metrics is not None:
        cfg["metrics"] = metrics
    if tenants is not None:
        cfg["tenants"] = tenants
    shared = shared_tiers(cfg) if replicated else frozenset()
    stores, caches = [], []
    for r in range(world):
        kv = _kv(0 if replicated else r)
        # Each rank's records carry its namespace, as under vLLM (the TP rank is in it).
        ns = Namespace.from_dict({"model_id": "m", "tp_rank": namespace_rank(r, replicated), "tp_size": world})
        stores.append(await kvtier.open(rank_tiers(cfg, r, world, shared=shared), kv_caches=kv, namespace=ns))
        caches.append(kv)
    config = load_config(rank_tiers(cfg, 0, world, shared=shared), block_bytes=BB * n)
    w = World(stores, caches, config, deadline_s=deadline_s, shared=shared)
    for e in w.engines:
        e.reports_load_errors = reports_load_errors
    return w


def cpu(blocks: int, world: int) -> dict[str, Any]:
    """A memory tier of ``blocks`` blocks (the config's capacity is the engine's, all ranks)."""
    return {"backend": "cpu", "capacity": blocks * BB * world}


def lmdb(path: Path) -> dict[str, Any]:
    return {"backend": "lmdb", "path": str(path), "capacity": "32MiB"}


