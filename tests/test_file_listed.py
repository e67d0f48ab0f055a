"""The keys a ``file`` tier listed at open, left in the table of records the open took
(``backends/file_listed.py``), against the same keys held in memory: the same answers, stamps
and tables written, through a tier's reopens; and a table that can no longer be read is a
logged miss of the accounting, never an error."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest
from kvtier.backends import file_listed, file_table
from kvtier.backends.file_known import KnownRecords
from kvtier.backends.file_listed import ListedInMemory, ListedOnDisk
from kvtier.backends.file_table import TABLE_NAME, take_table, write_table

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=4096, dtype="bfloat16", namespace={"model_id": "m"})


def _awkward_keys(rng: random.Random) -> list[bytes]:
    """Digests, keys sharing all but their last byte, and three keys where the last one also
    stands across the bytes of the first two (so a scan for it meets it out of place first)."""
    keys = {rng.randbytes(32) for _ in range(300)}
    keys |= {b"\x07" * 31 + bytes([i]) for i in range(0, 256, 5)}
    keys |= {b"\x01" * 16 + b"\x05" * 16, b"\x01" * 16 + b"\x05" * 15 + b"\x06", b"\x05" * 16 + b"\x01" * 16}
    return sorted(keys)


def _on_disk(tmp_path: Path, keys: list[bytes], stamps: np.ndarray) -> ListedOnDisk:
    """``keys`` and ``stamps`` left in a table written and taken as a tier's close and open do."""
    write_table(str(tmp_path), keys, np.full(len(keys), 4096), stamps, durable=False, temp=str(tmp_path / "t.tmp"))
    table = take_table(str(tmp_path))
    assert table is not None and not (tmp_path / TABLE_NAME).exists()
    known = KnownRecords()
    try:
        table.adopt(known)
    finally:
        table.close()
    listed = known._listed
    assert isinstance(listed, ListedOnDisk)
    known._listed = ListedInMemory([], np.empty(0))  # handed to the caller, not closed with known
    return listed


