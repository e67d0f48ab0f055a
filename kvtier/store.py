"""The engine-facing store: tiers, manager and transfers behind one asyncio object.

``store = await kvtier.open(config, kv_caches=caches)`` (or ``async with kvtier.open(...)``)
builds the backends named in ``config`` through the plugin registry, opens them, rebuilds the
index of persistent tiers, and starts the transfer workers. The lifecycle calls are the
manager's (see :mod:`kvtier.manager`); ``save`` and ``load`` run prepare -> transfer ->
complete for engines that want no connector (:class:`kvtier.transfer.runs.JobRuns` does the work).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch

from kvtier import config as config_module
from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.bulk import RecordColumns, paused_gc
from kvtier.config import StoreConfig, load_config
from kvtier.config.tier_errors import no_room, tier_error
from kvtier.errors import BackendError, ClosedError, ConfigError, KVTierError, LayoutError
from kvtier.keys import Namespace, check_keys
from kvtier.manager import CacheEvent, KeyStatus, LoadPlan, StorePlan, TierManager, TierSpec
from kvtier.metrics import Exporter, StoreMetrics
from kvtier.records.head_group_tier import group_tiers
from kvtier.records.head_groups import HeadGroupLayout
from kvtier.tenancy import StoreTenancy
from kvtier.transfer import TransferEngine
from kvtier.transfer.handover import release_tiers
from kvtier.transfer.jobs import Applied, JobResult
from kvtier.transfer.layout import KVLayout
from kvtier.transfer.layout_checks import check_caches_match_namespace, check_distinct_block_ids, given_fields
from kvtier.transfer.offloop import off_loop
from kvtier.transfer.runs import JobRuns

__all__ = ["KVStore", "open"]

log = logging.getLogger("kvtier")


class KVStore(StoreTenancy):
    """Tiers + manager + transfer engine. Build it with :func:`kvtier.open`. Tenant calls
    (usage, quotas, pins, deletes) come from :class:`kvtier.tenancy.StoreTenancy`."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        kv_caches: Sequence[torch.Tensor] | torch.Tensor | None = None,
        namespace: Namespace | None = None,
        head_groups: HeadGroupLayout | None = None,
    ) -> None:
        self.config = config
        self.layout: KVLayout | None = None
        if kv_caches is not None:
            self.layout = KVLayout(
                kv_caches,
                engine_blocks_per_block=config.engine_blocks_per_block,
                staging_bytes=config.staging_bytes,
                copy_threads=config.copy_threads,
            )
            block_bytes = self.layout.block_bytes
            dtype = self.layout.dtype
        elif config.block_bytes is not None:
            block_bytes, dtype = config.block_bytes, "uint8"
        else:
            raise ConfigError("block_bytes: give kv_caches, or set block_bytes in the config for a store without a KV cache")
        if self.layout is not None:  # refuse caches the namespace contradicts, naming the shape
            given = (config.namespace or {}).keys() if namespace is None else given_fields(namespace)
            check_caches_match_namespace(self.layout.kv_caches, namespace or Namespace.from_dict(config.namespace_fields()), given)
        if namespace is None:
            ns_fields = config.namespace_fields()
            if self.layout is not None:
                ns_fields.setdefault("kv_layout", self.layout.fingerprint())
            namespace = Namespace.from_dict(ns_fields)
        if head_groups is None and self.layout is not None and config.head_groups.enabled:
            head_groups = config.head_groups.layout(self.layout.kv_caches, namespace, engine_blocks_per_block=config.engine_blocks_per_block)
        if not config.head_groups.enabled:
            head_groups = None  # the config's per_rank layout, with its reason, wins
        #: one record per (block, head group) in byte tiers (kvtier.records.head_groups), or None
        self.head_groups = head_groups
        if head_groups is not None:
            # Keys and records no longer depend on the TP rank or size: the group layout replaces
            # the rank's own tensor shapes in the namespace.
            namespace = head_groups.namespace(namespace)
        elif self.layout is not None:
            # Whatever namespace the caller passes, the layout is part of what persistent tiers
            # check at open and of the keys built from ``store.namespace`` (issue 11, item 2).
            namespace = _with_layout(namespace, self.layout.fingerprint())
        self.namespace = namespace
        self.format = BlockFormat(
            block_bytes=block_bytes, dtype=dtype, namespace_digest=namespace.digest, namespace=namespace.to_dict()
        )
        self.backends: list[Backend] = [config_module.build_backend(t, i) for i, t in enumerate(config.tiers)]
        if head_groups is not None:
            self.backends = group_tiers(self.backends, head_groups, namespace)
        self.metrics = StoreMetrics(len(self.backends))
        # Tenant tags are saved only in persistent tiers: a save skips flush_tags without one.
        self._tagged_tiers = any(b.persistent for b in self.backends)
        self._exporter: Exporter | None = None
        self.manager: TierManager | None = None
        self.transfers: TransferEngine | None = None
        self._closed = False
        #: save and load jobs, and those of cancelled callers (kvtier.transfer.runs)
        self._runs = JobRuns(self._mgr, self.metrics, self.format.block_bytes, config.engine_blocks_per_block, lambda: self._closed)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> KVStore:
        from kvtier.config.deploy import log_findings

        log_findings(self.config, log)  # warnings only: what `kvtier config check` would report
        opened: list[Backend] = []
        try:
            for i, backend in enumerate(self.backends):
                try:
                    await backend.open(self.format)
                except (ConfigError, BackendError) as exc:
                    raise tier_error(i, backend, exc) from exc
                opened.append(backend)
                if backend.max_blocks < 1:
                    raise ConfigError(no_room(i, backend, self.config.tiers[i].capacity))
        except BaseException:
            for backend in opened:
                await backend.aclose()
            raise
        specs = []
        names: set[str] = set()
        for i, (tier, backend) in enumerate(zip(self.config.tiers, self.backends)):
            name = tier.name or backend.name
            if name in names:
                name = f"{name}{i}"
            names.add(name)
            policy_cls = registry.policies.get(tier.policy or self.config.policy)
            specs.append(
                TierSpec(
                    name=name,
                    capacity_bytes=backend.usable_bytes(),
                    block_reserve=backend.reserve_bytes(),
                    policy=policy_cls(capacity=backend.max_blocks),
                    persistent=backend.persistent,
                    variable_size=getattr(backend, "variable_size", backend.reserve_bytes() != self.format.block_bytes),
                    admit_after=tier.admit_after,
                )
            )
        try:
            self.manager = TierManager(specs, write=self.config.write, tenants=self._tenant_rules([s.name for s in specs]))
        except KVTierError:  # a quota the opened tiers cannot hold (a database keeps some room)
            for backend in opened:
                await backend.aclose()
            raise
        for i, backend in enumerate(self.backends):
            if backend.persistent:
                tags = await self._read_tags(backend)
                with paused_gc():  # a record and a tuple per stored block (kvtier.bulk)
                    records = await asyncio.to_thread(_scan_records, backend)
                    owners = _held_tags(tags[0], records) if tags and tags[0] else None
                    excess = self.manager.adopt(i, records, owners)
                if tags is not None:
                    await self._adopt_tags(i, backend, tags[1])
                if excess and not getattr(backend, "shared", False):  # a shared tier's records are every host's
                    log.warning(
                        "kvtier: tier %d (%s) holds %d records beyond its usable capacity; deleting the %d oldest",
                        i, backend.name, len(records), len(excess),
                    )
                    await backend.delete(excess)
            bind_index = getattr(backend, "bind_index", None)
            if bind_index is not None:  # a shared tier keeps this index in step with its server
                bind_index(self.manager, i)
        if self.layout is not None:
            self.transfers = TransferEngine(
                self.layout,
                self.backends,
                staging_blocks=self.config.staging_blocks,
                write_through_backlog=self.config.write_through_backlog,
                deadline_s=self.config.job_deadline_s,
                inline_max_bytes=self.config.inline_max_bytes,
            )
        if self.config.metrics.enabled:
            from kvtier import metrics

            m = self.config.metrics
            self._exporter = metrics.export(self, store_label=m.store_label, port=m.port, addr=m.addr)
        log.info("kvtier store open: tiers %s, write-%s", [s.name for s in specs], self.config.write)
        return self

    async def aclose(self) -> None:
        """Finish queued jobs, persist access stamps, close every tier. Idempotent.

        Never frees what a running job uses: a job still inside a tier call when the transfer
        engine's close gives up waiting (``close_timeout_s``) is stopped (reported failed, it
        never touches an engine block again), and the tiers and device staging are left to its
        thread, which closes them when the call returns (:mod:`kvtier.transfer.handover`); no
        write-back runs then. This returns without waiting for it."""
        if self._closed:
            return
        self._closed = True
        if self._exporter is not None:
            self._exporter.close()
        if self.transfers is not None:
            await off_loop(self.transfers.close)
            self._settle_finished()
            if not self.transfers.stopped:
                log.warning("kvtier: a transfer job still runs at close; its thread closes the tiers when it ends, no write-back")
                if self.manager is not None:
                    self.manager.close()
                staging = self.layout.staging if self.layout is not None else None
                self.transfers.when_stopped(functools.partial(release_tiers, list(self.backends), staging))
                return
        if self.layout is not None:  # the device staging goes back to the allocator
            await off_loop(self.layout.staging.close)
        if self.manager is not None:
            await self._flush_on_close()
            await self.flush_stamps()
            self.manager.close()
        for backend in self.backends:
            await backend.aclose()

    async def flush(self, *, budget_s: float | None = None, budget_bytes: int | None = None) -> Any:
        """Write blocks held only in memory tiers back to the first persistent tier now, most
        recent first, within the budgets (``None``: no limit); returns a
        :class:`kvtier.transfer.flush.FlushReport`. ``aclose()`` does this with the configured budget."""
        from kvtier.transfer.flush import flush_to_persistent

        return await flush_to_persistent(self._mgr(), self.backends, budget_s=budget_s, budget_bytes=budget_bytes)

    async def _flush_on_close(self) -> None:
        budget_s = self.config.flush_on_close_s
        if self.manager is None or not budget_s:
            return
        from kvtier.transfer.flush import flush_to_persistent

        try:
            await flush_to_persistent(self.manager, self.backends, budget_s=budget_s, budget_bytes=self.config.flush_on_close_bytes)
        except Exception as exc:  # a clean close never fails over the write-back
            log.warning("kvtier: write-back at close failed: %s", exc)

    async def flush_stamps(self) -> None:
        """Save access stamps of persistent tiers, so eviction order survives a restart (and
        their tenant tags and pins)."""
        assert self.manager is not None
        await self.flush_tags()
        for i, backend in enumerate(self.backends):
            if backend.persistent:
                stamps = self.manager.take_stamps(i)
                if stamps:
                    await off_loop(backend.touch_stamps, stamps)

    async def __aenter__(self) -> KVStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _mgr(self) -> TierManager:
        if self._closed:
            raise ClosedError("the store is closed")
        if self.manager is None:
            raise ClosedError("the store is not open; use 'await kvtier.open(...)'")
        return self.manager

    def _xfer(self) -> TransferEngine:
        self._mgr()
        if self.transfers is None:
            raise LayoutError("this store was opened without kv_caches, so it cannot move blocks")
        return self.transfers

    # -- lifecycle calls (see kvtier.manager) ----------------------------------------------
    async def lookup(self, keys: Sequence[bytes]) -> int:
        return self._mgr().lookup(keys)

    async def lookup_detail(self, keys: Sequence[bytes]) -> list[KeyStatus]:
        return self._mgr().lookup_detail(keys)

    async def prepare_store(self, keys: Sequence[bytes], *, tenant: str | None = None) -> StorePlan | None:
        return self._mgr().prepare_store(keys, tenant=tenant)

    async def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        self._mgr().complete_store(keys, success)

    async def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        return self._mgr().prepare_load(keys)

    async def complete_load(self, keys: Sequence[bytes]) -> None:
        self._mgr().complete_load(keys)

    async def touch(self, keys: Sequence[bytes]) -> None:
        self._mgr().touch(keys)

    def take_events(self) -> list[CacheEvent]:
        """Stored / removed events, oldest first: this store's own, and, for shared tiers,
        the blocks it adopted from other engines (``stored``) and those it learnt the tier
        lost (``removed``), as its followers applied them."""
        return self._mgr().take_events()

    # -- shared tiers: live following (kvtier.backends.feed_follower) --------------------------
    @property
    def followers(self) -> dict[int, Any]:
        """The :class:`~kvtier.backends.feed_follower.TierFollower` of each shared tier, by tier
        index (empty when no tier is shared)."""
        found = {i: getattr(b, "follower", None) for i, b in enumerate(self.backends)}
        return {i: f for i, f in found.items() if f is not None}

    def on_shared_change(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``listener`` with every :class:`~kvtier.backends.feed_follower.TierChange` of
        every shared tier (keys other engines stored and this store adopted, keys the tier
        lost), on the followers' threads, after the index changed. Returns a function that
        stops the calls."""
        stops = [f.listen(listener) for f in self.followers.values()]

        def unlisten() -> None:
            for stop in stops:
                stop()

        return unlisten

    def stats(self) -> dict[str, Any]:
        data = self._mgr().stats()
        if "tenants" in data and self.config.tenancy.hash_ids:  # never a tenant id in clear
            data["tenants"] = self.labelled(data["tenants"])
        data["backends"] = [b.stats() for b in self.backends]
        if self.transfers is not None:
            data["transfers"] = dict(self.transfers.counters)
        if self.layout is not None:
            data["staging"] = self.layout.staging.stats()
        data["io"] = self.metrics.snapshot()
        data["saved_memory_only"] = self._runs.memory_only
        return data

    def finish_store(self, plan: StorePlan, result: JobResult) -> int:
        """Apply a finished store job to the manager; return how many blocks became ready."""
        return self._runs.finish_store(plan, result)

    def finish_load(self, plan: LoadPlan, result: JobResult) -> Applied:
        """Apply a finished load job: unpin, and forget keys that turned out missing or corrupt."""
        return self._runs.finish_load(plan, result)

    # -- convenience: prepare -> transfer -> complete ----------------------------------------
    def _job_input(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> tuple[TransferEngine, list[int]]:
        """Validate ``keys`` and their engine ``block_ids`` (``n`` per key) before any change."""
        check_keys(keys)
        transfers = self.transfers
        if transfers is None or self._closed or self.manager is None:  # (no calls when open)
            transfers = self._xfer()  # raises, naming what is wrong
        ids = transfers.layout.check_block_ids(block_ids, len(keys))
        return transfers, ids

    async def save(self, keys: Sequence[bytes], block_ids: Sequence[int], *, durable: bool = False, tenant: str | None = None) -> int:
        """Store the blocks ``block_ids`` (``n`` engine ids per key) under ``keys``.

        Returns the number of blocks newly stored (keys already present are skipped), all of
        them in the batch's leading run: a full tier or a failing disk gives 0 for the blocks
        concerned, and the store stops at the first block it could not store. Blocks of the same
        run written behind that hole (a Redis Cluster with one primary down stores the live
        primaries' keys) are released: ``lookup`` and ``load`` could never reach them, so they
        are forgotten, their records deleted, and not counted. Nothing raises.

        Blocks stored but held only in memory tiers are lost by a crash: with ``write: back``,
        or when a write-through copy failed or was deferred because the tier writes were behind
        (``write_through_backlog``). Each such block is counted in
        ``stats()["saved_memory_only"]``. With ``durable=True`` the save's write-through copies
        are never deferred (they wait their turn), and the count returned is of the newly
        stored blocks that are on a persistent tier when it returns: a crash from then on loses
        none of them. (A store without a persistent tier is a ``ConfigError``.)

        A batch larger than the first tier's room is stored in runs, in prefix order: each run
        is the leading part of what is left that the first tier can take
        (``prepare_store(partial=True)``), and each run makes room by evicting the run before
        it, which the lower tiers take (demotion, or the write-through copy already there). So a
        long prompt is stored as far as the tiers have room, never all or nothing; the store
        stops at the first run that cannot be placed or fails, and before a run that would push
        the earlier ones out of the lowest tier.

        ``tenant`` names whose blocks these are: counted as its usage, stored under its quotas
        (a quota makes a save smaller, never an error)."""
        transfers, ids = self._job_input(keys, block_ids)
        stored, kept = await self._runs.save(transfers, keys, ids, durable=durable, tenant=tenant)
        if stored and self._tagged_tiers and not self._closed:  # the tenant tags of the blocks made ready, once per save
            await self.flush_tags(sync=durable)  # synced to disk when the save must be
        return kept if durable else stored

    async def load(self, keys: Sequence[bytes], block_ids: Sequence[int], *, promote: bool = True) -> int:
        """Load the leading run of ``keys`` that is stored into ``block_ids``; return how many
        leading blocks were filled with the right bytes (the rest must be recomputed).

        With ``promote``, the filled blocks that were served from a lower tier are then
        promoted into the first tier (:meth:`TierManager.prepare_promote`: room is made by
        demoting the first tier's victims) by a store job that reads them from ``block_ids``.
        That job is awaited before this returns, so the caller may reuse its blocks at once;
        a promotion that cannot make room or fails is skipped, never an error."""
        transfers, ids = self._job_input(keys, block_ids)
        check_distinct_block_ids(ids)
        return await self._runs.load(transfers, keys, ids, promote=promote)

    async def _run_job(self, transfers: TransferEngine, job: int, plan: StorePlan | LoadPlan) -> JobResult:
        return await self._runs.run(transfers, job, plan)

    def _settle_finished(self) -> None:
        """Apply the jobs of cancelled callers that have ended since."""
        if self.manager is not None:
            self._runs.settle_finished(self.transfers)


def _with_layout(namespace: Namespace, fingerprint: str) -> Namespace:
    """``namespace`` with the KV layout's fingerprint in ``kv_layout`` (kept if already there)."""
    if fingerprint in namespace.kv_layout:
        return namespace
    layout = f"{namespace.kv_layout};{fingerprint}" if namespace.kv_layout else fingerprint
    return dataclasses.replace(namespace, kv_layout=layout)


def _held_tags(owners: dict[bytes, str], records: list[tuple[bytes, int, float]] | RecordColumns) -> dict[bytes, str]:
    """The saved tenant tags of the records a tier lists (tags of records gone are dropped)."""
    return {key: owners[key] for key, _, _ in records if key in owners}


def _scan_records(backend: Backend) -> list[tuple[bytes, int, float]] | RecordColumns:
    """The tier's records: as columns where the tier lists them so (``scan_columns``: no
    object per record but its key), else one tuple per ``scan()`` record."""
    columns = getattr(backend, "scan_columns", None)
    listed = columns() if columns is not None else None
    if listed is not None:
        return listed
    return [(r.key, r.stored_bytes, r.stamp) for r in backend.scan()]


class _Opener:
    """``await kvtier.open(...)`` or ``async with kvtier.open(...) as store``."""

    def __init__(self, store: KVStore) -> None:
        self._store = store

    def __await__(self) -> Generator[Any, None, KVStore]:
        return self._store.start().__await__()

    async def __aenter__(self) -> KVStore:
        return await self._store.start()

    async def __aexit__(self, *exc: object) -> None:
        await self._store.aclose()


def open(
    config: Mapping[str, Any] | StoreConfig | str | Any,
    *,
    kv_caches: Sequence[torch.Tensor] | torch.Tensor | None = None,
    namespace: Namespace | None = None,
) -> _Opener:
    """Build a :class:`KVStore` from ``config`` (a dict, or a YAML/TOML file path)."""
    if isinstance(config, (str, os.PathLike)):
        cfg = config_module.load_config_file(config)
    elif not isinstance(config, (Mapping, StoreConfig)):
        raise ConfigError(f"config: expected a mapping or a YAML/TOML file path, got {type(config).__name__}")
    else:
        cfg = load_config(config)
    return _Opener(KVStore(cfg, kv_caches=kv_caches, namespace=namespace))
