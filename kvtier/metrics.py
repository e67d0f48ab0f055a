"""Metrics: a dependency-free recorder on every store, and an optional Prometheus exporter.

Two parts with one contract:

* :class:`StoreMetrics` is owned by each :class:`~kvtier.store.KVStore` and records what the
  manager and backends do not count themselves, per finished *job*: blocks served and missed
  per tier, raw bytes stored and loaded per tier, promotions (blocks served from a tier below
  the first that a load also copied into the first tier), store failures by cause, and job latency histograms.
  Updating it is a few integer additions under a lock, once per job, never per lookup.
  ``KVStore.stats()`` includes its snapshot under ``"io"``.
* :func:`export` registers a collector that reads ``KVStore.stats()`` **on scrape** and turns
  it into Prometheus counters, gauges and histograms (names below), so the hot path pays
  nothing for Prometheus. ``prometheus_client`` is the optional ``metrics`` extra and is
  imported only here, lazily; without it, ``export`` logs one clear warning and returns a
  no-op handle (or raises :class:`~kvtier.errors.MissingDependencyError` with ``require=True``).

Exported families (every one has a ``store`` label; ``tier`` is the tier's name):
``kvtier_lookups_total``, ``kvtier_lookup_keys_total``, ``kvtier_lookup_hits_total``,
``kvtier_lookup_misses_total``, ``kvtier_tier_hits_total{tier}``, ``kvtier_tier_misses_total{tier}``,
``kvtier_tier_bytes_stored_total{tier}``, ``kvtier_tier_bytes_loaded_total{tier}``,
``kvtier_tier_evictions_total{tier}``, ``kvtier_tier_demotions_total{tier}``,
``kvtier_tier_promotions_total{tier}``, ``kvtier_store_failures_total{cause}`` (``tier_full``,
``write_failed``, ``job_error``), ``kvtier_corrupt_records_total{tier}``,
``kvtier_tier_used_bytes{tier}``, ``kvtier_tier_capacity_bytes{tier}``, ``kvtier_tier_blocks{tier}``,
``kvtier_job_latency_seconds{kind}`` (histogram). Shared tiers (those with a follower, see
:mod:`kvtier.backends.feed_follower`) add ``kvtier_shared_hits_total{tier}``,
``kvtier_shared_adopted_total{tier}``, ``kvtier_shared_removed_total{tier}``,
``kvtier_shared_tier_blocks{tier}``, ``kvtier_feed_entries_total{tier}``,
``kvtier_feed_gaps_total{tier}``, ``kvtier_feed_failures_total{tier}``,
``kvtier_index_sweeps_total{tier}`` and ``kvtier_feed_lag_seconds{tier,quantile}``. ``kvtier_scrape_errors_total{store}`` counts
scrapes that could not read a store (logged, at warning level the first time).

A scrape runs on the exporter's thread while the engine's loop changes the store: ``stats()``
is safe there (the manager copies its figures under its lock, in time independent of how many
keys it holds), so one scrape is one consistent moment.

Logging: kvtier logs through :mod:`logging` under ``kvtier.*`` and, with the library's
``NullHandler``, prints nothing unless the application configures logging.
"""

from __future__ import annotations

import logging
import threading
import weakref
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from typing import Any

from kvtier.errors import ClosedError, MissingDependencyError

__all__ = ["LATENCY_BUCKETS", "Exporter", "StoreMetrics", "collect_families", "export", "tenant_metrics_text"]

log = logging.getLogger("kvtier.metrics")

#: Upper bounds (seconds) of the job latency histogram buckets; the last bucket is +Inf.
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_INSTALL_HINT = "pip install 'kvtier[metrics]'"


