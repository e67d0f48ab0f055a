"""The ``lmdb`` tier's straight line for a job of one key (``lmdb_one.StraightRead.one``) against the
general path (``JobReader.read_job``): the same bytes, the same misses, the same records
dropped, the same counters and the same errors, whatever the record or the argument."""

from __future__ import annotations

import asyncio
import os
import shutil
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_direct, lmdb_layout, lmdb_one, lmdb_plain
from lmdb_lookups import HookedEnv, damaged_store, layouts, slow_lookups_read_the_disk

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import BackendError, ClosedError, InvalidKeyError, LayoutError
from kvtier.records.checks import SIDE_MIN_BYTES
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=8192, dtype="uint8")


@pytest.fixture(autouse=True, params=["joined", "split"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on stores saved joined, then split (the layouts of small and large records)."""
    return layouts(monkeypatch, request.param)


@pytest.fixture(autouse=True, params=["native", "native-pyget", "python"])
def guard_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with the straight line's row checks and file guard (``lmdb_plain.host_view``,
    ``same_size``, ``one_row``), its whole job of one key (``one_read``) and of several
    (``job_read``), and the call of either from the tier (``straight_read``), in their native
    form (its lookups by LMDB's own get where python-lmdb is the one probed for it, then
    ``native-pyget``: by python-lmdb's get, ``lmdb_direct.DIRECT_GETS`` off), then in their
    Python one."""
    if request.param == "native-pyget":
        monkeypatch.setattr(lmdb_direct, "DIRECT_GETS", False)
    if request.param == "python":
        monkeypatch.setattr(lmdb_plain, "host_view", lmdb_plain.host_view_python)
        monkeypatch.setattr(lmdb_plain, "same_size", lmdb_plain.same_size_python)
        monkeypatch.setattr(lmdb_plain, "one_row", lmdb_plain.one_row_python)
        monkeypatch.setattr(lmdb_plain, "one_read", None)
        monkeypatch.setattr(lmdb_plain, "job_read", None)
        monkeypatch.setattr(lmdb_plain, "straight_read", None)
    elif not lmdb_plain.NATIVE_GUARD:
        pytest.skip("built without the native row guard (kvtier.backends._rowguard)")
    return str(request.param)


def _open(path: Path, **options: Any) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path), **options)
    asyncio.run(backend.open(FMT))
    return backend


_READ_JOB = lmdb_layout.JobReader.read_job  # the general path, unpatched
_STATS = ("blocks_read", "bytes_read", "read_misses", "corrupt_records", "deleted")


def _read_one_by_one(path: Path, keys: list[bytes], monkeypatch: pytest.MonkeyPatch, fast: bool) -> tuple[list[bool], list[torch.Tensor], dict[str, Any], set[bytes], list[int]]:
    """Each key read as a job of its own, into a row of its own that a job read before
    (a row seen for the first time is the general path's: its view is made there)."""
    monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", fast)
    general: list[int] = []
    real = _READ_JOB

    def counted(self: Any, env: Any, keys: Any, *args: Any) -> Any:
        general.append(len(keys))
        return real(self, env, keys, *args)

    monkeypatch.setattr(lmdb_layout.JobReader, "read_job", counted)
    backend = _open(path)
    rows = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
    try:
        for row in rows:  # the rows' first job: key 0, sound
            assert backend.read_blocks([keys[0]], [row]) == [True]
        before = {k: v for k, v in backend.stats().items() if k in _STATS}
        for row in rows:
            row.fill_(7)
        general.clear()
        found = [backend.read_blocks([key], [row])[0] for key, row in zip(keys, rows)]
        stats = {k: v - before[k] for k, v in backend.stats().items() if k in _STATS}
        listed = {r.key for r in backend.scan()}
    finally:
        asyncio.run(backend.aclose())
    return found, rows, stats, listed, general


