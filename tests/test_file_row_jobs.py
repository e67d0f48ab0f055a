"""The ``file`` tier's job of several plain records from its rows' checks to its reads in one
native call (``PlainReads.read_rows``, :func:`kvtier.records.xxcopy.xxh3_read_rows`) against
the same job with its rows checked in Python (a build without the call) and the general read:
the same hits, bytes, misses, deletions and counters, whatever the records and the rows."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_reads, file_tier
from test_file_plain_reads import _copy, _damaged_store
from test_lmdb_one_read import FMT as ROW_FMT
from test_lmdb_one_read import _changes, changed_alike, outcome_after_change
from test_lmdb_row_storage import _READ_UNDER_FREES, _PassThrough
from torch.utils._python_dispatch import TorchDispatchMode

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
FORMS = ["python", *(["native"] if xxcopy.xxh3_read_rows is not None else [])]


def _open(path: Path, fmt: BlockFormat = FMT) -> Backend:
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(path), sync_mode="fast", layout="flat")
    asyncio.run(backend.open(fmt))
    return backend


def _rows_jobs(form: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``form``: the native call (``"native"``) or none (``"python"``, as without the extension);
    the list returned counts the jobs that call read. (The flat job's one call from its checks
    to its counters, ``xxh3_read_job``, is set aside: ``tests/test_file_read_job.py``.)"""
    monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
    read = xxcopy.xxh3_read_rows if form == "native" else None
    taken: list[int] = []

    def counted(*args: Any) -> Any:
        assert read is not None
        got = read(*args)
        if got is not None:
            taken.append(len(args[3]))
        return got

    monkeypatch.setattr(xxcopy, "xxh3_read_rows", counted if read is not None else None)
    return taken


@pytest.mark.parametrize("form", FORMS)
def test_a_job_of_rows_seen_before_finds_drops_and_counts_what_the_general_read_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """The damaged store (good records, a flipped bit, a bad magic, short, compressed, long, a
    symlink, absent) read by a job whose rows were seen by an earlier job: the general read's
    hits, bytes, misses, deletions and counters, on both forms."""
    keys, data = _damaged_store(tmp_path / "a" / "store", tmp_path / "a" / "outside")
    _copy(tmp_path / "a", tmp_path / "b")
    taken = _rows_jobs(form, monkeypatch)
    results = []
    for root, plain in ((tmp_path / "a" / "store", False), (tmp_path / "b" / "store", True)):
        monkeypatch.setattr(file_tier, "PLAIN_READS", plain)
        backend = _open(root)
        out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
        try:
            assert backend.read_blocks([make_key(100 + i) for i in range(len(out))], out) == [False] * len(out)  # the rows' views kept
            found = backend.read_blocks(keys, out)
            stats = {k: v for k, v in backend.stats().items() if k in ("blocks_read", "read_misses", "corrupt_records", "deleted", "bytes_read")}
        finally:
            asyncio.run(backend.aclose())
        files = sorted(str(p.relative_to(root.parent)) for p in root.parent.rglob("*") if p.is_file() or p.is_symlink())
        results.append((found, out, stats, files))
    general, job = results
    assert taken == ([len(keys)] if form == "native" else [])  # the first job's rows were new: checked in Python
    assert general[0] == [True, False, False, False, False, True, False, False, True, False]
    assert job[0] == general[0]
    for i, hit in enumerate(general[0]):  # (a miss's row holds whatever the read left there)
        if hit:
            assert torch.equal(job[1][i], data[i]) and torch.equal(general[1][i], data[i])
    assert job[2] == general[2] and general[2]["corrupt_records"] == 4
    assert job[3] == general[3]


@pytest.mark.parametrize("form", FORMS)
def test_a_row_changed_since_its_last_job_is_checked_again_as_the_general_read_checks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """A row whose view a job kept, then changed in place (a new storage, resized, another dtype
    or shape, strided, moved, another tensor in its place, written): the next job answers as
    the general read does (the same hits and bytes, or the same error naming the row), never
    writing where the row no longer is."""
    keys = [make_key(i) for i in range(3)]
    data = [random_block(ROW_FMT.block_bytes, 120 + i) for i in range(3)]
    fmt = BlockFormat(block_bytes=ROW_FMT.block_bytes, dtype="uint8")
    backend = _open(tmp_path / "store", fmt)
    backend.write_blocks(keys, data)
    taken = _rows_jobs(form, monkeypatch)
    outcomes: dict[bool, dict[str, Any]] = {}
    try:
        for plain in (True, False):
            seen: dict[str, Any] = {}
            for what in _changes([]):
                monkeypatch.setattr(file_tier, "PLAIN_READS", True)  # (the general read leaves a row's storage not resizable)
                rows = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
                assert backend.read_blocks(keys, rows) == [True] * 3  # the rows' views are kept
                assert backend.read_blocks(keys, rows) == [True] * 3  # (native: the call reads this one)
                monkeypatch.setattr(file_tier, "PLAIN_READS", plain)
                seen[what] = outcome_after_change(backend, keys, rows, what, data[1], list)
            outcomes[plain] = seen
    finally:
        asyncio.run(backend.aclose())
    changed_alike(outcomes, 3)
    assert len(taken) >= (2 * len(_changes([])) if form == "native" else 0)