class _Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def snapshot(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        bounds = [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]
        return {"buckets": dict(zip(bounds, cumulative)), "count": running, "sum": self.sum}


class StoreMetrics:
    """Per-job counters of one store. Thread-safe; ``snapshot()`` returns plain data."""

    _PER_TIER = ("hits", "misses", "bytes_stored", "bytes_loaded", "promotions", "write_failed")

    def __init__(self, num_tiers: int) -> None:
        self._lock = threading.Lock()
        self._tiers = [dict.fromkeys(self._PER_TIER, 0) for _ in range(num_tiers)]
        self._failures = {"write_failed": 0, "job_error": 0}
        self._latency = {"store": _Histogram(), "load": _Histogram()}

    def record_store(self, plan: Any, result: Any, block_bytes: int) -> None:
        """Account a finished store job (a ``StorePlan`` and its ``JobResult``)."""
        with self._lock:
            # (a bucket and the sum, here and in record_load: no call of its own, once per job)
            seconds = float(result.seconds)
            latency = self._latency["store"]
            latency.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
            latency.sum += seconds
            if result.error is not None:
                self._failures["job_error"] += 1
                return
            if not result.failed and not plan.write_through and not plan.demotions:  # (the usual job)
                if 0 <= plan.tier < len(self._tiers):
                    self._tiers[plan.tier]["bytes_stored"] += len(plan.keys) * block_bytes
                return
            failed = {t: len(keys) for t, keys in result.failed.items()}
            writes: list[tuple[int, int]] = [(plan.tier, len(plan.keys))]
            writes += [(t, len(keys)) for t, keys in plan.write_through]
            writes += [(d.dst, len(d.keys)) for d in plan.demotions]
            for tier, count in writes:
                if 0 <= tier < len(self._tiers):
                    self._tiers[tier]["bytes_stored"] += max(count - failed.get(tier, 0), 0) * block_bytes
            for tier, count in failed.items():
                if 0 <= tier < len(self._tiers):
                    self._tiers[tier]["write_failed"] += count
                self._failures["write_failed"] += count

    def record_load(self, plan: Any, result: Any, block_bytes: int) -> None:
        """Account a finished load job (a ``LoadPlan`` and its ``JobResult``)."""
        with self._lock:
            seconds = float(result.seconds)
            latency = self._latency["load"]
            latency.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
            latency.sum += seconds
            if result.error is not None:
                for tier in plan.tiers:
                    if 0 <= tier < len(self._tiers):
                        self._tiers[tier]["misses"] += 1
                return
            tiers = plan.tiers
            if tiers and not result.missed and not getattr(plan, "promote", ()) and tiers.count(tiers[0]) == len(tiers):
                if 0 <= tiers[0] < len(self._tiers):  # (the usual load: every key from one tier, found)
                    row = self._tiers[tiers[0]]
                    row["hits"] += len(tiers)
                    row["bytes_loaded"] += len(tiers) * block_bytes
                return
            missed: dict[int, int] = {}
            for tier in result.missed_tiers:
                missed[tier] = missed.get(tier, 0) + 1
            served: dict[int, int] = {}
            for tier in plan.tiers:
                served[tier] = served.get(tier, 0) + 1
            for tier, count in served.items():
                if not 0 <= tier < len(self._tiers):
                    continue
                row = self._tiers[tier]
                hits = max(count - missed.get(tier, 0), 0)
                row["hits"] += hits
                row["misses"] += count - hits
                row["bytes_loaded"] += hits * block_bytes
            promoted = set(getattr(plan, "promote", ())) - set(result.failed.get(0, ())) - set(result.missed)
            for key, tier in zip(plan.keys, plan.tiers):
                if key in promoted and 0 < tier < len(self._tiers):
                    self._tiers[tier]["promotions"] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "tiers": [dict(row) for row in self._tiers],
                "store_failures": dict(self._failures),
                "latency_seconds": {kind: h.snapshot() for kind, h in self._latency.items()},
            }


# -- Prometheus ------------------------------------------------------------------------------


