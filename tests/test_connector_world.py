"""Connector with ``world_size=2``: each worker holds its own shard of every block under the same
keys in its own tiers, and a job that fails on one rank only must not leave the other rank's
bytes behind (``StepMetadata.deletes``).

Every rank has its own store (tiers, transfer engine) and its own KV cache; the scheduler side
uses rank 0's manager. Each rank's compute writes different values, so a byte-exact load also
proves that every rank got its own shard back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import torch

import kvtier
from kvtier.connector import (
    ConnectorConfig,
    ConnectorError,
    ConnectorUpdate,
    JobReport,
    SchedulerConnector,
    SchedulerStep,
    StepMetadata,
    WorkerConnector,
    WorkerOutput,
)
from kvtier.keys import Namespace, block_keys

BLOCK = 4  # tokens per engine block (= one offloaded block)
NUM_BLOCKS = 32
WIDTH = 8
SLOT = 2 * BLOCK * WIDTH * 4  # bytes per block: K and V, float32
CPU4 = {"backend": "cpu", "capacity": 4 * SLOT}  # a memory tier of exactly 4 slots


@dataclass
class Req:
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)


def _value(block: int, rank: int, salt: float) -> float:
    return salt + block + 1000.0 * rank


class World:
    """The scheduler half plus ``world`` worker halves, each over its own store and cache."""

    def __init__(self, tiers: list[dict[str, Any]], *, world: int = 2, write: str = "back", **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.namespace = Namespace(model_id="world-test", block_size=BLOCK)
        self.caches: list[list[torch.Tensor]] = []
        self.stores: list[kvtier.KVStore] = []
        for _ in range(world):
            caches = [torch.zeros((NUM_BLOCKS, BLOCK, WIDTH), dtype=torch.float32) for _ in range(2)]
            cfg = {"tiers": [dict(t) for t in tiers], "write": write}
            self.stores.append(
                self.loop.run_until_complete(kvtier.open(cfg, kv_caches=caches, namespace=self.namespace))
            )
            self.caches.append(caches)
        self.manager = self.stores[0].manager
        self.sched = SchedulerConnector(
            self.manager, self.namespace, ConnectorConfig(block_size=BLOCK, world_size=world, **options)
        )
        self.workers = [WorkerConnector(s.transfers, rank=r) for r, s in enumerate(self.stores)]
        self.step_no = 0
        self.metas: list[StepMetadata] = []

    def close(self) -> None:
        for s in self.stores:
            self.loop.run_until_complete(s.aclose())
        self.loop.close()

    # -- engine side -----------------------------------------------------------------------
    def backend(self, rank: int, tier: int = 0) -> Any:
        return self.stores[rank].backends[tier]

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        return block_keys(list(tokens), block_size=BLOCK, namespace=self.namespace)

    def fill(self, blocks: Sequence[int], salt: float) -> None:
        """Each rank's compute writes its own shard of ``blocks``."""
        for rank, caches in enumerate(self.caches):
            for b in blocks:
                for c in caches:
                    c[b].fill_(_value(b, rank, salt))

    def step(
        self,
        scheduled: dict[str, int] | None = None,
        *,
        allocated: Sequence[int] = (),
        finished: Sequence[str] = (),
        compute: Callable[[], object] | None = None,
    ) -> ConnectorUpdate:
        self.step_no += 1
        step = SchedulerStep(self.step_no, scheduled or {}, tuple(allocated), tuple(finished))
        meta = StepMetadata.from_bytes(self.sched.build_connector_meta(step).to_bytes())
        self.metas.append(meta)
        for w in self.workers:
            w.handle_preemptions(meta)
            w.start_load_kv(meta)
        if compute is not None:
            compute()
        outs = [WorkerOutput.from_bytes(w.get_finished(block=True).to_bytes()) for w in self.workers]
        return self.sched.update_connector_output(outs)

    def drain(self) -> None:
        for _ in range(10):
            if not self.sched.has_pending_work() and not any(w.num_unsubmitted for w in self.workers):
                return
            self.step()
        raise AssertionError("the connector did not drain")

    def store(self, rid: str, tokens: list[int], blocks: list[int], salt: float, *, drain: bool = True) -> Req:
        """A request computes ``tokens`` in one step and finishes; its full blocks are stored."""
        req = Req(rid, tokens)
        self.sched.get_num_new_matched_tokens(req, 0)  # whatever is offered, it is computed
        req.block_ids = list(blocks)
        self.sched.update_state_after_alloc(req, req.block_ids, 0)
        full = blocks[: len(tokens) // BLOCK]
        self.step({rid: len(tokens)}, allocated=blocks, compute=lambda: self.fill(full, salt))
        req.num_computed_tokens = len(tokens)
        self.sched.request_finished(req, req.block_ids)
        if drain:
            self.step(finished=[rid])
            self.drain()
        return req

    def load(self, rid: str, tokens: list[int], blocks: list[int]) -> tuple[int, ConnectorUpdate]:
        """Admit a request over ``tokens`` that loads what kvtier holds into ``blocks``."""
        req = Req(rid, tokens)
        ext, is_async = self.sched.get_num_new_matched_tokens(req, 0)
        assert ext and is_async
        req.block_ids = list(blocks)
        self.sched.update_state_after_alloc(req, req.block_ids, ext)
        update = self.step(allocated=blocks)
        self.sched.request_finished(req, req.block_ids)
        return ext, update

    def assert_loaded(self, blocks: Sequence[int], sources: Sequence[int], salt: float) -> None:
        """Every rank's ``blocks`` hold that rank's shard of the blocks computed in ``sources``."""
        for rank, caches in enumerate(self.caches):
            for dst, src in zip(blocks, sources):
                want = torch.full((BLOCK, WIDTH), _value(src, rank, salt))
                for c in caches:
                    assert torch.equal(c[dst], want), (rank, dst, src)

    def holds(self, rank: int, keys: Sequence[bytes], tier: int = 0) -> list[bool]:
        backend = self.backend(rank, tier)
        row = torch.empty(backend.format.block_bytes, dtype=torch.uint8)
        return [backend.read_blocks([k], [row])[0] for k in keys]


def _break_reserve(backend: Any) -> Callable[[], None]:
    """Make a memory tier refuse every reservation (the store job fails on that rank)."""
    backend.reserve = lambda keys: None
    return lambda: delattr(backend, "reserve")


def _fail_writes_of(backend: Any, bad: set[bytes]) -> Callable[[], None]:
    """Make a byte tier fail the writes of ``bad`` keys (and store nothing for them)."""
    write = backend.write_blocks

    def failing(keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        keep = [i for i, k in enumerate(keys) if k not in bad]
        got = write([keys[i] for i in keep], [blocks[i] for i in keep])
        out: list[int | None] = [None] * len(keys)
        for i, size in zip(keep, got):
            out[i] = size
        return out

    backend.write_blocks = failing
    return lambda: delattr(backend, "write_blocks")


TOKENS_A = list(range(100, 109))  # two full blocks (and one token of a third)
TOKENS_B = [*TOKENS_A[:8], *range(200, 209)]  # A's two blocks, then two more


def test_store_failed_on_one_rank_is_deleted_on_the_other_and_its_slots_come_back() -> None:
    w = World([CPU4])
    try:
        keys = w.keys(TOKENS_A)[:2]
        undo = _break_reserve(w.backend(1))
        w.store("a", TOKENS_A, [1, 2, 3], salt=0.0)  # built, submitted, acknowledged by both ranks
        undo()
        assert w.manager.lookup(keys) == 0
        assert w.sched.counters["store_failed_blocks"] == 2
        # Rank 1's job failed; rank 0 wrote both blocks: shipped as deletes, run on rank 0.
        (deletes,) = [m.deletes for m in w.metas if m.deletes]
        assert deletes == ((0, tuple(sorted(keys))),)
        assert len(w.backend(0)) == 0 and len(w.backend(1)) == 0
        assert w.holds(0, keys) == [False, False]
        assert w.sched.num_pending_deletes == 0 and not w.sched.has_pending_work()
        assert w.workers[0].counters["deleted_keys"] == 2 and w.workers[0].num_deletes_in_flight == 0
        # All four slots are free again on rank 0: a store that needs every one of them (A's two
        # keys again, then two more) succeeds on both ranks. With the leak, rank 0's reserve
        # would fail ("accounting is off").
        w.store("b", TOKENS_B, [4, 5, 6, 7, 8], salt=10.0)
        keys_b = w.keys(TOKENS_B)[:4]
        assert keys_b[:2] == keys
        assert w.manager.lookup(keys_b) == 4
        assert w.sched.counters["store_failed_blocks"] == 2
        assert len(w.backend(0)) == 4 and len(w.backend(1)) == 4
        ext, update = w.load("c", [*TOKENS_B[:16], 1], [20, 21, 22, 23, 24])
        assert ext == 16 and update.loaded == {"c": 16}
        w.assert_loaded([20, 21, 22, 23], [4, 5, 6, 7], salt=10.0)
        w.drain()
        assert (w.sched.num_jobs, w.sched.num_request_states) == (0, 0)
    finally:
        w.close()


def test_key_failed_in_a_byte_tier_on_one_rank_is_deleted_on_the_other() -> None:
    w = World([{"backend": "compressed", "capacity": "1MiB"}])
    try:
        keys = w.keys(TOKENS_A)[:2]
        undo = _fail_writes_of(w.backend(1), {keys[1]})
        w.store("a", TOKENS_A, [1, 2, 3], salt=0.0, drain=False)
        w.step(finished=["a"])  # the store runs and is acknowledged: key 1 failed on rank 1
        undo()
        assert w.manager.lookup(keys) == 1 and w.sched.num_jobs == 0
        assert w.sched.num_pending_deletes == 1
        assert w.holds(0, keys) == [True, True]  # the orphan, until the next step
        meta_no = len(w.metas)
        w.step()
        assert w.metas[meta_no].deletes == ((0, (keys[1],)),)
        assert w.holds(0, keys) == [True, False] and w.holds(1, keys) == [True, False]
        assert len(w.backend(0)) == 1
        # The same tokens again: key 0 is skipped, key 1 is stored on both ranks.
        w.store("b", TOKENS_A, [4, 5, 6], salt=20.0)
        assert w.manager.lookup(keys) == 2
        assert w.holds(0, keys) == [True, True] and w.holds(1, keys) == [True, True]
        ext, update = w.load("c", [*TOKENS_A[:8], 7], [10, 11, 12])
        assert ext == 8 and update.loaded == {"c": 8}
        w.assert_loaded([10], [1], salt=0.0)
        w.assert_loaded([11], [5], salt=20.0)
    finally:
        w.close()


def test_key_missed_by_a_load_on_one_rank_is_deleted_on_the_other() -> None:
    w = World([CPU4])
    try:
        w.store("a", TOKENS_A, [1, 2, 3], salt=0.0)
        keys = w.keys(TOKENS_A)[:2]
        assert w.manager.lookup(keys) == 2 and len(w.backend(0)) == 2 and len(w.backend(1)) == 2
        w.backend(1).delete_blocks([keys[1]])  # rank 1's copy vanishes behind the manager's back
        ext, update = w.load("r", [*TOKENS_A[:8], 5], [10, 11, 12])
        assert ext == 8 and update.loaded == {"r": 4}  # block 1 is recomputed
        assert w.manager.lookup(keys) == 1
        assert w.holds(0, keys) == [True, True]
        w.step()
        assert w.metas[-1].deletes == ((0, (keys[1],)),)
        assert w.holds(0, keys) == [True, False] and len(w.backend(0)) == 1
        # Stored again from a fresh compute, on both ranks; then loaded byte for byte.
        w.store("b", TOKENS_A, [4, 5, 6], salt=30.0)
        assert w.manager.lookup(keys) == 2
        assert w.holds(0, keys) == [True, True] and w.holds(1, keys) == [True, True]
        ext, update = w.load("c", [*TOKENS_A[:8], 6], [20, 21, 22])
        assert ext == 8 and update.loaded == {"c": 8}
        w.assert_loaded([20], [1], salt=0.0)
        w.assert_loaded([21], [5], salt=30.0)
    finally:
        w.close()


def test_delete_runs_before_a_restore_of_the_same_keys_built_in_the_same_step() -> None:
    """The step that ships the delete also builds a new store of the same keys. The worker runs
    the delete first; were it run after the step's stores, rank 0 would lose the new copies."""
    w = World([CPU4])
    try:
        keys = w.keys(TOKENS_A)[:2]
        undo = _break_reserve(w.backend(1))
        w.store("a", TOKENS_A, [1, 2, 3], salt=0.0, drain=False)
        w.step(finished=["a"])
        undo()
        assert w.manager.lookup(keys) == 0 and w.sched.num_pending_deletes == 2
        assert len(w.backend(0)) == 2  # rank 0's copies of the failed store
        # In one step: the delete of those keys and a store of the same keys from a new request.
        w.store("b", TOKENS_A, [4, 5, 6], salt=40.0, drain=False)
        meta = w.metas[-1]
        assert meta.deletes == ((0, tuple(sorted(keys))),)
        assert [j.plan.keys for j in meta.stores] == [tuple(keys)]
        w.step(finished=["b"])  # b's store runs now, after the delete
        w.drain()
        assert w.manager.lookup(keys) == 2
        assert len(w.backend(0)) == 2 and len(w.backend(1)) == 2
        ext, update = w.load("c", [*TOKENS_A[:8], 1], [20, 21, 22])
        assert ext == 8 and update.loaded == {"c": 8}
        w.assert_loaded([20, 21], [4, 5], salt=40.0)
    finally:
        w.close()


def test_engine_without_step_loop_runs_the_delete_before_the_restore_in_one_metadata() -> None:
    """``build_immediate_meta`` ships the delete and the new store of the same keys together;
    ``run_now`` must submit the delete first."""
    w = World([CPU4], step_loop=False)
    try:
        keys = w.keys(TOKENS_A)[:2]

        def finish_now(rid: str, blocks: list[int], salt: float) -> StepMetadata:
            req = Req(rid, TOKENS_A, num_computed_tokens=len(TOKENS_A), block_ids=blocks)
            w.fill(blocks[:2], salt)
            w.sched.get_num_new_matched_tokens(req, 0)
            w.sched.update_state_after_alloc(req, blocks, 0)
            w.sched.request_finished(req, blocks)
            meta = StepMetadata.from_bytes(w.sched.build_immediate_meta().to_bytes())
            w.sched.update_connector_output([wk.run_now(meta) for wk in w.workers])
            w.sched.update_connector_output([wk.get_finished(block=True) for wk in w.workers])
            return meta

        undo = _break_reserve(w.backend(1))
        first = finish_now("a", [1, 2, 3], 0.0)
        undo()
        assert first.deletes == () and w.manager.lookup(keys) == 0
        assert len(w.backend(0)) == 2 and w.sched.num_pending_deletes == 2
        again = finish_now("b", [4, 5, 6], 60.0)
        assert again.deletes == ((0, tuple(sorted(keys))),)
        assert [j.plan.keys for j in again.stores] == [tuple(keys)]
        assert w.manager.lookup(keys) == 2
        assert len(w.backend(0)) == 2 and len(w.backend(1)) == 2
        req = Req("c", [*TOKENS_A[:8], 1])
        assert w.sched.get_num_new_matched_tokens(req, 0) == (8, True)
        w.sched.update_state_after_alloc(req, [20, 21, 22], 8)
        meta = w.sched.build_immediate_meta()
        update = w.sched.update_connector_output([wk.run_now(meta) for wk in w.workers])
        assert update.loaded == {"c": 8}
        w.assert_loaded([20, 21], [4, 5], salt=60.0)
    finally:
        w.close()


def test_promotion_after_a_partly_failed_store_is_built_after_the_deletes_and_needs_their_room() -> None:
    """Tier 0 (4 slots) over a compressed tier, write-back. A store that demotes two blocks and
    then fails on rank 1 leaves rank 0 with two orphan slots in tier 0. A load of the demoted
    keys reads them from tier 1 and queues their promotion; the load's build ships the deletes
    first, and the promotion is a store job of a later build, so on rank 0 it runs after the
    deletes freed the orphans' slots (it would find the tier full otherwise)."""
    w = World([CPU4, {"backend": "compressed", "capacity": "1MiB"}])
    try:
        tokens_a = list(range(300, 317))  # four full blocks: tier 0 is full
        w.store("a", tokens_a, [1, 2, 3, 4, 5], salt=0.0)
        ka = w.keys(tokens_a)[:4]
        assert w.manager.lookup(ka) == 4 and len(w.backend(0)) == 4
        tokens_b = list(range(400, 409))  # two blocks: evicts (demotes) a's first two
        undo = _break_reserve(w.backend(1))
        w.store("b", tokens_b, [6, 7, 8], salt=50.0, drain=False)
        w.step(finished=["b"])
        undo()
        kb = w.keys(tokens_b)[:2]
        assert w.manager.lookup(kb) == 0
        assert [s.tier for s in w.manager.lookup_detail(ka)] == [1, 1, 0, 0]
        assert len(w.backend(0, 0)) == 4 and len(w.backend(1, 0)) == 2  # rank 0: a[2:], b (orphans)
        ext, update = w.load("r", [*tokens_a[:16], 9], [10, 11, 12, 13, 14])
        meta = w.metas[-1]
        assert dict(meta.deletes) == {0: tuple(sorted([*ka[:2], *kb]))}
        assert meta.loads[0].plan.promote == ()  # nothing is written into tier 0 by the load
        assert ext == 16 and update.loaded == {"r": 16}
        w.assert_loaded([10, 11, 12, 13], [1, 2, 3, 4], salt=0.0)
        assert [s.tier for s in w.manager.lookup_detail(ka)] == [1, 1, 0, 0]
        w.step()
        (promotion,) = w.metas[-1].stores
        assert promotion.plan.keys == tuple(ka[:2]) and promotion.block_ids == (10, 11)
        assert w.metas[-1].deletes == ()
        w.drain()
        assert w.manager.stats()["promotions"] == 2 and w.manager.stats()["promotions_failed"] == 0
        assert [s.tier for s in w.manager.lookup_detail(ka)] == [0, 0, 0, 0]
        for rank in (0, 1):
            assert w.holds(rank, ka, tier=0) == [True] * 4
            assert w.holds(rank, kb, tier=0) == [False, False]
            assert len(w.backend(rank, 0)) == 4
    finally:
        w.close()


def test_failed_promotion_on_one_rank_is_deleted_on_the_other() -> None:
    w = World([{"backend": "cpu", "capacity": 2 * SLOT}, {"backend": "compressed", "capacity": "1MiB"}])
    try:
        tokens_a = list(range(500, 509))
        w.store("a", tokens_a, [1, 2, 3], salt=0.0)
        w.store("b", list(range(600, 609)), [4, 5, 6], salt=1.0)  # demotes a's blocks to tier 1
        ka = w.keys(tokens_a)[:2]
        assert [s.tier for s in w.manager.lookup_detail(ka)] == [1, 1]
        undo = _break_reserve(w.backend(1, 0))  # rank 1's promotions fail
        ext, update = w.load("r", [*tokens_a[:8], 3], [10, 11, 12])
        assert ext == 8 and update.loaded == {"r": 8}  # the load itself is fine (read from tier 1)
        w.assert_loaded([10, 11], [1, 2], salt=0.0)
        w.step()  # builds the promotion: it evicts b's blocks (demoted to tier 1)
        (promotion,) = w.metas[-1].stores
        assert promotion.plan.keys == tuple(ka) and promotion.plan.demotions[0].keys == tuple(
            w.keys(range(600, 609))[:2]
        )
        w.step()  # runs it (deferred one step, like every store): it fails on rank 1
        undo()
        assert w.manager.stats()["promotions_failed"] == 2
        assert w.holds(0, ka, tier=0) == [True, True]  # rank 0 promoted them
        w.step()
        # Every tier-0 key the failed job touched and the manager does not hold: ka and the
        # demoted victims (which the manager holds in tier 1, so nothing is deleted there).
        assert dict(w.metas[-1].deletes) == {0: tuple(sorted([*ka, *w.keys(range(600, 609))[:2]]))}
        assert w.holds(0, ka, tier=0) == [False, False]
        assert w.holds(0, ka, tier=1) == [True, True]  # the lower tier's copies stay
        assert [s.tier for s in w.manager.lookup_detail(ka)] == [1, 1]
    finally:
        w.close()


def test_deletes_round_trip_and_old_blobs_decode() -> None:
    k1, k2 = b"\x01" * 32, b"\x02" * 32
    meta = StepMetadata(3, deletes=((0, (k1, k2)), (2, (k1,))))
    assert not meta.empty
    assert StepMetadata.from_bytes(meta.to_bytes()) == meta
    # Without deletes the encoding is exactly the five-element form of this wire version.
    assert msgpack.unpackb(StepMetadata(3).to_bytes()) == [1, 3, [], [], []]
    assert StepMetadata.from_bytes(msgpack.packb([1, 3, [], [], []])) == StepMetadata(3)
    for bad in ([[0, ["text"]]], [[-1, [k1]]], [[True, [k1]]], [0], "x"):
        with pytest.raises(ConnectorError):
            StepMetadata.from_bytes(msgpack.packb([1, 3, [], [], [], bad]))
    with pytest.raises(ConnectorError):
        StepMetadata.from_bytes(msgpack.packb([1, 3, [], [], [], [], []]))


def test_world_size_one_failed_store_ships_a_harmless_delete() -> None:
    """With one worker the failing rank already holds nothing; the delete is a no-op there and
    the next store of the same keys succeeds."""
    w = World([CPU4], world=1)
    try:
        keys = w.keys(TOKENS_A)[:2]
        undo = _break_reserve(w.backend(0))
        w.store("a", TOKENS_A, [1, 2, 3], salt=0.0)
        undo()
        assert w.manager.lookup(keys) == 0 and len(w.backend(0)) == 0
        assert any(m.deletes for m in w.metas)
        w.store("b", TOKENS_A, [4, 5, 6], salt=2.0)
        assert w.manager.lookup(keys) == 2 and len(w.backend(0)) == 2
    finally:
        w.close()


def test_promotion_job_is_fenced_and_flushed_when_its_block_is_handed_out_again() -> None:
    """A promotion reads the engine blocks a load just filled: it is fenced like any store, so
    when one of them is handed out again in the very step that builds it, the worker runs it
    before that step's compute overwrites the block, and the promoted copy is exact."""
    w = World([{"backend": "cpu", "capacity": 2 * SLOT}, {"backend": "compressed", "capacity": "1MiB"}])
    try:
        tokens_a = list(range(700, 709))
        w.store("a", tokens_a, [1, 2, 3], salt=0.0)
        w.store("b", list(range(800, 809)), [4, 5, 6], salt=1.0)  # tier 0 full, a demoted
        ka = w.keys(tokens_a)[:2]
        assert [s.tier for s in w.manager.lookup_detail(ka)] == [1, 1]
        ext, update = w.load("r", [*tokens_a[:8], 3], [10, 11, 12])
        assert ext == 8 and update.loaded == {"r": 8}
        assert w.sched.has_pending_work()  # the queued promotion keeps the engine stepping
        # Block 10 goes to another request in the step that builds the promotion; its compute
        # overwrites it.
        w.step(allocated=[10], compute=lambda: w.fill([10, 11], salt=99.0))
        meta = w.metas[-1]
        (promotion,) = meta.stores
        assert promotion.plan.keys == tuple(ka) and promotion.block_ids == (10, 11)
        assert meta.jobs_to_flush == (promotion.job_id,)
        w.drain()
        assert w.sched.counters["promoted_blocks"] == 2 and w.sched.num_fenced_blocks == 0
        assert [s.tier for s in w.manager.lookup_detail(ka)] == [0, 0]
        for c in w.caches:
            for t in c:
                t.zero_()
        ext, update = w.load("s", [*tokens_a[:8], 4], [20, 21, 22])
        assert ext == 8 and update.loaded == {"s": 8}
        assert w.metas[-1].loads[0].plan.tiers == (0, 0)
        w.assert_loaded([20, 21], [1, 2], salt=0.0)
    finally:
        w.close()


def test_unflushed_promotion_fences_its_blocks_until_acknowledged() -> None:
    w = World([{"backend": "cpu", "capacity": 2 * SLOT}, {"backend": "compressed", "capacity": "1MiB"}])
    try:
        tokens_a = list(range(900, 909))
        w.store("a", tokens_a, [1, 2, 3], salt=0.0)
        w.store("b", list(range(950, 959)), [4, 5, 6], salt=1.0)
        w.load("r", [*tokens_a[:8], 3], [10, 11, 12])
        step = SchedulerStep(w.step_no + 1, {}, ())
        meta = w.sched.build_connector_meta(step)
        (promotion,) = meta.stores
        assert meta.jobs_to_flush == () and {10, 11} <= w.sched.fenced_blocks()
        # Handed out in a later step while still unsubmitted: flushed then.
        later = w.sched.build_connector_meta(SchedulerStep(step.step + 1, {}, (11,)))
        assert later.jobs_to_flush == (promotion.job_id,)
        for wk in w.workers:
            wk.handle_preemptions(meta)
            wk.handle_preemptions(later)
            assert wk.num_unsubmitted == 0
        outs = [wk.get_finished(block=True) for wk in w.workers]
        update = w.sched.update_connector_output(outs)
        assert {10, 11} <= set(update.unfenced) and w.sched.num_fenced_blocks == 0
        assert w.manager.stats()["promotions"] == 2
    finally:
        w.close()


def test_fence_is_lifted_once_every_rank_has_read_the_blocks() -> None:
    """A store still writing its tiers no longer holds the engine's blocks once every worker
    reported it done reading them (``WorkerOutput.released``); one rank alone is not enough."""
    w = World([CPU4], world=2)
    try:
        req = Req("a", TOKENS_A)
        w.sched.get_num_new_matched_tokens(req, 0)
        req.block_ids = [1, 2, 3]
        w.sched.update_state_after_alloc(req, req.block_ids, 0)
        meta = w.sched.build_connector_meta(SchedulerStep(1, {"a": len(TOKENS_A)}, (1, 2, 3)))
        (job,) = meta.stores
        assert w.sched.fenced_blocks() == set(job.block_ids)
        update = w.sched.update_connector_output(WorkerOutput(0, released=(job.job_id,)))
        assert update.unfenced == () and w.sched.fenced_blocks() == set(job.block_ids)
        update = w.sched.update_connector_output(WorkerOutput(1, released=(job.job_id, 999)).to_bytes())
        assert sorted(update.unfenced) == sorted(job.block_ids)
        assert (w.sched.num_fenced_blocks, w.sched.num_jobs) == (0, 1)
        assert w.sched.counters["unknown_reports"] == 0  # a stale release is not an error
        # A rank that reports a store finished is done reading it as well.
        other = Req("b", [*range(300, 305)])
        w.sched.get_num_new_matched_tokens(other, 0)
        other.block_ids = [8, 9]
        w.sched.update_state_after_alloc(other, other.block_ids, 0)
        meta2 = w.sched.build_connector_meta(SchedulerStep(2, {"b": 5}, (8, 9)))
        (job2,) = meta2.stores
        done = JobReport(job2.job_id, "store", True)
        update = w.sched.update_connector_output(WorkerOutput(0, finished=(done,)))
        assert update.unfenced == () and w.sched.num_jobs == 2
        update = w.sched.update_connector_output(WorkerOutput(1, released=(job2.job_id,)))
        assert update.unfenced == (8,) and w.sched.num_jobs == 2
        for worker in w.workers:
            for m in (meta, meta2):
                worker.handle_preemptions(m)
                worker.start_load_kv(m)
        w.drain()
        assert w.manager.lookup(w.keys(TOKENS_A)) == len(job.plan.keys)
        assert (w.sched.num_jobs, w.sched.num_request_states) == (0, 2)
    finally:
        w.close()


def test_released_round_trips_and_old_outputs_decode() -> None:
    out = WorkerOutput(1, released=(4, 7))
    assert WorkerOutput.from_bytes(out.to_bytes()) == out
    # Without releases the encoding is exactly the three-element form of this wire version.
    assert msgpack.unpackb(WorkerOutput(1).to_bytes()) == [1, 1, []]
    assert WorkerOutput.from_bytes(msgpack.packb([1, 1, []])) == WorkerOutput(1)
    for bad in (["x"], [True], 3):
        with pytest.raises(ConnectorError):
            WorkerOutput.from_bytes(msgpack.packb([1, 1, [], bad]))
    with pytest.raises(ConnectorError):
        WorkerOutput.from_bytes(msgpack.packb([1, 1, [], [], []]))


def test_store_a_rank_never_reports_is_given_up_after_the_ack_deadline() -> None:
    """Rank 1 stops answering (dead or stuck). Past ``ack_deadline_s`` (0 here: at the next
    update) the store counts as failed and its keys are released, but its blocks stay fenced
    until rank 1 is done reading them; when rank 1 comes back, its late report lifts the fence
    and the deletes drop rank 0's copies."""
    w = World([CPU4], world=2, ack_deadline_s=0)
    try:
        req = Req("a", TOKENS_A)
        w.sched.get_num_new_matched_tokens(req, 0)
        req.block_ids = [1, 2, 3]
        w.sched.update_state_after_alloc(req, req.block_ids, 0)
        w.step_no += 1
        meta = w.sched.build_connector_meta(SchedulerStep(w.step_no, {"a": len(TOKENS_A)}, (1, 2, 3)))
        (job,) = meta.stores
        live, stuck = w.workers
        live.handle_preemptions(meta)
        live.start_load_kv(meta)
        live.flush()  # rank 0 runs the store; rank 1 never sees it (yet)
        update = w.sched.update_connector_output(live.get_finished(block=True))
        assert w.sched.counters["expired_jobs"] == 1 and w.sched.num_jobs == 0
        assert w.manager.lookup(w.keys(TOKENS_A)) == 0  # a miss, never a half-written block
        assert update.unfenced == () and w.sched.fenced_blocks() == set(job.block_ids)  # rank 1 may read them
        assert w.sched.num_pending_deletes > 0 and len(w.backend(0)) == 2
        stuck.handle_preemptions(meta)
        stuck.start_load_kv(meta)
        stuck.flush()
        update = w.sched.update_connector_output(stuck.get_finished(block=True))
        assert sorted(update.unfenced) == sorted(job.block_ids) and w.sched.num_fenced_blocks == 0
        assert w.sched.counters["late_reports"] == 1 and w.sched.counters["unknown_reports"] == 0
        w.drain()  # ships the deletes
        assert len(w.backend(0)) == 0 and len(w.backend(1)) == 0
    finally:
        w.close()


def test_ack_deadline_must_be_seconds() -> None:
    for bad in (-1, "1", True):
        with pytest.raises(ConnectorError, match="ack_deadline_s"):
            ConnectorConfig(block_size=4, ack_deadline_s=bad)  # type: ignore[arg-type]
