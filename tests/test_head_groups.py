"""Head-group records: engines of any TP size read and write each other's records.

Below any engine: each "rank" is a KVStore over its shard of one model's KV cache (the heads
it holds), with the tiers of the fleet. World sizes 1, 2, 4 and 8 write; every world size reads
back, byte-exact, in every byte tier (lmdb, file, redis standalone and cluster, compressed,
mooncake, s3).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier.backend import BlockFormat
from kvtier.config import load_config
from kvtier.errors import ConfigError, LayoutError
from kvtier.keys import Namespace, block_keys
from kvtier.records.head_group_tier import HeadGroupTier
from kvtier.records.head_groups import (
    HeadAxis,
    HeadGroupLayout,
    HeadGroups,
    block_key_of,
    default_group_size,
    group_key,
    rows_view,
)
from kvtier.testing import BackendTests

LAYERS, TOKENS, HEADS, HEAD_SIZE = 3, 4, 8, 16
NUM_BLOCKS = 6
PROMPT = list(range(1000, 1000 + TOKENS * 4))  # four blocks


def full_cache(seed: int = 0, heads: int = HEADS) -> list[torch.Tensor]:
    """The whole model's cache: per layer ``(blocks, 2, tokens, heads, head_size)`` bf16."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, 2, TOKENS, heads, HEAD_SIZE, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def shard(full: list[torch.Tensor], groups: HeadGroups) -> list[torch.Tensor]:
    heads = groups.local_heads
    return [t[:, :, :, heads.start : heads.stop, :].contiguous() for t in full]


def namespace(tp: int, rank: int) -> dict[str, Any]:
    return {"model_id": "m", "dtype": "bfloat16", "block_size": TOKENS, "tp_size": tp, "tp_rank": rank}


def config(tier: dict[str, Any], tp: int, rank: int, **head_groups: Any) -> dict[str, Any]:
    return {
        "tiers": [tier],
        "namespace": namespace(tp, rank),
        "head_groups": {"kv_heads": HEADS, "head_dim": 3, **head_groups},
        "flush_on_close_s": 0,
    }


async def write_world(tier: dict[str, Any], tp: int, full: list[torch.Tensor], **hg: Any) -> list[bytes]:
    keys: list[bytes] = []
    for rank in range(tp):
        groups = HeadGroups.for_rank(HEADS, tp, rank, hg.get("group_size", 1))
        async with kvtier.open(config(tier, tp, rank, **hg), kv_caches=shard(full, groups)) as store:
            keys = block_keys(PROMPT, block_size=TOKENS, namespace=store.namespace)
            saved = await store.save(keys, [0, 1, 2, 3])
            assert saved == 4, f"rank {rank} of {tp} saved {saved}: {_tier_stats(store)}"
    return keys


async def read_world(tier: dict[str, Any], tp: int, full: list[torch.Tensor], keys: list[bytes], **hg: Any) -> list[int]:
    """Per rank: the blocks loaded; each loaded block equals the rank's shard of ``full``."""
    loaded = []
    for rank in range(tp):
        groups = HeadGroups.for_rank(HEADS, tp, rank, hg.get("group_size", 1))
        want = shard(full, groups)
        caches = [torch.zeros_like(t) for t in want]
        async with kvtier.open(config(tier, tp, rank, **hg), kv_caches=caches) as store:
            assert block_keys(PROMPT, block_size=TOKENS, namespace=store.namespace) == keys  # TP-free keys
            n = await store.load(keys, [2, 3, 4, 5])
            if n != len(keys):  # the tier's own account of a short load, for the assertion below
                print(f"rank {rank} of {tp} loaded {n}: {_tier_stats(store)}")
        for have, exp in zip(caches, want):
            assert torch.equal(have[2 : 2 + n], exp[:n]), f"rank {rank} of {tp}: bytes differ"
        loaded.append(n)
    return loaded


def _tier_stats(store: Any) -> dict[str, Any]:
    """What a store's tiers say of their faults and counts (outages, fast failures, misses...),
    for a failed assertion's message."""
    return {b["backend"]: {k: v for k, v in b.items() if not isinstance(v, (dict, list))} for b in store.stats()["backends"]}


def _prefix(path: Path) -> str:
    return "hg" + hashlib.sha256(str(path).encode()).hexdigest()[:12]


