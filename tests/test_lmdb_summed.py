"""A plain split record's checksum is taken in the write transaction from the copy its put made
(``lmdb_plain.PlainReads.summed``), not from the block before the put: the stored head and
payload are byte for byte what the general encoder (``encode_record``) makes, in one transaction
per job and in the one-per-record path a full map falls back to, they read back, and a flipped
payload bit is a counted corrupt record."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_plain
from kvtier.backends.lmdb_entries import INDEX
from lmdb_lookups import reads_all_but_one

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records import xxcopy
from kvtier.records.codec import NoneCodec
from kvtier.records.format import encode_record
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=128 << 10, dtype="bfloat16", namespace={"model_id": "m"})  # split: above JOIN_MAX
N = 5


def _lmdb(path: Path) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(path), sync_mode="fast")
    asyncio.run(backend.open(FMT))
    return backend


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("shape", ["one transaction", "one per record"])
def test_split_saves_store_what_the_general_encoder_makes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str, path: str) -> None:
    """Also with the checksum's Python path (``xxcopy.xxh3_copy`` without the extension)."""
    if path == "python":
        monkeypatch.setattr(xxcopy, "xxh3_copy", xxcopy.xxh3_copy_python)
    elif not xxcopy.fused():
        pytest.skip("the native extension is not built here")
    keys = [make_key(i) for i in range(N)]
    data = [random_block(FMT.block_bytes, 80 + i) for i in range(N)]
    summed: list[bytes] = []
    real = lmdb_plain.PlainReads.summed

    def counting(self: Any, key: bytes, stored: Any) -> bytes:
        summed.append(key)
        return real(self, key, stored)

    monkeypatch.setattr(lmdb_plain.PlainReads, "summed", counting)
    backend = _lmdb(tmp_path)
    if shape == "one per record":  # what a transaction that hit a full map falls back to

        def full(*args: Any) -> Any:
            raise lmdb.MapFullError("full")

        monkeypatch.setattr(backend, "_put_together", full)
    try:
        assert all(s is not None for s in backend.write_blocks(keys, data))
    finally:
        asyncio.run(backend.aclose())
    assert summed == keys  # each head made from the stored copy, in the transaction
    env = lmdb.open(str(tmp_path), max_dbs=8, lock=True)
    try:
        blocks, index = env.open_db(b"blocks"), env.open_db(b"index")
        with env.begin(write=True) as txn:
            for key, block in zip(keys, data):
                head, payload = encode_record(key, memoryview(block.numpy()), NoneCodec(), 1)
                assert txn.get(key, db=blocks) == bytes(payload)
                entry = txn.get(key, db=index)
                assert entry[INDEX.size :] == head
                assert entry[INDEX.size :] != lmdb_plain.UNSUMMED
            value = bytearray(txn.get(keys[2], db=blocks))
            value[1000] ^= 0x10
            txn.put(keys[2], bytes(value), db=blocks)
    finally:
        env.close()
    reads_all_but_one(_lmdb(tmp_path), keys, data, bad=2)


