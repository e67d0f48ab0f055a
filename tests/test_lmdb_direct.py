"""The ``lmdb`` tier's straight reads looking keys up by LMDB's own get (``lmdb_direct``,
``backends/_lmdbdirect.c``) against python-lmdb's get and the general path: the same hits, bytes,
drops and counters on good, damaged and missing records, split and joined; the probe at the
open refusing what it was not written for, by name; and every job it cannot vouch for read by
python-lmdb's get. (The straight-read tests of ``test_lmdb_one_read`` run with both lookups.)"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_direct, lmdb_one, lmdb_plain
from kvtier.backends.lmdb_files import META_KEY
from lmdb_lookups import HookedEnv, damaged_store, layouts

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=8192, dtype="uint8")
_STATS = ("blocks_read", "bytes_read", "read_misses", "corrupt_records", "deleted")
_JOBS = [[0], [1], [4, 7], [0, 1, 4, 7], [2], [0, 3], [5], [6, 0], list(range(8)), [1, 1, 4]]

native = pytest.mark.skipif(
    lmdb_plain._rowguard is None or not hasattr(lmdb_plain._rowguard, "direct_probe") or lmdb.__version__ != lmdb_direct.LAYOUT_VERSION,
    reason="needs the native row guard and the python-lmdb the direct lookups were written for",
)

@pytest.fixture(autouse=True, params=["joined", "split"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    return layouts(monkeypatch, request.param)

def _open(path: Path) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path))
    asyncio.run(backend.open(FMT))
    return backend

def _jobs() -> int:
    return int(lmdb_plain._rowguard.direct_jobs())  # type: ignore[union-attr]

def _read(path: Path, keys: list[bytes], monkeypatch: pytest.MonkeyPatch, route: str) -> tuple[Any, ...]:
    """Each job of _JOBS read once by ``route`` (``direct``: LMDB's get; ``pyget``:
    python-lmdb's get; ``general``: the job reader) into rows a job of sound records saw
    first: what each found, the rows, the counters' moves, the keys listed after, and how many
    jobs the direct lookups read."""
    with monkeypatch.context() as patch:
        patch.setattr(lmdb_direct, "DIRECT_GETS", route == "direct")
        patch.setattr(lmdb_one, "STRAIGHT_READS", route != "general")
        backend = _open(path)
        try:
            rows = [[torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in job] for job in _JOBS]
            for job_rows in rows:
                assert backend.read_blocks([keys[0]] * len(job_rows), job_rows) == [True] * len(job_rows)
                for row in job_rows:
                    row.fill_(7)
            before, jobs = backend.stats(), _jobs()
            found = [backend.read_blocks([keys[i] for i in job], job_rows) for job, job_rows in zip(_JOBS, rows)]
            direct = _jobs() - jobs
            stats = {k: v - before[k] for k, v in backend.stats().items() if k in _STATS}
            listed = {r.key for r in backend.scan()}
        finally:
            asyncio.run(backend.aclose())
    return found, rows, stats, listed, direct

@native
@pytest.mark.parametrize("head_at", [0, 12])
def test_direct_lookups_find_drop_and_count_what_pythons_get_and_the_general_path_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, head_at: int) -> None:
    keys, data = damaged_store(tmp_path / "store", FMT, head_at=head_at)
    for route in ("direct", "pyget", "general"):
        shutil.copytree(tmp_path / "store", tmp_path / route)
    got = {route: _read(tmp_path / route, keys, monkeypatch, route) for route in ("direct", "pyget", "general")}
    for route, (found, _, stats, _, direct) in got.items():
        print(route, found, stats, "direct jobs", direct)
    direct, pyget, general = got["direct"], got["pyget"], got["general"]
    assert direct[0] == pyget[0] == general[0]
    assert direct[0][:4] == [[True], [False], [True, True], [True, False, True, True]]
    for job, hits, rows_d, rows_g in zip(_JOBS, general[0], direct[1], general[1]):
        for i, hit, d, g in zip(job, hits, rows_d, rows_g):
            if hit:
                assert torch.equal(d, data[i]) and torch.equal(g, data[i])
    assert direct[2] == pyget[2] == general[2] and general[2]["corrupt_records"] == 2
    assert direct[3] == pyget[3] == general[3] == {keys[i] for i in (0, 4, 5, 6, 7)}
    # The direct lookups read every job up to a record not raw and sound (the warm-up jobs too,
    # but those are before the count); python-lmdb's get and the general path none.
    assert direct[4] >= 4 and pyget[4] == 0 and general[4] == 0

@native
def test_the_probe_takes_this_python_lmdb_and_refuses_another_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(tmp_path / "store")
    try:
        straight = backend._straight  # type: ignore[attr-defined]
        assert straight.native_parts[-1] is not None  # probed sound at the open
        env, meta = backend._env, backend._meta  # type: ignore[attr-defined]
        blocks, index = backend._blocks, backend._index  # type: ignore[attr-defined]
        assert lmdb_direct.direct_gets(env, meta, META_KEY, blocks, index) is not None
        assert lmdb_direct.direct_gets(env, meta, META_KEY, blocks, index, version="3.0.1") is None
        assert lmdb_direct.direct_gets(env, meta, META_KEY, blocks, index, version="2.3.0") is None
        assert lmdb_direct.direct_gets(env, meta, b"not there", blocks, index) is None
        with monkeypatch.context() as patch:
            patch.setattr(xxcopy, "xxh3_check_copy", xxcopy.xxh3_check_copy_python)  # another check: not taken
            assert lmdb_direct.direct_gets(env, meta, META_KEY, blocks, index) is None
        with monkeypatch.context() as patch:
            patch.setattr(lmdb_direct, "_rowguard", None)  # built without the extension
            assert lmdb_direct.direct_gets(env, meta, META_KEY, blocks, index) is None
    finally:
        asyncio.run(backend.aclose())
    monkeypatch.setattr(lmdb_direct, "LAYOUT_VERSION", "0.0.0")  # a python-lmdb not read: python-lmdb's get
    backend = _open(tmp_path / "store")
    try:
        assert backend._straight.native_parts[-1] is None  # type: ignore[attr-defined]
        key, block = make_key(3), random_block(FMT.block_bytes, 3)
        backend.write_blocks([key], [block])
        row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        backend.read_blocks([key], [row])
        jobs = _jobs()
        row.zero_()
        assert backend.read_blocks([key, make_key(4)], [row, torch.zeros_like(row)]) == [True, False]
        assert torch.equal(row, block) and _jobs() == jobs
    finally:
        asyncio.run(backend.aclose())

@native
def test_the_probe_refuses_by_name_what_it_cannot_vouch_for(tmp_path: Path) -> None:
    backend = _open(tmp_path / "store")
    env, meta = backend._env, backend._meta  # type: ignore[attr-defined]
    blocks, index = backend._blocks, backend._index  # type: ignore[attr-defined]
    probe = lmdb_plain._rowguard.direct_probe  # type: ignore[union-attr]
    so_path = lmdb_direct._extension()
    assert so_path is not None
    check, check_c = xxcopy.xxh3_check_copy_native, lmdb_direct._xxcopy.check_copy_c  # type: ignore[union-attr]
    try:
        txn = env.begin(buffers=True)
        try:
            value = txn.get(META_KEY, db=meta)
            good = (env, txn, meta, META_KEY, value, txn.id(), blocks, index, so_path, check, check_c)
            assert probe(*good) is not None
            for at, bad, match in [
                (0, HookedEnv(env, lambda key: None), "env: not python-lmdb"),
                (1, env, "txn: not python-lmdb"),
                (4, bytes(value), "not where python-lmdb's get found it"),  # the same bytes, elsewhere
                (5, txn.id() + 1, "id is not txn.id"),
                (6, object(), "not databases of env"),
                (8, lmdb_plain._rowguard.__file__, "not one of python-lmdb's exported engines"),  # type: ignore[union-attr]
                (8, str(tmp_path / "no such library.so"), "so_path: not a library"),
            ]:
                args = list(good)
                args[at] = bad
                with pytest.raises(RuntimeError, match=match):
                    probe(*args)
            with pytest.raises(TypeError, match=r"takes 11 arguments"):
                probe(*good[:10])
        finally:
            txn.abort()
        other = lmdb.open(str(tmp_path / "other"), max_dbs=3)
        try:
            other_meta = other.open_db(b"meta")
            with other.begin(write=True) as wtxn:
                wtxn.put(META_KEY, b"x", db=other_meta)
            with other.begin(buffers=True) as otxn:
                ovalue = otxn.get(META_KEY, db=other_meta)
                with pytest.raises(RuntimeError, match="not databases of env"):  # another environment's
                    probe(other, otxn, other_meta, META_KEY, ovalue, otxn.id(), blocks, index, so_path, check, check_c)
        finally:
            other.close()
    finally:
        asyncio.run(backend.aclose())

@native
def test_a_stand_in_transaction_and_a_closed_environment_are_read_by_pythons_get(tmp_path: Path) -> None:
    key, block = make_key(1), random_block(FMT.block_bytes, 1)
    backend = _open(tmp_path / "store")
    env = backend._env  # type: ignore[attr-defined]
    try:
        backend.write_blocks([key], [block])
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(2)]
        assert backend.read_blocks([key, key], rows) == [True, True]
        jobs = _jobs()
        assert backend.read_blocks([key, key], rows) == [True, True] and _jobs() == jobs + 1
        looked: list[bytes] = []
        backend._env = HookedEnv(env, looked.append, reads_only=True)  # type: ignore[attr-defined]
        for row in rows:
            row.zero_()
        assert backend.read_blocks([key, key], rows) == [True, True]
        assert len(looked) >= 2 and set(looked) == {key} and _jobs() == jobs + 1  # python-lmdb's get, each hooked
        assert all(torch.equal(row, block) for row in rows)
    finally:
        backend._env = env  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())
    # python-lmdb's own close under the tier (the tier's close waits for its reads first): its
    # objects are no longer valid, so a job is python-lmdb's get's, which refuses it.
    backend = _open(tmp_path / "store")
    try:
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(2)]
        assert backend.read_blocks([key, key], rows) == [True, True]
        jobs = _jobs()
        backend._env.close()  # type: ignore[attr-defined]
        with pytest.raises(Exception):  # noqa: B017 (whatever the general path raises for a closed environment)
            backend.read_blocks([key, key], rows)
        assert _jobs() == jobs
    finally:
        asyncio.run(backend.aclose())

def test_the_reads_are_right_with_the_direct_lookups_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off (or not built): python-lmdb's get, the same outcome."""
    monkeypatch.setattr(lmdb_direct, "DIRECT_GETS", False)
    backend = _open(tmp_path / "store")
    try:
        assert backend._straight.native_parts[-1] is None  # type: ignore[attr-defined]
        keys = [make_key(i) for i in range(3)]
        blocks = [random_block(FMT.block_bytes, 10 + i) for i in range(3)]
        backend.write_blocks(keys[:2], blocks[:2])
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        for _ in range(2):
            assert backend.read_blocks(keys, rows) == [True, True, False]
        assert torch.equal(rows[0], blocks[0]) and torch.equal(rows[1], blocks[1])
    finally:
        asyncio.run(backend.aclose())



@native
def test_the_reference_copy_copies_what_pythons_get_finds_and_refuses_what_it_cannot_vouch_for(tmp_path: Path) -> None:
    """``direct_copy``, the benchmark's reference load (LMDB's get and memcpy, nothing else)."""
    env = lmdb.open(str(tmp_path / "raw"), max_dbs=3)
    try:
        db = env.open_db(b"blocks")
        keys = [make_key(i) for i in range(4)]
        values = [bytes(random_block(512, i).numpy()) for i in range(3)]
        with env.begin(write=True, db=db) as txn:
            for key, value in zip(keys, values):
                txn.put(key, value)
        direct = lmdb_direct.direct_gets(env, db, keys[0], db, db)
        assert direct is not None
        copy = lmdb_plain._rowguard.direct_copy  # type: ignore[union-attr]
        rows = [memoryview(bytearray(512)) for _ in keys]
        with env.begin(buffers=True, db=db) as txn:
            assert copy(direct, env, txn, db, keys, rows) == 3
            assert [bytes(r) for r in rows[:3]] == [bytes(txn.get(k)) for k in keys[:3]] == values
            assert bytes(rows[3]) == bytes(512)  # absent: untouched
            with pytest.raises(TypeError, match=r"keys\[1\] must be bytes"):
                copy(direct, env, txn, db, [keys[0], "k"], rows[:2])
            with pytest.raises(TypeError, match="lists of one length"):
                copy(direct, env, txn, db, keys, rows[:2])
        with pytest.raises(ValueError, match="valid, of one environment"):
            copy(direct, env, txn, db, keys, rows)  # the transaction is over
    finally:
        env.close()


@native
def test_the_reference_copy_refuses_an_environment_of_the_other_engine(tmp_path: Path) -> None:
    """python-lmdb picks its LMDB 0.9 or 1.0 engine per environment: a capsule probed on one
    engine's environment must not call that engine's get on the other's transaction (whose
    structs it does not know), it refuses the job by name."""
    opened = []
    for version in (0, 1):
        env = lmdb.open(str(tmp_path / f"v{version}"), max_dbs=3, lib_version=version)
        db = env.open_db(b"blocks")
        with env.begin(write=True, db=db) as txn:
            txn.put(make_key(0), bytes([version + 1]) * 512)
        opened.append((env, db))
    copy = lmdb_plain._rowguard.direct_copy  # type: ignore[union-attr]
    try:
        for (probed, probed_db), (other, other_db) in (opened, opened[::-1]):
            direct = lmdb_direct.direct_gets(probed, probed_db, make_key(0), probed_db, probed_db)
            assert direct is not None
            row = memoryview(bytearray(512))
            with other.begin(buffers=True, db=other_db) as txn:
                with pytest.raises(ValueError, match="of the probed engine"):
                    copy(direct, other, txn, other_db, [make_key(0)], [row])
            assert bytes(row) == bytes(512)
            with probed.begin(buffers=True, db=probed_db) as txn:  # its own engine's: copied
                assert copy(direct, probed, txn, probed_db, [make_key(0)], [row]) == 1 and bytes(row) == bytes(txn.get(make_key(0)))
    finally:
        for env, _ in opened:
            env.close()


@native
def test_the_reference_copy_writes_only_inside_a_contiguous_live_row(tmp_path: Path) -> None:
    """``direct_copy`` writes a row's bytes from its buffer's start: a strided or reversed
    memoryview (whose start is not its lowest byte) or a released one is refused by name, never
    written past (before: a reversed row's copy wrote the bytes after it, here the rest of its
    bytearray; a released one's, freed memory)."""
    env = lmdb.open(str(tmp_path / "raw"), max_dbs=3)
    try:
        db = env.open_db(b"blocks")
        key = make_key(0)
        with env.begin(write=True, db=db) as txn:
            txn.put(key, bytes(random_block(512, 0).numpy()))
        direct = lmdb_direct.direct_gets(env, db, key, db, db)
        assert direct is not None
        copy = lmdb_plain._rowguard.direct_copy  # type: ignore[union-attr]
        whole = bytearray(1024)
        released = memoryview(bytearray(512))
        released.release()
        with env.begin(buffers=True, db=db) as txn:
            for row in (memoryview(whole)[:512][::-1], memoryview(whole)[::2], released):
                with pytest.raises((TypeError, ValueError), match=r"rows\[0\]|released"):
                    copy(direct, env, txn, db, [key], [row])
                assert whole == bytearray(1024)
    finally:
        env.close()
