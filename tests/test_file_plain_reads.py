"""The ``file`` tier's one-pass read of plain records (:mod:`kvtier.backends.file_reads`) against
its general read: the same bytes, misses, deletions and counters, and no symlink followed."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_reads, file_tier

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ClosedError, InvalidKeyError, LayoutError
from kvtier.records import xxcopy
from kvtier.records.format import record_checksum
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


def _open(path: Path, **options: Any) -> Backend:
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(path), sync_mode="fast", **options)
    asyncio.run(backend.open(FMT))
    return backend


def _record(root: Path, key: bytes, layout: str) -> Path:
    h = key.hex()
    return root / f"{h}.kvb" if layout == "flat" else root / h[:2] / h[2:4] / f"{h}.kvb"


def _damaged_store(root: Path, outside: Path, layout: str = "flat") -> tuple[list[bytes], list[torch.Tensor]]:
    """Ten keys: 0 and 8 sound; 1 absent; 2 a flipped payload bit; 3 a bad magic; 4 truncated;
    5 compressed; 6 with a byte too many; 7 behind a symlinked shard directory (a sound record
    outside the root; in the flat layout, a symlink to it); 9 a symlink to a sound record outside
    the root."""
    keys = [make_key(i) for i in range(10)]
    data = [random_block(FMT.block_bytes, 900 + i) for i in range(10)]
    data[5] = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    backend = _open(root, layout=layout)
    backend.write_blocks([keys[i] for i in (0, 2, 3, 4, 6, 7, 8, 9)], [data[i] for i in (0, 2, 3, 4, 6, 7, 8, 9)])
    asyncio.run(backend.aclose())
    zstd = _open(root, codec={"name": "zstd", "level": 1})
    zstd.write_blocks([keys[5]], [data[5]])
    asyncio.run(zstd.aclose())
    raw = bytearray(_record(root, keys[2], layout).read_bytes())
    raw[-100] ^= 0x20
    _record(root, keys[2], layout).write_bytes(bytes(raw))
    raw = bytearray(_record(root, keys[3], layout).read_bytes())
    raw[0] ^= 0x01
    _record(root, keys[3], layout).write_bytes(bytes(raw))
    os.truncate(_record(root, keys[4], layout), _record(root, keys[4], layout).stat().st_size - 1)
    with open(_record(root, keys[6], layout), "ab") as f:
        f.write(b"x")
    outside.mkdir()
    for i in (7, 9):
        (outside / _record(root, keys[i], layout).name).write_bytes(_record(root, keys[i], layout).read_bytes())
    if layout == "sharded":
        shard = _record(root, keys[7], layout).parent
        shutil.rmtree(shard)
        shard.symlink_to(outside, target_is_directory=True)
    for i in (7, 9) if layout == "flat" else (9,):
        _record(root, keys[i], layout).unlink()
        _record(root, keys[i], layout).symlink_to(outside / _record(root, keys[i], layout).name)
    return keys, data


def _copy(src: Path, dst: Path) -> None:
    """A copy of a damaged store and its outside, the copied symlinks pointing into the copy's own outside."""
    shutil.copytree(src, dst, symlinks=True)
    for link in dst.rglob("*"):
        if link.is_symlink():
            target = os.readlink(link)
            link.unlink()
            link.symlink_to(target.replace(str(src), str(dst)))


def _read(root: Path, keys: list[bytes], plain: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[bool], list[torch.Tensor], dict[str, Any], list[str]]:
    monkeypatch.setattr(file_tier, "PLAIN_READS", plain)
    backend = _open(root)
    try:
        out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        stats = {k: v for k, v in backend.stats().items() if k in ("blocks_read", "read_misses", "corrupt_records", "deleted", "bytes_read")}
    finally:
        asyncio.run(backend.aclose())
    files = sorted(str(p.relative_to(root.parent)) for p in root.parent.rglob("*") if p.is_file() or p.is_symlink())
    return found, out, stats, files


