"""Wrong layouts are refused at open (or at the call, for duplicate block ids), naming the shape
and what was expected; nothing stored is touched."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import kvtier
from kvtier.errors import LayoutError

CFG: dict[str, Any] = {"tiers": [{"backend": "cpu", "capacity": "16MiB"}]}


def _open(caches: Any, ns: kvtier.Namespace | None = None, **cfg: Any) -> None:
    """Open and close a store over ``caches``: ``ns`` is the caller's namespace, ``cfg`` more config."""

    async def go() -> None:
        async with kvtier.open({**CFG, **cfg}, kv_caches=caches, namespace=ns):
            pass

    asyncio.run(go())


def test_tokens_per_block_that_the_namespace_contradicts_are_refused() -> None:
    caches = [torch.zeros(8, 32, 2, 4, 8, dtype=torch.bfloat16)]  # 32 tokens per block
    with pytest.raises(LayoutError, match=r"kv_caches\[0\]: shape \(8, 32, 2, 4, 8\) has no dimension of 16 tokens"):
        _open(caches, namespace={"model_id": "m", "block_size": 16})  # a config's namespace says 16
    with pytest.raises(LayoutError, match="has no dimension of 64 tokens"):
        _open(caches, kvtier.Namespace(model_id="m", block_size=64))
    _open(caches, kvtier.Namespace(model_id="m", block_size=32))  # the right one opens


def test_a_namespace_dtype_other_than_the_caches_is_refused() -> None:
    caches = [torch.zeros(8, 16, 4, 8, dtype=torch.bfloat16)]
    with pytest.raises(LayoutError, match=r"kv_caches\[0\]: dtype bfloat16, but the namespace says dtype 'float16'"):
        _open(caches, kvtier.Namespace(model_id="m", dtype="float16"))
    with pytest.raises(LayoutError, match="dtype bfloat16, but the namespace says dtype 'float32'"):
        _open(caches, namespace={"model_id": "m", "dtype": "float32"})
    _open([torch.zeros(8, 64, dtype=torch.uint8)], kvtier.Namespace(model_id="m", dtype="float16"))  # raw bytes: not checked


def test_a_kv_first_tensor_is_refused_at_open_not_at_the_first_save() -> None:
    kv_first = [torch.zeros(2, 8, 16, 4, 8, dtype=torch.bfloat16)]  # (K/V, blocks, tokens, heads, dim)
    with pytest.raises(LayoutError, match=r"kv_caches\[0\]: shape \(2, 8, 16, 4, 8\) looks K/V-first"):
        _open(kv_first, kvtier.Namespace(model_id="m"))
    _open([torch.zeros(8, 2, 16, 4, 8, dtype=torch.bfloat16)], kvtier.Namespace(model_id="m"))  # blocks first: fine


def test_duplicate_block_ids_in_a_load_are_refused_and_nothing_changes() -> None:
    caches = [torch.randn(8, 16, 4, 8).to(torch.bfloat16)]
    ns = kvtier.Namespace(model_id="m")

    async def go() -> None:
        async with kvtier.open(CFG, kv_caches=caches, namespace=ns) as store:
            keys = kvtier.block_keys(list(range(32)), block_size=16, namespace=store.namespace)
            assert await store.save(keys, [0, 1]) == 2
            before = caches[0].clone()
            with pytest.raises(LayoutError, match=r"block_ids\[1\]: engine block id 5 appears twice \(also at block_ids\[0\]\)"):
                await store.load(keys, [5, 5])
            assert torch.equal(caches[0], before) and await store.lookup(keys) == 2
            assert await store.load(keys, [5, 6]) == 2 and torch.equal(caches[0][5:7], caches[0][0:2])

    asyncio.run(go())
