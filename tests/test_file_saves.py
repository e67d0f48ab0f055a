"""The ``file`` tier's save of plain records (unkeyed, uncompressed jobs of host rows: the job's
checks and its rows' views in one loop, each checksum from the store's one hash state) against
the general save (``_check_io`` and ``encode_record`` per block): the same files, byte for
byte, in both layouts; a short ``pwritev`` still writes the whole record; and large records of a
durable job have their writeback started once written, the same files either way."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_commit

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import InvalidKeyError, LayoutError
from kvtier.records.codec import NoneCodec
from kvtier.records.record import encode_record
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


def _open(path: Path, **options: Any) -> Backend:
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(path), **options)
    asyncio.run(backend.open(FMT))
    return backend


def _records(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.rglob("*.kvb")}


@pytest.mark.parametrize("layout", ["flat", "sharded"])
@pytest.mark.parametrize("rows", ["own", "staging"])
def test_a_plain_job_is_saved_as_the_general_encoder_saves_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, rows: str) -> None:
    keys = [make_key(i) for i in range(6)]
    data = [random_block(FMT.block_bytes, 700 + i) for i in range(6)]
    calls: list[int] = []
    real = file_commit.plain_records
    from kvtier.backends import file_saves

    monkeypatch.setattr(file_saves, "plain_records", lambda *a: calls.append(1) or real(*a))
    stores = {}
    for way in ("plain", "general"):
        blocks = [d.clone() for d in data] if rows == "own" else list(torch.stack(data).unbind(0))
        backend = _open(tmp_path / way, layout=layout)
        try:
            if way == "general":
                backend._views = None  # type: ignore[attr-defined]  # every job by the general checks and encoder
            sizes = backend.write_blocks(keys, blocks)
            assert None not in sizes and backend.stats()["blocks_written"] == 6
            assert backend.stats()["bytes_written"] == 6 * (32 + FMT.block_bytes)
            out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
            assert backend.read_blocks(keys, out) == [True] * 6
            assert all(torch.equal(o, d) for o, d in zip(out, data))
        finally:
            asyncio.run(backend.aclose())
        stores[way] = _records(tmp_path / way)
        assert calls == [1]  # the plain way took the tight encoder once, the general way not at all
    assert stores["plain"] == stores["general"] and len(stores["plain"]) == 6
    for key, d in zip(keys, data):
        head, payload = encode_record(key, d.numpy().data, NoneCodec(), 1, None)  # bfloat16: dtype code 1
        assert stores["plain"][key.hex() + ".kvb"] == head + bytes(payload)


def test_jobs_the_plain_save_does_not_take_go_the_general_way(tmp_path: Path) -> None:
    """Compressed or keyed stores, and rows that are not host rows of the block's size, are
    encoded by the general path; bad input is refused with the general path's errors."""
    keys = [make_key(i) for i in range(3)]
    data = [random_block(FMT.block_bytes, 800 + i) for i in range(3)]
    for options in ({"codec": {"name": "zstd", "level": 1}}, {"mac_key": b"k" * 32}, {}):
        backend = _open(tmp_path / str(len(os.listdir(tmp_path))), **options)
        try:
            strided = torch.stack([d for d in data], 1).t()  # rows that are not contiguous
            assert None not in backend.write_blocks(keys, list(strided))
            out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
            assert backend.read_blocks(keys, out) == [True] * 3
            assert all(torch.equal(o, d) for o, d in zip(out, data))
            with pytest.raises(LayoutError, match=r"blocks\[1\]"):
                backend.write_blocks(keys[:2], [data[0], data[1][:-1]])
            with pytest.raises(InvalidKeyError, match=r"keys\[1\]"):
                backend.write_blocks([keys[0], b"short"], data[:2])
        finally:
            asyncio.run(backend.aclose())


def test_a_short_write_is_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pwritev`` may write less than asked; the record is still written whole."""
    real = os.pwritev
    short: list[int] = []

    def pwritev(fd: int, buffers: Any, offset: int) -> int:
        if not short:  # the first call writes 100 bytes only
            short.append(fd)
            return real(fd, [memoryview(b"".join(bytes(b) for b in buffers))[:100]], offset)
        return real(fd, buffers, offset)

    backend = _open(tmp_path, sync_mode="fast")
    key, data = make_key(1), random_block(FMT.block_bytes, 3)
    try:
        monkeypatch.setattr(os, "pwritev", pwritev)
        assert backend.write_blocks([key], [data]) == [20480]
        monkeypatch.undo()
        assert short
        out = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        assert backend.read_blocks([key], [out]) == [True] and torch.equal(out, data)
    finally:
        asyncio.run(backend.aclose())


BIG = BlockFormat(block_bytes=file_commit.EARLY_WRITEBACK_BYTES, dtype="uint8")


def _kicks(monkeypatch: pytest.MonkeyPatch, result: int = 0) -> list[int]:
    """Spy on the writeback started early (the real call made, its result replaced by
    ``result``): the descriptors it was started for, and whether each had its data written."""
    calls: list[int] = []
    real = file_commit._sync_range

    def spy(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append(os.fstat(fd).st_size)
        if real is not None:
            real(fd, offset, nbytes, flags)
        return result

    monkeypatch.setattr(file_commit, "_sync_range", spy)
    return calls


@pytest.mark.parametrize("kick_fails", [False, True])
def test_a_durable_job_of_large_records_starts_their_writeback_as_it_writes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kick_fails: bool
) -> None:
    """Each written file's writeback is started before the commit's syncs (measured: 2 MiB
    records in jobs of 16 saved 1.2x as fast); the files are the same bytes as a job saved
    without it, and a writeback that cannot be started changes nothing but the speed."""
    keys = [make_key(i) for i in range(4)]
    data = [random_block(BIG.block_bytes, 900 + i) for i in range(4)]
    stores = {}
    for way in ("early", "plain"):
        calls = _kicks(monkeypatch, -1 if kick_fails else 0)
        if way == "plain":
            monkeypatch.setattr(file_commit, "EARLY_WRITEBACK_BYTES", 1 << 40)
        backend = registry.backends.get("file")(capacity=64 << 20, path=str(tmp_path / way))
        asyncio.run(backend.open(BIG))
        try:
            assert None not in backend.write_blocks(keys, data)
            out = [torch.zeros(BIG.block_bytes, dtype=torch.uint8) for _ in keys]
            assert backend.read_blocks(keys, out) == [True] * 4
            assert all(torch.equal(o, d) for o, d in zip(out, data))
        finally:
            asyncio.run(backend.aclose())
        # Started once per record, each once its whole record was written.
        assert calls == ([32 + BIG.block_bytes] * 4 if way == "early" else [])
        stores[way] = _records(tmp_path / way)
        monkeypatch.undo()
    assert stores["early"] == stores["plain"] and len(stores["early"]) == 4


def test_writeback_is_not_started_early_for_one_record_small_records_or_fast_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _kicks(monkeypatch)
    cases = [(BIG, {}, 1), (FMT, {}, 4), (BIG, {"sync_mode": "fast"}, 4)]
    for i, (fmt, options, n) in enumerate(cases):
        backend = registry.backends.get("file")(capacity=64 << 20, path=str(tmp_path / str(i)), **options)
        asyncio.run(backend.open(fmt))
        try:
            keys = [make_key(k) for k in range(n)]
            assert None not in backend.write_blocks(keys, [random_block(fmt.block_bytes, k) for k in range(n)])
        finally:
            asyncio.run(backend.aclose())
    assert calls == []
