"""The per-job recorder, the Prometheus exporter built on KVStore.stats(), and quiet logging."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from test_rows_moved_count import JOBS, THREADS, _race, busy_switches  # noqa: F401  (busy_switches: a fixture)

import kvtier
from kvtier.metrics import StoreMetrics, export
from kvtier.testing import make_key

BLOCK = 4096


def caches() -> torch.Tensor:
    return torch.arange(16 * BLOCK, dtype=torch.int32).to(torch.uint8).reshape(16, BLOCK)


CONFIG = {
    "tiers": [{"backend": "cpu", "capacity": 2 * BLOCK, "name": "host"}, {"backend": "cpu", "capacity": 8 * BLOCK, "name": "spill"}],
    "write": "back",
}


async def exercise() -> tuple[kvtier.KVStore, dict]:
    store = await kvtier.open(CONFIG, kv_caches=caches())
    keys = [make_key(i) for i in range(4)]
    for i, key in enumerate(keys):  # the first tier holds two: two blocks are demoted
        assert await store.save([key], [i]) == 1
    assert await store.load(keys, [8, 9, 10, 11]) == 4
    await store.lookup([*keys, make_key(99)])
    return store, store.stats()


def test_store_stats_include_per_tier_io() -> None:
    async def run() -> dict:
        store, stats = await exercise()
        await store.aclose()
        return stats

    stats = asyncio.run(run())
    io = stats["io"]
    hits = [t["hits"] for t in io["tiers"]]
    assert sum(hits) == 4 and hits[1] == 2  # two blocks served from the lower tier...
    # promotion into the first tier happens only where it has room; both counts agree
    assert io["tiers"][1]["promotions"] == stats.get("promotions", 0)
    assert io["tiers"][0]["promotions"] == 0
    assert io["tiers"][0]["bytes_loaded"] == 2 * BLOCK
    assert io["tiers"][0]["bytes_stored"] == 4 * BLOCK and io["tiers"][1]["bytes_stored"] == 2 * BLOCK
    assert io["latency_seconds"]["store"]["count"] == 4 and io["latency_seconds"]["load"]["count"] == 1


def test_recorder_counts_failures_by_cause() -> None:
    from kvtier.manager import LoadPlan, StorePlan
    from kvtier.transfer import JobResult

    m = StoreMetrics(2)
    keys = (make_key(1), make_key(2))
    plan = StorePlan(1, keys, (0, 1), tier=0, write_through=((1, keys),))
    m.record_store(plan, JobResult(1, "store", True, keys, seconds=0.002, failed={1: (keys[0],)}), BLOCK)
    m.record_store(plan, JobResult(2, "store", False, keys, seconds=20.0, error="boom"), BLOCK)
    m.record_load(LoadPlan(keys, (1, 1)), JobResult(3, "load", True, keys, missed=(keys[1],), missed_tiers=(1,)), BLOCK)
    snap = m.snapshot()
    assert snap["store_failures"] == {"write_failed": 1, "job_error": 1}
    assert snap["tiers"][0]["bytes_stored"] == 2 * BLOCK and snap["tiers"][1]["bytes_stored"] == BLOCK
    assert (snap["tiers"][1]["hits"], snap["tiers"][1]["misses"]) == (1, 1)
    buckets = snap["latency_seconds"]["store"]["buckets"]
    assert buckets["0.0025"] == 1 and buckets["10.0"] == 1 and buckets["+Inf"] == 2


def test_prometheus_exporter_reads_stats_on_scrape() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()

    async def run() -> None:
        store, _ = await exercise()
        handle = export(store, registry=registry, store_label="s1")
        try:
            value = registry.get_sample_value
            assert value("kvtier_tier_hits_total", {"store": "s1", "tier": "spill"}) == 2
            promoted = store.stats().get("promotions", 0)
            assert value("kvtier_tier_promotions_total", {"store": "s1", "tier": "spill"}) == promoted
            assert value("kvtier_tier_evictions_total", {"store": "s1", "tier": "host"}) == 2
            assert value("kvtier_tier_demotions_total", {"store": "s1", "tier": "spill"}) == 2
            assert value("kvtier_lookup_hits_total", {"store": "s1"}) == 8  # load() looks up too
            assert value("kvtier_lookup_misses_total", {"store": "s1"}) == 1
            # two memory tiers: every saved block is held in memory only
            assert value("kvtier_saved_memory_only_total", {"store": "s1"}) == 4
            assert value("kvtier_write_through_deferred_total", {"store": "s1"}) == 0
            assert value("kvtier_tier_bytes_stored_total", {"store": "s1", "tier": "host"}) == 4 * BLOCK
            assert value("kvtier_corrupt_records_total", {"store": "s1", "tier": "host"}) == 0
            assert value("kvtier_store_failures_total", {"store": "s1", "cause": "tier_full"}) == 0
            assert value("kvtier_job_latency_seconds_count", {"store": "s1", "kind": "store"}) == 4
            # a second store with the same label is told apart, not merged
            other = export(store, registry=registry, store_label="s1")
            assert other.label == "s1-2"
            other.close()
        finally:
            handle.close()
            await store.aclose()
        assert registry.get_sample_value("kvtier_tier_hits_total", {"store": "s1", "tier": "spill"}) is None

    asyncio.run(run())


def test_metrics_config_registers_while_open() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")

    async def run() -> None:
        cfg = {**CONFIG, "metrics": {"prometheus": True, "store_label": "from-config"}}
        async with kvtier.open(cfg, kv_caches=caches()) as store:
            await store.save([make_key(1)], [0])
            value = prometheus_client.REGISTRY.get_sample_value("kvtier_tier_blocks", {"store": "from-config", "tier": "host"})
            assert value == 1
        gone = prometheus_client.REGISTRY.get_sample_value("kvtier_tier_blocks", {"store": "from-config", "tier": "host"})
        assert gone is None

    asyncio.run(run())


def test_without_prometheus_export_is_a_noop_with_a_message() -> None:
    code = """
