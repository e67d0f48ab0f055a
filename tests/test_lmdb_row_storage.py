"""A job's rows' views are taken before its copies; Python run between (a torch function mode's
handler, which the tensor getters of a later row's checks call) may free an earlier row's memory.
The copy must then never write where that row was: before, it wrote the record into memory
freed meanwhile (here handed straight to a new tensor, which the read overwrote; a crash or a
corrupt heap elsewhere). A job read while such a mode is on is the general path's, whose copies
take each row's memory as they write it. The native job read, the Python form of the straight
read, and the tier's views (``RowViews.of``) each. Run in a child: a write to freed memory may
crash it."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from kvtier.backends import lmdb_plain
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SIZE = 4096

#: What both children run their job under (rows: the job's rows): at the second row's first
#: check, the first row's memory is freed and handed to a new tensor of sevens (freed[1]).
_FREES = r"""
freed = []
class Frees(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not freed and args and args[0] is rows[1]:
            freed.append(rows[0].data_ptr())
            rows[0].set_(torch.empty(0, dtype=torch.uint8))
            freed.append(torch.full((4096,), 7, dtype=torch.uint8))
        return func(*args, **(kwargs or {}))
"""

#: How both read children end: their job read again under the freeing mode, then whether the
#: mode ran and whether the tensor handed the freed memory was written.
_READ_UNDER_FREES = _FREES + r"""
with Frees():
    try:
        backend.read_blocks(keys, rows)
    except (ValueError, TypeError):
        pass  # the first row is now empty: the general path may refuse it by name
print(bool(freed), bool(freed) and bool((freed[1] != 7).any()))
asyncio.run(backend.aclose())
"""

_CHILD = r"""
import asyncio, sys, tempfile, torch
from torch.overrides import TorchFunctionMode
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_one, lmdb_plain
from kvtier.testing import make_key, random_block
way = sys.argv[1]
if way != "native":
    lmdb_plain.straight_read = lmdb_plain.job_read = lmdb_plain.one_read = None
if way == "views":
    lmdb_one.STRAIGHT_READS = False
fmt = BlockFormat(block_bytes=4096, dtype="uint8")
backend = registry.backends.get("lmdb")(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast")
asyncio.run(backend.open(fmt))
n = 4
keys = [make_key(i) for i in range(n)]
backend.write_blocks(keys, [random_block(4096, i) for i in range(n)])
rows = [torch.zeros(4096, dtype=torch.uint8) for _ in range(n)]  # each its own memory
assert backend.read_blocks(keys, rows) == [True] * n  # (the rows' views kept, the thread marked)
""" + _READ_UNDER_FREES


@pytest.mark.parametrize("way", ["native", "python", "views"])
def test_a_job_read_never_writes_a_row_freed_by_python_run_during_its_checks(way: str) -> None:
    _never_written(_CHILD, way)


def _never_written(script: str, arg: str) -> None:
    """Run a read child: the freeing mode ran mid-job, and the memory it freed was not written."""
    child = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    freed, written = child.stdout.split()
    assert freed == "True", child.stdout  # the handler ran mid-job
    assert written == "False", "the job wrote its first record into memory freed during its checks"


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _Plain(torch.Tensor):
    pass


class _Own(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs)


def test_python_in_torch_tells_modes_and_rows_with_a_torch_function_of_their_own() -> None:
    row = torch.zeros(SIZE, dtype=torch.uint8)
    assert not lmdb_plain.python_in_torch([row, row])
    assert not lmdb_plain.python_in_torch([row, row.as_subclass(_Plain), torch.nn.Parameter(row, requires_grad=False)])
    assert lmdb_plain.python_in_torch([row, row.as_subclass(_Own)])
    with TorchFunctionMode():
        assert lmdb_plain.python_in_torch([row])
    with TorchDispatchMode():
        assert lmdb_plain.python_in_torch([row])
    assert not lmdb_plain.python_in_torch([row])


def test_row_views_refuse_a_job_whose_checks_would_run_code_of_its_own() -> None:
    """``RowViews.of`` (and ``host_rows``) hand such a job to the general checks; the same rows
    are viewed once nothing runs."""
    views = lmdb_plain.RowViews(SIZE)
    rows = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(3)]
    keys = [bytes(32)] * 3
    assert views.of(keys, rows) is not None and lmdb_plain.host_rows(rows, SIZE) is not None
    for mode in (TorchFunctionMode, TorchDispatchMode):
        with mode():
            assert views.of(keys, rows) is None and lmdb_plain.host_rows(rows, SIZE) is None
    own = [rows[0], rows[1].as_subclass(_Own), rows[2]]
    assert views.of(keys, own) is None and lmdb_plain.host_rows(own, SIZE) is None
    plain = [rows[0], rows[1].as_subclass(_Plain), rows[2]]
    assert views.of(keys, plain) is not None and lmdb_plain.host_rows(plain, SIZE) is not None
    cut = list(torch.zeros((3, SIZE), dtype=torch.uint8).unbind(0))  # rows of one tensor: one view of it
    assert lmdb_plain.host_rows(cut, SIZE) is not None
    assert lmdb_plain.host_rows([cut[0], cut[1].as_subclass(_Own), cut[2]], SIZE) is None
    with _PassThrough():
        assert lmdb_plain.host_rows(cut, SIZE) is None


@pytest.mark.parametrize("native", [True, False])
def test_a_job_read_while_a_mode_is_on_reads_as_without(native: bool, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The general path a job under a mode takes reads the same bytes and hits as the fast one."""
    import asyncio

    from kvtier import registry
    from kvtier.backend import BlockFormat
    from kvtier.testing import make_key, random_block

    if not native:
        for name in ("straight_read", "job_read", "one_read"):
            monkeypatch.setattr(lmdb_plain, name, None)
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(tmp_path), sync_mode="fast")
    asyncio.run(backend.open(BlockFormat(block_bytes=SIZE, dtype="uint8")))
    try:
        keys = [make_key(i) for i in range(5)]
        blocks = [random_block(SIZE, i) for i in range(4)]
        backend.write_blocks(keys[:4], blocks)
        rows = [torch.zeros(SIZE, dtype=torch.uint8) for _ in keys]
        fast = backend.read_blocks(keys, rows)
        fast_rows = [r.clone() for r in rows[:4]]
        for r in rows:
            r.zero_()
        with _PassThrough():
            general = backend.read_blocks(keys, rows)
    finally:
        asyncio.run(backend.aclose())
    assert fast == general == [True] * 4 + [False]
    assert all(torch.equal(r, f) and torch.equal(r, b.view(torch.uint8)) for r, f, b in zip(rows, fast_rows, blocks))


_SAVE_CHILD = r"""
import asyncio, sys, tempfile, torch
from torch.overrides import TorchFunctionMode
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.testing import make_key, random_block
kind = sys.argv[1]
fmt = BlockFormat(block_bytes=4096, dtype="uint8")
backend = registry.backends.get(kind)(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast")
asyncio.run(backend.open(fmt))
n = 4
rows = [random_block(4096, i).view(torch.uint8).clone() for i in range(n)]  # each its own memory
first = rows[0].clone()
warm = [make_key(100 + i) for i in range(n)]
backend.write_blocks(warm, rows)  # (the rows' views kept)
keys = [make_key(i) for i in range(n)]
""" + _FREES + r"""with Frees():
    try:
        backend.write_blocks(keys, rows)
    except (ValueError, TypeError):
        pass  # the first row is now empty: the general path may refuse it by name
out = [torch.zeros(4096, dtype=torch.uint8)]
hit = backend.read_blocks(keys[:1], out) == [True]
print(bool(freed), hit and not torch.equal(out[0], first))
asyncio.run(backend.aclose())
"""


@pytest.mark.parametrize("kind", ["lmdb", "file"])
def test_a_job_save_never_stores_the_bytes_of_a_row_freed_by_python_run_during_its_checks(kind: str) -> None:
    """A record saved from a row's view taken before a mode's handler freed that row's memory
    would hold whatever is there now, under a sound checksum: wrong data served later."""
    child = subprocess.run([sys.executable, "-c", _SAVE_CHILD, kind], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    freed, wrong = child.stdout.split()
    assert freed == "True", child.stdout  # the handler ran mid-job
    assert wrong == "False", "the job stored other bytes than its first row's under its first key"


_ONE_CHILD = r"""
import asyncio, sys, tempfile, torch
from torch.overrides import TorchFunctionMode
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_plain
from kvtier.testing import make_key, random_block
tier, way = sys.argv[1], sys.argv[2]
if way != "native":
    lmdb_plain.straight_read = lmdb_plain.one_read = None
fmt = BlockFormat(block_bytes=4096, dtype="uint8")
more = {"layout": "flat"} if tier == "file" else {}
backend = registry.backends.get(tier)(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast", **more)
asyncio.run(backend.open(fmt))
keys = [make_key(0)]
backend.write_blocks(keys, [random_block(4096, 0)])
rows = [torch.zeros(4096, dtype=torch.uint8)]
for _ in range(3):  # (the row's view kept, the thread marked)
    assert backend.read_blocks(keys, rows) == [True]
freed = []
class FreesAfter(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        got = func(*args, **(kwargs or {}))
        if not freed and getattr(func, "__name__", "") == "data_ptr":
            rows[0].set_(torch.empty(0, dtype=torch.uint8))
            freed.append(torch.full((4096,), 7, dtype=torch.uint8))
        return got
with FreesAfter():
    try:
        backend.read_blocks(keys, rows)
    except (ValueError, TypeError):
        pass
print(bool(freed) and bool((freed[0] != 7).any()))
asyncio.run(backend.aclose())
"""


@pytest.mark.parametrize(("tier", "way"), [("lmdb", "native"), ("lmdb", "python"), ("file", "native")])
def test_a_job_of_one_never_writes_its_row_freed_once_its_address_was_read(tier: str, way: str) -> None:
    """A torch function mode's handler frees the row just after its ``data_ptr()`` answered (and
    hands the memory to a tensor of sevens): a job of one record, read by its straight line or
    the plain reads, must not write the record there (a child: it may crash)."""
    child = subprocess.run([sys.executable, "-c", _ONE_CHILD, tier, way], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["False"], "the job wrote its record into memory freed during its row's checks"


_ONE_SAVE_CHILD = r"""
import asyncio, sys, tempfile, torch
from torch.overrides import TorchFunctionMode
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.testing import make_key, random_block
tier = sys.argv[1]
more = {"layout": "flat"} if tier == "file" else {}
backend = registry.backends.get(tier)(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast", **more)
asyncio.run(backend.open(BlockFormat(block_bytes=4096, dtype="uint8")))
keys = [make_key(0)]
shadow = torch.zeros(4096, dtype=torch.uint8)
row = shadow.view(-1)  # its memory also held by shadow
for i in range(3):  # (the row's view kept)
    row.copy_(random_block(4096, i))
    backend.write_blocks(keys, [row])
first = random_block(4096, 9)
row.copy_(first)
moved = []
class MovesAfter(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        got = func(*args, **(kwargs or {}))
        if not moved and getattr(func, "__name__", "") == "data_ptr":
            row.set_(first.clone())  # the row moves, its bytes the same; its old memory gets sevens
            shadow.fill_(7)
            moved.append(True)
        return got
with MovesAfter():
    backend.write_blocks(keys, [row])
out = [torch.zeros(4096, dtype=torch.uint8)]
print(backend.read_blocks(keys, out) == [True] and not torch.equal(out[0], first))
asyncio.run(backend.aclose())
"""


@pytest.mark.parametrize("tier", ["lmdb", "file"])
def test_a_save_of_one_block_never_stores_the_memory_its_row_moved_from_under_a_mode(tier: str) -> None:
    """A torch function mode's handler moves the row just after its ``data_ptr()`` answered. The
    ``lmdb`` tier's lone save built its record from that address: the sevens now there, stored
    under a sound checksum (a child: the memory could as well have been freed)."""
    child = subprocess.run([sys.executable, "-c", _ONE_SAVE_CHILD, tier], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["False"], "the save stored other bytes than its row's"
