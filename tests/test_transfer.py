"""TransferEngine: failures are results, wait() is a fence, poll_finished reports once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest
import torch
from kvtier.backends.memory import CpuBackend

from kvtier.backend import Backend, BlockFormat
from kvtier.errors import BackendError, ClosedError, LayoutError
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key
from kvtier.transfer import TransferEngine
from kvtier.transfer.layout import KVLayout

NUM_BLOCKS = 16
K = [make_key(i) for i in range(64)]


class DictBackend(Backend):
    """A byte backend in a dict; ``fail_writes`` makes the whole write call raise."""

    name = "dict"

    def __init__(self, *, capacity: int) -> None:
        super().__init__(capacity=capacity)
        self.data: dict[bytes, torch.Tensor] = {}
        self.fail_writes = False

    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        if self.fail_writes:
            raise BackendError("dict: injected write failure")
        for key, block in zip(keys, blocks):
            self.data[key] = block.clone()
        return [b.numel() for b in blocks]

    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        found = []
        for key, dst in zip(keys, out):
            block = self.data.get(key)
            if block is not None:
                dst.copy_(block)
            found.append(block is not None)
        return found

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.data.pop(key, None)


def make_layout() -> KVLayout:
    g = torch.Generator().manual_seed(0)
    caches = [torch.randint(0, 256, (NUM_BLOCKS, 2, 4, 64), dtype=torch.uint8, generator=g) for _ in range(3)]
    return KVLayout([c.view(torch.float16) for c in caches])


def manager_for(backend: Backend, blocks: int) -> TierManager:
    reserve = backend.reserve_bytes()
    return TierManager([TierSpec(backend.name, blocks * reserve, reserve, LRUPolicy(blocks))])


def record_of(layout: KVLayout, block: int) -> torch.Tensor:
    return torch.cat([c[block].reshape(-1).view(torch.uint8) for c in layout.kv_caches])


@pytest.fixture
def layout() -> KVLayout:
    return make_layout()


@pytest.fixture
def engine_and_backend(layout: KVLayout) -> Iterator[tuple[TransferEngine, DictBackend, TierManager]]:
    backend = DictBackend(capacity=64 * layout.block_bytes)
    asyncio.run(backend.open(BlockFormat(block_bytes=layout.block_bytes)))
    engine = TransferEngine(layout, [backend], staging_blocks=2)
    yield engine, backend, manager_for(backend, 64)
    engine.close()


def test_a_failing_backend_gives_a_failed_result_and_the_engine_keeps_going(
    engine_and_backend: tuple[TransferEngine, DictBackend, TierManager],
) -> None:
    engine, backend, manager = engine_and_backend
    backend.fail_writes = True
    plan = manager.prepare_store(K[:3])
    assert plan is not None
    (result,) = engine.wait([engine.submit_store(plan, [0, 1, 2])], timeout=30)
    assert result.success is False
    assert result.error is not None and "injected write failure" in result.error
    assert result.keys == tuple(K[:3])
    manager.complete_store(plan.keys, result.success)
    assert manager.lookup(K[:3]) == 0
    assert engine.counters["failed_jobs"] == 1
    # The worker survived: later jobs succeed, across chunks of the 2-block staging buffer.
    backend.fail_writes = False
    plan = manager.prepare_store(K[3:8])
    assert plan is not None
    (result,) = engine.wait([engine.submit_store(plan, [3, 4, 5, 6, 7])], timeout=30)
    assert result.success and result.error is None
    assert result.nbytes == 5 * engine.layout.block_bytes
    for i, key in enumerate(K[3:8]):
        assert torch.equal(backend.data[key], record_of(engine.layout, 3 + i))
    manager.complete_store(plan.keys, True)
    # And loads through the staging buffer come back byte-exact into other blocks.
    want = [record_of(engine.layout, b) for b in (3, 4, 5, 6, 7)]
    for c in engine.layout.kv_caches:
        c.view(torch.uint8).zero_()
    load = manager.prepare_load(K[3:8])
    (result,) = engine.wait([engine.submit_load(load, [11, 12, 13, 14, 15])], timeout=30)
    assert result.success and result.missed == ()
    for i, b in enumerate((11, 12, 13, 14, 15)):
        assert torch.equal(record_of(engine.layout, b), want[i])


def test_a_missing_record_is_a_miss_not_an_error(engine_and_backend: tuple[TransferEngine, DictBackend, TierManager]) -> None:
    engine, backend, manager = engine_and_backend
    plan = manager.prepare_store(K[:2])
    assert plan is not None
    engine.wait([engine.submit_store(plan, [0, 1])], timeout=30)
    manager.complete_store(plan.keys)
    backend.data.pop(K[1])
    load = manager.prepare_load(K[:2])
    (result,) = engine.wait([engine.submit_load(load, [5, 6])], timeout=30)
    assert result.success is False and result.error is None
    assert result.missed == (K[1],) and result.missed_tiers == (0,)


async def test_wait_is_a_fence_for_a_memory_tier(layout: KVLayout) -> None:
    backend = CpuBackend(capacity=32 * layout.block_bytes)
    await backend.open(BlockFormat(block_bytes=layout.block_bytes))
    manager = manager_for(backend, 32)
    engine = TransferEngine(layout, [backend])
    try:
        jobs = []
        plans = []
        for j in range(4):
            keys = K[4 * j : 4 * j + 4]
            plan = manager.prepare_store(keys)
            assert plan is not None
            plans.append(plan)
            jobs.append(engine.submit_store(plan, [4 * j + i for i in range(4)]))
        results = engine.wait(jobs, timeout=30)
        assert [r.job_id for r in results] == jobs and all(r.success for r in results)
        # Right after wait returns, every byte is in the pool.
        for i, slot in enumerate(backend.slots(K[:16])):
            assert torch.equal(backend.pool[slot], record_of(layout, i))
        assert engine.pending_jobs() == 0
        # The async form resolves with the same result.
        assert (await engine.wait_async(jobs[0])) == results[0]
    finally:
        engine.close()
        await backend.aclose()


@pytest.mark.parametrize("gone", [(), (1,), (0, 3), (0, 1, 2, 3)], ids=str)
async def test_a_memory_tier_load_finds_its_slots_in_one_call_or_tells_the_missing(layout: KVLayout, gone: tuple[int, ...]) -> None:
    """A memory tier's load asks for every slot at once; when a record is gone, key by key:
    the missing ones are misses, every other block comes back byte-exact, and the blocks of
    the missing ones are not written."""
    backend = CpuBackend(capacity=8 * layout.block_bytes)
    await backend.open(BlockFormat(block_bytes=layout.block_bytes))
    manager = manager_for(backend, 8)
    engine = TransferEngine(layout, [backend])
    try:
        plan = manager.prepare_store(K[:4])
        assert plan is not None
        (res,) = engine.wait([engine.submit_store(plan, [0, 1, 2, 3])], timeout=30)
        assert res.success
        manager.complete_store(plan.keys)
        want = [record_of(layout, b) for b in range(4)]
        backend.delete_blocks([K[i] for i in gone])
        for c in layout.kv_caches:
            c.view(torch.uint8)[8:12].zero_()
        load = manager.prepare_load(K[:4])
        (res,) = engine.wait([engine.submit_load(load, [8, 9, 10, 11])], timeout=30)
        assert res.missed == tuple(K[i] for i in gone) and res.success is not bool(gone)
        for i in range(4):
            got = record_of(layout, 8 + i)
            assert (not got.any()) if i in gone else torch.equal(got, want[i])
    finally:
        engine.close()
        await backend.aclose()


def test_poll_finished_reports_each_job_once(engine_and_backend: tuple[TransferEngine, DictBackend, TierManager]) -> None:
    engine, _backend, manager = engine_and_backend
    jobs = {}
    for j in range(3):
        plan = manager.prepare_store(K[10 * j : 10 * j + j + 1])
        assert plan is not None
        jobs[engine.submit_store(plan, list(range(j + 1)))] = j + 1
    engine.wait(list(jobs), timeout=30)
    seen = engine.poll_finished()
    assert sorted(r.job_id for r in seen) == sorted(jobs)
    for r in seen:
        assert r.kind == "store" and r.success
        assert r.nbytes == jobs[r.job_id] * engine.layout.block_bytes
        assert r.seconds >= 0.0
    assert engine.poll_finished() == []
    assert engine.wait(list(jobs)) == []  # forgotten after being reported
    assert engine.counters["jobs"] == 3
    assert engine.counters["bytes_stored"] == 6 * engine.layout.block_bytes


def test_submit_validates_block_ids(engine_and_backend: tuple[TransferEngine, DictBackend, TierManager]) -> None:
    engine, _backend, manager = engine_and_backend
    plan = manager.prepare_store(K[:2])
    assert plan is not None
    with pytest.raises(LayoutError):
        engine.submit_store(plan, [0])
    with pytest.raises(LayoutError):
        engine.submit_store(plan, [0, NUM_BLOCKS])
    assert engine.pending_jobs() == 0


def test_closed_engine_refuses_jobs(layout: KVLayout) -> None:
    engine = TransferEngine(layout, [])
    engine.close()
    engine.close()
    manager = TierManager([TierSpec("x", layout.block_bytes, layout.block_bytes, LRUPolicy())])
    plan = manager.prepare_store(K[:1])
    assert plan is not None
    with pytest.raises(ClosedError):
        engine.submit_store(plan, [0])