def _in_forked_child(call: Callable[[], object], done: bytes) -> bytes:
    """What ``call`` gave in a child of fork (whose environment is the parent's): ``done``,
    ``refused`` (the ``BackendError`` that names another process), ``other`` or ``raised``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            call()
            os.write(write, done)
        except BackendError as exc:
            os.write(write, b"refused" if "another process" in str(exc) else b"other")
        except BaseException:
            os.write(write, b"raised")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    got = os.read(read, 100)
    os.close(read)
    return got


def test_a_one_record_job_finds_drops_and_counts_what_the_general_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, data = damaged_store(tmp_path / "store", FMT, head_at=12)
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    general = _read_one_by_one(tmp_path / "store", keys, monkeypatch, False)
    fast = _read_one_by_one(tmp_path / "copy", keys, monkeypatch, True)
    print(f"general: found {general[0]}, stats {general[2]}; fast: found {fast[0]}, stats {fast[2]}")
    assert general[0] == [True, False, False, False, True, True, True, True]
    assert fast[0] == general[0]
    for i, hit in enumerate(general[0]):
        if hit:
            assert torch.equal(general[1][i], data[i]) and torch.equal(fast[1][i], data[i])
    assert fast[2] == general[2] and general[2]["corrupt_records"] == 2 and general[2]["deleted"] == 2
    assert general[2]["read_misses"] == 1 and general[2]["blocks_read"] == 5
    assert fast[3] == general[3] == {keys[i] for i in (0, 4, 5, 6, 7)}
    # The general path read every job; the straight line handed it only the records that are
    # not raw and sound (2, 3, 5, 6): it read the sound ones and the absent one itself.
    assert general[4] == [1] * 8 and fast[4] == [1] * 4


def _bad_jobs() -> list[tuple[str, Any, Any, type[Exception]]]:
    key = make_key(0)
    row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    return [
        ("a short key", [key[:31]], [row], InvalidKeyError),
        ("a str key", ["k" * 32], [row], InvalidKeyError),
        ("a float row", [key], [torch.zeros(FMT.block_bytes // 4)], LayoutError),
        ("a short row", [key], [row[:100]], LayoutError),
        ("a long row", [key], [torch.zeros(FMT.block_bytes + 1, dtype=torch.uint8)], LayoutError),
        ("a 2-D row", [key], [row.view(2, -1)], LayoutError),
        ("no row", [key], [], LayoutError),
    ]


@pytest.mark.parametrize("case", range(len(_bad_jobs())))
def test_a_bad_one_record_job_is_refused_by_name_as_the_general_path_refuses_it(tmp_path: Path, case: int) -> None:
    what, keys, rows, error = _bad_jobs()[case]
    backend = _open(tmp_path / "store")
    try:
        backend.write_blocks([make_key(0)], [random_block(FMT.block_bytes, 1)])
        good = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        assert backend.read_blocks([make_key(0)], [good]) == [True]  # the straight line is warm
        if rows and rows[0].dtype == torch.uint8 and rows[0].numel() == FMT.block_bytes:
            assert rows[0].data_ptr() != good.data_ptr()
        with pytest.raises(error) as raised:
            backend.read_blocks(keys, rows)
        print(what, "->", raised.value)
        assert "blocks[0]" in str(raised.value) or "keys[0]" in str(raised.value) or what == "no row"
        assert all(int(r.count_nonzero()) == 0 for r in rows)
    finally:
        asyncio.run(backend.aclose())


def test_rows_the_straight_line_does_not_take_are_read_by_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A strided row, a row cut from a larger tensor at an offset (a view of its own address),
    and a keyed store: the bytes are the record's either way."""
    key, block = make_key(3), random_block(FMT.block_bytes, 3)
    general: list[int] = []
    real = _READ_JOB
    monkeypatch.setattr(lmdb_layout.JobReader, "read_job", lambda self, env, keys, *a: general.append(1) or real(self, env, keys, *a))
    for options in ({}, {"mac_key": "a-test-secret-of-32-bytes-012345"}):
        backend = _open(tmp_path / f"store{len(options)}", **options)
        try:
            backend.write_blocks([key], [block])
            strided = torch.zeros((FMT.block_bytes, 2), dtype=torch.uint8)[:, 1]
            inner = torch.zeros(FMT.block_bytes + 64, dtype=torch.uint8)[32 : 32 + FMT.block_bytes]
            # A strided row and a keyed store always take the general path; a contiguous row
            # of an unkeyed store, only the first time its address is seen.
            expected = [2, 2, 2] if options else [2, 1, 0]
            for row, jobs in zip((strided, inner, inner), expected):
                general.clear()
                assert backend.read_blocks([key], [row]) == [True] and torch.equal(row, block)
                row.zero_()
                assert backend.read_blocks([key], [row]) == [True] and torch.equal(row, block)
                assert len(general) == jobs
            assert bool(options) == (backend._straight is None)  # type: ignore[attr-defined]
        finally:
            asyncio.run(backend.aclose())