def _tier(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if kind in ("lmdb", "file"):
        return {"backend": kind, "capacity": "32MiB", "path": str(tmp_path / kind), "sync_mode": "fast"}
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        return {"backend": "redis", "capacity": "32MiB", "url": server.url, "prefix": _prefix(tmp_path)}
    if kind == "s3":
        from s3_servers import BUCKET

        server = request.getfixturevalue("seaweed")
        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
        return {"backend": "s3", "capacity": "32MiB", "endpoint_url": server.endpoint_url, "bucket": BUCKET, "prefix": _prefix(tmp_path)}
    if kind == "mooncake":
        servers = request.getfixturevalue("mooncake_store")
        return {"backend": "mooncake", "capacity": "32MiB", "prefix": _prefix(tmp_path), **servers.tier_options()}
    cluster = request.getfixturevalue("redis_cluster")
    return {"backend": "redis", "capacity": "32MiB", "url": cluster.url, "cluster": True, "prefix": _prefix(tmp_path)}


# -- which groups a rank holds and writes ------------------------------------------------------------

@pytest.mark.parametrize(
    ("kv_heads", "tp", "size", "held", "written"),
    [
        (8, 1, 1, [tuple(range(8))], [tuple(range(8))]),
        (8, 2, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3)]),
        (8, 4, 1, [(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 1), (2, 3), (4, 5), (6, 7)]),
        (2, 4, 1, [(0,), (0,), (1,), (1,)], [(0,), (), (1,), ()]),  # replicated: one writer per group
        (1, 8, 1, [(0,)] * 8, [(0,)] + [()] * 7),
    ],
)
def test_groups_a_rank_holds_and_writes(kv_heads: int, tp: int, size: int, held: list[tuple[int, ...]], written: list[tuple[int, ...]]) -> None:
    got = [HeadGroups.for_rank(kv_heads, tp, r, size) for r in range(tp)]
    assert [g.held for g in got] == held
    assert [g.written for g in got] == written
    every = sorted(g for hg in got for g in hg.written)
    assert every == list(range(kv_heads // size)), "every group has exactly one writer"


def test_mla_is_one_record_for_every_rank() -> None:
    ranks = [HeadGroups.for_rank(1, 4, r, mla=True) for r in range(4)]
    assert {g.held for g in ranks} == {(0,)}
    assert [g.written for g in ranks] == [(0,), (), (), ()]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"kv_heads": 8, "tp_size": 4, "rank": 0, "group_size": 4}, "group_size"),  # a group spans ranks
        ({"kv_heads": 8, "tp_size": 3, "rank": 0, "group_size": 1}, "tp_size"),
        ({"kv_heads": 2, "tp_size": 4, "rank": 0, "group_size": 2}, "group_size"),
        ({"kv_heads": 8, "tp_size": 2, "rank": 2, "group_size": 1}, "rank"),
        ({"kv_heads": 8, "tp_size": 1, "rank": 0, "group_size": 3}, "group_size"),
        ({"kv_heads": 0, "tp_size": 1, "rank": 0, "group_size": 1}, "kv_heads"),
    ],
)
def test_bad_groups_name_the_field(args: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"head_groups\.{field}"):
        HeadGroups(**args)


def test_default_group_size() -> None:
    assert default_group_size(8) == 1  # any TP size
    assert default_group_size(8, max_tp_size=2) == 4  # records as large as TP 2 allows
    assert default_group_size(8, max_tp_size=2, head_record_bytes=32 << 10) == 2  # 64 KiB reached at 2
    assert default_group_size(8, max_tp_size=2, head_record_bytes=8 << 10) == 4  # bounded by TP 2
    assert default_group_size(8, max_tp_size=16) == 1
    assert HeadGroups.for_rank(8, 4, 0).group_size == 1  # never this engine's TP size


