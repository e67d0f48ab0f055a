"""A pool grown in place (``pool.resize_`` to more rows) by another thread while an ``lmdb`` save
waits for the store's write lock: the save's views (the rows' addresses, taken at their checks)
point at memory torch has freed by then, which no hold keeps (the storage object is the same,
its memory swapped). The lone and job saves ask the rows' addresses again in the call that
copies, once the transaction is begun (``views_stayed``): where they moved, the job is not
saved (a counted write failure, each key a miss), never freed memory stored under a good
checksum. The general path builds its joined records from the views before it waits.

The window is opened deterministically: the test holds the write lock and grows the pool once
the save waits for it. Run in a child: a read of freed memory crashes it (a 64 MiB pool has its
own mapping, unmapped when freed)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from typing import Any

import pytest
import torch
from kvtier.backends import lmdb_lone, lmdb_plain

from kvtier.keys import KEY_BYTES
from kvtier.pool_rows import PoolRows
from tests import grown_saves

_GROWN = r"""
import asyncio, sys, tempfile, threading
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_lone, lmdb_plain
job, form, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
lmdb_lone.RESERVED_PUTS = path == "reserved"
lmdb_lone.LONE_SAVES = path != "general"
b = registry.backends.get("lmdb")(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast")
asyncio.run(b.open(BlockFormat(block_bytes=4096, dtype="uint8")))
""" + grown_saves.ROWS + r"""
class Gate:  # the store's write lock, held by the test: the save waits in it
    def __init__(self, lock):
        self.lock, self.waiting = lock, threading.Event()
    def __enter__(self):
        self.waiting.set()
        self.lock.acquire()
    def __exit__(self, *exc):
        self.lock.release()

lock = b._write_lock
gate = Gate(lock)
lock.acquire()
b._write_lock = gate
failures, got = b.counters.write_failures, []
t = threading.Thread(target=lambda: got.append(b.write_blocks(keys, rows)))
t.start()
waited = gate.waiting.wait(60)
old = pool.data_ptr()
pool.resize_(32768, 4096)  # the storage's memory reallocated, the old freed (unmapped)
moved = pool.data_ptr() != old
lock.release()
t.join()
b._write_lock = lock
sizes = got[0]
""" + grown_saves.READ_BACK + r"""
print(waited, moved, right, answered, sum(found), b.counters.write_failures - failures)
"""


@pytest.mark.parametrize("path", ["reserved", "joined", "general"])
@pytest.mark.parametrize("form", ["pool", "list"])
@pytest.mark.parametrize("job", [1, 4])
def test_a_pool_grown_while_a_save_waits_for_the_lock_is_never_stored_from_freed_memory(job: int, form: str, path: str) -> None:
    child = subprocess.run([sys.executable, "-c", _GROWN, str(job), form, path], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    waited, moved, right, answered, found, failures = child.stdout.split()
    assert (waited, moved) == ("True", "True")  # the save waited in the lock, the pool moved meanwhile
    assert (right, answered) == ("True", "True")  # every block found holds its row's bytes; a key is found where its size said so
    if path == "general" or (path, job) == ("joined", 1):  # built before the wait: saved from the rows as they were
        assert (found, failures) == (str(job), "0")
    else:  # asked again once begun: the job not saved, counted
        assert (found, failures) == ("0", str(job))


def _views(rows: list[torch.Tensor], size: int) -> list[memoryview]:
    """A view of each row by its address (as the tiers' views are: they hold nothing)."""
    return [memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B") for t in rows]


@pytest.mark.parametrize("shape", ["pool", "every_other", "list", "one"])
def test_views_stayed_answers_alike_native_and_in_python(shape: str) -> None:
    """Each form of what a save's views were taken of (the rows, a list or tuple of them, or a
    :class:`PoolRows`; the one row of a job of one; ``(pool, address)``, what the pool's checks
    keep in Python) is asked alike by both forms of ``views_stayed``."""
    native = lmdb_lone._native
    forms = [lmdb_lone.views_stayed_python] + ([native.views_stayed] if native is not None else [])
    pool = torch.zeros(64, 256, dtype=torch.uint8)
    cut = pool[::2] if shape == "every_other" else pool
    tensors = [cut[i] for i in range(3, 7)] if shape != "one" else [cut[5]]
    takens: list[object] = (
        [PoolRows(cut, range(3, 7)), tuple(tensors), (cut, cut.data_ptr())] if shape in ("pool", "every_other") else [tensors, tuple(tensors)] if shape == "list" else [cut[5]]
    )
    views = _views(tensors, 256)
    for form in forms:
        for taken in takens:
            assert form(taken, views) is True
            assert form(taken, views[:0]) is True
            assert form(taken, [*views[:-1], object()]) is False  # (not a view: not where its row is)
            if shape != "one" and not (type(taken) is tuple and type(taken[1]) is int):  # (a pool and its address: by the pool)
                assert form(taken, list(reversed(views))) is False  # each view against its own row
    pool.resize_(4096, 256)  # moved: every view's row elsewhere now
    for form in forms:
        for taken in takens:
            assert form(taken, views) is False


@pytest.mark.parametrize("shape", ["pool", "every_other"])
@pytest.mark.parametrize("how", ["native", "python"])
def test_what_a_pools_checks_keep_asks_its_rows_again(shape: str, how: str) -> None:
    """``held_views`` of rows of one pool keeps what their checks took (:attr:`HeldViews.taken`:
    natively the pool and its address then, or its rows one by one where the one-pool checks do
    not take the pool; in Python ``(pool, address)``): ``views_stayed`` of it answers ``True``
    until the pool moves, then ``False``; natively it asks the pool once, not each row."""
    native = lmdb_lone._native
    if how == "native" and native is None:
        pytest.skip("built without the native row guard")
    pool = torch.zeros(64, 256, dtype=torch.uint8)
    cut = pool[::2] if shape == "every_other" else pool
    rows = PoolRows(cut, range(3, 7))
    keys = [bytes(KEY_BYTES)] * 4
    seen = lmdb_plain.RowViews(256)
    seen.of(keys, list(rows))  # (every row seen: its view kept)
    job_views = lmdb_plain.job_views if how == "native" else lmdb_plain.job_views_python
    lmdb_plain.job_views, kept = job_views, lmdb_plain.job_views
    try:
        held = lmdb_plain.held_views(keys, rows, seen.shape, seen.views)
    finally:
        lmdb_plain.job_views = kept
    assert isinstance(held, lmdb_plain.HeldViews) and len(held) == 4
    stayed = native.views_stayed if how == "native" else lmdb_lone.views_stayed_python
    assert stayed(held.taken, held) is True
    if how == "python":
        assert held.taken == (cut, cut.data_ptr())
    pool.resize_(4096, 256)
    assert stayed(held.taken, held) is False
    assert lmdb_lone.views_stayed_python(object(), held) is False  # (nothing it can ask)


def test_job_views_held_form_gives_the_views_of_its_plain_form() -> None:
    """``job_views``' held form (rows of one pool) gives the views its plain form gives, as the
    held type: made by that type's own allocation where it adds no ``__init__``, else by calling
    it (the general path); both slots what the checks kept. Rows that are not one pool, or a job
    it does not take, are answered as by the plain form."""
    native = lmdb_plain._rowguard
    if native is None:
        pytest.skip("built without the native row guard")

    class Inited(list):  # type: ignore[type-arg]
        __slots__ = ("made", "memory", "taken")

        def __init__(self, items: Any) -> None:
            super().__init__(items)
            self.made = True

    pool = torch.zeros(64, 256, dtype=torch.uint8)
    rows = PoolRows(pool, range(3, 7))
    keys = [bytes(KEY_BYTES)] * 4
    seen = lmdb_plain.RowViews(256)
    seen.of(keys, list(rows))
    args = (torch.Tensor, torch.uint8, seen.shape, seen.views, KEY_BYTES)
    plain = native.job_views(keys, rows, *args)
    assert plain is not None and len(plain) == 4
    for held_type in (lmdb_plain.HeldViews, Inited):
        got = native.job_views(keys, rows, *args, held_type)
        assert type(got) is held_type and all(a is b for a, b in zip(got, plain, strict=True))
        assert got.memory is got.taken and lmdb_lone.views_stayed(got.taken, got) is True
        assert getattr(got, "made", False) is (held_type is Inited)
    listed = native.job_views(keys, list(rows), *args, lmdb_plain.HeldViews)
    assert type(listed) is list and all(a is b for a, b in zip(listed, plain, strict=True))
    assert native.job_views(keys[:3], rows, *args, lmdb_plain.HeldViews) is None
