"""The deployability pass: configs that are well formed but cannot run on this machine."""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path

import pytest

from kvtier import registry
from kvtier.config import load_config
from kvtier.config.deploy import check_deployment, host_memory, log_findings


def findings(config: dict) -> list[str]:
    return [f"{f.severity} {f}" for f in check_deployment(load_config(config))]


def test_a_plain_config_is_deployable(tmp_path: Path) -> None:
    assert findings({"tiers": [{"backend": "cpu", "capacity": "1MiB"}, {"backend": "lmdb", "capacity": "1MiB", "path": str(tmp_path / "db")}]}) == []


@pytest.mark.parametrize("backend", ["lmdb", "file"])
def test_a_path_that_is_a_regular_file_is_an_error(tmp_path: Path, backend: str) -> None:
    regular = tmp_path / "passwd"
    regular.write_text("root:x:0:0\n")
    out = findings({"tiers": [{"backend": backend, "capacity": "1MiB", "path": str(regular)}]})
    assert out == [f"error tiers[0].path: {str(regular)!r} exists and is not a directory; the {backend} tier needs a directory of its own"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_path_that_cannot_be_created_is_an_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    out = findings({"tiers": [{"backend": "lmdb", "capacity": "1MiB", "path": str(locked / "db")}]})
    assert len(out) == 1 and "tiers[0].path" in out[0] and "cannot be created" in out[0] and "not writable" in out[0]


def test_capacity_beyond_the_disk_is_an_error(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    disk = st.f_blocks * st.f_frsize
    out = findings({"tiers": [{"backend": "lmdb", "capacity": disk * 2, "path": str(tmp_path / "db")}]})
    assert len(out) == 1 and out[0].startswith("error tiers[0].capacity:") and "more than the whole filesystem" in out[0]


def test_tiers_sharing_a_disk_are_added_up(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    each = free // 2 + 2**30  # each fits alone, both together do not
    out = findings(
        {
            "tiers": [
                {"backend": "lmdb", "capacity": each, "path": str(tmp_path / "a")},
                {"backend": "file", "capacity": each, "path": str(tmp_path / "b")},
            ]
        }
    )
    assert [o.split(":")[0] for o in out] == ["error tiers[0].capacity", "error tiers[1].capacity"]
    assert "tiers[0]" in out[0] and "tiers[1]" in out[0] and "free" in out[0]


def test_host_memory_beyond_the_machine_is_an_error() -> None:
    total, _ = host_memory()
    assert total is not None
    out = findings({"tiers": [{"backend": "cpu", "capacity": total * 2, "pin_memory": False}]})
    assert len(out) == 1 and out[0].startswith("error tiers[0].capacity:") and "more than this machine's" in out[0]


def test_pinned_memory_beyond_the_memlock_limit_is_a_warning() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft > 2**30:
        pytest.skip("no small RLIMIT_MEMLOCK here")
    out = findings({"tiers": [{"backend": "cpu", "capacity": soft + 2**20, "pin_memory": True}]})
    assert any(o.startswith("warning tiers[0].capacity:") and "RLIMIT_MEMLOCK" in o for o in out)
    # unpinned memory is not limited by it
    assert not any("RLIMIT_MEMLOCK" in o for o in findings({"tiers": [{"backend": "cpu", "capacity": soft + 2**20, "pin_memory": False}]}))


def test_a_plugin_that_fails_to_import_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real installed distribution (found through its .dist-info on sys.path) whose entry point
    # names a class its module does not have.
    (tmp_path / "broken_policy_mod.py").write_text("class LRU:\n    pass\n")
    info = tmp_path / "broken_policy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-policy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvtier.policies]\nfifo = broken_policy_mod:FifoPolicy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.policies.refresh()
    try:
        cfg = load_config({"policy": "fifo", "tiers": [{"backend": "cpu", "capacity": "1MiB"}]})  # well formed
        out = [f"{f.severity} {f}" for f in check_deployment(cfg)]
        assert len(out) == 1 and out[0].startswith("error policy: the policy 'fifo' cannot be loaded")
        assert "FifoPolicy" in out[0]
    finally:
        monkeypatch.undo()
        registry.policies.refresh()


def test_findings_are_logged_as_warnings_at_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    regular = tmp_path / "regular"
    regular.write_text("x")
    cfg = load_config({"tiers": [{"backend": "file", "capacity": "1MiB", "path": str(regular)}]})
    with caplog.at_level(logging.WARNING, logger="kvtier.config.deploy"):
        assert len(log_findings(cfg)) == 1
    assert "tiers[0].path" in caplog.text


async def test_a_store_logs_the_findings_when_it_opens_and_opens_anyway(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    import kvtier

    st = os.statvfs(tmp_path)
    too_big = st.f_blocks * st.f_frsize * 2  # LMDB maps it lazily: the store opens
    caches = [torch.zeros(4, 16, 2, 4, 8, dtype=torch.bfloat16)]
    config = {"tiers": [{"backend": "lmdb", "capacity": too_big, "path": str(tmp_path / "db")}]}
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        async with kvtier.open(config, kv_caches=caches, namespace=kvtier.Namespace(model_id="m")) as store:
            assert store.stats()["tiers"][0]["capacity_bytes"] > 0
    assert "tiers[0].capacity" in caplog.text and "more than the whole filesystem" in caplog.text


# -- remote tiers: `kvtier config check` connects to each server once --------------------------


def probed(tier: dict) -> list[str]:
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}, {"backend": "redis", "capacity": "1MiB", **tier}]})
    return [f"{f.severity} {f}" for f in check_deployment(cfg, probe_timeout_s=2.0) if f.field == "tiers[1]"]


