"""kvtier as a block store, without a connector: save an engine's KV blocks, then load them in a new store.

``python examples/store_only.py [config.yaml]`` (default: examples/kvtier.yaml next to this file).
The second store is opened from the same file, as a restarted process would be, and serves the
blocks from the LMDB tier.
"""

import asyncio
import sys
from pathlib import Path

import torch

import kvtier

CONFIG = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("kvtier.yaml"))


async def main() -> None:
    # The engine's paged KV cache: one tensor per layer, block dimension first (64 blocks of 16 tokens).
    # Seeded: K/V are a function of the tokens, so a second run stores the same bytes under the same keys.
    torch.manual_seed(0)
    caches = [torch.randn(64, 16, 2, 4, 32).to(torch.bfloat16) for _ in range(4)]
    namespace = kvtier.Namespace(model_id="example-model", dtype="bfloat16", block_size=16)
    tokens = list(range(100, 164))  # 64 tokens: 4 full blocks
    keys = kvtier.block_keys(tokens, block_size=16, namespace=namespace)

    async with kvtier.open(CONFIG, kv_caches=caches, namespace=namespace) as store:
        saved = await store.save(keys, block_ids=[0, 1, 2, 3])  # engine blocks -> tiers
        print(f"saved {saved} blocks; lookup finds {await store.lookup(keys)}")
    # The config writes through to LMDB, so a new store (a restarted engine) loads from there.
    expected = [cache[0:4].clone() for cache in caches]
    async with kvtier.open(CONFIG, kv_caches=caches, namespace=namespace) as store:
        loaded = await store.load(keys, block_ids=[10, 11, 12, 13])  # tiers -> engine blocks
        print(f"new store: loaded {loaded} blocks into engine blocks 10-13")
        assert all(torch.equal(cache[10:14], want) for cache, want in zip(caches, expected)), "wrong bytes"
        print("byte-exact: yes")


asyncio.run(main())
