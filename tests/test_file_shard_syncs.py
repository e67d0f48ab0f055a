"""A durable ``file`` save in the sharded layout returns only once every directory entry on its
record's path is synced, also where another job, still committing, made its shard directory: a
record is acknowledged only once a power loss cannot take its name away.

The syncs are recorded (the directories synced, by path) and the creating job is held just
before its own directory syncs, so only the second job's syncs can have made its path durable
when it returns."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_commit

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import random_block

FMT = BlockFormat(block_bytes=4096, dtype="bfloat16", namespace={"model_id": "shard-syncs"})


def _open(path: Path) -> Backend:
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(path), layout="sharded")
    asyncio.run(backend.open(FMT))
    return backend


def _key(leaf: bytes, i: int) -> bytes:
    return leaf + bytes([i]) * 30


def _path_of(item: int | str) -> str:
    return os.readlink(f"/proc/self/fd/{item}") if isinstance(item, int) else os.path.realpath(item)


class _Syncs:
    """``file_commit._sync_all`` recorded: the directories each thread's syncs reached (once they
    returned); the thread named ``holder`` waits at its directory syncs until ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dirs: list[str] = []
        self.lock = threading.Lock()
        self.holder: int | None = None
        self.held, self.release = threading.Event(), threading.Event()
        real = file_commit._sync_all

        def sync_all(items: Any, *, data: bool) -> Any:
            if not data and threading.get_ident() == self.holder:
                self.held.set()
                assert self.release.wait(30)
            paths = [_path_of(i) for i in items] if not data else []
            errors = real(items, data=data)
            with self.lock:
                self.dirs.extend(paths)
            return errors

        monkeypatch.setattr(file_commit, "_sync_all", sync_all)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.parametrize("second_job", [1, 2])
def test_a_save_into_a_shard_directory_another_job_just_made_syncs_its_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second_job: int
) -> None:
    root = (tmp_path / "store").resolve()
    backend = _open(root)
    syncs = _Syncs(monkeypatch)
    leaf = b"\x5a\xc3"
    parent = str(root / "5a")
    blocks = [random_block(FMT.block_bytes, i) for i in range(4)]
    done: list[Any] = []

    def first() -> None:
        syncs.holder = threading.get_ident()
        done.append(backend.write_blocks([_key(leaf, 0)], blocks[:1]))

    creator = threading.Thread(target=first)
    creator.start()
    try:
        assert syncs.held.wait(30)  # the shard directory made, its parent's entry not synced yet
        assert (root / "5a" / "c3").is_dir() and parent not in syncs.dirs
        keys = [_key(leaf, 1 + i) for i in range(second_job)]
        assert None not in backend.write_blocks(keys, blocks[1 : 1 + second_job])
        # Acknowledged: the record's name, and its shard directory's name in its parent, are synced.
        assert str(root / "5a" / "c3") in syncs.dirs
        assert parent in syncs.dirs, "acknowledged before the shard directory's entry in its parent was synced"
    finally:
        syncs.release.set()
        creator.join(30)
    assert done and None not in done[0]
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(1 + second_job)]
    assert backend.read_blocks([_key(leaf, i) for i in range(1 + second_job)], out) == [True] * (1 + second_job)
    assert all(torch.equal(o, b) for o, b in zip(out, blocks))
    asyncio.run(backend.aclose())


