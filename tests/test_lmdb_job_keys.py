"""The native straight read of a job of several keys (``lmdb_plain.job_read``) reads the keys the
job had when the call began: a keys list emptied or grown meanwhile (by another thread, while a
lookup let the GIL go; here by the record check the call makes) must not be read through its
old item array, which the list frees (before: the keys after the first were read from freed
memory, misses or worse). So must its rows list, which Python run mid-call may change likewise
(a job read while a torch function mode is on, whose handler runs in the rows' checks, is the
general path's: ``test_lmdb_row_storage.py``). Run in a child: a read of freed memory may crash
it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvtier.backends import lmdb_plain

_CHILD = r"""
import asyncio, tempfile, torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_one, lmdb_plain
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
fmt = BlockFormat(block_bytes=4096, dtype="uint8")
backend = registry.backends.get("lmdb")(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast")
asyncio.run(backend.open(fmt))
n = 8
keys = [make_key(i) for i in range(n)]
blocks = [random_block(4096, i) for i in range(n)]
backend.write_blocks(keys, blocks)
rows = [torch.zeros(4096, dtype=torch.uint8) for _ in range(n)]
assert backend.read_blocks(keys, rows) == [True] * n  # (the rows' views kept, the thread marked)
job = [bytes(bytearray(k)) for k in keys]  # the job's own keys: the list holds their only references
checked = []
def check(*args):
    if not checked:
        job.clear()  # the caller's list emptied and grown while the job runs
        job.extend(bytes(32) for _ in range(100))
    checked.append(1)
    return xxcopy.xxh3_check_copy(*args)
for row in rows:
    row.zero_()
got = lmdb_plain.job_read(backend._straight.native_parts, backend._env, job, rows, lmdb_one.perf_counter, lmdb_one.COLD_GET_S, check)
print(got == [True] * n, all(torch.equal(r, b.view(torch.uint8)) for r, b in zip(rows, blocks)))
asyncio.run(backend.aclose())
"""


@pytest.mark.skipif(lmdb_plain.job_read is None, reason="kvtier.backends._rowguard not built")
def test_a_job_read_reads_the_keys_it_was_given_when_the_list_changes_meanwhile() -> None:
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["True", "True"], child.stdout


_ROWS_CHILD = _CHILD.replace("job = [bytes(bytearray(k)) for k in keys]", "job = list(keys)\ngiven = list(rows)").replace(
    """        job.clear()  # the caller's list emptied and grown while the job runs
        job.extend(bytes(32) for _ in range(100))""",
    """        given.clear()  # the caller's rows list emptied and grown while the job runs
        given.extend(torch.zeros(1, dtype=torch.uint8) for _ in range(100))""",
).replace("backend._env, job, rows, lmdb_one.perf_counter", "backend._env, job, given, lmdb_one.perf_counter")


@pytest.mark.skipif(lmdb_plain.job_read is None, reason="kvtier.backends._rowguard not built")
def test_a_job_read_reads_into_the_rows_it_was_given_when_the_list_changes_meanwhile() -> None:
    child = subprocess.run([sys.executable, "-c", _ROWS_CHILD], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["True", "True"], child.stdout


@pytest.mark.skipif(lmdb_plain.job_read is None, reason="kvtier.backends._rowguard not built")
def test_a_job_read_leaves_the_reference_counts_of_true_and_false_where_they_were(tmp_path) -> None:
    """Each entry of the answer is set once: before, the list was filled with False and each key's
    entry set again over it without the first False released, a reference to False leaked per key
    per call (on 3.11 False is counted like any object: 10,000 calls drifted it by 40,000)."""
    import asyncio

    import torch
    from kvtier.backends import lmdb_one

    from kvtier import registry
    from kvtier.backend import BlockFormat
    from kvtier.records import xxcopy
    from kvtier.testing import make_key, random_block

    fmt = BlockFormat(block_bytes=4096, dtype="uint8")
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(tmp_path), sync_mode="fast")
    asyncio.run(backend.open(fmt))
    try:
        stored = [make_key(i) for i in range(2)]
        backend.write_blocks(stored, [random_block(4096, i) for i in range(2)])
        keys = [stored[0], make_key(100), stored[1], make_key(101)]  # two hits, two misses
        rows = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, rows) == [True, False, True, False]  # (views kept, thread marked)
        parts, env = backend._straight.native_parts, backend._env

        def job() -> object:
            return lmdb_plain.job_read(parts, env, keys, rows, lmdb_one.perf_counter, lmdb_one.COLD_GET_S, xxcopy.xxh3_check_copy)

        assert job() == [True, False, True, False]
        false_before, true_before = sys.getrefcount(False), sys.getrefcount(True)
        for _ in range(10_000):
            job()
        false_drift, true_drift = sys.getrefcount(False) - false_before, sys.getrefcount(True) - true_before
    finally:
        asyncio.run(backend.aclose())
    assert abs(false_drift) < 1000, f"False's reference count drifted by {false_drift} over 10,000 job reads"
    assert abs(true_drift) < 1000, f"True's reference count drifted by {true_drift} over 10,000 job reads"