@pytest.mark.skipif(xxcopy.xxh3_read_rows is None, reason="no native job read from rows in this build")
def _unseen_row(views: dict[int, memoryview]) -> torch.Tensor:
    """A new row at an address whose view the store does not keep. A new tensor may land where a
    freed one whose view is kept was (the views are by address, so the store would take it, and
    rightly: its view is that memory): the tensors tried meanwhile are held, so each try is a new
    address."""
    tried = []
    while True:
        row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        if row.data_ptr() not in views:
            return row
        tried.append(row)


def test_the_native_job_from_rows_refuses_bad_arguments_by_name_and_holds_no_reference(tmp_path: Path) -> None:
    """Its arguments are refused by name; a key or a row it does not take is ``None`` with
    nothing counted; thousands of jobs leave every reference count where it was."""
    read = xxcopy.xxh3_read_rows
    assert read is not None
    backend = _open(tmp_path / "store")
    keys = [make_key(i) for i in range(4)]
    backend.write_blocks(keys[:3], [random_block(FMT.block_bytes, 7 + i) for i in range(3)])
    rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    try:
        backend.read_blocks(keys, rows)  # the rows' views kept
        plain = backend._plain  # type: ignore[attr-defined]
        assert isinstance(plain, file_reads.PlainReads)
        root, head, kind = plain.root, plain.checksum.head, plain._kind
        found = [False] * 4
        args = (root.under_way, root.dir_at, head, keys, rows, kind, plain.piece, found)
        assert read(*args) == [] and found == [True, True, True, False]
        with pytest.raises(TypeError, match="under_way: expected a list"):
            read((), *args[1:])
        with pytest.raises(TypeError, match=r"kind: expected a tuple \(tensor_type, dtype, shape, views: dict, key_bytes\)"):
            read(*args[:5], kind[:4], *args[6:])
        with pytest.raises(ValueError, match="piece: expected a count of bytes >= 0, got -1"):
            read(*args[:6], -1, found)
        with pytest.raises(ValueError, match="dir_at: expected an aligned C int"):
            read(args[0], bytearray(8), *args[2:])
        with pytest.raises(TypeError, match="found: expected a list"):
            read(*args[:7], (False,) * 4)
        unseen = _unseen_row(kind[3])
        for bad_keys, bad_rows in (([*keys[:3], keys[3][:31]], rows), (keys, [*rows[:3], unseen]), (keys, rows[:3])):
            assert read(root.under_way, root.dir_at, head, bad_keys, bad_rows, kind, plain.piece, [False] * 4) is None
        assert root.under_way == []
        views = list(kind[3].values())
        counts, shared = [sys.getrefcount(x) for x in (*keys, *rows, *views)], [sys.getrefcount(x) for x in (True, False)]
        for _ in range(2000):
            read(root.under_way, root.dir_at, head, keys, rows, kind, plain.piece, [False] * 4)
        assert [sys.getrefcount(x) for x in (*keys, *rows, *views)] == counts
        # (True and False are shared with any other thread still running: a leak a call would be 2000)
        assert all(abs(sys.getrefcount(x) - was) < 1000 for x, was in zip((True, False), shared))
    finally:
        asyncio.run(backend.aclose())


_FREED_CHILD = r"""
import asyncio, sys, tempfile, torch
from torch.overrides import TorchFunctionMode
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
if sys.argv[1] != "native":
    xxcopy.xxh3_read_rows = None
fmt = BlockFormat(block_bytes=4096, dtype="uint8")
backend = registry.backends.get("file")(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast", layout="flat")
asyncio.run(backend.open(fmt))
n = 4
keys = [make_key(i) for i in range(n)]
backend.write_blocks(keys, [random_block(4096, i) for i in range(n)])
rows = [torch.zeros(4096, dtype=torch.uint8) for _ in range(n)]  # each its own memory
assert backend.read_blocks(keys, rows) == [True] * n  # (the rows' views kept)
""" + _READ_UNDER_FREES


@pytest.mark.parametrize("form", FORMS)
def test_a_job_never_writes_a_row_freed_by_a_mode_run_during_its_rows_checks(form: str) -> None:
    """A torch function mode's handler, run in the second row's checks, frees the first row's
    memory (its view taken) and hands it to a tensor of sevens: the job, the native call's or
    the Python checks', must not write the first record there (a child: it may crash)."""
    child = subprocess.run([sys.executable, "-c", _FREED_CHILD, form], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    freed, written = child.stdout.split()
    assert freed == "True", child.stdout  # the handler ran mid-job
    assert written == "False", "the job wrote its first record into memory freed during its rows' checks"


class _Dispatched(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", [_PassThrough, _Dispatched])
def test_a_job_while_a_mode_is_on_is_left_to_the_rows_checks_and_reads_as_without(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: type) -> None:
    """Under a torch function or dispatch mode the native job from its rows' checks is not taken;
    the job reads the same bytes, hits and misses as without the mode."""
    taken = _rows_jobs("native" if xxcopy.xxh3_read_rows is not None else "python", monkeypatch)
    backend = _open(tmp_path / "store")
    try:
        keys = [make_key(i) for i in range(5)]
        blocks = [random_block(FMT.block_bytes, 60 + i) for i in range(4)]
        backend.write_blocks(keys[:4], blocks)
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, rows) == [True] * 4 + [False]  # (the rows' views kept)
        for row in rows:
            row.zero_()
        before = len(taken)
        with mode():
            found = backend.read_blocks(keys, rows)
        assert len(taken) == before  # not the native job's
    finally:
        asyncio.run(backend.aclose())
    assert found == [True] * 4 + [False]
    assert all(torch.equal(r, b) for r, b in zip(rows, blocks))