def test_a_shard_directory_synced_into_its_parent_is_not_synced_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the job that made a shard directory has synced its parent, later saves there sync
    the shard directory alone (the parent's sync is paid once, by the first commit)."""
    root = (tmp_path / "store").resolve()
    backend = _open(root)
    syncs = _Syncs(monkeypatch)
    leaf = b"\x11\x22"
    blocks = [random_block(FMT.block_bytes, i) for i in range(3)]
    assert None not in backend.write_blocks([_key(leaf, 0)], blocks[:1])
    assert syncs.dirs.count(str(root / "11")) == 1
    syncs.dirs.clear()
    assert None not in backend.write_blocks([_key(leaf, 1), _key(leaf, 2)], blocks[1:])
    assert syncs.dirs == [str(root / "11" / "22")]
    asyncio.run(backend.aclose())


def test_a_directory_made_by_a_walk_that_failed_below_it_is_synced_by_the_next_save_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walk that makes a shard's first-level directory (the open made them all; this one went
    missing since), then fails to make the shard directory below it (a full disk, say), fails its save; the first-level directory stays, its entry in the
    root never synced. The next save through it makes the shard directory and syncs its entry,
    and also the first-level directory's entry in the root: else it is acknowledged with a path a
    power loss can take away."""
    root = (tmp_path / "store").resolve()
    backend = _open(root)
    syncs = _Syncs(monkeypatch)
    leaf = b"\x6b\xd4"
    blocks = [random_block(FMT.block_bytes, i) for i in range(2)]
    real_mkdir = os.mkdir
    os.rmdir(root / "6b")  # (made empty by the open)

    def full(path: Any, *args: Any, **kwargs: Any) -> None:
        if path == "d4":
            raise OSError(28, "No space left on device", path)
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", full)
    assert backend.write_blocks([_key(leaf, 0)], blocks[:1]) == [None]
    monkeypatch.setattr(os, "mkdir", real_mkdir)
    assert (root / "6b").is_dir() and not (root / "6b" / "d4").exists()
    syncs.dirs.clear()
    assert None not in backend.write_blocks([_key(leaf, 1)], blocks[1:])
    assert str(root / "6b") in syncs.dirs and str(root / "6b" / "d4") in syncs.dirs
    assert str(root) in syncs.dirs, "acknowledged before the first-level directory's entry in the root was synced"
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8)]
    assert backend.read_blocks([_key(leaf, 1)], out) == [True] and torch.equal(out[0], blocks[1])
    asyncio.run(backend.aclose())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_commit_leaves_unsynced_a_shard_directory_made_after_its_parent_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's commit syncs the parent of the shard directory it made, then marks that parent's
    new entries synced. Another job may make a second shard directory in the same parent after
    that sync and before the mark: its entry is not covered by the sync, so the mark must not
    take it off the list. Else a third save into that second directory, made while its own
    maker still commits, syncs only below it and is acknowledged with a path a power loss can
    take away."""
    from kvtier.backends.file_root import ShardDirs

    root = (tmp_path / "store").resolve()
    backend = _open(root)
    syncs = _Syncs(monkeypatch)
    parent = str(root / "3c")
    first_key, second_key, third_key = _key(b"\x3c\x01", 0), _key(b"\x3c\x02", 0), _key(b"\x3c\x02", 1)
    blocks = [random_block(FMT.block_bytes, i) for i in range(3)]
    marking, mark = threading.Event(), threading.Event()
    first_thread: list[int] = []
    real_synced = ShardDirs.synced

    def synced(self: ShardDirs, *args: Any) -> None:
        if first_thread and threading.get_ident() == first_thread[0]:
            marking.set()  # its directory syncs returned, its mark not made yet
            assert mark.wait(30)
        real_synced(self, *args)

    monkeypatch.setattr(ShardDirs, "synced", synced)
    done: dict[str, Any] = {}

    def first() -> None:
        first_thread.append(threading.get_ident())
        done["first"] = backend.write_blocks([first_key], blocks[:1])

    def second() -> None:
        syncs.holder = threading.get_ident()
        done["second"] = backend.write_blocks([second_key], blocks[1:2])

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    try:
        assert marking.wait(30) and parent in syncs.dirs  # the first job's parent synced
        threads[1].start()
        assert syncs.held.wait(30)  # the second shard directory made, its entry in the parent not synced
        assert (root / "3c" / "02").is_dir()
        mark.set()
        threads[0].join(30)
        assert "first" in done
        syncs.dirs.clear()
        assert backend.write_blocks([third_key], blocks[2:]) != [None]
        assert str(root / "3c" / "02") in syncs.dirs
        assert parent in syncs.dirs, "acknowledged before the shard directory's entry in its parent was synced"
    finally:
        mark.set()
        syncs.release.set()
        for thread in threads:
            if thread.ident is not None:
                thread.join(30)
    assert None not in done["first"] and None not in done["second"]
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(3)]
    assert backend.read_blocks([first_key, second_key, third_key], out) == [True] * 3
    assert all(torch.equal(o, b) for o, b in zip(out, blocks))
    asyncio.run(backend.aclose())
