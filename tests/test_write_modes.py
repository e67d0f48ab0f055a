"""The default write mode: every stored block is written through to the persistent tier in the
store job's tier phase, so a crash loses only what was still queued; when the tier writes fall
behind, blocks fall back one by one to write-back demotion (counted), and none is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier.manager import Demotion, TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key

K = [make_key(i) for i in range(64)]
BLOCK = 100
NUM_BLOCKS = 32


def _caches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(NUM_BLOCKS, 2, 8, 16, generator=g) for _ in range(2)]


def _block_bytes(caches: list[torch.Tensor]) -> int:
    return sum(c[0].numel() * c.element_size() for c in caches)


def _config(caches: list[torch.Tensor], path: Path, first: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "tiers": [
            {"backend": "cpu", "capacity": first * _block_bytes(caches)},
            {"backend": "lmdb", "path": str(path), "capacity": "16MiB"},
        ],
        "namespace": {"model_id": "write-modes"},
        **extra,
    }


def test_the_default_write_mode_is_through() -> None:
    assert kvtier.config.load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}]}).write == "through"


def test_a_write_through_victim_without_a_copy_below_is_demoted() -> None:
    """Write-through mode falls back to write-back for a block whose copy never reached the
    lower tier; a block with its copy there is simply dropped from the first tier."""
    specs = [
        TierSpec("cpu", 2 * BLOCK, BLOCK, LRUPolicy(2)),
        TierSpec("disk", 8 * BLOCK, BLOCK, LRUPolicy(8), persistent=True),
    ]
    m = TierManager(specs, write="through")
    plan = m.prepare_store(K[:2])
    assert plan is not None and plan.write_through == ((1, (K[0], K[1])),)
    m.complete_store(plan.keys, failed={1: [K[0]]})  # K[0]'s copy was deferred or failed
    assert not m.holds(K[0], 1) and m.holds(K[1], 1)
    plan = m.prepare_store(K[2:4])  # evicts K[0] and K[1]
    assert plan is not None
    assert plan.demotions == (Demotion(0, 1, (K[0],)),)
    assert plan.drops == ((0, (K[1],)),)
    m.complete_store(plan.keys)
    assert m.lookup(K[:4]) == 4
    assert m.lookup_detail([K[0]])[0].tier == 1


async def test_blocks_fall_back_to_write_back_when_the_tier_writes_are_behind(tmp_path: Path) -> None:
    caches = _caches()
    want = [c[:12].clone() for c in caches]
    async with kvtier.open(_config(caches, tmp_path / "kv"), kv_caches=caches) as store:
        assert store.transfers is not None
        store.transfers.write_through_backlog = 0  # always behind: every copy is deferred
        assert await store.save(K[:4], [0, 1, 2, 3]) == 4
        assert store.stats()["transfers"]["write_through_deferred"] == 4
        assert [r.key for r in store.backends[1].scan()] == []  # nothing written through
        store.transfers.write_through_backlog = 4
        assert await store.save(K[4:8], [4, 5, 6, 7]) == 4  # evicts K[0:4]: demoted, not lost
        assert await store.lookup(K[:8]) == 8
        assert {r.key for r in store.backends[1].scan()} == set(K[:8])
        for c in caches:
            c.zero_()
        assert await store.load(K[:8], list(range(8)), promote=False) == 8
        assert all(torch.equal(c[:8], w[:8]) for c, w in zip(caches, want))


def _crashing_writer(path: Path, fd: int) -> None:
    async def run() -> None:
        caches = _caches()
        store = await kvtier.open(_config(caches, path, first=16), kv_caches=caches)
        for i in range(8):
            assert await store.save([K[i]], [i]) == 1
            os.write(fd, b"%d\n" % i)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush

    asyncio.run(run())


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="needs fork and SIGKILL")
async def test_a_sigkill_after_saves_loses_nothing_under_the_default_mode(tmp_path: Path) -> None:
    """Eight saves into a store whose memory tier holds them all, then SIGKILL: with the
    default write mode every saved block is in the LMDB tier when the process dies."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            _crashing_writer(tmp_path / "kv", write)
        finally:
            os._exit(1)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        saved = [int(line) for line in f.read().split()]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert saved == list(range(8))
    caches = _caches()
    want = [c[:8].clone() for c in caches]
    async with kvtier.open(_config(caches, tmp_path / "kv", first=16), kv_caches=caches) as store:
        assert await store.lookup(K[:8]) == 8
        for c in caches:
            c.zero_()
        assert await store.load(K[:8], list(range(8)), promote=False) == 8
        assert all(torch.equal(c[:8], w) for c, w in zip(caches, want))
