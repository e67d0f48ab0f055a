"""A pool grown in place (``pool.resize_`` to more rows) by another thread between a ``file``
save's checksum and its write: the write copies out of the rows' old memory, which torch has
freed by then. A ``file`` save hashes each row right after its view is taken, the GIL held,
and its write is the kernel's copy (``pwritev``): a row moved before it makes the write fail
(``EFAULT`` where the old memory is unmapped: a counted write failure, a miss) or stores bytes
its checksum refuses on read, never a crash and never a record served with the wrong bytes.

The window is opened deterministically: the pool is grown just before the write. Run in a
child: a read of freed memory by the process itself would crash it (a 64 MiB pool has its own
mapping, unmapped when freed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import grown_saves

_GROWN = r"""
import asyncio, sys, tempfile
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import file_commit, file_saves
job, form, one = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "one"
file_saves.SAVE_ONE = one
b = registry.backends.get("file")(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast")
asyncio.run(b.open(BlockFormat(block_bytes=4096, dtype="uint8")))
""" + grown_saves.ROWS + r"""
real, grown = file_commit.write_all, []
def write_all(fd, buffers, nbytes=None):  # the first write of the job: another thread grows the pool first
    if not grown:
        old = pool.data_ptr()
        pool.resize_(32768, 4096)  # the storage's memory reallocated, the old freed (unmapped)
        grown.append(pool.data_ptr() != old)
    return real(fd, buffers, nbytes)
file_commit.write_all = write_all
failures = b.counters.write_failures
sizes = b.write_blocks(keys, rows)
file_commit.write_all = real
""" + grown_saves.READ_BACK + r"""
print(grown == [True], right, answered, b.counters.write_failures - failures == sizes.count(None))
"""


@pytest.mark.parametrize(("job", "path"), [(1, "one"), (1, "general"), (4, "general")])
@pytest.mark.parametrize("form", ["pool", "list"])
def test_a_pool_grown_before_a_file_save_writes_is_never_served_wrong(job: int, form: str, path: str) -> None:
    child = subprocess.run([sys.executable, "-c", _GROWN, str(job), form, path], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    # the pool moved before the write; every block found holds its row's bytes, and only a saved
    # one is found; each key not saved counted as a write failure
    assert child.stdout.split() == ["True"] * 4
