"""Group commit in the disk tiers: a job's records share one durable commit, and (lmdb) jobs
whose writers wait together share one commit too (``kvtier.backends.group_commit``)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from kvtier.backends import file_commit
from kvtier.backends.group_commit import GroupCommit

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


def _open(name: str, path: Path, capacity: int = 16 << 20, **options: object) -> Backend:
    backend = registry.backends.get(name)(capacity=capacity, path=str(path / name), **options)
    asyncio.run(backend.open(FMT))
    return backend


def _blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    return [random_block(FMT.block_bytes, seed * 1000 + i) for i in range(n)]


def _txnid(backend: Backend) -> int:
    return int(backend._env.info()["last_txnid"])  # type: ignore[attr-defined]


def test_a_job_of_lmdb_records_is_one_transaction_and_reads_back(tmp_path: Path) -> None:
    backend = _open("lmdb", tmp_path)
    try:
        keys, data = [make_key(i) for i in range(16)], _blocks(16)
        before = _txnid(backend)
        assert backend.write_blocks(keys, data) == [backend.reserve_bytes()] * 16
        assert _txnid(backend) == before + 1  # one commit for the job, not one per record
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 16
        assert all(torch.equal(o, d) for o, d in zip(out, data))
    finally:
        asyncio.run(backend.aclose())


def test_a_grouped_lmdb_commit_that_hits_a_full_map_fails_only_the_keys_that_do_not_fit(tmp_path: Path) -> None:
    backend = _open("lmdb", tmp_path, capacity=8 * FMT.block_bytes)
    try:
        keys, data = [make_key(i) for i in range(20)], _blocks(20)
        sizes = backend.write_blocks(keys, data)
        stored = [i for i, s in enumerate(sizes) if s is not None]
        assert stored and len(stored) < 20  # the job did not fit whole, but its leading records did
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in stored]
        assert backend.read_blocks([keys[i] for i in stored], out) == [True] * len(stored)
        assert all(torch.equal(o, data[i]) for o, i in zip(out, stored))
    finally:
        asyncio.run(backend.aclose())


def test_concurrent_lmdb_jobs_that_wait_together_share_one_commit(tmp_path: Path) -> None:
    """While one job's commit runs, three more jobs arrive: they are committed together, in one
    more commit, and every record of every job reads back."""
    backend = _open("lmdb", tmp_path)
    commits = backend._commits  # type: ignore[attr-defined]
    real = commits._commit
    first_in, release = threading.Event(), threading.Event()
    groups: list[int] = []

    def commit(jobs: list[object]) -> object:
        groups.append(len(jobs))
        if len(groups) == 1:
            first_in.set()
            release.wait(30)
        return real(jobs)

    commits._commit = commit
    keys = [[make_key(100 * j + i) for i in range(4)] for j in range(4)]
    data = [_blocks(4, seed=j) for j in range(4)]
    sizes: list[object] = [None] * 4

    def job(j: int) -> None:
        sizes[j] = backend.write_blocks(keys[j], data[j])

    try:
        threads = [threading.Thread(target=job, args=(0,))]
        threads[0].start()
        assert first_in.wait(30)
        threads += [threading.Thread(target=job, args=(j,)) for j in (1, 2, 3)]
        for t in threads[1:]:
            t.start()
        while sum(len(x) for x in [commits._waiting]) < 3:  # the three wait behind the running commit
            threading.Event().wait(0.01)
        release.set()
        for t in threads:
            t.join(30)
        assert groups == [1, 3]
        assert all(s is not None and None not in s for s in sizes)
        for j in range(4):
            out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(4)]
            assert backend.read_blocks(keys[j], out) == [True] * 4
            assert all(torch.equal(o, d) for o, d in zip(out, data[j]))
    finally:
        release.set()
        asyncio.run(backend.aclose())


def test_a_failed_group_commit_fails_every_job_of_the_group_and_the_next_group_commits() -> None:
    calls: list[list[int]] = []
    fail = [True]

    def commit(batches: list[int]) -> list[int]:
        calls.append(batches)
        if fail[0]:
            raise OSError("disk gone")
        return [b * 10 for b in batches]

    group: GroupCommit[int, int] = GroupCommit(commit)
    with pytest.raises(OSError, match="disk gone"):
        group.submit(1)
    fail[0] = False
    assert group.submit(2) == 20
    assert calls == [[1], [2]] and (group.groups, group.batches) == (2, 2)


def test_group_commit_is_idle_only_while_no_commit_runs_and_no_batch_waits() -> None:
    """``idle()`` (the hint a plain ``lmdb`` save takes to build its joined records in the
    transaction or before it) is false from a leader's commit to its end, and while a batch
    waits for it."""
    entered, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def commit(batches: list[int]) -> list[int]:
        seen.append(group.idle())
        if batches == [1]:
            entered.set()
            release.wait(10)
        return batches

    group: GroupCommit[int, int] = GroupCommit(commit)
    assert group.idle()
    first = threading.Thread(target=group.submit, args=(1,))
    first.start()
    assert entered.wait(10)
    assert not group.idle()  # a commit runs
    second = threading.Thread(target=group.submit, args=(2,))
    second.start()
    for _ in range(10000):  # (until the second batch queued behind the first commit)
        if group._waiting:
            break
        threading.Event().wait(0.001)
    assert group._waiting and not group.idle()  # a batch waits
    release.set()
    first.join(10)
    second.join(10)
    assert seen == [False, False] and group.idle()


def test_a_job_of_files_syncs_each_changed_directory_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file job writes all its records, then syncs them: every record file once (after all
    were written, so the device sees them together), and each directory it changed once,
    however many of its records went there."""
    import os

    backend = _open("file", tmp_path, layout="sharded")
    keys = [bytes([7, 7]) + make_key(i)[2:] for i in range(8)]  # one shard directory for all
    synced: list[str] = []
    real_fsync, real_fdatasync, real_pwritev = os.fsync, os.fdatasync, os.pwritev
    monkeypatch.setattr(file_commit, "NATIVE_SYNCS", False)  # each sync an os call, counted here
    monkeypatch.setattr(os, "pwritev", lambda *a: (synced.append("write"), real_pwritev(*a))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append("dir"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append("file"), real_fdatasync(fd))[1])
    try:
        assert None not in backend.write_blocks(keys, _blocks(8))
        # 8 files, their shard directory, and the directory that gained it (07/, made at open)
        assert synced[:16] == ["write"] * 8 + ["file"] * 8 and synced[16:] == ["dir"] * 2
        synced.clear()
        assert None not in backend.write_blocks(keys, _blocks(8, seed=1))  # rewritten: no new directory
        assert synced == ["write"] * 8 + ["file"] * 8 + ["dir"]
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 8
        assert all(torch.equal(o, d) for o, d in zip(out, _blocks(8, seed=1)))
    finally:
        monkeypatch.undo()
        asyncio.run(backend.aclose())


