"""A ``file`` tier job's records read two at a time, by the caller and a second core
(:func:`kvtier.records.xxcopy.xxh3_pair_reads`), against the same job read by the caller alone:
the same hits, bytes, misses, deletions, counters, answers and errors, whatever the records
(sound, damaged in the middle of a job, truncated, absent, symlinked) and the job's size."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_file_plain_reads import FMT, _copy, _damaged_store, _open, _record

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.errors import ClosedError, InvalidKeyError, LayoutError
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block

pytestmark = pytest.mark.skipif(xxcopy.xxh3_pair_reads is None or xxcopy.xxh3_read_job is None, reason="built without the native job read")
_JOB = xxcopy.xxh3_read_job
_STATS = ("blocks_read", "read_misses", "corrupt_records", "deleted", "bytes_read")


@pytest.fixture
def pairing() -> Iterator[Any]:
    """``set(on)``: every job of two records or more shared with the second core (``on``), or
    none; the length at import is put back after the test."""
    assert xxcopy.xxh3_pair_reads is not None
    was = xxcopy.xxh3_pair_reads(0)
    try:
        yield lambda on: xxcopy.xxh3_pair_reads(1 if on else 0)  # type: ignore[misc]
    finally:
        xxcopy.xxh3_pair_reads(was)


def _answers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What each call of the one native job read answered, in order."""
    real = _JOB
    answers: list[Any] = []

    def recorded(*args: Any) -> Any:
        assert real is not None
        got = real(*args)
        answers.append((list(got[0]), list(got[1])) if isinstance(got, tuple) else None if got is None else list(got))
        return got

    monkeypatch.setattr(xxcopy, "xxh3_read_job", recorded)
    return answers


def _read_jobs(root: Path, jobs: list[list[bytes]], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """Each job read from the store at root, its rows viewed by a first job of absent keys:
    (hits, rows, counters, files left, the native call's answers)."""
    answers = _answers(monkeypatch)
    backend = _open(root)
    found, rows = [], []
    try:
        for keys in jobs:
            out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
            assert backend.read_blocks([make_key(500 + i) for i in range(len(out))], out) == [False] * len(out)
            found.append(backend.read_blocks(keys, out))
            rows.append(out)
        stats = {k: v for k, v in backend.stats().items() if k in _STATS}
    finally:
        asyncio.run(backend.aclose())
    files = sorted(str(p.relative_to(root.parent)) for p in root.parent.rglob("*") if p.is_file() or p.is_symlink())
    return found, rows, stats, files, answers


def test_a_shared_job_finds_drops_and_counts_what_the_job_read_alone_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pairing: Any) -> None:
    """Sound, flipped (a hash that fails in the middle of the job), bad magic, truncated,
    compressed, a byte long, symlinked and absent records, in jobs of 1, 2, 10 and 17 records:
    shared with the second core or not, every hit, byte, miss, deletion, counter and answer is
    the same, and only the sound records are hits."""
    keys, data = _damaged_store(tmp_path / "a" / "store", tmp_path / "a" / "outside")
    _copy(tmp_path / "a", tmp_path / "b")
    extra = [make_key(40 + i) for i in range(7)]  # absent: a job of 17 with the damaged ones in its middle
    jobs = [keys[:1], keys[8:9], keys[:2], [keys[8], keys[0]], keys, extra[:4] + keys + extra[4:], keys[::-1]]
    pairing(False)
    alone = _read_jobs(tmp_path / "a" / "store", jobs, monkeypatch)
    pairing(True)
    shared = _read_jobs(tmp_path / "b" / "store", jobs, monkeypatch)
    assert shared[0] == alone[0]
    hits = [True, False, False, False, False, True, False, False, True, False]  # (5: the general read's zstd)
    assert alone[0][4] == hits and alone[0][5] == [False] * 4 + hits + [False] * 3
    for job, found, a_rows, s_rows in zip(jobs, alone[0], alone[1], shared[1]):
        for key, hit, a, s in zip(job, found, a_rows, s_rows):
            assert torch.equal(a, s)
            if hit:
                assert torch.equal(s, data[keys.index(key)])
    assert shared[2] == alone[2] and alone[2]["corrupt_records"] == 4
    assert shared[3] == alone[3]
    assert shared[4] == alone[4]


def test_jobs_of_sound_records_shared_read_every_byte_and_the_second_core_takes_some(tmp_path: Path, pairing: Any) -> None:
    """Jobs of 2 and 17 records of 256 KiB, shared: every row holds its record; over enough jobs
    the second core reads some of them (it is woken once a job and takes records from the same
    counter), and each job's records are counted once."""
    assert xxcopy.xxh3_pair_count is not None
    size = 262144
    backend = registry.backends.get("file")(capacity=64 << 20, path=str(tmp_path / "store"), sync_mode="fast", layout="flat")
    asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8")))
    keys = [make_key(i) for i in range(17)]
    data = [random_block(size, 300 + i) for i in range(17)]
    rows = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
    pairing(True)
    try:
        backend.write_blocks(keys, data)
        before, reads = xxcopy.xxh3_pair_count(), 0
        for _ in range(400):
            for job in (slice(0, 2), slice(0, 17)):
                for row in rows[job]:
                    row.zero_()
                assert backend.read_blocks(keys[job], rows[job]) == [True] * len(keys[job])
                assert all(torch.equal(r, d) for r, d in zip(rows[job], data[job]))
                reads += len(keys[job])
            if xxcopy.xxh3_pair_count() > before:
                break
        assert xxcopy.xxh3_pair_count() > before
        assert backend.stats()["blocks_read"] == reads
    finally:
        asyncio.run(backend.aclose())