def test_concurrent_jobs_in_one_commit_each_get_their_own_heads(tmp_path: Path) -> None:
    """Jobs that share one commit (group commit) each get the heads of their own blocks."""
    import threading

    backend = _lmdb(tmp_path)
    jobs = [[make_key(100 * j + i) for i in range(3)] for j in range(4)]
    data = {k: random_block(FMT.block_bytes, 200 + n) for n, k in enumerate(k for job in jobs for k in job)}
    gate = threading.Barrier(len(jobs))

    def save(job: list[bytes]) -> None:
        gate.wait()
        assert None not in backend.write_blocks(job, [data[k] for k in job])

    try:
        threads = [threading.Thread(target=save, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        keys = list(data)
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * len(keys)
        assert all(torch.equal(o, data[k]) for o, k in zip(out, keys))
        env = backend._env  # type: ignore[attr-defined]
        with env.begin() as txn:
            for key in keys:
                head, _ = encode_record(key, memoryview(data[key].numpy()), NoneCodec(), 1)
                assert txn.get(key, db=backend._index)[INDEX.size :] == head  # type: ignore[attr-defined]
    finally:
        asyncio.run(backend.aclose())


JOINED_FMT = BlockFormat(block_bytes=16 << 10, dtype="bfloat16", namespace={"model_id": "m"})  # joined: under JOIN_MAX


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("shape", ["one transaction", "one per record"])
@pytest.mark.parametrize("built", ["commits idle", "a commit running"])
@pytest.mark.parametrize("damage", ["payload", "checksum", "head"])
def test_joined_saves_store_what_the_general_encoder_makes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str, path: str, built: str, damage: str) -> None:
    """A plain joined record of the general path is built from its row's view before the job
    waits for the write lock (the store's commits idle or a commit of another job running:
    ``GroupCommit.idle`` either way; the wait and LMDB's begin let the GIL go, in which the
    rows may move); either way, and in the one-per-record path a full map falls back to, with
    the extension's pass or the Python one, the store holds the bytes the general encoder
    makes, which read back; a flipped bit of the payload, the checksum or the head is a
    counted corrupt record, never served."""
    from kvtier.backends.group_commit import GroupCommit

    if path == "native" and xxcopy.xxh3_joined is not xxcopy.xxh3_joined_native:
        pytest.skip("the native extension is not built here")
    real = xxcopy.xxh3_joined_python if path == "python" else xxcopy.xxh3_joined
    monkeypatch.setattr(GroupCommit, "idle", lambda self: built == "commits idle")
    keys = [make_key(i) for i in range(N)]
    data = [random_block(JOINED_FMT.block_bytes, 40 + i) for i in range(N)]
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(tmp_path), sync_mode="fast")
    asyncio.run(backend.open(JOINED_FMT))
    joined: list[tuple[bytes, bool]] = []  # each record built: its key, and whether in the transaction
    lock = backend._write_lock  # type: ignore[attr-defined]  # (held through the write transaction)
    monkeypatch.setattr(xxcopy, "xxh3_joined", lambda head, key, view: joined.append((key, lock.locked())) or real(head, key, view))
    if shape == "one per record":

        def full(*args: Any) -> Any:
            raise lmdb.MapFullError("full")

        monkeypatch.setattr(backend, "_put_together", full)
    try:
        assert backend.write_blocks(keys, data) == [backend._pages(32 + JOINED_FMT.block_bytes)] * N  # type: ignore[attr-defined]
        assert backend.stats()["bytes_written"] == N * (32 + JOINED_FMT.block_bytes)
    finally:
        asyncio.run(backend.aclose())
    assert joined == [(key, False) for key in keys]  # each built once, before the transaction
    at = {"payload": 32 + 5000, "checksum": 27, "head": 3}[damage]
    env = lmdb.open(str(tmp_path), max_dbs=8, lock=True)
    try:
        blocks, index = env.open_db(b"blocks"), env.open_db(b"index")
        with env.begin(write=True) as txn:
            for key, block in zip(keys, data):
                head, payload = encode_record(key, memoryview(block.numpy()), NoneCodec(), 1)
                assert txn.get(key, db=blocks) == bytes(head) + bytes(payload)
                assert txn.get(key, db=index) is None  # joined: no entry
            value = bytearray(txn.get(keys[3], db=blocks))
            value[at] ^= 0x10
            txn.put(keys[3], bytes(value), db=blocks)
    finally:
        env.close()
    reopened = registry.backends.get("lmdb")(capacity=64 << 20, path=str(tmp_path), sync_mode="fast")
    asyncio.run(reopened.open(JOINED_FMT))
    reads_all_but_one(reopened, keys, data, bad=3)


def test_a_joined_job_of_one_record_is_built_before_its_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain joined job of the general path is built before its write transaction, of one
    record or of two (the transaction's wait lets the GIL go, in which the rows may move); both
    hold the general encoder's bytes."""
    real = xxcopy.xxh3_joined
    backend = registry.backends.get("lmdb")(capacity=64 << 20, path=str(tmp_path), sync_mode="fast")
    asyncio.run(backend.open(JOINED_FMT))
    built: list[tuple[bytes, bool]] = []
    lock = backend._write_lock  # type: ignore[attr-defined]
    monkeypatch.setattr(xxcopy, "xxh3_joined", lambda head, key, view: built.append((key, lock.locked())) or real(head, key, view))
    keys = [make_key(50 + i) for i in range(3)]
    data = [random_block(JOINED_FMT.block_bytes, 50 + i) for i in range(3)]
    try:
        assert None not in backend.write_blocks(keys[:1], data[:1])
        assert None not in backend.write_blocks(keys[1:], data[1:])
        assert built == [(keys[0], False), (keys[1], False), (keys[2], False)]
        env = backend._env  # type: ignore[attr-defined]
        with env.begin() as txn:
            for key, block in zip(keys, data):
                head, payload = encode_record(key, memoryview(block.numpy()), NoneCodec(), 1)
                assert txn.get(key, db=backend._blocks) == bytes(head) + bytes(payload)  # type: ignore[attr-defined]
    finally:
        asyncio.run(backend.aclose())
