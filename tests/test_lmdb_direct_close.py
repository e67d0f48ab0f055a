"""python-lmdb's own close and resize (``Environment.close``, ``set_mapsize``) wait for a job the
direct lookups (``backends/_lmdbdirect.c``) have in flight: the job is counted in python-lmdb's
in-flight operations until its last copy out of the map. The job parks at the native park point
(``direct_park``), counted and without the GIL, between its lookups and its copies; the close or
resize is begun and seen waiting (python-lmdb's ``ops_waiters``) before the job goes on, so
nothing here hangs on timing. And a job racing a close from another thread, many times over,
reads the right bytes or is refused, and never crashes. Each runs in a child process: a close
that does not wait unmaps what the job then copies from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
from kvtier.backends import lmdb_direct, lmdb_plain

pytestmark = pytest.mark.skipif(
    lmdb_plain._rowguard is None or not hasattr(lmdb_plain._rowguard, "direct_park") or lmdb.__version__ != lmdb_direct.LAYOUT_VERSION,
    reason="needs the native row guard and the python-lmdb the direct lookups were written for",
)

_SETUP = r"""
import asyncio, json, sys, threading, time
import torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_layout, lmdb_plain
from kvtier.testing import make_key, random_block

lmdb_layout.Temperature.slow = lambda self, start: False  # every lookup warm, as the tests' fixture has it
guard = lmdb_plain._rowguard
FMT = BlockFormat(block_bytes=8192, dtype="uint8")
KEYS = [make_key(i) for i in range(4)]
BLOCKS = [random_block(FMT.block_bytes, i) for i in range(4)]
path = sys.argv[1]

def open_tier():
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=path)
    asyncio.run(backend.open(FMT))
    return backend

def warm(backend, rows):
    # a thread's first read of new rows is the general path's; its next ones are straight
    for _ in range(2):
        assert backend.read_blocks(KEYS, rows) == [True] * len(KEYS)
    for row in rows:
        row.zero_()
"""

_PARKED = _SETUP + r"""
how = sys.argv[2]
backend = open_tier()
backend.write_blocks(KEYS, BLOCKS)
env = backend._env
rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in KEYS]
out = {}

def read():
    warm(backend, rows)
    out["jobs"] = guard.direct_jobs()
    guard.direct_park(True)
    out["found"] = backend.read_blocks(KEYS, rows)
    out["direct"] = guard.direct_jobs() - out["jobs"]

reader = threading.Thread(target=read)
reader.start()
while guard.direct_parked() == 0 and reader.is_alive():
    time.sleep(0.001)
out["parked"] = guard.direct_parked()
out["ops_parked"] = list(guard.direct_ops(env))
ender = threading.Thread(target=env.close if how == "close" else (lambda: env.set_mapsize(16 << 20)))
ender.start()
while guard.direct_ops(env)[1] == 0 and ender.is_alive():
    time.sleep(0.001)
out["waited"] = ender.is_alive()  # the close or resize still under way, waiting for the parked job
print(json.dumps(out), flush=True)  # (before the release: a close that did not wait crashes the job)
guard.direct_release()
reader.join()
ender.join()
guard.direct_park(False)
out["rows_right"] = all(torch.equal(row, block) for row, block in zip(rows, BLOCKS))
if how == "close":
    try:
        env.stat()
        out["closed"] = False
    except Exception:
        out["closed"] = True
else:
    out["map_size"] = env.info()["map_size"]
    out["ops_after"] = list(guard.direct_ops(env))
print(json.dumps(out), flush=True)
"""

_RACE = _SETUP + r"""
import random
rounds = int(sys.argv[2])
backend = open_tier()
backend.write_blocks(KEYS, BLOCKS)
asyncio.run(backend.aclose())
rng = random.Random(7)
tally = {"rounds": 0, "right": 0, "wrong": 0, "refused": 0, "direct": 0}
for _ in range(rounds):
    backend = open_tier()
    env = backend._env
    rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in KEYS]
    warmed = threading.Event()

    def read():
        warm(backend, rows)
        warmed.set()
        while True:
            jobs = guard.direct_jobs()
            try:
                found = backend.read_blocks(KEYS, rows)
            except Exception:
                tally["refused"] += 1
                return
            tally["direct"] += guard.direct_jobs() - jobs
            for hit, row, block in zip(found, rows, BLOCKS):
                if hit:
                    tally["right" if torch.equal(row, block) else "wrong"] += 1
                row.zero_()

    reader = threading.Thread(target=read)
    reader.start()
    warmed.wait()
    time.sleep(rng.random() * 0.002)
    env.close()
    reader.join()
    try:
        asyncio.run(backend.aclose())
    except Exception:
        pass
    tally["rounds"] += 1
print(json.dumps(tally), flush=True)
"""


def _child(script: str, *args: str) -> tuple[int, list[dict[str, object]], str]:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, lines, done.stderr[-2000:]


@pytest.mark.parametrize("how", ["close", "resize"])
def test_pythons_close_and_resize_wait_for_a_parked_direct_job(tmp_path: Path, how: str) -> None:
    rc, lines, err = _child(_PARKED, str(tmp_path / "store"), how)
    print(how, rc, lines, err)
    assert lines, f"the child printed nothing (rc {rc}): {err}"
    parked = lines[0]
    assert parked["parked"] == 1 and parked["ops_parked"] == [1, 0]  # parked inside its count, nobody waiting yet
    assert parked["waited"] is True, f"python-lmdb's {how} did not wait for the direct job in flight"
    assert rc == 0 and len(lines) == 2, f"the child died after the release (rc {rc}): {err}"
    after = lines[1]
    assert after["found"] == [True] * 4 and after["rows_right"] is True and after["direct"] == 1
    if how == "close":
        assert after["closed"] is True
    else:
        assert after["map_size"] == 16 << 20 and after["ops_after"] == [0, 0]


def test_a_direct_job_racing_pythons_close_reads_right_or_is_refused(tmp_path: Path) -> None:
    rounds = 100
    rc, lines, err = _child(_RACE, str(tmp_path / "store"), str(rounds))
    print(rc, lines, err)
    assert rc == 0 and lines, f"the child died (rc {rc}): {err}"
    tally = lines[-1]
    assert tally["rounds"] == rounds and tally["refused"] == rounds  # each round ends at the close, refused
    assert tally["wrong"] == 0 and tally["right"] > 0
    assert tally["direct"] > 0  # the racing jobs were the direct lookups'
