"""Crash and fault injection for the persistent tiers.

The kill test forks a writer that stores blocks in a loop and reports each key on a pipe only
after ``write_blocks`` returned (i.e. once the block is durable), SIGKILLs it at a random moment,
then reopens the store in the parent: open must never fail, every reported block must be present
and byte-exact, and no other record may ever be served with wrong bytes.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import DiskError
from kvtier.testing import make_key, random_block

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="needs fork and SIGKILL")

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "crash"})
PER_ROUND = 1000  # key space per round; a writer never gets near it before being killed


def _seed(round_: int, i: int) -> int:
    return round_ * PER_ROUND + i


def _block(seed: int) -> torch.Tensor:
    return random_block(FMT.block_bytes, seed)


def _backend(name: str, path: Path) -> Backend:
    return registry.backends.get(name)(capacity=256 << 20, path=str(path))


def _writer(name: str, path: Path, round_: int, fd: int) -> None:
    backend = _backend(name, path)
    asyncio.run(backend.open(FMT))
    i = 0
    rng = random.Random(round_)
    while i < PER_ROUND - 4:
        n = rng.randint(1, 3)
        seeds = [_seed(round_, i + j) for j in range(n)]
        sizes = backend.write_blocks([make_key(s) for s in seeds], [_block(s) for s in seeds])
        done = [s for s, size in zip(seeds, sizes) if size is not None]
        if done:
            os.write(fd, b"".join(b"%d\n" % s for s in done))
        i += n


def _run_round(name: str, path: Path, round_: int, rng: random.Random) -> list[int]:
    """Fork a writer, kill it at a random moment, return the seeds it reported as stored."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            _writer(name, path, round_, w)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    wanted = rng.randint(0, 12)
    buf = b""
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while buf.count(b"\n") < wanted:
            chunk = pipe.read(4096)
            if not chunk:
                break
            buf += chunk
        time.sleep(rng.uniform(0, 0.004))  # land anywhere: mid-put, mid-commit, mid-sync, mid-rename
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "writer died on its own"
        buf += pipe.read()  # lines written before the kill are complete writes too
    return [int(line) for line in buf.split()]


def _check_store(name: str, path: Path, reported: set[int], all_seeds: dict[bytes, int]) -> None:
    backend = _backend(name, path)
    asyncio.run(backend.open(FMT))  # must never fail after a crash
    try:
        listed = {r.key for r in backend.scan()}
        must = {make_key(s) for s in reported}
        assert must <= listed, "a block reported stored is missing from scan"
        keys = sorted(listed | must)
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        for key, ok, got in zip(keys, found, out):
            assert key in all_seeds, "a record under a key nobody wrote"
            if key in must:
                assert ok, "a block reported stored is not served"
            if ok:
                assert torch.equal(got, _block(all_seeds[key])), "wrong bytes served"
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.parametrize(("name", "rounds"), [("lmdb", 50), ("file", 20)])
def test_kill_9_never_loses_reported_blocks_or_serves_bad_ones(name: str, rounds: int, tmp_path: Path) -> None:
    rng = random.Random(1234)
    path = tmp_path / name
    reported: set[int] = set()
    all_seeds: dict[bytes, int] = {}
    for round_ in range(rounds):
        all_seeds.update({make_key(_seed(round_, i)): _seed(round_, i) for i in range(PER_ROUND)})
        reported.update(_run_round(name, path, round_, rng))
        _check_store(name, path, reported, all_seeds)
    assert len(reported) > rounds  # the writers really did get blocks in before dying


def test_file_sync_failure_fails_the_write_and_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend("file", tmp_path / "store")
    asyncio.run(backend.open(FMT))
    try:
        assert backend.write_blocks([make_key(1)], [_block(1)]) != [None]

        def eio(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", eio)
        assert backend.write_blocks([make_key(2)], [_block(2)]) == [None]
        monkeypatch.undo()
        assert backend.stats()["write_failures"] == 1
        assert not list((tmp_path / "store").rglob("*.tmp"))
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(2)]
        assert backend.read_blocks([make_key(1), make_key(2)], out) == [True, False]
        assert torch.equal(out[0], _block(1))
    finally:
        asyncio.run(backend.aclose())


