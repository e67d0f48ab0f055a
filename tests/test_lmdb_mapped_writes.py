"""The ``lmdb`` tier maps the pages a commit appends to its data file before the save returns
(``lmdb_writes``, ``lmdb_files.map_pages``): the first load of a record just saved finds its
value's pages mapped, reads the same bytes as a store that does not map ahead, and a store
whose map cannot be found, or a kernel that refuses the call, saves and loads as before."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

import pytest
import torch
from kvtier.backends import lmdb_files, lmdb_writes

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=1 << 20, dtype="uint8")
N = 2  # a commit of 2 MiB of 1 MiB records: mapped ahead (lmdb_writes.MAP_AFTER_BYTES, MAP_BELOW_BYTES)


def _open(path: Path) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(path))
    asyncio.run(backend.open(FMT))
    return backend


def _mapped_after_save(path: Path) -> tuple[float, list[torch.Tensor]]:
    """Save ``N`` records: the share of the pages they appended to ``data.mdb`` that this
    process's page tables hold before any load (``/proc/self/pagemap``, bit 63); then load
    them, and the rows."""
    keys = [make_key(i) for i in range(N)]
    data = [random_block(FMT.block_bytes, 40 + i) for i in range(N)]
    backend = _open(path)
    try:
        base = backend._reader.map_base  # type: ignore[attr-defined]
        if base is None:
            pytest.skip("the map of data.mdb is not found here")
        start = os.path.getsize(path / "data.mdb")
        assert None not in backend.write_blocks(keys, data)
        end = os.path.getsize(path / "data.mdb")
        assert end - start >= N * FMT.block_bytes
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/pagemap", "rb") as f:
            f.seek((base + start) // page * 8)
            entries = f.read((end - start) // page * 8)
        present = sum(e >> 63 for (e,) in struct.iter_unpack("<Q", entries))
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * N
        assert all(torch.equal(o, d) for o, d in zip(out, data))
    finally:
        asyncio.run(backend.aclose())
    return present / ((end - start) // page), out


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="page tables are read from Linux's pagemap")
def test_the_pages_a_save_appends_are_mapped_before_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = lmdb_files.map_pages
    monkeypatch.setattr(lmdb_writes, "map_pages", lambda address, length: calls.append(real(address, length)) or calls[-1])
    mapped, rows = _mapped_after_save(tmp_path / "mapped")
    if calls == [False]:
        pytest.skip("this kernel cannot map pages ahead (MADV_POPULATE_READ)")
    assert calls == [True]  # one call for the job's commit
    monkeypatch.setattr(lmdb_writes, "MAP_AFTER_BYTES", 1 << 40)  # not mapped ahead: as before
    unmapped, again = _mapped_after_save(tmp_path / "unmapped")
    assert all(torch.equal(a, b) for a, b in zip(rows, again))  # the same bytes either way
    assert mapped == 1.0 and unmapped < 0.1, (mapped, unmapped)


def test_small_and_large_commits_are_not_mapped_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(lmdb_writes, "map_pages", lambda address, length: calls.append(length) or True)
    for n, size in ((4, 1 << 20), (64, 16 << 10)):  # 4 MiB and more in one commit; 1 MiB of small records
        fmt = BlockFormat(block_bytes=size, dtype="uint8")
        backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(tmp_path / str(size)))
        asyncio.run(backend.open(fmt))
        try:
            assert None not in backend.write_blocks([make_key(i) for i in range(n)], [random_block(size, i) for i in range(n)])
        finally:
            asyncio.run(backend.aclose())
    assert calls == []


def test_saves_and_loads_go_on_where_the_pages_cannot_be_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(N)]
    data = [random_block(FMT.block_bytes, 70 + i) for i in range(N)]
    monkeypatch.setattr(lmdb_files, "_madvise", lambda: (lambda address, length, advice: -1))  # the kernel refuses
    # A refusal read as EINVAL turns mapping ahead off for the rest of the process: only for
    # this test's, not for the tests after it (the first one here would then skip).
    monkeypatch.setattr(lmdb_files, "_POPULATE", [True])
    for name in ("refused", "no-map"):
        backend = _open(tmp_path / name)
        try:
            if name == "no-map":
                object.__setattr__(backend._reader, "map_base", None)  # type: ignore[attr-defined]
            assert None not in backend.write_blocks(keys, data)
            out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
            assert backend.read_blocks(keys, out) == [True] * N
            assert all(torch.equal(o, d) for o, d in zip(out, data))
        finally:
            asyncio.run(backend.aclose())