def test_a_slow_one_record_lookup_makes_the_next_job_cold_as_the_general_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(2)]
    backend = _open(tmp_path / "store")
    clock = [0.0]
    slow_key: list[bytes] = []

    def perf_counter() -> float:
        return clock[0]

    try:
        backend.write_blocks(keys, [random_block(FMT.block_bytes, 40 + i) for i in range(2)])
        monkeypatch.setattr(lmdb_layout, "time", types.SimpleNamespace(perf_counter=perf_counter))
        monkeypatch.setattr(lmdb_one, "perf_counter", perf_counter)
        slow_lookups_read_the_disk(monkeypatch)
        env = backend._env  # type: ignore[attr-defined]

        def slow(key: bytes) -> None:
            if key in slow_key:
                clock[0] += 2 * lmdb_layout.COLD_GET_S

        backend._env = HookedEnv(env, slow)  # type: ignore[attr-defined]
        general: list[int] = []
        real = _READ_JOB
        monkeypatch.setattr(lmdb_layout.JobReader, "read_job", lambda self, env, keys, *a: general.append(1) or real(self, env, keys, *a))
        temperature = backend._reader.temperature  # type: ignore[attr-defined]
        row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        for fast in (True, False):
            monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", fast)
            temperature.cold = False
            slow_key.clear()
            assert backend.read_blocks([keys[0]], [row]) == [True]
            assert not temperature.cold
            slow_key.append(keys[1])
            general.clear()
            assert backend.read_blocks([keys[1]], [row]) == [True]
            assert temperature.cold, fast
            assert temperature.readers == 0 and len(general) == (0 if fast else 1)
    finally:
        backend._env = env  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())


@pytest.mark.parametrize("error", [lmdb.CorruptedError, lmdb.MapResizedError])
def test_an_lmdb_error_in_a_one_record_job_is_the_general_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[lmdb.Error]) -> None:
    """The straight line hands the job over at the error; the general path meets it again:
    a damaged page drops the key, another error keeps it; a miss either way."""
    key = make_key(5)
    backend = _open(tmp_path / "store")
    env = backend._env  # type: ignore[attr-defined]
    try:
        backend.write_blocks([key], [random_block(FMT.block_bytes, 5)])
        row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        assert backend.read_blocks([key], [row]) == [True]
        lookups: list[str] = []

        def fail(key: bytes) -> None:
            lookups.append("get")
            raise error("injected")

        backend._env = HookedEnv(env, fail, reads_only=True)  # type: ignore[attr-defined]
        row.zero_()
        assert backend.read_blocks([key], [row]) == [False]
        assert len(lookups) == 2  # once in the straight line, once in the general path
        backend._env = env  # type: ignore[attr-defined]
        dropped = error is lmdb.CorruptedError
        assert (key in {r.key for r in backend.scan()}) is not dropped
        stats = backend.stats()
        assert stats["deleted"] == (1 if dropped else 0) and stats["blocks_read"] == 1 and stats["read_misses"] == 1
    finally:
        backend._env = env  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())


def test_a_one_record_job_of_a_closed_or_forked_store_is_refused(tmp_path: Path) -> None:
    key = make_key(6)
    backend = _open(tmp_path / "store")
    row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    backend.write_blocks([key], [random_block(FMT.block_bytes, 6)])
    assert backend.read_blocks([key], [row]) == [True]
    assert _in_forked_child(lambda: backend.read_blocks([key], [row]), b"read") == b"refused"
    assert backend.read_blocks([key], [row]) == [True]  # the parent reads on
    rows = [row, torch.zeros(FMT.block_bytes, dtype=torch.uint8)]
    assert backend.read_blocks([key, key], rows) == [True, True]  # a job of several: its rows seen
    assert _in_forked_child(lambda: backend.read_blocks([key, key], rows), b"read") == b"refused"
    assert backend.read_blocks([key, key], rows) == [True, True]
    asyncio.run(backend.aclose())
    with pytest.raises(ClosedError):
        backend.read_blocks([key], [row])
    with pytest.raises(ClosedError):
        backend.read_blocks([key, key], rows)


