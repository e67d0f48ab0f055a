"""Persistence through the store: a new process serves what an earlier one stored, eviction
order survives a restart, and LMDB's own overhead never turns churn into failed stores."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import kvtier
from kvtier.testing import make_key

LAYERS, SHAPE = 2, (16, 2, 4, 32)


def make_caches(seed: int, num_blocks: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, *SHAPE, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def block_bytes() -> int:
    return LAYERS * 16 * 2 * 4 * 32 * 2


def lmdb_config(path: Path, blocks: int, first: str = "cpu") -> dict:
    tiers = [{"backend": "lmdb", "path": str(path), "capacity": blocks * (block_bytes() + 8192)}]
    if first == "cpu":
        tiers.insert(0, {"backend": "cpu", "capacity": 8 * block_bytes()})
    return {"tiers": tiers, "write": "through", "namespace": {"model_id": "persist-test"}}


async def test_a_new_process_serves_blocks_an_earlier_one_stored(tmp_path: Path) -> None:
    kv = make_caches(seed=1)
    keys = [make_key(i) for i in range(6)]
    async with kvtier.open(lmdb_config(tmp_path / "db", 32), kv_caches=kv) as store:
        assert await store.save(keys, list(range(6))) == 6
    want = [[t[i].float().sum().item() for t in kv] for i in range(6)]
    digest = [bytes(torch.cat([t[i].flatten().view(torch.uint8) for t in kv]).numpy()).hex() for i in range(6)]
    script = textwrap.dedent(
        f"""
        import asyncio, json, sys, torch, kvtier
        from kvtier.testing import make_key
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_persistence import lmdb_config, make_caches
        from pathlib import Path

        async def main():
            kv = [torch.zeros_like(t) for t in make_caches(seed=1)]
            keys = [make_key(i) for i in range(6)]
            async with kvtier.open(lmdb_config(Path({str(tmp_path / "db")!r}), 32), kv_caches=kv) as store:
                hits = await store.lookup(keys)
                loaded = await store.load(keys, [20, 21, 22, 23, 24, 25])
                tiers = [d.tier for d in await store.lookup_detail(keys)]
                out = [bytes(torch.cat([t[20 + i].flatten().view(torch.uint8) for t in kv]).numpy()).hex() for i in range(6)]
                print(json.dumps({{"hits": hits, "loaded": loaded, "blocks": out, "tiers_after": tiers}}))

        asyncio.run(main())
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["hits"] == 6 and result["loaded"] == 6
    assert result["blocks"] == digest
    # Served from the disk tier, then promoted into the empty memory tier (8 slots).
    assert result["tiers_after"] == [0] * 6
    assert len(want) == 6


async def test_eviction_order_survives_a_restart(tmp_path: Path) -> None:
    kv = make_caches(seed=2)
    keys = [make_key(100 + i) for i in range(16)]
    cfg = lmdb_config(tmp_path / "db", 16, first="none")
    cfg["write"] = "back"
    async with kvtier.open(cfg, kv_caches=kv) as store:
        usable = store.manager.tier_spec(0).capacity_bytes // store.manager.tier_spec(0).block_reserve  # type: ignore[union-attr]
        keys = keys[:usable]
        assert len(keys) >= 3
        for i, key in enumerate(keys):
            assert await store.save([key], [i]) == 1
        # Use the oldest block again: it becomes the most recent.
        assert await store.load(keys[:1], [10]) == 1
        before = store.manager.tier_keys(0)  # type: ignore[union-attr]
    assert before[-1] == keys[0]
    async with kvtier.open(cfg, kv_caches=kv) as store:
        after = store.manager.tier_keys(0)  # type: ignore[union-attr]
    assert after == before


async def test_churn_through_a_small_lmdb_tier_never_fails_a_store(tmp_path: Path) -> None:
    kv = make_caches(seed=3)
    cfg = lmdb_config(tmp_path / "db", 24, first="none")
    cfg["write"] = "back"
    async with kvtier.open(cfg, kv_caches=kv) as store:
        stored = 0
        for start in range(0, 240, 6):
            stored += await store.save([make_key(1000 + start + j) for j in range(6)], list(range(6)))
        stats = store.stats()
    assert stored == 240
    assert stats["store_failed"] == 0
    assert stats["backends"][0]["write_failures"] == 0
    assert stats["tiers"][0]["ready"] > 0


