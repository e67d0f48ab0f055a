"""The ``lmdb`` tier's straight line for a job of several plain blocks
(``lmdb_lone.LoneSave.save_job``: the job's checks and views in one call, ``lmdb_plain.job_views``;
its records each built just before its put, ``lmdb_lone.put_joined``, or written into the room
LMDB's own put reserves, ``lmdb_lone.RESERVED_PUTS``) against the general path
(``LONE_SAVES = False``): the same records on disk, the same records read back, the same sizes,
counters and errors, whatever fails; with those calls native and in Python."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_entries, lmdb_lone, lmdb_plain

from kvtier import registry
from kvtier.backend import Backend
from kvtier.errors import BackendError, ClosedError, DiskError
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
from tests import lmdb_saves
from tests.lmdb_saves import (
    FMT,
    FORMS,
    Dispatching,
    FailingEnv,
    Passing,
    RefusingEnv,
    compare,
    dump,
    open_store,
    read_back,
    while_a_commit_runs,
)

_FORMS = ("host_view", "job_views", "put_joined", "views_stayed")


@pytest.fixture(autouse=True, params=FORMS)
def guard_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with the row checks, the job's views and its puts native, its records written
    into the room LMDB's own put reserves (``lmdb_lone.RESERVED_PUTS``); then built and put
    through python-lmdb, native, then in Python."""
    return lmdb_saves.guard_form(request, monkeypatch, _FORMS)


def _block(i: int) -> bytes:
    return bytes(random_block(FMT.block_bytes, i).numpy())


def test_job_saves_store_read_and_count_what_the_general_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(12)]

    def plan(backend: Backend, rows: list[torch.Tensor]) -> list[Any]:
        sizes = []
        for i, row in enumerate(rows):
            row.copy_(random_block(FMT.block_bytes, i))
        sizes.append(backend.write_blocks(keys[:4], rows[:4]))
        sizes.append(backend.write_blocks(keys[4:12], rows))  # eight rows, one job
        rows[0].copy_(random_block(FMT.block_bytes, 50))
        sizes.append(backend.write_blocks([keys[2], keys[3], keys[2]], [rows[1], rows[0], rows[0]]))  # saved over, a key twice
        return [sizes, read_back(backend, keys)]

    fast, slow = compare(tmp_path, monkeypatch, plan)
    assert fast[3] == [] and slow[3] == [4, 8, 3]  # the straight line took every job
    sizes, read = fast[0]
    assert [len(s) for s in sizes] == [4, 8, 3] and len({s for job in sizes for s in job}) == 1 and sizes[0][0] > 0
    assert read[:2] == [_block(0), _block(1)] and read[2] == read[3] == _block(50) and read[4:12] == [_block(i) for i in range(8)]
    assert fast[1] == {"blocks_written": 15, "bytes_written": 15 * (32 + FMT.block_bytes), "write_failures": 0}


def test_a_job_with_a_row_not_seen_yet_or_not_such_is_the_general_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(3)]

    def plan(backend: Backend, rows: list[torch.Tensor]) -> list[Any]:
        new = random_block(FMT.block_bytes, 9)  # not saved from before: its view is made by the general path
        sizes = [backend.write_blocks(keys, [rows[0], new, rows[1]]), backend.write_blocks(keys, [rows[0], new, rows[1]])]
        with pytest.raises(ValueError):
            backend.write_blocks(keys, [rows[0], rows[1]])  # one row short: the general checks name it
        with pytest.raises(ValueError):
            backend.write_blocks([keys[0], b"short", keys[2]], rows[:3])
        return [sizes, read_back(backend, keys)]

    fast, slow = compare(tmp_path, monkeypatch, plan)
    assert fast[3][0] == 3 and slow[3][:2] == [3, 3]  # the unseen row's job was the general path's; the next one straight
    assert fast[0][1] == [bytes(FMT.block_bytes), _block(9), bytes(FMT.block_bytes)]


