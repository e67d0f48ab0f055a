"""Where a tensor lives, and waiting for the copies queued on the devices a call touched.

``tensor_device(t)`` is the one place kvtier asks where a tensor lives: a test stand-in for
``torch.cuda`` (``tests/cuda_standin.py``) places CPU tensors on pretend devices by setting
:data:`locate`, and every path then takes the branch a GPU would.

``wait_for_copies(tensors)`` is what a blocking tier call runs before it returns after queueing
asynchronous copies (``copy_(..., non_blocking=True)``): it waits for the *current stream of
each device* among ``tensors``, and for nothing else. Never ``torch.cuda.synchronize()`` with no
device there: that waits for the current device only (the wrong one when a pool lives on
another GPU) and for every stream on it (the engine's compute stream included).

``usable_cpus()`` is the number of host CPUs this process may run on, which sizes the ``auto``
thread counts of the host copies and of the Redis tier's connections per job.

``one_intra_op_thread()`` runs torch's CPU ops on the calling thread alone for a while, so a
kvtier thread never starts an OpenMP team beside the engine's (why: :mod:`kvtier.transfer.copies`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["accelerators", "confines_intra_op", "copy_rows", "device_index", "locate", "one_intra_op_thread", "openmp_team_runner", "tensor_device", "usable_cpus", "wait_for_copies"]

#: Replaced by a test stand-in for ``torch.cuda``; ``None`` asks the tensor itself.
locate: Callable[[torch.Tensor], torch.device] | None = None


def usable_cpus() -> int:
    """Host CPUs this process may run on (its affinity set; all CPUs where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _OpenMP:
    """The calling thread's OpenMP thread count (``omp_get_max_threads`` /
    ``omp_set_num_threads``, a per-thread setting), through the OpenMP runtime torch loaded;
    ``None`` where torch runs without one."""

    def __init__(self) -> None:
        self.get: Any = None
        self.set: Any = None
        self.parallel = 0  # the address of GOMP_parallel (0: not found)
        if not torch.backends.openmp.is_available():
            return
        try:
            lib = ctypes.CDLL(None)
            get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
        except (OSError, AttributeError):
            return
        get.restype, get.argtypes = ctypes.c_int, []
        put.restype, put.argtypes = None, [ctypes.c_int]
        self.get, self.set = get, put
        try:  # the same runtime's entry that runs a C function on the calling thread's team
            self.parallel = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value or 0
        except AttributeError:
            pass


_omp = _OpenMP()


def confines_intra_op() -> bool:
    """Whether :func:`one_intra_op_thread` can set a thread's count here (torch runs with an
    OpenMP runtime whose per-thread setting this process can reach)."""
    return _omp.set is not None


def openmp_team_runner() -> int:
    """The address of the OpenMP runtime's ``GOMP_parallel`` (GCC's ABI, which libgomp and
    LLVM's libomp both export) in the runtime torch's ops use, so native code can run on the
    calling thread's own team (:mod:`kvtier.transfer.block_copy`); 0 where there is none."""
    return _omp.parallel if _omp.set is not None else 0


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Torch's CPU ops on the calling thread run on it alone inside the block (no OpenMP team:
    see :mod:`kvtier.transfer.copies`); the thread's count is restored after. Other threads are untouched
    (``torch.set_num_threads`` would change the process's default as well)."""
    if _omp.set is None:
        yield
        return
    torch.get_num_threads()  # torch sets a thread's count on its first op: let it happen first
    before = _omp.get()
    _omp.set(1)
    try:
        yield
    finally:
        _omp.set(before)


def tensor_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` lives on."""
    return t.device if locate is None else locate(t)


def accelerators(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct non-CPU devices among ``tensors``, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for t in tensors:
        d = tensor_device(t)
        if d.type != "cpu":
            seen.setdefault(d, None)
    return list(seen)


def device_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 index on ``device``, copied without making the host wait for
    the stream (a pageable copy would)."""
    host = torch.tensor(list(values), dtype=torch.long)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def copy_rows(src: torch.Tensor, rows: Sequence[int], dst: torch.Tensor) -> None:
    """``dst[i] = src[rows[i]]`` for a ``[len(rows), ...]`` tensor ``dst``, queued as one copy
    (consecutive rows) or one gather on ``src``'s device and one copy, never a copy per row.
    Queued without waiting: the caller waits (:func:`wait_for_copies`)."""
    first = rows[0]
    if list(rows) == list(range(first, first + len(rows))):
        part = src[first : first + len(rows)]
    else:
        part = src.index_select(0, device_index(rows, tensor_device(src)))
    dst.copy_(part, non_blocking=True)


def wait_for_copies(tensors: Iterable[torch.Tensor]) -> None:
    """Block until the work queued on the current stream of every device among ``tensors`` has
    completed (nothing to do when they are all host tensors)."""
    for device in accelerators(tensors):
        torch.cuda.current_stream(device).synchronize()
