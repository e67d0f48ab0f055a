"""A ``file`` commit's syncs of several descriptors in one native call
(``kvtier.backends._filesync.sync_all``, ``file_commit.NATIVE_SYNCS``) against the general path
(one ``os`` call each on Python's sync pool): the same outcome per descriptor, sound or failing
(a pipe cannot be synced: EINVAL); through ``commit_files`` the same records committed, the
same failed alone, the same directory failure raised; through the tier the same sizes, files,
counters and bytes; many callers at once; and a child made by fork, whose parent's sync threads
it does not have."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvtier.backends import file_commit
from kvtier.backends.file_commit import FileJob, commit_files

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import DiskError
from kvtier.testing import make_key, random_block

native = pytest.mark.skipif(file_commit._filesync is None, reason="kvtier.backends._filesync not built (no C compiler)")
FMT = BlockFormat(block_bytes=16384, dtype="uint8")


@pytest.fixture
def pipe() -> Iterator[int]:
    """A pipe's write end: a descriptor that fdatasync and fsync refuse (EINVAL)."""
    r, w = os.pipe()
    yield w
    os.close(r)
    try:
        os.close(w)
    except OSError:
        pass  # (closed by a commit)


def _both(monkeypatch: pytest.MonkeyPatch, run: object) -> dict[bool, object]:
    """``run()`` with the native syncs and without them."""
    seen = {}
    for on in (True, False):
        monkeypatch.setattr(file_commit, "NATIVE_SYNCS", on)
        seen[on] = run()  # type: ignore[operator]
    return seen


def _outcome(errors: list[OSError | None]) -> list[int | None]:
    return [None if e is None else e.errno for e in errors]


@native
@pytest.mark.parametrize("data", [True, False])
def test_each_descriptors_outcome_is_the_general_paths(tmp_path: Path, pipe: int, monkeypatch: pytest.MonkeyPatch, data: bool) -> None:
    files = [os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o600) for i in range(5)]
    root = os.open(tmp_path, os.O_RDONLY)
    try:
        for f in files:
            os.write(f, b"x" * 4096)
        items = [files[0], pipe, files[1], root, files[2], files[3], pipe, files[4]]
        seen = _both(monkeypatch, lambda: _outcome(file_commit._sync_all(items, data=data)))
        assert seen[True] == seen[False] == [None, 22, None, None, None, None, 22, None]
        assert file_commit._sync_all(items, data=data)[1].strerror == os.strerror(22)  # type: ignore[union-attr]
    finally:
        for f in (*files, root):
            os.close(f)


