"""Connector scenarios with hand-built scheduler steps (no engine loop).

Each test drives the scheduler half and one or two worker halves over real stores (host-memory
tiers, real transfer threads) and checks both the connector's bookkeeping and the bytes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgpack
import pytest
import torch

import kvtier
from kvtier.connector import (
    ConnectorConfig,
    ConnectorError,
    JobReport,
    SchedulerConnector,
    SchedulerStep,
    StepMetadata,
    WorkerConnector,
    WorkerOutput,
)
from kvtier.keys import Namespace, block_keys

BLOCK = 4  # tokens per engine block
NUM_BLOCKS = 32
WIDTH = 8


@dataclass
class Req:
    request_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    hidden: int = 0  # newest tokens the scheduler has not seen (async scheduling)

    @property
    def token_ids(self) -> list[int]:
        return self.tokens[: len(self.tokens) - self.hidden]


class Rig:
    """A scheduler connector over a store, plus ``world`` workers each with its own store."""

    def __init__(self, n: int = 1, world: int = 1, capacity: str = "1MiB", **options: object) -> None:
        self.loop = asyncio.new_event_loop()
        self.n = n
        self.caches: list[list[torch.Tensor]] = []
        self.stores = []
        self.namespace = Namespace(model_id="test", block_size=BLOCK)
        for _ in range(world):
            caches = [torch.zeros((NUM_BLOCKS, BLOCK, WIDTH), dtype=torch.float32) for _ in range(2)]
            cfg = {"tiers": [{"backend": "cpu", "capacity": capacity}], "engine_blocks_per_block": n}
            self.stores.append(self.loop.run_until_complete(self._open(cfg, caches)))
            self.caches.append(caches)
        store = self.stores[0]
        self.manager = store.manager
        self.sched = SchedulerConnector(
            store.manager,
            self.namespace,
            ConnectorConfig(block_size=BLOCK, engine_blocks_per_block=n, world_size=world, **options),  # type: ignore[arg-type]
        )
        self.workers = [WorkerConnector(s.transfers, rank=i) for i, s in enumerate(self.stores)]
        self.step_no = 0

    async def _open(self, cfg: dict, caches: list[torch.Tensor]) -> kvtier.KVStore:
        return await kvtier.open(cfg, kv_caches=caches, namespace=self.namespace)

    def close(self) -> None:
        for s in self.stores:
            self.loop.run_until_complete(s.aclose())
        self.loop.close()

    def fill(self, block: int, value: float, rank: int | None = None) -> None:
        """The engine's compute writing ``block``."""
        for r, caches in enumerate(self.caches):
            if rank is None or r == rank:
                for c in caches:
                    c[block].fill_(value)

    def content(self, block: int, rank: int = 0) -> list[torch.Tensor]:
        return [c[block].clone() for c in self.caches[rank]]

    def meta(self, scheduled: dict[str, int] | None = None, allocated=(), finished=(), preempted=()) -> StepMetadata:
        self.step_no += 1
        step = SchedulerStep(self.step_no, scheduled or {}, tuple(allocated), tuple(finished), tuple(preempted))
        meta = self.sched.build_connector_meta(step)
        return StepMetadata.from_bytes(meta.to_bytes())

    def run_workers(self, meta: StepMetadata, compute=None, *, ack: bool = True):
        for w in self.workers:
            w.handle_preemptions(meta)
            w.start_load_kv(meta)
        if compute is not None:
            compute()
        outs = [WorkerOutput.from_bytes(w.get_finished(block=True).to_bytes()) for w in self.workers]
        if ack:
            return self.sched.update_connector_output(outs)
        return outs

    def keys(self, tokens: list[int]) -> list[bytes]:
        return block_keys(tokens, block_size=BLOCK * self.n, namespace=self.namespace)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def _admit(rig: Rig, req: Req, blocks: list[int], computed: int = 0) -> None:
    ext, _ = rig.sched.get_num_new_matched_tokens(req, computed)
    assert ext == 0
    req.block_ids = list(blocks)
    req.num_computed_tokens = computed
    rig.sched.update_state_after_alloc(req, req.block_ids, 0)


def test_stores_cover_exactly_the_computed_blocks(rig: Rig) -> None:
    req = Req("a", list(range(10, 21)))  # 11 tokens: blocks 0, 1 full, block 2 partial
    _admit(rig, req, [5, 6, 7])
    meta = rig.meta({"a": 6}, allocated=[5, 6, 7])  # chunked prefill: 6 of 11 tokens
    assert [j.block_ids for j in meta.stores] == [(5,)]  # block 1 is half computed: not stored
    rig.run_workers(meta, lambda: (rig.fill(5, 1.0), rig.fill(6, 2.0)))
    req.num_computed_tokens = 6
    meta = rig.meta({"a": 5})
    assert [j.block_ids for j in meta.stores] == [(6,)]  # 11 computed: block 2 still partial
    rig.run_workers(meta)
    req.num_computed_tokens = 11
    req.tokens.append(99)  # the sampled 12th token fills block 2, but its slot is not computed
    assert rig.sched.request_finished(req, req.block_ids) == (False, None)
    meta = rig.meta(finished=["a"])
    assert meta.stores == ()  # the final sampled token's slot is never stored
    rig.run_workers(meta)
    assert rig.manager.lookup(rig.keys(req.tokens)) == 2
    assert (rig.sched.num_request_states, rig.sched.num_jobs, rig.sched.num_fenced_blocks) == (0, 0, 0)


