"""An ``lmdb`` tier reopened with a lowered capacity drops its oldest records and compacts the
file: the compacted copy replaces ``data.mdb``. The copy's data is synced before its name
replaces the old file's (and the directory after), so a power loss leaves either the old file
or the whole new one, never a name pointing at data that was not yet on disk (a file of holes,
which the next open would move aside with every record of the tier)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from kvtier.backends import lmdb_tier

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=4096, dtype="uint8", namespace={"model_id": "shrink"})


def _fill(path: Path) -> int:
    backend = registry.backends.get("lmdb")(capacity=4 << 20, path=str(path))
    asyncio.run(backend.open(FMT))
    n = 0
    while n < 400 and backend.write_blocks([make_key(n)], [random_block(4096, n, torch.uint8)]) != [None]:
        backend.touch_stamps([(make_key(n), float(n))])  # oldest first
        n += 1
    asyncio.run(backend.aclose())
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_the_compacted_file_is_synced_before_it_replaces_data_mdb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "env"
    stored = _fill(path)
    events: list[tuple[str, str]] = []
    real_fsync, real_fdatasync, real_replace = os.fsync, os.fdatasync, os.replace

    def where(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def fsync(fd: int) -> None:
        events.append(("sync", where(fd)))
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        events.append(("sync", where(fd)))
        real_fdatasync(fd)

    def replace(src: str, dst: str, **kwargs: object) -> None:
        events.append(("replace", os.path.realpath(src)))
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(lmdb_tier.os, "replace", replace)
    small = registry.backends.get("lmdb")(capacity=2 << 20, path=str(path))
    asyncio.run(small.open(FMT))
    try:
        kept = sorted(r.key for r in small.scan())
        assert 0 < len(kept) < stored  # the case was made: the file was compacted
        copy = os.path.realpath(path / "compact.tmp" / "data.mdb")
        assert ("replace", copy) in events
        before = events[: events.index(("replace", copy))]
        assert ("sync", copy) in before, "the compacted copy replaced data.mdb before its data was synced"
        out = [torch.zeros(4096, dtype=torch.uint8) for _ in kept]
        assert all(small.read_blocks(kept, out))
    finally:
        asyncio.run(small.aclose())