def test_record_keys_are_distinct_and_map_back() -> None:
    keys = [os.urandom(32) for _ in range(50)]
    recs = HeadGroupLayout.record_keys(keys, range(8))
    assert len(set(recs)) == len(recs) and not set(recs) & set(keys)
    assert recs[8 * 3 + 5] == group_key(keys[3], 5) and block_key_of(recs[8 * 3 + 5], 5) == keys[3]


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_a_listing_finds_blocks_whose_every_group_is_stored(tp: int) -> None:
    axis = HeadAxis(heads=HEADS // tp, segments=((4, 32),))
    layout = HeadGroupLayout(HeadGroups.for_rank(HEADS, tp, 0, 1), axis)
    keys = [os.urandom(32) for _ in range(20)]
    recs = set(HeadGroupLayout.record_keys(keys, range(HEADS)))
    recs.discard(group_key(keys[7], 6))  # one group of one block missing: that block is not present
    found = layout.blocks_present(recs)
    assert set(found) == set(keys) - {keys[7]}, "no block made up of other blocks' records, none partial"
    assert found[keys[0]] == HeadGroupLayout.record_keys([keys[0]], range(HEADS))  # every group's record
    assert found[keys[0]][layout.held_slice] == HeadGroupLayout.record_keys([keys[0]], layout.groups.held)


def test_two_blocks_that_share_a_record_key_are_both_left_out() -> None:
    # Keys b and b + o1 - o0 share a record key (b's group 1 is the other's group 0): that record
    # holds one of them, so a listing must show neither (before, both were found, and the index
    # took the record's size for both blocks).
    from kvtier.manager import TierManager, TierSpec
    from kvtier.manager.policies import LRUPolicy
    from kvtier.records.head_group_tier import GroupIndex

    layout = HeadGroupLayout(HeadGroups.for_rank(2, 1, 0, 1), HeadAxis(heads=2, segments=((1, 64),), tag="t"))
    b = os.urandom(32)
    other = block_key_of(group_key(b, 1), 0)
    assert group_key(other, 0) == group_key(b, 1)
    c = os.urandom(32)
    recs = {group_key(b, 0), group_key(b, 1), group_key(other, 1), group_key(c, 0), group_key(c, 1)}
    assert layout.blocks_present(recs) == {c: [group_key(c, 0), group_key(c, 1)]}

    mgr = TierManager([TierSpec("redis", 8 * 100, 100, LRUPolicy(capacity=8), persistent=True)])
    index = GroupIndex(mgr, layout)
    assert index.adopt(0, [(rk, 64, 1.0) for rk in recs]) == []
    assert mgr.holds(c, 0) and not mgr.holds(b, 0) and not mgr.holds(other, 0)
    assert index.holds(group_key(c, 1), 0) and not index.holds(group_key(b, 0), 0)


def test_the_index_view_starts_from_the_blocks_the_tier_listed() -> None:
    # The tier's scan and its index view share one mapping of records to blocks: a record of a
    # listed block is held from the start, and its removal forgets the block.
    from kvtier.manager import TierManager, TierSpec
    from kvtier.manager.policies import LRUPolicy
    from kvtier.records.head_group_tier import GroupIndex

    layout = HeadGroupLayout(HeadGroups.for_rank(4, 2, 1, 1), HeadAxis(heads=2, segments=((1, 64),), tag="t"))
    keys = [os.urandom(32) for _ in range(3)]
    listed = layout.blocks_present(HeadGroupLayout.record_keys(keys, range(4)))
    mgr = TierManager([TierSpec("redis", 8 * 200, 200, LRUPolicy(capacity=8), persistent=True)])
    assert mgr.adopt(0, [(k, 128, 1.0) for k in keys]) == []
    index = GroupIndex(mgr, layout, listed=listed)
    assert all(index.holds(group_key(k, g), 0) for k in keys for g in range(4))
    assert index.remove([group_key(keys[1], 0)], 0) == [keys[1]]  # a group this rank does not hold
    assert not mgr.holds(keys[1], 0) and mgr.holds(keys[0], 0)
    assert not index.holds(group_key(keys[1], 3), 0)


def test_rows_view_only_for_evenly_spaced_rows() -> None:
    pool = torch.arange(64, dtype=torch.uint8).view(8, 8)
    view = rows_view([pool[1], pool[3], pool[5]])
    assert view is not None and torch.equal(view, pool[1:6:2])
    assert rows_view([pool[1], pool[2], pool[5]]) is None
    assert rows_view([pool[1], torch.zeros(8, dtype=torch.uint8)]) is None


def test_axis_must_match_the_rank() -> None:
    with pytest.raises(LayoutError, match="holds 3 heads"):
        HeadGroupLayout(HeadGroups.for_rank(8, 2, 0, 1), HeadAxis(heads=3, segments=((1, 1),)))


def test_split_then_join_is_the_identity() -> None:
    full = full_cache()
    groups = HeadGroups.for_rank(HEADS, 2, 1, 2)
    caches = shard(full, groups)
    layout = HeadGroupLayout(groups, HeadAxis.from_caches(caches, head_dim=3))
    blocks = torch.cat([t.view(NUM_BLOCKS, -1).view(torch.uint8) for t in caches], dim=1)
    records = layout.split(list(blocks), groups.held)
    assert len(records) == NUM_BLOCKS * 2 and records[0].numel() == layout.group_bytes
    # the record of global group 2 (the rank's first) of block 4 holds heads 4 and 5, layer by layer
    rec = records[4 * 2 + 0].view(torch.bfloat16).view(LAYERS, 2, TOKENS, 2, HEAD_SIZE)
    assert torch.equal(rec[1], full[1][4][:, :, 4:6, :])
    out = torch.zeros_like(blocks)
    layout.join(torch.stack(records).view(NUM_BLOCKS, 2, -1), list(out))
    assert torch.equal(out, blocks)
    scattered = [torch.zeros(blocks.shape[1], dtype=torch.uint8) for _ in range(NUM_BLOCKS)]  # not one buffer
    layout.join(torch.stack(records).view(NUM_BLOCKS, 2, -1), scattered)
    assert torch.equal(torch.stack(scattered), blocks)


def test_jobs_hand_the_inner_tier_the_same_record_rows_and_read_back_exact() -> None:
    # A tensor per record costs as much as the rest of the layer: the rows of the thread's
    # buffer are made once and handed to the inner tier job after job (not rebuilt per job).
    from kvtier.backends.compressed import CompressedBackend

    full = full_cache(seed=3)
    groups = HeadGroups.for_rank(HEADS, 2, 0, 1)
    caches = shard(full, groups)
    tier = HeadGroupTier(CompressedBackend(capacity="16MiB"), HeadGroupLayout(groups, HeadAxis.from_caches(caches, head_dim=3)),
                         Namespace(model_id="m", dtype="bfloat16", block_size=TOKENS))
    asyncio.run(tier.open(BlockFormat(block_bytes=tier.layout.axis.block_bytes, dtype="bfloat16")))
    seen: list[list[int]] = []
    write, read = tier.inner.write_blocks, tier.inner.read_blocks

    def spy_write(keys: Any, rows: Any) -> Any:
        seen.append([id(r) for r in rows])
        return write(keys, rows)

    def spy_read(keys: Any, rows: Any) -> Any:
        seen.append([id(r) for r in rows])
        return read(keys, rows)

    tier.inner.write_blocks, tier.inner.read_blocks = spy_write, spy_read  # type: ignore[method-assign]
    blocks = torch.cat([c.view(NUM_BLOCKS, -1).view(torch.uint8) for c in caches], dim=1)
    for n in (NUM_BLOCKS, NUM_BLOCKS, 3):
        keys = [os.urandom(32) for _ in range(n)]
        assert None not in tier.write_blocks(keys, list(blocks[:n]))
        out = torch.zeros_like(blocks[:n])
        assert all(tier.read_blocks(keys, list(out))) and torch.equal(out, blocks[:n])
    held = len(groups.held)
    assert seen[0] == seen[1] == seen[2] == seen[3] and len(seen[0]) == NUM_BLOCKS * held
    assert seen[4] == seen[0][: 3 * held], "a smaller job takes the first rows of the same buffer"


# -- world sizes writing and reading each other's records -----------------------------------------------

@pytest.mark.parametrize("kind", ["lmdb", "file", "redis", "redis-cluster", "mooncake", "s3"])
def test_world_sizes_share_records(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    full = full_cache(seed=1)
    for writer in (1, 2, 4, 8):
        tier = _tier(kind, tmp_path / f"w{writer}", request)
        keys = asyncio.run(write_world(tier, writer, full))
        for reader in (1, 2, 4, 8):
            assert asyncio.run(read_world(tier, reader, full, keys)) == [4] * reader, (kind, writer, reader)


def test_compressed_tier_shares_records_between_world_sizes() -> None:
    """The in-memory compressed tier, one object under the views of every rank of both worlds."""
    from kvtier.backends.compressed import CompressedBackend

    full = full_cache(seed=2)
    ns = Namespace(model_id="m", dtype="bfloat16", block_size=TOKENS)
    keys = [os.urandom(32) for _ in range(NUM_BLOCKS)]
    inner = CompressedBackend(capacity="16MiB")

    def tier(tp: int, rank: int) -> tuple[HeadGroupTier, list[torch.Tensor]]:
        groups = HeadGroups.for_rank(HEADS, tp, rank, 1)
        caches = shard(full, groups)
        return HeadGroupTier(inner, HeadGroupLayout(groups, HeadAxis.from_caches(caches, head_dim=3)), ns), caches

    async def run() -> None:
        for writer, reader in ((4, 1), (1, 8), (8, 2)):
            for rank in range(writer):
                t, caches = tier(writer, rank)
                await t.open(BlockFormat(block_bytes=t.layout.axis.block_bytes, dtype="bfloat16"))
                blocks = torch.cat([c.view(NUM_BLOCKS, -1).view(torch.uint8) for c in caches], dim=1)
                assert None not in t.write_blocks(keys, list(blocks))
            for rank in range(reader):
                t, caches = tier(reader, rank)
                await t.open(BlockFormat(block_bytes=t.layout.axis.block_bytes, dtype="bfloat16"))
                want = torch.cat([c.view(NUM_BLOCKS, -1).view(torch.uint8) for c in caches], dim=1)
                assert set(t.stored_keys() or ()) == set(keys)
                out = torch.zeros_like(want)
                assert all(t.read_blocks(keys, list(out)))
                assert torch.equal(out, want)
            inner.delete_blocks(list(inner.stored_keys()))
        await inner.aclose()

    asyncio.run(run())


def test_kv_heads_fewer_than_tp_size(tmp_path: Path) -> None:
    """Two KV heads: TP 4 and TP 8 replicate them; one writer per group, every holder reads."""
    heads = 2
    full = full_cache(seed=3, heads=heads)
    tier = {"backend": "lmdb", "capacity": "32MiB", "path": str(tmp_path / "t"), "sync_mode": "fast"}

    async def world(tp: int, read: bool, keys: list[bytes] | None = None) -> list[bytes]:
        for rank in range(tp):
            groups = HeadGroups.for_rank(heads, tp, rank, 1)
            want = shard(full, groups)
            caches = [torch.zeros_like(t) for t in want] if read else want
            cfg = config(tier, tp, rank, kv_heads=heads)
            async with kvtier.open(cfg, kv_caches=caches) as store:
                keys = block_keys(PROMPT, block_size=TOKENS, namespace=store.namespace)
                if read:
                    assert await store.load(keys, [0, 1, 2, 3]) == 4
                    assert all(torch.equal(a[:4], b[:4]) for a, b in zip(caches, want))
                else:
                    await store.save(keys, [0, 1, 2, 3])  # 0 once every group is there: adopted at open
                    assert await store.lookup(keys) == 4
                    stats = store.stats()["backends"][0]["head_groups"]
                    assert stats["written"] == list(groups.written)
        assert keys is not None
        return keys

    asyncio.run(world(8, read=False))
    asyncio.run(world(4, read=True))
    asyncio.run(world(1, read=True))


def test_mla_one_record_in_every_tier_for_all_ranks(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    latent = [torch.randn(NUM_BLOCKS, TOKENS, 24, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    tier = {"backend": "file", "capacity": "32MiB", "path": str(tmp_path / "t"), "sync_mode": "fast"}

    def cfg(tp: int, rank: int) -> dict[str, Any]:
        return {"tiers": [tier], "namespace": namespace(tp, rank), "head_groups": {"mla": True}, "flush_on_close_s": 0}

    async def run() -> None:
        for rank in range(2):  # TP 2 writes: rank 0 only; rank 1 finds the blocks there at open
            async with kvtier.open(cfg(2, rank), kv_caches=latent) as store:
                keys = block_keys(PROMPT, block_size=TOKENS, namespace=store.namespace)
                assert await store.save(keys, [0, 1, 2, 3]) == (4 if rank == 0 else 0)
        records = [p for p in (tmp_path / "t").rglob("*.kvb")]
        assert len(records) == 4, "one record per block, whatever the ranks"
        for rank in range(4):  # TP 4 reads the same records on every rank
            caches = [torch.zeros_like(t) for t in latent]
            async with kvtier.open(cfg(4, rank), kv_caches=caches) as store:
                assert await store.load(keys, [0, 1, 2, 3]) == 4
            assert all(torch.equal(a[:4], b[:4]) for a, b in zip(caches, latent))

    asyncio.run(run())


def test_two_kv_cache_groups_keep_apart(tmp_path: Path) -> None:
    """Two KV-cache groups of one engine (full and sliding-window layers, say) have the same
    block keys and shapes: the axis tag keeps their records apart in one tier."""
    full_a, full_b = full_cache(seed=5), full_cache(seed=6)
    path = str(tmp_path / "t")
    ns = Namespace(model_id="m", dtype="bfloat16", block_size=TOKENS)
    keys = [os.urandom(32) for _ in range(3)]

    def store(full: list[torch.Tensor], tag: str, tp: int, rank: int, zero: bool = False) -> kvtier.KVStore:
        groups = HeadGroups.for_rank(HEADS, tp, rank, 1)
        caches = shard(full, groups)
        caches = [torch.zeros_like(c) for c in caches] if zero else caches
        layout = HeadGroupLayout(groups, HeadAxis.from_caches(caches, head_dim=3, tag=tag))
        cfg = load_config({"tiers": [{"backend": "lmdb", "capacity": "32MiB", "path": path, "sync_mode": "fast"}], "flush_on_close_s": 0})
        return kvtier.KVStore(cfg, kv_caches=caches, namespace=ns, head_groups=layout)

    async def run() -> None:
        for full, tag in ((full_a, "group0"), (full_b, "group1")):
            for rank in range(2):
                async with store(full, tag, 2, rank) as s:
                    await s.start()
                    assert await s.save(keys, [0, 1, 2]) == 3
        for full, tag in ((full_a, "group0"), (full_b, "group1")):
            s = await store(full, tag, 1, 0, zero=True).start()
            try:
                assert await s.load(keys, [3, 4, 5]) == 3
                want = shard(full, HeadGroups.for_rank(HEADS, 1, 0, 1))
                assert all(torch.equal(a[3:6], b[0:3]) for a, b in zip(s.layout.kv_caches, want))  # type: ignore[union-attr]
            finally:
                await s.aclose()

    asyncio.run(run())


def test_writer_killed_between_groups_is_a_miss(tmp_path: Path) -> None:
    """Rank 1 of a TP 2 writer dies before storing its groups: no reader loads a partial block,
    and no store adopts it at open."""
    full = full_cache(seed=7)
    tier = {"backend": "lmdb", "capacity": "32MiB", "path": str(tmp_path / "t"), "sync_mode": "fast"}

    async def run() -> None:
        groups = HeadGroups.for_rank(HEADS, 2, 0, 1)
        async with kvtier.open(config(tier, 2, 0), kv_caches=shard(full, groups)) as store:
            keys = block_keys(PROMPT, block_size=TOKENS, namespace=store.namespace)
            assert await store.save(keys, [0, 1, 2, 3]) == 4
        # the same rank's view, reopened: its own groups are there, the block is not whole
        caches = [torch.zeros_like(c) for c in shard(full, groups)]
        async with kvtier.open(config(tier, 2, 0), kv_caches=caches) as store:
            assert await store.lookup(keys) == 0, "a block missing a group is not adopted"
        groups1 = HeadGroups.for_rank(HEADS, 1, 0, 1)
        caches = [torch.zeros_like(c) for c in shard(full, groups1)]
        async with kvtier.open(config(tier, 1, 0), kv_caches=caches) as store:
            assert await store.lookup(keys) == 0
            tier_ = store.backends[0]
            out = torch.zeros(4, tier_.format.block_bytes, dtype=torch.uint8)
            assert tier_.read_blocks(keys, list(out)) == [False] * 4, "never a partial load"

    asyncio.run(run())


def test_per_rank_records_are_a_miss_never_an_error(tmp_path: Path) -> None:
    full = full_cache(seed=8)
    tier = {"backend": "lmdb", "capacity": "32MiB", "path": str(tmp_path / "t"), "sync_mode": "fast"}
    groups = HeadGroups.for_rank(HEADS, 1, 0, 1)
    per_rank = {"record_layout": "per_rank", "reason": "engines of one TP size only"}

    async def run() -> None:
        cfg = config(tier, 1, 0, **per_rank)
        async with kvtier.open(cfg, kv_caches=shard(full, groups)) as store:
            assert store.head_groups is None
            keys = block_keys(PROMPT, block_size=TOKENS, namespace=store.namespace)
            assert await store.save(keys, [0, 1, 2, 3]) == 4
        async with kvtier.open(config(tier, 1, 0), kv_caches=shard(full, groups)) as store:
            assert store.head_groups is not None
            assert await store.lookup(block_keys(PROMPT, block_size=TOKENS, namespace=store.namespace)) == 0
            assert await store.lookup(keys) == 0

    asyncio.run(run())


def test_per_rank_layout_needs_a_reason() -> None:
    with pytest.raises(ConfigError, match="per_rank needs a reason"):
        load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}], "head_groups": {"record_layout": "per_rank"}})
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}], "head_groups": {"group_size": 2, "kv_heads": 8, "head_dim": 3}})
    assert load_config(cfg.to_dict()) == cfg
    assert "head_groups" not in load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}]}).to_dict()


