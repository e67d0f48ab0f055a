"""A job's rows' views are addresses taken once each row's checks passed, and hold nothing; a
garbage collection run before the job's last copy (any allocation may start one: a later row's
checks, the job's own objects) runs finalizers and weakref callbacks, Python that may move a
row whose view is taken to other memory (``row.set_(...)``). The copy then read or wrote memory
the row no longer owned: freed, or another tensor's. Here the moved row's old memory stays held
by a second tensor (``shadow``), so the test sees where the copy went without touching freed
memory. Every collection is made to start at the next allocation, and the finalizer moves the
row at the n-th one of the call, for each n in turn: every point of the job. Jobs hold automatic
collection off from their first row's checks to their last copy (``xxcopy.rows_hold``).

Before, reads wrote the first record into the old memory (the native ``lmdb`` job read at 5 of
the 8 points where the row moved during the call, its Python form at 11 of 24, the general read
at 22 of 34, the ``file`` tier's native job read at 3 of 10), and job saves stored the old
memory's bytes under the first key, under a sound checksum (native 12 of 24, general 30 of 40):
wrong data served later."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

import pytest

from kvtier.records import rowhold, xxcopy

_PRELUDE = r"""
import asyncio, gc, sys, tempfile, torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_lone, lmdb_one, lmdb_plain
from kvtier.testing import make_key, random_block
tier, way, points = sys.argv[1], sys.argv[2], int(sys.argv[3])
n = 1 if way == "one" else 4
if way in ("python", "one"):
    lmdb_plain.straight_read = lmdb_plain.job_read = lmdb_plain.one_read = None
if way == "general":
    lmdb_one.STRAIGHT_READS = lmdb_lone.LONE_SAVES = False
