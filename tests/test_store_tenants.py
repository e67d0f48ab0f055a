"""Tenants through the store facade: save(tenant=), usage, quotas from the config, pins by
prompt, deletes by keys / prompt / tenant / namespace, and tags and pins that survive a restart
of the lmdb and file tiers."""

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
from kvtier.errors import ConfigError, QuotaError
from kvtier.keys import Namespace
from kvtier.testing import make_key

LAYERS, SHAPE = 2, (4, 2, 4, 8)  # block size 4 tokens
BLOCK = LAYERS * 4 * 2 * 4 * 8 * 2


def caches(num_blocks: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(num_blocks, *SHAPE, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def config(cpu_blocks: int = 8, *, disk: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"backend": "cpu", "capacity": cpu_blocks * BLOCK}]
    if disk is not None:
        tiers.append(disk)
    return {"tiers": tiers, "write": "through", "namespace": {"model_id": "tenants-test", "block_size": 4}, **extra}


def ks(tag: int, n: int) -> list[bytes]:
    return [make_key(tag * 1000 + i) for i in range(n)]


async def test_save_with_a_tenant_counts_its_usage() -> None:
    async with kvtier.open(config(), kv_caches=caches()) as store:
        assert await store.save(ks(1, 3), [0, 1, 2], tenant="chat") == 3
        assert await store.save(ks(2, 2), [3, 4]) == 2
        assert await store.load(ks(1, 3), [10, 11, 12]) == 3
        u = store.usage()["cpu"]
        assert u["chat"]["blocks"] == 3 and u["chat"]["bytes"] == 3 * BLOCK and u["chat"]["hits"] == 3
        assert u["default"]["blocks"] == 2
        assert store.stats()["tenants"]["cpu"] == u


async def test_config_quotas_keep_a_tenants_prefix_through_a_flood() -> None:
    cfg = config(8, tenants={"chat": {"cpu": 3 * BLOCK}})
    async with kvtier.open(cfg, kv_caches=caches()) as store:
        chat = ks(1, 3)
        await store.save(chat, [0, 1, 2], tenant="chat")
        for i in range(12):
            await store.save(ks(100 + i, 2), [4, 5], tenant="batch")
        assert await store.lookup(chat) == 3
        assert store.usage()["cpu"]["batch"]["bytes"] <= 5 * BLOCK
    async with kvtier.open(config(8), kv_caches=caches()) as store:  # the same flood, no quota
        await store.save(chat, [0, 1, 2], tenant="chat")
        for i in range(12):
            await store.save(ks(100 + i, 2), [4, 5], tenant="batch")
        assert await store.lookup(chat) == 0


async def test_set_quota_at_runtime_and_bad_quotas() -> None:
    async with kvtier.open(config(8), kv_caches=caches()) as store:
        store.set_quota("chat", "cpu", f"{2 * BLOCK}B")
        assert await store.save(ks(1, 4), [0, 1, 2, 3], tenant="chat") == 2  # a smaller save
        with pytest.raises(QuotaError, match="larger than the tier"):
            store.set_quota("chat", "cpu", "1GiB")
        with pytest.raises(ConfigError, match="no tier 'ssd'"):
            store.set_quota("chat", "ssd", "1KiB")
        assert store.usage()["cpu"]["chat"]["quota_bytes"] == 2 * BLOCK


def test_bad_tenant_config_names_the_field() -> None:
    with pytest.raises(ConfigError) as err:
        kvtier.config.load_config(config(8, tenants={"chat": {"cpu": "1GiB", "ssd": "1KiB"}}, tenancy={"pin_budget": {"gpu": 1}}))
    text = str(err.value)
    assert "tenants.chat.cpu: 1073741824 bytes is larger than the tier" in text
    assert "tenants.chat.ssd: no tier 'ssd'" in text
    assert "tenancy.pin_budget.gpu: no tier 'gpu'" in text
    with pytest.raises(ConfigError, match="reserve"):
        kvtier.config.load_config(config(8, tenants={"a": {"cpu": 5 * BLOCK}, "b": {"cpu": 5 * BLOCK}}))
    cfg = kvtier.config.load_config(config(8, tenants={"a": {"cpu": "1KiB"}}, tenancy={"top_n": 3, "hash_ids": True}))
    assert kvtier.config.load_config(cfg.to_dict()) == cfg


async def test_pin_prefix_keeps_a_system_prompt_and_over_budget_is_refused() -> None:
    cfg = config(8, tenancy={"pin_budget": {"cpu": 2 * BLOCK}})
    async with kvtier.open(cfg, kv_caches=caches()) as store:
        prompt = list(range(100, 112))  # three blocks of four tokens
        keys = store.prefix_keys(prompt)
        assert len(keys) == 3
        await store.save(keys, [0, 1, 2])
        with pytest.raises(QuotaError, match="pin budget"):
            await store.pin_prefix(prompt)
        assert store.usage()["cpu"]["default"]["pinned"] == 0  # nothing pinned
        assert await store.pin_prefix(prompt[:8]) == 2
        for i in range(10):
            await store.save(ks(10 + i, 3), [4, 5, 6])
        assert await store.lookup(keys[:2]) == 2
        assert await store.unpin_prefix(prompt[:8]) == 2


async def test_delete_by_keys_prompt_tenant_and_namespace() -> None:
    async with kvtier.open(config(16), kv_caches=caches()) as store:
        await store.save(ks(1, 2), [0, 1], tenant="alice")
        await store.save(ks(2, 2), [2, 3], tenant="bob")
        prompt = list(range(8))
        await store.save(store.prefix_keys(prompt), [4, 5])
        assert (await store.delete(ks(1, 1))).deleted == 1
        assert (await store.delete(token_ids=prompt)).deleted == 2
        assert (await store.delete(token_ids=list(range(50, 58)))).deleted == 0  # a missing prefix: a no-op
        report = await store.delete(tenant="bob")
        assert report.to_dict() == {"deleted": 2, "by_tier": {"cpu": 2}, "skipped": 0}
        assert await store.lookup(ks(1, 2)[1:]) == 1
        other = Namespace(model_id="someone-else", block_size=4)
        assert (await store.delete(namespace=other)).deleted == 0
        assert (await store.delete(namespace=store.namespace)).deleted == 1
        assert len(store.manager) == 0  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="give one of"):
            await store.delete(ks(1, 1), tenant="bob")
        with pytest.raises(ConfigError, match="tenant"):
            await store.delete(tenant="")