def test_a_store_without_head_information_keeps_whole_blocks(tmp_path: Path) -> None:
    caches = full_cache()
    cfg = {"tiers": [{"backend": "lmdb", "capacity": "32MiB", "path": str(tmp_path / "t"), "sync_mode": "fast"}], "flush_on_close_s": 0}

    async def run() -> None:
        async with kvtier.open(cfg, kv_caches=caches) as store:
            assert store.head_groups is None and not isinstance(store.backends[0], HeadGroupTier)

    asyncio.run(run())


def test_half_configured_head_groups_name_the_missing_field() -> None:
    with pytest.raises(ConfigError, match=r"head_groups\.head_dim"):
        kvtier.KVStore(load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}], "head_groups": {"kv_heads": 8}}), kv_caches=full_cache())


def test_a_failed_group_write_fails_the_block_and_leaves_no_group(tmp_path: Path) -> None:
    from kvtier.backends.compressed import CompressedBackend

    class FailingSecondGroup(CompressedBackend):
        def write_blocks(self, keys: Any, blocks: Any) -> list[int | None]:
            sizes = super().write_blocks(keys, blocks)
            return [None if i % HEADS == 1 and i < HEADS else s for i, s in enumerate(sizes)]

    inner = FailingSecondGroup(capacity="16MiB")
    groups = HeadGroups.for_rank(HEADS, 1, 0, 1)
    caches = shard(full_cache(), groups)
    t = HeadGroupTier(inner, HeadGroupLayout(groups, HeadAxis.from_caches(caches, head_dim=3)), Namespace(model_id="m"))
    asyncio.run(t.open(BlockFormat(block_bytes=t.layout.axis.block_bytes, dtype="bfloat16")))
    keys = [os.urandom(32) for _ in range(2)]
    blocks = torch.cat([c.view(NUM_BLOCKS, -1).view(torch.uint8) for c in caches], dim=1)[:2]
    sizes = t.write_blocks(keys, list(blocks))
    assert sizes[0] is None and sizes[1] is not None
    assert t.stored_keys() == [keys[1]]
    # the failed block's groups that did store were deleted (the one reported failed is the inner tier's own)
    assert len(inner.stored_keys()) == HEADS + 1
    asyncio.run(t.aclose())



