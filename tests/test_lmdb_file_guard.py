"""The ``lmdb`` tier's file guard (``lmdb_plain.FileGuard``) refuses reads once ``data.mdb`` is
shorter than it was, and only then: reads run on several threads while saves grow the file, so
a check may measure the file just before another thread's check records it larger. That check
compares with what was recorded before it measured, and so never takes a file that grew for one
that was cut (it refused such reads with a DiskError, "shorter than the ... it held", in about
one run of five of 8 threads reading and saving at once)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from kvtier.backends import lmdb_plain

from kvtier.errors import DiskError


def _guarded(tmp_path: Path, size: int) -> tuple[str, lmdb_plain.FileGuard]:
    path = str(tmp_path / "data.mdb")
    with open(path, "wb") as f:
        f.truncate(size)
    return path, lmdb_plain.FileGuard(path)


def _checked_while_another_grows(guard: lmdb_plain.FileGuard, path: str, monkeypatch: pytest.MonkeyPatch, grown: int) -> None:
    """``guard.check()`` where, between this check's measure and its compare, another thread's
    save grows the file to ``grown`` bytes and that thread's check records it."""
    lseek = os.lseek

    def measured_then_overtaken(fd: int, pos: int, how: int) -> Any:
        size = lseek(fd, pos, how)  # this thread's measure
        os.truncate(path, grown)
        guard.seen = grown
        return size

    monkeypatch.setattr(os, "lseek", measured_then_overtaken)
    try:
        guard.check()
    finally:
        monkeypatch.undo()


def test_a_file_that_grew_while_another_thread_checked_it_is_not_taken_for_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, guard = _guarded(tmp_path, 4096)
    _checked_while_another_grows(guard, path, monkeypatch, 8192)  # measured 4096, then 8192 recorded
    assert guard.seen == 8192
    guard.check()
    assert guard.seen == 8192
    guard.close()


def test_a_cut_file_is_refused_and_a_grown_one_recorded(tmp_path: Path) -> None:
    path, guard = _guarded(tmp_path, 8192)
    os.truncate(path, 12288)
    guard.check()
    assert guard.seen == 12288
    os.truncate(path, 4096)
    with pytest.raises(DiskError, match="4096 bytes, shorter than the 12288 it held"):
        guard.check()
    guard.close()


def test_a_check_that_measured_less_does_not_store_over_a_larger_size_another_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A check measures 8192 (grown from 4096); before it stores, another thread's check records
    12288. Storing 8192 then stepped the guard back, and a later cut from 12288 to 8192 went
    unrefused: the reads past the cut would fault on the map's pages."""
    path, guard = _guarded(tmp_path, 4096)
    os.truncate(path, 8192)
    _checked_while_another_grows(guard, path, monkeypatch, 12288)  # measured 8192, then 12288 recorded
    assert guard.seen == 12288
    os.truncate(path, 8192)
    with pytest.raises(DiskError, match="8192 bytes, shorter than the 12288 it held"):
        guard.check()
    guard.close()


_WRITES_AFTER_A_CUT = """
import asyncio, os, sys
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.errors import DiskError
from kvtier.testing import make_key, random_block

fmt = BlockFormat(block_bytes=65536, dtype="uint8")
backend = registry.backends.get("lmdb")(capacity=32 << 20, path=sys.argv[1], sync_mode="fast")
asyncio.run(backend.open(fmt))
keys = [make_key(i) for i in range(64)]
assert None not in backend.write_blocks(keys, [random_block(fmt.block_bytes, i) for i in range(64)])
import torch
assert backend.read_blocks(keys[:1], [torch.zeros(fmt.block_bytes, dtype=torch.uint8)]) == [True]  # (the guard sees the grown file)
data = os.path.join(sys.argv[1], "data.mdb")
os.truncate(data, os.path.getsize(data) // 4)
for name, write in [
    ("save of one", lambda: backend.write_blocks([make_key(1000)], [random_block(fmt.block_bytes, 1000)])),
    ("save of a job", lambda: backend.write_blocks([make_key(1001 + i) for i in range(16)], [random_block(fmt.block_bytes, i) for i in range(16)])),
    ("delete", lambda: backend.delete_blocks(keys[:8])),
    ("stamps", lambda: backend.touch_stamps([(keys[9], 1.0)])),
]:
    try:
        print(name, "went on", write(), flush=True)
    except DiskError as exc:
        print(name, "refused:", exc, flush=True)
"""


@pytest.mark.parametrize("lone", [True, False])
def test_writes_to_a_data_file_cut_short_are_refused(tmp_path: Path, lone: bool) -> None:
    """A save, a delete or a stamp update of a store whose data.mdb was cut short under it fails
    with the guard's DiskError, as a read does: its write transaction would touch the lost
    pages and fault the process (SIGBUS, rc 135, before the writers asked the guard). In a child
    process, so a fault is observed, not suffered; with and without the lone saves' path."""
    import subprocess
    import sys

    script = _WRITES_AFTER_A_CUT if lone else "from kvtier.backends import lmdb_lone\nlmdb_lone.LONE_SAVES = False\n" + _WRITES_AFTER_A_CUT
    child = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True, text=True, timeout=300)
    print(child.stdout, child.stderr[-2000:])
    assert child.returncode == 0
    for name in ("save of one", "save of a job", "delete", "stamps"):
        assert f"{name} refused:" in child.stdout and "shorter than" in child.stdout