def test_a_save_of_a_forked_store_is_refused_and_the_parent_saves_on(tmp_path: Path) -> None:
    """A save in a child of the process that opened the store is refused (the environment is
    the parent's), told by the count of forks, not by a pid asked at each save."""
    keys = [make_key(7), make_key(8)]
    backend = _open(tmp_path / "store")
    blocks = [random_block(FMT.block_bytes, 7), random_block(FMT.block_bytes, 8)]
    assert _in_forked_child(lambda: backend.write_blocks(keys[:1], blocks[:1]), b"saved") == b"refused"
    try:
        assert None not in backend.write_blocks(keys, blocks)  # the parent saves on
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, rows) == [True, True]
        assert all(torch.equal(r, b) for r, b in zip(rows, blocks))
    finally:
        asyncio.run(backend.aclose())


_CUT = """
import asyncio, os, sys
import torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.errors import DiskError
from kvtier.testing import make_key, random_block

fmt = BlockFormat(block_bytes=65536, dtype="uint8")
backend = registry.backends.get("lmdb")(capacity=8 << 20, path=sys.argv[1], sync_mode="fast")
asyncio.run(backend.open(fmt))
keys = [make_key(i) for i in range(4)]
backend.write_blocks(keys, [random_block(fmt.block_bytes, i) for i in range(4)])
row = torch.zeros(fmt.block_bytes, dtype=torch.uint8)
assert backend.read_blocks(keys[3:], [row]) == [True]
assert backend._straight.one(backend._env, keys[3], row) is True  # the straight line takes the job
data = os.path.join(sys.argv[1], "data.mdb")
os.truncate(data, os.path.getsize(data) // 2)
print("cut", flush=True)
try:
    print("read", backend.read_blocks(keys[3:], [row]), flush=True)
except DiskError as exc:
    print("refused", exc, flush=True)
"""


