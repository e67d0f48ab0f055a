"""The ``lmdb`` tier's file guard (``lmdb_plain.FileGuard``) refuses reads and write transactions
once ``data.mdb`` is shorter than it was, and only then: reads run on several threads while saves grow the file, so
a check may measure the file just before another thread's check records it larger. That check
compares with what was recorded before it measured, and so never takes a file that grew for one
that was cut (it refused such reads with a DiskError, "shorter than the ... it held", in about
one run of five of 8 threads reading and saving at once)."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_lone, lmdb_plain
from kvtier.backends.group_commit import GroupCommit

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.errors import DiskError
from kvtier.testing import make_key, random_block


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


#: A store grown by saves in one form (argv[2]: "lone", saves of one on the straight line; "job",
#: jobs of 16 on it; "general", both on the general path), then its data.mdb cut (argv[3]: "below",
#: to a quarter of what the last read's check saw; "above", into what the last save appended, above
#: what the check at that save's begin saw); then a read and every write entry point, each said
#: refused or went on.
_AFTER_A_CUT = """
import asyncio, os, sys
import lmdb, torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_lone
from kvtier.backends.group_commit import GroupCommit
from kvtier.errors import DiskError
from kvtier.testing import make_key, random_block

path, form, cut = sys.argv[1:4]
lmdb_lone.LONE_SAVES = form != "general"
fmt = BlockFormat(block_bytes=16384, dtype="uint8")  # (put joined: the straight line's records)
backend = registry.backends.get("lmdb")(capacity=64 << 20, path=path, sync_mode="fast")
asyncio.run(backend.open(fmt))
rows = [random_block(fmt.block_bytes, i) for i in range(16)]
for i, row in enumerate(rows):  # each row saved once: the store keeps its view (the straight line takes it)
    assert backend.write_blocks([make_key(1000 + i)], [row]) != [None]
general = []
submit = GroupCommit.submit
GroupCommit.submit = lambda self, batch: general.append(len(batch)) or submit(self, batch)

def grow(first, count):
    keys = [make_key(first + i) for i in range(count)]
    for n in range(0, count, 16 if form == "job" else 1):
        part = keys[n : n + (16 if form == "job" else 1)]
        assert None not in backend.write_blocks(part, rows[: len(part)])
    return keys

keys = grow(0, 32)
out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in range(8)]
assert backend.read_blocks(keys[:1], out[:1]) == [True]  # a check: the guard sees the file as it is
data = os.path.join(path, "data.mdb")
checked = os.path.getsize(data)
if cut == "above":
    keys += grow(100, 48)
    for n in range(100):  # then a last save that appends two pages or more
        checked = os.path.getsize(data)  # what the last check saw: the one at that save's begin
        keys += grow(200 + 16 * n, 16 if form == "job" else 1)
        if os.path.getsize(data) - checked >= 8192:
            break
grown = os.path.getsize(data)
print("general commits while growing:", len(general), flush=True)
to = checked // 4 if cut == "below" else (checked + grown) // 2 // 4096 * 4096
assert to < checked if cut == "below" else checked < to < grown, (checked, to, grown)
os.truncate(data, to)
print("cut", checked, to, grown, flush=True)

def one_per_record():  # the general commit's fallback: each record in a transaction of its own
    def full(*args):
        raise lmdb.MapFullError("full")
    backend._put_together = full
    try:
        return backend.write_blocks([make_key(2000 + i) for i in range(4)], rows[:4])
    finally:
        del backend._put_together

for name, call in [
    ("read", lambda: backend.read_blocks(keys[-8:], out)),
    ("save of one", lambda: backend.write_blocks([make_key(3000)], rows[:1])),
    ("save of a job", lambda: backend.write_blocks([make_key(3001 + i) for i in range(16)], rows)),
    ("save one per record", one_per_record),
    ("delete", lambda: backend.delete_blocks(keys[:8])),
    ("stamps", lambda: backend.touch_stamps([(keys[9], 1.0)])),
]:
    try:
        print(name, "went on", call(), flush=True)
    except DiskError as exc:
        print(name, "refused:", exc, flush=True)