async def _fed(follower: Any) -> None:
    """Wait until ``follower`` has applied every entry of its feed written so far (its cursor,
    moved once a read's entries are applied, at the feed's head); 60 s at most."""
    head = await asyncio.to_thread(follower.feed.head)
    for _ in range(1200):
        if follower._cursor is not None and follower._cursor >= head:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the follower's feed stayed behind {head} (at {follower._cursor})")


def test_a_shared_tier_index_follows_other_tp_sizes_in_block_keys(redis_server: Any, tmp_path: Path) -> None:
    """A TP 1 store on a Redis tier, open while a TP 2 engine stores: its index view sweeps the
    server's record keys and the manager adopts the blocks (once every group is there); a group
    that vanishes from the server takes its block out of the index."""
    full = full_cache(seed=9)
    tier = {"backend": "redis", "capacity": "32MiB", "url": redis_server.url, "prefix": _prefix(tmp_path), "sync_interval_s": 3600}

    async def run() -> None:
        reader_groups = HeadGroups.for_rank(HEADS, 1, 0, 1)
        caches = [torch.zeros_like(c) for c in shard(full, reader_groups)]
        async with kvtier.open(config(tier, 1, 0), kv_caches=caches) as reader:
            keys = block_keys(PROMPT, block_size=TOKENS, namespace=reader.namespace)
            follower = reader.backends[0].inner.follower  # type: ignore[attr-defined]
            view = follower.view
            async with kvtier.open(config(tier, 2, 0), kv_caches=shard(full, HeadGroups.for_rank(HEADS, 2, 0, 1))) as w0:
                await w0.save(keys, [0, 1, 2, 3])
            await _fed(follower)
            await asyncio.to_thread(view.sweep_once)
            assert await reader.lookup(keys) == 0, "half the groups: not adopted"
            async with kvtier.open(config(tier, 2, 1), kv_caches=shard(full, HeadGroups.for_rank(HEADS, 2, 1, 1))) as w1:
                await w1.save(keys, [0, 1, 2, 3])
            # The feed's entries of these saves applied first: one applied while the sweep after
            # the deletion below runs counts as just written, and keeps the deleted group's block
            # held until the next sweep (the staleness the view allows, one sweep).
            await _fed(follower)
            await asyncio.to_thread(view.sweep_once)
            assert await reader.lookup(keys) == 4
            assert await reader.load(keys, [0, 1, 2, 3]) == 4
            want = shard(full, reader_groups)
            assert all(torch.equal(a[:4], b[:4]) for a, b in zip(caches, want))
            inner = reader.backends[0].inner  # type: ignore[attr-defined]
            import redis

            client = redis.Redis.from_url(redis_server.url)  # another host's eviction of one group
            assert client.delete(inner._prefix_bytes + group_key(keys[2], 5)) == 1
            client.close()
            await asyncio.to_thread(view.sweep_once)
            assert await reader.lookup(keys) == 2

    asyncio.run(run())