async def test_delete_waits_for_a_load_and_skips_when_it_does_not_end() -> None:
    async with kvtier.open(config(8), kv_caches=caches()) as store:
        keys = ks(1, 2)
        await store.save(keys, [0, 1])
        mgr = store.manager
        assert mgr is not None
        plan = mgr.prepare_load(keys)  # a load that reads them
        report = await store.delete(keys, wait_s=0.05)
        assert report.skipped == 2 and report.deleted == 0
        assert await store.lookup(keys) == 2

        async def finish_later() -> None:
            await asyncio.sleep(0.05)
            mgr.complete_load(plan.keys)

        task = asyncio.create_task(finish_later())
        report = await store.delete(keys, wait_s=5)
        await task
        assert report.deleted == 2 and report.skipped == 0


def disk_tier(kind: str, path: Path, url: str = "") -> dict[str, Any]:
    if kind == "redis":
        return {"backend": "redis", "url": url, "prefix": f"tenants-{path.name}", "capacity": 64 * BLOCK}
    if kind == "lmdb":
        return {"backend": "lmdb", "path": str(path), "capacity": 64 * (BLOCK + 8192)}
    return {"backend": "file", "path": str(path), "capacity": 64 * BLOCK}


@pytest.mark.parametrize("kind", ["lmdb", "file", "redis"])
async def test_tenants_usage_and_pins_survive_a_restart(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else ""
    cfg = config(4, disk=disk_tier(kind, tmp_path / kind, url), tenants={"chat": {kind: "48KiB"}})
    async with kvtier.open(cfg, kv_caches=caches()) as store:
        await store.save(ks(1, 3), [0, 1, 2], tenant="chat", durable=True)
        await store.save(ks(2, 2), [3, 4], tenant="batch", durable=True)
        assert await store.pin(ks(1, 2), tier=kind) == 2
        gone = ks(2, 1)
        await store.delete(gone)
        before = store.usage()[kind]
    async with kvtier.open(cfg, kv_caches=caches()) as store:
        after = store.usage()[kind]
        assert {u: (r["blocks"], r["bytes"], r["pinned"]) for u, r in after.items()} == {
            u: (r["blocks"], r["bytes"], r["pinned"]) for u, r in before.items()
        }
        assert after["chat"]["blocks"] == 3 and after["chat"]["pinned"] == 2 and after["batch"]["blocks"] == 1
        assert sorted(store.manager.tenants.pinned(kind)) == sorted(ks(1, 2))  # type: ignore[union-attr]
        await store.unpin(ks(1, 2))
        assert (await store.delete(tenant="chat")).deleted == 3
    async with kvtier.open(cfg, kv_caches=caches()) as store:
        after = store.usage() if store.manager._book is not None else {}  # type: ignore[union-attr]
        assert "chat" not in after.get(kind, {}) or after[kind]["chat"]["blocks"] == 0
        assert store.manager.tenants.pinned(kind) == []  # type: ignore[union-attr]


async def test_prometheus_reports_usage_per_tenant_with_bounded_and_hashed_labels() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvtier.config.tenants import hashed_tenant
    from kvtier.metrics import export

    registry = prometheus_client.CollectorRegistry()
    cfg = config(16, tenants={"chat": {"cpu": 4 * BLOCK}}, tenancy={"top_n": 2, "hash_ids": True})
    async with kvtier.open(cfg, kv_caches=caches()) as store:
        for i, tenant in enumerate(["chat", "a", "b", "c"]):  # 4, 3, 2 and 1 blocks
            await store.save(ks(i + 1, 4 - i), [0, 1, 2, 3][: 4 - i], tenant=tenant)
        handle = export(store, registry=registry, store_label="t")
        try:
            value = registry.get_sample_value
            chat = hashed_tenant("chat", True)
            assert chat != "chat" and chat.startswith("t-")
            assert value("kvtier_tenant_blocks", {"store": "t", "tier": "cpu", "tenant": chat}) == 4
            assert value("kvtier_tenant_quota_bytes", {"store": "t", "tier": "cpu", "tenant": chat}) == 4 * BLOCK
            labels = {s.labels["tenant"] for m in registry.collect() if m.name == "kvtier_tenant_bytes" for s in m.samples}
            assert len(labels) == 3 and "other" in labels and not labels & {"chat", "a", "b", "c"}
            assert value("kvtier_tenant_blocks", {"store": "t", "tier": "cpu", "tenant": "other"}) == 3  # b's two and c's one
        finally:
            handle.close()


@pytest.mark.parametrize("kind", ["lmdb", "file", "redis"])
async def test_cli_inspect_shows_tenants_and_clear_deletes_one_tenant(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    import json

    import yaml

    from kvtier.tools.cli import main

    url = request.getfixturevalue("redis_server").url if kind == "redis" else ""
    cfg = config(4, disk=disk_tier(kind, tmp_path / kind, url))
    cfg_file = tmp_path / "kvtier.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    async with kvtier.open(cfg, kv_caches=caches()) as store:
        await store.save(ks(1, 3), [0, 1, 2], tenant="chat", durable=True)
        await store.save(ks(2, 2), [3, 4], tenant="batch", durable=True)
    capsys.readouterr()
    if kind != "redis":  # inspect reads a tier directory
        assert main(["inspect", str(tmp_path / kind), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        tenants = report["tenants"] if "tenants" in report else report["tiers"][0]["tenants"]
        assert tenants["chat"]["blocks"] == 3 * tenants["batch"]["blocks"] // 2  # records: one per head group
    assert main(["clear", "--config", str(cfg_file), "--tenant", "nobody", "--yes"]) == 0  # nothing to delete: a no-op
    assert "nothing to delete" in capsys.readouterr().out
    assert main(["clear", "--config", str(cfg_file), "--tenant", "chat", "--yes"]) == 0
    async with kvtier.open(cfg, kv_caches=caches()) as store:
        assert await store.lookup(ks(1, 3)) == 0
        assert await store.lookup(ks(2, 2)) == 2
        assert store.usage()[kind]["batch"]["blocks"] == 2
        assert "chat" not in store.usage()[kind]


def _crashing_tenant_writer(cfg: dict[str, Any], fd: int) -> None:
    async def run() -> None:
        store = await kvtier.open(cfg, kv_caches=caches())
        await store.save(ks(1, 3), [0, 1, 2], tenant="chat", durable=True)
        await store.save(ks(2, 2), [3, 4], tenant="batch", durable=True)
        os.write(fd, b"saved\n")
        os.kill(os.getpid(), signal.SIGKILL)  # no close: the tags are only what each save wrote

    asyncio.run(run())


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="needs fork and SIGKILL")
@pytest.mark.parametrize("kind", ["lmdb", "file"])
async def test_the_tenant_of_a_saved_block_survives_a_crash(kind: str, tmp_path: Path) -> None:
    """Tags are written with each save (per save, not per block): a SIGKILL right after the
    saves, with no close, loses no block's tenant."""
    cfg = config(4, disk=disk_tier(kind, tmp_path / kind))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            _crashing_tenant_writer(cfg, write)
        finally:
            os._exit(1)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        assert f.read() == "saved\n"
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    async with kvtier.open(cfg, kv_caches=caches()) as store:
        usage = store.usage()[kind]
        assert usage["chat"]["blocks"] == 3 and usage["batch"]["blocks"] == 2
        assert usage.get("default", {}).get("blocks", 0) == 0