def _finish_with_hidden_last_block(rig: Rig) -> Req:
    """A request whose last block is completed by its final decode step, under async
    scheduling: that block's last token is seen by the scheduler only at finish."""
    req = Req("a", list(range(100, 107)))  # 7 prompt tokens
    _admit(rig, req, [3, 4])
    meta = rig.meta({"a": 7}, allocated=[3, 4])
    assert [j.block_ids for j in meta.stores] == [(3,)]
    rig.run_workers(meta, lambda: (rig.fill(3, 3.0), rig.fill(4, 4.0)))
    req.num_computed_tokens = 7
    req.tokens.append(107)
    req.hidden = 1  # sampled, not yet visible to the scheduler
    meta = rig.meta({"a": 1})  # decode writes slot 7: block 1 is now complete
    assert meta.stores == ()  # its key is not known yet
    rig.run_workers(meta, lambda: rig.fill(4, 4.5))
    req.num_computed_tokens = 8
    req.tokens.append(2)  # EOS
    req.hidden = 0
    return req


def test_last_block_is_stored_at_finish_and_served_to_the_next_turn(rig: Rig) -> None:
    req = _finish_with_hidden_last_block(rig)
    assert rig.sched.request_finished(req, req.block_ids) == (False, None)
    assert rig.sched.num_request_states == 1  # kept for the finish walk
    meta = rig.meta(finished=["a"])
    assert [j.block_ids for j in meta.stores] == [(4,)]
    assert meta.jobs_to_flush == ()
    rig.run_workers(meta)  # deferred: not submitted yet
    assert rig.sched.num_jobs == 1
    rig.run_workers(rig.meta())
    assert (rig.sched.num_request_states, rig.sched.num_jobs, rig.sched.num_fenced_blocks) == (0, 0, 0)
    # The next turn (history + a new message) loads both blocks.
    nxt = Req("b", [*req.tokens[:8], 7, 7, 7])
    ext, is_async = rig.sched.get_num_new_matched_tokens(nxt, 0)
    assert (ext, is_async) == (8, True)
    nxt.block_ids = [10, 11, 12]
    rig.sched.update_state_after_alloc(nxt, nxt.block_ids, 8)
    update = rig.run_workers(rig.meta(allocated=[10, 11, 12]))
    assert update.loaded == {"b": 8}
    assert torch.equal(rig.content(11)[0], torch.full((BLOCK, WIDTH), 4.5))


def test_disabling_the_finish_walk_loses_the_last_block() -> None:
    rig = Rig(store_last_block_at_finish=False)
    try:
        req = _finish_with_hidden_last_block(rig)
        rig.sched.request_finished(req, req.block_ids)
        meta = rig.meta(finished=["a"])
        assert meta.stores == ()
        assert rig.sched.num_request_states == 0
        assert rig.manager.lookup(rig.keys(req.tokens)) == 1
    finally:
        rig.close()


def test_block_reused_before_the_store_is_submitted_is_flushed_with_old_bytes(rig: Rig) -> None:
    req = _finish_with_hidden_last_block(rig)
    old = rig.content(4)
    rig.sched.request_finished(req, req.block_ids)
    assert rig.sched.fenced_blocks() == set()
    # The engine frees block 4 at once and hands it to a new request in the very next step.
    other = Req("b", [9] * 4)
    _admit(rig, other, [4])
    meta = rig.meta({"b": 4}, allocated=[4], finished=["a"])
    (job,) = [j for j in meta.stores if j.request_id == "a"]
    assert job.block_ids == (4,)
    assert meta.jobs_to_flush == (job.job_id,)
    for w in rig.workers:
        w.handle_preemptions(meta)
        assert w.num_unsubmitted == 1  # only b's own store, which waits for b's compute
    rig.fill(4, -1.0)  # b's compute overwrites the block
    for w in rig.workers:
        w.start_load_kv(meta)
    rig.sched.update_connector_output([w.get_finished(block=True) for w in rig.workers])
    rig.run_workers(rig.meta())
    key = rig.keys(req.tokens)[1]
    loaded = Req("c", [*req.tokens[:8], 1])
    assert rig.sched.get_num_new_matched_tokens(loaded, 0) == (8, True)
    loaded.block_ids = [20, 21, 22]
    rig.sched.update_state_after_alloc(loaded, loaded.block_ids, 8)
    rig.run_workers(rig.meta(allocated=[20, 21, 22]))
    assert rig.manager.lookup([key]) == 1
    for got, want in zip(rig.content(21), old):
        assert torch.equal(got, want)  # the old content, not b's