def test_a_one_record_job_of_a_data_file_cut_short_is_refused(tmp_path: Path) -> None:
    """As a job of several keys (``test_lmdb_plain_reads``): refused before any lookup, not a
    fault inside one. In a child process, so a fault would be observed, not suffered."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _CUT, str(tmp_path / "store")], capture_output=True, text=True, timeout=120)
    print(child.stdout, child.stderr[-2000:])
    assert child.returncode == 0 and "refused" in child.stdout and "shorter than" in child.stdout



def test_a_one_record_job_notes_the_data_file_grown_since_the_last_read(tmp_path: Path) -> None:
    """The straight line compares the file's end with the guard's last size itself and calls
    the guard only when it moved: a grown file is noted there, so a later cut to below the
    grown size (not below the first) is still refused (the cut itself: the test above)."""
    backend = _open(tmp_path / "store")
    try:
        guard = backend._reader.guard  # type: ignore[attr-defined]
        row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        keys = [make_key(i) for i in range(40)]
        backend.write_blocks(keys[:1], [random_block(FMT.block_bytes, 0)])
        assert backend.read_blocks(keys[:1], [row]) == [True]  # the row's view is made
        first = guard.seen
        backend.write_blocks(keys[1:], [random_block(FMT.block_bytes, i) for i in range(1, 40)])
        grown = os.path.getsize(tmp_path / "store" / "data.mdb")
        assert grown > first
        assert backend._straight.one(backend._env, keys[39], row) is True  # type: ignore[attr-defined]
        assert guard.seen == grown
        assert torch.equal(row, random_block(FMT.block_bytes, 39))
    finally:
        asyncio.run(backend.aclose())

# -- jobs of several keys (StraightRead.job) ---------------------------------------------------

_JOBS = [(0, 1, 4, 7), (7, 2, 0), (3, 4), (4, 5, 0), (6, 7), (0, 1, 2, 3, 4, 5, 6, 7), (4, 7, 0)]


def _read_jobs(path: Path, keys: list[bytes], monkeypatch: pytest.MonkeyPatch, fast: bool) -> tuple[list[list[bool]], list[list[torch.Tensor]], dict[str, Any], set[bytes], list[int]]:
    """The jobs of ``_JOBS`` read in turn, each into rows of its own that a job read before."""
    monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", fast)
    general: list[int] = []

    def counted(self: Any, env: Any, keys: Any, *args: Any) -> Any:
        general.append(len(keys))
        return _READ_JOB(self, env, keys, *args)

    monkeypatch.setattr(lmdb_layout.JobReader, "read_job", counted)
    backend = _open(path)
    rows = [[torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in job] for job in _JOBS]
    try:
        for job_rows in rows:  # the rows' first job: key 0, sound
            assert backend.read_blocks([keys[0]] * len(job_rows), job_rows) == [True] * len(job_rows)
            for row in job_rows:
                row.fill_(7)
        before = {k: v for k, v in backend.stats().items() if k in _STATS}
        general.clear()
        found = [backend.read_blocks([keys[i] for i in job], job_rows) for job, job_rows in zip(_JOBS, rows)]
        stats = {k: v - before[k] for k, v in backend.stats().items() if k in _STATS}
        listed = {r.key for r in backend.scan()}
    finally:
        asyncio.run(backend.aclose())
    return found, rows, stats, listed, general


def test_a_warm_job_finds_drops_and_counts_what_the_general_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, data = damaged_store(tmp_path / "store", FMT, head_at=12)
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    general = _read_jobs(tmp_path / "store", keys, monkeypatch, False)
    fast = _read_jobs(tmp_path / "copy", keys, monkeypatch, True)
    print(f"general: found {general[0]}, stats {general[2]}; fast: found {fast[0]}, stats {fast[2]}")
    assert general[0][0] == [True, False, True, True] and general[0][1] == [True, False, True]
    assert fast[0] == general[0]
    for job, hits, fast_rows, general_rows in zip(_JOBS, general[0], fast[1], general[1]):
        for i, hit, f, g in zip(job, hits, fast_rows, general_rows):
            if hit:
                assert torch.equal(f, data[i]) and torch.equal(g, data[i])
    assert fast[2] == general[2] and general[2]["corrupt_records"] == 2 and general[2]["deleted"] == 2
    assert fast[3] == general[3] == {keys[i] for i in (0, 4, 5, 6, 7)}
    # The general path read every job; the straight line handed it only the jobs with a record
    # that is not raw and sound (2, 3, 5, 6) before it was dropped or rewritten: the second to
    # the fifth. The sixth met keys 2 and 3 dropped already: absent, and its 5 and 6 are not raw.
    assert general[4] == [len(job) for job in _JOBS]
    assert fast[4] == [3, 2, 3, 2, 8]


def test_a_bad_warm_job_is_refused_by_name_as_the_general_path_refuses_it(tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(3)]
    backend = _open(tmp_path / "store")
    try:
        backend.write_blocks(keys, [random_block(FMT.block_bytes, 60 + i) for i in range(3)])
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, rows) == [True] * 3  # the rows are seen: the straight line is warm
        for row in rows:
            row.zero_()
        for what, job, job_rows, error in [
            ("a short key", [keys[0], keys[1][:31], keys[2]], rows, InvalidKeyError),
            ("a str key", [keys[0], "k" * 32, keys[2]], rows, InvalidKeyError),
            ("fewer rows", keys, rows[:2], LayoutError),
            ("a short row", keys, [rows[0], rows[1][:100], rows[2]], LayoutError),
            ("a 2-D row", keys, [rows[0], rows[1].view(2, -1), rows[2]], LayoutError),
        ]:
            with pytest.raises(error) as raised:
                backend.read_blocks(job, job_rows)
            print(what, "->", raised.value)
            assert "blocks[1]" in str(raised.value) or "keys[1]" in str(raised.value) or what == "fewer rows"
            assert all(int(r.count_nonzero()) == 0 for r in rows), what
    finally:
        asyncio.run(backend.aclose())


def test_a_slow_warm_job_makes_the_next_job_cold_and_a_cold_job_is_the_general_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that took ``COLD_GET_S`` and read from disk is read on by the straight line and
    makes the reader cold; the next job (cold) is the job reader's. A warm job of
    ``SIDE_MIN_BYTES`` or more is the straight line's once its rows were seen (the job reader
    would read it in one pass on this thread too)."""
    keys = [make_key(i) for i in range(4)]
    backend = _open(tmp_path / "store")
    clock = [0.0]
    slow_lookups_read_the_disk(monkeypatch, thread=False)
    monkeypatch.setattr(lmdb_layout, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(lmdb_one, "perf_counter", lambda: clock[0])
    general: list[int] = []
    monkeypatch.setattr(lmdb_layout.JobReader, "read_job", lambda self, env, keys, *a: general.append(len(keys)) or _READ_JOB(self, env, keys, *a))
    env = backend._env  # type: ignore[attr-defined]
    slow_key = keys[1]

    def slow(key: bytes) -> None:
        if key == slow_key:
            clock[0] += 2 * lmdb_layout.COLD_GET_S

    try:
        data = [random_block(FMT.block_bytes, 80 + i) for i in range(4)]
        backend.write_blocks(keys, data)
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, rows) == [True] * 4  # the rows are seen
        general.clear()
        backend._env = HookedEnv(env, slow)  # type: ignore[attr-defined]
        temperature = backend._reader.temperature  # type: ignore[attr-defined]
        assert not temperature.cold
        for row in rows:
            row.zero_()
        assert backend.read_blocks(keys, rows) == [True] * 4
        assert general == [] and temperature.cold and temperature.readers == 0  # read on by the straight line
        assert all(torch.equal(r, d) for r, d in zip(rows, data))
        slow_key = b""
        assert backend.read_blocks(keys, rows) == [True] * 4
        assert general == [4] and not temperature.cold  # read cold by the job reader, which found it warm
        assert backend.read_blocks(keys, rows) == [True] * 4
        assert general == [4]  # warm again: the straight line's
        big = -(-SIDE_MIN_BYTES // FMT.block_bytes) + 1
        many = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(big)]
        for _ in range(2):  # (the first time, rows not seen)
            assert backend.read_blocks([keys[0]] * big, many) == [True] * big
            assert all(torch.equal(r, data[0]) for r in many)
        assert general == [4, big]
    finally:
        backend._env = env  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())


