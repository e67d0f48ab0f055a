"""The default write mode: every stored block is written through to the persistent tier in the
store job's tier phase, so a crash loses only what was still queued; when the tier writes fall
behind, blocks fall back one by one to write-back demotion (counted), and none is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
import kvtier.config  # the tests below name kvtier.config: imported here, not by whichever test ran first
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


def test_the_write_through_backlog_is_a_setting() -> None:
    tiers = [{"backend": "cpu", "capacity": "1MiB"}]
    assert kvtier.config.load_config({"tiers": tiers}).write_through_backlog == 16
    assert kvtier.config.load_config({"tiers": tiers, "write_through_backlog": 0}).write_through_backlog == 0
    with pytest.raises(kvtier.ConfigError, match="write_through_backlog"):
        kvtier.config.load_config({"tiers": tiers, "write_through_backlog": -1})


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
        store.transfers.write_through_backlog = -1  # always behind: every copy is deferred
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


def _crashing_writer(path: Path, fd: int, durable: bool = False) -> None:
    async def run() -> None:
        caches = _caches()
        store = await kvtier.open(_config(caches, path, first=16), kv_caches=caches)
        if durable:
            assert store.transfers is not None
            store.transfers.write_through_backlog = -1  # always behind: only durable saves are written through
        for i in range(8):
            assert await store.save([K[i]], [i], durable=durable) == 1
            os.write(fd, b"%d\n" % i)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush

    asyncio.run(run())


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="needs fork and SIGKILL")
@pytest.mark.parametrize("durable", [False, True])
async def test_a_sigkill_after_saves_loses_nothing_under_the_default_mode(tmp_path: Path, durable: bool) -> None:
    """Eight saves into a store whose memory tier holds them all, then SIGKILL: with the
    default write mode every saved block is in the LMDB tier when the process dies. With
    ``durable=True`` that holds even when the tier writes are behind."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            _crashing_writer(tmp_path / "kv", write, durable)
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


class _Gate:
    """Holds the lmdb tier's writes until released, so store jobs pile up behind one; records
    the keys of each write."""

    def __init__(self, backend: Any) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.writes: list[list[bytes]] = []
        real = backend.write_blocks

        def write_blocks(keys: Any, blocks: Any) -> Any:
            self.writes.append(list(keys))
            if not self.release.is_set():
                self.entered.set()
                self.release.wait(60)
            return real(keys, blocks)

        backend.write_blocks = write_blocks


async def _until(check: Any) -> None:
    for _ in range(6000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def _three_saves(store: Any, base: int, durable: bool) -> _Gate:
    """Save K[base] and, while its write is held, K[base + 1] and K[base + 2] one by one."""
    gate = _Gate(store.backends[1])
    first = asyncio.create_task(store.save([K[base]], [base], durable=durable))
    assert await asyncio.to_thread(gate.entered.wait, 60)
    rest = [asyncio.create_task(store.save([K[base + i]], [base + i], durable=durable)) for i in (1, 2)]
    await _until(lambda: store.transfers._tier_jobs == 3)
    gate.release.set()
    assert await asyncio.gather(first, *rest) == [1, 1, 1]
    return gate


async def test_write_through_is_deferred_only_when_more_than_the_backlog_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``write_through_backlog`` counts the jobs waiting behind the group being written: with 0
    and groups of one job, a job alone is written through; of two jobs queued behind a slow
    write, the first (one waits behind it) is deferred and the last (none behind it) is written
    through. With ``durable=True`` nothing is deferred."""
    from kvtier.transfer import movers

    monkeypatch.setattr(movers, "MAX_GROUP_JOBS", 1)
    caches = _caches()
    async with kvtier.open(_config(caches, tmp_path / "kv", first=16, write_through_backlog=0), kv_caches=caches) as store:
        transfers = store.transfers
        assert transfers is not None and transfers.write_through_backlog == 0
        assert await store.save(K[:2], [0, 1]) == 2
        assert transfers.counters["write_through_deferred"] == 0  # alone: nothing waits behind it
        assert {r.key for r in store.backends[1].scan()} == set(K[:2])
        await _three_saves(store, 2, durable=False)
        on_disk = {r.key for r in store.backends[1].scan()}
        assert K[2] in on_disk and K[3] not in on_disk and K[4] in on_disk
        await _three_saves(store, 5, durable=True)
        assert set(K[5:8]) <= {r.key for r in store.backends[1].scan()}
        assert transfers.counters["write_through_deferred"] == 1
        assert store.stats()["saved_memory_only"] == 1


async def test_store_jobs_that_wait_together_share_one_write(tmp_path: Path) -> None:
    """Two saves queued behind a slow write are taken as one group: their write-through copies
    go to the tier in one ``write_blocks`` call (one commit), nothing is deferred, and both are
    on disk when their saves return."""
    caches = _caches()
    async with kvtier.open(_config(caches, tmp_path / "kv", first=16, write_through_backlog=0), kv_caches=caches) as store:
        gate = await _three_saves(store, 0, durable=False)
        assert gate.writes == [[K[0]], [K[1], K[2]]]
        assert store.stats()["transfers"]["write_through_deferred"] == 0
        assert set(K[:3]) <= {r.key for r in store.backends[1].scan()}
        want = [c[:3].clone() for c in caches]
        for c in caches:
            c.zero_()
        assert await store.load(K[:3], [0, 1, 2], promote=False) == 3
        assert all(torch.equal(c[:3], w) for c, w in zip(caches, want))


async def test_a_durable_save_counts_only_what_reached_a_persistent_tier(tmp_path: Path) -> None:
    caches = _caches()
    async with kvtier.open(_config(caches, tmp_path / "kv", first=16, write="back"), kv_caches=caches) as store:
        assert await store.save(K[:2], [0, 1], durable=True) == 0  # write-back: stored in memory only
        assert await store.lookup(K[:2]) == 2
        assert store.stats()["saved_memory_only"] == 2
    memory_only = {"tiers": [{"backend": "cpu", "capacity": 16 * _block_bytes(caches)}], "namespace": {"model_id": "write-modes"}}
    async with kvtier.open(memory_only, kv_caches=caches) as store:
        with pytest.raises(kvtier.ConfigError, match="persistent tier"):
            await store.save(K[:2], [0, 1], durable=True)
        assert await store.lookup(K[:2]) == 0
