"""Large plain records of the ``file`` tier read and hashed a piece at a time (the plain read's
one call, :func:`kvtier.records.xxcopy.xxh3_read_check`, native and Python) against the general
read and the one-``preadv`` read: the same bytes, misses, deletions and counters, whatever
piece holds the damage, in jobs of several records and of one."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_reads, file_tier

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
from tests.test_file_plain_reads import READ_PATHS, general_reads, record_read_calls

BLOCK = 16384
FMT = BlockFormat(block_bytes=BLOCK, dtype="bfloat16", namespace={"model_id": "m"})
HEAD = 32
#: Per key: what is done to its record file (``None``: nothing, ``"absent"``: never written).
DAMAGE: list[Any] = [
    None,
    ("flip", HEAD + 5),  # in the first piece
    ("flip", HEAD + 6000),  # in a middle piece
    ("flip", HEAD + BLOCK - 1),  # the last byte
    ("flip", 3),  # the head's magic
    ("flip", 27),  # the stored checksum
    ("cut", HEAD + 6000),  # cut short in a middle piece
    ("cut", HEAD + BLOCK - 1),  # one byte short
    ("grow", 1),  # one byte too many
    "absent",
    None,
]


def _open(path: Path) -> Backend:
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(path), sync_mode="fast")
    asyncio.run(backend.open(FMT))
    return backend


def _store(root: Path) -> tuple[list[bytes], list[torch.Tensor]]:
    keys = [make_key(i) for i in range(len(DAMAGE))]
    data = [random_block(BLOCK, 700 + i) for i in range(len(DAMAGE))]
    backend = _open(root)
    written = [i for i, damage in enumerate(DAMAGE) if damage != "absent"]
    backend.write_blocks([keys[i] for i in written], [data[i] for i in written])
    asyncio.run(backend.aclose())
    for key, damage in zip(keys, DAMAGE):
        if damage is None or damage == "absent":
            continue
        path = root / f"{key.hex()}.kvb"
        raw = bytearray(path.read_bytes())
        kind, at = damage
        if kind == "flip":
            raw[at] ^= 0x10
        elif kind == "cut":
            del raw[at:]
        else:
            raw += b"x" * at
        path.write_bytes(bytes(raw))
    return keys, data


def _read(root: Path, keys: list[bytes], *, plain: bool, one: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    monkeypatch.setattr(file_tier, "PLAIN_READS", plain)
    backend = _open(root)
    try:
        out = [torch.full((BLOCK,), 7, dtype=torch.uint8) for _ in keys]
        if one:  # a job of absent keys first keeps the rows' views: then each key in a job of its own
            assert backend.read_blocks([make_key(100 + i) for i in range(len(out))], out) == [False] * len(out)
            found = [backend.read_blocks([key], [row])[0] for key, row in zip(keys, out)]
        else:
            found = backend.read_blocks(keys, out)
        stats = {k: v for k, v in backend.stats().items() if k in ("blocks_read", "read_misses", "corrupt_records", "deleted", "bytes_read")}
    finally:
        asyncio.run(backend.aclose())
    return found, out, stats, sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("path", READ_PATHS)
@pytest.mark.parametrize("one", [False, True], ids=["job", "one"])
@pytest.mark.parametrize("piece", [4096, 5000, BLOCK - 1])
def test_records_read_in_pieces_serve_what_the_general_and_whole_reads_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int, one: bool, path: str
) -> None:
    outcomes = record_read_calls(path, monkeypatch)
    calls: list[int] = []
    real_preadv = os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        calls.append(offset)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(file_reads.os, "preadv", preadv)
    results = {}
    for name, plain, size in (("general", False, BLOCK), ("whole", True, BLOCK), ("pieces", True, piece)):
        monkeypatch.setattr(file_reads, "PIECE_BYTES", size)
        keys, data = _store(tmp_path / name)
        calls.clear()
        results[name] = _read(tmp_path / name, keys, plain=plain, one=one, monkeypatch=monkeypatch)
        if name == "pieces" and path == "python":  # each sound record took one preadv a piece, at the pieces' offsets
            pieces = [HEAD + at for at in range(piece, BLOCK, piece)]
            assert calls[: 1 + len(pieces)] == [0, *pieces]
        if name == "pieces":  # the damaged records, each told apart by the one call
            good, bad_sum, bad_head, shape = xxcopy.CHECK_GOOD, xxcopy.CHECK_SUM, xxcopy.CHECK_HEAD, xxcopy.CHECK_SHAPE
            expected = [good, bad_sum, bad_sum, bad_sum, bad_head, bad_sum, shape, shape, shape, good]
            if one:  # each read by the straight line, then by the job's read it hands it to
                expected = [expected[0], *[o for o in expected[1:-1] for _ in range(2)], expected[-1]]
            assert outcomes[-len(expected) :] == expected, outcomes
        outcomes.clear()
    general = results["general"]
    assert general[0] == [True] + [False] * 9 + [True]
    assert general[2]["corrupt_records"] == 8 and general[2]["read_misses"] == 1 + (len(DAMAGE) if one else 0)
    for name in ("whole", "pieces"):
        found, out, stats, files = results[name]
        assert found == general[0] and stats == general[2] and files == general[3], name
        for i, hit in enumerate(found):
            if hit:
                assert torch.equal(out[i], data[i]) and torch.equal(general[1][i], data[i])


def test_a_failed_piece_leaves_the_record_to_the_general_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error on a later piece's ``preadv`` (here an injected EIO, on the Python path of the
    one call) hands the record to the general read, which reads it again and serves it."""
    record_read_calls("python", monkeypatch, check_jobs=False)
    monkeypatch.setattr(file_reads, "PIECE_BYTES", 4096)
    keys = [make_key(i) for i in range(3)]
    data = [random_block(BLOCK, 800 + i) for i in range(3)]
    backend = _open(tmp_path / "store")
    backend.write_blocks(keys, data)
    general = general_reads(monkeypatch)
    real_preadv = os.preadv
    failed: list[int] = []

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        if offset == HEAD + 8192 and not failed:
            failed.append(fd)
            raise OSError(5, "injected EIO")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(file_reads.os, "preadv", preadv)
    try:
        out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 3
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        assert len(failed) == 1 and general == [0]
        assert backend.stats()["corrupt_records"] == 0
    finally:
        asyncio.run(backend.aclose())
