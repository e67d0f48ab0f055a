"""vLLM's scheduler looks a block up in one call and prepares its load in a later one; a shared
tier's follower may forget the block in between (another engine deleted it, the server evicted
it). The load must then be a load error for that block (vLLM recomputes it), never an exception
in vLLM's step, and every other block of it loads as usual."""

from __future__ import annotations

from pathlib import Path

import torch
from vllm_world import lmdb, open_world

from kvtier.testing import make_key

K = [make_key(900 + i) for i in range(8)]


async def test_a_block_forgotten_between_vllms_lookup_and_its_load_is_a_load_error(tmp_path: Path) -> None:
    w = await open_world(2, [lmdb(tmp_path)])
    try:
        w.store(K[:4], [0, 1, 2, 3])
        assert all(w.manager.lookup_key(key) for key in K[:4])  # vLLM's lookup: every block a hit
        for store in w.stores:  # the record goes (another engine deleted it) ...
            store.backends[0].delete_blocks([K[2]])
        assert w.manager.remove([K[2]], 0) == [K[2]]  # ... and the tier's follower forgets it
        lookups = w.manager.counters["lookups"]
        failed = w.load(K[:4], [8, 9, 10, 11])  # vLLM's prepare_load, the ranks' loads, complete_load
        assert w.manager.counters["lookups"] == lookups  # preparing the load looked nothing up
        assert failed == {10}  # the forgotten block is a load error on the ranks: recomputed
        for r in range(w.world):
            for t in w.caches[r]:
                assert torch.equal(t[8:10], t[0:2]) and torch.equal(t[11], t[3])
        assert w.manager.lookup(K[:4]) == 2 and not w.manager.lookup_key(K[2])
        idle = w.idle()
        assert idle["pins"] == 0 and idle["pending"] == 0 and idle["partly_pinned_loads"] == 0, idle
        # Its record back (another engine stored it again, the follower adopted it): it loads.
        w.store(K[2:3], [2])
        assert w.load(K[:4], [8, 9, 10, 11]) == set()
        for r in range(w.world):
            for t in w.caches[r]:
                assert torch.equal(t[8:12], t[0:4])
    finally:
        await w.close()


async def test_a_load_whose_every_block_was_forgotten_pins_nothing_and_fails_every_block(tmp_path: Path) -> None:
    w = await open_world(1, [lmdb(tmp_path)])
    try:
        w.store(K[:2], [0, 1])
        for key in K[:2]:
            w.stores[0].backends[0].delete_blocks([key])
        assert w.manager.remove(K[:2], 0) == K[:2]
        assert w.load(K[:2], [5, 6]) == {5, 6}
        assert w.idle()["pins"] == 0 and w.side.table_sizes()["partly_pinned_loads"] == 0
    finally:
        await w.close()
