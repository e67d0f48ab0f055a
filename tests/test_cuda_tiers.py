"""On a real CUDA device: a memory tier's call has finished its copies when it returns, waits on
the devices it touched only, and never on the engine's compute stream; a gpu tier's batched
read (one gather, one DMA) and a staged write-through into a byte tier (one host copy per job)
give the right bytes.

Each test queues a long ``torch.cuda._sleep`` ahead of the tier's copies on the stream they go
to, so a call that returned before its copies landed would leave stale bytes for the host to
see. Marked ``cuda`` (``scripts/gpu_check.sh`` runs them); the same orderings are checked on CPU
through the stand-in in ``test_device_ordering.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from kvtier.backends.memory import CpuBackend, GpuBackend

from kvtier.backend import BlockFormat
from kvtier.devices import tensor_device
from kvtier.testing import make_key

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA TESTS NOT RUN: no CUDA device here"),
]

SLEEP_CYCLES = 500_000_000  # a spinning kernel of a good fraction of a second
BLOCK = 1 << 20
FMT = BlockFormat(block_bytes=BLOCK)
KEYS = [make_key(600 + i) for i in range(4)]


def _rows(device: str) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, device=device) for _ in KEYS]


def test_a_cpu_tier_write_from_device_rows_has_landed_when_it_returns() -> None:
    cpu = CpuBackend(capacity=len(KEYS) * BLOCK)
    asyncio.run(cpu.open(FMT))
    rows = _rows("cuda")
    want = [r.cpu() for r in rows]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the tier's copies queue behind this
        assert all(s is not None for s in cpu.write_blocks(KEYS, rows))
    pool = cpu.pool
    for key, row in zip(KEYS, want):
        (slot,) = cpu.slots([key])
        assert torch.equal(pool[slot], row), "write_blocks returned before its device-to-host copy landed"
    asyncio.run(cpu.aclose())


def _filled_gpu_tier(device: str) -> tuple[GpuBackend, list[torch.Tensor], list[torch.Tensor]]:
    """A gpu tier on ``device`` holding ``KEYS``: (tier, its rows, pinned rows to read into)."""
    gpu = GpuBackend(capacity=len(KEYS) * BLOCK, device=device)
    asyncio.run(gpu.open(FMT))
    rows = _rows(device)
    gpu.write_blocks(KEYS, rows)
    return gpu, rows, [torch.empty(BLOCK, dtype=torch.uint8, pin_memory=True) for _ in KEYS]


def test_a_gpu_tier_read_waits_for_its_own_stream_not_the_compute_stream() -> None:
    gpu, rows, out = _filled_gpu_tier("cuda:0")
    torch.cuda._sleep(SLEEP_CYCLES)  # the engine's compute stream is busy
    busy = torch.cuda.Event()
    busy.record()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert gpu.read_blocks(KEYS, out) == [True] * len(KEYS)
    assert not busy.query(), "read_blocks waited for the compute stream"
    for got, row in zip(out, rows):
        assert torch.equal(got, row.cpu())
    torch.cuda.synchronize()
    asyncio.run(gpu.aclose())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices, this machine has one")
def test_a_gpu_tier_on_another_device_waits_for_that_device() -> None:
    gpu, rows, out = _filled_gpu_tier("cuda:1")
    with torch.cuda.device(1):
        torch.cuda._sleep(SLEEP_CYCLES)  # cuda:1's current stream: the copies queue behind this
    assert torch.cuda.current_device() == 0
    assert gpu.read_blocks(KEYS, out) == [True] * len(KEYS)
    for got, row in zip(out, rows):
        assert torch.equal(got, row.cpu()), "read_blocks waited on the wrong device"
    asyncio.run(gpu.aclose())


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 0, 2, 1]], ids=["consecutive-slots", "gathered"])
def test_a_gpu_tier_read_into_consecutive_host_rows_has_landed_when_it_returns(order: list[int]) -> None:
    """The batched read (one gather, one DMA) into rows of one pinned buffer, behind a busy
    stream: the bytes are there when the call returns."""
    gpu, rows, _ = _filled_gpu_tier("cuda:0")
    staging = torch.zeros((len(order), BLOCK), dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the tier's gather and DMA queue behind this
        assert gpu.read_blocks([KEYS[i] for i in order], list(staging)) == [True] * len(order)
    for i, k in enumerate(order):
        assert torch.equal(staging[i], rows[k].cpu()), "read_blocks returned before its batched copy landed"
    asyncio.run(gpu.aclose())


def test_a_staged_write_through_hands_the_byte_tier_host_rows_of_the_engine_bytes() -> None:
    """A store staged on the device (its first tier a gpu tier, the tiers thread busy) writes
    through to a byte tier from one host copy of its staging: host rows, the engine's bytes."""
    import threading

    from test_transfer import DictBackend

    from kvtier.manager import TierManager, TierSpec
    from kvtier.manager.policies import LRUPolicy
    from kvtier.transfer import TransferEngine
    from kvtier.transfer.layout import KVLayout

    cache = torch.randint(0, 256, (16, BLOCK), dtype=torch.uint8, device="cuda")
    layout = KVLayout([cache])
    gpu = GpuBackend(capacity=8 * BLOCK)
    disk = DictBackend(capacity=8 * BLOCK)
    for b in (gpu, disk):
        asyncio.run(b.open(FMT))
    entered, opened = threading.Event(), threading.Event()
    devices: list[str] = []
    inner = disk.write_blocks

    def write(keys: Any, blocks: Any) -> Any:
        devices.extend(str(tensor_device(b)) for b in blocks)
        entered.set()
        assert opened.wait(30)
        return inner(keys, blocks)

    disk.write_blocks = write  # type: ignore[method-assign]
    specs = [TierSpec("gpu", 8 * BLOCK, BLOCK, LRUPolicy(8)), TierSpec("disk", 8 * BLOCK, BLOCK, LRUPolicy(8))]
    manager = TierManager(specs, write="through")
    engine = TransferEngine(layout, [gpu, disk])
    try:
        keys = [make_key(700 + i) for i in range(5)]
        plan_a, plan_b = manager.prepare_store(keys[:1]), manager.prepare_store(keys[1:])
        assert plan_a is not None and plan_b is not None
        a = engine.submit_store(plan_a, [0])
        assert entered.wait(30)
        torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy when B is submitted
        cache[9].fill_(7)  # written by the compute stream before B's read
        b = engine.submit_store(plan_b, [9, 1, 5, 2])
        engine.wait_device([b], timeout=30)
        opened.set()
        ra, rb = engine.wait([a, b], timeout=30)
        assert ra.success and rb.success, (ra.error, rb.error)
        assert engine.counters["staged_jobs"] == 1
        assert devices[1:] == ["cpu"] * 4, devices
        for key, blk in zip(keys[1:], [9, 1, 5, 2]):
            assert torch.equal(disk.data[key], cache[blk].cpu())
    finally:
        opened.set()
        engine.close()
        for b in (gpu, disk):
            asyncio.run(b.aclose())
