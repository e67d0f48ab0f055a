"""Stream ordering and the two phases of a store job (#10), checked on CPU.

The CUDA paths run through the ``cuda_standin`` stand-in for ``torch.cuda`` (see
``tests/cuda_standin.py``): it logs every stream, event and copy and tells whether one op is
ordered before another under CUDA's rules, so these tests assert what a real device needs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch
from kvtier.backends.memory import CpuBackend

import kvtier
from kvtier.backend import BlockFormat
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key
from kvtier.transfer import TransferEngine
from kvtier.transfer.jobs import apply_result
from kvtier.transfer.layout import KVLayout

if TYPE_CHECKING:
    from cuda_standin import CudaStandIn, Op

pytest_plugins = ("cuda_standin",)

K = [make_key(500 + i) for i in range(32)]
HANG_GUARD = 60.0  # seconds; only ever reached when a test is about to fail


class Gate:
    """Wraps a callable so that it blocks until ``open()``; ``entered`` tells it was reached."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            if not self.opened.wait(HANG_GUARD):
                raise RuntimeError("gate never opened")
            return fn(*args, **kwargs)

        return gated


def device_setup(
    s: CudaStandIn, tiers: int = 1, blocks: int = 8
) -> tuple[torch.Tensor, KVLayout, list[CpuBackend], TierManager, TransferEngine]:
    cache = torch.randint(0, 256, (8, 256), dtype=torch.uint8, device="cuda")
    layout = KVLayout([cache])
    assert layout.device.type == "cuda"
    backends = []
    specs = []
    for i in range(tiers):
        b = CpuBackend(capacity=blocks * layout.block_bytes)
        asyncio.run(b.open(BlockFormat(block_bytes=layout.block_bytes)))
        backends.append(b)
        specs.append(TierSpec(f"cpu{i}", blocks * layout.block_bytes, layout.block_bytes, LRUPolicy(blocks)))
    manager = TierManager(specs)
    return cache, layout, backends, manager, TransferEngine(layout, backends)


def writes_to(s: CudaStandIn, t: torch.Tensor, after: Op) -> list[Op]:
    return [op for op in s.ops(writes=t, kind="device") if op.seq > after.seq]