def test_the_feed_adopts_other_tp_sizes_blocks_live_and_names_blocks(tmp_path: Path) -> None:
    """Following by the change feed of a shared file tier (no sweep): a TP 2 engine's blocks
    reach a TP 1 store within seconds, its listeners hear block keys (what KV events announce),
    and a load of them counts as shared hits."""
    full = full_cache(seed=10)
    tier = {"backend": "file", "capacity": "32MiB", "path": str(tmp_path / "t"), "sync_mode": "fast", "shared": True,
            "sweep_interval_s": 3600}

    async def run() -> None:
        caches = [torch.zeros_like(c) for c in shard(full, HeadGroups.for_rank(HEADS, 1, 0, 1))]
        async with kvtier.open(config(tier, 1, 0), kv_caches=caches) as reader:
            keys = block_keys(PROMPT, block_size=TOKENS, namespace=reader.namespace)
            follower = reader.backends[0].inner.follower  # type: ignore[attr-defined]
            heard: list[bytes] = []
            follower.listen(lambda change: heard.extend(change.adopted))
            for rank in range(2):
                cfg = config(tier, 2, rank)
                async with kvtier.open(cfg, kv_caches=shard(full, HeadGroups.for_rank(HEADS, 2, rank, 1))) as writer:
                    await writer.save(keys, [0, 1, 2, 3])
            for _ in range(200):
                if await reader.lookup(keys) == 4:
                    break
                await asyncio.sleep(0.05)
            assert await reader.lookup(keys) == 4
            assert sorted(heard) == sorted(keys), "listeners hear the blocks, not their group records"
            assert await reader.load(keys, [0, 1, 2, 3]) == 4
            assert follower.stats()["shared_hits"] == 4

    asyncio.run(run())