"""

_CALLS = ("read", "save of one", "save of a job", "save one per record", "delete", "stamps")


@pytest.mark.parametrize("cut", ["below", "above"])
@pytest.mark.parametrize("form", ["lone", "job", "general"])
def test_reads_and_writes_of_a_data_file_cut_short_are_refused(tmp_path: Path, form: str, cut: str) -> None:
    """A read, a save (of one, of a job, one record a transaction), a delete or a stamp update
    of a store whose data.mdb was cut short under it fails with the guard's DiskError: its
    transaction would touch the lost pages and fault the process. ``below``: cut below what the
    last check saw (a write died of SIGBUS, rc -7, before the writers asked the guard). ``above``:
    cut into what the last save appended, above what the check at its begin saw, which the guard
    learned only from its checks: the read of the last key died of SIGBUS before each commit told
    it the file's size. Grown by saves of one or jobs on the straight line, or on the general path. In a child
    process, so a fault is observed, not suffered."""
    child = subprocess.run([sys.executable, "-c", _AFTER_A_CUT, str(tmp_path / "store"), form, cut], capture_output=True, text=True, timeout=300)
    print(child.stdout, child.stderr[-2000:])
    assert child.returncode == 0
    assert ("general commits while growing: 0" in child.stdout) == (form != "general")  # (the form grew it)
    for name in _CALLS:
        assert f"{name} refused:" in child.stdout
    assert child.stdout.count("shorter than") == len(_CALLS)


def _sizes(backend: Any) -> tuple[int, int]:
    """The file guard's size, and data.mdb's."""
    guard = backend._reader.guard
    return guard.seen, os.path.getsize(guard.path)


def test_every_commit_tells_the_guard_the_size_it_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After each write entry point's commit the guard holds the file's size, with no read or
    check between: a cut below it is then refused (the test above, ``above``). The saves grow
    the file; the guard held the size its last check saw until every commit told it."""
    fmt = BlockFormat(block_bytes=16384, dtype="uint8")
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(tmp_path / "store"), sync_mode="fast")
    asyncio.run(backend.open(fmt))
    rows = [random_block(fmt.block_bytes, i) for i in range(16)]
    counter = iter(range(10**6))

    def keys(n: int) -> list[bytes]:
        return [make_key(next(counter)) for _ in range(n)]

    def full(*args: Any) -> Any:
        raise lmdb.MapFullError("full")

    try:
        for row in rows:  # the rows' views kept: the straight line takes them
            backend.write_blocks(keys(1), [row])
        general: list[int] = []
        submit = GroupCommit.submit
        monkeypatch.setattr(GroupCommit, "submit", lambda self, batch: general.append(len(batch)) or submit(self, batch))
        for lone, reserved, count in [(True, True, 1), (True, True, 16), (True, False, 1), (True, False, 16), (False, True, 1), (False, True, 16)]:
            # the straight line (records written into LMDB's reserved room, or built first), the general path
            monkeypatch.setattr(lmdb_lone, "LONE_SAVES", lone)
            monkeypatch.setattr(lmdb_lone, "RESERVED_PUTS", reserved)
            before = _sizes(backend)
            for _ in range(3):
                general.clear()
                assert None not in backend.write_blocks(keys(count), rows[:count])
                assert (general == []) == lone  # (the path named)
                seen, size = _sizes(backend)
                assert seen == size, (lone, reserved, count, seen, size)
            assert size > before[1]  # (the saves grew it)
        monkeypatch.setattr(backend, "_put_together", full)  # one record a transaction
        before = _sizes(backend)
        assert None not in backend.write_blocks(keys(4), rows[:4])
        assert _sizes(backend)[0] == _sizes(backend)[1] > before[1]
        monkeypatch.undo()
        stamped = keys(64)
        assert None not in backend.write_blocks(stamped, [rows[i % 16] for i in range(64)])
        backend.touch_stamps([(key, 1.0) for key in stamped])  # joined records gain index entries
        assert _sizes(backend)[0] == _sizes(backend)[1]
        backend.delete_blocks(stamped[:32])
        assert _sizes(backend)[0] == _sizes(backend)[1]
        assert backend.read_blocks(stamped[32:33], [torch.zeros(fmt.block_bytes, dtype=torch.uint8)]) == [True]
    finally:
        asyncio.run(backend.aclose())


def test_every_write_transaction_of_the_tier_begins_through_the_guard() -> None:
    """No module of the backends begins a write transaction but the store's ``_begin_write``
    (the store open, the file guard asked): a new write path cannot forget the guard. The
    exceptions write where no guard is yet: the open's meta record (``_try_open``, just after
    the open's check of the file) and the offline tools' own environments."""
    root = Path(__file__).resolve().parents[1] / "backends"
    found: set[tuple[str, str]] = set()
    for source in sorted(root.glob("*.py")):
        tree = ast.parse(source.read_text(), str(source))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(function):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "begin"):
                    continue
                write = [k.value for k in call.keywords if k.arg == "write"] + call.args[2:3]
                if any(not (isinstance(w, ast.Constant) and w.value in (False, None)) for w in write):
                    found.add((source.stem, function.name))
    offline = {(module, name) for module, name in found if module == "lmdb_offline"}
    assert found - offline == {("lmdb_writes", "_begin_write"), ("lmdb_tier", "_try_open")}


#: Native sources of ``backends/`` that begin a write transaction themselves, each only after its
#: Python caller asked the store's ``_guarded_env()`` (the file guard), and followed by ``_wrote()``
#: after its commit, under the write lock, as ``_begin_write``'s callers do.
GUARDED_BY_THEIR_CALLERS: set[str] = set()


def test_a_native_write_transaction_is_one_its_caller_guards() -> None:
    """The test above reads Python: a write transaction begun in C (LMDB's ``txn_begin`` without
    ``MDB_RDONLY``) is a write path it cannot see. Each such source must be listed in
    :data:`GUARDED_BY_THEIR_CALLERS` once its caller asks the guard before it and tells the guard
    the size after it; the cut-file tests above then run through it."""
    root = Path(__file__).resolve().parents[1] / "backends"
    found = set()
    for source in sorted(root.glob("*.c")):
        text = source.read_text()
        for call in re.finditer(r"txn_begin\)?\s*\(", text):  # a call, also through a cast pointer
            if "RDONLY" not in text[call.start() : text.find(";", call.start())]:
                found.add(source.name)
    assert found <= GUARDED_BY_THEIR_CALLERS, (
        f"{sorted(found - GUARDED_BY_THEIR_CALLERS)} begin write transactions in C: their caller must ask "
        "tier._guarded_env() before and call tier._wrote() after the commit; then list them here"
    )