@pytest.mark.parametrize("run", [1, 3, 128])
def test_keys_left_in_the_table_are_found_as_in_the_sorted_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: int) -> None:
    monkeypatch.setattr(file_listed, "RUN", run)
    monkeypatch.setattr(file_table, "RUN", run)
    rng = random.Random(5)
    keys = _awkward_keys(rng)
    stamps = np.array([rng.uniform(0, 1e6) for _ in keys])
    disk, memory = _on_disk(tmp_path, keys, stamps), ListedInMemory(list(keys), stamps.copy())
    try:
        assert len(disk) == len(memory) == len(keys) and len(disk.firsts) == -(-len(keys) // run)
        misplaced = keys[0][16:] + keys[1][:16]  # stands across the first two keys only
        probes = [*keys, misplaced, b"\x00" * 32, b"\xff" * 32, *(rng.randbytes(32) for _ in range(300))]
        probes += [k[:31] + bytes([k[31] ^ 1]) for k in keys]  # a neighbour of every key
        for key in probes + probes[::-1]:  # a key asked again answers from the last find too
            assert disk.find(key) == memory.find(key), key
        assert disk.find(keys[-1]) == len(keys) - 1 and disk.find(misplaced) == -1
        for i in rng.sample(range(len(keys)), 40):
            stamp = rng.uniform(0, 2e6)
            disk.touch(i, stamp)
            memory.touch(i, stamp)
        assert disk.packed_keys().tobytes() == memory.packed_keys().tobytes() == b"".join(keys)
        assert disk.stamps_now().tolist() == memory.stamps_now().tolist()
    finally:
        disk.close()


def _run_ops(known: KnownRecords, keys: list[bytes], seed: int) -> list[object]:
    """A random schedule of gets, writes, touches and deletes over listed and other keys, and
    every answer it got."""
    rng = random.Random(seed)
    answers: list[object] = []
    for step in range(4000):
        key = keys[rng.randrange(len(keys))] if rng.random() < 0.7 else make_key(10_000 + rng.randrange(400))
        op = rng.randrange(4)
        if op == 0:
            answers.append(known.get(key, -1))
        elif op == 1:
            known.set(key, rng.choice((4096, 12288)))
        elif op == 2:
            known.touch(key, float(step))
        else:
            answers.append(known.pop(key, -1))
        answers.append(len(known))
    return answers


def test_known_records_over_the_table_answer_and_save_as_over_the_list_in_memory(tmp_path: Path) -> None:
    """The general path (the listing in memory) and the table's file: the same answers to the
    same schedule, and the same columns for the next table (keys, sizes, stamps)."""
    rng = random.Random(9)
    keys = _awkward_keys(rng)
    stamps = np.array([rng.uniform(0, 1e6) for _ in keys])
    memory, disk = KnownRecords(), KnownRecords()
    memory.adopt(list(keys), np.full(len(keys), 4096), stamps)
    disk.adopt_listed(_on_disk(tmp_path, keys, stamps), 4096)
    try:
        assert _run_ops(disk, keys, 3) == _run_ops(memory, keys, 3)
        files = {make_key(10_000 + i): float(i) for i in range(0, 400, 3)}  # records written since, still there
        got, want = disk.columns(files.get), memory.columns(files.get)
        assert got[0].tobytes() == want[0].tobytes() and len(got[0]) > 40
        assert got[1].tolist() == want[1].tolist() and got[2].tolist() == want[2].tolist()
    finally:
        disk.clear()


def _tier(root: Path) -> object:
    backend = registry.backends.get("file")(capacity=16 << 20, path=str(root), sync_mode="fast")
    asyncio.run(backend.open(FMT))
    return backend


def _history(root: Path, keys: list[bytes], form: type) -> list[tuple[bytes, int, float]]:
    """Open the store under ``root`` (its listed keys held in ``form``), use it (deletes,
    touches, a write of a listed key and of a new one), close it, reopen it: the records the
    first open lists, the bytes in use, and the records the second lists, oldest first."""
    backend = _tier(root)
    listed = backend._sizes._listed  # type: ignore[attr-defined]
    assert type(listed) is form
    if form is ListedOnDisk:  # under one key object in RUN of its own
        assert len(listed.firsts) == -(-len(keys) // file_listed.RUN)
    columns = backend.scan_columns()  # type: ignore[attr-defined]
    first = list(columns)
    backend.delete_blocks(keys[:5])  # type: ignore[attr-defined]
    backend.touch_stamps([(k, 2_000_000.0 - i) for i, k in enumerate(keys[10:40])])  # type: ignore[attr-defined]
    backend.write_blocks([keys[50], make_key(999)], [random_block(FMT.block_bytes, 1)] * 2)  # type: ignore[attr-defined]
    backend.touch_stamps([(keys[50], 3_000_000.0), (make_key(999), 2_500_000.0)])  # type: ignore[attr-defined]
    used = backend.stats()["used_bytes"]  # type: ignore[attr-defined]
    asyncio.run(backend.aclose())  # type: ignore[attr-defined]
    again = _tier(root)
    try:
        return [*first, ("used", used, 0.0), *again.scan_columns()]  # type: ignore[attr-defined]
    finally:
        asyncio.run(again.aclose())  # type: ignore[attr-defined]


@pytest.mark.parametrize("walk", [False, True])
def test_a_tier_reopened_keeps_the_listed_keys_on_disk_and_lists_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, walk: bool) -> None:
    """Two copies of one closed store, reopened and used the same way: with the listed keys
    left in the table's file (or, with no table, in a scratch file the walk's open wrote) and
    with them in memory (the general path): the same records, sizes, stamps and order,
    twice."""
    monkeypatch.setattr(file_table, "RUN", 16)
    monkeypatch.setattr(file_listed, "RUN", 16)
    keys = [make_key(i) for i in range(200)]
    backend = _tier(tmp_path / "a")
    backend.write_blocks(keys, [random_block(FMT.block_bytes, i) for i in range(len(keys))])  # type: ignore[attr-defined]
    backend.touch_stamps([(k, 1_000_000.0 + (i % 7)) for i, k in enumerate(keys)])  # ties: the order is the table's
    asyncio.run(backend.aclose())  # type: ignore[attr-defined]
    if walk:
        (tmp_path / "a" / TABLE_NAME).unlink()
    os.system(f"cp -a {tmp_path / 'a'} {tmp_path / 'b'}")
    on_disk = _history(tmp_path / "a", keys, ListedOnDisk)
    monkeypatch.setattr(file_table, "LISTED_ON_DISK", False)
    in_memory = _history(tmp_path / "b", keys, ListedInMemory)
    assert on_disk == in_memory
    assert len(on_disk) == len(keys) + 1 + len(keys) - 5 + 1  # the first open, used, the second
    assert [k for k, *_ in on_disk[-2:]] == [make_key(999), keys[50]] and on_disk[-3][2] == 2_000_000.0


def test_a_table_that_cannot_be_read_back_is_a_logged_miss_and_the_next_open_walks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = [make_key(i) for i in range(40)]
    backend = _tier(tmp_path)
    backend.write_blocks(keys, [random_block(FMT.block_bytes, i) for i in range(len(keys))])  # type: ignore[attr-defined]
    asyncio.run(backend.aclose())  # type: ignore[attr-defined]
    backend = _tier(tmp_path)
    listed = backend._sizes._listed  # type: ignore[attr-defined]
    assert isinstance(listed, ListedOnDisk)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, listed.fd)  # the table's file now reads as empty
    os.close(null)
    with caplog.at_level(logging.WARNING, logger="kvtier.backends.file_tier"):
        assert backend._sizes.get(keys[3], -1) == -1  # type: ignore[attr-defined]
        backend.delete_blocks(keys[:2])  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())  # type: ignore[attr-defined]
    assert sum("cannot be read back" in r.message for r in caplog.records) == 1
    assert any("cannot be written" in r.message for r in caplog.records) and not (tmp_path / TABLE_NAME).exists()
    names = sorted(os.listdir(tmp_path))
    again = _tier(tmp_path)  # the walk's listing goes to a file no name reaches
    try:
        assert sorted(again.scan_columns().keys) == sorted(keys[2:])  # type: ignore[attr-defined]
        assert isinstance(again._sizes._listed, ListedOnDisk) and sorted(os.listdir(tmp_path)) == names  # type: ignore[attr-defined]
        assert again._sizes.get(keys[3]) == 8192 and again._sizes.get(keys[0], -1) == -1  # a record of 4096 and its head, in blocks of 4 KiB  # type: ignore[attr-defined]
    finally:
        asyncio.run(again.aclose())  # type: ignore[attr-defined]


