"""Device ordering of the transfer paths out of and into gpu and cpu tiers, on one device and
on two, checked on CPU through the CUDA stand-in (``tests/cuda_standin.py``), and the report
of a load job that fails.

Each test runs jobs through :class:`device_world.DeviceWorld`, which notes every copy a kvtier
thread queued that is still unordered with the host once its job is reported, or once the tier
call that queued it has returned (see that module)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest
import torch
from device_world import DeviceWorld, Faults, pool_of

import kvtier
from kvtier.devices import tensor_device
from kvtier.errors import BackendError
from kvtier.testing import make_key

if TYPE_CHECKING:
    from cuda_standin import CudaStandIn

pytest_plugins = ("cuda_standin",)

K = [make_key(900 + i) for i in range(32)]


def test_the_stand_in_places_pools_on_their_devices(cuda_standin_two: CudaStandIn) -> None:
    w = DeviceWorld(cuda_standin_two, ["gpu", "gpu1", "cpu"])
    try:
        assert w.layout.device == torch.device("cuda", 0)
        assert [tensor_device(pool_of(b)) for b in w.backends] == [
            torch.device("cuda", 0),
            torch.device("cuda", 1),
            torch.device("cpu"),
        ]
        assert pool_of(w.backends[2]).is_pinned()
    finally:
        w.close()


@pytest.mark.parametrize("where", ["gpu", "gpu1"])
def test_a_demotion_out_of_a_gpu_tier_hands_a_byte_tier_host_rows_it_may_read(
    request: pytest.FixtureRequest, where: str
) -> None:
    """The demoted blocks are read out of the pool (on the engine's device, or on another)
    into host rows, each wait on the pool's own device only, then handed to the byte tier."""
    s = request.getfixturevalue("cuda_standin_two")
    w = DeviceWorld(s, [where, "bytes"], blocks=[2, 8])
    seen: list[torch.device] = []
    inner = w.backends[1].write_blocks

    def write(keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        seen.extend(tensor_device(b) for b in blocks)
        return inner(keys, blocks)  # type: ignore[no-any-return]

    w.backends[1].write_blocks = write  # type: ignore[method-assign]
    try:
        for i in range(4):
            assert w.store(K[i : i + 1], [i]) is not None
        assert seen and all(d.type == "cpu" for d in seen), seen
        # gpu1: reading the pool on cuda:1 waited for cuda:1's copies, not for cuda:0's.
        assert w.violations == []
        assert not [op for op in s.ops("synchronize") if op.detail == "device" and op.thread.startswith("kvtier-")]
        for i in range(4):
            got = w.load(K[i : i + 1], [8 + i])
            assert got is not None and got[1].done == 1
        assert w.violations == []
    finally:
        w.close()


def test_a_gpu_tier_on_the_engine_device_never_stalls_the_compute_stream(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    w = DeviceWorld(s, ["gpu", "bytes"], blocks=[2, 8])
    entered, opened = _gated(w, 0, "read_blocks")
    try:
        for i in range(2):
            assert w.store(K[i : i + 1], [i]) is not None
        plan = w.manager.prepare_store(K[2:3])
        assert plan is not None and plan.demotions
        job = w.engine.submit_store(plan, [2])
        assert entered.wait(30)  # the demotion is about to read the gpu tier
        kernel = s.mark("attention of the next step (queued after the store was submitted)")
        opened.set()
        (r,) = w.engine.wait([job], timeout=30)
        assert r.success
        late = [op for op in s.ops(kind="host") if op.seq > kernel.seq and op.thread.startswith("kvtier-")]
        assert late, "the tier work ran before the kernel was queued"
        assert not any(s.happens_before(kernel, op) for op in late), "a tier call waited for the compute stream"
        assert w.violations == []
    finally:
        opened.set()
        w.close()


def _gated(w: DeviceWorld, tier: int, call: str) -> tuple[threading.Event, threading.Event]:
    """Make tier ``tier``'s ``call`` wait until the second event is set (the first tells it
    was reached)."""
    entered, opened = threading.Event(), threading.Event()
    inner = getattr(w.backends[tier], call)

    def gated(keys: Sequence[bytes], rows: Sequence[torch.Tensor]) -> Any:
        entered.set()
        assert opened.wait(30), "gate never opened"
        return inner(keys, rows)

    setattr(w.backends[tier], call, gated)
    return entered, opened


@pytest.mark.parametrize("first", ["gpu", "gpu1"])
def test_write_through_from_device_staging_into_the_cpu_tier_lands_before_the_job_is_done(
    request: pytest.FixtureRequest, first: str
) -> None:
    s = request.getfixturevalue("cuda_standin_two")
    w = DeviceWorld(s, [first, "cpu", "bytes"], blocks=[8, 8, 8], write="through")
    entered, opened = _gated(w, 2, "write_blocks")
    try:
        # Job A holds the tiers thread in its byte write-through; job B, queued behind it,
        # is staged: its blocks go to device staging, then into the gpu and the cpu tier.
        plan_a = w.manager.prepare_store(K[:1])
        plan_b = w.manager.prepare_store(K[1:3])
        assert plan_a is not None and plan_b is not None
        assert [t for t, _ in plan_b.write_through] == [1, 2]
        a = w.engine.submit_store(plan_a, [0])
        assert entered.wait(30)
        b = w.engine.submit_store(plan_b, [1, 2])
        w.engine.wait_device([b], timeout=30)
        assert w.engine.counters["staged_jobs"] == 1
        opened.set()
        ra, rb = w.engine.wait([a, b], timeout=30)
        w.quiet("both stores were reported")
        assert ra.success and rb.success, (ra.error, rb.error)
        cpu = pool_of(w.backends[1])
        for k, blk in zip(K[1:3], [1, 2]):
            (slot,) = w.backends[1].slots([k])  # type: ignore[attr-defined]
            assert torch.equal(cpu[slot], w.cache[blk])
        assert w.violations == []
    finally:
        opened.set()
        w.close()


def test_a_promotion_out_of_a_gpu_tier_into_the_cpu_tier_lands_before_the_load_is_done(
    cuda_standin_two: CudaStandIn,
) -> None:
    w = DeviceWorld(cuda_standin_two, ["cpu", "gpu1"], blocks=[2, 8])
    try:
        for i in range(3):  # the first is demoted into the gpu tier
            assert w.store(K[i : i + 1], [i]) is not None
        assert w.manager.remove(K[2:3], 0)  # room in the first tier for the promotion
        w.backends[0].delete_blocks(K[2:3])
        assert w.manager.lookup(K[:1]) == 1
        plan = w.manager.prepare_load(K[:1], promote=True)
        assert plan.tiers == (1,) and plan.promote
        (r,) = w.engine.wait([w.engine.submit_load(plan, [9])], timeout=30)
        w.quiet("the promoting load was reported")
        assert r.success
        (slot,) = w.backends[0].slots(K[:1])  # type: ignore[attr-defined]
        assert torch.equal(pool_of(w.backends[0])[slot], w.cache[0])
        assert w.violations == []
    finally:
        w.close()


@pytest.mark.parametrize("tiers", [["cpu"], ["gpu1"]], ids=["cpu", "gpu-on-another-device"])
def test_a_store_failing_between_two_chunks_waits_for_the_chunks_already_queued(
    request: pytest.FixtureRequest, tiers: list[str]
) -> None:
    faults = Faults()
    w = DeviceWorld(request.getfixturevalue("cuda_standin_two"), tiers, blocks=[8], faults=faults)
    try:
        faults.arm("gather_chunk", 1)
        got = w.store(K[:3], [0, 1, 2])
        assert got is not None and not got[0].success and faults.fired
        assert w.violations == []
        assert w.manager.lookup(K[:3]) == 0
        # The freed slots are reused by the next store; its bytes are its own.
        got = w.store(K[3:6], [3, 4, 5])
        assert got is not None and got[0].success
        got = w.load(K[3:6], [10, 11, 12])
        assert got is not None and got[1].done == 3
        assert w.violations == []
    finally:
        w.close()


def test_a_load_failing_between_two_chunks_waits_for_the_chunks_already_queued(cuda_standin: CudaStandIn) -> None:
    faults = Faults()
    w = DeviceWorld(cuda_standin, ["cpu"], blocks=[8], faults=faults)
    try:
        got = w.store(K[:3], [0, 1, 2])
        assert got is not None and got[0].success
        faults.arm("scatter_chunk", 1)
        got = w.load(K[:3], [10, 11, 12])
        assert got is not None and got[0].error is not None and faults.fired
        assert w.violations == []
    finally:
        w.close()


def test_a_load_whose_device_copy_raises_is_reported_at_once(cuda_standin: CudaStandIn) -> None:
    faults = Faults()
    w = DeviceWorld(cuda_standin, ["cpu"], blocks=[8], faults=faults)
    try:
        assert w.store(K[:2], [0, 1]) is not None
        faults.arm("scatter", 0)
        plan = w.manager.prepare_load(K[:2], promote=False)
        job = w.engine.submit_load(plan, [10, 11])
        (r,) = w.engine.wait([job], timeout=10)  # no deadline is set: only the job reports
        assert not r.success and "injected" in (r.error or "")
        assert w.engine.pending_jobs() == 0
    finally:
        w.close()


def _caches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(16, 4, 8, generator=g) for _ in range(2)]


async def test_a_store_whose_load_copy_raises_returns_a_miss_without_a_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = _caches()
    cfg = {"tiers": [{"backend": "cpu", "capacity": "64KiB"}], "job_deadline_s": None}
    async with kvtier.open(cfg, kv_caches=kv) as store:
        assert await store.save([make_key(1)], [0]) == 1
        assert store.transfers is not None

        def broken(*args: Any, **kwargs: Any) -> None:
            raise OSError(5, "injected EIO")

        monkeypatch.setattr(store.transfers.layout, "scatter", broken)
        assert await asyncio.wait_for(store.load([make_key(1)], [9]), 10) == 0


async def test_a_backend_whose_whole_read_raises_is_a_miss_and_its_keys_are_not_offered_again(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = _caches()
    cfg = {
        "tiers": [{"backend": "cpu", "capacity": "2KiB"}, {"backend": "file", "capacity": "1MiB", "path": str(tmp_path)}],
        "write": "through",
    }
    async with kvtier.open(cfg, kv_caches=kv) as store:
        keys = [make_key(i) for i in range(12)]
        for i, k in enumerate(keys):
            assert await store.save([k], [i]) == 1
        gone = [k for k in keys if not store.manager.holds(k, 0)]
        assert gone, "the cpu tier should have dropped some keys to the file tier"
        calls = []

        def broken(keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
            calls.append(len(keys))
            raise BackendError("file: injected failure of the whole read")

        monkeypatch.setattr(store.backends[1], "read_blocks", broken)
        for _ in range(3):
            assert await store.load(gone[:1], [15]) == 0  # a miss, never an exception
        assert len(calls) == 1, "a key whose read failed is not offered again"
        assert await store.lookup(gone[:1]) == 0
        assert store.transfers is not None and store.transfers.counters["read_errors"] == 1
