"""The reference engine: a small, honest model of a paged-attention engine on CPU tensors.

It exists to exercise the connector the way a real engine does, and to check every byte:

- a **block allocator** with a free queue: blocks are handed out from the front, freed blocks go
  to the back (a request's tail first), so the most recently freed are reused last, as in real
  prefix caches; allocating a block evicts its hash from the engine's own prefix cache;
- a **GPU prefix cache** (engine block hash -> block), filled with every block whose slots are
  all computed (or loaded and verified);
- a **scheduler** with chunked prefill under a token budget, decode steps, EOS and ``max_tokens``,
  preemption under memory pressure (newest running request first, recomputed later), and
  optional async-scheduling lag (the newest sampled token is invisible to the connector until
  the next step, as with placeholder tokens);
- a **forward pass** that writes deterministic content into every computed slot: a hash of
  ``(position, prefix hash)`` expanded to the slot's bytes in bf16, differently in each layer
  tensor. The "model" samples the next token from the prefix hash too, so a whole run is a pure
  function of the workload and seed.

Every block a load fills is compared byte for byte with what recomputation writes
(``corrupt_blocks`` must stay 0), and every step checks that no block still read by an
unfinished store job is written (``fence_violations`` must stay 0).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

import kvtier
from kvtier.config import load_config
from kvtier.config.tier_errors import tier_error
from kvtier.connector import (
    SchedulerConnector,
    SchedulerStep,
    StepMetadata,
    WorkerConnector,
    WorkerOutput,
)
from kvtier.errors import ConfigError, KVTierError
from kvtier.keys import Namespace
from kvtier.sim.config import SimConfig, SimReport, make_caches
from kvtier.sim.content import kv_content, mix, prefix_hash
from kvtier.sim.content import sim_namespace as _sim_namespace
from kvtier.sim.state import BlockPool, SimRequest
from kvtier.sim.workloads import Session, make_workload

__all__ = [
    "BlockPool",
    "SimConfig",
    "SimReport",
    "SimRequest",
    "Simulator",
    "kv_content",
    "make_caches",
    "prefix_hash",
    "run_sim",
    "sim_namespace",
]


class Simulator:
    """The engine loop over one :class:`kvtier.KVStore`; drive it with :meth:`run` or :meth:`step`."""

    def __init__(self, store: Any, config: SimConfig, *, worker: WorkerConnector | None = None) -> None:
        self.config = config
        self.store = store
        c = config
        self.caches = store.layout.kv_caches
        self.pool = BlockPool(c.num_gpu_blocks)
        self.connector = SchedulerConnector.from_store(
            store,
            block_size=c.block_size,
            store_last_block_at_finish=c.store_last_block_at_finish,
            promote=c.promote,
        )
        self.worker = worker or WorkerConnector(store.transfers)
        self.block_tokens = c.block_size * c.engine_blocks_per_block
        self.report = SimReport()
        self.step_no = 0
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.loading: dict[str, SimRequest] = {}
        self.delayed: dict[str, SimRequest] = {}  # finished, blocks kept while a load writes
        self._finished_ids: list[str] = []
        self._load_plans: dict[str, tuple[tuple[int, ...], int]] = {}
        self._oracle: set[int] = set()
        self._computed: set[int] = set()  # engine block hashes some step of this run computed
        self._pending: list[
            tuple[int, int, Session, int, list[int], list[int]]
        ] = []  # (due, seq, session, turn, tokens, hashes)
        self._seq = 0
        self._sessions: dict[int, Session] = {}
        self.on_step: Callable[[Simulator], None] | None = None
        self._tier_names = [store.manager.tier_spec(i).name for i in range(store.manager.num_tiers)]
        for name, backend in zip(self._tier_names, store.backends):
            path = getattr(backend, "path", None)
            self.report.tiers.append(
                {"name": name, "backend": backend.name, "capacity_bytes": backend.capacity_bytes, "path": None if path is None else str(path)}
            )
            self.report.loaded_tokens_by_tier[name] = 0  # a tier that served nothing shows 0

    # -- workload --------------------------------------------------------------------------
    def submit(
        self, session: Session, *, turn: int = 0, history: list[int] | None = None, hashes: list[int] | None = None
    ) -> None:
        """Queue ``session``'s turn ``turn`` (its first turn arrives at ``session.start_step``)."""
        tokens = list(history or []) + list(session.turns[turn].message)
        hs = list(hashes or [])
        h = hs[-1] if hs else 0
        for t in tokens[len(hs) :]:
            h = prefix_hash(h, t)
            hs.append(h)
        limit = self.config.num_gpu_blocks * self.config.block_size
        if len(tokens) + session.turns[turn].max_tokens > limit:
            raise ConfigError(
                f"sim: session {session.session_id} turn {turn} needs {len(tokens) + session.turns[turn].max_tokens} "
                f"tokens of KV cache, more than the {limit} the GPU pool holds"
            )
        due = session.start_step if turn == 0 else self.step_no + session.think_steps
        self._seq += 1
        self._pending.append((due, self._seq, session, turn, tokens, hs))

    def _arrivals(self) -> None:
        due = [p for p in self._pending if p[0] <= self.step_no]
        if not due:
            return
        self._pending = [p for p in self._pending if p[0] > self.step_no]
        for _, _, session, turn, tokens, hs in sorted(due, key=lambda p: (p[0], p[1])):
            rid = f"{session.session_id}/t{turn}"
            req = SimRequest(rid, tokens, hs, session.turns[turn].max_tokens, 0, turn)
            req.session = id(session)
            self._sessions[id(session)] = session
            self.waiting.append(req)
            self.report.requests += 1
            self.report.prompt_tokens += len(tokens)

    # -- scheduling ------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _engine_hashes(self, req: SimRequest, blocks: int) -> list[int]:
        b = self.config.block_size
        return [req.hashes[(i + 1) * b - 1] for i in range(blocks)]

    def _preempt(self, victim: SimRequest, preempted: list[str]) -> None:
        self.running.remove(victim)
        self.report.preempted_unfinished_tokens += max(0, victim.admit_len - victim.num_computed_tokens)
        self.pool.free(victim.block_ids)
        victim.block_ids = []
        victim.num_computed_tokens = 0
        victim.hidden = 0
        victim.status = "waiting"
        self.waiting.appendleft(victim)
        preempted.append(victim.request_id)
        self.report.preemptions += 1

    def _admit_hits(self, req: SimRequest) -> tuple[list[int], int]:
        b = self.config.block_size
        if not self.config.prefix_caching:
            return [], 0
        hits = self.pool.lookup(self._engine_hashes(req, (len(req.tokens) - 1) // b))
        return hits, len(hits) * b

    def _oracle_hits(self, req: SimRequest) -> int:
        """Prefix tokens an unbounded cache of every block ever computed would serve."""
        b = self.config.block_size
        oracle = 0
        for h in self._engine_hashes(req, (len(req.tokens) - 1) // b):
            if h not in self._oracle:
                break
            oracle += 1
        return oracle * b

    def _schedule(self) -> tuple[dict[str, int], list[int], list[str]]:
        c = self.config
        budget = c.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        allocated: list[int] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = min(len(req.tokens) - req.num_computed_tokens, budget)
            need = self._blocks_for(req.num_computed_tokens + want) - len(req.block_ids)
            while need > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim, preempted)
                if victim is req:
                    break
            if req.status != "running":
                break
            got = self.pool.allocate(need) if need > 0 else []
            assert got is not None
            req.block_ids.extend(got)
            allocated.extend(got)
            scheduled[req.request_id] = want
            budget -= want
            i += 1
        if preempted:
            return scheduled, allocated, preempted
        skipped: list[SimRequest] = []
        while self.waiting and len(self.running) < c.max_running and budget > 0:
            req = self.waiting.popleft()
            hits, computed = self._admit_hits(req)
            external, is_async = self.connector.get_num_new_matched_tokens(req, computed)
            if external is None:  # the connector asks us to try again next step
                skipped.append(req)
                continue
            if external > 0 and is_async:
                total = computed + external
                need = self._blocks_for(total) - len(hits)
            else:
                want = min(len(req.tokens) - computed, budget)
                need = self._blocks_for(computed + want) - len(hits)
            # Cached hits with no other user sit in the free queue: taking them uses it up too.
            if need + self.pool.count_free(hits) > self.pool.num_free:
                self.waiting.appendleft(req)
                break
            self.pool.take(hits)
            got = self.pool.allocate(need)
            assert got is not None
            req.block_ids = hits + got
            allocated.extend(got)
            req.num_computed_tokens = computed
            if req.admit_len:  # admitted before: readmitted after a preemption
                self.report.reprefill_tokens += len(req.tokens)
            req.admit_len = len(req.tokens)
            self.report.prefill_tokens += len(req.tokens)
            self.report.gpu_hit_tokens += computed
            self.report.oracle_hit_tokens += self._oracle_hits(req)
            self.connector.update_state_after_alloc(req, req.block_ids, external if is_async else 0)
            if external > 0 and is_async:
                req.status = "loading"
                req.load_base = computed
                self.loading[req.request_id] = req
                continue
            req.status = "running"
            self.running.append(req)
            scheduled[req.request_id] = want
            budget -= want
        for req in reversed(skipped):
            self.waiting.appendleft(req)
        return scheduled, allocated, preempted

    # -- the step --------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step: schedule, connector metadata, worker calls, forward, outputs."""
        self.step_no += 1
        self._arrivals()
        scheduled, allocated, preempted = self._schedule()
        finished_ids, self._finished_ids = self._finished_ids, []
        sched_step = SchedulerStep(self.step_no, scheduled, tuple(allocated), tuple(finished_ids), tuple(preempted))
        meta = self.connector.build_connector_meta(sched_step)
        # Scheduler and workers talk bytes, as they would across processes.
        wmeta = StepMetadata.from_bytes(meta.to_bytes())
        for load in wmeta.loads:
            self._load_plans[load.request_id] = (load.plan.tiers, load.job_id)
        self.worker.handle_preemptions(wmeta)
        self.worker.start_load_kv(wmeta)
        written = self._written_blocks(scheduled, wmeta)
        if written:
            reading = self.worker.unfinished_store_blocks(exclude_step=self.step_no, exclude_requests=scheduled)
            self.report.fence_violations += len(written & reading)
        finished = self._forward(scheduled)
        out = self.worker.get_finished(block=self.config.wait_for_transfers)
        update = self.connector.update_connector_output(WorkerOutput.from_bytes(out.to_bytes()))
        for rid, valid in update.loaded.items():
            self._load_done(rid, valid)
        for rid in update.freed:
            req = self.delayed.pop(rid, None)
            if req is not None:
                self.pool.free(req.block_ids)
                req.block_ids = []
        for req in finished:
            self._finish(req)
        self.report.steps = self.step_no
        if self.on_step is not None:
            self.on_step(self)

    def _written_blocks(self, scheduled: Mapping[str, int], meta: StepMetadata) -> set[int]:
        """Engine blocks this step's compute and loads write (a load's rewrite of blocks the
        engine already holds with the same bytes excluded)."""
        b = self.config.block_size
        out: set[int] = set()
        by_id = {r.request_id: r for r in self.running}
        for rid, count in scheduled.items():
            req = by_id[rid]
            first = req.num_computed_tokens // b
            last = (req.num_computed_tokens + count - 1) // b
            out.update(req.block_ids[first : last + 1])
        for load in meta.loads:
            loading = self.loading.get(load.request_id)
            held = set(loading.block_ids[: loading.load_base // b]) if loading is not None else set()
            out.update(x for x in load.block_ids if x not in held)
        return out

    def _forward(self, scheduled: Mapping[str, int]) -> list[SimRequest]:
        c = self.config
        b = c.block_size
        if not scheduled:
            return []
        by_id = {r.request_id: r for r in self.running}
        slots: list[int] = []
        seeds: list[int] = []
        finished: list[SimRequest] = []
        newly_full: list[tuple[SimRequest, int, int]] = []
        for rid, count in scheduled.items():
            req = by_id[rid]
            start = req.num_computed_tokens
            for p in range(start, start + count):
                slots.append(req.block_ids[p // b] * b + p % b)
                seeds.append(req.hashes[p])
            prefill = max(0, min(start + count, req.admit_len) - start)
            self.report.recomputed_tokens += prefill
            self.report.decode_tokens += count - prefill
            req.num_computed_tokens = start + count
            for blk in range(start // b, (start + count) // b):
                newly_full.append((req, blk, req.hashes[(blk + 1) * b - 1]))
        idx = torch.tensor(slots, dtype=torch.int64)
        seed_t = torch.tensor(seeds, dtype=torch.int64)
        for layer, cache in enumerate(self.caches):
            cache.view(-1, c.width).index_copy_(0, idx, kv_content(seed_t, layer, c.width))
        for req, blk, h in newly_full:
            self.pool.cache(req.block_ids[blk], h)
            self._oracle.add(h)
            self._computed.add(h)
        # Sample: a request whose every known token is computed produces the next one.
        for rid in scheduled:
            req = by_id[rid]
            if req.num_computed_tokens < len(req.tokens):
                continue
            h = req.hashes[-1]
            r = mix(h ^ 0x5EED)
            token = c.eos_token if r % c.answer_mean == 0 else 3 + (r >> 8) % (c.vocab_size - 3)
            req.tokens.append(token)
            req.hashes.append(prefix_hash(h, token))
            req.num_output += 1
            req.hidden = 1 if c.async_scheduling else 0
            if token == c.eos_token or req.num_output >= req.max_tokens:
                finished.append(req)
        return finished

    def _finish(self, req: SimRequest) -> None:
        self.running.remove(req)
        req.status = "finished"
        req.hidden = 0  # the finished request's whole output is known
        delay, _ = self.connector.request_finished(req, req.block_ids)
        if delay:
            self.delayed[req.request_id] = req
        else:
            self.pool.free(req.block_ids)
            req.block_ids = []
        self._finished_ids.append(req.request_id)
        session = self._sessions[req.session]
        if req.turn + 1 < len(session.turns):
            self.submit(session, turn=req.turn + 1, history=req.tokens, hashes=req.hashes)

    def _load_done(self, rid: str, valid: int) -> None:
        req = self.loading.pop(rid, None)
        if req is None:
            return
        c = self.config
        b = c.block_size
        bt = self.block_tokens
        tiers, _ = self._load_plans.pop(rid, ((), 0))
        first_block = req.load_base // bt
        valid = min(valid, len(req.tokens) - 1)
        loaded = max(0, valid - req.load_base)
        self.report.loaded_tokens += loaded
        # Attribute loaded tokens to the tier each offloaded block came from.
        for i, tier in enumerate(tiers):
            lo = max((first_block + i) * bt, req.load_base)
            hi = min((first_block + i + 1) * bt, valid)
            if hi > lo:
                name = self._tier_names[tier]
                self.report.loaded_tokens_by_tier[name] = self.report.loaded_tokens_by_tier.get(name, 0) + hi - lo
        # Check every engine block the load filled against what recomputation writes.
        for blk in range(first_block * c.engine_blocks_per_block, valid // b):
            if not self._verify_block(req, blk):
                self.report.corrupt_blocks += 1
            self.report.verified_blocks += 1
        for blk in range(req.load_base // b, valid // b):
            h = req.hashes[(blk + 1) * b - 1]
            self.pool.cache(req.block_ids[blk], h)
            self._oracle.add(h)
            if h not in self._computed:
                self.report.earlier_process_tokens += b
        req.num_computed_tokens = max(req.load_base, valid)
        # Keep the blocks allocated for the load; compute resumes from the first invalid token.
        req.status = "running"
        self.running.append(req)

    def _verify_block(self, req: SimRequest, blk: int) -> bool:
        c = self.config
        b = c.block_size
        seeds = torch.tensor(req.hashes[blk * b : (blk + 1) * b], dtype=torch.int64)
        engine_block = req.block_ids[blk]
        for layer, cache in enumerate(self.caches):
            want = kv_content(seeds, layer, c.width).view(torch.int16)
            got = cache[engine_block].reshape(b, c.width).view(torch.int16)
            if not torch.equal(want, got):
                return False
        return True

    # -- driving ---------------------------------------------------------------------------
    def idle(self) -> bool:
        return not (self._pending or self.waiting or self.running or self.loading or self.delayed)

    def run(self, sessions: list[Session]) -> SimReport:
        """Run every session to completion, then drain the connector."""
        started = time.perf_counter()
        for s in sessions:
            self.submit(s)
        while not self.idle():
            if self.step_no >= self.config.max_steps:
                raise RuntimeError(f"sim: no progress after {self.step_no} steps")
            self.step()
        # Idle steps (nothing scheduled) until every job is acknowledged: what an engine's
        # loop does while the connector still has work.
        for _ in range(1000):
            if not (self.connector.has_pending_work() or self.worker.num_unsubmitted or self.worker.num_in_flight):
                break
            self.step()
            if not self.config.wait_for_transfers:
                time.sleep(0.001)
        self._collect()
        self.report.seconds = time.perf_counter() - started
        return self.report

    def _collect(self) -> None:
        r = self.report
        k = self.connector.counters
        r.bytes_stored = k["bytes_stored"]
        r.bytes_loaded = k["bytes_loaded"]
        r.stored_blocks = k["store_blocks"] - k["store_failed_blocks"]
        r.last_block_jobs = k["last_block_jobs"]
        r.flushed_jobs = k["flushed_jobs"]
        r.deferred_lookups = k["deferred_lookups"]
        r.load_missed_blocks = k["load_missed_blocks"]
        r.live_request_states = self.connector.num_request_states
        r.live_jobs = self.connector.num_jobs + self.worker.num_unsubmitted + self.worker.num_in_flight
        r.fenced_blocks = self.connector.num_fenced_blocks
        for tier, backend in zip(r.tiers, self.store.backends):
            # A tier with a server (redis) counts its outages; the run goes on without it, so
            # the report says so rather than leaving the operator to guess from the hits.
            stats = backend.stats()
            if stats.get("outages"):
                tier["outages"] = int(stats["outages"])
                tier["up_at_end"] = bool(stats.get("up", True))
            failed = int(stats.get("write_failures", 0))
            if failed:
                tier["write_failures"] = failed



def sim_namespace(config: SimConfig, kv_layout: str) -> Namespace:
    """The namespace of a run of ``config`` over a KV layout with fingerprint ``kv_layout``."""
    return _sim_namespace(config.block_size, kv_layout)


def _all_keys(backend: Any) -> list[bytes]:
    return [r.key for r in backend.scan()]


async def _empty_persistent(cfg: Mapping[str, Any], caches: list[torch.Tensor], namespace: Namespace) -> int:
    """Delete every record of ``cfg``'s persistent tiers; returns how many. Each tier is opened
    on its own with the simulator's format, so its namespace check runs before anything goes."""
    shell = kvtier.KVStore(load_config(cfg), kv_caches=caches, namespace=namespace)  # builds backends, no I/O
    removed = 0
    for i, backend in enumerate(shell.backends):
        if not backend.persistent:
            continue
        try:
            await backend.open(shell.format)
        except KVTierError as exc:
            raise tier_error(i, backend, exc) from exc
        try:
            keys = await asyncio.to_thread(_all_keys, backend)
            if keys:
                await backend.delete(keys)
            removed += len(keys)
        finally:
            await backend.aclose()
    return removed


def run_sim(
    store_config: Mapping[str, Any],
    *,
    workload: str = "chat",
    requests: int = 48,
    seed: int = 0,
    sim: SimConfig | None = None,
    on_step: Callable[[Simulator], None] | None = None,
    empty_persistent: bool = False,
) -> SimReport:
    """Open a store from ``store_config``, run ``workload`` on the reference engine, close it.

    ``empty_persistent`` first deletes every record of the persistent tiers (in the
    simulator's namespace only: a tier written for another namespace fails to open, untouched),
    so hits are this run's own and never exceed the oracle.
    """
    sim = sim or SimConfig()
    sessions = make_workload(workload, requests=requests, seed=seed, vocab=sim.vocab_size)
    cfg = dict(store_config)
    cfg["engine_blocks_per_block"] = sim.engine_blocks_per_block
    caches = make_caches(sim)
    layout = kvtier.KVLayout(caches, engine_blocks_per_block=sim.engine_blocks_per_block)
    namespace = sim_namespace(sim, layout.fingerprint())

    async def _open() -> Any:
        return await kvtier.open(cfg, kv_caches=caches, namespace=namespace)

    loop = asyncio.new_event_loop()
    try:
        emptied = loop.run_until_complete(_empty_persistent(cfg, caches, namespace)) if empty_persistent else 0
        store = loop.run_until_complete(_open())
        try:
            engine = Simulator(store, sim)
            engine.on_step = on_step
            report = engine.run(sessions)
            report.workload = workload
            report.emptied_records = emptied
        finally:
            loop.run_until_complete(store.aclose())
    finally:
        loop.close()
    return report