def test_a_walk_whose_keys_cannot_be_written_down_keeps_them_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    keys = [make_key(i) for i in range(40)]
    backend = _tier(tmp_path)
    backend.write_blocks(keys, [random_block(FMT.block_bytes, i) for i in range(len(keys))])  # type: ignore[attr-defined]
    asyncio.run(backend.aclose())  # type: ignore[attr-defined]
    (tmp_path / TABLE_NAME).unlink()

    def full(root: str) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_listed, "_scratch_fd", full)
    with caplog.at_level(logging.WARNING, logger="kvtier.backends.file_tier"):
        again = _tier(tmp_path)
    try:
        assert isinstance(again._sizes._listed, ListedInMemory) and any("stay in memory" in r.message for r in caplog.records)  # type: ignore[attr-defined]
        assert [again._sizes.get(k) for k in keys] == [8192] * len(keys) and len(again._sizes) == len(keys)  # type: ignore[attr-defined]
    finally:
        asyncio.run(again.aclose())  # type: ignore[attr-defined]


def test_a_table_that_fails_one_read_then_reads_again_never_lists_a_key_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of the table's file that fails once (a disk or NFS error that passes): the key
    written and deleted meanwhile stays gone when the reads work again (its bytes counted once,
    never given back twice), and no table is written back from a listing that failed."""
    keys = [make_key(i) for i in range(40)]
    known = KnownRecords()
    known.adopt_listed(_on_disk(tmp_path, sorted(keys), np.zeros(len(keys))), 4096)
    real = os.pread
    failing = {"on": True}

    def pread(fd: int, size: int, at: int) -> bytes:
        if failing["on"]:
            raise OSError(5, "Input/output error")
        return real(fd, size, at)

    monkeypatch.setattr(file_listed.os, "pread", pread)
    try:
        key = keys[7]
        assert known.get(key, 0) == 0  # not listed while the table cannot be read
        known.set(key, 4096)  # written meanwhile (grows the bytes in use by all of its size)
        assert known.pop(key, 0) == 4096  # and deleted (gives all of it back)
        failing["on"] = False
        assert known.get(key, 0) == 0, "a key deleted since came back once the table read again"
        assert known.pop(key, 0) == 0  # its bytes are not given back a second time
        with pytest.raises(OSError):
            known.columns(lambda k: None)  # a table from it could name keys no longer there
    finally:
        known.clear()


@pytest.mark.parametrize("shared", [False, True])
def test_an_open_that_fails_after_taking_the_table_keeps_no_descriptor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    """An open that fails after it took the table (its shard directories cannot be made: a
    full or read-only disk) raises a clear error and holds no descriptor, neither the unlinked
    table's nor the root's, and (shared) follows the directory no more: the store closes only
    the tiers that opened."""
    from kvtier.backends import file_tier

    from kvtier.errors import DiskError

    backend = _tier(tmp_path)
    backend.write_blocks([make_key(i) for i in range(8)], [random_block(FMT.block_bytes, i) for i in range(8)])  # type: ignore[attr-defined]
    asyncio.run(backend.aclose())  # type: ignore[attr-defined]
    assert (tmp_path / TABLE_NAME).exists()

    def refuse(self: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(file_tier.ShardDirs, "make_top", refuse)
    fds = set(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    again = registry.backends.get("file")(capacity=16 << 20, path=str(tmp_path), sync_mode="fast", shared=shared)
    with pytest.raises(DiskError, match="Read-only"):
        asyncio.run(again.open(FMT))
    assert again.follower is None and threading.active_count() == threads  # type: ignore[attr-defined]
    left = {fd for fd in set(os.listdir("/proc/self/fd")) - fds if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not left, [os.readlink(f"/proc/self/fd/{fd}") for fd in left]


def test_a_scratch_listing_stopped_midway_closes_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk's listing whose scratch file is stopped while written (memory refused, an
    interrupt) lets its descriptor go before the error goes up."""
    keys = sorted(make_key(i) for i in range(20))
    calls = []

    def stop(fd: int, data: object) -> None:
        calls.append(fd)
        raise MemoryError("refused")

    monkeypatch.setattr(file_listed, "_write_all", stop)
    with pytest.raises(MemoryError):
        file_listed.scratch_listing(str(tmp_path), keys, np.zeros(len(keys)))
    assert calls
    with pytest.raises(OSError):
        os.fstat(calls[0])  # closed (nothing opened since could have taken its number)
