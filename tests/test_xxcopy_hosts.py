"""A host whose CPU has no vector path (an ARM server, an x86 without AVX2) imports
:mod:`kvtier.records.xxcopy` with every function on its pure-Python path: the copy, the joined
record and the one-call check. Other tests compare each function with its native twin, one at a
time; here the whole set an ARM host runs saves and reads stores end to end, damage included,
against the native set on the same blocks: the same stored bytes, the same hits, misses,
corrupt counts and deletions, and the right bytes in every row found."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_layout, lmdb_one
from kvtier.backends.lmdb_entries import INDEX
from lmdb_lookups import damaged_store, layouts, read_as_damaged
from test_file_plain_reads import _damaged_store, _read, _record

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.records import xxcopy

pytestmark = pytest.mark.skipif(not xxcopy.NATIVE, reason="without the extension every host is on the Python path already")

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


@contextmanager
def on_host(kind: str) -> Iterator[None]:
    """``native``: this host's own functions; ``arm``: xxcopy as a host with no vector path
    imports it (the extension there reports only its scalar path)."""
    if kind == "native":
        yield
        return
    from kvtier.records import _xxcopy  # type: ignore[attr-defined]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_xxcopy, "path", "scalar")
        importlib.reload(xxcopy)
        try:
            assert xxcopy.PATH == "python" and not xxcopy.fused()
            assert xxcopy.xxh3_copy is xxcopy.xxh3_copy_python and xxcopy.xxh3_joined is xxcopy.xxh3_joined_python
            assert xxcopy.xxh3_check_copy is xxcopy.xxh3_check_copy_python
            yield
        finally:
            mp.undo()
            importlib.reload(xxcopy)
    assert xxcopy.xxh3_check_copy is not xxcopy.xxh3_check_copy_python


def _lmdb_values(path: Path, keys: list[bytes]) -> list[tuple[bytes, bytes | None]]:
    """Each key's stored value and its index entry's head (``None``: joined, no entry), the
    stamp left out."""
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=False)
    try:
        blocks, index = env.open_db(b"blocks", create=False), env.open_db(b"index", create=False)
        with env.begin() as txn:
            got = []
            for key in keys:
                entry = txn.get(key, db=index)
                got.append((bytes(txn.get(key, db=blocks)), None if entry is None else bytes(entry[INDEX.size :])))
            return got
    finally:
        env.close()


@pytest.mark.parametrize("layout", ["joined", "split"])
def test_an_arm_host_saves_and_reads_an_lmdb_store_as_this_one_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    layouts(monkeypatch, layout)
    seen: dict[str, Any] = {}
    for kind in ("native", "arm"):
        with on_host(kind):
            for way in ("straight", "tight", "general"):
                path = tmp_path / f"{kind}-{way}"
                keys, data = damaged_store(path, FMT, head_at=12)
                stored = _lmdb_values(path, [keys[i] for i in (0, 4, 7)])
                monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", way == "straight")
                monkeypatch.setattr(lmdb_layout, "ONE_PASS_READS", way != "general")
                backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path))
                asyncio.run(backend.open(FMT))
                try:
                    out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in keys]
                    backend.read_blocks(keys[:1], out[:1])  # the row views are known from here
                    found = backend.read_blocks(keys, out)
                    stats = backend.stats()
                finally:
                    asyncio.run(backend.aclose())
                read_as_damaged(found, out, data, stats)
                seen[kind, way] = stored, found, {k: stats[k] for k in ("blocks_read", "read_misses", "corrupt_records", "deleted")}
    for way in ("straight", "tight", "general"):
        assert seen["arm", way] == seen["native", way], way


@pytest.mark.parametrize("plain", [True, False])
def test_an_arm_host_saves_and_reads_a_file_store_as_this_one_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain: bool) -> None:
    seen: dict[str, Any] = {}
    for kind in ("native", "arm"):
        with on_host(kind):
            root = tmp_path / kind / "store"
            root.parent.mkdir()
            keys, data = _damaged_store(root, tmp_path / kind / "outside")
            stored = [_record(root, keys[i], "flat").read_bytes() for i in (0, 2, 8)]
            found, out, stats, _ = _read(root, keys, plain, monkeypatch)
            assert found[0] and found[8] and not found[1] and not found[2]  # 2: a flipped payload bit
            assert torch.equal(out[0], data[0]) and torch.equal(out[8], data[8])
            assert stats["corrupt_records"] >= 1
            seen[kind] = stored, found, stats, [bytes(o.numpy()) for i, o in enumerate(out) if found[i]]
    assert seen["arm"] == seen["native"]
