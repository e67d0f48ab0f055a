"""Fleets under vLLM, below vLLM: where the KV heads are in vLLM's pages, where head-group records
live per rank, the scheduler side's index of a shared tier over head-group records, the offload
key directory on a real Redis server, and KV events for blocks another engine stored."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.integrations.vllm.engines import rank_tiers
from kvtier.integrations.vllm.follow import RedisOffloadKeys, SharedFollowing
from kvtier.integrations.vllm.head_layout import HeadShape, head_shapes, page_head_shape, rank_head_groups
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.records.head_groups import group_key
from kvtier.testing import make_key

BS, HS, NB = 32, 64, 5


def _packed(heads: int, hnd: bool) -> torch.Tensor:
    """vLLM's (num_blocks, heads, block_size, 2 * head_size) tensor, in HND or NHD strides."""
    if hnd:
        return torch.zeros(NB, heads, BS, 2 * HS)
    return torch.zeros(NB, BS, heads, 2 * HS).permute(0, 2, 1, 3)


def _halves(heads: int, hnd: bool) -> torch.Tensor:
    """vLLM's (num_blocks, 2, block_size, heads, head_size) tensor, in NHD or HND strides."""
    if hnd:
        return torch.zeros(NB, 2, heads, BS, HS).permute(0, 1, 3, 2, 4)
    return torch.zeros(NB, 2, BS, heads, HS)


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        (_packed(2, hnd=True), (1, BS * 2 * HS * 4)),
        (_packed(2, hnd=False), (BS, 2 * HS * 4)),
        (_halves(2, hnd=False), (2 * BS, HS * 4)),
        (_halves(2, hnd=True), (2, BS * HS * 4)),
    ],
    ids=["packed-HND", "packed-NHD", "halves-NHD", "halves-HND"],
)
def test_page_head_shape_finds_the_heads_in_vllm_s_pages(tensor: torch.Tensor, expected: tuple[int, int]) -> None:
    assert page_head_shape(tensor, NB, 2, HS) == expected
    # Head 1 of block 1, read at the shape's [outer, heads, inner] bytes, is vLLM's head 1.
    outer, inner = expected
    page = tensor[0].numel()
    tensor.as_strided((NB * page,), (1,)).copy_(torch.arange(NB * page, dtype=torch.float32))
    block = tensor.as_strided((page,), (1,), page).view(torch.uint8).view(outer, 2, inner)
    theirs = tensor[1, 1] if tensor.dim() == 4 else tensor[1, :, :, 1]
    assert torch.equal(block[:, 1].reshape(-1), theirs.contiguous().view(torch.uint8).view(-1))


def test_page_head_shape_refuses_what_it_does_not_know() -> None:
    assert page_head_shape(torch.zeros(NB, BS, 576), NB, 1, 576) is None  # MLA: no heads axis
    assert page_head_shape(torch.zeros(NB, 2, BS, 2 * HS), NB, 3, HS) is None  # heads do not match
    assert page_head_shape(torch.zeros(NB + 1, 2, BS, 2 * HS), NB, 2, HS) is None  # not one page per block
    spec = SimpleNamespace(num_kv_heads=2, head_size=HS)
    mixed = head_shapes([(0, spec, [_packed(2, True), _packed(2, False)])], NB, kv_heads=4)
    assert mixed == {0: None}  # layers that disagree keep the per-rank layout
    same = head_shapes([(0, spec, [_packed(2, True)] * 3)], NB, kv_heads=4)
    assert same == {0: HeadShape(outer=1, heads=2, inner=BS * 2 * HS * 4, kv_heads=4)}


def test_rank_head_groups_agree_across_tp_sizes_and_honour_per_rank() -> None:
    shape1 = HeadShape(outer=1, heads=2, inner=BS * 2 * HS * 4, kv_heads=2)
    shape2 = HeadShape(outer=1, heads=1, inner=BS * 2 * HS * 4, kv_heads=2)
    tp1 = rank_head_groups(None, shape1, 2, tp_size=1, rank=0, blocks_per_chunk=1, tag="vllm:LBHNC")
    tp2 = [rank_head_groups({}, shape2, 2, tp_size=2, rank=r, blocks_per_chunk=1, tag="vllm:LBHNC") for r in range(2)]
    assert tp1 is not None and all(x is not None for x in tp2)
    assert tp1.groups.held == (0, 1) and [x.groups.held for x in tp2 if x] == [(0,), (1,)]
    assert {tp1.layout_string()} == {x.layout_string() for x in tp2 if x}  # one record namespace
    assert tp1.group_bytes == tp2[0].group_bytes  # type: ignore[union-attr]
    per_rank = {"record_layout": "per_rank", "reason": "a test"}
    assert rank_head_groups(per_rank, shape1, 2, tp_size=1, rank=0, blocks_per_chunk=1, tag="t") is None
    assert rank_head_groups(None, None, 2, tp_size=1, rank=0, blocks_per_chunk=1, tag="t") is None