def test_copy_on_write_destination_flushes_a_pending_store(rig: Rig) -> None:
    req = Req("a", [*list(range(8)), 50])
    _admit(rig, req, [1, 2, 3])
    meta = rig.meta({"a": 9}, allocated=[1, 2, 3])
    rig.run_workers(meta, lambda: rig.fill(1, 1.0))
    req.num_computed_tokens = 9
    (pending,) = rig.sched._jobs  # deferred, not yet submitted
    assert 1 in rig.sched.fenced_blocks()
    meta = rig.meta({"a": 1}, allocated=[1])  # block 1 becomes a copy-on-write destination
    assert pending in meta.jobs_to_flush


def test_preemption_flushes_the_requests_stores_and_readmission_is_deferred(rig: Rig) -> None:
    req = Req("a", list(range(30, 39)))
    _admit(rig, req, [7, 8, 9])
    meta = rig.meta({"a": 9}, allocated=[7, 8, 9])
    job_ids = {j.job_id for j in meta.stores}
    assert job_ids
    rig.run_workers(meta, lambda: (rig.fill(7, 7.0), rig.fill(8, 8.0)))
    req.num_computed_tokens = 9
    # Preempted: blocks freed, the request goes back to waiting with nothing computed.
    req.block_ids, req.num_computed_tokens = [], 0
    meta = rig.meta(preempted=["a"])
    assert set(meta.jobs_to_flush) == job_ids
    outs = rig.run_workers(meta, ack=False)
    assert all(w.num_unsubmitted == 0 for w in rig.workers)
    # Re-admitted before the flushed stores are acknowledged: asked to wait, no load.
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    rig.sched.update_connector_output(outs)
    ext, is_async = rig.sched.get_num_new_matched_tokens(req, 0)
    assert (ext, is_async) == (8, True)


def test_aborted_never_scheduled_request_builds_no_store(rig: Rig) -> None:
    req = Req("a", list(range(16)))
    _admit(rig, req, [1, 2, 3, 4])
    req.num_computed_tokens = 12  # whatever the engine says: it never ran a step
    assert rig.sched.request_finished(req, req.block_ids) == (False, None)
    meta = rig.meta(finished=["a"])
    assert meta.stores == ()
    assert rig.sched.num_request_states == 0


def test_concurrent_lookups_of_one_prefix_load_it_once(rig: Rig) -> None:
    src = Req("src", list(range(200, 209)))
    _admit(rig, src, [1, 2, 3])
    rig.run_workers(rig.meta({"src": 9}, allocated=[1, 2, 3]), lambda: (rig.fill(1, 1.0), rig.fill(2, 2.0)))
    src.num_computed_tokens = 9
    rig.sched.request_finished(src, src.block_ids)
    rig.run_workers(rig.meta(finished=["src"]))
    rig.run_workers(rig.meta())
    a, b = Req("a", [*src.tokens[:8], 1, 2]), Req("b", [*src.tokens[:8], 3, 4])
    assert rig.sched.get_num_new_matched_tokens(a, 0) == (8, True)
    a.block_ids = [10, 11, 12]
    rig.sched.update_state_after_alloc(a, a.block_ids, 8)
    assert rig.sched.get_num_new_matched_tokens(b, 0) == (None, False)
    meta = rig.meta(allocated=[10, 11, 12])
    assert len(meta.loads) == 1
    update = rig.run_workers(meta)
    assert update.loaded == {"a": 8}
    # Now the engine's own prefix cache holds a's blocks; b finds nothing more to load.
    assert rig.sched.get_num_new_matched_tokens(b, 8) == (0, False)


def test_failed_load_becomes_recompute(rig: Rig) -> None:
    src = Req("src", list(range(300, 313)))
    _admit(rig, src, [1, 2, 3, 4])
    rig.run_workers(rig.meta({"src": 13}, allocated=[1, 2, 3, 4]))
    src.num_computed_tokens = 13
    rig.sched.request_finished(src, src.block_ids)
    rig.run_workers(rig.meta(finished=["src"]))
    rig.run_workers(rig.meta())
    keys = rig.keys(src.tokens)
    assert rig.manager.lookup(keys) == 3
    rig.stores[0].backends[0].delete_blocks([keys[1]])  # the bytes vanish behind the manager's back
    req = Req("r", [*src.tokens[:12], 5])
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (12, True)
    req.block_ids = [10, 11, 12, 13]
    rig.sched.update_state_after_alloc(req, req.block_ids, 12)
    update = rig.run_workers(rig.meta(allocated=req.block_ids))
    assert update.loaded == {"r": 4}  # block 0 is valid; from block 1 on the engine recomputes
    assert rig.manager.lookup(keys) == 1  # the missing key is forgotten
    assert rig.sched.num_jobs == 0


