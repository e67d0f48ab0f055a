"""A ``file`` tier closed while a read is under way (the read took the tier's one-pass reader,
then the close let the root's descriptor go): the one-pass read leaves its records to the
general path (which refuses a closed tier by name), on the native and the Python read, in either
layout; it never hands the closed descriptor's number to ``openat`` as a ``ValueError`` or a
read of whatever directory the number names next."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block


@pytest.mark.parametrize("layout", ["flat", "sharded"])
@pytest.mark.parametrize("way", ["native", "python"])
def test_a_read_that_outlives_the_tiers_close_is_left_to_the_general_path(tmp_path: Path, layout: str, way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if way == "python":
        monkeypatch.setattr(xxcopy, "xxh3_read_check_at", xxcopy.xxh3_read_check_at_python)
        monkeypatch.setattr(xxcopy, "xxh3_read_check_key", xxcopy.xxh3_read_check_key_python)
        monkeypatch.setattr(xxcopy, "xxh3_read_check", xxcopy.xxh3_read_check_python)
    fmt = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path), sync_mode="fast", layout=layout)
    asyncio.run(backend.open(fmt))
    keys = [make_key(i) for i in range(3)]
    backend.write_blocks(keys, [random_block(fmt.block_bytes, 40 + i) for i in range(3)])
    out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
    assert backend.read_blocks(keys, out) == [True, True, True]
    assert backend.read_blocks(keys[:1], out[:1]) == [True]  # (the row's view is kept)
    plain = backend._plain
    assert plain is not None
    asyncio.run(backend.aclose())
    found = [False] * 3
    assert plain.read(keys, out, found) == [0, 1, 2]
    assert found == [False, False, False]
    assert plain.read_one(keys[0], out[0], backend.counters) is None


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_a_read_that_outlives_the_tiers_close_reads_nothing_of_a_store_opened_since(tmp_path: Path, layout: str) -> None:
    """The closed root's descriptor number is handed out again (here to another store's root):
    the closed tier's one-pass read must not open its records beneath it."""
    fmt = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
    first = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path / "a"), sync_mode="fast", layout=layout)
    asyncio.run(first.open(fmt))
    keys = [make_key(i) for i in range(2)]
    out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
    first.write_blocks(keys, [random_block(fmt.block_bytes, 40 + i) for i in range(2)])
    assert first.read_blocks(keys, out) == [True, True]
    assert first.read_blocks(keys[:1], out[:1]) == [True]
    plain = first._plain
    assert plain is not None
    asyncio.run(first.aclose())
    second = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path / "b"), sync_mode="fast", layout=layout)
    asyncio.run(second.open(fmt))
    try:
        second.write_blocks(keys, [random_block(fmt.block_bytes, 50 + i) for i in range(2)])
        found = [False] * 2
        assert plain.read(keys, out, found) == [0, 1]
        assert found == [False, False]
        assert plain.read_one(keys[0], out[0], first.counters) is None
    finally:
        asyncio.run(second.aclose())


_RACE = r"""
import asyncio, sys, tempfile, threading, torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
fmt = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
tmp = tempfile.mkdtemp()
def opened(name):
    backend = registry.backends.get("file")(capacity=8 << 20, path=f"{tmp}/{name}", sync_mode="fast", layout="flat")
    asyncio.run(backend.open(fmt))
    return backend
first = opened("a")
keys = [make_key(i) for i in range(2)]
data = [random_block(fmt.block_bytes, 40 + i) for i in range(2)]
first.write_blocks(keys, data)
out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
first.read_blocks(keys, out)
real, entered, go = xxcopy.xxh3_read_check_key, threading.Event(), threading.Event()
def held(dir_fd, *args):  # the read's native call, held between its descriptor's read and its open
    if not entered.is_set():
        entered.set()
        go.wait()
    return real(dir_fd, *args)
xxcopy.xxh3_read_check_key = held
got = []
reader = threading.Thread(target=lambda: got.append(first.read_blocks(keys, out)))
reader.start()
entered.wait()
closed = threading.Event()
closer = threading.Thread(target=lambda: (asyncio.run(first.aclose()), closed.set()))
closer.start()
if not closed.wait(0.5):  # the close waits for the read under way: let the read go on first
    go.set()
closer.join()
second = opened("b")  # may take the closed root's descriptor number
second.write_blocks(keys, [random_block(fmt.block_bytes, 50 + i) for i in range(2)])
go.set()
reader.join()
print(got[0], all(torch.equal(o, d) for o, d, hit in zip(out, data, got[0]) if hit))
asyncio.run(second.aclose())
"""


def test_a_close_waits_for_a_read_under_way_before_its_root_descriptor_is_reused() -> None:
    """A read whose native open comes after a close began: the close waits for it, so the
    read opens the closed store's own records, never those of a store opened since under the
    descriptor's number (child process: a close that never ends fails the test, not the run)."""
    child = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["[True,", "True]", "True"], child.stdout
