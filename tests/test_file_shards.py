"""The ``file`` tier's shard directories (:mod:`kvtier.backends.file_root`): the first level made
once at open, and a known shard directory opened in one ``openat2``, with the outcome of the
level-by-level walk in every case (a directory gone, a symlink in its place, no ``openat2``)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=8192, dtype="bfloat16", namespace={"model_id": "m"})


def _open(path: Path, sync_mode: str = "durable") -> Backend:
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(path), sync_mode=sync_mode, layout="sharded")
    asyncio.run(backend.open(FMT))
    return backend


def _blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    return [random_block(FMT.block_bytes, seed * 100 + i) for i in range(n)]


def _shard(root: Path, key: bytes) -> Path:
    h = key.hex()
    return root / h[:2] / h[2:4]


def test_the_first_level_is_made_once_at_open_and_the_root_synced_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    made: list[str] = []
    synced: list[int] = []
    real_mkdir, real_fsync = os.mkdir, os.fsync

    def mkdir(path: str, *args: object, **kwargs: object) -> None:
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]
        made.append(os.fspath(path))

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    backend = _open(root)
    try:
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [f"{i:02x}" for i in range(256)]
        assert sorted(m for m in made if len(m) == 2) == [f"{i:02x}" for i in range(256)]
        # the meta record, its directory entry, then the 256 new directories' entries: one sync each
        assert len(synced) == 3
        made.clear()
        synced.clear()
        key = make_key(1)
        assert backend.write_blocks([key], _blocks(1)) == [backend.reserve_bytes()]
        assert made == [key.hex()[2:4]]  # only the second level is made by a write
        assert len(synced) == 2  # the new shard directory, and its parent that gained it
    finally:
        asyncio.run(backend.aclose())
    made.clear()
    synced.clear()
    backend = _open(root)  # reopened: nothing made, nothing synced
    try:
        assert made == [] and synced == []
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8)]
        assert backend.read_blocks([make_key(1)], out) == [True] and torch.equal(out[0], _blocks(1)[0])
    finally:
        asyncio.run(backend.aclose())


def test_a_known_shard_directory_is_opened_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(tmp_path / "store", "fast")
    if not backend._beneath.usable:  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())
        pytest.skip("NO OPENAT2 HERE: every shard directory takes the level-by-level walk")
    keys = [bytes([9, 9]) + make_key(i)[2:] for i in range(3)]
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (opened.append(os.fspath(path)), real_open(path, *a, **k))[1])
    try:
        assert None not in backend.write_blocks(keys[:1], _blocks(1))
        # one level at a time: the root, 09/, 09/09/ (missing, made, opened), then the temporary file
        assert len(opened) == 5 and opened[-1].endswith(".tmp")
        opened.clear()
        assert None not in backend.write_blocks(keys[1:], _blocks(2, seed=1))
        assert len(opened) == 2 and all(name.endswith(".tmp") for name in opened)  # only the files
    finally:
        monkeypatch.undo()
        asyncio.run(backend.aclose())


def _scenario(tmp_path: Path, name: str, openat2: bool) -> tuple[list[object], list[bool], list[str]]:
    """Write a key, change its shard directory behind the tier's back (``name``), write again
    and read back: the sizes, what was found, and the files under the test's folder."""
    base = tmp_path / ("fast" if openat2 else "walk")
    root, outside = base / "store", base / "outside"
    outside.mkdir(parents=True)
    backend = _open(root)
    if not backend._beneath.usable:  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())
        pytest.skip("NO OPENAT2 HERE: every shard directory takes the level-by-level walk")
    backend._beneath.usable = openat2  # type: ignore[attr-defined]  # (as when the kernel refuses it)
    keys = [make_key(1), bytes(make_key(1)[:2]) + make_key(2)[2:]]  # one shard directory
    try:
        assert None not in backend.write_blocks(keys[:1], _blocks(1))
        shard = _shard(root, keys[0])
        if name == "gone":
            shutil.rmtree(shard)
        elif name == "symlinked shard":
            shutil.rmtree(shard)
            shard.symlink_to(outside, target_is_directory=True)
        elif name == "symlinked parent":
            shutil.rmtree(shard.parent)
            shard.parent.symlink_to(outside, target_is_directory=True)
        elif name == "a file":
            shutil.rmtree(shard)
            shard.write_bytes(b"not a directory")
        sizes = backend.write_blocks(keys, _blocks(2, seed=1))
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        for o, b, f in zip(out, _blocks(2, seed=1), found):
            assert not f or torch.equal(o, b)
    finally:
        asyncio.run(backend.aclose())
    files = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file() and not p.is_symlink())
    return list(sizes), found, files


@pytest.mark.parametrize("name", ["kept", "gone", "symlinked shard", "symlinked parent", "a file"])
def test_a_known_shard_directory_is_written_as_the_level_by_level_walk_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    fast = _scenario(tmp_path, name, True)
    walk = _scenario(tmp_path, name, False)
    print(name, fast, walk)
    assert fast == walk
    sizes, found, files = fast
    if name in ("kept", "gone"):
        assert None not in sizes and found == [True, True]
    else:  # nothing is written through a symlink or over a file, and nothing lands outside
        assert sizes == [None, None] and found == [False, False]
        assert not [f for f in files if f.startswith("outside")]