@pytest.mark.parametrize("error", [lmdb.CorruptedError, lmdb.MapResizedError])
def test_an_lmdb_error_in_a_warm_job_is_the_general_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[lmdb.Error]) -> None:
    keys = [make_key(i) for i in range(3)]
    backend = _open(tmp_path / "store")
    env = backend._env  # type: ignore[attr-defined]
    failed: list[bytes] = []

    def fail(key: bytes) -> None:
        if key == keys[1] and len(failed) < 2:
            failed.append(key)
            raise error("injected")

    try:
        data = [random_block(FMT.block_bytes, 90 + i) for i in range(3)]
        backend.write_blocks(keys, data)
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, rows) == [True] * 3
        for row in rows:
            row.zero_()
        backend._env = HookedEnv(env, fail, reads_only=True)  # type: ignore[attr-defined]
        assert backend.read_blocks(keys, rows) == [True, False, True]
        assert failed == [keys[1]] * 2  # once in the straight line, once in the general path
        backend._env = env  # type: ignore[attr-defined]
        assert torch.equal(rows[0], data[0]) and torch.equal(rows[2], data[2])
        dropped = error is lmdb.CorruptedError
        assert (keys[1] in {r.key for r in backend.scan()}) is not dropped
        stats = backend.stats()
        assert stats["deleted"] == (1 if dropped else 0) and stats["blocks_read"] == 5 and stats["read_misses"] == 1
    finally:
        backend._env = env  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())


