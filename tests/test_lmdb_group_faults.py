"""A plain joined record is built in the write transaction that jobs waiting together share
(``LmdbWrites._put_together``): a record whose build fails there (its memory, a bad view) fails
that record alone, as a full map does, never the other jobs of the group, and nothing it
rolled back is acknowledged."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends.lmdb_plain import host_rows

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16 << 10, dtype="bfloat16", namespace={"model_id": "m"})  # joined: under JOIN_MAX


def test_a_record_that_fails_to_build_fails_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(tmp_path), sync_mode="fast")
    asyncio.run(backend.open(FMT))
    first = [make_key(i) for i in range(3)]
    second = [make_key(10 + i) for i in range(3)]
    data = {k: random_block(FMT.block_bytes, n) for n, k in enumerate(first + second)}
    bad = second[1]
    real = xxcopy.xxh3_joined

    def build(head: Any, key: bytes, view: Any) -> bytes:
        if key == bad:
            raise MemoryError("no memory for the record")
        return real(head, key, view)

    monkeypatch.setattr(xxcopy, "xxh3_joined", build)
    plain = backend._plain_records  # type: ignore[attr-defined]
    jobs = []
    for keys in (first, second):
        views = host_rows([data[k] for k in keys], FMT.block_bytes)
        assert views is not None
        jobs.append(plain.records(keys, views))  # built in the transaction
    try:
        sizes = backend._commit_jobs(jobs)  # type: ignore[attr-defined]  # two jobs, one group
        stored = backend._pages(32 + FMT.block_bytes)  # type: ignore[attr-defined]
        assert sizes == [[stored] * 3, [stored, None, stored]]
        assert backend.stats()["write_failures"] == 1
        keys = first + second
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [k != bad for k in keys]
        assert all(torch.equal(o, data[k]) for o, k in zip(out, keys) if k != bad)
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_record_left_to_the_transaction_is_built_with_collection_held_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: int) -> None:
    """The general save builds a job's joined records before it waits for the write lock; one
    whose build fails there (its memory) is built again in the write transaction, from its row's
    view. Collection stays held off until that copy, whichever record of the job it is: a
    finalizer run during the wait may free the row the view points at."""
    from kvtier.backends import lmdb_lone

    monkeypatch.setattr(lmdb_lone, "LONE_SAVES", False)
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(tmp_path), sync_mode="fast")
    asyncio.run(backend.open(FMT))
    keys = [make_key(i) for i in range(3)]
    rows = [random_block(FMT.block_bytes, i) for i in range(3)]
    real = xxcopy.xxh3_joined
    failed: list[bool] = []
    collecting: list[bool] = []

    def build(head: Any, key: bytes, view: Any) -> bytes:
        if key == keys[bad]:
            if not failed:
                failed.append(True)
                raise MemoryError("no memory for the record")
            collecting.append(gc.isenabled())
        return real(head, key, view)

    monkeypatch.setattr(xxcopy, "xxh3_joined", build)
    try:
        assert gc.isenabled()
        assert None not in backend.write_blocks(keys, rows)
        assert failed and collecting == [False], "the record was built from its row's view with collection on"
        assert gc.isenabled()
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 3
        assert all(torch.equal(o, r) for o, r in zip(out, rows))
    finally:
        asyncio.run(backend.aclose())
