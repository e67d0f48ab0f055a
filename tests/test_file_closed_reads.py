"""A ``file`` tier closed while a read is under way (the read took the tier's one-pass reader,
then the close let the root's descriptor go): the one-pass read leaves its records to the
general path (which refuses a closed tier by name), on the native and the Python read, in either
layout; it never hands the closed descriptor's number to ``openat`` as a ``ValueError`` or a
read of whatever directory the number names next."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block


@pytest.mark.parametrize("layout", ["flat", "sharded"])
@pytest.mark.parametrize("way", ["native", "python"])
def test_a_read_that_outlives_the_tiers_close_is_left_to_the_general_path(tmp_path: Path, layout: str, way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if way == "python":
        monkeypatch.setattr(xxcopy, "xxh3_read_check_at", xxcopy.xxh3_read_check_at_python)
        monkeypatch.setattr(xxcopy, "xxh3_read_check", xxcopy.xxh3_read_check_python)
    fmt = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path), sync_mode="fast", layout=layout)
    asyncio.run(backend.open(fmt))
    keys = [make_key(i) for i in range(3)]
    backend.write_blocks(keys, [random_block(fmt.block_bytes, 40 + i) for i in range(3)])
    out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
    assert backend.read_blocks(keys, out) == [True, True, True]
    assert backend.read_blocks(keys[:1], out[:1]) == [True]  # (the row's view is kept)
    plain = backend._plain
    assert plain is not None
    asyncio.run(backend.aclose())
    found = [False] * 3
    assert plain.read(keys, out, found) == [0, 1, 2]
    assert found == [False, False, False]
    assert plain.read_one(keys[0], out[0], backend.counters) is None


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_a_read_that_outlives_the_tiers_close_reads_nothing_of_a_store_opened_since(tmp_path: Path, layout: str) -> None:
    """The closed root's descriptor number is handed out again (here to another store's root):
    the closed tier's one-pass read must not open its records beneath it."""
    fmt = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
    first = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path / "a"), sync_mode="fast", layout=layout)
    asyncio.run(first.open(fmt))
    keys = [make_key(i) for i in range(2)]
    out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
    first.write_blocks(keys, [random_block(fmt.block_bytes, 40 + i) for i in range(2)])
    assert first.read_blocks(keys, out) == [True, True]
    assert first.read_blocks(keys[:1], out[:1]) == [True]
    plain = first._plain
    assert plain is not None
    asyncio.run(first.aclose())
    second = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path / "b"), sync_mode="fast", layout=layout)
    asyncio.run(second.open(fmt))
    try:
        second.write_blocks(keys, [random_block(fmt.block_bytes, 50 + i) for i in range(2)])
        found = [False] * 2
        assert plain.read(keys, out, found) == [0, 1]
        assert found == [False, False]
        assert plain.read_one(keys[0], out[0], first.counters) is None
    finally:
        asyncio.run(second.aclose())
