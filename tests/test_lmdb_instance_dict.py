"""An ``lmdb`` tier's instance dict stays small enough for CPython to share its keys between
instances (at most 30 in CPython 3.11), so that the lookups of its methods and attributes on
every job stay specialized; past that its dict is a plain one and each job pays for generic
lookups. The attributes every job reads are slots (``LmdbBackend.__slots__``), which behave as
the dict's did: set, read, replaced and deleted alike, and absent until set."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from kvtier.backends.lmdb_tier import LmdbBackend

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.pool_rows import PoolRows
from kvtier.testing import make_key, random_block

#: CPython's limit on the keys a class's instances share (Objects/dictobject.c,
#: SHARED_KEYS_MAX_SIZE); a store is kept a few keys under it.
SHARED_KEYS = 30
SIZE = 4096


def test_an_open_store_that_has_read_and_saved_keeps_its_dict_under_the_shared_key_limit(tmp_path: Path) -> None:
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(tmp_path / "store"))
    asyncio.run(backend.open(BlockFormat(block_bytes=SIZE, dtype="uint8")))
    try:
        keys = [make_key(i) for i in range(3)]
        blocks = [random_block(SIZE, i) for i in range(3)]
        assert None not in backend.write_blocks(keys[:1], blocks[:1])  # a lone save
        assert None not in backend.write_blocks(keys[1:], blocks[1:])  # a job save
        pool = torch.zeros((3, SIZE), dtype=torch.uint8)
        assert backend.read_blocks(keys, PoolRows(pool, range(3))) == [True, True, True]
        assert backend.read_blocks(keys[:1], [pool[0]]) == [True]
        assert all(torch.equal(pool[i], blocks[i]) for i in range(3))
        held = vars(backend)
        assert len(held) < SHARED_KEYS - 2, sorted(held)
        for name in LmdbBackend.__slots__:  # the slots are not in the dict, and are set
            assert name not in held
            getattr(backend, name)
    finally:
        asyncio.run(backend.aclose())
    assert len(vars(backend)) < SHARED_KEYS - 2


def test_the_slots_read_write_and_delete_as_attributes_do(tmp_path: Path) -> None:
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(tmp_path / "store"))
    assert backend._env is None and backend._straight is None and backend._closed is False
    backend.mac = "replaced"  # type: ignore[assignment]
    assert backend.mac == "replaced"
    del backend.mac
    with pytest.raises(AttributeError):
        backend.mac  # noqa: B018
    with pytest.raises(AttributeError):
        backend.not_an_attribute  # type: ignore[attr-defined]  # noqa: B018
    backend.not_an_attribute = 1  # type: ignore[attr-defined]  # (the dict still takes others)
    assert vars(backend)["not_an_attribute"] == 1