def test_a_job_save_over_split_records_drops_their_index_entries_as_the_general_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(3)]

    def plan(backend: Backend, rows: list[torch.Tensor]) -> list[Any]:
        with pytest.MonkeyPatch.context() as split:
            split.setattr(lmdb_entries, "JOIN_MAX", 0)  # saved split: an index entry each
            rows[0].copy_(random_block(FMT.block_bytes, 1))
            backend.write_blocks(keys, [rows[0]] * 3)
        assert len(dump(backend)[1]) == 3
        rows[1].copy_(random_block(FMT.block_bytes, 2))
        sizes = backend.write_blocks(keys[:2], rows[1:3])  # saved joined over them
        return [sizes, len(dump(backend)[1]), read_back(backend, keys)]

    fast, slow = compare(tmp_path, monkeypatch, plan)
    assert fast[3] == [3] and slow[3] == [3, 2]
    assert fast[0][1] == 1  # the two saved joined have no entry left
    assert fast[0][2] == [_block(2), bytes(FMT.block_bytes), _block(1)]


def test_a_record_that_fails_to_build_in_the_transaction_fails_alone_as_on_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(4)]
    real = xxcopy.xxh3_joined

    def plan(backend: Backend, rows: list[torch.Tensor]) -> list[Any]:
        def build(head: Any, key: bytes, view: Any) -> bytes:
            if key == keys[1]:
                raise MemoryError("no memory for the record")
            return real(head, key, view)

        for i, row in enumerate(rows):
            row.copy_(random_block(FMT.block_bytes, i))
        with pytest.MonkeyPatch.context() as failing:
            failing.setattr(xxcopy, "xxh3_joined", build)
            sizes = backend.write_blocks(keys, rows[:4])
        return [sizes, read_back(backend, keys)]

    fast, _ = compare(tmp_path, monkeypatch, plan)
    sizes, read = fast[0]
    # built in the transaction on both paths: aborted, then each record in its own; that key alone fails
    assert sizes[1] is None and None not in sizes[:1] + sizes[2:]
    assert read == [_block(0), None, _block(2), _block(3)]
    assert fast[1] == {"blocks_written": 3, "bytes_written": 3 * (32 + FMT.block_bytes), "write_failures": 1}


def test_job_saves_into_a_full_map_fail_and_recover_as_on_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(200)]

    def plan(backend: Backend, rows: list[torch.Tensor]) -> list[Any]:
        sizes = [s for i in range(0, len(keys), 4) for s in backend.write_blocks(keys[i : i + 4], rows[:4])]
        assert None in sizes and sizes[0] is not None
        saved = [k for k, s in zip(keys, sizes) if s is not None]
        backend.delete_blocks(saved[:20])
        again = backend.write_blocks(keys[-4:], rows[4:8])
        return [sizes, again]

    fast, _ = compare(tmp_path, monkeypatch, plan, capacity=512 << 10)
    assert fast[0][1].count(None) < 4  # room again after the deletions
    assert fast[1]["write_failures"] > 0


@pytest.mark.parametrize("error", [lmdb.DiskError, lmdb.CorruptedError])
def test_an_lmdb_error_in_a_job_save_is_the_general_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[lmdb.Error]) -> None:
    keys = [make_key(i) for i in range(3)]

    def plan(backend: Backend, rows: list[torch.Tensor]) -> list[Any]:
        env = backend._env  # type: ignore[attr-defined]
        backend._env = FailingEnv(env, error)  # type: ignore[attr-defined]
        try:
            got: Any = backend.write_blocks(keys, rows[:3])
        except DiskError as exc:
            got = f"DiskError: {exc}".replace(backend.path, "PATH")  # type: ignore[attr-defined]
        finally:
            backend._env = env  # type: ignore[attr-defined]
        return [got, read_back(backend, keys)]

    fast, _ = compare(tmp_path, monkeypatch, plan)
    got, read = fast[0]
    assert read == [None] * 3
    if error is lmdb.DiskError:
        assert got == [None] * 3 and fast[1]["write_failures"] == 3
    else:
        assert got == "DiskError: lmdb: write to 'PATH' failed: injected" and fast[1]["write_failures"] == 0


def test_a_job_save_while_a_commit_runs_joins_the_group_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = open_store(tmp_path / "store")
    rows = [random_block(FMT.block_bytes, i) for i in range(4)]
    keys = [make_key(i) for i in range(4)]
    try:
        backend.write_blocks(keys[2:], rows[2:])  # the rows' views are kept from now on
        committed = while_a_commit_runs(backend, monkeypatch, (keys[:1], rows[:1]), (keys[2:], rows[2:]), lambda job: [head for _, head, _ in job])
        assert committed[1] == [[b"", b""]]  # through the group's commit, its records built whole while it waited
        assert read_back(backend, keys) == [bytes(rows[0].numpy()), None, bytes(rows[2].numpy()), bytes(rows[3].numpy())]
    finally:
        asyncio.run(backend.aclose())


