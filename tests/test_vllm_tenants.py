"""Tenants under vLLM, below vLLM: a request's ``cache_salt`` is the tenant of what it stores.

Two tenants' requests over two ranks: one floods the cache with unique prompts while the other's
prefix stays served when the config gives it a quota; the same run without quotas shows the
flood evicting it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from vllm_world import BB, cpu, open_world

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
