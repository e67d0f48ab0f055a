"""A block the engine changes while a save reads it (what the fence exists to prevent, so a
bug elsewhere) must end as a counted miss at load, never as wrong bytes served. Some save
paths read the source twice: once for the checksum, once for the bytes stored (the joined
record of a host with no vector path, the ``file`` tier's checksum before its write). There
the stored checksum can describe other bytes than those stored; what keeps the promise is
that every load checks the checksum over the very bytes it hands over. Each test changes the
block at exactly that point (after its checksum, before its bytes are stored), then loads: a
miss, counted corrupt and deleted, and the row never reported found with the changed bytes.
The ``lmdb`` tier's split records take their checksum from the copy already put, so the same
change there is stored consistently and read back as the bytes that were put."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lmdb_lookups import layouts
from test_xxcopy_hosts import on_host

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.records import checks, xxcopy
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


def _changed(block: torch.Tensor) -> None:
    """The engine writes into the block (every byte changes)."""
    view = block.numpy()
    np.bitwise_xor(view, 0x5A, out=view)


class _HashThenChange:
    """``xxhash`` for :mod:`kvtier.records.xxcopy`: a hasher that, once it has read a whole
    block, lets the engine change that block (the hashing pass done, the copy not yet)."""

    def __init__(self, real: Any, block: torch.Tensor) -> None:
        self.real, self.block, self.fired = real, block, False

    def xxh3_64(self, data: Any = b"") -> Any:
        return _Hasher(self.real.xxh3_64(data), self)


class _Hasher:
    def __init__(self, h: Any, owner: _HashThenChange) -> None:
        self.h, self.owner = h, owner

    def update(self, data: Any) -> None:
        self.h.update(data)
        if memoryview(data).nbytes == FMT.block_bytes and not self.owner.fired:
            self.owner.fired = True
            _changed(self.owner.block)

    def intdigest(self) -> int:
        return self.h.intdigest()  # type: ignore[no-any-return]


def _load(backend: Any, key: bytes) -> tuple[bool, dict[str, Any]]:
    """Whether ``key`` is found (then closed), and the tier's counters; a record found bad is
    deleted, so a second read misses too."""
    row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    try:
        found = backend.read_blocks([key], [row])
        again = backend.read_blocks([key], [torch.zeros_like(row)])
        stats = backend.stats()
    finally:
        asyncio.run(backend.aclose())
    assert again == [False]
    return found[0], stats


def test_lmdb_joined_record_of_a_host_with_no_vector_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layouts(monkeypatch, "joined")
    key, block = make_key(1), random_block(FMT.block_bytes, 1)
    with on_host("arm"):
        shim = _HashThenChange(xxcopy.xxhash, block)
        monkeypatch.setattr(xxcopy, "xxhash", shim)
        backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(tmp_path / "lmdb"))
        asyncio.run(backend.open(FMT))
        backend.write_blocks([key], [block])
        monkeypatch.undo()
        assert shim.fired
        found, stats = _load(backend, key)
    assert not found and stats["corrupt_records"] == 1 and stats["deleted"] == 1


@pytest.mark.parametrize("jobs", [1, 3])
def test_file_record_checksummed_before_its_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: int) -> None:
    """One key (the straight save) and several (the job's loop): each record's checksum is
    taken from the row, then the row is written."""
    keys = [make_key(10 + i) for i in range(jobs)]
    blocks = [random_block(FMT.block_bytes, 10 + i) for i in range(jobs)]
    real = checks.HeadChecksum.__call__
    fired: list[bool] = []

    def summed_then_changed(self: Any, key: bytes, payload: Any) -> int:
        value = real(self, key, payload)
        if key == keys[-1] and not fired:
            fired.append(True)
            _changed(blocks[-1])
        return value

    monkeypatch.setattr(checks.HeadChecksum, "__call__", summed_then_changed)
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path / "file"), sync_mode="fast")
    asyncio.run(backend.open(FMT))
    backend.write_blocks(keys, blocks)
    monkeypatch.undo()
    assert fired
    found, stats = _load(backend, keys[-1])
    assert not found and stats["corrupt_records"] == 1 and stats["deleted"] == 1


def test_lmdb_split_record_is_checksummed_from_the_copy_put(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The split layout takes the checksum from the value just put, not from the block: a
    change after the put is not stored, and the record reads back as put."""
    layouts(monkeypatch, "split")
    key, block = make_key(2), random_block(FMT.block_bytes, 2)
    put = block.clone()
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(tmp_path / "lmdb"))
    asyncio.run(backend.open(FMT))
    from kvtier.backends.lmdb_plain import PlainReads

    real = PlainReads.summed
    summed: list[bytes] = []

    def changed_then_summed(self: PlainReads, key: bytes, stored: Any) -> bytes:
        _changed(block)  # after the put, before its checksum
        summed.append(key)
        return real(self, key, stored)

    monkeypatch.setattr(PlainReads, "summed", changed_then_summed)
    backend.write_blocks([key], [block])
    monkeypatch.undo()
    assert summed == [key] and not torch.equal(block, put)
    row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    try:
        assert backend.read_blocks([key], [row]) == [True] and backend.stats()["corrupt_records"] == 0
    finally:
        asyncio.run(backend.aclose())
    assert torch.equal(row, put)