def test_a_durable_job_save_returns_after_its_sync(tmp_path: Path) -> None:
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(tmp_path / "store"))
    asyncio.run(backend.open(FMT))
    rows = [random_block(FMT.block_bytes, i) for i in range(3)]
    keys = [make_key(i) for i in range(3)]
    commits = backend._commits  # type: ignore[attr-defined]
    settled: list[Any] = []
    real = commits._settle

    def settle(results: Any) -> None:
        real(results)
        settled.append(results)

    commits._settle = settle
    try:
        backend.write_blocks(keys, rows)  # the rows' views, by the general path
        settled.clear()
        sizes = backend._lone.save_job(keys, rows)  # type: ignore[attr-defined]
        assert sizes is not None and settled == [[sizes]]
    finally:
        asyncio.run(backend.aclose())


def test_a_job_save_of_a_closed_or_forked_store_is_refused(tmp_path: Path) -> None:
    backend = open_store(tmp_path / "store")
    rows = [random_block(FMT.block_bytes, i) for i in range(2)]
    keys = [make_key(i) for i in range(2)]
    backend.write_blocks(keys, rows)  # the rows' views are kept: the next saves are straight
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            backend._lone.save_job(keys, rows)  # type: ignore[attr-defined]
            os.write(write, b"saved")
        except BackendError:
            os.write(write, b"refused")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 64) == b"refused"
    os.close(read)
    assert None not in backend.write_blocks(keys, rows)  # the parent saves on
    asyncio.run(backend.aclose())
    with pytest.raises(ClosedError):
        backend._lone.save_job(keys, rows)  # type: ignore[attr-defined]


def test_job_views_and_put_joined_answer_alike_native_and_in_python() -> None:
    if not lmdb_plain.NATIVE_GUARD:
        pytest.skip("built without the native row guard (kvtier.backends._rowguard)")
    native = lmdb_plain._rowguard
    views = lmdb_plain.RowViews(64)
    rows = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
    keys = [make_key(i) for i in range(3)]
    assert views.of(keys, rows) is not None  # seen: views kept
    unseen = torch.zeros(64, dtype=torch.uint8)
    first, head_rows = keys[:2], rows[:2]
    cases = [
        (keys, rows), (tuple(keys), tuple(rows)), (keys, head_rows), ([*first, b"x" * 31], rows), ([*first, bytearray(32)], rows),
        (keys, [*head_rows, unseen]), (keys, [*head_rows, rows[0].view(torch.int8)]), (keys, [*head_rows, torch.zeros(2, 32, dtype=torch.uint8)]),
        (keys, [*head_rows, None]), ([], []),
    ]
    for ks, rs in cases:
        args = (ks, rs, torch.Tensor, torch.uint8, views.shape, views.views, 32)
        got, want = native.job_views(*args), lmdb_plain.job_views_python(*args)
        assert (got is None) == (want is None) and (got is None or [v.obj for v in got] == [v.obj for v in want]), (ks, rs)
    with pytest.raises(TypeError, match="job_views"):
        native.job_views(keys, rows)

    head = b"h" * 24
    got_views = native.job_views(keys, rows, torch.Tensor, torch.uint8, views.shape, views.views, 32)
    calls: list[Any] = []

    def put(key: bytes, value: bytes) -> bool:
        calls.append(("put", key, bytes(value)))
        if len(calls) > 4:
            raise lmdb.MapFullError("full")
        return True

    def delete(key: bytes, value: bytes, db: Any) -> bool:
        calls.append(("delete", key, value, db))
        return True

    for form in (native.put_joined, lmdb_lone.put_joined_python):
        calls.clear()

        form(put, None, "index", head, keys, got_views, xxcopy.xxh3_joined)
        assert calls == [("put", k, xxcopy.xxh3_joined(head, k, v)) for k, v in zip(keys, got_views)]
        calls.clear()
        with pytest.raises(lmdb.MapFullError):
            form(put, delete, "index", head, keys, got_views, xxcopy.xxh3_joined)
        assert [c[0] for c in calls] == ["put", "delete", "put", "delete", "put"] and calls[1] == ("delete", keys[0], b"", "index")
        with pytest.raises(ValueError, match="3 keys but 2 views"):
            form(put, None, "index", head, keys, got_views[:2], xxcopy.xxh3_joined)