def test_on_a_machine_whose_every_lookup_is_slow_and_waits_for_the_disk_tests_read_warm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tests' lookups are warm whatever the machine (lmdb_lookups.warm_lmdb_lookups, autouse):
    with every lookup over ``COLD_GET_S`` and a major fault each time (a cold page cache on a
    loaded host), warm jobs stay on the straight line; ``slow_lookups_read_the_disk`` gives a
    test the tier's rule back, and the same job then makes the reader cold."""
    import itertools

    monkeypatch.setattr(lmdb_layout, "COLD_GET_S", -1.0)
    monkeypatch.setattr(lmdb_one, "COLD_GET_S", -1.0)
    monkeypatch.setattr(lmdb_layout, "major_faults", itertools.count(-(10**6)).__next__)  # below the rule's own count below
    keys = [make_key(i) for i in range(3)]
    backend = _open(tmp_path / "store")
    general: list[int] = []
    monkeypatch.setattr(lmdb_layout.JobReader, "read_job", lambda self, env, keys, *a: general.append(len(keys)) or _READ_JOB(self, env, keys, *a))
    try:
        data = [random_block(FMT.block_bytes, 90 + i) for i in range(3)]
        backend.write_blocks(keys, data)
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, rows) == [True] * 3  # the rows are seen
        temperature = backend._reader.temperature  # type: ignore[attr-defined]
        general.clear()
        for _ in range(3):
            assert backend.read_blocks(keys, rows) == [True] * 3
        assert general == [] and not temperature.cold  # the straight line's, every time
        assert all(torch.equal(r, d) for r, d in zip(rows, data))
        slow_lookups_read_the_disk(monkeypatch, thread=False)
        assert backend.read_blocks(keys, rows) == [True] * 3
        assert temperature.cold  # the tier's own rule: that job read from disk
        assert backend.read_blocks(keys, rows) == [True] * 3
        assert general == [3]  # the next job is read cold, by the job reader
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.parametrize("n", [1, 2])
def test_a_slow_lookup_on_a_threads_first_job_is_a_disk_read_only_if_the_thread_waited_for_the_disk_on_both_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """A thread's first job marks its major faults (``Temperature.begin``), on the straight line
    as on the general path: a slow lookup of that job with no fault since is not a disk read,
    and the reader stays warm; with one, it is, and the reader goes cold. Each job runs on a
    thread of its own (the mark is per thread), after a job on this one saw its rows."""
    import threading

    keys = [make_key(i) for i in range(n)]
    backend = _open(tmp_path / "store")
    clock = [0.0]
    faults = [0]
    slow_lookups_read_the_disk(monkeypatch, thread=False)
    monkeypatch.setattr(lmdb_layout, "major_faults", lambda: faults[0])
    monkeypatch.setattr(lmdb_layout, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(lmdb_one, "perf_counter", lambda: clock[0])
    env = backend._env  # type: ignore[attr-defined]

    def slow(key: bytes) -> None:
        clock[0] += 2 * lmdb_layout.COLD_GET_S
        faults[0] += fault[0]

    general: list[int] = []
    monkeypatch.setattr(lmdb_layout.JobReader, "read_job", lambda self, env, keys, *a: general.append(len(keys)) or _READ_JOB(self, env, keys, *a))
    fault = [0]
    try:
        data = [random_block(FMT.block_bytes, 60 + i) for i in range(n)]
        backend.write_blocks(keys, data)
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, rows) == [True] * n  # the rows are seen (on this thread)
        backend._env = HookedEnv(env, slow)  # type: ignore[attr-defined]
        temperature = backend._reader.temperature  # type: ignore[attr-defined]
        seen: dict[tuple[bool, int], tuple[bool, list[int]]] = {}
        for fast in (True, False):
            monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", fast)
            for fault[0] in (0, 1):
                temperature.cold = False
                general.clear()
                for row in rows:
                    row.zero_()
                found: list[Any] = []
                reader = threading.Thread(target=lambda found=found: found.append(backend.read_blocks(keys, rows)))
                reader.start()
                reader.join()
                assert found == [[True] * n]
                assert all(torch.equal(r, d) for r, d in zip(rows, data))
                seen[fast, fault[0]] = (temperature.cold, list(general))
        print(seen)
        assert seen[True, 0] == (False, []) and seen[False, 0] == (False, [n])  # no fault: warm, on both
        assert seen[True, 1] == (True, []) and seen[False, 1] == (True, [n])  # a fault: cold, on both
    finally:
        backend._env = env  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())


def test_a_threads_fault_mark_goes_with_the_thread() -> None:
    """``Temperature.marks`` (thread ident -> the mark of :meth:`Temperature.begin`, which the
    straight line looks up instead of calling it) holds the threads that began a job and are
    alive: a thread's mark is dropped as the thread ends, before its ident can be another
    thread's (which then begins afresh), and a slow lookup moves only its own thread's mark."""
    import threading

    temperature = lmdb_layout.Temperature()
    seen: list[tuple[int, bool]] = []

    def job() -> None:
        temperature.begin()
        seen.append((threading.get_ident(), threading.get_ident() in temperature.marks))

    temperature.begin()
    here = threading.get_ident()
    for _ in range(3):
        thread = threading.Thread(target=job)
        thread.start()
        thread.join()
        ident, marked = seen[-1]
        assert marked and ident != here and ident not in temperature.marks
    assert list(temperature.marks) == [here]
    mark = temperature.marks[here]
    temperature.begin()  # begun already: the mark stays
    assert temperature.marks == {here: mark}


