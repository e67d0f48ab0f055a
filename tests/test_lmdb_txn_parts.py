"""A group of ``lmdb`` jobs larger than :data:`~kvtier.backends.lmdb_writes.TXN_MOST_BYTES` is put in
several write transactions (``lmdb_writes.transactions``): every record stored and read back as one
transaction stores it, each job's sizes in its own order, and no more transactions than needed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import lmdb_writes
from kvtier.backends.lmdb_writes import transactions

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=128 << 10, dtype="uint8")  # split records (above JOIN_MAX): the general path


def _open(path: Path) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(path), sync_mode="durable")
    asyncio.run(backend.open(FMT))
    return backend


def _rows(first: int, count: int) -> list[torch.Tensor]:
    return [random_block(FMT.block_bytes, first + i) for i in range(count)]


def _txnid(backend: Backend) -> int:
    return int(backend._env.info()["last_txnid"])  # type: ignore[attr-defined]


def _read(backend: Backend, keys: list[bytes]) -> list[bytes | None]:
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    found = backend.read_blocks(keys, out)
    return [bytes(o.numpy()) if hit else None for o, hit in zip(out, found)]


@pytest.mark.parametrize(("counts", "per_most"), [((1,), 1), ((5,), 5), ((10,), 3), ((4, 7, 1), 4), ((3, 3), 2), ((64,), 22)])
def test_transactions_deal_every_record_once_in_order_within_the_bound(counts: tuple[int, ...], per_most: int) -> None:
    jobs: list[list[Any]] = [[(j, i) for i in range(n)] for j, n in enumerate(counts)]
    parts = transactions(jobs, 10, most=10 * per_most)
    total = sum(counts)
    if total <= per_most:
        assert parts is None
        return
    assert parts is not None
    assert len(parts) == -(-total // per_most)  # as few transactions as the bound allows
    sizes = [sum(map(len, part)) for part, _ in parts]
    assert max(sizes) <= per_most and max(sizes) - min(sizes) <= per_most - 1
    seen: list[list[Any]] = [[] for _ in jobs]
    for part, owners in parts:
        assert len(part) == len(owners) and all(piece for piece in part)
        for owner, piece in zip(owners, part):
            assert all(record[0] == owner for record in piece)
            seen[owner] += piece
    assert seen == jobs


def test_a_job_over_the_bound_is_stored_in_several_transactions_and_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(tmp_path / "parts")
    record = backend._record_pages[1]  # type: ignore[attr-defined]
    monkeypatch.setattr(lmdb_writes, "TXN_MOST_BYTES", 3 * record)  # three records a transaction
    keys, rows = [make_key(i) for i in range(10)], _rows(0, 10)
    before = _txnid(backend)
    sizes = backend.write_blocks(keys, rows)
    assert all(size for size in sizes) and len(sizes) == 10
    assert _txnid(backend) - before == 4  # 10 records, at most 3 a transaction: 3, 3, 3, 1
    assert _read(backend, keys) == [bytes(r.numpy()) for r in rows]
    asyncio.run(backend.aclose())
    again = _open(tmp_path / "parts")  # durable: every part on disk
    assert _read(again, keys) == [bytes(r.numpy()) for r in rows]
    asyncio.run(again.aclose())


def test_jobs_sharing_a_split_group_get_their_own_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(tmp_path / "group")
    record = backend._record_pages[1]  # type: ignore[attr-defined]
    monkeypatch.setattr(lmdb_writes, "TXN_MOST_BYTES", 2 * record)
    jobs = []
    for j, n in enumerate((3, 1, 4)):
        rows = _rows(10 * j, n)
        jobs.append([(make_key(10 * j + i), b"", bytes(r.numpy())) for i, r in enumerate(rows)])
    # Whole records as payloads (a head of b""): the sizes are what each job gets back.
    sizes = backend._commit_jobs(jobs)  # type: ignore[attr-defined]
    assert [len(s) for s in sizes] == [3, 1, 4]
    assert all(size for job in sizes for size in job)
    asyncio.run(backend.aclose())


def test_the_bound_keeps_a_job_of_sixteen_2mib_records_in_one_transaction() -> None:
    """The common large job (16 records of 2 MiB, 32 MiB and its pages' heads) stays one durable
    commit; 64 such records go in three."""
    each = 513 * 4096  # a 2 MiB record and its head: 513 pages
    assert transactions([[0] * 16], each) is None  # type: ignore[list-item]
    parts = transactions([[0] * 64], each)  # type: ignore[list-item]
    assert parts is not None and [sum(map(len, p)) for p, _ in parts] == [22, 22, 20]
