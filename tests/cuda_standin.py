"""A stand-in for ``torch.cuda`` so that kvtier's CUDA code paths run, and are checked, on CPU.

Every tensor stays a CPU tensor and every operation runs at once, so the bytes that come out
are what a GPU would produce once all copies have finished. What the stand-in adds is the
*order*: each stream, event and copy is logged, and a vector clock per stream and per host
thread tells whether one logged operation is guaranteed to happen before another under CUDA's
rules. A test therefore asserts the ordering a real device would need (a copy that waits for an
event, a buffer reused only after the copy that read it), not just the bytes.

Use it through the ``cuda_standin`` fixture; a test module loads it as a plugin::

    from typing import TYPE_CHECKING
    if TYPE_CHECKING:
        from cuda_standin import CudaStandIn

    pytest_plugins = ("cuda_standin",)

    def test_x(cuda_standin: CudaStandIn) -> None:
        cache = torch.zeros((8, 1024), device="cuda")    # a CPU tensor kvtier sees on cuda:0
        layout = KVLayout([cache])                       # layout.device == cuda:0
        ...
        assert cuda_standin.happens_before(gather_op, dma_op)

While installed (the fixture installs it through ``monkeypatch`` and undoes it after the test):

- ``torch.cuda.is_available()`` is True; ``device_count()`` is ``devices`` (1 for the
  ``cuda_standin`` fixture, 2 for ``cuda_standin_two``); ``current_device()``, ``set_device``
  and the ``device(...)`` context manager keep a current device per thread, as CUDA does;
  ``init``, ``empty_cache``, ``get_device_name``, ``mem_get_info`` (from ``device_memory``)
  are there.
- ``torch.cuda.Stream(device=None, priority=0)``: ``wait_event(e)``, ``wait_stream(s)``,
  ``record_event(e=None)``, ``synchronize()``, ``query()``, ``with stream:``; ``.name``,
  ``.device``. Each device has its own default stream (``default``, ``default:1``).
- ``torch.cuda.Event(enable_timing=False, blocking=False, interprocess=False)``:
  ``record(stream=None)``, ``wait(stream=None)``, ``synchronize()``, ``query()``,
  ``elapsed_time(end)`` (host time between the two records, in ms).
- ``torch.cuda.current_stream(device=None)`` / ``default_stream()`` / ``set_stream(s)`` and the
  ``torch.cuda.stream(s)`` context manager; the current stream is per thread and per device,
  as in CUDA (``set_stream`` and ``stream(s)`` also make ``s``'s device the current one).
- ``torch.cuda.synchronize(device=None)`` waits for every stream of that device only (the
  current device when ``None``), as CUDA does; it is logged with ``detail == "device"``.
  ``torch.cuda._sleep(cycles)`` logs a ``_sleep`` op.
- Allocation with ``device="cuda"`` (``torch.empty``, ``zeros``, ``ones``, ``full``,
  ``tensor``, ``as_tensor``, ``arange``, ``randint``, ``*_like``) gives a CPU tensor that is
  registered as device memory (``tensor`` / ``as_tensor`` also log the blocking copy from
  pageable memory: an op on the current stream, then the host waits for it); ``pin_memory=True`` gives a CPU tensor registered as pinned
  (``Tensor.is_pinned()`` and ``Tensor.pin_memory()`` answer from that registry). A device
  allocation larger than ``device_memory_free`` raises ``torch.OutOfMemoryError``; one on a
  device index past ``devices`` raises as CUDA does. ``device="cuda"`` means the current device.
  ``Tensor.to("cuda")``, ``.cuda()`` and ``.cpu()`` copy between the registries.
- ``kvtier.devices.tensor_device(t)`` (kvtier's one place that asks where a tensor lives)
  answers ``cuda:i`` for a tensor registered on device ``i``, so kvtier takes every branch a
  GPU takes. ``t.device`` itself still says ``cpu``.

The log (``standin.log``, a list of :class:`Op`, in host order) holds:

- tensor operations: ``copy_``, ``index_select`` (method and function), ``index_copy_``,
  ``index_put_``, ``__setitem__``, ``fill_``, ``zero_``, ``clone`` and ``_foreach_copy_``.
  One that touches a registered device tensor is a *device* op, logged on the calling
  thread's current stream of that tensor's device (the destination's, for a copy between two
  devices, which is ordered after and before the current stream of the source's device, as
  PyTorch's peer copies are); one that touches none is a *host* op (``stream is None``) of the
  calling thread. ``reads`` / ``writes`` hold the byte ranges ``(start, end)`` of the tensor
  arguments (the whole extent of a view, so index ops count as touching all of ``self``). A
  blocking cross-device ``copy_`` also makes the host wait for its stream, as CUDA does.
- stream and event calls: ``record``, ``wait_event``, ``wait_stream``, ``synchronize``
  (stream, event or device), ``query``; ``op.event`` / ``op.other`` name what they refer to.
- ``standin.mark(name, reads=(), writes=(), on_host=False)``: an op the test logs itself, for
  example a compute kernel that still reads a block, or a disk write reading host rows.

Queries: ``ops(name=None, stream=..., writes=tensor, reads=tensor, kind=None)`` filters the
log (``stream=None`` means host ops; omit it for all); ``happens_before(a, b)`` is True when
``a`` is ordered before ``b`` by stream order, events, stream waits or host synchronisation;
``stream_log(stream)`` lists one stream's ops; ``touches(op, tensor)`` / ``overlaps``;
``is_device(t)``, ``is_pinned(t)``, ``device_tensor(t)`` (register an existing CPU tensor as
device memory) and ``pinned_tensor(t)``.

Host synchronisation is a fact in real time: once any host thread has seen an event or a stream
complete (``synchronize``, ``query``, a blocking copy), every op logged after that, by any
thread, is ordered after the completed work. So a worker thread that synchronises before it
reports a job finished orders the engine's later ops after the job's copies, as on a device.

Event semantics follow CUDA: waiting on an event that was never recorded is a no-op (logged
with ``op.detail == "unrecorded"``); an event re-recorded later captures the new position,
and a wait sees the position at the time of the wait call.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

__all__ = ["CudaStandIn", "FakeEvent", "FakeStream", "Op", "cuda_standin"]

DEVICE = torch.device("cuda", 0)
Range = tuple[int, int]
Clock = dict[str, int]


def _join(a: Clock, b: Clock) -> None:
    for k, v in b.items():
        if a.get(k, 0) < v:
            a[k] = v


def _extent(t: torch.Tensor) -> Range:
    """Byte range ``[start, end)`` covered by ``t`` (a view's whole span)."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    start = t.data_ptr()
    return (start, start + span * t.element_size())


@dataclass(eq=False)
class Op:
    """One logged operation. ``where`` is the stream's or host thread's clock name."""

    seq: int
    name: str
    stream: FakeStream | None
    thread: str
    where: str
    clock: Clock
    reads: tuple[Range, ...] = ()
    writes: tuple[Range, ...] = ()
    event: FakeEvent | None = None
    other: FakeStream | None = None
    detail: str = ""

    def __repr__(self) -> str:
        at = self.stream.name if self.stream is not None else f"host:{self.thread}"
        extra = f" event={self.event.name}" if self.event is not None else ""
        extra += f" other={self.other.name}" if self.other is not None else ""
        return f"Op#{self.seq}({self.name} on {at}{extra}{' ' + self.detail if self.detail else ''})"


class FakeStream:
    """A CUDA stream of the stand-in: an ordered log of the ops enqueued on it."""

    def __init__(self, device: Any = None, priority: int = 0, *, name: str | None = None) -> None:
        s = _active()
        self.standin = s
        self.device = torch.device("cuda", s._index(device))
        self.priority = priority
        self.name = name or f"stream{next(s._stream_ids)}"
        self.clock: Clock = {}
        s._streams.append(self)

    def wait_event(self, event: FakeEvent) -> None:
        self.standin._wait_event(self, event)

    def wait_stream(self, stream: FakeStream) -> None:
        self.standin._wait_stream(self, stream)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.standin._host_join("synchronize", self.clock, stream=self)

    def query(self) -> bool:
        self.standin._host_join("query", self.clock, stream=self)
        return True

    def __enter__(self) -> FakeStream:
        self._ctx = _stream_context(self)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """A CUDA event of the stand-in: the clock of its stream at the last ``record``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        s = _active()
        self.standin = s
        self.name = f"event{next(s._event_ids)}"
        self.clock: Clock | None = None
        self.stream: FakeStream | None = None
        self.time = 0.0

    @property
    def recorded(self) -> bool:
        return self.clock is not None

    def record(self, stream: FakeStream | None = None) -> None:
        self.standin._record(self, stream if stream is not None else self.standin.current_stream())

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream if stream is not None else self.standin.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        self.standin._host_join("synchronize", self.clock or {}, event=self)

    def query(self) -> bool:
        self.standin._host_join("query", self.clock or {}, event=self)
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.time - self.time) * 1000.0

    def __repr__(self) -> str:
        return f"FakeEvent({self.name})"


_ACTIVE: list[CudaStandIn] = []


def _active() -> CudaStandIn:
    if not _ACTIVE:
        raise RuntimeError("the CUDA stand-in is not installed")
    return _ACTIVE[-1]


@contextlib.contextmanager
def _stream_context(stream: FakeStream | None) -> Iterator[FakeStream | None]:
    """``torch.cuda.stream(s)``: ``s`` current on its device, and its device the current one."""
    s = _active()
    if stream is None:
        yield None
        return
    prev_device = s.current_device()
    prev = s.current_stream(stream.device)
    s._set_stream(stream)
    try:
        yield stream
    finally:
        s._set_stream(prev)
        s._tls.device = prev_device


@contextlib.contextmanager
def _device_context(device: Any = None) -> Iterator[None]:
    """``torch.cuda.device(d)``: ``d`` is the current device inside."""
    s = _active()
    prev = s.current_device()
    if device is not None:
        s._tls.device = s._index(device)
    try:
        yield
    finally:
        s._tls.device = prev


class CudaStandIn:
    """The stand-in's state: registries of device and pinned memory, streams, and the log."""

    device = DEVICE

    def __init__(self, *, device_memory: int = 64 << 30, devices: int = 1) -> None:
        self.devices = devices
        self.device_memory = device_memory
        self.device_memory_free = device_memory
        self.log: list[Op] = []
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._stream_ids = itertools.count(1)
        self._event_ids = itertools.count(1)
        self._tls = threading.local()
        self._host_clocks: dict[str, Clock] = {}
        self._completed: Clock = {}  # work some host thread has seen complete
        self._device: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self._pinned: dict[int, torch.UntypedStorage] = {}
        self.default_stream: FakeStream | None = None  # device 0's
        self.default_streams: list[FakeStream] = []
        self._streams: list[FakeStream] = []

    # -- registries --------------------------------------------------------------------------
    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def device_tensor(self, t: torch.Tensor, index: int = 0) -> torch.Tensor:
        """Register ``t`` (a CPU tensor) as memory of device ``index``; returns ``t``."""
        if t.untyped_storage().nbytes():
            self._device[self._key(t)] = (t.untyped_storage(), index)
        return t

    def pinned_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Register ``t`` (a CPU tensor) as pinned host memory; returns ``t``."""
        if t.untyped_storage().nbytes():
            self._pinned[self._key(t)] = t.untyped_storage()
        return t

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().nbytes() > 0 and self._key(t) in self._device

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().nbytes() > 0 and self._key(t) in self._pinned

    def device_index(self, t: torch.Tensor) -> int | None:
        """The device ``t`` is registered on, or ``None`` for host memory."""
        if not t.untyped_storage().nbytes():
            return None
        entry = self._device.get(self._key(t))
        return None if entry is None else entry[1]

    def tensor_device(self, t: torch.Tensor) -> torch.device:
        index = self.device_index(t)
        return t.device if index is None else torch.device("cuda", index)

    # -- devices and streams -------------------------------------------------------------------
    def _index(self, device: Any) -> int:
        """The device index ``device`` names (``None`` / ``"cuda"``: the current device)."""
        if device is None:
            index = self.current_device()
        elif isinstance(device, int):
            index = device
        elif isinstance(device, FakeStream):
            index = device.device.index
        else:
            d = torch.device(device)
            if d.type != "cuda":
                raise ValueError(f"CUDA stand-in: expected a cuda device, got {device!r}")
            index = self.current_device() if d.index is None else d.index
        if not 0 <= index < self.devices:
            raise RuntimeError(f"CUDA stand-in: invalid device ordinal {index} ({self.devices} devices)")
        return index

    def current_device(self) -> int:
        return int(getattr(self._tls, "device", 0))

    def _set_device(self, device: Any) -> None:
        self._tls.device = self._index(device)

    def _tls_streams(self) -> dict[int, FakeStream]:
        streams = getattr(self._tls, "streams", None)
        if streams is None:
            streams = self._tls.streams = {}
        return streams

    def current_stream(self, device: Any = None) -> FakeStream:
        index = self._index(device)
        cur = self._tls_streams().get(index)
        return cur if cur is not None else self.default_streams[index]

    def _set_stream(self, stream: FakeStream) -> None:
        """``torch.cuda.set_stream``: current on its device, which becomes the current one."""
        index = stream.device.index
        self._tls_streams()[index] = stream
        self._tls.device = index

    def _thread_clock(self) -> tuple[str, Clock]:
        name = f"host:{threading.current_thread().name}:{threading.get_ident()}"
        return name, self._host_clocks.setdefault(name, {})

    def _append(self, op_name: str, stream: FakeStream | None, **kw: Any) -> Op:
        """Log an op: on ``stream`` (after the host's knowledge), or on the calling thread."""
        with self._lock:
            host, hclock = self._thread_clock()
            _join(hclock, self._completed)
            if stream is None:
                hclock[host] = hclock.get(host, 0) + 1
                clock, where = dict(hclock), host
            else:
                _join(stream.clock, hclock)
                stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
                clock, where = dict(stream.clock), stream.name
            op = Op(next(self._seq), op_name, stream, threading.current_thread().name, where, clock, **kw)
            self.log.append(op)
            return op

    def _record(self, event: FakeEvent, stream: FakeStream) -> None:
        with self._lock:
            self._append("record", stream, event=event)
            event.clock = dict(stream.clock)
            event.stream = stream
            event.time = time.perf_counter()

    def _wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        with self._lock:
            if event.clock is not None:
                _join(stream.clock, event.clock)
            self._append("wait_event", stream, event=event, detail="" if event.recorded else "unrecorded")

    def _wait_stream(self, stream: FakeStream, other: FakeStream) -> None:
        with self._lock:
            _join(stream.clock, other.clock)
            self._append("wait_stream", stream, other=other)

    def _host_join(
        self, name: str, clock: Clock, *, stream: FakeStream | None = None, event: FakeEvent | None = None
    ) -> None:
        with self._lock:
            _, hclock = self._thread_clock()
            _join(hclock, clock)
            _join(self._completed, clock)
            self._append(name, None, event=event, other=stream)

    def synchronize(self, device: Any = None) -> None:
        """``torch.cuda.synchronize``: every stream of that one device (the current one)."""
        index = self._index(device)
        with self._lock:
            _, hclock = self._thread_clock()
            for stream in self._streams:
                if stream.device.index == index:
                    _join(hclock, stream.clock)
                    _join(self._completed, stream.clock)
            self._append("synchronize", None, detail="device", other=self.default_streams[index])

    # -- ops ---------------------------------------------------------------------------------
    def _tensor_op(self, name: str, reads: Iterable[Any], writes: Iterable[Any], *, blocking_cross: bool = False) -> Op:
        rt = [t for t in _flatten(reads)]
        wt = [t for t in _flatten(writes)]
        indices = [i for i in (self.device_index(t) for t in (*wt, *rt)) if i is not None]
        if not indices:
            return self._append(name, None, reads=tuple(_extent(t) for t in rt), writes=tuple(_extent(t) for t in wt))
        with self._lock:
            # On the current stream of the first device touched (the destination's, for a copy);
            # a peer copy is ordered after, and before, the current stream of every other one.
            stream = self.current_stream(indices[0])
            others = [self.current_stream(i) for i in dict.fromkeys(indices[1:]) if i != indices[0]]
            for other in others:
                _join(stream.clock, other.clock)
            op = self._append(name, stream, reads=tuple(_extent(t) for t in rt), writes=tuple(_extent(t) for t in wt))
            for other in others:
                _join(other.clock, stream.clock)
        if blocking_cross and any(not self.is_device(t) for t in (*rt, *wt)):
            self._host_join("synchronize", stream.clock, stream=stream)
        return op

    def mark(
        self,
        name: str,
        *,
        reads: Iterable[torch.Tensor] = (),
        writes: Iterable[torch.Tensor] = (),
        on_host: bool = False,
    ) -> Op:
        """Log an op of the test's own: on the current stream, or on the host with ``on_host``."""
        stream = None if on_host else self.current_stream()
        return self._append(
            name, stream, reads=tuple(_extent(t) for t in reads), writes=tuple(_extent(t) for t in writes)
        )

    # -- queries -----------------------------------------------------------------------------
    _ALL: Any = object()

    def ops(
        self,
        name: str | None = None,
        *,
        stream: Any = _ALL,
        writes: torch.Tensor | None = None,
        reads: torch.Tensor | None = None,
        kind: str | None = None,
    ) -> list[Op]:
        """Logged ops, filtered by name, stream (``None``: host ops), and tensors touched."""
        with self._lock:
            out = list(self.log)
        if name is not None:
            out = [o for o in out if o.name == name]
        if stream is not self._ALL:
            out = [o for o in out if o.stream is stream]
        if writes is not None:
            out = [o for o in out if any(_overlap(r, _extent(writes)) for r in o.writes)]
        if reads is not None:
            out = [o for o in out if any(_overlap(r, _extent(reads)) for r in o.reads)]
        if kind == "device":
            out = [o for o in out if o.stream is not None]
        elif kind == "host":
            out = [o for o in out if o.stream is None]
        return out

    def stream_log(self, stream: FakeStream) -> list[Op]:
        return self.ops(stream=stream)

    def happens_before(self, a: Op, b: Op) -> bool:
        """Whether ``a`` is guaranteed to finish before ``b`` starts on a real device."""
        return a is not b and a.clock[a.where] <= b.clock.get(a.where, 0)

    @staticmethod
    def touches(op: Op, t: torch.Tensor) -> bool:
        ext = _extent(t)
        return any(_overlap(r, ext) for r in (*op.reads, *op.writes))

    @staticmethod
    def overlaps(a: Range, t: torch.Tensor) -> bool:
        return _overlap(a, _extent(t))

    def clear(self) -> None:
        """Forget the log (clocks and registries stay)."""
        with self._lock:
            self.log.clear()

    # -- installation --------------------------------------------------------------------------
    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        _ACTIVE.append(self)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        self.default_streams = [
            FakeStream(i, name="default" if i == 0 else f"default:{i}") for i in range(self.devices)
        ]
        self.default_stream = self.default_streams[0]
        cuda: dict[str, Any] = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "init": lambda: None,
            "device_count": lambda: self.devices,
            "current_device": self.current_device,
            "set_device": self._set_device,
            "device": _device_context,
            "get_device_name": lambda device=None: "CUDA stand-in",
            "empty_cache": lambda: None,
            "mem_get_info": lambda device=None: (self.device_memory_free, self.device_memory),
            "Stream": FakeStream,
            "Event": FakeEvent,
            "current_stream": self.current_stream,
            "default_stream": lambda device=None: self.default_streams[self._index(device)],
            "set_stream": self._set_stream,
            "stream": _stream_context,
            "synchronize": self.synchronize,
            "_sleep": lambda cycles: self.mark("_sleep"),
        }
        for name, value in cuda.items():
            monkeypatch.setattr(torch.cuda, name, value)
        for name in ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "randint"):
            monkeypatch.setattr(torch, name, self._factory(getattr(torch, name)))
        for name in ("empty_like", "zeros_like", "ones_like"):
            monkeypatch.setattr(torch, name, self._factory(getattr(torch, name), like=True))
        self._patch_tensor_methods(monkeypatch)
        with contextlib.suppress(ImportError):
            import kvtier.devices

            monkeypatch.setattr(kvtier.devices, "locate", self.tensor_device)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a, **k: self.is_pinned(t))

    def uninstall(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _is_cuda(self, device: Any) -> bool:
        if device is None:
            return False
        if isinstance(device, int):
            return True
        return torch.device(device).type == "cuda"

    def _target(self, device: Any) -> int | None:
        """The device index an allocation on ``device`` lands on, ``None`` for the host."""
        return self._index(device) if self._is_cuda(device) else None

    def _alloc_check(self, nbytes: int) -> None:
        if nbytes > self.device_memory_free:
            raise torch.OutOfMemoryError(
                f"CUDA stand-in: out of memory allocating {nbytes} bytes ({self.device_memory_free} free)"
            )

    def _factory(self, fn: Callable[..., torch.Tensor], *, like: bool = False) -> Callable[..., torch.Tensor]:
        fn_name = fn.__name__

        def make(*args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.get("device")
            index = self._target(device)
            if like and device is None and args and isinstance(args[0], torch.Tensor):
                index = self.device_index(args[0])
            if index is not None:
                kwargs["device"] = "cpu"
            pin = bool(kwargs.pop("pin_memory", False))
            out = fn(*args, **kwargs)
            if index is not None:
                self._alloc_check(out.untyped_storage().nbytes())
                self.device_tensor(out, index)
                if fn_name in ("tensor", "as_tensor"):  # data from pageable host memory: a blocking copy
                    stream = self.current_stream(index)
                    self._append(fn_name, stream, writes=(_extent(out),))
                    self._host_join("synchronize", stream.clock, stream=stream)
            elif pin:
                self.pinned_tensor(out)
            return out

        return make

    def _patch_tensor_methods(self, monkeypatch: pytest.MonkeyPatch) -> None:
        T = torch.Tensor
        orig = {
            n: getattr(T, n)
            for n in (
                "copy_",
                "index_select",
                "index_copy_",
                "index_put_",
                "__setitem__",
                "fill_",
                "zero_",
                "clone",
                "to",
                "cuda",
                "cpu",
                "pin_memory",
            )
        }
        orig_index_select = torch.index_select
        orig_foreach = torch._foreach_copy_
        s = self

        def copy_(t: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            s._tensor_op("copy_", [src], [t], blocking_cross=not non_blocking)
            return orig["copy_"](t, src, non_blocking)

        def index_select(
            t: torch.Tensor, dim: int, index: torch.Tensor, *, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            if out is None:
                res = orig["index_select"](t, dim, index)
                if s.is_device(t):
                    s.device_tensor(res, s.device_index(t) or 0)
            else:
                res = orig_index_select(t, dim, index, out=out)
            s._tensor_op("index_select", [t, index], [res])
            return res

        def fn_index_select(
            t: torch.Tensor, dim: int, index: torch.Tensor, *, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            return index_select(t, dim, index, out=out)

        def index_copy_(t: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
            s._tensor_op("index_copy_", [index, source], [t])
            return orig["index_copy_"](t, dim, index, source)

        def index_put_(t: torch.Tensor, indices: Any, values: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
            s._tensor_op("index_put_", [*_tensors(indices), values], [t])
            return orig["index_put_"](t, indices, values, accumulate)

        def setitem(t: torch.Tensor, idx: Any, value: Any) -> None:
            s._tensor_op("__setitem__", [*_tensors(idx), *_tensors(value)], [t])
            orig["__setitem__"](t, idx, value)

        def fill_(t: torch.Tensor, value: Any) -> torch.Tensor:
            s._tensor_op("fill_", list(_tensors(value)), [t])
            return orig["fill_"](t, value)

        def zero_(t: torch.Tensor) -> torch.Tensor:
            s._tensor_op("zero_", [], [t])
            return orig["zero_"](t)

        def clone(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            res = orig["clone"](t, *args, **kwargs)
            if s.is_device(t):
                s.device_tensor(res, s.device_index(t) or 0)
            s._tensor_op("clone", [t], [res])
            return res

        def foreach_copy_(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False) -> None:
            s._tensor_op("_foreach_copy_", srcs, dsts, blocking_cross=not non_blocking)
            orig_foreach(dsts, srcs, non_blocking=non_blocking)

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.pop("device", None)
            rest = []
            for a in args:
                if isinstance(a, (str, torch.device)) and device is None:
                    device = a
                else:
                    rest.append(a)
            non_blocking = bool(kwargs.get("non_blocking", False))
            if device is None:
                return orig["to"](t, *rest, **kwargs)
            want = s._target(device)
            if want == s.device_index(t):
                return orig["to"](t, *rest, **kwargs)
            res = orig["clone"](orig["to"](t, *rest, **kwargs), memory_format=torch.contiguous_format)
            if want is not None:
                s._alloc_check(res.untyped_storage().nbytes())
                s.device_tensor(res, want)
            s._tensor_op("to", [t], [res], blocking_cross=not non_blocking)
            return res

        def cuda(t: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
            return to(t, "cuda", non_blocking=non_blocking)

        def cpu(t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return to(t, "cpu") if s.is_device(t) else t

        def pin_memory(t: torch.Tensor, *args: Any) -> torch.Tensor:
            return s.pinned_tensor(orig["clone"](t))

        for name, fn in (
            ("copy_", copy_),
            ("index_select", index_select),
            ("index_copy_", index_copy_),
            ("index_put_", index_put_),
            ("__setitem__", setitem),
            ("fill_", fill_),
            ("zero_", zero_),
            ("clone", clone),
            ("to", to),
            ("cuda", cuda),
            ("cpu", cpu),
            ("pin_memory", pin_memory),
        ):
            monkeypatch.setattr(T, name, fn)
        monkeypatch.setattr(torch, "index_select", fn_index_select)
        monkeypatch.setattr(torch, "_foreach_copy_", foreach_copy_)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _flatten(xs: Iterable[Any]) -> Iterator[torch.Tensor]:
    for x in xs:
        yield from _tensors(x)


def _overlap(a: Range, b: Range) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _installed(monkeypatch: pytest.MonkeyPatch, devices: int) -> Iterator[CudaStandIn]:
    standin = CudaStandIn(devices=devices)
    standin.install(monkeypatch)
    try:
        yield standin
    finally:
        standin.uninstall()


@pytest.fixture
def cuda_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[CudaStandIn]:
    """Install the stand-in, one device, for one test (see the module docstring)."""
    yield from _installed(monkeypatch, 1)


@pytest.fixture
def cuda_standin_two(monkeypatch: pytest.MonkeyPatch) -> Iterator[CudaStandIn]:
    """Install the stand-in with two devices (``cuda:0``, ``cuda:1``) for one test."""
    yield from _installed(monkeypatch, 2)