def test_lmdb_disk_error_on_put_fails_only_that_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmdb

    backend = _backend("lmdb", tmp_path / "env")
    asyncio.run(backend.open(FMT))
    try:
        module = sys.modules[type(backend).__module__]
        real_put = module.LmdbBackend._put
        calls = {"n": 0}

        def flaky(self: Backend, env: object, key: bytes, record: memoryview, stored: int) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise lmdb.DiskError("injected ENOSPC")
            real_put(self, env, key, record, stored)

        monkeypatch.setattr(module.LmdbBackend, "_put", flaky)
        keys = [make_key(i) for i in range(3)]
        sizes = backend.write_blocks(keys, [_block(i) for i in range(3)])
        assert sizes[0] is not None and sizes[1] is None and sizes[2] is not None
        assert backend.stats()["write_failures"] == 1
        assert backend.read_blocks(keys, [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]) == [True, False, True]
    finally:
        asyncio.run(backend.aclose())


def test_lmdb_failed_sync_raises_disk_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmdb

    backend = _backend("lmdb", tmp_path / "env")
    asyncio.run(backend.open(FMT))
    try:
        env = backend._env  # type: ignore[attr-defined]

        class FailingSync:
            def __getattr__(self, name: str) -> object:
                return getattr(env, name)

            def sync(self, force: bool = False) -> None:
                raise lmdb.DiskError("injected EIO")

        monkeypatch.setattr(backend, "_env", FailingSync())
        with pytest.raises(DiskError, match="sync") as info:
            backend.write_blocks([make_key(1)], [_block(1)])
        assert isinstance(info.value.__cause__, lmdb.Error)
    finally:
        monkeypatch.undo()
        asyncio.run(backend.aclose())


# -- item 10: keyed records on stores others can write to -------------------------------------

MAC_SECRET = "fleet-secret-for-tests-0123456789"


def _plant_forgery(name: str, path: Path, key: bytes, raw: torch.Tensor) -> None:
    """What anyone with write access can do: a well-formed record with a valid checksum."""
    plain = _backend(name, path)
    asyncio.run(plain.open(FMT))
    try:
        assert plain.write_blocks([key], [raw]) != [None]
    finally:
        asyncio.run(plain.aclose())


@pytest.mark.parametrize("name", ["lmdb", "file"])
def test_keyed_store_serves_no_forged_record(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_FAULT_SECRET", MAC_SECRET)
    path = tmp_path / name

    def keyed_backend() -> Backend:
        return registry.backends.get(name)(capacity=64 << 20, path=str(path), mac_key_env="KV_FAULT_SECRET")

    good = [make_key(i) for i in range(4)]
    keyed = keyed_backend()
    asyncio.run(keyed.open(FMT))
    try:
        assert None not in keyed.write_blocks(good, [_block(i) for i in range(4)])
    finally:
        asyncio.run(keyed.aclose())
    forged = make_key(100)
    _plant_forgery(name, path, forged, _block(999))
    keys = [*good, forged]
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    # A reader without the secret cannot check keyed records: misses, never served.
    plain = _backend(name, path)
    asyncio.run(plain.open(FMT))
    try:
        assert plain.read_blocks(good[:1], out[:1]) == [False]
    finally:
        asyncio.run(plain.aclose())
    keyed = keyed_backend()
    asyncio.run(keyed.open(FMT))
    try:
        found = keyed.read_blocks(keys[1:], out[1:])
        stats = keyed.stats()
        print(f"{name}: served {sum(found)} keyed, refused {stats['auth_failures']} forged, deleted {stats['deleted']}")
        assert found == [True, True, True, False]
        assert all(torch.equal(out[i], _block(i)) for i in range(1, 4))
        assert stats["auth_failures"] == 1 and stats["corrupt_records"] == 1
    finally:
        asyncio.run(keyed.aclose())