def test_an_unreachable_redis_server_is_an_error_naming_its_url(dead_port: int) -> None:
    url = f"redis://127.0.0.1:{dead_port}/0"  # nothing listens there
    out = probed({"url": url})
    assert len(out) == 1 and out[0].startswith(f"error tiers[1]: the redis server does not answer: {url}: not reachable"), out
    cfg = load_config({"tiers": [{"backend": "redis", "capacity": "1MiB", "url": url}]})
    assert check_deployment(cfg) == []  # without a probe timeout (what a store does at open): no network


def test_a_reachable_server_passes_and_a_refused_login_or_a_missing_database_is_named(own_redis_server) -> None:
    own_redis_server.cli("ACL", "SETUSER", "probe", "on", ">right", "~*", "+@all")
    assert probed({"url": own_redis_server.url}) == []
    assert probed({"url": own_redis_server.url, "username": "probe", "password": "right"}) == []
    wrong = probed({"url": own_redis_server.url, "username": "probe", "password": "wrong"})
    assert len(wrong) == 1 and "authentication refused (check username and password / password_env)" in wrong[0], wrong
    assert "wrong" not in wrong[0].replace("authentication", "")  # never the secret
    missing = probed({"url": own_redis_server.url.replace("/0", "/99")})
    assert len(missing) == 1 and "the database number in the URL does not exist" in missing[0], missing


def test_a_tls_server_whose_certificate_is_not_trusted_is_named(tmp_path: Path) -> None:
    from redis_servers import tls_server

    server, tls_port, cert = tls_server(tmp_path)
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        assert probed({"url": url, "tls_ca_file": str(cert)}) == []
        untrusted = probed({"url": url})
        assert len(untrusted) == 1 and "the TLS handshake failed" in untrusted[0] and url in untrusted[0], untrusted
    finally:
        server.stop()


# -- slots: what a tier holds before it evicts, worked out without opening it -------------------


@pytest.mark.parametrize(
    "tier",
    [
        {"backend": "lmdb", "capacity": "256MiB", "codec": "zstd-shuffle"},
        {"backend": "lmdb", "capacity": "8MiB"},
        {"backend": "file", "capacity": "8MiB"},
        {"backend": "cpu", "capacity": "8MiB"},
    ],
)
async def test_tier_slots_are_the_blocks_the_opened_tier_holds(tmp_path: Path, tier: dict) -> None:
    import kvtier
    from kvtier.config.deploy import tier_slots

    block = 32 << 10
    if tier["backend"] in ("lmdb", "file"):
        tier = {**tier, "path": str(tmp_path / "tier")}
    cfg = load_config({"tiers": [tier], "block_bytes": block})
    slots, more = tier_slots(cfg, 0, block)
    assert more is ("codec" in tier)
    async with kvtier.open(cfg) as store:
        assert store.manager is not None
        assert slots == store.backends[0].max_blocks == store.manager.tier_spec(0).policy.capacity
    if tier["backend"] == "lmdb":  # its map's own pages and every record's header are counted
        assert slots < cfg.tiers[0].capacity // block