def general_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The positions of the records each job hands to the file tier's general read, as a list
    that grows as jobs run (the general read itself runs as before)."""
    general: list[int] = []
    real_each = file_tier.FileBackend._read_each
    monkeypatch.setattr(file_tier.FileBackend, "_read_each", lambda self, k, o, which, f: general.extend(which) or real_each(self, k, o, which, f))
    return general


READ_PATHS = ["python", *(["native"] if xxcopy.xxh3_read_check_native is not None else [])]


def record_read_calls(path: str, monkeypatch: pytest.MonkeyPatch, *, check_jobs: bool = True) -> list[int]:
    """``xxcopy.xxh3_read_check``, ``xxh3_read_check_key`` (the flat layout's, which names
    and opens the file too), ``xxh3_read_check_keys`` (the flat layout's job) and
    ``xxh3_read_one`` (its job of one record) on one path (``"python"`` or ``"native"``) for the rest of the test, recording
    the outcome of each record's read in the list returned (``check_jobs`` false: the job's
    call on that path as it is, its records' outcomes not recorded). A flat job's one call from
    its checks to its counters (``xxh3_read_job``) is set aside: ``tests/test_file_read_job.py``
    compares it with these paths."""
    monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
    seen: list[int] = []
    for name in ("xxh3_read_check", "xxh3_read_check_key"):
        fn = getattr(xxcopy, f"{name}_{path}")
        assert fn is not None

        def recording(*args: Any, fn: Any = fn) -> int:
            status = fn(*args)
            seen.append(status)
            return status  # type: ignore[no-any-return]

        monkeypatch.setattr(xxcopy, name, recording)
    job, one = getattr(xxcopy, f"xxh3_read_check_keys_{path}"), getattr(xxcopy, f"xxh3_read_check_key_{path}")
    assert job is not None and one is not None
    rows_read = xxcopy.xxh3_read_rows if path == "native" else None  # (none in Python: the rows' checks, then the job's call)
    if not check_jobs:
        monkeypatch.setattr(xxcopy, "xxh3_read_check_keys", job)
        monkeypatch.setattr(xxcopy, "xxh3_read_one", getattr(xxcopy, f"xxh3_read_one_{path}"))
        monkeypatch.setattr(xxcopy, "xxh3_read_rows", rows_read)
        return seen

    def expected(dir_at: Any, head: Any, keys: Any, sizes: list[int], piece: int) -> tuple[list[int], list[int]]:
        """The records read and checked and those left to the general read, by a call a record
        of the same path (into rows of its own), whose outcomes are recorded."""
        good, rest = [], []
        for i, (key, size) in enumerate(zip(keys, sizes)):
            try:
                status = one(dir_at.value, head, key, bytearray(size), piece)
            except FileNotFoundError:
                continue
            except OSError:
                rest.append(i)
                continue
            seen.append(status)
            (good if status == xxcopy.CHECK_GOOD else rest).append(i)
        return good, rest

    def recording_job(dir_at: Any, head: Any, keys: Any, rows: Any, piece: int, found: list[bool]) -> list[int]:
        """The job's call, checked against :func:`expected`."""
        good, rest = expected(dir_at, head, keys, [len(row) for row in rows], piece)
        got = job(dir_at, head, keys, rows, piece, found)
        assert got == rest and [i for i, hit in enumerate(found) if hit] == good, (got, rest, found, good)
        return got  # type: ignore[no-any-return]

    def recording_rows(under_way: list[None], dir_at: Any, head: Any, keys: Any, out: Any, kind: Any, piece: int, found: list[bool]) -> list[int] | None:
        """The native job from its rows' checks, checked against :func:`expected` where it read."""
        assert rows_read is not None
        counted = len(under_way)
        got = rows_read(under_way, dir_at, head, keys, out, kind, piece, found)
        assert len(under_way) == counted  # its count let go
        if got is not None:
            good, rest = expected(dir_at, head, keys, [row.nbytes for row in out], piece)
            assert got == rest and [i for i, hit in enumerate(found) if hit] == good, (got, rest, found, good)
        return got

    monkeypatch.setattr(xxcopy, "xxh3_read_check_keys", recording_job)
    monkeypatch.setattr(xxcopy, "xxh3_read_rows", recording_rows if rows_read is not None else None)
    lone = getattr(xxcopy, f"xxh3_read_one_{path}")
    assert lone is not None

    def recording_one(under_way: list[None], dir_at: Any, head: Any, key: Any, row: Any, piece: int) -> int:
        """A job of one record's call, checked as :func:`recording_job` checks a job's."""
        found = [False]
        rest = recording_job(dir_at, head, [key], [bytearray(len(row))], piece, found)
        status = lone(under_way, dir_at, head, key, row, piece)
        assert status == (xxcopy.ONE_READ if found[0] else xxcopy.ONE_ELSE if rest else xxcopy.ONE_ABSENT), (status, found, rest)
        return status  # type: ignore[no-any-return]

    monkeypatch.setattr(xxcopy, "xxh3_read_one", recording_one)
    return seen


@pytest.fixture(params=READ_PATHS)
def checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``xxcopy.xxh3_read_check`` on one path (native or Python), recording each outcome."""
    return record_read_calls(request.param, monkeypatch)


# What the plain read's one call says of the damaged store's records it opens: 0 and 8 good,
# 2 (a flipped payload bit) a checksum mismatch, 3 (a bad magic) another head; 4 and 6 (a byte
# short, a byte too many) and 5 (compressed: shorter) never fill exactly.
_GOOD, _SUM, _HEAD, _SHAPE = xxcopy.CHECK_GOOD, xxcopy.CHECK_SUM, xxcopy.CHECK_HEAD, xxcopy.CHECK_SHAPE
_PLAIN_CHECKS = [_GOOD, _SUM, _HEAD, _SHAPE, _SHAPE, _SHAPE, _GOOD]


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_a_plain_read_finds_drops_and_counts_what_the_general_read_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, checks: list[int]
) -> None:
    keys, data = _damaged_store(tmp_path / "a" / "store", tmp_path / "a" / "outside", layout)
    _copy(tmp_path / "a", tmp_path / "b")
    general = _read(tmp_path / "a" / "store", keys, False, monkeypatch)
    assert checks == []
    plain = _read(tmp_path / "b" / "store", keys, True, monkeypatch)
    print(f"general: found {general[0]}, stats {general[2]}; plain: found {plain[0]}, stats {plain[2]}")
    assert checks == _PLAIN_CHECKS
    assert general[0] == [True, False, False, False, False, True, False, False, True, False]
    assert plain[0] == general[0]
    for i, hit in enumerate(general[0]):
        if hit:
            assert torch.equal(general[1][i], data[i]) and torch.equal(plain[1][i], data[i])
    assert plain[2] == general[2] and general[2]["corrupt_records"] == 4
    assert plain[3] == general[3]  # the same records deleted, nothing outside the root touched
    assert sum("outside" in f for f in plain[3]) == 2


def test_a_plain_read_takes_three_system_calls_a_record_and_checks_what_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sound records of a job never reach the general read; a record it cannot take (here
    an injected read error, on the Python path of its one call) does, and is served there."""
    record_read_calls("python", monkeypatch, check_jobs=False)
    keys = [make_key(i) for i in range(4)]
    data = [random_block(FMT.block_bytes, 950 + i) for i in range(4)]
    backend = _open(tmp_path / "store")
    backend.write_blocks(keys, data)
    general = general_reads(monkeypatch)
    real_preadv = os.preadv
    failed: list[int] = []

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        if len(buffers) == 3 and len(failed) == 0 and len(general) == 0 and preadv.calls == 2:  # type: ignore[attr-defined]
            failed.append(fd)
            raise OSError(5, "injected EIO")
        preadv.calls += 1  # type: ignore[attr-defined]
        return real_preadv(fd, buffers, offset)

    preadv.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(file_reads.os, "preadv", preadv)
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        if not backend._beneath.usable:  # type: ignore[attr-defined]
            pytest.skip("OPENAT2 IS REFUSED HERE: every record takes the general read")
        assert backend.read_blocks(keys, out) == [True] * 4
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        assert len(failed) == 1 and general == [2]  # only the record whose read failed
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_without_openat2_a_sharded_store_takes_the_general_read_and_a_flat_one_needs_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    keys = [make_key(i) for i in range(3)]
    data = [random_block(FMT.block_bytes, 970 + i) for i in range(3)]
    backend = _open(tmp_path / "store", layout=layout)
    backend.write_blocks(keys, data)
    monkeypatch.setattr(file_reads, "_syscall", lambda *args: -1)
    monkeypatch.setattr(file_reads.ctypes, "get_errno", lambda: 38)  # ENOSYS
    general = general_reads(monkeypatch)
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 3
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        if layout == "sharded":
            assert not backend._beneath.usable and general == [0, 1, 2]  # type: ignore[attr-defined]
        else:  # one openat of a name in the root, no openat2
            assert general == []
    finally:
        asyncio.run(backend.aclose())


def test_a_record_whose_head_differs_from_the_stores_goes_to_the_general_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-pass read compares a record's whole checked head (dtype byte and flags too) with
    the store's; a sound record with another dtype byte is left to the general read, and both
    ways serve it alike. Its checksum is taken over its own head, not the store's."""
    keys = [make_key(i) for i in range(3)]
    data = [random_block(FMT.block_bytes, 980 + i) for i in range(3)]
    backend = _open(tmp_path / "store")
    backend.write_blocks(keys, data)
    asyncio.run(backend.aclose())
    path = _record(tmp_path / "store", keys[1], "flat")
    raw = bytearray(path.read_bytes())
    raw[6] = 0  # dtype code 0 (opaque bytes) where the store writes bfloat16's
    raw[24:32] = struct.pack("<Q", record_checksum(bytes(raw[:24]), keys[1], bytes(raw[32:])))
    path.write_bytes(bytes(raw))
    results = []
    general = general_reads(monkeypatch)
    for plain in (False, True):
        general.clear()
        results.append(_read(tmp_path / "store", keys, plain, monkeypatch))
        assert general == ([1] if plain else [0, 1, 2])
    assert results[0][0] == results[1][0] == [True, True, True]
    assert all(torch.equal(a, b) and torch.equal(a, d) for a, b, d in zip(results[0][1], results[1][1], data))
    assert results[0][2] == results[1][2] and results[0][3] == results[1][3]


def test_rows_viewed_by_address_read_what_checked_rows_do_and_bad_jobs_are_refused_alike(tmp_path: Path) -> None:
    """An unkeyed job's keys and rows are checked, and the rows viewed (kept by address), in one
    loop; rows it cannot view (strided, here) take the job's general checks and the per-row
    views. Both serve the same bytes and misses; a bad key, a row of another size and a closed
    tier are refused by name either way."""
    keys = [make_key(i) for i in range(4)]
    data = [random_block(FMT.block_bytes, 990 + i) for i in range(4)]
    backend = _open(tmp_path / "store")
    try:
        backend.write_blocks(keys[:3], data[:3])
        dense = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        strided = [torch.zeros(2 * FMT.block_bytes, dtype=torch.uint8)[::2] for _ in keys]
        views = backend._views  # type: ignore[attr-defined]
        assert views is not None and views.of(keys, dense) is not None and views.of(keys, strided) is None
        for _ in range(2):  # the second time from views kept by address
            assert backend.read_blocks(keys, dense) == [True, True, True, False]
            assert backend.read_blocks(keys, strided) == [True, True, True, False]
            for i in range(3):
                assert torch.equal(dense[i], data[i]) and torch.equal(strided[i], data[i])
        assert backend.stats()["blocks_read"] == 12 and backend.stats()["read_misses"] == 4
        for rows in (dense, strided):
            with pytest.raises(InvalidKeyError, match=r"keys\[1\]: expected 32 bytes, got 31"):
                backend.read_blocks([keys[0], b"\x00" * 31], rows[:2])
            with pytest.raises(LayoutError, match=r"blocks\[0\] must be a 1-D uint8 tensor of 16384 bytes"):
                backend.read_blocks(keys[:1], [torch.zeros(FMT.block_bytes // 2, dtype=torch.uint8)])
    finally:
        asyncio.run(backend.aclose())
    with pytest.raises(ClosedError):
        backend.read_blocks(keys[:1], dense[:1])


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_jobs_of_one_record_read_find_drop_and_count_what_the_general_read_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, checks: list[int]
) -> None:
    """A job of one plain record takes the straight line (``PlainReads.read_one``) once its row's
    view is kept: read one key at a time, twice, the damaged store gives the general read's hits,
    bytes, misses, deletions and counters, and the sound records never reach the job's path."""
    keys, data = _damaged_store(tmp_path / "a" / "store", tmp_path / "a" / "outside", layout)
    _copy(tmp_path / "a", tmp_path / "b")
    jobs: list[int] = []  # the keys that took the job's path (the views' loop, or the native job that checks its rows), -1 for others
    real_of, real_rows = file_tier.RowViews.of, file_reads.PlainReads.read_rows
    monkeypatch.setattr(file_tier.RowViews, "of", lambda self, k, o: jobs.extend(keys.index(x) if x in keys else -1 for x in k) or real_of(self, k, o))

    def read_rows(self: file_reads.PlainReads, k: list[bytes], o: list[torch.Tensor]) -> Any:
        got = real_rows(self, k, o)
        if got is not None:
            jobs.extend(keys.index(x) if x in keys else -1 for x in k)
        return got

    monkeypatch.setattr(file_reads.PlainReads, "read_rows", read_rows)
    results = []
    for root, plain in ((tmp_path / "a" / "store", False), (tmp_path / "b" / "store", True)):
        monkeypatch.setattr(file_tier, "PLAIN_READS", plain)
        backend = _open(root, layout=layout)
        out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
        try:  # a job of absent keys first keeps the rows' views, so even the first pass reads in a straight line
            assert backend.read_blocks([make_key(100 + i) for i in range(len(out))], out) == [False] * len(out)
            found = [[backend.read_blocks([key], [row])[0] for key, row in zip(keys, out)] for _ in range(2)]
            stats = {k: v for k, v in backend.stats().items() if k in ("blocks_read", "read_misses", "corrupt_records", "deleted", "bytes_read")}
        finally:
            asyncio.run(backend.aclose())
        files = sorted(str(p.relative_to(root.parent)) for p in root.parent.rglob("*") if p.is_file() or p.is_symlink())
        results.append((found, out, stats, files))
        if plain:  # the sound records in a straight line; the damaged ones (2, 3, 4, 6), the compressed one (5)
            # and the symlinks (7, 9) left to the general read, which deletes the damaged ones
            assert jobs == [-1] * len(keys) + [2, 3, 4, 5, 6, 7, 9] + [5, 7, 9], jobs
            # one call a record opened: 2 to 6 each read by the straight line, then by the job's
            # plain read it hands them to, before the general read deletes the damaged ones (2,
            # 3, 4, 6); the second pass reads the sound ones and the compressed one (5) again
            first = [_GOOD, _SUM, _SUM, _HEAD, _HEAD, *[_SHAPE] * 6, _GOOD]
            assert checks == [*first, _GOOD, _SHAPE, _SHAPE, _GOOD], checks
        else:
            assert checks == []
        jobs.clear()
    general, straight = results
    assert general[0][0] == general[0][1] == [True, False, False, False, False, True, False, False, True, False]
    assert straight[0] == general[0]
    for i, hit in enumerate(general[0][0]):
        if hit:
            assert torch.equal(general[1][i], data[i]) and torch.equal(straight[1][i], data[i])
    assert straight[2] == general[2] and general[2]["corrupt_records"] == 4
    assert straight[3] == general[3]


@pytest.mark.parametrize("job", [True, False])
def test_a_job_of_one_record_refuses_what_a_job_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: bool) -> None:
    """Bad input to a one-record job is refused by name, as the job's checks refuse it, also with
    the row's view kept; a strided row is served by the job's path; a closed tier refuses. The
    same with the flat job's one call from its checks to its counters (``job``: where built)
    and without it (the straight line, ``PlainReads.read_one``)."""
    if not job:
        monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
    keys = [make_key(i) for i in range(2)]
    data = [random_block(FMT.block_bytes, 995 + i) for i in range(2)]
    backend = _open(tmp_path / "store")
    row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    try:
        backend.write_blocks(keys, data)
        for _ in range(2):
            assert backend.read_blocks(keys[:1], [row]) == [True] and torch.equal(row, data[0])
        with pytest.raises(InvalidKeyError, match=r"keys\[0\]: expected 32 bytes, got 31"):
            backend.read_blocks([b"\x00" * 31], [row])
        with pytest.raises(InvalidKeyError):
            backend.read_blocks([keys[0].hex()], [row])  # type: ignore[list-item]
        with pytest.raises(InvalidKeyError, match=r"keys\[1\]: expected 32 bytes, got 31"):
            backend.read_blocks([keys[0], b"\x00" * 31], [row, torch.zeros_like(row)])
        for bad in (row[: FMT.block_bytes // 2], row.view(torch.int16), row.view(2, -1)):
            with pytest.raises(LayoutError, match=r"blocks\[0\] must be a 1-D uint8 tensor of 16384 bytes"):
                backend.read_blocks(keys[:1], [bad])
        with pytest.raises(LayoutError):
            backend.read_blocks(keys, [row])  # (a row short)
        strided = torch.zeros(2 * FMT.block_bytes, dtype=torch.uint8)[::2]
        assert backend.read_blocks(keys[1:], [strided]) == [True] and torch.equal(strided, data[1])
        assert backend.stats()["blocks_read"] == 3
    finally:
        asyncio.run(backend.aclose())
    with pytest.raises(ClosedError):
        backend.read_blocks(keys[:1], [row])
