"""A tier without the secret on a keyed store: refused at open with an error naming the key
setting, and the store's records left as they were (a local tier that opened would drop every
keyed record it read, since it can check none of them)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ConfigError
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "keyed-open"})
SECRET = "fleet-secret-for-tests-0123456789"


def _tier(name: str, path: Path, **options: object) -> Backend:
    return registry.backends.get(name)(capacity=64 << 20, path=str(path), **options)


@pytest.mark.parametrize("name", ["lmdb", "file"])
def test_unkeyed_tier_is_refused_on_a_keyed_store_and_its_records_stay(name: str, tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(3)]
    data = [random_block(FMT.block_bytes, i) for i in range(3)]
    keyed = _tier(name, tmp_path, mac_key=SECRET)
    asyncio.run(keyed.open(FMT))
    try:
        assert None not in keyed.write_blocks(keys, data)
    finally:
        asyncio.run(keyed.aclose())
    plain = _tier(name, tmp_path)
    with pytest.raises(ConfigError, match=r"keyed with aes-gmac.*no mac_key.*mac_key_env"):
        asyncio.run(plain.open(FMT))
    asyncio.run(plain.aclose())
    keyed = _tier(name, tmp_path, mac_key=SECRET)
    asyncio.run(keyed.open(FMT))
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert keyed.read_blocks(keys, out) == [True, True, True]
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        assert keyed.stats()["deleted"] == 0
    finally:
        asyncio.run(keyed.aclose())
