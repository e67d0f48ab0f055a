"""Closing an ``lmdb`` tier while another thread reads it. python-lmdb's ``close`` unmaps the
file at once, and a read copies from the mapped value with the GIL released (the native
check-copy of :mod:`kvtier.records.xxcopy`), so a close in that window faulted the process
(SIGSEGV). The close now refuses new reads first, then waits for the ones under way before it
unmaps. Each case runs in a child process, so a fault fails the test instead of the run; the
read is held inside its copy (as the native pass would be, the GIL released) until the close
has begun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = """
import asyncio, sys, threading, time
import torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_one

from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block

path, how = sys.argv[1], sys.argv[2]
lmdb_one.STRAIGHT_READS = how != "general"
fmt = BlockFormat(block_bytes=1 << 20, dtype="uint8")
backend = registry.backends.get("lmdb")(capacity=32 << 20, path=path, sync_mode="fast")
asyncio.run(backend.open(fmt))
n = 1 if how.startswith("one") else 3
keys = [make_key(i) for i in range(n)]
blocks = [random_block(fmt.block_bytes, i) for i in range(n)]
backend.write_blocks(keys, blocks)
rows = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in range(n)]
assert backend.read_blocks(keys, rows) == [True] * n  # the rows' views are made
for row in rows:
    row.zero_()
inside, go, armed = threading.Event(), threading.Event(), threading.Event()
if how != "one warm":
    armed.set()

def held(real):
    def call(*args):
        if armed.is_set() and not inside.is_set():
            inside.set()
            go.wait(60)  # the copy, GIL released, is under way here when the close begins
        return real(*args)
    return call

xxcopy.xxh3_check_copy = held(xxcopy.xxh3_check_copy)
xxcopy.xxh3_copy = held(xxcopy.xxh3_copy)
got = {}

def read():
    try:
        if not armed.is_set():  # "one warm": the thread's first job done (its faults marked), then held
            backend.read_blocks(keys, rows)
            armed.set()
        got["read"] = backend.read_blocks(keys, rows)
    except Exception as exc:
        got["read"] = repr(exc)

reader = threading.Thread(target=read)
reader.start()
assert inside.wait(60), "the read never reached its copy"
env = backend._env
closer = threading.Thread(target=lambda: asyncio.run(backend.aclose()))
closer.start()
while backend._reader.guard.fd != -1:  # the close has begun: new reads are refused
    time.sleep(0.001)
try:
    late = backend.read_blocks(keys[:1], [torch.zeros(fmt.block_bytes, dtype=torch.uint8)])
except Exception as exc:  # (a ClosedError or a DiskError)
    late = type(exc).__name__
go.set()
reader.join()
closer.join()
print("read", got["read"], flush=True)
print("same", all(torch.equal(r, b) for r, b in zip(rows, blocks)), flush=True)
print("late", late, flush=True)
try:  # unmapped, not left open (a close whose wait ran out sets _env to None too)
    env.info()
    unmapped = False
except Exception:
    unmapped = True
print("closed", backend._env is None and unmapped, flush=True)
"""


@pytest.mark.parametrize("how", ["one", "one warm", "job", "general"])
def test_a_close_waits_for_a_read_copying_from_the_map(tmp_path: Path, how: str) -> None:
    """The read under way ends with the right bytes, one that starts once the close began is
    refused, and the environment is closed after both; the child does not fault (-11 before).
    ``one warm``: a job of one key on a thread that read before (the native straight read,
    ``lmdb_plain.one_read``, where built; a thread's first job is read in Python)."""
    child = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "store"), how], capture_output=True, text=True, timeout=300)
    print(child.stdout, child.stderr[-3000:])
    assert child.returncode == 0
    read = [True] if how.startswith("one") else [True] * 3
    assert f"read {read}" in child.stdout and "same True" in child.stdout
    assert "late DiskError" in child.stdout or "late ClosedError" in child.stdout
    assert "closed True" in child.stdout
