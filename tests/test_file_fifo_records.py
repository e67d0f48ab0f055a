"""A FIFO (or another file that is not a regular one) planted in a ``file`` store in a record's
place, by anyone who can write the directory, is a miss: the read's ``open`` does not wait for
a writer that never comes (``O_NONBLOCK``), and the other records of the job are read as
before, on the one-pass read (native and Python) and the general read. The read runs in a child
process, so a read that blocks fails the test instead of stopping the run."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = """
import asyncio, os, sys, tempfile, torch
from pathlib import Path
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import file_tier
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
layout, way = sys.argv[1], sys.argv[2]
if way == "python":
    xxcopy.xxh3_read_check_key = xxcopy.xxh3_read_check_key_python
    xxcopy.xxh3_read_check_keys = xxcopy.xxh3_read_check_keys_python
    xxcopy.xxh3_read_one = xxcopy.xxh3_read_one_python
    xxcopy.xxh3_read_check = xxcopy.xxh3_read_check_python
if way == "general":
    file_tier.PLAIN_READS = False
fmt = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
root = Path(tempfile.mkdtemp())
backend = registry.backends.get("file")(capacity=8 << 20, path=str(root), sync_mode="fast", layout=layout)
asyncio.run(backend.open(fmt))
keys = [make_key(i) for i in range(3)]
data = [random_block(fmt.block_bytes, 40 + i) for i in range(3)]
backend.write_blocks(keys, data)
h = keys[1].hex()
record = root / f"{h}.kvb" if layout == "flat" else root / h[:2] / h[2:4] / f"{h}.kvb"
record.unlink()
os.mkfifo(record)
for job in ([keys[1]], keys):
    out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in job]
    found = backend.read_blocks(job, out)
    print("found", found)
    print("bytes", all(torch.equal(o, data[keys.index(k)]) for o, k, f in zip(out, job, found) if f))
"""


@pytest.mark.parametrize(("layout", "way"), [("flat", "native"), ("flat", "python"), ("flat", "general"), ("sharded", "native"), ("sharded", "general")])
def test_a_fifo_in_a_records_place_is_a_miss_not_a_wait(layout: str, way: str) -> None:
    try:
        child = subprocess.run([sys.executable, "-c", _CHILD, layout, way], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {layout} store's {way} read of a FIFO in a record's place is still waiting for a writer")
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[:4] == ["found [False]", "bytes True", "found [True, False, True]", "bytes True"], child.stdout
