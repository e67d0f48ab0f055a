"""Byte tiers fed from device memory get their rows in one copy per job, checked on CPU through
the CUDA stand-in (``tests/cuda_standin.py``) against the general path, one copy per block:

* a store staged on the device (its first tier a ``gpu`` tier, the tiers thread busy) hands
  its byte write-through host rows copied out of the device staging with one DMA, where the
  byte tier's encoder made one blocking copy per device row;
* a ``gpu`` tier's ``read_blocks`` into consecutive host rows (a staging buffer) is one gather
  and one DMA, not a copy per block; what a write-through after a direct store and a demotion
  out of a ``gpu`` tier read through.

Each comparison runs the same jobs both ways: the bytes the byte tier holds are equal, the
copies are ordered after what wrote their source and before what reads their destination, and
the number of copies per job is counted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest
import torch
from device_world import DeviceWorld
from kvtier.backends import memory

from kvtier.backend import BlockFormat
from kvtier.devices import tensor_device
from kvtier.testing import make_key
from kvtier.transfer import movers

if TYPE_CHECKING:
    from cuda_standin import CudaStandIn, Op

pytest_plugins = ("cuda_standin",)

K = [make_key(1300 + i) for i in range(16)]
HOST_ROWS = movers.host_rows


def _copies_out_of_the_device(s: CudaStandIn, since: Op, thread: str) -> list[Op]:
    """Device-to-host copies ``thread`` queued after ``since``."""
    return [
        op
        for op in s.ops(kind="device")
        if op.seq > since.seq
        and op.thread == thread
        and op.name in ("copy_", "to", "_foreach_copy_")
        and not any(_is_device_range(s, r) for r in op.writes)
    ]


def _is_device_range(s: CudaStandIn, r: tuple[int, int]) -> bool:
    with s._lock:
        storages = [st for st, _ in s._device.values()]
    return any(st.data_ptr() <= r[0] < st.data_ptr() + st.nbytes() for st in storages)


def _watch_byte_writes(s: CudaStandIn, w: DeviceWorld, tier: int) -> list[tuple[Op, list[torch.device]]]:
    """Log a host op reading the rows of each ``write_blocks`` of ``tier`` (its encoder's read)."""
    seen: list[tuple[Op, list[torch.device]]] = []
    inner = w.backends[tier].write_blocks

    def write(keys: Sequence[bytes], rows: Sequence[torch.Tensor]) -> Any:
        devices = [tensor_device(r) for r in rows]
        if all(d.type == "cpu" for d in devices):
            seen.append((s.mark("byte tier encodes its rows", reads=rows, on_host=True), devices))
        else:
            seen.append((s.mark("byte tier gets device rows", on_host=True), devices))
        return inner(keys, rows)

    w.backends[tier].write_blocks = write  # type: ignore[method-assign]
    return seen


def _staged_store(s: CudaStandIn, batched: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Job A (1 block, direct) holds the tiers thread in its byte write; job B (4 blocks) is
    staged on the device meanwhile, then written through to the byte tier."""
    # The general path: device rows straight to the byte tier.
    monkeypatch.setattr(movers, "host_rows", HOST_ROWS if batched else lambda staging, positions: {})
    w = DeviceWorld(s, ["gpu", "bytes"], blocks=[8, 8], write="through")
    entered, opened = threading.Event(), threading.Event()
    inner = w.backends[1].write_blocks

    def gated(keys: Sequence[bytes], rows: Sequence[torch.Tensor]) -> Any:
        entered.set()
        assert opened.wait(30), "gate never opened"
        return inner(keys, rows)

    w.backends[1].write_blocks = gated  # type: ignore[method-assign]
    seen = _watch_byte_writes(s, w, 1)
    try:
        plan_a = w.manager.prepare_store(K[:1])
        plan_b = w.manager.prepare_store(K[1:5])
        assert plan_a is not None and plan_b is not None
        a = w.engine.submit_store(plan_a, [0])
        assert entered.wait(30)
        b = w.engine.submit_store(plan_b, [3, 1, 7, 2])
        w.engine.wait_device([b], timeout=30)
        assert w.engine.counters["staged_jobs"] == 1
        gate = s.mark("the gate opens", on_host=True)
        opened.set()
        ra, rb = w.engine.wait([a, b], timeout=30)
        w.quiet("both stores were reported")
        assert ra.success and rb.success, (ra.error, rb.error)
        assert w.violations == []
        data = w.backends[1].data  # type: ignore[attr-defined]
        return {
            "bytes": {k: data[k].clone() for k in K[1:5]},
            "want": {k: w.cache[b].clone() for k, b in zip(K[1:5], [3, 1, 7, 2])},
            "copies": _copies_out_of_the_device(s, gate, "kvtier-store-tiers"),
            "writes": seen[-1],
            "gathers": [op for op in s.ops(kind="device") if op.thread == "kvtier-store" and op.seq < gate.seq],
        }
    finally:
        opened.set()
        w.close()


def test_a_staged_write_through_into_a_byte_tier_is_one_copy_per_job(
    cuda_standin: CudaStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = cuda_standin
    general = _staged_store(s, False, monkeypatch)
    s.clear()
    batched = _staged_store(s, True, monkeypatch)
    # The same bytes, and the engine's.
    assert general["bytes"].keys() == batched["bytes"].keys()
    for k, want in batched["want"].items():
        assert torch.equal(general["bytes"][k], want)
        assert torch.equal(batched["bytes"][k], want)
    # One blocking copy per block before; one DMA for the job now.
    assert len(general["copies"]) == 4, general["copies"]
    assert all(d.type == "cuda" for d in general["writes"][1])
    (dma,) = batched["copies"]
    write, devices = batched["writes"]
    assert all(d.type == "cpu" for d in devices), devices
    assert [op.name for op in (dma,)] == ["copy_"]
    # Ordered: after the device read that filled the staging, before the tier reads the rows.
    assert batched["gathers"] and all(s.happens_before(op, dma) for op in batched["gathers"])
    assert s.happens_before(dma, write)


def test_a_write_through_after_a_direct_store_reads_the_gpu_tier_in_one_copy(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    w = DeviceWorld(s, ["gpu", "bytes"], blocks=[8, 8], write="through", staging_blocks=4)
    seen = _watch_byte_writes(s, w, 1)
    try:
        start = s.mark("before the store", on_host=True)
        res = w.store(K[:4], [5, 0, 9, 2])
        assert res is not None and res[0].success
        assert w.violations == []
        copies = _copies_out_of_the_device(s, start, "kvtier-store-tiers")
        assert len(copies) == 1, copies  # one chunk of 4 staging rows: one DMA, not four
        (write, devices) = seen[-1]
        assert all(d.type == "cpu" for d in devices)
        assert s.happens_before(copies[0], write)
        data = w.backends[1].data  # type: ignore[attr-defined]
        for k, b in zip(K[:4], [5, 0, 9, 2]):
            assert torch.equal(data[k], w.cache[b])
    finally:
        w.close()


def _gpu_tier(s: CudaStandIn, blocks: int = 8, words: int = 64) -> tuple[memory.GpuBackend, list[torch.Tensor]]:
    gpu = memory.GpuBackend(capacity=blocks * words, device="cuda:0")
    asyncio.run(gpu.open(BlockFormat(block_bytes=words)))
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 256, (words,), dtype=torch.uint8, generator=g) for _ in range(blocks)]
    assert gpu.write_blocks(K[:blocks], rows) == [words] * blocks
    return gpu, rows


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5, 6, 7], [6, 1, 7, 0, 3]], ids=["consecutive-slots", "gathered"])
def test_a_gpu_tier_read_into_consecutive_host_rows_is_one_copy(cuda_standin: CudaStandIn, order: list[int]) -> None:
    s = cuda_standin
    gpu, rows = _gpu_tier(s)
    keys = [K[i] for i in order]
    staging = torch.full((len(order), 64), 7, dtype=torch.uint8, pin_memory=True)
    start = s.mark("before the batched read", on_host=True)
    assert gpu.read_blocks(keys, [staging[i] for i in range(len(order))]) == [True] * len(order)
    done = s.mark("after it returned", on_host=True)
    ops = [op for op in s.ops(kind="device") if op.seq > start.seq]
    assert [op.name for op in ops if op.name == "copy_"] == ["copy_"], ops
    assert len([op for op in ops if op.name == "index_select"]) == (0 if order == sorted(order) else 1)
    assert all(s.happens_before(op, done) for op in ops)
    # The general path: separate host rows, a copy per block; the same bytes.
    separate = [torch.zeros(64, dtype=torch.uint8, pin_memory=True) for _ in order]
    start = s.mark("before the per-block read", on_host=True)
    assert gpu.read_blocks(keys, separate) == [True] * len(order)
    assert len([op for op in s.ops("copy_", kind="device") if op.seq > start.seq]) == len(order)
    for i, k in enumerate(order):
        assert torch.equal(staging[i], rows[k]) and torch.equal(separate[i], rows[k])
    asyncio.run(gpu.aclose())


def test_a_batched_gpu_tier_read_gathers_in_bounded_pieces(cuda_standin: CudaStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    s = cuda_standin
    gpu, rows = _gpu_tier(s)
    monkeypatch.setattr(memory, "GATHER_BYTES", 3 * 64)  # three blocks of device memory at a time
    order = [7, 5, 3, 1, 0, 2, 4]
    staging = torch.zeros((len(order), 64), dtype=torch.uint8, pin_memory=True)
    start = s.mark("before", on_host=True)
    assert gpu.read_blocks([K[i] for i in order], list(staging)) == [True] * len(order)
    ops = [op for op in s.ops(kind="device") if op.seq > start.seq]
    # pieces of 3 + 3 + 1 blocks: two gathers (one block needs none), three DMAs
    assert len([op for op in ops if op.name == "index_select"]) == 2
    assert len([op for op in ops if op.name == "copy_"]) == 3
    for i, k in enumerate(order):
        assert torch.equal(staging[i], rows[k])
    assert gpu.stats()["blocks_read"] == len(order)
    asyncio.run(gpu.aclose())


def test_a_gpu_tier_read_with_a_miss_leaves_the_missing_row_alone(cuda_standin: CudaStandIn) -> None:
    gpu, rows = _gpu_tier(cuda_standin)
    staging = torch.full((3, 64), 7, dtype=torch.uint8, pin_memory=True)
    assert gpu.read_blocks([K[2], make_key(99_999), K[4]], list(staging)) == [True, False, True]
    assert torch.equal(staging[0], rows[2]) and torch.equal(staging[2], rows[4])
    assert bool((staging[1] == 7).all()), "a missing key's row was written"
    stats = gpu.stats()
    assert (stats["blocks_read"], stats["read_misses"]) == (2, 1)
    asyncio.run(gpu.aclose())


def test_a_demotion_out_of_a_gpu_tier_is_one_copy_per_chunk(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    w = DeviceWorld(s, ["gpu", "bytes"], blocks=[4, 8], staging_blocks=4)
    try:
        assert w.store(K[:4], [0, 1, 2, 3]) is not None
        start = s.mark("before the demoting store", on_host=True)
        assert w.store(K[4:8], [4, 5, 6, 7]) is not None  # demotes the first four
        copies = _copies_out_of_the_device(s, start, "kvtier-store-tiers")
        assert len(copies) == 1, copies
        assert w.violations == []
        data = w.backends[1].data  # type: ignore[attr-defined]
        for k, b in zip(K[:4], [0, 1, 2, 3]):
            assert torch.equal(data[k], w.cache[b])
    finally:
        w.close()