@pytest.mark.parametrize("mode", [Passing, Dispatching])
def test_a_job_saved_while_a_torch_mode_is_on_is_the_general_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: type) -> None:
    """A mode's handler runs in the row checks and may free a row whose view is taken already
    (tests/test_lmdb_row_storage.py): such a job is the general path's."""
    keys = [make_key(i) for i in range(3)]

    def plan(backend: Backend, rows: list[torch.Tensor]) -> list[Any]:
        rows[1].copy_(random_block(FMT.block_bytes, 1))
        with mode():
            sizes = backend.write_blocks(keys, rows[:3])
        return [sizes, read_back(backend, keys)]

    fast, slow = compare(tmp_path, monkeypatch, plan)
    assert fast[3] == slow[3] == [3]
    assert fast[0][1] == [bytes(FMT.block_bytes), _block(1), bytes(FMT.block_bytes)]


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_write_transaction_that_cannot_begin_fails_as_on_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: int) -> None:
    """Its error is the general path's ``DiskError`` naming the store (not LMDB's own), for a
    lone save and a job's, and nothing is stored."""
    keys = [make_key(i) for i in range(jobs)]

    def plan(backend: Backend, rows: list[torch.Tensor]) -> list[Any]:
        env = backend._env  # type: ignore[attr-defined]
        backend._env = RefusingEnv(env, lmdb.PanicError)  # type: ignore[attr-defined]
        try:
            got: Any = backend.write_blocks(keys, rows[:jobs])
        except Exception as exc:
            got = f"{type(exc).__name__}: {exc}".replace(backend.path, "PATH")  # type: ignore[attr-defined]
        finally:
            backend._env = env  # type: ignore[attr-defined]
        return [got, read_back(backend, keys)]

    fast, _ = compare(tmp_path, monkeypatch, plan)
    got, read = fast[0]
    assert got == "DiskError: lmdb: write to 'PATH' failed: injected" and read == [None] * jobs


def _wait_until(done: Any, polls: int) -> None:
    """Poll ``done()`` every 10 ms, ``polls`` times at most."""
    pause = threading.Event()
    while polls > 0 and not done():
        pause.wait(0.01)
        polls -= 1


def test_a_record_that_fails_to_build_while_a_commit_runs_is_built_in_the_transaction_as_on_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that waits for another's commit builds its records meanwhile; one whose build fails
    then (its memory) is left to the write transaction, which builds it from its row's view, as
    the general path does: the job is stored, not failed with the build's error, and collection
    stays held off until that copy (a finalizer run during the wait may free the row)."""
    keys = [make_key(i) for i in range(4)]
    real = xxcopy.xxh3_joined

    def plan(backend: Backend, rows: list[torch.Tensor]) -> list[Any]:
        for i, row in enumerate(rows):
            row.copy_(random_block(FMT.block_bytes, i))
        failed: list[bool] = []
        collecting: list[bool] = []

        def build(head: Any, key: bytes, view: Any) -> bytes:
            if key == keys[1]:
                if not failed:
                    failed.append(True)
                    raise MemoryError("no memory for the record")
                collecting.append(gc.isenabled())
            return real(head, key, view)

        commits = backend._commits  # type: ignore[attr-defined]
        got: list[Any] = []

        def second() -> None:
            try:
                got.append(backend.write_blocks(keys, rows[:4]))
            except Exception as exc:
                got.append(repr(exc))

        one = threading.Thread(target=backend.write_blocks, args=([make_key(10)], [rows[7]]))
        two = threading.Thread(target=second)
        with pytest.MonkeyPatch.context() as failing:
            failing.setattr(xxcopy, "xxh3_joined", build)
            with backend._write_lock:  # type: ignore[attr-defined]  # the first job's commit held in it
                one.start()
                _wait_until(lambda: commits._busy, 3000)
                two.start()
                _wait_until(lambda: commits._waiting or got, 3000)  # (the second job waits for the group, or gave up)
            one.join(30)
            two.join(30)
        return [got, read_back(backend, keys), collecting]

    assert gc.isenabled()
    fast, _ = compare(tmp_path, monkeypatch, plan)
    got, read, collecting = fast[0]
    assert len(got) == 1 and isinstance(got[0], list) and None not in got[0], f"the job failed: {got}"
    assert read == [_block(i) for i in range(4)]
    assert collecting == [False], "the record was built from its row's view with collection on"
