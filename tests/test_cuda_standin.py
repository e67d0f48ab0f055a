"""The CUDA stand-in itself: its ordering model is CUDA's (stream order, events, host sync)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import pytest
import torch

import kvtier.devices
import kvtier.transfer.staging

if TYPE_CHECKING:
    from cuda_standin import CudaStandIn

pytest_plugins = ("cuda_standin",)


def test_device_and_pinned_allocation(cuda_standin: CudaStandIn) -> None:
    assert torch.cuda.is_available()
    dev = torch.zeros((4, 8), dtype=torch.uint8, device="cuda")
    host = torch.empty((4, 8), dtype=torch.uint8, pin_memory=True)
    plain = torch.empty((4, 8), dtype=torch.uint8)
    assert dev.device.type == "cpu", "tensors stay on the CPU"
    assert kvtier.transfer.staging.tensor_device(dev) == torch.device("cuda", 0)
    assert kvtier.transfer.staging.tensor_device(dev[1:]) == torch.device("cuda", 0), "views share the registry"
    assert kvtier.transfer.staging.tensor_device(host) == torch.device("cpu")
    assert host.is_pinned() and not plain.is_pinned() and not dev.is_pinned()
    back = dev.cpu()
    assert not cuda_standin.is_device(back) and torch.equal(back, dev)
    assert cuda_standin.is_device(torch.empty_like(dev)) and not cuda_standin.is_device(torch.empty_like(host))


def test_device_allocation_over_the_free_memory_raises(cuda_standin: CudaStandIn) -> None:
    cuda_standin.device_memory_free = 1000
    torch.empty(1000, dtype=torch.uint8, device="cuda")
    with pytest.raises(torch.OutOfMemoryError, match="1001 bytes"):
        torch.empty(1001, dtype=torch.uint8, device="cuda")
    torch.empty(5000, dtype=torch.uint8)  # host memory is not limited


def test_stream_order_events_and_host_sync(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    a = torch.zeros(16, dtype=torch.uint8, device="cuda")
    b = torch.zeros(16, dtype=torch.uint8, device="cuda")
    host = torch.zeros(16, dtype=torch.uint8, pin_memory=True)
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    a.fill_(1)
    kernel = s.ops("fill_")[-1]
    assert kernel.stream is compute
    with torch.cuda.stream(side):
        b.copy_(a)  # no wait: unordered with the kernel
    unordered = s.ops("copy_")[-1]
    assert unordered.stream is side
    assert not s.happens_before(kernel, unordered) and not s.happens_before(unordered, kernel)
    ev = torch.cuda.Event()
    ev.record(compute)
    side.wait_event(ev)
    with torch.cuda.stream(side):
        host.copy_(b, non_blocking=True)
    dma = s.ops("copy_", writes=host)[-1]
    assert s.happens_before(kernel, dma) and not s.happens_before(dma, kernel)
    # The host reads `host` only after synchronising the event recorded behind the DMA.
    done = torch.cuda.Event()
    done.record(side)
    early = s.mark("host-read", reads=[host], on_host=True)
    done.synchronize()
    late = s.mark("host-read", reads=[host], on_host=True)
    assert not s.happens_before(dma, early) and s.happens_before(dma, late)
    # An op enqueued after a host op is ordered after it (enqueue order).
    with torch.cuda.stream(side):
        b.zero_()
    assert s.happens_before(early, s.ops("zero_")[-1])


def test_wait_on_an_unrecorded_event_orders_nothing(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    a = torch.zeros(8, device="cuda")
    side = torch.cuda.Stream()
    a.fill_(2)
    ev = torch.cuda.Event()
    side.wait_event(ev)
    with torch.cuda.stream(side):
        a.zero_()
    assert s.ops("wait_event")[-1].detail == "unrecorded"
    assert not s.happens_before(s.ops("fill_")[-1], s.ops("zero_")[-1])


def test_current_stream_is_per_thread_and_blocking_copies_sync(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    side = torch.cuda.Stream()
    seen = []
    dev = torch.ones(8, device="cuda")
    host = torch.zeros(8)

    def worker() -> None:
        seen.append(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(dev)  # blocking: the host waits for the stream
        s.mark("after", on_host=True)

    with torch.cuda.stream(side):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == [s.default_stream]
    copy = s.ops("copy_")[-1]
    assert s.happens_before(copy, s.ops("after")[-1])
    assert torch.equal(host, dev)


def test_a_layout_on_the_stand_in_device_moves_exact_bytes(cuda_standin: CudaStandIn) -> None:
    from kvtier.transfer.layout import KVLayout

    cache = torch.randint(0, 256, (6, 64), dtype=torch.uint8, device="cuda")
    layout = KVLayout([cache])
    assert layout.device == torch.device("cuda", 0)
    pool = torch.zeros((3, 64), dtype=torch.uint8, pin_memory=True)
    layout.gather([4, 1], pool, [2, 0], non_blocking=True)
    assert torch.equal(pool[2], cache[4]) and torch.equal(pool[0], cache[1])
    assert s_ops_on_device(cuda_standin), "the copies were logged as device ops"


def s_ops_on_device(s: CudaStandIn) -> list[object]:
    return [op for op in s.ops(kind="device") if op.name not in ("record", "wait_event", "wait_stream")]


def test_completion_seen_by_one_thread_orders_later_ops_of_every_thread(cuda_standin: CudaStandIn) -> None:
    s = cuda_standin
    side = torch.cuda.Stream()
    dev = torch.zeros(8, device="cuda")
    with torch.cuda.stream(side):
        dev.fill_(1)
    copy = s.ops("fill_")[-1]
    early = s.mark("engine op before the worker synced")
    ev = torch.cuda.Event()
    ev.record(side)
    t = threading.Thread(target=ev.synchronize)
    t.start()
    t.join()
    late = s.mark("engine op after the worker synced")
    assert not s.happens_before(copy, early) and s.happens_before(copy, late)


def test_two_devices_each_have_their_own_streams_and_synchronize_waits_for_one(cuda_standin_two: CudaStandIn) -> None:
    s = cuda_standin_two
    a = torch.zeros(16, dtype=torch.uint8, device="cuda:0")
    b = torch.zeros(16, dtype=torch.uint8, device="cuda:1")
    assert kvtier.devices.tensor_device(a) == torch.device("cuda", 0)
    assert kvtier.devices.tensor_device(b) == torch.device("cuda", 1)
    assert torch.cuda.device_count() == 2
    assert torch.cuda.current_stream(1) is not torch.cuda.current_stream(0)
    b.fill_(1)
    on_1 = s.ops("fill_")[-1]
    assert on_1.stream is torch.cuda.current_stream(1)
    torch.cuda.synchronize()  # the current device: cuda:0 only
    assert not s.happens_before(on_1, s.mark("host after synchronize(0)", on_host=True))
    torch.cuda.synchronize(1)
    assert s.happens_before(on_1, s.mark("host after synchronize(1)", on_host=True))


def test_a_stream_context_makes_its_device_current_and_a_peer_copy_orders_both_streams(
    cuda_standin_two: CudaStandIn,
) -> None:
    s = cuda_standin_two
    a = torch.zeros(16, dtype=torch.uint8, device="cuda:0")
    side = torch.cuda.Stream(device="cuda:1")
    assert side.device == torch.device("cuda", 1)
    with torch.cuda.stream(side):
        assert torch.cuda.current_device() == 1
        b = torch.empty(16, dtype=torch.uint8, device="cuda")  # the current device
        b.fill_(2)
    assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(1) is not side
    assert kvtier.devices.tensor_device(b) == torch.device("cuda", 1)
    fill = s.ops("fill_")[-1]
    assert fill.stream is side
    torch.cuda.current_stream(1).wait_stream(side)
    a.copy_(b, non_blocking=True)  # peer copy: on cuda:0's current stream, after cuda:1's
    peer = s.ops("copy_")[-1]
    assert peer.stream is torch.cuda.current_stream(0)
    assert s.happens_before(fill, peer)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.empty(4, device="cuda:2")
