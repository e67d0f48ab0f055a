"""A job save's records written into the room LMDB's own put reserves (``_rowguard.put_reserved``,
``lmdb_lone.RESERVED_PUTS``) against the same job built and put through python-lmdb
(``put_joined``): the same bytes stored, read back by the tier, by ``kvtier verify`` and by the
salvage walk; what it refuses to take it leaves untouched, and a failure in it fails the
transaction, which the general commit then retries. The tier-level comparisons (full maps,
closed stores, refused transactions, torch modes, bad rows) run in tests/test_lmdb_job_save.py,
whose first form is this one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import lmdb_entries, lmdb_lone
from kvtier.backends.lmdb_salvage import SalvagedRecord, salvage_records

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.keys import KEY_BYTES
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
from kvtier.tools.offline import verify_tier

_rowguard = pytest.importorskip("kvtier.backends._rowguard")


def _open(path: Path, fmt: BlockFormat, capacity: int = 16 << 20) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=capacity, path=str(path), sync_mode="fast")
    asyncio.run(backend.open(fmt))
    if backend._lone is None or backend._lone.direct is None:  # type: ignore[attr-defined]
        pytest.skip("LMDB's own put is not probed sound here (lmdb_direct.direct_gets)")
    return backend


def _dump(backend: Backend) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """Every record of ``blocks``, and the keys of ``index``."""
    env = backend._env  # type: ignore[attr-defined]
    with env.begin() as txn:
        return (
            [(bytes(k), bytes(v)) for k, v in txn.cursor(db=backend._blocks)],  # type: ignore[attr-defined]
            [bytes(k) for k, _ in txn.cursor(db=backend._index)],  # type: ignore[attr-defined]
        )


def _plan(backend: Backend, block_bytes: int) -> list[Any]:
    """Jobs saved over split records, over joined ones, with a key twice: what they answered."""
    rows = [torch.zeros(block_bytes, dtype=torch.uint8) for _ in range(16)]
    keys = [make_key(i) for i in range(24)]
    backend.write_blocks(keys[:16], rows)  # the rows' views are kept from now on
    with pytest.MonkeyPatch.context() as split:
        split.setattr(lmdb_entries, "JOIN_MAX", 0)  # saved split: an index entry each
        backend.write_blocks(keys[16:20], rows[:4])
    for i, row in enumerate(rows):
        row.copy_(random_block(block_bytes, i))
    got = [backend.write_blocks(keys[8:24], rows), backend.write_blocks([keys[0], keys[1], keys[0]], rows[3:6])]
    rows[2].copy_(random_block(block_bytes, 99))
    got.append(backend.write_blocks(keys[:3], rows[:3]))
    return got


@pytest.mark.parametrize("block_bytes", [4096, 65536])  # 64 KiB: written without the GIL
def test_reserved_puts_store_what_put_joined_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_bytes: int) -> None:
    fmt = BlockFormat(block_bytes=block_bytes, dtype="uint8")
    outcomes = []
    for reserved in (True, False):
        monkeypatch.setattr(lmdb_lone, "RESERVED_PUTS", reserved)
        backend = _open(tmp_path / str(reserved), fmt)
        try:
            jobs = _rowguard.reserved_jobs()
            sizes = _plan(backend, block_bytes)
            ran = _rowguard.reserved_jobs() - jobs
            out = [torch.zeros(block_bytes, dtype=torch.uint8) for _ in range(24)]
            found = backend.read_blocks([make_key(i) for i in range(24)], out)
            outcomes.append((sizes, _dump(backend), found, [bytes(o.numpy()) for o in out], ran))
        finally:
            asyncio.run(backend.aclose())
    fast, slow = outcomes
    assert fast[4] == 3 and slow[4] == 0  # the three jobs of several keys, written reserved on one arm only
    assert fast[:4] == slow[:4]
    (records, index), found, read = fast[1], fast[2], fast[3]
    assert len(records) == 24 and index == [] and all(found)  # the split entries saved over are gone
    assert read[2] == bytes(random_block(block_bytes, 99).numpy()) and read[0] == read[8] == bytes(random_block(block_bytes, 0).numpy())


def test_reserved_records_pass_verify_and_the_salvage_walk(tmp_path: Path) -> None:
    fmt = BlockFormat(block_bytes=4096, dtype="uint8")
    backend = _open(tmp_path / "store", fmt)
    try:
        jobs = _rowguard.reserved_jobs()
        _plan(backend, 4096)
        assert _rowguard.reserved_jobs() - jobs == 3
        stored = dict(_dump(backend)[0])
    finally:
        asyncio.run(backend.aclose())
    report = verify_tier(tmp_path / "store")
    assert report.checked == 24 and report.bad == []
    salvaged: list[SalvagedRecord] = []

    def put(batch: list[SalvagedRecord]) -> bool:
        salvaged.extend(batch)
        return True

    kept, refused, why, _ = salvage_records(str(tmp_path / "store"), fmt, None, put)
    assert (kept, refused, why) == (24, 0, None)
    assert {r.key: r.value for r in salvaged} == stored


def _env(tmp_path: Path) -> tuple[Backend, Any, bytes, list[bytes], list[memoryview]]:
    fmt = BlockFormat(block_bytes=4096, dtype="uint8")
    backend = _open(tmp_path / "store", fmt)
    keys = [make_key(i) for i in range(3)]
    views = [memoryview(random_block(4096, i).numpy()) for i in range(3)]  # type: ignore[arg-type]
    return backend, backend._lone.direct, backend._lone.head, keys, views  # type: ignore[attr-defined]


def _put(backend: Backend, direct: Any, txn: Any, head: Any, keys: Any, views: Any, index: bool = False) -> Any:
    return _rowguard.put_reserved(direct, backend._env, txn, backend._blocks, backend._index, index, head, keys, views)  # type: ignore[attr-defined]


def test_put_reserved_writes_the_bytes_xxh3_joined_builds(tmp_path: Path) -> None:
    backend, direct, head, keys, views = _env(tmp_path)
    env = backend._env  # type: ignore[attr-defined]
    try:
        with env.begin(write=True) as txn:
            assert _put(backend, direct, txn, head, keys, views) is True  # lists taken as the tuples they hold now
            assert _put(backend, direct, txn, head, (), ()) is True
        assert dict(_dump(backend)[0]) == {k: xxcopy.xxh3_joined_python(head, k, v) for k, v in zip(keys, views)}
    finally:
        asyncio.run(backend.aclose())


def test_put_reserved_takes_nothing_it_cannot_write_as_probed(tmp_path: Path) -> None:
    """``False`` with nothing put: a transaction or environment not python-lmdb's own, a key not
    bytes, a view not a contiguous memoryview or not of the others' length, a released one."""
    backend, direct, head, keys, views = _env(tmp_path)
    env = backend._env  # type: ignore[attr-defined]
    released = memoryview(bytearray(4096))
    released.release()
    try:
        with env.begin(write=True) as txn:

            class StandIn:
                def put(self, *args: Any) -> bool:
                    raise AssertionError("not called")

            assert _rowguard.put_reserved(None, env, txn, backend._blocks, backend._index, False, head, keys, views) is False  # type: ignore[attr-defined]
            assert _rowguard.put_reserved(direct, env, StandIn(), backend._blocks, backend._index, False, head, keys, views) is False  # type: ignore[attr-defined]
            for bad_keys, bad_views in (
                ([keys[0], bytearray(keys[1]), keys[2]], views),
                (keys, [views[0], bytearray(4096), views[2]]),
                (keys, [views[0], views[1][:100], views[2]]),
                (keys, [views[0], memoryview(bytes(8192))[::2], views[2]]),
                (keys, [views[0], released, views[2]]),
            ):
                assert _put(backend, direct, txn, head, bad_keys, bad_views) is False
            with pytest.raises(ValueError, match="3 keys but 2 views"):
                _put(backend, direct, txn, head, keys, views[:2])
            with pytest.raises(TypeError, match="head a bytes"):
                _put(backend, direct, txn, bytearray(head), keys, views)
        assert _dump(backend)[0] == []
    finally:
        asyncio.run(backend.aclose())


