"""A pool grown in place (``pool.resize_`` to more rows) by another thread while a straight
read's lookups run without the GIL: torch reallocates the pool's storage's memory and frees the
old memory, which the job's views (addresses taken at the rows' checks, before the lookups)
still point at. Neither the storage the job holds (the same storage object, its memory swapped)
nor a list of views of the pool's rows (views of that same storage) keeps the old memory: the
rows' addresses are asked again once the lookups are done, the GIL held from there to the copy,
and a job whose rows moved is the general path's, which reads into the rows where they are now.
The same move by ``pool.set_(...)`` is held (the storage hold) and seen likewise.

What stays open (docs/architecture.md, the engine's contract): torch's own ops (``set_``,
``resize_``) let the GIL go inside, so another thread's move begun during the lookups may still
be under way at the copy, and a copy of 16 KiB or more lets the GIL go. Run in a child: a write
to freed memory crashes it (a 64 MiB pool has its own mapping, unmapped when freed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_rowguard = pytest.importorskip("kvtier.backends._rowguard")

_GROWN = r"""
import asyncio, sys, tempfile, threading, time, torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.pool_rows import PoolRows
from kvtier.testing import make_key, random_block
from kvtier.backends import _rowguard as rg
job, form, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
b = registry.backends.get("lmdb")(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast")
asyncio.run(b.open(BlockFormat(block_bytes=4096, dtype="uint8")))
keys = [make_key(i) for i in range(job)]
b.write_blocks(keys, [random_block(4096, i, torch.uint8) for i in range(job)])
pool = torch.zeros(16384, 4096, dtype=torch.uint8)  # 64 MiB: its memory mapped alone, unmapped when freed
numbers = range(16384 - job, 16384)
rows = PoolRows(pool, numbers) if form == "pool" else [pool[i] for i in numbers]
warm, go, got = threading.Event(), threading.Event(), []
def reader():
    for _ in range(3):  # (the rows' views kept, the thread's first straight read marked)
        b.read_blocks(keys, rows)
    warm.set()
    go.wait()
    got.append(b.read_blocks(keys, rows))
t = threading.Thread(target=reader)
t.start()
warm.wait(60)
jobs = rg.direct_jobs()
rg.direct_park(True)
go.set()
deadline = time.monotonic() + 30
while rg.direct_parked() == 0 and time.monotonic() < deadline:
    time.sleep(0.001)
parked = rg.direct_parked()
old = pool.data_ptr()
if how == "grown":
    pool.resize_(32768, 4096)  # the storage's memory reallocated, the old freed
else:
    pool.set_(torch.zeros(2, 4096, dtype=torch.uint8))
moved = pool.data_ptr() != old
rg.direct_park(False)
rg.direct_release()
t.join()
# each row read holds its block where the pool is now (the grown pool keeps its first rows)
held = how == "grown" and all(torch.equal(pool[n], random_block(4096, i, torch.uint8)) for i, n in enumerate(numbers))
print(parked, moved, rg.direct_jobs() - jobs, held, got)
"""


def _child(job: int, form: str, how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _GROWN, str(job), form, how], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("form", ["pool", "list"])
@pytest.mark.parametrize("job", [1, 4])
def test_a_pool_moved_by_set_during_the_lookups_leaves_its_memory_to_the_job(job: int, form: str) -> None:
    child = _child(job, form, "set")
    assert child.returncode == 0, child.stderr[-2000:]
    parked, moved, direct, _, _ = child.stdout.split(maxsplit=4)
    assert (parked, moved, direct) == ("1", "True", "1")  # the job parked in its lookups, the pool moved meanwhile


@pytest.mark.parametrize("form", ["pool", "list"])
@pytest.mark.parametrize("job", [1, 4])
def test_a_pool_grown_during_the_lookups_is_never_written_where_it_was(job: int, form: str) -> None:
    child = _child(job, form, "grown")
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    parked, moved, direct, held, got = child.stdout.split(maxsplit=4)
    assert (parked, moved, direct) == ("1", "True", "1")
    assert (held, got.strip()) == ("True", repr([[True] * job]))  # read where the rows are now


_PYGET = r"""
import asyncio, sys, tempfile, torch
sys.path.insert(0, sys.argv[3])
from lmdb_lookups import HookedEnv
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_direct
from kvtier.pool_rows import PoolRows
from kvtier.testing import make_key, random_block
job, form = int(sys.argv[1]), sys.argv[2]
lmdb_direct.DIRECT_GETS = False  # python-lmdb's get, which lets the GIL go for each lookup
b = registry.backends.get("lmdb")(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast")
asyncio.run(b.open(BlockFormat(block_bytes=4096, dtype="uint8")))
keys = [make_key(i) for i in range(job)]
b.write_blocks(keys, [random_block(4096, i, torch.uint8) for i in range(job)])
pool = torch.zeros(16384, 4096, dtype=torch.uint8)
numbers = range(16384 - job, 16384)
rows = PoolRows(pool, numbers) if form == "pool" else [pool[i] for i in numbers]
for _ in range(3):
    b.read_blocks(keys, rows)
pool.zero_()
armed, old = [True], pool.data_ptr()
def grow(key):  # in the job's first lookup: what another thread may do while the GIL is let go there
    if armed[0]:
        armed[0] = False
        pool.resize_(32768, 4096)
env = b._env
b._env = HookedEnv(env, grow)
got = b.read_blocks(keys, rows)
b._env = env
held = all(torch.equal(pool[n], random_block(4096, i, torch.uint8)) for i, n in enumerate(numbers))
print(armed[0], pool.data_ptr() != old, held, got)
"""


@pytest.mark.parametrize("form", ["pool", "list"])
@pytest.mark.parametrize("job", [1, 4])
def test_a_pool_grown_during_pythons_get_is_never_written_where_it_was(job: int, form: str) -> None:
    here = str(Path(__file__).parent)
    child = subprocess.run([sys.executable, "-c", _PYGET, str(job), form, here], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    armed, moved, held, got = child.stdout.split(maxsplit=3)
    assert (armed, moved, held, got.strip()) == ("False", "True", "True", repr([True] * job))