async def test_a_layout_change_under_an_explicit_namespace_is_never_served(tmp_path: Path) -> None:
    """Issue 11, item 2: a Namespace given without kv_layout still gets the layout checked."""
    import pytest

    from kvtier.errors import ConfigError

    ns = kvtier.Namespace(model_id="layout-test", dtype="bfloat16", block_size=16)
    cfg = lmdb_config(tmp_path / "db", 16, first="none")
    kv = make_caches(seed=4)
    keys = [make_key(300 + i) for i in range(4)]
    async with kvtier.open(cfg, kv_caches=kv, namespace=ns) as store:
        assert await store.save(keys, [0, 1, 2, 3]) == 4
        assert store.namespace.kv_layout.endswith(store.layout.fingerprint())  # type: ignore[union-attr]
    # The same bytes per block and the same dtype, another shape: the old records are not this layout's.
    reshaped = [t.reshape(t.shape[0], 16, 4, 2, 32).contiguous() for t in make_caches(seed=5)]
    hits = 0
    with pytest.raises(ConfigError, match="namespace") as info:
        async with kvtier.open(cfg, kv_caches=reshaped, namespace=ns) as store:
            hits = await store.lookup(keys)
    print(f"layout change: {hits} hits, refused at open: {info.value}")
    assert hits == 0
    # The original layout still opens and serves its blocks.
    async with kvtier.open(cfg, kv_caches=make_caches(seed=6), namespace=ns) as store:
        assert await store.lookup(keys) == 4


def _readme_config(path: Path, **extra: object) -> dict:
    """The README's shape: a host-memory tier in front of LMDB, in write-back mode (what a clean
    close and ``flush`` write back)."""
    return {
        "write": "back",
        "tiers": [{"backend": "cpu", "capacity": 8 * block_bytes()}, {"backend": "lmdb", "path": str(path), "capacity": 64 * (block_bytes() + 8192)}],
        "namespace": {"model_id": "flush-test"},
        **extra,
    }


async def test_a_clean_close_writes_memory_tiers_back_to_disk(tmp_path: Path) -> None:
    """Issue 11, item 1: with the README's configuration a second process found 0 blocks."""
    kv = make_caches(seed=7)
    keys = [make_key(700 + i) for i in range(6)]
    async with kvtier.open(_readme_config(tmp_path / "db"), kv_caches=kv) as store:
        assert await store.save(keys, list(range(6))) == 6
        in_lmdb_before_close = sum(store.manager.holds(k, 1) for k in keys)  # type: ignore[union-attr]
    fresh = [torch.zeros_like(t) for t in kv]
    async with kvtier.open(_readme_config(tmp_path / "db"), kv_caches=fresh) as store:
        hits = await store.lookup(keys)
        loaded = await store.load(keys, [10, 11, 12, 13, 14, 15])
    print(f"write-back at close: {in_lmdb_before_close} of 6 on disk before close, {hits} hits and {loaded} loaded after")
    assert in_lmdb_before_close == 0 and hits == 6 and loaded == 6
    for i in range(6):
        assert all(torch.equal(f[10 + i], t[i]) for f, t in zip(fresh, kv))


async def test_flush_is_bounded_skips_what_is_there_and_keeps_the_accounting(tmp_path: Path) -> None:
    kv = make_caches(seed=8)
    keys = [make_key(800 + i) for i in range(6)]
    async with kvtier.open(_readme_config(tmp_path / "db", flush_on_close_s=0), kv_caches=kv) as store:
        assert await store.save(keys, list(range(6))) == 6
        first = await store.flush(budget_bytes=2 * block_bytes())
        second = await store.flush()
        third = await store.flush()
        row = store.stats()["tiers"][1]
        on_disk = sorted(r.key for r in store.backends[1].scan())
    print(f"flush: {first.flushed} then {second.flushed} (skipped {second.already_there}) then {third.flushed}")
    assert (first.flushed, first.left, first.stopped_by) == (2, 4, "bytes")
    assert (second.flushed, second.already_there) == (4, 2)
    assert (third.flushed, third.already_there) == (0, 6)
    assert row["ready"] == 6 and on_disk == sorted(keys)  # the manager knows what the tier holds
    # flush_on_close_s=0: no write-back at close, and a flushed store needed none
    async with kvtier.open(_readme_config(tmp_path / "db"), kv_caches=kv) as store:
        assert await store.lookup(keys) == 6


async def test_no_write_back_when_disabled(tmp_path: Path) -> None:
    kv = make_caches(seed=9)
    keys = [make_key(900 + i) for i in range(3)]
    async with kvtier.open(_readme_config(tmp_path / "db", flush_on_close_s=0), kv_caches=kv) as store:
        assert await store.save(keys, [0, 1, 2]) == 3
    async with kvtier.open(_readme_config(tmp_path / "db"), kv_caches=kv) as store:
        assert await store.lookup(keys) == 0