def test_put_reserved_writes_only_into_the_environment_it_probed(tmp_path: Path) -> None:
    """A capsule probed on one store's environment, given another's (of the same type, with a
    live write transaction and its own databases): ``False``, nothing put, as the lookups refuse
    an environment other than the probed one. Before, the other store was written through the
    probe of the first."""
    backend, direct, head, keys, views = _env(tmp_path / "a")
    other, _, _, _, _ = _env(tmp_path / "b")
    env = other._env  # type: ignore[attr-defined]
    try:
        with env.begin(write=True) as txn:
            assert _rowguard.put_reserved(direct, env, txn, other._blocks, other._index, False, head, keys, views) is False  # type: ignore[attr-defined]
        assert _dump(other)[0] == []
    finally:
        asyncio.run(backend.aclose())
        asyncio.run(other.aclose())


def test_put_reserved_fails_where_lmdb_refuses_the_put(tmp_path: Path) -> None:
    """A read-only transaction (LMDB answers EACCES), a full map: an error, the transaction's to
    abort; nothing stored."""
    backend, direct, head, keys, views = _env(tmp_path)
    env = backend._env  # type: ignore[attr-defined]
    try:
        with env.begin() as txn, pytest.raises(RuntimeError, match=r"put of keys\[0\] failed \(code 13\)"):
            _put(backend, direct, txn, head, keys, views)
        many = [make_key(i) for i in range(10_000)]
        txn = env.begin(write=True)
        with pytest.raises(RuntimeError, match=r"failed \(code -30792\)"):  # MDB_MAP_FULL
            _put(backend, direct, txn, head, many, [views[0]] * len(many))
        txn.abort()
        assert _dump(backend)[0] == []
    finally:
        asyncio.run(backend.aclose())


