"""Tenants under vLLM, below vLLM: a request's ``cache_salt`` is the tenant of what it stores.

Two tenants' requests over two ranks: one floods the cache with unique prompts while the other's
prefix stays served when the config gives it a quota; the same run without quotas shows the
flood evicting it. Tags and pins survive an engine restart over lmdb and file tiers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis_servers import RedisServer
from vllm_world import BB, World, cpu, lmdb, open_world

from kvtier.integrations.vllm.tenants import RequestTenants
from kvtier.testing import make_key


@dataclass
class Request:  # the fields of vLLM's Request the connector reads
    request_id: str
    cache_salt: str | None = None


def test_request_tenants_follow_the_cache_salt() -> None:
    tenants = RequestTenants()
    tenants.note(Request("a", "chat"))
    tenants.note(Request("b"))  # no salt: the default tenant
    tenants.note(Request("c", ""))
    assert tenants.tenant("a") == "chat" and tenants.tenant("b") is None and tenants.tenant(None) is None
    assert len(tenants) == 1
    tenants.forget("a")
    tenants.forget("never-seen")
    assert tenants.tenant("a") is None and len(tenants) == 0


@pytest.mark.parametrize("quotas", [True, False])
async def test_a_flood_by_one_cache_salt_keeps_or_evicts_the_other(quotas: bool) -> None:
    # the config's quota is the engine's (over both ranks), as its capacities are: 3 blocks per rank
    w = await open_world(2, [cpu(8, 2)], tenants={"chat": {"cpu": 3 * BB * 2}} if quotas else None)
    try:
        tenants = RequestTenants()
        tenants.note(Request("chat-1", "chat"))
        chat = [make_key(i) for i in range(3)]
        w.store(chat, [0, 1, 2], tenant=tenants.tenant("chat-1"))
        tenants.forget("chat-1")
        for i in range(10):  # unique prompts under another salt
            tenants.note(Request(f"batch-{i}", "batch"))
            w.store([make_key(100 + 2 * i), make_key(101 + 2 * i)], [3, 4], tenant=tenants.tenant(f"batch-{i}"))
            tenants.forget(f"batch-{i}")
        usage = w.manager.tenants.usage()["cpu"]
        if quotas:
            assert usage["chat"]["quota_bytes"] == 3 * BB
            assert w.manager.lookup(chat) == 3
            assert usage["chat"]["blocks"] == 3 and usage["chat"]["evictions"] == 0
            assert usage["batch"]["blocks"] == 5
            assert w.load(chat, [5, 6, 7]) == set()  # served from every rank
        else:
            assert w.manager.lookup(chat) == 0
            assert usage["chat"]["evictions"] == 3
    finally:
        for s in w.stores:
            await s.aclose()


def _kept(w: World, tier: int) -> dict[str, tuple[int, int, int]]:
    """(blocks, bytes, pinned) per tenant of ``tier`` as the scheduler side's manager counts them."""
    name = w.manager.tier_spec(tier).name
    rows = w.manager.tenants.usage()[name]
    return {u: (row["blocks"], row["bytes"], row["pinned"]) for u, row in rows.items() if row["blocks"]}


def _file(path: Path) -> dict[str, Any]:
    return {"backend": "file", "path": str(path), "capacity": "32MiB"}


@pytest.mark.parametrize("backend", ["lmdb", "file"])
async def test_tenants_and_pins_survive_an_engine_restart(tmp_path: Path, backend: str) -> None:
    # The scheduler side's manager ships its tags and pins to the ranks with the next step's
    # deletes; each rank saves them with its tiers, reads them back at start and reports them
    # with its records, so the new scheduler side counts every block as its tenant's again.
    disk = lmdb(tmp_path / "db") if backend == "lmdb" else _file(tmp_path / "files")
    tiers = [cpu(8, 2), disk]
    w = await open_world(2, tiers)
    chat, batch = [make_key(i) for i in range(3)], [make_key(100 + i) for i in range(4)]
    try:
        w.store(chat, [0, 1, 2], tenant="chat")
        w.store(batch[:2], [3, 4], tenant="batch")
        w.store(batch[2:], [5, 6])  # no salt: the default tenant's
        assert w.manager.tenants.pin(chat[:2], 1) == 2  # as the admin endpoint pins a prefix
        w.run_deletes()  # the next step: the ranks save the tags and pins
        before = _kept(w, 1)
        assert {u: (blocks, pinned) for u, (blocks, _, pinned) in before.items()} == {"chat": (3, 2), "batch": (2, 0), "default": (2, 0)}
    finally:
        await w.close()
    w = await open_world(2, tiers)  # a restart: new stores, worker and scheduler sides on the same dirs
    try:
        assert w.adopted == 7
        assert _kept(w, 1) == before
        assert sorted(w.manager.tenants.pinned(1)) == sorted(chat[:2])
        assert sorted(w.manager.tenants.keys_of("batch")) == sorted(batch[:2])
        w.manager.tenants.unpin(chat[:1], 1)  # an unpin is saved the same way
        w.run_deletes()
    finally:
        await w.close()
    w = await open_world(2, tiers)
    try:
        assert w.manager.tenants.pinned(1) == [chat[1]]
        assert _kept(w, 1) == {**before, "chat": (3, before["chat"][1], 1)}
    finally:
        await w.close()


async def test_tags_of_a_shared_tier_are_saved_by_its_writer_rank_and_survive_a_restart(redis_server: RedisServer) -> None:
    # Replicated KV (MLA): one copy in the Redis tier, written by rank 0 alone; the other rank
    # skips that tier's tags as it skips its writes, and a new engine reads them back.
    tiers = [cpu(8, 2), {"backend": "redis", "url": redis_server.url, "capacity": "1MiB", "prefix": "tags-once", "sync_interval_s": 3600}]
    w = await open_world(2, tiers, replicated=True)
    chat = [make_key(i) for i in range(3)]
    try:
        calls = [0, 0]
        for r in range(2):
            backend = w.stores[r].backends[1]
            real = backend.write_tags

            def counted(*args: Any, r: int = r, real: Any = real, **kw: Any) -> Any:
                calls[r] += 1
                return real(*args, **kw)

            backend.write_tags = counted
        w.store(chat, [0, 1, 2], tenant="chat")
        assert w.manager.tenants.pin(chat[:1], 1) == 1
        w.run_deletes()
        assert calls == [1, 0]  # one write for the job, by the writer rank only
    finally:
        await w.close()
    w = await open_world(2, tiers, replicated=True)
    try:
        assert _kept(w, 1)["chat"][0] == 3 and _kept(w, 1)["chat"][2] == 1
        assert w.manager.tenants.pinned(1) == chat[:1]
    finally:
        await w.close()