def test_a_job_of_files_syncs_side_by_side_and_names_a_record_only_once_its_data_is_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's file syncs run at the same time (each waits at a barrier that only all of them
    together pass: one after the other they would never pass it), on the sync threads; no
    rename starts before every file sync has returned, and no directory sync before every
    rename (the order that makes a record durable before its name)."""
    import os

    backend = _open("file", tmp_path, layout="sharded")
    keys = [make_key(i) for i in range(4)]  # four shard directories
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(keys), timeout=60)
    real_fsync, real_fdatasync, real_replace = os.fsync, os.fdatasync, os.replace

    def note(what: str) -> None:
        with lock:
            events.append((what, threading.current_thread().name))

    def fdatasync(fd: int) -> None:
        note("file")
        barrier.wait()
        real_fdatasync(fd)
        note("file done")

    def fsync(fd: int) -> None:
        note("dir")
        real_fsync(fd)

    def replace(*args: object, **kwargs: object) -> None:
        note("rename")
        real_replace(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(file_commit, "NATIVE_SYNCS", False)  # the syncs as os calls on Python's pool, watched here
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    try:
        assert None not in backend.write_blocks(keys, _blocks(4))
    finally:
        monkeypatch.undo()
    try:
        kinds = [what for what, _ in events]
        print(f"sync order: {kinds}")
        assert kinds.count("file done") == 4 and kinds.count("rename") == 4
        assert max(i for i, k in enumerate(kinds) if k == "file done") < kinds.index("rename")
        assert max(i for i, k in enumerate(kinds) if k == "rename") < kinds.index("dir")
        assert kinds.count("dir") >= 4 + 1  # the four shard directories, and the parents that gained one
        assert all(name.startswith(file_commit.THREAD_PREFIX) for what, name in events if what in ("file", "dir"))
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 4
        assert all(torch.equal(o, d) for o, d in zip(out, _blocks(4)))
    finally:
        asyncio.run(backend.aclose())


def test_a_file_sync_that_fails_fails_its_record_alone_when_the_syncs_run_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    backend = _open("file", tmp_path)
    keys = [make_key(i) for i in range(4)]
    real_fdatasync = os.fdatasync
    bad: list[int] = []
    lock = threading.Lock()

    def fdatasync(fd: int) -> None:
        with lock:
            if not bad:
                bad.append(fd)
                raise OSError(5, "injected EIO")
        real_fdatasync(fd)

    monkeypatch.setattr(file_commit, "NATIVE_SYNCS", False)  # (natively: tests/test_file_syncs.py)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    try:
        sizes = backend.write_blocks(keys, _blocks(4))
    finally:
        monkeypatch.undo()
    try:
        assert sizes.count(None) == 1 and backend.stats()["write_failures"] == 1
        assert not list((tmp_path / "file").rglob("*.tmp"))
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [s is not None for s in sizes]
    finally:
        asyncio.run(backend.aclose())


def test_the_next_group_commits_while_one_settles_and_no_caller_returns_before_its_settle() -> None:
    """``settle`` (LMDB: the meta page's sync) runs after the next group may start its commit;
    a group's callers return only once their own settle has returned; settles run in commit
    order; a settle that fails fails its group alone."""
    events: list[str] = []
    settling, release = threading.Event(), threading.Event()

    def commit(batches: list[int]) -> list[int]:
        events.append(f"commit {batches}")
        return [b * 10 for b in batches]

    def settle(results: list[int]) -> None:
        events.append(f"settle {results}")
        if results == [10]:
            settling.set()
            assert release.wait(30)
        if results == [30]:
            raise OSError("sync failed")
        events.append(f"settled {results}")

    group: GroupCommit[int, int] = GroupCommit(commit, settle)
    got: dict[int, object] = {}

    def call(b: int) -> None:
        try:
            got[b] = group.submit(b)
        except OSError as exc:
            got[b] = exc

    first = threading.Thread(target=call, args=(1,))
    first.start()
    assert settling.wait(30)
    second = threading.Thread(target=call, args=(2,))
    second.start()
    for _ in range(3000):  # the second group commits while the first settles
        if "commit [2]" in events:
            break
        threading.Event().wait(0.01)
    assert "commit [2]" in events
    threading.Event().wait(0.05)
    assert 1 not in got and 2 not in got  # neither returns before its settle
    assert "settle [20]" not in events  # settles in commit order
    release.set()
    first.join(30)
    second.join(30)
    assert got == {1: 10, 2: 20}
    assert events == ["commit [1]", "settle [10]", "commit [2]", "settled [10]", "settle [20]", "settled [20]"]
    call(3)
    assert isinstance(got[3], OSError)  # a failed settle fails its group ...
    call(4)
    assert got[4] == 40 and (group.groups, group.batches) == (4, 4)  # ... and the next one commits


def test_an_lmdb_write_returns_after_its_own_sync_while_the_next_job_commits(tmp_path: Path) -> None:
    """Durable lmdb: a job's ``env.sync`` runs outside the write lock; the next writer's
    transaction commits meanwhile, and the first writer returns only once its sync is done."""
    backend = _open("lmdb", tmp_path)
    commits = backend._commits  # type: ignore[attr-defined]
    real_settle, real_commit = commits._settle, commits._commit
    syncing, release, committed = threading.Event(), threading.Event(), threading.Event()
    calls: list[int] = []

    def settle(sizes: list[object]) -> None:
        calls.append(1)
        if len(calls) == 1:
            syncing.set()
            assert release.wait(30)
        real_settle(sizes)

    def commit(jobs: list[object]) -> object:
        result = real_commit(jobs)
        if syncing.is_set():
            committed.set()
        return result

    commits._settle, commits._commit = settle, commit
    keys = [[make_key(100 * j + i) for i in range(4)] for j in range(2)]
    data = [_blocks(4, seed=j) for j in range(2)]
    done: list[int] = []

    def job(j: int) -> None:
        assert None not in backend.write_blocks(keys[j], data[j])
        done.append(j)

    try:
        first = threading.Thread(target=job, args=(0,))
        first.start()
        assert syncing.wait(30)
        second = threading.Thread(target=job, args=(1,))
        second.start()
        assert committed.wait(30)  # the second job's transaction committed during the first's sync
        assert done == []
        release.set()
        first.join(30)
        second.join(30)
        assert sorted(done) == [0, 1] and len(calls) == 2
        for j in range(2):
            out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(4)]
            assert backend.read_blocks(keys[j], out) == [True] * 4
            assert all(torch.equal(o, d) for o, d in zip(out, data[j]))
    finally:
        release.set()
        asyncio.run(backend.aclose())


def test_an_lmdb_close_waits_for_a_sync_under_way_and_a_write_whose_sync_comes_after_a_close_fails(tmp_path: Path) -> None:
    """The meta page's sync runs outside the write lock: a close that comes while it runs waits
    for it (the write it serves returns its sizes), and a write whose sync has not begun when the
    store closes fails with ``BackendError`` (nothing acknowledged that was not synced)."""
    from kvtier.errors import BackendError

    backend = _open("lmdb", tmp_path)
    syncing, release = threading.Event(), threading.Event()

    class SlowSync:
        def __init__(self, env: object) -> None:
            self.env = env

        def sync(self, force: bool = False) -> None:
            syncing.set()
            assert release.wait(30)
            self.env.sync(force)  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self.env, name)

    backend._env = SlowSync(backend._env)  # type: ignore[attr-defined]
    keys, data = [make_key(i) for i in range(4)], _blocks(4)
    got: list[object] = []
    writer = threading.Thread(target=lambda: got.append(backend.write_blocks(keys, data)))
    writer.start()
    assert syncing.wait(30)
    closer = threading.Thread(target=lambda: asyncio.run(backend.aclose()))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # the close waits for the sync under way
    release.set()
    writer.join(30)
    closer.join(30)
    assert not closer.is_alive() and got == [[backend.reserve_bytes()] * 4]

    backend = _open("lmdb", tmp_path)  # reopened: the blocks are there
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    assert backend.read_blocks(keys, out) == [True] * 4
    commits = backend._commits  # type: ignore[attr-defined]
    real_settle, hold = commits._settle, threading.Event()

    def settle(sizes: list[object]) -> None:
        hold.set()
        assert release.wait(30)
        real_settle(sizes)

    release.clear()
    commits._settle = settle
    errors: list[BaseException] = []

    def write() -> None:
        try:
            backend.write_blocks([make_key(9)], _blocks(1, seed=9))
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    assert hold.wait(30)
    asyncio.run(backend.aclose())
    release.set()
    writer.join(30)
    assert len(errors) == 1 and isinstance(errors[0], BackendError) and "closed" in str(errors[0])


def test_a_lone_caller_skips_the_queue_and_gets_what_a_queued_caller_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lone path (no commit running, nothing waiting: no ticket) against the queue's path
    (callers that arrive while a commit runs): the same results, errors, groups and counts."""
    from kvtier.backends import group_commit

    tickets: list[object] = []

    class Counted(group_commit._Ticket):  # type: ignore[type-arg]
        __slots__ = ()

        def __init__(self, batch: object) -> None:
            tickets.append(batch)
            super().__init__(batch)

    monkeypatch.setattr(group_commit, "_Ticket", Counted)

    def run(queued: bool) -> tuple[list[list[int]], dict[int, object], tuple[int, int]]:
        calls: list[list[int]] = []
        held = {0: threading.Event(), 5: threading.Event()}
        go = {0: threading.Event(), 5: threading.Event()}

        def commit(batches: list[int]) -> list[int]:
            calls.append(list(batches))
            if queued and batches[0] in held:  # the blockers 0 and 5 hold their commit
                held[batches[0]].set()
                assert go[batches[0]].wait(30)
            if 3 in batches:
                raise OSError("disk gone")
            return [b * 10 for b in batches]

        group: GroupCommit[int, int] = GroupCommit(commit, lambda results: None)
        got: dict[int, object] = {}

        def call(b: int) -> None:
            try:
                got[b] = group.submit(b)
            except OSError as exc:
                got[b] = str(exc)

        for blocker, pair in ((0, (1, 2)), (5, (3, 4))):
            if not queued:
                for b in (blocker, *pair):
                    call(b)
                continue
            threads = [threading.Thread(target=call, args=(blocker,))]
            threads[0].start()
            assert held[blocker].wait(30)
            threads += [threading.Thread(target=call, args=(b,)) for b in pair]
            for t in threads[1:]:
                t.start()
            for _ in range(3000):  # both queue behind the blocker's commit
                if sum(1 for t in group._waiting if not t.taken) == len(pair):
                    break
                threading.Event().wait(0.01)
            go[blocker].set()
            for t in threads:
                t.join(30)
        return calls, got, (group.groups, group.batches)

    tickets.clear()
    lone_calls, lone_got, lone_counts = run(queued=False)
    assert tickets == []  # every call took the lone path
    assert lone_calls == [[0], [1], [2], [5], [3], [4]] and lone_counts == (6, 6)
    queued_calls, queued_got, queued_counts = run(queued=True)
    assert sorted(tickets) == [1, 2, 3, 4]  # these went through the queue
    assert [sorted(c) for c in queued_calls] == [[0], [1, 2], [5], [3, 4]] and queued_counts == (4, 6)
    # The same result per batch, except that a failed group fails every batch in it.
    assert lone_got == {0: 0, 1: 10, 2: 20, 5: 50, 3: "disk gone", 4: 40}
    assert queued_got == {**lone_got, 4: "disk gone"}