def test_load_starting_inside_an_offloaded_block() -> None:
    rig = Rig(n=2)
    try:
        src = Req("src", list(range(400, 417)))  # 17 tokens: two offloaded blocks of 8
        _admit(rig, src, [1, 2, 3, 4, 5])
        rig.run_workers(
            rig.meta({"src": 17}, allocated=[1, 2, 3, 4, 5]), lambda: [rig.fill(b, float(b)) for b in (1, 2, 3, 4)]
        )
        src.num_computed_tokens = 17
        rig.sched.request_finished(src, src.block_ids)
        rig.run_workers(rig.meta(finished=["src"]))
        rig.run_workers(rig.meta())
        req = Req("r", [*src.tokens[:16], 1])
        # The engine's own prefix cache holds 3 engine blocks (12 tokens): mid offloaded block 1.
        ext, is_async = rig.sched.get_num_new_matched_tokens(req, 12)
        assert (ext, is_async) == (4, True)
        req.block_ids = [1, 2, 3, 9, 10]
        rig.sched.update_state_after_alloc(req, req.block_ids, 4)
        update = rig.run_workers(rig.meta(allocated=[9, 10]))
        assert update.loaded == {"r": 16}
        assert torch.equal(rig.content(9)[0], torch.full((BLOCK, WIDTH), 4.0))
        assert torch.equal(rig.content(3)[0], torch.full((BLOCK, WIDTH), 3.0))
    finally:
        rig.close()


def test_world_size_two_needs_both_acks() -> None:
    rig = Rig(world=2)
    try:
        req = Req("a", list(range(9)))
        _admit(rig, req, [1, 2, 3])
        rig.run_workers(rig.meta({"a": 9}, allocated=[1, 2, 3]))
        meta = rig.meta()
        for w in rig.workers:
            w.handle_preemptions(meta)
            w.start_load_kv(meta)
        out0, out1 = (w.get_finished(block=True) for w in rig.workers)
        assert out0.finished and out1.finished
        keys = rig.keys(req.tokens)
        rig.sched.update_connector_output(out0.to_bytes())
        rig.sched.update_connector_output(out0)  # a duplicate from rank 0 is not rank 1's ack
        assert rig.sched.num_jobs == 1 and rig.manager.lookup(keys) == 0
        rig.sched.update_connector_output(out1.to_bytes())
        assert rig.sched.num_jobs == 0 and rig.manager.lookup(keys) == 2
        with pytest.raises(ConnectorError):
            rig.sched.update_connector_output(WorkerOutput(rank=2))
    finally:
        rig.close()


def test_step_metadata_and_worker_output_round_trip(rig: Rig) -> None:
    req = Req("a", list(range(9)))
    _admit(rig, req, [1, 2, 3])
    meta = rig.meta({"a": 9}, allocated=[1, 2, 3])
    assert meta.stores
    again = StepMetadata.from_bytes(meta.to_bytes())
    assert again == meta
    out = WorkerOutput(
        rank=1,
        finished=(
            JobReport(
                7, "load", False, 10, failed={0: (b"k" * 32,)}, missed=(b"m" * 32,), missed_tiers=(1,), error="x"
            ),
            JobReport(8, "store", True, 4096, sizes={1: {b"s" * 32: 100}}),
        ),
    )
    assert WorkerOutput.from_bytes(out.to_bytes()) == out
    with pytest.raises(ConnectorError):
        StepMetadata.from_bytes(b"\x80not msgpack")
    with pytest.raises(ConnectorError):
        StepMetadata.from_bytes(msgpack.packb([99, 1, [], [], []]))
    with pytest.raises(ConnectorError):
        WorkerOutput.from_bytes(msgpack.packb([1, 0, [[1, "bogus", True, 0, [], [], [], [], None]]]))


def test_run_longer_than_the_tier_stores_what_fits_at_finish_and_frees_the_state() -> None:
    rig = Rig(capacity="1KiB")  # one block of 2 tensors x 4 slots x 8 floats x 4 bytes = 256 B: 4 slots
    try:
        req = Req("a", list(range(41)))  # 10 full blocks: more than the tier holds
        _admit(rig, req, list(range(11)))
        meta = rig.meta({"a": 41}, allocated=range(11))
        assert meta.stores == ()  # while it runs, the whole run waits for room
        assert rig.sched.counters["store_rejected_blocks"] == 10
        rig.run_workers(meta)
        req.num_computed_tokens = 41
        rig.sched.request_finished(req, req.block_ids)
        meta = rig.meta(finished=["a"])  # the last chance: ten do not fit, nor five; two do
        assert [j.block_ids for j in meta.stores] == [(0, 1)]
        rig.run_workers(meta)
        rig.run_workers(rig.meta())
        assert rig.manager.lookup(rig.keys(req.tokens)) == 2
        assert (rig.sched.num_request_states, rig.sched.num_jobs) == (0, 0)
    finally:
        rig.close()


def test_finish_walk_stores_the_leading_blocks_that_fit() -> None:
    rig = Rig(capacity="512B")  # two slots
    try:
        a, b = Req("a", list(range(1100, 1105))), Req("b", list(range(1200, 1213)))
        _admit(rig, a, [1, 2])
        _admit(rig, b, [10, 11, 12, 13])
        # a's one block takes a slot (pending); b's three blocks do not fit.
        meta = rig.meta({"a": 5, "b": 13}, allocated=[1, 2, 10, 11, 12, 13])
        assert [j.request_id for j in meta.stores] == ["a"]
        rig.run_workers(meta)
        b.num_computed_tokens = 13
        b.tokens.append(2)
        rig.sched.request_finished(b, b.block_ids)
        meta = rig.meta(finished=["b"])  # a's store still pending: one slot left, for b's first block
        assert [j.block_ids for j in meta.stores] == [(10,)]
        rig.run_workers(meta)
        rig.run_workers(rig.meta())
        assert rig.manager.lookup(rig.keys(b.tokens)) == 1
    finally:
        rig.close()