def test_a_key_too_long_for_the_build_fails_before_its_bytes_are_written(tmp_path: Path) -> None:
    """The job is refused before its first put: a transaction committed after the error holds
    nothing of it (no room reserved and left unwritten, holding whatever the page held)."""
    backend, direct, head, keys, views = _env(tmp_path)
    env = backend._env  # type: ignore[attr-defined]
    try:
        txn = env.begin(write=True)
        with pytest.raises(ValueError, match=r"keys\[1\]: head and key are 324 bytes"):
            _put(backend, direct, txn, head, [keys[0], bytes(300)], views[:2])
        txn.commit()
        assert _dump(backend)[0] == [] and len(keys[0]) == KEY_BYTES
        assert _rowguard.direct_ops(env) == (0, 0)  # the refused job is not left counted in flight
    finally:
        asyncio.run(backend.aclose())


def test_a_job_saved_while_xxh3_joined_is_not_the_native_build_is_put_joined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its records are built by whatever ``xxh3_joined`` is then, as on the general path."""
    backend, _, _, keys, _ = _env(tmp_path)
    rows = [random_block(4096, i) for i in range(3)]
    built: list[bytes] = []

    def joined(h: Any, key: bytes, view: Any) -> bytes:
        built.append(key)
        return xxcopy.xxh3_joined_python(h, key, view)

    try:
        backend.write_blocks(keys, rows)  # the rows' views are kept from now on
        jobs = _rowguard.reserved_jobs()
        monkeypatch.setattr(xxcopy, "xxh3_joined", joined)
        monkeypatch.setattr(lmdb_lone, "put_joined", lmdb_lone.put_joined_python)
        assert None not in backend.write_blocks(keys, rows)
        assert built == keys and _rowguard.reserved_jobs() == jobs
    finally:
        asyncio.run(backend.aclose())