def _changes(rows: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """What can happen to a row between two jobs, in place on the same tensor object."""
    size = FMT.block_bytes
    return {
        "a new storage (set_)": lambda: rows[1].set_(torch.zeros(size, dtype=torch.uint8)),
        "cut short (resize_)": lambda: rows[1].resize_(size // 2),
        "grown (resize_)": lambda: rows[1].resize_(2 * size),
        "another dtype (.data)": lambda: setattr(rows[1], "data", torch.zeros(size, dtype=torch.int8)),
        "2-D (as_strided_)": lambda: rows[1].as_strided_((2, size // 2), (size // 2, 1)),
        "strided (set_)": lambda: rows[1].set_(torch.zeros(2 * size, dtype=torch.uint8).untyped_storage(), 0, (size,), (2,)),
        "moved in its storage (set_)": lambda: rows[1].set_(torch.zeros(2 * size, dtype=torch.uint8).untyped_storage(), size, (size,), (1,)),
        "a freed row's place (new tensor)": lambda: rows.__setitem__(1, torch.zeros(size, dtype=torch.uint8)),
        "written (fill_)": lambda: rows[1].fill_(3),
    }


def outcome_after_change(
    backend: Backend, keys: list[bytes], rows: list[torch.Tensor], what: str, block: torch.Tensor, pick: Callable[[list[torch.Tensor]], list[torch.Tensor]]
) -> tuple[Any, bool | None, bool]:
    """``rows`` zeroed, then ``rows[1]`` changed as :func:`_changes` says of ``what``, then a job
    of ``keys`` read into ``pick(rows)``: the job's answer (or its error's name), whether
    ``rows[1]`` then holds ``block``, and whether the storage it had before was left zeroed."""
    for row in rows:
        row.zero_()
    before = rows[1].untyped_storage()  # kept alive: its old place is not reused
    _changes(rows)[what]()
    try:
        found: Any = backend.read_blocks(keys, pick(rows))
    except Exception as exc:  # (the outcome compared)
        found = type(exc).__name__
    target = rows[1]
    got = target.contiguous().view(torch.uint8).reshape(-1)[: block.numel()].clone() if target.numel() else None
    return found, None if got is None else bytes(got.numpy()) == bytes(block.numpy()), bytes(before)[:16] == bytes(16)


def changed_alike(outcomes: dict[bool, dict[str, Any]], jobs: int) -> None:
    """The outcomes of :func:`outcome_after_change` for each change, on the fast path (``True``)
    and the general one (``False``): the same, and those that must read, read, or refuse."""
    for what in outcomes[True]:
        print(what, "fast:", outcomes[True][what], "general:", outcomes[False][what])
    assert outcomes[True] == outcomes[False]
    assert outcomes[True]["a new storage (set_)"][:2] == ([True] * jobs, True)
    assert outcomes[True]["cut short (resize_)"][0] == "LayoutError"
    assert outcomes[True]["written (fill_)"][:2] == ([True] * jobs, True)


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_row_changed_since_its_last_job_is_checked_again_as_the_general_path_checks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: int) -> None:
    """A row whose views were made by a job, then changed in place (a new storage, resized,
    another dtype or shape, strided, moved, or another tensor in its place): the next job,
    of one key or of several, answers as the general path does (the same hits and bytes, or
    the same error naming the row), never writing where the row no longer is."""
    keys = [make_key(i) for i in range(3)]
    data = [random_block(FMT.block_bytes, 120 + i) for i in range(3)]
    backend = _open(tmp_path / "store")
    backend.write_blocks(keys, data)
    outcomes: dict[bool, dict[str, Any]] = {}
    try:
        for fast in (True, False):
            monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", fast)
            seen: dict[str, Any] = {}
            for what in _changes([]):
                rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
                job = keys[:jobs] if jobs > 1 else keys[1:2]
                job_rows = rows[:jobs] if jobs > 1 else rows[1:2]
                assert backend.read_blocks(job, job_rows) == [True] * jobs  # the rows' views are made
                seen[what] = outcome_after_change(backend, job, rows, what, data[1], lambda rows: rows[:jobs] if jobs > 1 else rows[1:2])
            outcomes[fast] = seen
    finally:
        asyncio.run(backend.aclose())
    changed_alike(outcomes, jobs)