def test_a_load_waits_for_the_compute_stream_before_writing_an_engine_block(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    cache, _layout, _backends, manager, engine = device_setup(s)
    try:
        plan = manager.prepare_store(K[:1])
        assert plan is not None
        (r,) = engine.wait([engine.submit_store(plan, [1])], timeout=HANG_GUARD)
        apply_result(manager, plan, r)
        compute = torch.cuda.current_stream()
        # A kernel of the previous step, still queued on the compute stream, reads block 5;
        # the engine has already freed block 5 and hands it to a request whose prefix loads.
        kernel = s.mark("attention(previous step)", reads=(cache[5],))
        load = manager.prepare_load(K[:1])
        job = engine.submit_load(load, [5])
        (r,) = engine.wait([job], timeout=HANG_GUARD)
        assert r.success
        writes = writes_to(s, cache, kernel)
        assert writes, "the load wrote no engine block"
        assert all(w.stream is not compute for w in writes)
        for w in writes:
            assert s.happens_before(kernel, w), f"{w} may overwrite block 5 under a queued kernel"
        # The order of calls: an event recorded on the compute stream at submit, which the
        # transfer stream waits for before its first write.
        records = [op for op in s.ops("record") if op.stream is compute and op.seq > kernel.seq]
        waits = [op for op in s.ops("wait_event") if op.stream is writes[0].stream and op.seq > kernel.seq]
        assert records and waits
        assert waits[0].event is records[0].event
        assert records[0].seq < waits[0].seq < writes[0].seq
        # Done means done: the loading thread saw its copies complete before reporting.
        syncs = [op for op in s.ops(kind="host") if op.thread == "kvtier-load" and op.name == "synchronize"]
        assert any(s.happens_before(writes[-1], op) for op in syncs)
        assert torch.equal(cache[5], cache[1])
        apply_result(manager, load, r)
    finally:
        engine.close()


@pytest.mark.parametrize("direct", [True, False], ids=["first-tier", "staged"])
def test_a_store_reads_engine_blocks_only_after_the_compute_stream(cuda_standin: CudaStandIn, direct: bool) -> None:
    s = cuda_standin
    cache, _layout, backends, manager, engine = device_setup(s, tiers=1 if direct else 2, blocks=2)
    try:
        if not direct:
            # Fill the first tier so the next store demotes to a byte-tier stand-in: staged.
            for i in range(2):
                plan = manager.prepare_store(K[i : i + 1])
                assert plan is not None
                (r,) = engine.wait([engine.submit_store(plan, [i])], timeout=HANG_GUARD)
                apply_result(manager, plan, r)
            engine.backends[1] = _ByteTier(backends[1])
        kernel = s.mark("compute writes block 3", writes=(cache[3],))
        plan = manager.prepare_store(K[4:5])
        assert plan is not None
        assert bool(plan.demotions) is not direct
        (r,) = engine.wait([engine.submit_store(plan, [3])], timeout=HANG_GUARD)
        assert r.success, r.error
        reads = [op for op in s.ops(reads=cache[3], kind="device") if op.seq > kernel.seq]
        assert reads
        for op in reads:
            assert s.happens_before(kernel, op), f"{op} may read block 3 before the compute stream wrote it"
        apply_result(manager, plan, r)
    finally:
        engine.close()


class _ByteTier:
    """A memory backend seen as a byte tier (not a ``MemoryBackend``), forcing staged stores."""

    def __init__(self, inner: CpuBackend) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_the_fence_waits_for_the_device_read_only_not_a_stalled_lower_tier(tmp_path: Any) -> None:
    g = torch.Generator().manual_seed(5)
    kv = [torch.randn(16, 4, 8, generator=g) for _ in range(2)]
    bb = 2 * 4 * 8 * 4
    cfg = {
        "tiers": [
            {"backend": "cpu", "capacity": 2 * bb},
            {"backend": "file", "path": str(tmp_path), "capacity": 64 * bb},
        ],
        "write": "back",  # the stalled disk is reached by demotion
        "job_deadline_s": None,
    }
    async with kvtier.open(cfg, kv_caches=kv) as store:
        assert await store.save(K[:2], [0, 1]) == 2  # the first tier is full
        assert store.manager is not None and store.transfers is not None
        gate = Gate()
        lower = store.backends[1]
        lower.write_blocks = gate.wrap(lower.write_blocks)  # type: ignore[method-assign]
        plan = store.manager.prepare_store(K[2:4])
        assert plan is not None and plan.demotions  # K[0], K[1] go down to the (stalled) disk
        job = store.transfers.submit_store(plan, [2, 3])
        # The fence returns while the disk write-back is still blocked on the gate.
        await asyncio.to_thread(store.transfers.wait_device, [job], HANG_GUARD)
        assert await asyncio.to_thread(gate.entered.wait, HANG_GUARD)
        assert not gate.opened.is_set()
        assert store.transfers.result(job) is None, "the job itself is not finished"
        # The engine reuses blocks 2 and 3 at once: the stored bytes are those read before.
        want = [[x[b].clone() for x in kv] for b in (2, 3)]
        for x in kv:
            x[2:4].fill_(-5.0)
        gate.opened.set()
        (result,) = await asyncio.to_thread(store.transfers.wait, [job], HANG_GUARD)
        store.transfers.forget([job])
        assert store.finish_store(plan, result) == 2
        assert await store.load(K[2:4], [8, 9], promote=False) == 2
        for b, w in zip((8, 9), want):
            assert all(torch.equal(x[b], y) for x, y in zip(kv, w))
        assert await store.load(K[:1], [10], promote=False) == 1  # the demoted block is on disk