fmt = BlockFormat(block_bytes=4096, dtype="uint8")
more = {"layout": "flat"} if tier == "file" else {}
backend = registry.backends.get(tier)(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast", **more)
asyncio.run(backend.open(fmt))
keys = [make_key(i) for i in range(n)]
backend.write_blocks(keys, [random_block(4096, i) for i in range(n)])
shadows = [torch.zeros(4096, dtype=torch.uint8) for _ in range(n)]
state = {"armed": False, "count": 0, "at": 0, "moved": None}
kept = []
class Kept:
    pass
def tick(phase, info):
    if phase != "start":
        kept.append(Kept()); kept.append(Kept())  # the next allocation collects again
        return
    if state["armed"]:
        state["count"] += 1
        if state["count"] == state["at"]:
            state["moved"] = moved()
gc.callbacks.append(tick)
def under_collections(at, job):
    gc.collect(); kept.clear()
    state.update(count=0, at=at, moved=None)
    gc.set_threshold(1, 1000000, 1000000)
    state["armed"] = True
    try:
        job()
    except (ValueError, TypeError):
        pass  # (a moved row the general checks refuse)
    finally:
        state["armed"] = False
        gc.set_threshold(700, 10, 10)
    return state["moved"]
"""

#: Reads: at the n-th collection the first row moves to new memory; the job must not write the
#: first record into its old memory (shadows[0]) afterwards. Prints the points where the row
#: moved during the call, and those where it moved before it was written and then was written.
_READ = _PRELUDE + r"""
def moved():
    before = not shadows[0].any()
    rows[0].set_(torch.zeros(4096, dtype=torch.uint8))
    return before
mid, wrong = 0, 0
for at in range(1, points + 1):
    rows = [s.view(-1) for s in shadows]  # each row's memory also held by its shadow
    for _ in range(3):  # (the rows' views kept, the thread marked)
        assert backend.read_blocks(keys, rows) == [True] * n
    for s in shadows:
        s.zero_()
    before = under_collections(at, lambda: backend.read_blocks(keys, rows))
    mid += before is not None
    wrong += bool(before) and bool(shadows[0].any())
print(mid, wrong)
asyncio.run(backend.aclose())
"""

#: Saves: at the n-th collection the first row moves to new memory holding the same bytes, and
#: its old memory is overwritten with sevens; the record saved under the first key must hold
#: the row's bytes. Prints the points where the row moved, and those where sevens were stored.
_SAVE = _PRELUDE + r"""
first = random_block(4096, 99)
def moved():
    rows[0].set_(first.clone())
    shadows[0].fill_(7)
    return True
mid, wrong = 0, 0
for at in range(1, points + 1):
    rows = [s.view(-1) for s in shadows]
    for i, s in enumerate(shadows):
        s.copy_(random_block(4096, 100 + i))
    for _ in range(2):  # (the rows' views kept)
        backend.write_blocks(keys, rows)
    shadows[0].copy_(first)
    mid += bool(under_collections(at, lambda: backend.write_blocks(keys, rows)))
    out = [torch.zeros(4096, dtype=torch.uint8)]
    assert backend.read_blocks(keys[:1], out) == [True]
    wrong += not torch.equal(out[0], first)
print(mid, wrong)
asyncio.run(backend.aclose())
"""


def _run(script: str, tier: str, way: str) -> tuple[int, int]:
    child = subprocess.run([sys.executable, "-c", script, tier, way, "40"], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    mid, wrong = child.stdout.split()
    return int(mid), int(wrong)


@pytest.mark.parametrize(("tier", "way"), [("lmdb", "native"), ("lmdb", "python"), ("lmdb", "general"), ("file", "native")])
def test_a_read_never_writes_where_a_row_moved_from_during_a_collection(tier: str, way: str) -> None:
    mid, wrong = _run(_READ, tier, way)
    assert mid > 0  # the finalizer moved the first row during the call, at some points
    assert wrong == 0, f"the job wrote its first record where its first row had moved from, at {wrong} of {mid} points"


@pytest.mark.parametrize("way", ["native", "one", "general"])
def test_a_save_never_stores_the_memory_a_row_moved_from_during_a_collection(way: str) -> None:
    mid, wrong = _run(_SAVE, "lmdb", way)
    assert mid > 0
    assert wrong == 0, f"the job stored other bytes than its first row's under its first key, at {wrong} of {mid} points"


@pytest.mark.parametrize("native", [True, False])
def test_rows_hold_is_counted_and_restores_what_was_on(native: bool) -> None:
    hold, let_go = (xxcopy.rows_hold, xxcopy.rows_let_go) if native else (xxcopy.rows_hold_python, xxcopy.rows_let_go_python)
    if native and not xxcopy.NATIVE:
        pytest.skip("built without the extension")
    was = gc.isenabled()
    try:
        for on in (True, False):
            (gc.enable if on else gc.disable)()
            hold()
            hold()
            assert not gc.isenabled()
            let_go()
            assert not gc.isenabled()  # one hold is left
            let_go()
            assert gc.isenabled() is on  # as before the first
            let_go()  # one too many: nothing changes
            assert gc.isenabled() is on
    finally:
        (gc.enable if was else gc.disable)()


#: A build with ``backends/_rowguard.c`` but without ``kvtier/records/_xxcopy``: the native lmdb
#: reads hold the rows through the Python count (``xxcopy.rows_hold_python``), the one the Python
#: paths keep. Before, they kept a count of their own: a Python hold let go while a native one was
#: held (another thread's job) turned collection on again under it.
_PARTIAL = r"""
import sys
sys.modules["kvtier.records._xxcopy"] = None  # not built
import gc
from kvtier.records import rowhold, xxcopy
calls = []
hold, let_go = xxcopy.rows_hold_python, xxcopy.rows_let_go_python
def counted_hold():
    calls.append(1); hold()
def counted_let_go():
    calls.append(-1); let_go()
xxcopy.rows_hold_python, xxcopy.rows_let_go_python = counted_hold, counted_let_go
import asyncio, tempfile, torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_plain
from kvtier.testing import make_key, random_block
assert lmdb_plain.NATIVE_GUARD and not xxcopy.NATIVE
backend = registry.backends.get("lmdb")(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast")
asyncio.run(backend.open(BlockFormat(block_bytes=4096, dtype="uint8")))
keys = [make_key(i) for i in range(4)]
blocks = [random_block(4096, i) for i in range(4)]
backend.write_blocks(keys, blocks)
rows = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
found = []
for _ in range(3):
    found += backend.read_blocks(keys, rows) + backend.read_blocks(keys[:1], rows[:1])
assert all(found) and all(torch.equal(r, b) for r, b in zip(rows, blocks))
asyncio.run(backend.aclose())
print(len(calls), sum(calls), int(gc.isenabled()))
"""


def test_a_build_without_xxcopy_keeps_one_count_of_holds() -> None:
    from kvtier.backends import lmdb_plain

    if not lmdb_plain.NATIVE_GUARD:
        pytest.skip("built without backends/_rowguard.c")
    child = subprocess.run([sys.executable, "-c", _PARTIAL], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    calls, balance, enabled = map(int, child.stdout.split())
    assert calls > 0, "the native reads kept a count of their own"
    assert balance == 0 and enabled == 1


@pytest.mark.parametrize("native", [True, False])
def test_rows_held_holds_the_block_on_the_same_count(native: bool) -> None:
    from kvtier.records import rowhold

    if native and not xxcopy.NATIVE:
        pytest.skip("built without the extension")
    held, hold, let_go = (
        (xxcopy.rows_held, xxcopy.rows_hold, xxcopy.rows_let_go)
        if native
        else (_PythonHeld(), xxcopy.rows_hold_python, xxcopy.rows_let_go_python)
    )
    assert (type(xxcopy.rows_held).__exit__ is rowhold._xxcopy.rows_exit) is xxcopy.NATIVE
    was = gc.isenabled()
    gc.enable()
    try:
        with held:
            assert not gc.isenabled()
            with held:
                pass
            assert not gc.isenabled()  # the outer block still holds
            hold()
            let_go()  # the functions' holds are on the same count
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(KeyError, match="raised in the block"):
            with held:
                raise KeyError("raised in the block")
        assert gc.isenabled()  # let go on the way out, the exception propagated
        hold()
        with held:
            pass
        assert not gc.isenabled()  # a block inside a hold of the functions' does not end it
        let_go()
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


class _PythonHeld:
    """``rows_held`` with the Python count's functions (a build without the extension)."""

    __enter__ = staticmethod(xxcopy.rows_hold_python)

    def __exit__(self, *exc: object) -> None:
        from kvtier.records import rowhold

        rowhold._rows_exit_python(*exc)


def _hold_interrupted_in_its_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python-form hold whose wait's sleep raises KeyboardInterrupt: the interrupt goes on to
    the caller, and the thread is left counted as holding none."""

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(rowhold.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rowhold.rows_hold_python()
    assert getattr(rowhold._mine, "holds", 0) == 0


def test_a_python_hold_interrupted_in_its_wait_leaves_the_thread_holding_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt raised in the wait of a hold (the Python form, waiting for another
    thread's holds to drain) ends the hold untaken: the thread is not left counted as holding one,
    so its next hold waits as a first one does, and the count is the other thread's alone. Before,
    the thread stayed counted as holding, and none of its holds waited again."""
    was = gc.isenabled()
    other_holds, other_done = threading.Event(), threading.Event()

    def other() -> None:
        rowhold.rows_hold_python()
        other_holds.set()
        other_done.wait(60)
        rowhold.rows_let_go_python()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert other_holds.wait(60)
        asked: list[int] = []
        monkeypatch.setattr(rowhold, "_hold_should_wait", lambda: asked.append(1) or True)
        _hold_interrupted_in_its_sleep(monkeypatch)
        assert rowhold._held[0] == 1  # the other thread's hold alone
        with pytest.raises(KeyboardInterrupt):
            rowhold.rows_hold_python()  # a first hold again: it waits (and is interrupted again)
        assert len(asked) == 2
    finally:
        monkeypatch.undo()
        other_done.set()
        thread.join()
        (gc.enable if was else gc.disable)()


def test_a_python_hold_interrupted_waiting_for_a_collection_lets_its_hold_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt raised while a hold (the Python form) waits for another thread's running
    collection to end, a wait that comes once the hold is taken: the hold is let go before the
    interrupt goes on, so collection is back on and neither the thread nor the count holds one.
    Before, the hold stayed taken with no caller to let it go: collection stayed off."""
    assert getattr(rowhold._mine, "holds", 0) == 0 and rowhold._held[0] == 0
    was = gc.isenabled()
    gc.enable()
    saved = list(rowhold._collection)
    try:
        rowhold._collection[:2] = [True, threading.get_ident() + 1]  # a collection running in another thread
        _hold_interrupted_in_its_sleep(monkeypatch)
        assert rowhold._held[0] == 0
        assert gc.isenabled()
    finally:
        monkeypatch.undo()
        rowhold._collection[:] = saved
        (gc.enable if was else gc.disable)()
