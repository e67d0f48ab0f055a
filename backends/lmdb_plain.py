"""The rows of a job of an ``lmdb`` tier, checked and viewed: each row's checks and its view
in one call (:data:`host_view`, :data:`job_views`; native in ``backends/_rowguard.c`` and
``backends/_rowsave.c``), the views kept by address (:class:`RowViews`), and rows of one pool
held with their views (:class:`HeldViews`). The plain records these views are read into and
saved from, their one pass and the file guard, are :mod:`kvtier.backends.lmdb_records`' (its
names are importable from here too).

The rows' buffers are taken once per job: by :class:`RowViews` (kept by address, checked as
``_check_io`` checks a job), or from one view of the tensor they are all cut from when they are
(a manager's staging rows), else one per row. A job's rows given as one pool (a
:class:`~kvtier.pool_rows.PoolRows`, the engine's staging rows) are checked once a job, the
pool's checks (:func:`pool_addresses`; natively ``host_job_views`` of
``kvtier/records/_hostrow.h``), each row's kept view then found by its address; a pool those
checks do not take has its rows checked one by one.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from kvtier.backends.lmdb_records import UNSUMMED, FileGuard, PlainReads, all_built, build_joined

from kvtier import devices
from kvtier.keys import KEY_BYTES
from kvtier.pool_rows import PoolRows

__all__ = [
    "NATIVE_GUARD", "UNSUMMED", "FileGuard", "HeldViews", "PlainReads", "RowViews", "all_built", "build_joined",
    "dispatch_modes", "function_mode", "held_views", "host_rows", "host_view", "job_read", "job_views", "modes_on",
    "one_read", "one_row", "pool_addresses", "pool_memory", "python_in_torch", "same_size", "straight_read",
]

try:
    from kvtier.backends import _rowguard  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the Python forms below
    _rowguard = None
_NATIVE_NAMES = ("host_view", "same_size", "one_row", "one_read", "job_read", "straight_read", "job_views", "pool_views", "put_joined", "views_stayed")
if _rowguard is not None and not all(hasattr(_rowguard, n) for n in _NATIVE_NAMES):
    _rowguard = None  # a stale build (sources newer than it; tests/test_native_builds.py says so): the Python forms

_U8 = torch.uint8
_TENSOR = torch.Tensor
#: Whether a torch function mode is on in this thread: its handler then runs Python in every
#: tensor getter and method a row's checks call.
function_mode: Callable[[], bool] = torch._C._is_torch_function_mode_enabled
#: How many torch dispatch modes are on in this thread (their handlers run Python too).
dispatch_modes: Callable[[], int] = torch._C._len_torch_dispatch_stack
_TORCH_FUNCTION = torch.Tensor.__torch_function__.__func__  # type: ignore[attr-defined]


def _overridden(row: Any) -> bool:
    """Whether ``type(row)`` (a subclass of ``torch.Tensor``) has a ``__torch_function__`` of its
    own."""
    handler = getattr(type(row), "__torch_function__", None)
    return getattr(handler, "__func__", handler) not in (_TORCH_FUNCTION, torch._C._disabled_torch_function_impl)


def modes_on() -> bool:
    """Whether a torch function or dispatch mode is on in this thread (see :func:`python_in_torch`)."""
    return bool(function_mode() or dispatch_modes())


def python_in_torch(out: Sequence[Any]) -> bool:
    """Whether code other than torch's own may run in torch while a job over the rows ``out``
    is checked and copied: a torch function or dispatch mode is on, or a row's type has a
    ``__torch_function__`` of its own. Views of a job's rows are taken before its copies, and
    such code may free a row whose view is taken (``row.set_(...)``): such jobs take each row's
    memory as they write it."""
    if modes_on():
        return True
    for row in (out.pool,) if type(out) is PoolRows else out:  # (rows of one pool: of its type)
        if type(row) is not _TENSOR and isinstance(row, _TENSOR) and _overridden(row):
            return True
    return False


def host_rows(out: Sequence[torch.Tensor], size: int, *, borrowed: bool = False) -> list[memoryview] | None:
    """A writable view of each row (1-D ``uint8`` tensors of ``size`` bytes, as ``_check_io``
    checked them), or ``None`` when one is not contiguous host memory (or when
    :data:`kvtier.devices.locate` makes host tensors stand in for a device's).  Rows cut from one
    host tensor (``staging[i]``, ``t.unbind(0)``) are views into one buffer of it, sliced at each
    row's offset: ``Tensor.numpy()`` costs 1-3 µs a row, more than the lookup and the copy of a 4
    KiB record together. Other rows, when ``borrowed`` (the caller holds the rows for as long as it
    uses the views, which do not hold them), are views of their memory by address (:func:`_at`, half
    a ``numpy()``'s cost); else one ``numpy()`` each. Borrowed rows of one pool (a
    :class:`PoolRows`, whose rows are made as asked): the views as :class:`HeldViews`, which hold
    the pool's memory."""
    if borrowed and type(out) is PoolRows:
        try:
            memory = pool_memory(out)
        except Exception:  # a pool whose storage cannot be had (sparse, or its own code refuses): not held, no views
            return None
        return HeldViews.of(_host_rows(out, size, borrowed), memory)
    return _host_rows(out, size, borrowed)


def _host_rows(out: Sequence[torch.Tensor], size: int, borrowed: bool) -> list[memoryview] | None:
    """:func:`host_rows`' views."""
    if devices.locate is not None or not out or function_mode() or dispatch_modes():
        return None  # (a mode's handler may free a row whose view is taken: python_in_torch)
    base = out[0]._base
    if base is not None and len(out) > 1 and type(base) is _TENSOR and base.is_cpu and base.is_contiguous():
        flat = base.detach().reshape(-1).view(torch.uint8)
        whole = flat.numpy().data
        start, length = flat.data_ptr(), len(whole)
        views = []
        for row in out:
            if type(row) is not _TENSOR:
                break
            at = row.data_ptr() - start
            if row._base is not base or not row.is_contiguous() or at < 0 or at + size > length:
                break
            views.append(whole[at : at + size])
        else:
            return views
    views = []
    for row in out:
        if type(row) is not _TENSOR and isinstance(row, _TENSOR) and _overridden(row):
            return None  # its checks would run its own code (python_in_torch)
        if not row.is_cpu or not row.is_contiguous():
            return None
        views.append(_at(row.data_ptr(), size) if borrowed else row.numpy().data)
    return views


@functools.cache
def _row_type(size: int) -> Any:
    return ctypes.c_char * size


def _at(address: int, size: int) -> memoryview:
    """A writable byte view of the ``size`` bytes at ``address`` (1.2 µs here, against 2.5 for
    ``Tensor.numpy().data``); it keeps nothing alive."""
    return memoryview(_row_type(size).from_address(address)).cast("B")


_VIEWS: dict[int, dict[int, memoryview]] = {}  # row size -> address -> view (see RowViews)


class RowViews:
    """Writable views of rows of :attr:`size` bytes, kept by address (at most :attr:`most` of each
    size, for the whole process), for rows that callers read into again and again (a staging pool,
    or tensors of their own that the allocator hands back at the same addresses).  :meth:`of` also
    checks the job as ``_check_io`` does, in the same loop: per row, the checks cost about 1.2 µs
    (five tensor attributes), a view from the cache 0.06 µs, one by address 1.1 µs and
    ``Tensor.numpy()`` 2.1 µs; a 4 KiB record's lookup, copy and check take about 2. A view outlives
    nothing it points at: it is used only for a row that was just found to be a live, contiguous
    host tensor of exactly :attr:`size` bytes at that address."""

    __slots__ = ("most", "shape", "size", "views")

    def __init__(self, size: int, most: int = 4096) -> None:
        self.size = size
        self.shape = torch.Size([size])
        self.most = most
        #: Shared by every store of rows this size in the process: rows outlive stores (a
        #: store reopened, or several stores read into one staging pool).
        self.views: dict[int, memoryview] = _VIEWS.setdefault(size, {})

    def of(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[memoryview] | None:
        """A view of each row when every key is ``bytes`` of 32 and every row a contiguous
        host ``uint8`` tensor of :attr:`size` elements; else ``None`` (the caller's general
        checks then name what is wrong, or take rows that are not host memory). Rows of one
        pool (a :class:`PoolRows`): the views as :class:`HeldViews`, which hold the pool's
        memory for as long as the caller holds them."""
        if devices.locate is not None or function_mode() or dispatch_modes():
            return None  # (a mode's handler may free a row whose view is taken: python_in_torch)
        if type(out) is not PoolRows:
            return _rows_viewed(keys, out, _TENSOR, _U8, self.shape, self.views, KEY_BYTES, self._unseen)
        pool = out.pool
        try:
            memory = pool.untyped_storage() if isinstance(pool, _TENSOR) else None  # (pool_memory, taken before the pool's checks)
        except Exception:  # a pool whose storage cannot be had: not held, its rows go to the general checks
            return None
        # the pool checked once (in one native call where the native forms are on), each row's view kept or made (not seen yet)
        of_pool = pool_views if job_views is not job_views_python else pool_views_python
        got = of_pool(keys, out, _TENSOR, _U8, self.shape, self.views, KEY_BYTES, self._view_at)
        if got is NotImplemented:  # a pool those checks do not take: its rows one by one
            got = _rows_viewed(keys, tuple(out), _TENSOR, _U8, self.shape, self.views, KEY_BYTES, self._unseen)
        if got is None:
            return None
        held = HeldViews(got)  # (HeldViews.of, written out: 60 ns a job less)
        held.memory = memory
        return held

    def _unseen(self, row: Any) -> memoryview | None:
        """The view of a row :data:`host_view` does not answer for (not seen yet, a subclass, or
        not such a row), after the checks here; ``None`` when it is not such a row."""
        if type(row) is not _TENSOR and isinstance(row, _TENSOR) and _overridden(row):
            return None  # its checks would run its own code (python_in_torch)
        if row.dtype is not _U8 or row.shape != self.shape or not row.is_cpu or not row.is_contiguous():
            return None
        return self._view_at(row.data_ptr())

    def _view_at(self, at: int | None) -> memoryview | None:
        """The kept view of the row of :attr:`size` bytes at ``at`` (a row that was just found to
        be a live, contiguous host ``uint8`` tensor of that many bytes there), made if not kept;
        ``None`` for no address (a pool's row not in the pool now: :func:`pool_addresses`)."""
        if at is None:
            return None
        views = self.views
        view = views.get(at)
        if view is None:
            if len(views) >= self.most:
                views.clear()
            view = views[at] = _at(at, self.size)
        return view


class HeldViews(list):  # type: ignore[type-arg]
    """A job's views of rows of one pool (a :class:`PoolRows`), with what holds the memory they
    point at (:attr:`memory`: the pool's storage as it was when the pool was checked), for as long
    as the views are held: a pool moved meanwhile (``pool.set_(...)`` from another thread while a
    copy lets the GIL go) leaves that memory to the job, not to the allocator, as a list of views of
    its rows holds it. Views by address hold nothing; handing back the hold with them leaves no
    caller to remember it (its views used, its memory held). :attr:`taken` (:func:`held_views`'
    only): what a save asks the rows by again before it copies (``lmdb_lone.views_stayed``): what
    the pool's checks kept (native: its pool and its address then, which also hold its memory), in
    Python the tuple ``(pool, address)``, or the :class:`PoolRows` itself (a pool that is not a
    tensor: asked row by row)."""

    __slots__ = ("memory", "taken")

    @classmethod
    def of(cls, views: list[memoryview] | None, memory: Any) -> HeldViews | None:
        """``views`` holding ``memory`` (``None`` for ``None``)."""
        if views is None:
            return None
        held = cls(views)
        held.memory = memory
        return held


def held_views(keys: Any, rows: Any, shape: Any, views: dict[int, memoryview]) -> list[memoryview] | None:
    """:data:`job_views` of a job of host ``uint8`` rows of ``shape`` and keys of
    :data:`~kvtier.keys.KEY_BYTES`; rows of one pool (a :class:`PoolRows`): the views as
    :class:`HeldViews`, the pool's memory taken with its checks (native: in the same call, which
    keeps the pool and its address then as :attr:`HeldViews.taken`), or before them."""
    if type(rows) is not PoolRows:
        return job_views(keys, rows, _TENSOR, _U8, shape, views, KEY_BYTES)
    if job_views is not job_views_python:
        return job_views(keys, rows, _TENSOR, _U8, shape, views, KEY_BYTES, HeldViews)
    pool = rows.pool
    try:
        memory = pool.untyped_storage() if isinstance(pool, _TENSOR) else None  # (pool_memory, taken before the pool's checks)
    except Exception:  # a pool whose storage cannot be had: not held, its rows go to the general checks
        return None
    at = pool.data_ptr() if memory is not None else None  # (where its rows' views are taken: asked again by a save)
    got = job_views(keys, rows, _TENSOR, _U8, shape, views, KEY_BYTES)
    if got is None:
        return None
    held = HeldViews(got)  # (HeldViews.of, written out: 60 ns a job less)
    held.memory, held.taken = memory, (pool, at) if at is not None else rows
    return held


def pool_addresses(rows: PoolRows, tensor_type: type, dtype: Any, shape: Any) -> list[int | None] | None:
    """The address of each row of a job's rows given as one pool (a :class:`PoolRows`), the
    pool's checks asked once, of the pool as it is now (as a row's: ``type(pool) is
    tensor_type``, ``pool.dtype is dtype``, 2-D with ``pool.shape[1:] == shape``, ``pool.is_cpu``,
    ``pool.is_contiguous()``); ``None`` for a row whose number is not one of the pool's rows now
    (a pool cut short since), never an address past the pool. ``None`` where the pool or its
    numbers are not such (its rows are then checked one by one, as a list of ``pool[n]`` each)."""
    pool = rows.pool
    if type(pool) is not tensor_type or pool.dtype is not dtype:
        return None
    whole = pool.shape
    if len(whole) != 2 or len(shape) != 1 or whole[1] != shape[0] or not pool.is_cpu or not pool.is_contiguous():
        return None
    size = whole[1] * dtype.itemsize
    base, count, numbers = pool.data_ptr(), whole[0], rows.numbers
    if type(numbers) is not range and (type(numbers) is not tuple or any(type(n) is not int for n in numbers)):
        return None
    return [base + n * size if 0 <= n < count else None for n in numbers]


def _rows_viewed(
    keys: Any, rows: Any, tensor_type: type, dtype: Any, shape: Any, views: dict[int, memoryview], key_bytes: int,
    unseen: Callable[[Any], memoryview | None] | None,
) -> list[memoryview] | None:
    """Each row's :data:`host_view`, else its ``unseen(row)``, when every key is ``bytes`` of
    ``key_bytes`` and every row has a view; else ``None`` (also when the counts differ): the
    loop of :meth:`RowViews.of` (``unseen``: its checks of a row not seen yet; its rows of one
    pool go to :data:`pool_views` first) and of :func:`job_views_python` (``None``: only rows
    seen before). Rows of one pool (a :class:`PoolRows`) whose pool :func:`pool_addresses`
    takes: each row's kept view by its address in ``views``; a row not in the pool now (its
    address ``None``) has none."""
    if type(rows) is PoolRows:
        addresses = pool_addresses(rows, tensor_type, dtype, shape)
        if addresses is not None:  # the same loop, each row's view looked up by its address
            return _viewed(keys, addresses, views.get, tensor_type, dtype, shape, views, key_bytes, None)
        rows = tuple(rows)  # its rows one by one, as a list of pool[n] each
    return _viewed(keys, rows, None, tensor_type, dtype, shape, views, key_bytes, unseen)


def _viewed(
    keys: Any, rows: Any, look: Callable[[Any], memoryview | None] | None, tensor_type: type, dtype: Any, shape: Any, views: dict[int, memoryview], key_bytes: int,
    unseen: Callable[[Any], memoryview | None] | None,
) -> list[memoryview] | None:
    """:func:`_rows_viewed`'s loop: each row's view, ``look(row)`` (``None``: the row's
    :data:`host_view`), else ``unseen(row)``; rows of one pool are given as their addresses
    (:func:`pool_addresses`) with ``look`` their kept views' lookup."""
    if len(keys) != len(rows):
        return None
    seen = host_view
    got = []
    for key, row in zip(keys, rows):
        if type(key) is not bytes or len(key) != key_bytes:
            return None
        view = seen(row, tensor_type, dtype, shape, views) if look is None else look(row)
        if view is None and (unseen is None or (view := unseen(row)) is None):
            return None
        got.append(view)
    return got


def pool_views_python(
    keys: Any, rows: Any, tensor_type: type, dtype: Any, shape: Any, views: dict[int, memoryview], key_bytes: int, unseen_at: Callable[[int], memoryview | None]
) -> Any:
    """:data:`pool_views` in Python: the same answers (``NotImplemented`` where ``rows`` is not a
    :class:`PoolRows` whose pool :func:`pool_addresses` takes)."""
    addresses = pool_addresses(rows, tensor_type, dtype, shape) if type(rows) is PoolRows else None
    if addresses is None:
        return NotImplemented
    return _viewed(keys, addresses, views.get, tensor_type, dtype, shape, views, key_bytes, lambda at: None if at is None else unseen_at(at))


def pool_memory(rows: Any) -> Any:
    """What holds the memory of a job's rows given as one pool (a :class:`PoolRows`: its pool's
    storage as it is now), for the caller to hold until the job's last copy: a pool moved
    meanwhile (``pool.set_(...)`` from another thread while a copy lets the GIL go) then leaves
    that memory to the job, not to the allocator, as a list of views of its rows holds it.
    ``None`` for any other rows (their views hold their memory)."""
    pool = rows.pool if type(rows) is PoolRows else None
    return pool.untyped_storage() if isinstance(pool, torch.Tensor) else None


def host_view_python(row: Any, tensor_type: type, dtype: Any, shape: Any, views: dict[int, memoryview]) -> memoryview | None:
    """:data:`host_view` in Python: the same answers, asked in the same order."""
    if type(row) is not tensor_type or row.dtype is not dtype or row.shape != shape or not row.is_cpu or not row.is_contiguous():
        return None
    return views.get(row.data_ptr())


def same_size_python(fd: int, seen: int) -> bool:
    """:data:`same_size` in Python (``os.lseek``, which hands the GIL over around the call)."""
    if fd < 0:
        return False
    try:
        return os.lseek(fd, 0, os.SEEK_END) == seen
    except OSError:
        return False


def one_row_python(key: Any, key_bytes: int, row: Any, tensor_type: type, dtype: Any, shape: Any, views: dict[int, memoryview], fd: int, seen: int) -> memoryview | bool | None:
    """:data:`one_row` in Python: the same answers, asked in the same order."""
    if type(key) is not bytes or len(key) != key_bytes:
        return None
    view = host_view_python(row, tensor_type, dtype, shape, views)
    if view is None:
        return None
    return view if same_size_python(fd, seen) else False


def job_views_python(keys: Any, rows: Any, tensor_type: type, dtype: Any, shape: Any, views: dict[int, memoryview], key_bytes: int) -> list[memoryview] | None:
    """:data:`job_views` in Python: the same answers, asked in the same order."""
    return _rows_viewed(keys, rows, tensor_type, dtype, shape, views, key_bytes, None)


#: Whether the native forms of :data:`host_view`, :data:`same_size` and :data:`one_row` are loaded.
NATIVE_GUARD: bool = _rowguard is not None
#: ``host_view(row, tensor_type, dtype, shape, views)``: ``views[row.data_ptr()]`` (a
#: :class:`RowViews` row's view) when ``type(row) is tensor_type``, ``row.dtype is dtype``,
#: ``row.shape == shape``, ``row.is_cpu`` and ``row.is_contiguous()``, else ``None`` (also for
#: an address ``views`` does not hold): a row's checks and its view in one call (native:
#: ``backends/_rowguard.c``; 0.5 µs of a 4 KiB one-key read in Python).
host_view: Callable[..., memoryview | None] = _rowguard.host_view if _rowguard is not None else host_view_python
#: ``same_size(fd, seen)``: whether the file open at ``fd`` is ``seen`` bytes long now
#: (``False`` also where ``fd`` cannot be asked: closed): :class:`FileGuard`'s test in one call,
#: without handing the GIL over (native) around an ``lseek`` that never waits.
same_size: Callable[[int, int], bool] = _rowguard.same_size if _rowguard is not None else same_size_python
#: ``one_row(key, key_bytes, row, tensor_type, dtype, shape, views, fd, seen)``: a one-key
#: read's checks before its lookup in one call: ``None`` when ``key`` is not ``bytes`` of
#: ``key_bytes`` or :data:`host_view` is ``None`` (not such a row, or not seen yet); ``False``
#: when :data:`same_size` is (the file's size moved, or it is closed: the caller's
#: :class:`FileGuard` tells which); else the row's view.
one_row: Callable[..., memoryview | bool | None] = _rowguard.one_row if _rowguard is not None else one_row_python
#: ``one_read(parts, env, key, row, clock, cold_s, check)``: a straight read of a job of one key
#: in one native call (:meth:`kvtier.backends.lmdb_one.StraightRead.read`, whose Python form
#: answers alike); ``None`` where the extension is not built.
one_read: Callable[..., list[bool] | bool | None] | None = _rowguard.one_read if _rowguard is not None else None
#: ``job_read(parts, env, keys, out, clock, cold_s, check)``: a straight read of a warm job of
#: several keys in one native call (:meth:`kvtier.backends.lmdb_one.StraightRead.job`, whose
#: Python form answers alike); ``None`` where the extension is not built.
job_read: Callable[..., list[bool] | bool | None] | None = _rowguard.job_read if _rowguard is not None else None
#: ``straight_read(parts, env, keys, out, clock, cold_s, check)``: the whole of
#: :meth:`kvtier.backends.lmdb_one.StraightRead.read` in one native call (:data:`one_read` for a
#: job of one key, :data:`job_read` for others, after its checks of the fork count and of
#: :data:`kvtier.devices.locate`), called by the tier's ``read_blocks`` with no Python frame
#: between; ``None`` where the extension is not built.
straight_read: Callable[..., list[bool] | bool | None] | None = _rowguard.straight_read if _rowguard is not None else None
#: ``job_views(keys, rows, tensor_type, dtype, shape, views, key_bytes)``: each row's
#: :data:`host_view`, when every key is ``bytes`` of ``key_bytes`` and every row's view is one;
#: else ``None`` (also when the counts differ): a job's checks and views in one call (the loop
#: ``job_read`` makes; native: ``backends/_rowsave.c``, whose ``held`` argument, for rows of one
#: pool, gives them as ``held(views)`` with what the pool's checks kept: :func:`held_views`). Its
#: caller makes sure no torch function or dispatch mode is on (:func:`python_in_torch`): a handler
#: run in a later row's checks could free a row whose view is taken already.
job_views: Callable[..., list[memoryview] | None] = _rowguard.job_views if _rowguard is not None else job_views_python
#: ``pool_views(keys, rows, tensor_type, dtype, shape, views, key_bytes, unseen_at)``: the views
#: of a job's rows given as one pool (a :class:`PoolRows`), its pool's checks asked once: each
#: row's kept view by its address, else ``unseen_at(address)`` (a row not seen yet: its view
#: made), when every key is ``bytes`` of ``key_bytes``; ``None`` where the counts differ, a key
#: is not such, a number is not one of the pool's rows now, or ``unseen_at`` gives ``None``;
#: ``NotImplemented`` where the pool is not one those checks take (native:
#: ``backends/_rowsave.c``; :func:`pool_views_python` where the extension is not built, with
#: the same answers). :meth:`RowViews.of`'s one native call for such a job, seen before or not.
pool_views: Callable[..., Any] = _rowguard.pool_views if _rowguard is not None else pool_views_python