import asyncio, logging, sys
sys.modules["prometheus_client"] = None  # as if the extra were not installed
logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
import kvtier
from kvtier.metrics import export
from kvtier.errors import MissingDependencyError
async def main():
    async with kvtier.open({"block_bytes": 4096, "tiers": [{"backend": "cpu", "capacity": 65536}]}) as store:
        handle = export(store)
        print("active", handle.active)
        try:
            export(store, require=True)
        except MissingDependencyError as exc:
            print("raised", exc)
asyncio.run(main())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "active False" in proc.stdout
    assert "raised" in proc.stdout and "kvtier[metrics]" in proc.stdout
    assert "kvtier.metrics" in proc.stderr and "prometheus_client is not installed" in proc.stderr


def test_library_logging_is_silent_by_default() -> None:
    handlers = logging.getLogger("kvtier").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)
    code = "import asyncio, kvtier\nasync def m():\n    async with kvtier.open({'block_bytes': 4096, 'tiers': [{'backend': 'cpu', 'capacity': 65536}]}):\n        pass\nasyncio.run(m())\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == ""


def test_scrapes_see_one_consistent_moment_while_the_manager_changes() -> None:
    """Defect 10: the exporter's scrape thread read the manager's dictionaries while the loop
    thread changed them; some scrapes raised and were dropped silently, and the others could
    mix two moments. Every scrape must now report the store, with figures that agree."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    block = 4096
    cfg = {
        "block_bytes": block,
        "tiers": [{"backend": "cpu", "capacity": 2048 * block, "name": "host"}, {"backend": "cpu", "capacity": 4096 * block, "name": "spill"}],
        "write": "back",
    }
    problems: list[str] = []
    scrapes = 0
    done = threading.Event()

    def scrape(store: kvtier.KVStore) -> None:
        nonlocal scrapes
        while not done.is_set():
            try:
                samples = {(s.name, s.labels.get("tier")): s.value for fam in registry.collect() for s in fam.samples}
                stats = store.stats()
            except Exception as exc:
                problems.append(f"scrape raised {exc!r}")
                continue
            scrapes += 1
            if ("kvtier_tier_blocks", "host") not in samples:
                problems.append("a scrape left the store out")
            if stats["lookup_hits"] > stats["lookup_keys"]:
                problems.append("lookup counters from two moments")
            for tier in stats["tiers"]:
                if tier["ready"] + tier["pending"] != tier["blocks"] or tier["used_bytes"] != tier["blocks"] * block:
                    problems.append(f"torn tier figures {tier}")

    async def run() -> None:
        async with kvtier.open(cfg) as store:
            handle = export(store, registry=registry, store_label="race")
            mgr = store.manager
            assert mgr is not None and mgr.tier_spec(0).block_reserve == block
            scraper = threading.Thread(target=scrape, args=(store,))
            interval = sys.getswitchinterval()
            sys.setswitchinterval(1e-5)  # switch threads often, as a loaded host does
            scraper.start()
            try:
                n = 0
                while scrapes < 150 and n < 200_000:  # both tiers fill up: stores evict and demote
                    keys = [make_key(n * 8 + i) for i in range(8)]
                    plan = mgr.prepare_store(keys)
                    assert plan is not None
                    mgr.complete_store(plan.keys)
                    mgr.lookup(keys)
                    mgr.complete_load(mgr.prepare_load(keys[:4]).keys)
                    n += 1
            finally:
                done.set()
                scraper.join()
                sys.setswitchinterval(interval)
                handle.close()

    asyncio.run(run())
    assert scrapes >= 150
    assert problems == []


def test_a_store_that_cannot_be_scraped_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Defect 10, second half: a failed scrape was dropped silently (a debug line at most)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()

    class Broken:
        def stats(self) -> dict:
            raise RuntimeError("dictionary changed size during iteration")

    store = Broken()
    handle = export(store, registry=registry, store_label="broken")
    with caplog.at_level(logging.WARNING, logger="kvtier.metrics"):
        list(registry.collect())
        list(registry.collect())
    handle.close()
    assert registry.get_sample_value("kvtier_scrape_errors_total", {"store": "broken"}) == 2
    warnings = [r for r in caplog.records if "broken" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dictionary changed size" in warnings[0].getMessage()


class _YieldingCounts(dict):  # type: ignore[type-arg]
    """Counts whose every read lets other threads run before the reader goes on (as a loaded
    host may)."""

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        time.sleep(0)
        return value


@pytest.mark.usefixtures("busy_switches")
def test_scrapes_on_many_threads_count_every_store_they_could_not_read() -> None:
    """prometheus_client's HTTP server answers each scrape on a thread of its own, so scrapes
    run at once: each failed read of a store is counted, none lost to another scrape's add."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()

    class Broken:
        def stats(self) -> dict:
            raise RuntimeError("unreadable")

    stores = [Broken(), Broken()]
    handles = [export(store, registry=registry, store_label=f"broken{i}") for i, store in enumerate(stores)]
    collector = handles[0]._collector
    assert collector is not None
    collector.errors = _YieldingCounts()
    problems: list[str] = []

    def scrape() -> None:
        try:
            list(registry.collect())
        except Exception as exc:  # a scrape that raises is one the server answers with an error
            problems.append(repr(exc))

    _race(scrape)
    for handle in handles:
        handle.close()
    assert problems == []
    assert dict(collector.errors) == {"broken0": THREADS * JOBS, "broken1": THREADS * JOBS}


def test_a_metrics_port_in_use_is_a_warning_and_the_store_runs_on(caplog: pytest.LogCaptureFixture) -> None:
    """Another process (another vLLM rank) holds the port: the store opens, saves and loads, and
    the warning names the setting and the port."""
    prometheus_client = pytest.importorskip("prometheus_client")
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def run() -> None:
            cfg = {**CONFIG, "metrics": {"port": port, "store_label": "port-in-use"}}
            with caplog.at_level(logging.WARNING, logger="kvtier.metrics"):
                async with kvtier.open(cfg, kv_caches=caches()) as store:
                    assert await store.save([make_key(1)], [0]) == 1
                    assert await store.load([make_key(1)], [5]) == 1
                    assert store._exporter is not None and store._exporter.active and store._exporter.port is None
                    blocks = prometheus_client.REGISTRY.get_sample_value("kvtier_tier_blocks", {"store": "port-in-use", "tier": "host"})
                    assert blocks == 1  # still reported in-process

        asyncio.run(run())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("metrics.port" in m and str(port) in m for m in warnings), warnings
