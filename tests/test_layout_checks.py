"""Wrong layouts are refused at open (or at the call, for duplicate block ids), naming the shape
and what was expected; nothing stored is touched."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
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


def test_overlapping_kv_tensors_are_refused_naming_both() -> None:
    """Two layers whose bytes overlap would make a load's result depend on the order of its
    copies (the native scatter and the per-tensor one wrote different bytes): refused."""
    x = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)
    with pytest.raises(LayoutError, match=r"kv_caches\[1\] overlaps kv_caches\[0\]: bytes 128\.\.384 of one storage"):
        kvtier.KVLayout([x[0:12], x[4:16]])
    with pytest.raises(LayoutError, match=r"kv_caches\[2\] overlaps kv_caches\[0\]"):
        kvtier.KVLayout([x[0:4], x[8:12], x[0:4]])  # one tensor given twice
    with pytest.raises(LayoutError, match=r"kv_caches\[1\] overlaps kv_caches\[0\]: bytes 64\.\.128 "):
        kvtier.KVLayout([x[2:6], x[0:4]])  # the later one starts first
    a = np.zeros((16, 8), dtype=np.float32)  # two torch storages over one numpy array
    with pytest.raises(LayoutError, match=r"kv_caches\[1\] overlaps kv_caches\[0\]: 256 bytes at "):
        kvtier.KVLayout([torch.from_numpy(a[0:12]), torch.from_numpy(a[4:16])])
    with pytest.raises(LayoutError, match=r"overlaps"):
        _open([x[0:12], x[4:16]], kvtier.Namespace(model_id="m"))


def test_views_of_one_buffer_that_do_not_overlap_are_accepted() -> None:
    """vLLM's and SGLang's caches are such views (one allocation cut into layers, K and V)."""
    buf = torch.zeros(3 * 12 * 8, dtype=torch.bfloat16)
    layers = [buf[i * 96 : (i + 1) * 96].view(12, 8) for i in range(3)]  # touching, never overlapping
    layout = kvtier.KVLayout(list(reversed(layers)))
    assert layout.num_engine_blocks == 12 and layout.block_bytes == 3 * 16
    kv = torch.zeros(2, 12, 16, dtype=torch.float16)
    kvtier.KVLayout([kv[0], kv[1]])  # K and V of one (2, blocks, ...) tensor
    _open(layers, kvtier.Namespace(model_id="m"))