# -- engines without a step loop (build_immediate_meta / run_now / wait_for) -------------------
@pytest.fixture
def sync_rig() -> Iterator[Rig]:
    r = Rig(step_loop=False)
    r.workers = [WorkerConnector.from_store(s, rank=i) for i, s in enumerate(r.stores)]
    yield r
    r.close()


def _held_gather(rig: Rig) -> threading.Event:
    """Hold every store's read of the engine blocks back until the returned event is set (a
    hang guard of a minute), so that a store is in flight for as long as the test needs it,
    however loaded the machine."""
    layout = rig.stores[0].transfers.layout
    gather = layout.gather
    release = threading.Event()

    def held(*args: object, **kwargs: object) -> None:
        assert release.wait(60), "the test never let the gather go"
        gather(*args, **kwargs)

    layout.gather = held  # type: ignore[method-assign]
    return release


def _finish_now(rig: Rig, req: Req) -> StepMetadata:
    """A synchronous engine's finish: no step ever reported; the stores are built at once."""
    ext, _ = rig.sched.get_num_new_matched_tokens(req, 0)  # the request's state starts at its match
    assert ext == 0
    rig.sched.update_state_after_alloc(req, req.block_ids, 0)
    assert rig.sched.request_finished(req, req.block_ids) == (False, None)
    return StepMetadata.from_bytes(rig.sched.build_immediate_meta().to_bytes())


def test_immediate_finish_store_is_in_the_metadata_and_then_hits(sync_rig: Rig) -> None:
    rig = sync_rig
    release = _held_gather(rig)  # the store is still in flight after run_now, until let go
    req = Req("a", list(range(500, 509)), num_computed_tokens=9, block_ids=[3, 4, 5])  # 2 full blocks
    rig.fill(3, 3.0)
    rig.fill(4, 4.0)
    meta = _finish_now(rig, req)
    (job,) = meta.stores
    assert job.block_ids == (3, 4)
    assert meta.loads == () and meta.jobs_to_flush == ()
    assert rig.sched.counters["last_block_jobs"] == 1
    assert rig.sched.fenced_blocks() == {3, 4}
    keys = rig.keys(req.tokens)
    assert rig.manager.lookup(keys) == 0  # pending until acknowledged
    nxt = Req("b", [*req.tokens[:8], 1, 2])
    out = rig.workers[0].run_now(meta)
    assert rig.workers[0].num_unsubmitted == 0  # submitted at once, not deferred to a next step
    assert rig.sched.update_connector_output(out).unfenced == ()
    assert rig.sched.num_jobs == 1
    # The next turn's lookup names the store writing its prefix; the engine waits for it.
    assert rig.sched.get_num_new_matched_tokens(nxt, 0) == (0, False)
    assert rig.sched.pending_prefix_stores(nxt, 0) == (job.job_id,)
    release.set()
    update = rig.sched.update_connector_output(rig.workers[0].wait_for([job.job_id]))
    assert sorted(update.unfenced) == [3, 4]
    assert rig.sched.pending_prefix_stores(nxt, 0) == ()
    assert rig.manager.lookup(keys) == 2
    assert rig.sched.counters["stored_blocks"] == 2
    assert rig.sched.get_num_new_matched_tokens(nxt, 0) == (8, True)
    rig.sched.update_state_after_alloc(nxt, [], 0)  # not loaded after all
    rig.sched.request_finished(nxt, [])
    assert (rig.sched.num_request_states, rig.sched.num_jobs, rig.sched.num_fenced_blocks) == (0, 0, 0)
    # The worker built from the store records the job in the store's I/O metrics.
    assert rig.stores[0].metrics.snapshot()["tiers"][0]["bytes_stored"] > 0


def test_stepped_connector_never_stores_an_unscheduled_request_but_a_stepless_one_does() -> None:
    for step_loop, stored in ((True, 0), (False, 2)):
        rig = Rig(step_loop=step_loop)
        try:
            req = Req("a", list(range(600, 609)), num_computed_tokens=9, block_ids=[1, 2, 3])
            meta = _finish_now(rig, req)
            assert sum(len(j.plan.keys) for j in meta.stores) == stored
            rig.sched.update_connector_output(rig.workers[0].run_now(meta))
            rig.sched.update_connector_output(rig.workers[0].get_finished(block=True))
            assert rig.manager.lookup(rig.keys(req.tokens)) == stored
            assert rig.sched.num_request_states == 0
        finally:
            rig.close()


