"""``delete_blocks`` of the local tiers (cpu, compressed, lmdb, file, and a head-group tier over
them) refuses malformed keys by name before it deletes anything, as a remote tier's does
(``tests/test_remote_delete_input.py``): a key of another length or type never reaches the
store, and the well-formed keys of the same call stay stored. A head-group tier maps a block
key to its records' keys by the key's last 8 bytes: a 33-byte key whose first 32 are a stored
key named that key's records, so deleting it dropped a block nobody asked to delete."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_head_groups import _grouped

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import InvalidKeyError
from kvtier.testing import make_key, random_block

BLOCK = 4096
FMT = BlockFormat(block_bytes=BLOCK, dtype="bfloat16", namespace={"model_id": "delete-input"})


def _tier(name: str, **options: object) -> Callable[[Path], Backend]:
    def make(path: Path) -> Backend:
        where = {"path": str(path / name)} if name in ("lmdb", "file") else {}
        return registry.backends.get(name)(capacity=64 * BLOCK, **where, **options)  # type: ignore[no-any-return]

    return make


TIERS: dict[str, Callable[[Path], Backend]] = {
    "cpu": _tier("cpu"),
    "compressed": _tier("compressed"),
    "lmdb": _tier("lmdb", sync_mode="fast"),
    "file-flat": _tier("file", sync_mode="fast", layout="flat"),
    "file-sharded": _tier("file", sync_mode="fast", layout="sharded"),
    "groups-lmdb": lambda path: _grouped(registry.backends.get("lmdb")(capacity=256 * BLOCK, path=str(path / "lmdb"), sync_mode="fast")),
    "groups-file": lambda path: _grouped(registry.backends.get("file")(capacity=256 * BLOCK, path=str(path / "file"), sync_mode="fast")),
    "groups-compressed": lambda path: _grouped(registry.backends.get("compressed")(capacity=256 * BLOCK)),
}


@contextmanager
def _opened(tier: str, path: Path) -> Iterator[Backend]:
    backend = TIERS[tier](path)
    asyncio.run(backend.open(FMT))
    try:
        yield backend
    finally:
        asyncio.run(backend.aclose())


def _stored(backend: Backend, keys: list[bytes], data: list[torch.Tensor]) -> list[bool]:
    """Per key, whether it reads back with exactly its bytes."""
    out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in keys]
    found = backend.read_blocks(keys, out)
    return [ok and torch.equal(got, want) for ok, got, want in zip(found, out, data)]


def _bad(case: str, key: bytes) -> object:
    return {
        "short": key[:31],
        "long": key + b"x",  # its first 32 bytes are a stored key
        "hex": key.hex().encode(),
        "str": key.hex(),
        "bytearray": bytearray(key),
        "none": None,
    }[case]


@pytest.mark.parametrize("case", ["short", "long", "hex", "str", "bytearray", "none"])
@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_delete_of_a_malformed_key_is_refused_by_name_and_deletes_nothing(tmp_path: Path, tier: str, case: str) -> None:
    with _opened(tier, tmp_path) as backend:
        keys = [make_key(i) for i in range(6)]
        data = [random_block(BLOCK, i) for i in range(6)]
        assert all(s is not None for s in backend.write_blocks(keys, data))
        deleted = backend.stats()["deleted"]
        with pytest.raises(InvalidKeyError, match=r"keys\[1\]"):
            backend.delete_blocks([keys[0], _bad(case, keys[1])])
        assert _stored(backend, keys, data) == [True] * 6  # nothing deleted, the well-formed key either
        assert backend.stats()["deleted"] == deleted
        backend.delete_blocks([keys[0], keys[1]])  # well-formed keys are deleted as before
        assert _stored(backend, keys, data) == [False, False, True, True, True, True]


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_single_key_where_a_sequence_belongs_is_refused(tmp_path: Path, tier: str) -> None:
    with _opened(tier, tmp_path) as backend:
        keys = [make_key(i) for i in range(2)]
        data = [random_block(BLOCK, i) for i in range(2)]
        backend.write_blocks(keys, data)
        with pytest.raises(InvalidKeyError, match="single bytes"):
            backend.delete_blocks(keys[0])
        assert _stored(backend, keys, data) == [True, True]
