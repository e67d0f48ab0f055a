"""The ``file`` tier's flat job in one native call from its checks to its counters
(:func:`kvtier.records.xxcopy.xxh3_read_job`, taken by ``read_blocks``) against the general read
and the tier's other plain reads: the same hits, bytes, misses, deletions, counters and errors,
whatever the records (sound, damaged, truncated, absent, symlinked) and the rows."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_tier
from test_file_plain_reads import FMT, _copy, _damaged_store
from test_file_row_jobs import _Dispatched
from test_lmdb_row_storage import _PassThrough

from kvtier import devices, registry
from kvtier.backend import Backend, BackendCounters
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block

pytestmark = pytest.mark.skipif(xxcopy.xxh3_read_job is None, reason="built without the native job read")
_JOB = xxcopy.xxh3_read_job
_STATS = ("blocks_read", "read_misses", "corrupt_records", "deleted", "bytes_read")


def _open(path: Path) -> Backend:
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(path), sync_mode="fast", layout="flat")
    asyncio.run(backend.open(FMT))
    return backend


def _job_calls(monkeypatch: pytest.MonkeyPatch, *, on: bool = True) -> list[Any]:
    """``xxh3_read_job`` as it is (``on``) or set aside (``None``: the tier's other paths); the
    list returned holds what each of its calls answered."""
    real = _JOB
    answers: list[Any] = []

    def recorded(*args: Any) -> Any:
        assert real is not None
        got = real(*args)
        answers.append(copy.deepcopy(got))  # (as answered: the general read fills in a found list handed to it)
        return got

    monkeypatch.setattr(xxcopy, "xxh3_read_job", recorded if on else None)
    return answers


def _viewed(path: Path, keys: list[bytes], saved: int, seed: int) -> tuple[Backend, list[torch.Tensor], list[torch.Tensor]]:
    """A store with the first ``saved`` of ``keys`` written, and a row for each key, zeroed once
    a job of them all read by the job's checks kept their views: (store, saved data, rows)."""
    backend = _open(path)
    data = [random_block(FMT.block_bytes, seed + i) for i in range(saved)]
    rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    backend.write_blocks(keys[:saved], data)
    assert backend.read_blocks(keys, rows) == [True] * saved + [False] * (len(keys) - saved)  # (new rows: the job's checks)
    for row in rows:
        row.zero_()
    return backend, data, rows


def _read_damaged(root: Path, keys: list[bytes], *, plain: bool, job: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """The damaged store read one key at a time twice, then as one job, with plain reads on or
    off and the one call on or off: (hits, rows, counters, files left, the call's answers)."""
    monkeypatch.setattr(file_tier, "PLAIN_READS", plain)
    answers = _job_calls(monkeypatch, on=job)
    backend = _open(root)
    out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
    try:  # a job of absent keys first keeps the rows' views
        assert backend.read_blocks([make_key(100 + i) for i in range(len(out))], out) == [False] * len(out)
        found = [[backend.read_blocks([key], [row])[0] for key, row in zip(keys, out)] for _ in range(2)]
        found.append(backend.read_blocks(keys, out))
        stats = {k: v for k, v in backend.stats().items() if k in _STATS}
    finally:
        asyncio.run(backend.aclose())
    files = sorted(str(p.relative_to(root.parent)) for p in root.parent.rglob("*") if p.is_file() or p.is_symlink())
    return found, out, stats, files, answers


def test_the_jobs_one_call_finds_drops_and_counts_what_the_general_read_and_the_other_plain_reads_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sound, flipped, bad magic, truncated, compressed, a byte long, symlinked and absent
    records: the one call, the tier's other plain reads and the general read agree on every
    hit, byte, miss, deletion and counter; the call counts the jobs it served whole and leaves
    the damaged records, uncounted, to the general read."""
    keys, data = _damaged_store(tmp_path / "a" / "store", tmp_path / "a" / "outside")
    for name in ("b", "c"):
        _copy(tmp_path / "a", tmp_path / name)
    general = _read_damaged(tmp_path / "a" / "store", keys, plain=False, job=False, monkeypatch=monkeypatch)
    other = _read_damaged(tmp_path / "b" / "store", keys, plain=True, job=False, monkeypatch=monkeypatch)
    job = _read_damaged(tmp_path / "c" / "store", keys, plain=True, job=True, monkeypatch=monkeypatch)
    hits = [True, False, False, False, False, True, False, False, True, False]
    assert general[0] == [hits, hits, hits]
    assert other[0] == job[0] == general[0]
    for i, hit in enumerate(hits):
        if hit:
            assert torch.equal(general[1][i], data[i]) and torch.equal(job[1][i], data[i])
    assert job[2] == other[2] == general[2] and general[2]["corrupt_records"] == 4
    assert job[3] == other[3] == general[3]
    assert general[4] == other[4] == []
    lone = job[4][1:21]  # the jobs of one key (the first answer: the job of absent keys, whose rows were new)
    assert job[4][0] is None
    # sound (0, 8) and absent (1) records whole; the damaged, compressed and symlinked ones left to the general read
    first = [[True], [False], ([False], [0]), ([False], [0]), ([False], [0]), ([False], [0]), ([False], [0]), ([False], [0]), [True], ([False], [0])]
    assert lone[:10] == first
    assert lone[10:] == [[True], [False], [False], [False], [False], ([False], [0]), [False], ([False], [0]), [True], ([False], [0])]
    assert job[4][21] == ([True, False, False, False, False, False, False, False, True, False], [5, 7, 9])


def test_the_jobs_one_call_counts_each_record_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = _job_calls(monkeypatch)
    keys = [make_key(i) for i in range(6)]
    backend, data, rows = _viewed(tmp_path / "store", keys, 4, 70)
    try:
        before = dict(backend.stats())
        assert backend.read_blocks(keys, rows) == [True] * 4 + [False] * 2
        assert backend.read_blocks(keys[:1], rows[:1]) == [True] and backend.read_blocks(keys[5:], rows[5:]) == [False]
        after = backend.stats()
    finally:
        asyncio.run(backend.aclose())
    assert answers[0] is None and answers[1:] == [[True] * 4 + [False] * 2, [True], [False]]
    assert all(torch.equal(r, d) for r, d in zip(rows, data))
    assert after["blocks_read"] - before["blocks_read"] == 5 and after["bytes_read"] - before["bytes_read"] == 5 * FMT.block_bytes
    assert after["read_misses"] - before["read_misses"] == 3


@pytest.mark.parametrize("mode", [_PassThrough, _Dispatched, "locate"])
def test_with_python_in_torch_or_a_device_map_the_one_call_reads_nothing_and_the_job_reads_as_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: Any
) -> None:
    """Under a torch function or dispatch mode (whose handler may free a row whose view is
    taken), or with a stand-in device map, the one call answers ``None`` before any row's
    check; the job's general checks read it with the same hits and bytes."""
    answers = _job_calls(monkeypatch)
    keys = [make_key(i) for i in range(3)]
    backend, data, rows = _viewed(tmp_path / "store", keys, 2, 90)
    try:
        if mode == "locate":
            monkeypatch.setattr(devices, "locate", lambda tensor: tensor.device)
            found = [backend.read_blocks(keys, rows), backend.read_blocks(keys[:1], rows[:1])]
        else:
            with mode():
                found = [backend.read_blocks(keys, rows), backend.read_blocks(keys[:1], rows[:1])]
    finally:
        asyncio.run(backend.aclose())
    assert answers == [None, None, None]
    assert found == [[True, True, False], [True]]
    assert all(torch.equal(r, d) for r, d in zip(rows, data))


def test_a_job_of_one_under_a_dispatch_mode_takes_the_jobs_checks_as_a_job_of_several_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-record straight line (``PlainReads.read_one``) and the plain read of rows not
    viewed yet ask what the job from its rows' checks asks: a torch function or dispatch mode
    on. Under a dispatch mode the straight line reads nothing; the job reads as without."""
    monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
    backend = _open(tmp_path / "store")
    key = make_key(0)
    data = random_block(FMT.block_bytes, 99)
    row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    try:
        backend.write_blocks([key], [data])
        assert backend.read_blocks([key], [row]) == [True]  # (the row's view kept)
        plain = backend._plain  # type: ignore[attr-defined]
        assert plain is not None
        row.zero_()
        with _Dispatched():
            assert plain.read_one(key, row, backend.counters) is None
            found = [False]
            assert plain.read([key], [row], found) == [0] and found == [False]
            assert not torch.equal(row, data)
            assert backend.read_blocks([key], [row]) == [True]
        assert torch.equal(row, data)
    finally:
        asyncio.run(backend.aclose())


def test_a_child_of_fork_counts_its_jobs_in_the_list_the_one_call_holds(tmp_path: Path) -> None:
    """After a fork the root's count of jobs starts again in place: the list the one call's
    parts hold is the root's own, so a close waits for the child's jobs."""
    backend = _open(tmp_path / "store")
    try:
        plain = backend._plain  # type: ignore[attr-defined]
        assert plain is not None and plain.job_parts is not None
        root = plain.root
        root.under_way.append(None)  # a parent's thread's job, as a child sees it
        root._after_fork()
        assert root.under_way == [] and plain.job_parts[0] is root.under_way
    finally:
        asyncio.run(backend.aclose())


class _SubCounters(BackendCounters):
    """Counters whose slots are their base's: the one call adds to them by getattr and setattr."""

    __slots__ = ()


class _WatchedCounters(BackendCounters):
    """Counters that see each set: the one call's straight slot adds would go past them."""

    __slots__ = ("sets",)

    def __init__(self) -> None:
        object.__setattr__(self, "sets", [])
        super().__init__()

    def __setattr__(self, name: str, value: Any) -> None:
        self.sets.append(name)
        object.__setattr__(self, name, value)


def _jobs_read(root: Path, counters: BackendCounters | None, *, job: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """17 keys (every third absent, key 4 with a flipped payload bit) read as jobs of 1, 2 and
    17, the one call on or off, into rows whose views are kept; (hits, rows, counters, answers)."""
    answers = _job_calls(monkeypatch, on=job)
    keys = [make_key(i) for i in range(17)]
    data = [random_block(FMT.block_bytes, 300 + i) for i in range(17)]
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(root), sync_mode="fast", layout="flat")
    if counters is not None:
        backend.counters = counters
    asyncio.run(backend.open(FMT))
    rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    try:
        backend.write_blocks([k for i, k in enumerate(keys) if i % 3], [d for i, d in enumerate(data) if i % 3])
        raw = bytearray((root / (keys[4].hex() + ".kvb")).read_bytes())
        raw[-7] ^= 0x10
        (root / (keys[4].hex() + ".kvb")).write_bytes(bytes(raw))
        assert backend.read_blocks([make_key(100 + i) for i in range(17)], rows) == [False] * 17  # (the rows' views kept)
        found = [backend.read_blocks(keys[:1], rows[:1]), backend.read_blocks(keys[1:3], rows[1:3]), backend.read_blocks(keys, rows)]
        stats = {k: getattr(backend.counters, k) for k in _STATS}  # (a subclass's as_dict names its own slots alone)
    finally:
        asyncio.run(backend.aclose())
    return found, rows, stats, answers[1:], data


@pytest.mark.parametrize("counters", [None, _SubCounters, _WatchedCounters])
def test_the_jobs_one_call_counts_into_the_tiers_counters_as_the_general_read_does_whatever_their_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counters: type[BackendCounters] | None
) -> None:
    """Jobs of 1, 2 and 17 records (sound, absent, damaged): the one call's counts, added
    straight into the counters' own slots or (a subclass's, one that sees its sets) by getattr
    and setattr, are the general read's, with the same hits and bytes; a job of only hits and
    misses answers its found list, one with a damaged record leaves it to the general read."""
    general = _jobs_read(tmp_path / "a", None, job=False, monkeypatch=monkeypatch)
    mine = counters() if counters is not None else None
    job = _jobs_read(tmp_path / "b", mine, job=True, monkeypatch=monkeypatch)
    hits = [bool(i % 3) and i != 4 for i in range(17)]
    assert general[0] == job[0] == [hits[:1], hits[1:3], hits]
    assert job[2] == general[2] and job[2]["blocks_read"] == 2 + 10 and job[2]["corrupt_records"] == 1
    for i, hit in enumerate(hits):
        if hit or i % 3 == 0:  # read, or absent: the row as it was
            assert torch.equal(job[1][i], general[1][i]) and torch.equal(job[1][i], job[4][i] if hit else torch.zeros(FMT.block_bytes, dtype=torch.uint8))
    assert job[3] == [[False], [True, True], (hits, [4])]
    if isinstance(mine, _WatchedCounters):
        assert mine.sets.count("blocks_read") >= 3 and mine.sets.count("read_misses") >= 2