def test_synchronous_load_fills_the_blocks_and_counts_valid_tokens(sync_rig: Rig) -> None:
    rig = sync_rig
    src = Req("src", list(range(700, 713)), num_computed_tokens=13, block_ids=[1, 2, 3, 4])  # 3 full blocks
    for b in (1, 2, 3):
        rig.fill(b, float(b))
    meta = _finish_now(rig, src)
    rig.sched.update_connector_output(rig.workers[0].run_now(meta))
    rig.sched.update_connector_output(rig.workers[0].get_finished(block=True))
    keys = rig.keys(src.tokens)
    assert rig.manager.lookup(keys) == 3
    # The engine's own cache holds block 0 (4 tokens); kvtier serves blocks 1 and 2 at once.
    req = Req("r", [*src.tokens[:12], 9], block_ids=[1])
    assert rig.sched.pending_prefix_stores(req, 4) == ()
    assert rig.sched.get_num_new_matched_tokens(req, 4) == (8, True)
    req.block_ids = [1, 20, 21]
    rig.sched.update_state_after_alloc(req, req.block_ids, 8)
    meta = rig.sched.build_immediate_meta()
    (load,) = meta.loads
    assert load.block_ids == (20, 21) and meta.stores == ()
    update = rig.sched.update_connector_output(rig.workers[0].run_now(meta))
    assert update.loaded == {"r": 12}
    assert torch.equal(rig.content(20)[0], torch.full((BLOCK, WIDTH), 2.0))
    assert torch.equal(rig.content(21)[1], torch.full((BLOCK, WIDTH), 3.0))
    assert rig.sched.num_jobs == 0 and not rig.sched.has_pending_work()
    # A record gone behind the manager's back: the load stops there, the rest is recomputed.
    rig.stores[0].backends[0].delete_blocks([keys[2]])
    again = Req("q", [*src.tokens[:12], 8])
    assert rig.sched.get_num_new_matched_tokens(again, 0) == (12, True)
    rig.sched.update_state_after_alloc(again, [24, 25, 26], 12)
    update = rig.sched.update_connector_output(rig.workers[0].run_now(rig.sched.build_immediate_meta()))
    assert update.loaded == {"q": 8}
    assert rig.manager.lookup(keys) == 2
    assert rig.sched.counters["load_missed_blocks"] == 1


@pytest.mark.parametrize("flush", [True, False], ids=["fenced", "unfenced"])
def test_fence_holds_for_an_immediately_submitted_store(sync_rig: Rig, flush: bool) -> None:
    """A store submitted at once by ``run_now`` is still reading block 4 (its gather is held
    back) when a later step hands block 4 out again: the step's ``jobs_to_flush`` names it and
    the worker waits for it before the compute overwrites the block. The control skips the
    flush and sees the overwrite stored, which shows the test sees the race."""
    rig = sync_rig
    release = _held_gather(rig)
    req = Req("a", list(range(800, 809)), num_computed_tokens=9, block_ids=[3, 4, 5])
    rig.fill(3, 3.0)
    rig.fill(4, 4.0)
    meta = _finish_now(rig, req)
    (job,) = meta.stores
    rig.sched.update_connector_output(rig.workers[0].run_now(meta))
    assert rig.workers[0].num_in_flight == 1  # in flight, the engine has already freed the blocks
    other = Req("b", [9] * 4)
    _admit(rig, other, [4])
    step = rig.meta({"b": 4}, allocated=[4])
    assert step.jobs_to_flush == (job.job_id,)
    if flush:
        # Let the gather go a moment after the flush has begun waiting for it: however late
        # that moment is, the flush returns only once the job has read block 4.
        threading.Timer(0.3, release.set).start()
        rig.workers[0].handle_preemptions(step)
    rig.fill(4, -1.0)  # b's compute
    release.set()  # the control: the gather reads block 4 only after b's compute wrote it
    rig.workers[0].start_load_kv(step)
    update = rig.sched.update_connector_output(rig.workers[0].get_finished(block=True))
    assert 3 in update.unfenced
    loaded = Req("c", [*req.tokens[:8], 1])
    assert rig.sched.get_num_new_matched_tokens(loaded, 0) == (8, True)
    rig.sched.update_state_after_alloc(loaded, [20, 21, 22], 8)
    update = rig.sched.update_connector_output(rig.workers[0].run_now(rig.sched.build_immediate_meta()))
    assert update.loaded == {"c": 8}
    want = 4.0 if flush else -1.0
    assert torch.equal(rig.content(21)[0], torch.full((BLOCK, WIDTH), want))


# -- a full tier, the final slot, unknown requests -----------------------------------------------
def _full_tier_rig(b: Req, computed: int) -> Rig:
    """A tier of two blocks. In step 1 request ``a``'s store takes both (pending: nothing can be
    evicted until it is acknowledged), so ``b``'s store of its first ``computed`` tokens is refused."""
    rig = Rig(capacity="512B")  # 2 caches x 4 tokens x 8 floats = 256 bytes a block
    a = Req("a", list(range(500, 509)))
    _admit(rig, a, [1, 2, 3])
    _admit(rig, b, [10, 11, 12])
    meta = rig.meta({"a": 9, "b": computed}, allocated=[1, 2, 3, 10, 11, 12])
    assert [(j.request_id, len(j.plan.keys)) for j in meta.stores] == [("a", 2)]
    assert rig.sched.counters["store_rejected_blocks"] == computed // BLOCK
    rig.run_workers(meta)  # a's store is deferred to the next step
    a.num_computed_tokens, b.num_computed_tokens = 9, computed
    return rig


