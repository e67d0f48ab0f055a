"""On a real CUDA device: a memory tier's call has finished its copies when it returns, waits on
the devices it touched only, and never on the engine's compute stream.

Each test queues a long ``torch.cuda._sleep`` ahead of the tier's copies on the stream they go
to, so a call that returned before its copies landed would leave stale bytes for the host to
see. Marked ``cuda`` (``scripts/gpu_check.sh`` runs them); the same orderings are checked on CPU
through the stand-in in ``test_device_ordering.py``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from kvtier.backends.memory import CpuBackend, GpuBackend

from kvtier.backend import BlockFormat
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