# -- the backend protocol, through the head-group view ---------------------------------------------------

def _grouped(inner: Any) -> HeadGroupTier:
    """TP 1 over 8 heads in groups of 2 (four records per block), 4096-byte blocks. (A rank of a
    larger TP writes only its groups, and a listing shows a block only once every group is
    stored: test_writer_killed_between_groups_is_a_miss.)"""
    layout = HeadGroupLayout(HeadGroups.for_rank(8, 1, 0, 2), HeadAxis(heads=8, segments=((8, 64),)))
    return HeadGroupTier(inner, layout, Namespace(model_id="conformance"))


class TestHeadGroupLmdbConformance(BackendTests):
    persistent = True

    def make_backend(self, path: Path, capacity: int) -> HeadGroupTier:
        from kvtier.backends.lmdb_tier import LmdbBackend

        # four small records (and their index entries) take more pages than one block
        room = capacity * 4 if capacity >= self.block_bytes else capacity
        return _grouped(LmdbBackend(capacity=room, path=path / "lmdb", sync_mode="fast"))


class TestHeadGroupFileConformance(BackendTests):
    persistent = True

    def make_backend(self, path: Path, capacity: int) -> HeadGroupTier:
        from kvtier.backends.file_tier import FileBackend

        # a file takes 4 KiB on disk at least: four 1 KiB group records take four times a block
        room = capacity * 4 if capacity >= self.block_bytes else capacity
        return _grouped(FileBackend(capacity=room, path=path / "file", sync_mode="fast"))