def test_rank_tiers_puts_every_rank_s_head_group_records_in_one_place_except_lmdb() -> None:
    cfg = {"tiers": [
        {"backend": "lmdb", "path": "/l", "capacity": 1 << 20},
        {"backend": "file", "path": "/f", "capacity": 1 << 20},
        {"backend": "redis", "prefix": "p", "capacity": 1 << 20},
    ]}
    from kvtier.integrations.vllm.head_layout import together_tiers

    together = together_tiers(cfg)
    assert together == frozenset({1, 2})
    for world in (1, 2, 4):
        for rank in range(world):
            tiers = rank_tiers(cfg, rank, world, together=together)["tiers"]
            assert tiers[0]["path"] == f"/l/r{rank}-of-{world}"
            assert tiers[1]["path"] == "/f/head-groups" and tiers[2]["prefix"] == "p.hg"
            assert tiers[1]["capacity"] == (1 << 20) // world  # each rank counts what it writes


def _manager(blocks: int = 8) -> TierManager:
    return TierManager([TierSpec("redis", blocks * 100, 100, LRUPolicy(capacity=blocks), persistent=True)])


def _layout(tp: int, rank: int) -> Any:
    shape = HeadShape(outer=1, heads=3 // tp if tp <= 3 else 1, inner=64, kv_heads=3)
    return rank_head_groups(None, shape, 1, tp_size=tp, rank=rank, blocks_per_chunk=1, tag="t")


def test_the_head_group_view_adopts_complete_blocks_only_as_stored_events() -> None:
    """The scheduler side's binding: the tier's GroupIndex over the manager adopts a block
    once every head group of it is on the tier (a stored event), and forgets it when one goes
    (a removed event)."""
    from kvtier.backends.shared_index import adopt_records

    from kvtier.records.head_group_tier import GroupIndex

    mgr = _manager()
    index = GroupIndex(mgr, _layout(3, 0))  # rank 0 of TP=3: holds group 0
    a, b = make_key(1), make_key(2)
    adopt_records(index, 0, [group_key(a, 0), group_key(a, 2), group_key(b, 1)], 10)  # as a follower does
    assert not mgr.holds(a, 0) and not mgr.holds(b, 0)  # a writer between its groups: a miss
    adopt_records(index, 0, [group_key(a, 1)], 10)
    assert mgr.lookup([a]) == 1 and not mgr.holds(b, 0)
    assert [(e.kind, e.key) for e in mgr.take_events()] == [("stored", a)]
    index.remove([group_key(a, 2)], 0)
    assert mgr.lookup([a]) == 0
    assert [(e.kind, e.key) for e in mgr.take_events()] == [("removed", a)]


def test_redis_offload_key_directory_serves_what_another_engine_published(redis_server: Any) -> None:
    import redis

    writer = RedisOffloadKeys(redis.Redis.from_url(redis_server.url), "fleet-test")
    reader = RedisOffloadKeys(redis.Redis.from_url(redis_server.url), "fleet-test")
    try:
        pairs = [(make_key(i), b"offload-%d" % i) for i in range(600)]  # more than one pipeline
        writer.publish(pairs)
        deadline = time.time() + 10
        found: dict[bytes, bytes] = {}
        asked = 0
        while len(found) < len(pairs) and time.time() < deadline:
            wanted = [k for k, _ in pairs if k not in found]
            reader.request(wanted)
            asked += len(wanted)
            time.sleep(0.05)
            found.update(reader.take_found())
        assert found == dict(pairs)
        reader.request([make_key(10_000)])  # never published: never found
        asked += 1
        while reader.counters["requested"] < asked and time.time() < deadline + 10:  # every request answered
            time.sleep(0.05)
        assert reader.counters["requested"] == asked
        late = reader.take_found()  # requests still queued when the last key came in answer again
        assert all(dict(pairs)[k] == v for k, v in late) and make_key(10_000) not in dict(late)
    finally:
        writer.close()
        reader.close()


def test_redis_offload_key_directory_survives_a_dead_server(own_redis_server: Any) -> None:
    import redis

    keys = RedisOffloadKeys(redis.Redis.from_url(own_redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5), "x")
    own_redis_server.stop()
    keys.publish([(make_key(1), b"v")])
    keys.request([make_key(1)])
    deadline = time.time() + 10
    while keys.counters["errors"] < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert keys.counters["errors"] == 2 and keys.take_found() == []
    keys.close()


class _Directory:
    """An in-process directory (the protocol's other side is tested on Redis above)."""

    def __init__(self, known: dict[bytes, bytes]) -> None:
        self.known = known
        self.found: list[tuple[bytes, bytes]] = []
        self.counters: dict[str, int] = {}
        self.published: list[tuple[bytes, bytes]] = []

    def publish(self, pairs: Any) -> None:
        self.published.extend(pairs)

    def request(self, keys: Any) -> None:
        self.found.extend((k, self.known[k]) for k in keys if k in self.known)

    def take_found(self) -> list[tuple[bytes, bytes]]:
        out, self.found = self.found, []
        return out

    def close(self) -> None:
        pass


def test_shared_following_names_adopted_keys_by_their_offload_keys() -> None:
    shared = SharedFollowing({"tiers": []}, 1)
    a, b = make_key(1), make_key(2)
    directory = _Directory({a: b"vllm-a"})
    shared.directory = directory
    shared.ask(0, a, 1)
    shared.ask(0, b, 1)  # nobody published b: never announced
    assert shared.take_found() == [(0, a, b"vllm-a", 1)]
    assert shared.take_found() == []
    shared.publish([(b, b"vllm-b")])
    assert directory.published == [(b, b"vllm-b")]
    shared.close()
    assert shared.directory is None


async def test_blocks_adopted_at_start_are_announced_from_the_directory(tmp_path: Any) -> None:
    """A fresh scheduler side over a persistent tier whose offload key log is gone (a Redis
    tier has none): the adopted blocks are named by the directory, then announced as stored."""
    from test_vllm_groups import GROUPS, okey, open_groups

    from kvtier.integrations.vllm import groups as vg
    from kvtier.integrations.vllm.announce import OffloadKeyLog
    from kvtier.integrations.vllm.engines import SchedulerEngine, vllm_namespace
    from kvtier.integrations.vllm.ranks import describe_rank

    world = await open_groups(1, [{"backend": "file", "path": str(tmp_path / "f"), "capacity": "1MiB"}])
    try:
        keys = [okey(0, 0), okey(1, 0), okey(0, 1), okey(1, 1)]
        world.store(keys, [1, 2, 3, 4], [2, 2], [0, 0])
        known = {world.side.groups[0].kkey(k): k for k in keys[:2]}  # the other engine published group 0's
        config = SimpleNamespace(model=SimpleNamespace(name="tiny-hybrid", dtype="float32"), kv_cache_layout="NHD",
                                 parallel=SimpleNamespace(tp_size=1, pp_size=1))
        shared = SharedFollowing({"tiers": []}, 1)
        fresh = vg.SchedulerGroups(
            [SchedulerEngine("e2", 1, group=g) for g in GROUPS],
            world.side._store_cfg,
            OffloadKeyLog(None),
            lambda gpos, layout: vllm_namespace(config, 16, layout, {}),
            shared=shared,
        )
        shared.start = lambda *args: setattr(shared, "directory", _Directory(known))  # type: ignore[method-assign]
        fresh.adopt({0: vg.RankGroups(0, 1, GROUPS, tuple(
            describe_rank("e", 0, 1, s, vg.group_layout("L", g, 2)) for g, s in zip(GROUPS, world.stores[0])
        ))})
        assert fresh.lookup(keys[0]) and fresh.lookup(keys[3])
        events = list(fresh.take_events())
        assert sorted(events) == sorted((k, 0, False) for k in keys[:2])  # group 1's were never published
        assert list(fresh.take_events()) == []
        fresh.close()
    finally:
        await world.close()


def test_group_index_with_two_groups_adopts_the_block_whatever_the_order() -> None:
    """With two groups a block's two records also read as those of one other key (the XOR of
    the two masks): both are adopted, and the real block never loses its records to the other
    (before, one of them raised KeyError in the follower's thread, half the time the real one)."""
    from kvtier.records.head_group_tier import GroupIndex

    shape = HeadShape(outer=1, heads=1, inner=64, kv_heads=2)
    for rank in (0, 1):
        layout = rank_head_groups(None, shape, 1, tp_size=2, rank=rank, blocks_per_chunk=1, tag="t")
        for i in range(20):  # set orders differ by key
            mgr = _manager()
            index = GroupIndex(mgr, layout)
            a = make_key(100 + i)
            index.adopt_live(0, [(group_key(a, 0), 10, 0.0), (group_key(a, 1), 10, 0.0)])
            assert mgr.lookup([a]) == 1