@native
def test_many_callers_at_once_each_get_their_own_outcomes(tmp_path: Path, pipe: int) -> None:
    """Eight threads, each syncing 20 descriptors (one of them a pipe at its own place) 10 times:
    every call returns every outcome in its own order; the pool never passes its 16 threads."""
    files = [os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o600) for i in range(20)]
    wrong: list[tuple[int, list[int]]] = []

    def caller(c: int) -> None:
        items = list(files)
        items[c] = pipe
        want = [22 if i == c else 0 for i in range(20)]
        for _ in range(10):
            got = file_commit._filesync.sync_all(items, True)
            if got != want:
                wrong.append((c, got))

    try:
        threads = [threading.Thread(target=caller, args=(c,)) for c in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for f in files:
            os.close(f)
    assert not wrong
    made, idle = file_commit._filesync.pool()
    assert 1 <= made <= file_commit.SYNC_THREADS and idle <= made


@native
def test_a_call_of_more_descriptors_than_its_stack_holds_returns_each_outcome(tmp_path: Path, pipe: int) -> None:
    """Past 64 descriptors the call's lists go to the heap: 150, every tenth a pipe."""
    f = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        items = [pipe if i % 10 == 3 else f for i in range(150)]
        assert file_commit._filesync.sync_all(items, True) == [22 if i % 10 == 3 else 0 for i in range(150)]
    finally:
        os.close(f)


@native
def test_bad_arguments_are_refused_by_name(tmp_path: Path) -> None:
    sync_all = file_commit._filesync.sync_all
    with pytest.raises(ValueError, match=r"fds\[1\]: expected an open file descriptor, got -1"):
        sync_all([0, -1], True)
    with pytest.raises(TypeError, match="fds: expected a sequence"):
        sync_all(3, True)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        sync_all([1])  # type: ignore[call-arg]
    assert sync_all([], True) == []


def _job(tmp_path: Path, names: list[str], bad_file: int | None = None, bad_dir: str | None = None) -> tuple[FileJob, list[int]]:
    """A job of one staged record per name, in directories ``a`` and ``b`` (alternately); the
    record at ``bad_file`` holds a pipe in place of its file, the directory ``bad_dir`` is
    synced through a pipe (its renames still go to the directory). Also the pipes' read ends."""
    job = FileJob()
    ends = []
    fds = {}
    for d in ("a", "b"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        fds[d] = os.open(tmp_path / d, os.O_RDONLY)
        job.dirs[d] = fds[d]
    for i, name in enumerate(names):
        d = "ab"[i % 2]
        job.stage(d, f"{name}.tmp", name, (b"head", name.encode() * 100), None)
        if i == bad_file:
            r, w = os.pipe()
            os.close(job.files[-1].fd)
            job.files[-1].fd = w
            ends.append(r)
    if bad_dir is not None:
        r, w = os.pipe()
        job.dirs[bad_dir] = w  # synced through the pipe; the renames keep the real directory
        job.dirs[bad_dir + "-real"] = fds[bad_dir]  # (closed with the job)
        ends.append(r)
    return job, ends


def _commit(tmp_path: Path, case: str) -> object:
    names = [f"r{i}" for i in range(6)]
    job, ends = _job(tmp_path / case, names, bad_file=3 if case == "file" else None, bad_dir="b" if case == "dir" else None)
    try:
        outcome: object = commit_files([job], durable=True)
    except DiskError as exc:
        outcome = ("DiskError", str(exc))
    finally:
        job.close()
        for r in ends:
            os.close(r)
    left = sorted(str(p.relative_to(tmp_path / case)) for p in (tmp_path / case).rglob("*"))
    for p in sorted((tmp_path / case).rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    return outcome, left


@native
@pytest.mark.parametrize("case", ["sound", "file", "dir"])
def test_a_commit_gives_the_general_paths_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Sound: every record committed. A file that cannot be synced: that record alone fails and
    leaves no temporary file. A directory that cannot be synced: the commit raises DiskError."""
    seen = _both(monkeypatch, lambda: _commit(tmp_path, case))
    assert seen[True] == seen[False]
    outcome, left = seen[True]  # type: ignore[misc]
    if case == "sound":
        assert outcome == [[True] * 6] and left == ["a", "a/r0", "a/r2", "a/r4", "b", "b/r1", "b/r3", "b/r5"]
    elif case == "file":
        assert outcome == [[True, True, True, False, True, True]] and "b/r3" not in left and "b/r3.tmp" not in left
    else:
        assert outcome == ("DiskError", "file: cannot sync directory entries: [Errno 22] Invalid argument")


def _save(path: Path) -> object:
    backend: Backend = registry.backends.get("file")(capacity=64 * FMT.block_bytes, path=str(path))
    asyncio.run(backend.open(FMT))
    try:
        keys = [make_key(i) for i in range(12)]
        blocks = [random_block(FMT.block_bytes, i) for i in range(12)]
        sizes = [backend.write_blocks(keys[i : i + 4], blocks[i : i + 4]) for i in range(0, 12, 4)]
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        same = all(torch.equal(o, b) for o, b in zip(out, blocks))
        counters = {k: v for k, v in backend.stats().items() if k in ("blocks_written", "bytes_written", "write_failures")}
    finally:
        asyncio.run(backend.aclose())
    return sizes, found, same, counters, sorted(p.name for p in path.iterdir())


@native
def test_the_tiers_jobs_save_as_on_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = iter(("native", "general"))
    seen = _both(monkeypatch, lambda: _save(tmp_path / next(runs)))
    assert seen[True] == seen[False]
    sizes, found, same, counters, names = seen[True]  # type: ignore[misc]
    assert all(None not in s for s in sizes) and found == [True] * 12 and same and counters["blocks_written"] == 12
    assert len([n for n in names if n.endswith(".kvb")]) == 12 and not [n for n in names if n.endswith(".tmp")]


@native
def test_a_child_made_by_fork_makes_its_own_sync_threads(tmp_path: Path) -> None:
    """The parent's sync threads are not in the child: its first call makes its own, and
    returns every outcome (a child that waited on the parent's threads would never return)."""
    files = [os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o600) for i in range(6)]
    try:
        assert file_commit._filesync.sync_all(files, True) == [0] * 6
        assert file_commit._filesync.pool()[0] >= 1
        pid = os.fork()
        if pid == 0:  # the child: no pool yet, then one of its own
            code = 0
            try:
                code |= 1 if file_commit._filesync.pool() != (0, 0) else 0
                code |= 2 if file_commit._filesync.sync_all(files, True) != [0] * 6 else 0
                code |= 4 if file_commit._filesync.pool()[0] < 1 else 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        for f in files:
            os.close(f)


_SHRINKING_LIST = """
import os
import subprocess
import sys
from kvtier.backends import _filesync
r, w = os.pipe()
fds = []
class Shrinks:
    def __index__(self):
        fds.clear()  # the list the call is reading from, emptied and its storage freed
        return w
fds.extend([Shrinks()] + [w] * 200)
print(_filesync.sync_all(fds, True) == [22] * 201, len(fds))
"""


@native
def test_a_descriptor_whose_conversion_empties_the_list_leaves_the_call_its_own_copy() -> None:
    """An item's ``__index__`` may run any code, even empty the list being read: the call reads
    the descriptors it was given (201 pipe ends, EINVAL each), never the freed storage (a crash)."""
    run = subprocess.run([sys.executable, "-c", _SHRINKING_LIST], capture_output=True, text=True, timeout=None)
    assert (run.returncode, run.stdout) == (0, "True 0\n"), run.stderr[-2000:]