class TestHeadGroupCompressedConformance(BackendTests):
    def make_backend(self, path: Path, capacity: int) -> HeadGroupTier:
        from kvtier.backends.compressed import CompressedBackend

        return _grouped(CompressedBackend(capacity=capacity))


def test_an_integration_gets_its_layout_from_the_config_section() -> None:
    """What an engine integration calls with the cache's head axis, for each rank."""
    from kvtier.config import HeadGroupsConfig

    axis = HeadAxis(heads=2, segments=((128, 256),), tag="vllm:NHD;group0")  # 32 KiB per head
    assert HeadGroupsConfig().for_engine(axis, kv_heads=8, tp_size=4, rank=1).groups.held == (2, 3)  # type: ignore[union-attr]
    fleet = HeadGroupsConfig(max_tp_size=4)  # one head reaches no 64 KiB; two is the most TP 4 allows
    layout = fleet.for_engine(axis, kv_heads=8, tp_size=4, rank=1)
    assert layout is not None and layout.groups.group_size == 2 and layout.group_bytes == 64 << 10
    assert HeadGroupsConfig(record_layout="per_rank", reason="r").for_engine(axis, kv_heads=8, tp_size=4, rank=1) is None
    mla = HeadGroupsConfig().for_engine(HeadAxis(heads=1, segments=((1, 4096),)), kv_heads=1, tp_size=2, rank=1, mla=True)
    assert mla is not None and mla.groups.written == () and mla.groups.held == (0,)


def test_memory_tier_in_front_keeps_whole_blocks_and_the_byte_tier_groups(tmp_path: Path) -> None:
    """``[cpu, lmdb]``: the cpu tier holds the rank's blocks whole, the lmdb tier head groups
    (written through); a TP 4 engine reads what TP 1 stored."""
    full = full_cache(seed=11)
    tiers = [{"backend": "cpu", "capacity": "64KiB"}, {"backend": "lmdb", "capacity": "32MiB", "path": str(tmp_path / "t"), "sync_mode": "fast"}]

    def cfg(tp: int, rank: int) -> dict[str, Any]:
        return {**config(tiers[1], tp, rank), "tiers": tiers}

    async def run() -> None:
        async with kvtier.open(cfg(1, 0), kv_caches=shard(full, HeadGroups.for_rank(HEADS, 1, 0, 1))) as store:
            assert not isinstance(store.backends[0], HeadGroupTier) and isinstance(store.backends[1], HeadGroupTier)
            keys = block_keys(PROMPT, block_size=TOKENS, namespace=store.namespace)
            assert await store.save(keys, [0, 1, 2, 3]) == 4
        for rank in range(4):
            groups = HeadGroups.for_rank(HEADS, 4, rank, 1)
            caches = [torch.zeros_like(c) for c in shard(full, groups)]
            async with kvtier.open(cfg(4, rank), kv_caches=caches) as store:
                assert await store.load(keys, [1, 2, 3, 4]) == 4
            assert all(torch.equal(a[1:5], b[:4]) for a, b in zip(caches, shard(full, groups)))

    asyncio.run(run())


@pytest.mark.parametrize("num_groups", [2, 3, 4, 8])
def test_a_listing_of_one_blocks_records_shows_that_block_only(num_groups: int) -> None:
    # With XOR masks, two groups' records {k ^ m0, k ^ m1} were also those of k ^ m0 ^ m1: every
    # listed block came with a phantom one that took index entries and could take its records.
    layout = HeadGroupLayout(
        HeadGroups.for_rank(num_groups, 1, 0, 1), HeadAxis(heads=num_groups, segments=((1, 64),), tag="t")
    )
    for i in range(50):
        key = hashlib.sha256(i.to_bytes(4, "little")).digest()
        records = layout.record_keys([key], range(num_groups))
        assert list(layout.blocks_present(records)) == [key]
        assert all(block_key_of(group_key(key, g), g) == key for g in range(num_groups))