def test_a_shared_job_refuses_what_a_job_alone_refuses(tmp_path: Path, pairing: Any) -> None:
    """Bad keys, rows of the wrong shape, a row short and a closed tier are refused by name,
    shared or not."""
    keys = [make_key(i) for i in range(3)]
    data = [random_block(FMT.block_bytes, 700 + i) for i in range(3)]
    backend = _open(tmp_path / "store")
    rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    errors: dict[bool, list[str]] = {}
    try:
        backend.write_blocks(keys, data)
        for on in (False, True):
            pairing(on)
            got = errors.setdefault(on, [])
            assert backend.read_blocks(keys, rows) == [True] * 3 and all(torch.equal(r, d) for r, d in zip(rows, data))
            for bad_keys, bad_rows, error in (
                ([keys[0], b"\x00" * 31, keys[2]], rows, InvalidKeyError),
                (keys, [rows[0], rows[1][:100], rows[2]], LayoutError),
                (keys, [rows[0], rows[1].view(torch.int16), rows[2]], LayoutError),
                (keys, rows[:2], LayoutError),
            ):
                with pytest.raises(error) as caught:
                    backend.read_blocks(bad_keys, bad_rows)
                got.append(str(caught.value))
    finally:
        asyncio.run(backend.aclose())
    assert errors[True] == errors[False] and "keys[1]" in errors[True][0] and "blocks[1]" in errors[True][1]
    for on in (False, True):
        pairing(on)
        with pytest.raises(ClosedError):
            backend.read_blocks(keys, rows)


def test_the_low_level_job_read_answers_the_same_shared_or_not(tmp_path: Path, pairing: Any) -> None:
    """``xxh3_read_check_keys`` of a damaged store's keys: the same positions left to the general
    read, the same found list and bytes; a truncated or flipped record is never a hit."""
    keys, data = _damaged_store(tmp_path / "a" / "store", tmp_path / "a" / "outside")
    backend = _open(tmp_path / "a" / "store")
    try:
        plain = backend._plain  # type: ignore[attr-defined]
        assert plain is not None and xxcopy.xxh3_read_check_keys is not None
        outcomes = []
        for on in (False, True):
            pairing(on)
            out = [bytearray(FMT.block_bytes) for _ in keys]
            found = [False] * len(keys)
            rest = xxcopy.xxh3_read_check_keys(plain.root.dir_at, plain.checksum.head, keys, out, plain.piece, found)
            outcomes.append((rest, found, out))
        assert outcomes[0] == outcomes[1]
        assert outcomes[1][1] == [True, False, False, False, False, False, False, False, True, False]
        assert bytes(outcomes[1][2][0]) == data[0].numpy().tobytes()
        assert os.path.exists(_record(tmp_path / "a" / "store", keys[2], "flat"))  # (nothing deleted at this level)
    finally:
        asyncio.run(backend.aclose())


def test_the_lengths_are_checked() -> None:
    assert xxcopy.xxh3_pair_reads is not None
    with pytest.raises(ValueError, match="min_bytes: expected a count of bytes >= 0, got -1"):
        xxcopy.xxh3_pair_reads(-1)
    with pytest.raises(TypeError):
        xxcopy.xxh3_pair_reads("1")  # type: ignore[arg-type]


_FORKED = """
import asyncio, os, sys, torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
size = 65536
backend = registry.backends.get("file")(capacity=16 << 20, path=sys.argv[1], sync_mode="fast", layout="flat")
asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8")))
keys = [make_key(i) for i in range(8)]
data = [random_block(size, 10 + i) for i in range(8)]
backend.write_blocks(keys, data)
want = [d.numpy().tobytes() for d in data]
rows = [torch.zeros(size, dtype=torch.uint8) for _ in keys]  # (made before the fork: torch's own calls may hang in a child)
views = [r.numpy() for r in rows]
xxcopy.xxh3_pair_reads(1)

def jobs(n):
    for _ in range(n):
        for v in views:
            v.fill(0)
        if backend.read_blocks(keys, rows) != [True] * 8 or [v.tobytes() for v in views] != want:
            return False
    return True

assert jobs(20)  # the worker started in the parent
pid = os.fork()
if pid == 0:
    os._exit(0 if jobs(50) else 3)  # no worker in the child: its jobs still read every record
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), jobs(20))
"""


def test_a_child_of_fork_reads_shared_jobs_whole(tmp_path: Path) -> None:
    """The worker thread does not survive a fork: the child's shared jobs start a new one and
    read every record (run in a child process: a lost worker would hang it)."""
    child = subprocess.run([sys.executable, "-c", _FORKED, str(tmp_path / "store")], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["0", "True"], child.stdout