def test_refused_store_is_retried_and_never_stored_past_a_gap() -> None:
    b = Req("b", list(range(600, 609)))  # 9 tokens: 2 full blocks
    rig = _full_tier_rig(b, 4)
    try:
        meta = rig.meta({"b": 4})  # block 1 completes; a's store is still pending
        assert meta.stores == ()  # not block 1 alone, after the gap left by block 0
        rig.run_workers(meta)  # a's store runs and is acknowledged: there is room again
        b.num_computed_tokens = 8
        meta = rig.meta({"b": 1})
        assert [j.block_ids for j in meta.stores] == [(10, 11)]  # block 0 asked for again
        rig.run_workers(meta)
        rig.run_workers(rig.meta())
        assert rig.manager.lookup(rig.keys(b.tokens)) == 2
    finally:
        rig.close()


def test_refused_store_is_retried_at_finish() -> None:
    b = Req("b", list(range(700, 709)))
    rig = _full_tier_rig(b, 8)
    try:
        rig.run_workers(rig.meta())  # a's store runs and is acknowledged
        b.tokens.append(2)  # EOS
        rig.sched.request_finished(b, b.block_ids)
        meta = rig.meta(finished=["b"])
        assert [j.block_ids for j in meta.stores] == [(10, 11)]
        rig.run_workers(meta)
        rig.run_workers(rig.meta())
        assert rig.manager.lookup(rig.keys(b.tokens)) == 2
        assert (rig.sched.num_request_states, rig.sched.num_jobs) == (1, 0)  # a is still running
    finally:
        rig.close()


def test_finish_walk_never_stores_the_final_sampled_slot(rig: Rig) -> None:
    # An engine that counts the scheduled but unwritten slot of the final token (vLLM #54288):
    # 7 prompt tokens computed, token 8 sampled, and num_computed_tokens says 8 at finish.
    req = Req("a", list(range(800, 807)))
    _admit(rig, req, [1, 2])
    meta = rig.meta({"a": 7}, allocated=[1, 2])
    assert [j.block_ids for j in meta.stores] == [(1,)]
    rig.run_workers(meta)
    req.tokens.append(2)  # EOS: it fills block 1, but its slot is never written
    req.num_computed_tokens = 8
    rig.sched.request_finished(req, req.block_ids)
    meta = rig.meta(finished=["a"])
    assert meta.stores == ()
    rig.run_workers(meta)
    assert rig.manager.lookup(rig.keys(req.tokens)) == 1
    assert rig.sched.num_request_states == 0