def _tier_rows(stats: Mapping[str, Any]) -> Iterator[tuple[int, str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    tiers = stats.get("tiers", [])
    backends = stats.get("backends", [])
    io = stats.get("io", {}).get("tiers", [])
    for i, tier in enumerate(tiers):
        name = str(tier.get("name", i))
        yield i, name, tier, backends[i] if i < len(backends) else {}, io[i] if i < len(io) else {}


def collect_families(stats: Mapping[str, Any], store_label: str) -> list[Any]:
    """Prometheus metric families for one ``KVStore.stats()`` snapshot."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    families: list[Any] = []

    def store_counter(name: str, doc: str, value: float) -> None:
        fam = CounterMetricFamily(name, doc, labels=["store"])
        fam.add_metric([store_label], value)
        families.append(fam)

    keys = int(stats.get("lookup_keys", 0))
    hits = int(stats.get("lookup_hits", 0))
    store_counter("kvtier_lookups", "lookup calls", stats.get("lookups", 0))
    store_counter("kvtier_lookup_keys", "keys asked about by lookups", keys)
    store_counter("kvtier_lookup_hits", "keys in the leading ready run of lookups", hits)
    store_counter("kvtier_lookup_misses", "keys asked about that were not part of the leading hit run", max(keys - hits, 0))
    store_counter(
        "kvtier_saved_memory_only",
        "blocks save() stored in memory tiers only (write-back, or a write-through copy deferred or failed): a crash loses them until they are demoted or flushed",
        stats.get("saved_memory_only", 0),
    )
    store_counter(
        "kvtier_write_through_deferred",
        "blocks whose write-through copy was deferred to write-back because the tier writes were behind",
        stats.get("transfers", {}).get("write_through_deferred", 0),
    )

    per_tier: list[tuple[str, str, type, Any]] = [
        ("kvtier_tier_hits", "blocks served by loads, by tier", CounterMetricFamily, lambda t, b, io: io.get("hits", 0)),
        ("kvtier_tier_misses", "blocks a load expected but could not read, by tier", CounterMetricFamily, lambda t, b, io: io.get("misses", 0)),
        ("kvtier_tier_bytes_stored", "raw block bytes written, by tier", CounterMetricFamily, lambda t, b, io: io.get("bytes_stored", 0)),
        ("kvtier_tier_bytes_loaded", "raw block bytes loaded, by tier", CounterMetricFamily, lambda t, b, io: io.get("bytes_loaded", 0)),
        ("kvtier_tier_evictions", "blocks evicted, by tier", CounterMetricFamily, lambda t, b, io: t.get("evictions", 0)),
        ("kvtier_tier_demotions", "blocks demoted into this tier", CounterMetricFamily, lambda t, b, io: t.get("demotions_in", 0)),
        (
            "kvtier_tier_promotions",
            "blocks a load promoted from this (lower) tier into the first tier",
            CounterMetricFamily,
            lambda t, b, io: t.get("promotions", io.get("promotions", 0)),
        ),
        ("kvtier_corrupt_records", "records that failed their checksum and were deleted", CounterMetricFamily, lambda t, b, io: b.get("corrupt_records", 0)),
        ("kvtier_tier_used_bytes", "bytes accounted in the tier", GaugeMetricFamily, lambda t, b, io: t.get("used_bytes", 0)),
        ("kvtier_tier_capacity_bytes", "byte cap of the tier", GaugeMetricFamily, lambda t, b, io: t.get("capacity_bytes", 0)),
        ("kvtier_tier_blocks", "blocks held (ready and pending)", GaugeMetricFamily, lambda t, b, io: t.get("blocks", 0)),
    ]
    rows = list(_tier_rows(stats))
    for name, doc, kind, get in per_tier:
        fam = kind(name, doc, labels=["store", "tier"])
        for _, tier_name, tier, backend, io in rows:
            fam.add_metric([store_label, tier_name], float(get(tier, backend, io)))
        families.append(fam)

    families += _tenant_families(stats, store_label)
    families += _shared_families(rows, store_label)

    io_all = stats.get("io", {})
    failures = CounterMetricFamily("kvtier_store_failures", "blocks or jobs that could not be stored, by cause", labels=["store", "cause"])
    failures.add_metric([store_label, "tier_full"], stats.get("store_rejected", 0))
    for cause, value in io_all.get("store_failures", {}).items():
        failures.add_metric([store_label, cause], value)
    families.append(failures)

    latency = HistogramMetricFamily("kvtier_job_latency_seconds", "transfer job latency", labels=["store", "kind"])
    for kind, hist in io_all.get("latency_seconds", {}).items():
        latency.add_metric([store_label, kind], list(hist["buckets"].items()), hist["sum"])
    families.append(latency)
    return families


def _tenant_families(stats: Mapping[str, Any], store_label: str) -> list[Any]:
    """Usage per tenant per tier (``stats()["tenants"]``: the top N tenants by bytes, the rest
    as ``other``, ids hashed when the store's config asks), when the store counts tenants."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    tenants = stats.get("tenants")
    if not tenants:
        return []
    out = []
    for field, name, doc, kind in (
        ("blocks", "kvtier_tenant_blocks", "blocks a tenant holds in a tier", GaugeMetricFamily),
        ("bytes", "kvtier_tenant_bytes", "bytes a tenant holds in a tier", GaugeMetricFamily),
        ("hits", "kvtier_tenant_hits", "blocks of a tenant served by loads from a tier", CounterMetricFamily),
        ("evictions", "kvtier_tenant_evictions", "blocks of a tenant evicted from a tier", CounterMetricFamily),
        ("pinned", "kvtier_tenant_pinned_blocks", "blocks of a tenant pinned in a tier", GaugeMetricFamily),
        ("quota_bytes", "kvtier_tenant_quota_bytes", "a tenant's byte quota in a tier", GaugeMetricFamily),
    ):
        fam = kind(name, doc, labels=["store", "tier", "tenant"])
        for tier, by_tenant in tenants.items():
            for tenant, row in by_tenant.items():
                if field in row:
                    fam.add_metric([store_label, str(tier), str(tenant)], float(row[field]))
        out.append(fam)
    return out


def tenant_metrics_text(usage: Mapping[str, Any], store_label: str) -> bytes:
    """The ``kvtier_tenant_*`` series of ``usage`` (per tier, per tenant, as ``store.usage``
    gives it) in Prometheus's text format (vLLM's admin endpoint serves them)."""
    from prometheus_client import CollectorRegistry, generate_latest

    families = _tenant_families({"tenants": usage}, store_label)

    class _Usage:
        def collect(self) -> list[Any]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Usage())  # type: ignore[arg-type]
    return bytes(generate_latest(registry))


def _shared_families(rows: list[tuple[int, str, Any, Any, Any]], store_label: str) -> list[Any]:
    """Series of shared tiers (those whose backend reports a ``follow`` section)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    shared = [(name, backend["follow"]) for _, name, _, backend, _ in rows if isinstance(backend.get("follow"), Mapping)]
    if not shared:
        return []
    specs: list[tuple[str, str, type, str]] = [
        ("kvtier_shared_hits", "blocks loads served from a shared tier that another engine stored", CounterMetricFamily, "shared_hits"),
        ("kvtier_shared_adopted", "blocks other engines stored that this engine adopted (feed and sweeps)", CounterMetricFamily, "adopted"),
        ("kvtier_shared_removed", "blocks this engine learnt the shared tier lost, and forgot", CounterMetricFamily, "removed"),
        ("kvtier_shared_tier_blocks", "blocks the shared tier held for this namespace at the last sweep (or at open)", GaugeMetricFamily, "tier_keys"),
        ("kvtier_feed_entries", "change feed entries of other engines applied", CounterMetricFamily, "feed_entries"),
        ("kvtier_feed_gaps", "times the change feed had lost entries (each followed by a sweep)", CounterMetricFamily, "feed_gaps"),
        ("kvtier_feed_failures", "change feed reads that failed (the server or directory unreachable)", CounterMetricFamily, "feed_failures"),
    ]
    out: list[Any] = []
    for name, doc, kind, field in specs:
        fam = kind(name, doc, labels=["store", "tier"])
        for tier_name, follow in shared:
            fam.add_metric([store_label, tier_name], float(follow.get(field, 0)))
        out.append(fam)
    sweeps = CounterMetricFamily("kvtier_index_sweeps", "full sweeps of a shared tier (the feed's backstop)", labels=["store", "tier"])
    lag = GaugeMetricFamily(
        "kvtier_feed_lag_seconds", "seconds from another engine's write to this engine's index, recent entries", labels=["store", "tier", "quantile"]
    )
    for tier_name, follow in shared:
        sweeps.add_metric([store_label, tier_name], float(follow.get("index", {}).get("sweeps", 0)))
        for q, key in (("0.5", "p50"), ("0.99", "p99")):
            lag.add_metric([store_label, tier_name, q], float(follow.get("lag_s", {}).get(key, 0.0)))
    return [*out, sweeps, lag]


class _Collector:
    """Reads every registered store's ``stats()`` on scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stores: dict[str, weakref.ref[Any]] = {}
        #: Scrapes that could not read a store's stats, by label (a closed store excepted);
        #: added to under ``_lock``, as scrapes may run on several threads at once.
        self.errors: dict[str, int] = {}

    def add(self, store: Any, label: str) -> str:
        with self._lock:
            unique, n = label, 1
            while unique in self._stores and self._stores[unique]() is not None:
                n += 1
                unique = f"{label}-{n}"
            self._stores[unique] = weakref.ref(store)
            return unique

    def remove(self, label: str) -> None:
        with self._lock:
            self._stores.pop(label, None)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            stores = [(label, ref()) for label, ref in self._stores.items()]
        merged: dict[str, Any] = {}
        for label, store in stores:
            if store is None:
                continue
            try:
                stats = store.stats()
            except ClosedError as exc:  # a closed store stops reporting
                log.debug("metrics: store %s not scraped: %s", label, exc)
                continue
            except Exception as exc:  # a scrape never fails, but it is never dropped silently
                # (under the lock: scrapes run at once on the HTTP server's threads, and an add
                # made between another's read and store would be lost)
                with self._lock:
                    failures = self.errors[label] = self.errors.get(label, 0) + 1
                log.log(logging.WARNING if failures == 1 else logging.DEBUG, "metrics: store %s not scraped: %r", label, exc)
                continue
            for fam in collect_families(stats, label):
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        with self._lock:
            failed = dict(self.errors)  # (a copy: another scrape may add a store's first failure)
        if failed:
            from prometheus_client.core import CounterMetricFamily

            errors = CounterMetricFamily("kvtier_scrape_errors", "scrapes that could not read a store's stats", labels=["store"])
            for label, count in failed.items():
                errors.add_metric([label], count)
            merged[errors.name] = errors
        yield from merged.values()

    def describe(self) -> list[Any]:
        return []  # families depend on the stores registered; skip the registry's collision check


_collectors: weakref.WeakKeyDictionary[Any, _Collector] = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()
_servers: dict[tuple[str, int], Any] = {}


class Exporter:
    """Handle returned by :func:`export`; ``close()`` stops reporting the store. Idempotent.
    ``port``: the port this process serves ``/metrics`` on for it (``None``: none, or the port
    could not be bound)."""

    def __init__(self, collector: _Collector | None = None, label: str = "", port: int | None = None) -> None:
        self._collector = collector
        self.label = label
        self.port = port

    @property
    def active(self) -> bool:
        return self._collector is not None

    def close(self) -> None:
        if self._collector is not None:
            self._collector.remove(self.label)
            self._collector = None


def export(
    store: Any,
    *,
    store_label: str = "kvtier",
    port: int | None = None,
    addr: str = "127.0.0.1",
    registry: Any = None,
    require: bool = False,
) -> Exporter:
    """Report ``store`` to Prometheus (``registry`` defaults to prometheus_client's default one).

    With ``port``, also serve ``/metrics`` over HTTP (one server per address and port per
    process). A port that cannot be bound (in use by another process, say another vLLM rank)
    is a warning naming ``metrics.port`` and the port, never an error: the store is registered
    all the same and the returned handle's ``port`` is ``None``. Without ``prometheus_client``:
    a warning and a no-op :class:`Exporter`, or :class:`MissingDependencyError` when ``require``
    is true.
    """
    try:
        import prometheus_client
    except ImportError as exc:
        message = f"Prometheus metrics requested but prometheus_client is not installed; export disabled ({_INSTALL_HINT})"
        if require:
            raise MissingDependencyError(message) from exc
        log.warning(message)
        return Exporter()
    registry = prometheus_client.REGISTRY if registry is None else registry
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = _Collector()
            registry.register(collector)
        if port is not None and (addr, port) not in _servers:
            try:
                _servers[(addr, port)] = prometheus_client.start_http_server(port, addr=addr, registry=registry)
            except OSError as exc:  # a port in use never stops a store (nor the engine it serves)
                log.warning(
                    "metrics.port %d on %s cannot be served (%s); this process's kvtier metrics are not served over "
                    "HTTP (the store runs on, registered with the in-process registry); set metrics.port to a free port",
                    port,
                    addr,
                    exc.strerror or exc,
                )
                port = None
    label = collector.add(store, store_label)
    log.info("metrics: exporting store %r to Prometheus%s", label, f" on {addr}:{port}" if port is not None else "")
    return Exporter(collector, label, port)