def test_finishing_an_unknown_request_warns_once(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    for rid in ("x", "y"):
        req = Req(rid, list(range(900, 909)), num_computed_tokens=8, block_ids=[1, 2, 3])
        with caplog.at_level("WARNING", logger="kvtier.connector"):
            assert rig.sched.request_finished(req, req.block_ids) == (False, None)
    warnings = [r for r in caplog.records if "never saw this request" in r.getMessage()]
    assert len(warnings) == 1 and "'x'" in warnings[0].getMessage()
    assert rig.sched.counters["unknown_finished_requests"] == 2
    assert rig.meta(finished=["x", "y"]).stores == ()
    assert rig.sched.num_request_states == 0


def test_without_a_step_loop_an_unknown_finished_request_is_stored() -> None:
    rig = Rig(step_loop=False)
    try:
        req = Req("x", list(range(900, 910)), num_computed_tokens=9, block_ids=[1, 2, 3])
        assert rig.sched.request_finished(req, req.block_ids) == (False, None)
        meta = rig.sched.build_immediate_meta()
        assert [j.block_ids for j in meta.stores] == [(1, 2)]
        rig.sched.update_connector_output(rig.workers[0].run_now(meta))
        rig.sched.update_connector_output(rig.workers[0].get_finished(block=True))
        assert rig.manager.lookup(rig.keys(req.tokens)) == 2
        assert (rig.sched.num_request_states, rig.sched.num_jobs) == (0, 0)
    finally:
        rig.close()


def test_fence_waits_for_the_device_read_only(tmp_path) -> None:
    """A flushed store whose tier write stalls (a disk that hangs) must not hold the engine's
    step: ``handle_preemptions`` returns once the job has read its engine blocks."""

    loop = asyncio.new_event_loop()
    ns = Namespace(model_id="test", block_size=BLOCK)
    caches = [torch.zeros((NUM_BLOCKS, BLOCK, WIDTH), dtype=torch.float32) for _ in range(2)]
    cfg = {"tiers": [{"backend": "file", "path": str(tmp_path / "kv"), "capacity": "1MiB"}]}
    store = loop.run_until_complete(kvtier.open(cfg, kv_caches=caches, namespace=ns))
    release = threading.Event()
    disk = store.backends[0]
    write = disk.write_blocks

    def stalled_write(keys, blocks):  # type: ignore[no-untyped-def]
        release.wait()
        return write(keys, blocks)

    disk.write_blocks = stalled_write  # type: ignore[method-assign]
    sched = SchedulerConnector.from_store(store, block_size=BLOCK)
    worker = WorkerConnector.from_store(store)
    try:
        req = Req("a", list(range(1000, 1009)))
        sched.get_num_new_matched_tokens(req, 0)
        req.block_ids = [1, 2, 3]
        sched.update_state_after_alloc(req, req.block_ids, 0)
        meta = sched.build_connector_meta(SchedulerStep(1, {"a": 9}, (1, 2, 3)))
        (job,) = meta.stores
        worker.handle_preemptions(meta)
        worker.start_load_kv(meta)
        meta = sched.build_connector_meta(SchedulerStep(2, preempted_request_ids=("a",)))
        assert meta.jobs_to_flush == (job.job_id,)
        fence = threading.Thread(target=worker.handle_preemptions, args=(meta,))
        fence.start()
        fence.join(timeout=30)  # a hang guard, not a speed check: the write never ends by itself
        assert not fence.is_alive(), "the fence waited for the stalled tier write"
        assert worker.unfinished_store_blocks() == set()  # the engine may reuse blocks 1, 2
        # The scheduler side hears it too: the fence is lifted while the job still runs.
        out = WorkerOutput.from_bytes(worker.get_finished().to_bytes())
        assert (out.finished, out.released) == ((), (job.job_id,))
        update = sched.update_connector_output(out)
        assert sorted(update.unfenced) == [1, 2]
        assert (sched.num_fenced_blocks, sched.num_jobs) == (0, 1)
        assert worker.get_finished().released == ()  # reported once
        release.set()
        update = sched.update_connector_output(worker.get_finished(block=True))
        assert update.unfenced == () and sched.num_jobs == 0
        assert store.manager.lookup(block_keys(req.tokens, block_size=BLOCK, namespace=store.namespace)) == 2
    finally:
        release.set()
        loop.run_until_complete(store.aclose())
        loop.close()


# -- the connector's bookkeeping on its own ------------------------------------------------------
def test_fence_index_lifts_a_block_when_its_last_reader_is_released() -> None:
    from kvtier.connector import FenceIndex

    fence = FenceIndex()
    fence.add(1, [5, 6])
    fence.add(2, [6, 7])
    assert fence.readers([6, 9]) == {1, 2} and fence.readers([7]) == {2} and fence.readers([9]) == set()
    assert fence.release(1, [5, 6]) == [5]  # 6 is still read by job 2
    assert fence.blocks() == {6, 7} and 6 in fence and len(fence) == 2
    assert fence.release(1, [5, 6]) == []  # releasing twice changes nothing
    assert sorted(fence.release(2, [6, 7])) == [6, 7] and len(fence) == 0


def test_delete_ledger_ships_only_what_the_manager_no_longer_holds(rig: Rig) -> None:
    from kvtier.connector import DeleteLedger
    from kvtier.manager import Demotion, StorePlan

    k1, k2, k3 = rig.keys(list(range(12)))
    held = rig.manager.prepare_store([k3])  # pending in tier 0: its bytes are wanted
    assert held is not None
    ledger = DeleteLedger()
    plan = StorePlan(plan_id=0, keys=(k2, k3), positions=(0, 1), demotions=(Demotion(0, 7, (k1,)),))
    ledger.remember_plan(plan)
    ledger.remember(0, [k1])
    assert len(ledger) == 4 and ledger  # k1, k2, k3 in tier 0; k1 in tier 7
    assert ledger.take(rig.manager) == ((0, tuple(sorted((k1, k2)))),)  # tier 7 does not exist
    assert not ledger and ledger.take(rig.manager) == ()


def test_namespace_of_the_engine_block_size_serves_two_engine_blocks_per_block() -> None:
    """An engine author builds the namespace for the engine's block size; with
    ``engine_blocks_per_block: 2`` the step must cut keys every two engine blocks, not raise."""
    rig = Rig(n=2)
    try:
        assert rig.namespace.block_size == BLOCK
        req = Req("r", list(range(500, 517)))  # 17 tokens: two offloaded blocks of 8
        ext, _ = rig.sched.get_num_new_matched_tokens(req, 0)
        assert ext == 0
        _admit(rig, req, [1, 2, 3, 4, 5])
        rig.run_workers(rig.meta({"r": 17}, allocated=[1, 2, 3, 4, 5]), lambda: [rig.fill(b, float(b)) for b in (1, 2, 3, 4)])
        req.num_computed_tokens = 17
        rig.sched.request_finished(req, req.block_ids)
        rig.run_workers(rig.meta(finished=["r"]))
        rig.run_workers(rig.meta())
        assert rig.manager.lookup(rig.keys(req.tokens)) == 2
    finally:
        rig.close()


def test_namespace_built_for_another_block_size_is_refused_when_the_connector_is_built() -> None:
    store_ns = Namespace(model_id="test", block_size=BLOCK * 2)
    from kvtier.manager import TierManager, TierSpec
    from kvtier.manager.policies import LRUPolicy

    manager = TierManager([TierSpec("cpu", capacity_bytes=4096, block_reserve=64, policy=LRUPolicy(capacity=64))])
    with pytest.raises(ConnectorError, match=r"blocks hold 4 tokens but namespace.block_size is 8"):
        SchedulerConnector(manager, store_ns, ConnectorConfig(block_size=BLOCK, engine_blocks_per_block=2))
