"""The store facade's tenant calls: usage, quotas, pins and deletes (a mixin of ``KVStore``).

* ``store.usage()``: blocks, bytes, hits, evictions and pins per tenant per tier (the top N
  tenants by bytes, the rest as ``other``); also in ``store.stats()["tenants"]``.
* ``store.set_quota(tenant, tier, size)``: change a quota while the store runs.
* ``store.pin(keys, tier=...)``, ``unpin``, ``pin_prefix(token_ids, namespace)``: pinned blocks
  are never evicted from that tier; a pin over the tier's pin budget raises
  :class:`~kvtier.errors.QuotaError` and pins nothing.
* ``store.delete(keys=..., token_ids=..., tenant=..., namespace=...)``: forget the blocks in
  every tier and delete their records, shared tiers included. A block a load is reading (or a
  store is writing) is waited for up to ``wait_s``, then skipped: its bytes are never freed
  under a reader. A delete that finds nothing is a no-op.

Tags (each block's tenant) and pins of persistent tiers are saved with the tier (see
``Backend.read_tags``): the tags of the blocks a ``save`` stored before it returns (one write per
tier per save, not per block), and at each pin, unpin and delete, and at close; they are read
back at open. Blocks stored through ``prepare_store`` / ``finish_store`` (the engine adapters)
have their tags saved at the next of those calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.backend import Backend
from kvtier.config.tenants import hashed_tenant, tenant_rules
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, block_keys, check_keys
from kvtier.manager import StorePlan, TierManager
from kvtier.manager.tenants import TenantRules, check_tenant
from kvtier.transfer.offloop import off_loop
from kvtier.units import parse_size

if TYPE_CHECKING:
    from kvtier.config import StoreConfig
    from kvtier.transfer import TransferEngine
    from kvtier.transfer.jobs import JobResult

__all__ = ["DeleteReport", "StoreTenancy"]

log = logging.getLogger("kvtier")


@dataclass(frozen=True, slots=True)
class DeleteReport:
    """What ``store.delete`` did: ``deleted`` distinct blocks (``by_tier``: per tier name), and
    ``skipped`` blocks a load was still reading (or a store writing) when ``wait_s`` ran out."""

    deleted: int
    by_tier: dict[str, int]
    skipped: int

    def to_dict(self) -> dict[str, Any]:
        return {"deleted": self.deleted, "by_tier": dict(self.by_tier), "skipped": self.skipped}


class StoreTenancy:
    """Tenant calls of :class:`kvtier.store.KVStore`; see the module doc."""

    config: StoreConfig
    backends: list[Backend]
    namespace: Namespace
    manager: TierManager | None
    transfers: TransferEngine | None

    if TYPE_CHECKING:

        def _mgr(self) -> TierManager: ...

        async def _run_job(self, transfers: TransferEngine, job: int, plan: StorePlan) -> JobResult: ...

    # -- rules and usage -------------------------------------------------------------------
    def _tenant_rules(self, names: Sequence[str]) -> TenantRules | None:
        """The config's quotas and pin budgets (``None`` when it sets none: tenants are then
        counted from the first call that names one)."""
        cfg = self.config
        if cfg.tenants is None and not cfg.tenancy.pin_budget and cfg.tenancy.top_n == 10:
            return None
        return tenant_rules(cfg.tenants, cfg.tenancy, names)

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` as logs and metric labels show it (hashed when ``tenancy.hash_ids``)."""
        return hashed_tenant(tenant, self.config.tenancy.hash_ids)

    def usage(self, *, labels: bool = False) -> dict[str, dict[str, dict[str, int]]]:
        """Per tier name, per tenant: blocks, bytes, hits, evictions, pinned (and quota_bytes).
        ``labels=True`` shows tenant ids as logs and metrics do (hashed if configured)."""
        rows = self._mgr().tenants.usage()
        return self.labelled(rows) if labels else rows

    def labelled(self, rows: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, dict[str, int]]]:
        """``rows`` (usage by tier, by tenant) with tenant ids as logs and metrics show them."""
        return {tier: {self.tenant_label(u): row for u, row in by.items()} for tier, by in rows.items()}

    def set_quota(self, tenant: str, tier: int | str, size: int | str | None) -> None:
        """Set ``tenant``'s byte quota in ``tier`` (``None``: remove it); checked like the
        config's quotas, raising before anything changes."""
        nbytes = None if size is None else parse_size(size, field=f"tenants.{tenant}.{tier}")
        self._mgr().tenants.set_quota(tenant, tier, nbytes)
        log.info("kvtier: quota of tenant %s in tier %s set to %s", self.tenant_label(tenant), tier, size)

    # -- pins ------------------------------------------------------------------------------
    async def pin(self, keys: Sequence[bytes], *, tier: int | str | None = None) -> int:
        """Pin ``keys`` in ``tier`` (default: the fastest tier holding each); how many were
        newly pinned. Keys not stored are skipped."""
        n = self._mgr().tenants.pin(keys, tier)
        await self.flush_tags()
        return n

    async def unpin(self, keys: Sequence[bytes], *, tier: int | str | None = None) -> int:
        n = self._mgr().tenants.unpin(keys, tier)
        await self.flush_tags()
        return n

    def prefix_keys(self, token_ids: Sequence[int], namespace: Namespace | None = None) -> list[bytes]:
        """The chain of block keys of ``token_ids`` (full blocks only) in ``namespace``
        (default: the store's)."""
        ns = namespace or self.namespace
        return block_keys(token_ids, block_size=ns.block_size * self.config.engine_blocks_per_block, namespace=ns)

    async def pin_prefix(self, token_ids: Sequence[int], namespace: Namespace | None = None, *, tier: int | str | None = None) -> int:
        """Pin the blocks of the prompt ``token_ids`` (see :meth:`prefix_keys`)."""
        return await self.pin(self.prefix_keys(token_ids, namespace), tier=tier)

    async def unpin_prefix(self, token_ids: Sequence[int], namespace: Namespace | None = None, *, tier: int | str | None = None) -> int:
        return await self.unpin(self.prefix_keys(token_ids, namespace), tier=tier)

    # -- deletes ---------------------------------------------------------------------------
    async def delete(
        self,
        keys: Sequence[bytes] | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        tenant: str | None = None,
        namespace: Namespace | None = None,
        wait_s: float = 2.0,
    ) -> DeleteReport:
        """Delete blocks from every tier: the given ``keys``, the chain of ``token_ids`` (in
        ``namespace``, default the store's), every block of ``tenant``, or, with ``namespace``
        alone, every block of that namespace (this store holds one: its own; another is a
        no-op). Exactly one selector besides ``namespace``, or ``namespace`` alone."""
        mgr = self._mgr()
        given = [name for name, v in (("keys", keys), ("token_ids", token_ids), ("tenant", tenant)) if v is not None]
        if len(given) > 1 or (not given and namespace is None):
            raise ConfigError(f"delete: give one of keys, token_ids, tenant or namespace alone, got {given or 'none'}")
        if keys is not None:
            check_keys(keys)
            wanted = list(keys)
        elif token_ids is not None:
            wanted = self.prefix_keys(token_ids, namespace)
        elif tenant is not None:
            wanted = mgr.tenants.keys_of(check_tenant(tenant))
        else:
            assert namespace is not None
            wanted = mgr.tenants.keys_of() if namespace.digest == self.namespace.digest else []
        removed: dict[int, set[bytes]] = {}
        deadline = time.monotonic() + wait_s
        busy: tuple[bytes, ...] = ()
        todo = wanted
        while True:
            gone = mgr.tenants.forget(todo)
            for ti, ks in gone.removed.items():
                removed.setdefault(ti, set()).update(ks)
            await self._delete_records(gone.removed, wanted if keys is not None or token_ids is not None else [])
            busy = gone.busy
            if not busy or time.monotonic() >= deadline:
                break
            todo = list(busy)
            await asyncio.sleep(0.01)  # a load reads them: wait for it, then try again
        await self.flush_tags()
        names = [mgr.tier_spec(i).name for i in range(mgr.num_tiers)]
        report = DeleteReport(len(set().union(*removed.values())), {names[i]: len(ks) for i, ks in sorted(removed.items())}, len(busy))
        if report.deleted or report.skipped:
            what = f"tenant {self.tenant_label(tenant)}" if tenant is not None else f"{len(wanted)} keys"
            log.info("kvtier: delete of %s: %d blocks deleted, %d skipped (being read)", what, report.deleted, report.skipped)
        return report

    async def _delete_records(self, removed: dict[int, list[bytes]], named: Sequence[bytes]) -> None:
        """Delete the records of keys the manager forgot: through the transfer engine when it
        runs (queued behind every job before, so a later store of the same key is never
        deleted), else straight. A shared tier also drops the ``named`` keys this host never
        listed (another host's copies)."""
        drops = {ti: list(ks) for ti, ks in removed.items()}
        for ti, backend in enumerate(self.backends):
            if getattr(backend, "shared", False) and named:
                extra = [key for key in named if key not in set(drops.get(ti, ()))]
                if extra:
                    drops.setdefault(ti, []).extend(extra)
        if not drops:
            return
        transfers = self.transfers
        if transfers is not None:
            plan = StorePlan(0, (), (), drops=tuple((ti, tuple(ks)) for ti, ks in sorted(drops.items(), reverse=True)))
            job = transfers.submit_store(plan, [])
            await self._run_job(transfers, job, plan)
            return
        for ti, ks in drops.items():
            try:
                await self.backends[ti].delete(ks)
            except Exception as exc:  # the manager forgot them: a record left over is an orphan, adopted later
                log.warning("kvtier: delete in tier %d failed: %s", ti, exc)

    # -- persistence of tags and pins ------------------------------------------------------
    async def _read_tags(self, backend: Backend) -> tuple[dict[bytes, str], list[bytes]] | None:
        try:
            return await off_loop(backend.read_tags)
        except Exception as exc:  # tags are bookkeeping: the blocks are served without them
            log.warning("kvtier: tenant tags of tier %s not read: %s", backend.name, exc)
            return None

    async def _adopt_tags(self, tier: int, backend: Backend, pins: Sequence[bytes]) -> None:
        """After ``tier`` adopted its records: pin again what was pinned, and rewrite the tags
        whole (the entries of records that are gone dropped)."""
        mgr = self._mgr()
        pins = [key for key in pins if mgr.holds(key, tier)]  # those of records gone are dropped
        if pins:
            n = mgr.tenants.adopt_pins(tier, pins)
            if n < len(pins):
                log.warning("kvtier: tier %s: %d of %d saved pins not restored (over the pin budget)", backend.name, len(pins) - n, len(pins))
        owners, kept = mgr.tenants.tags(tier)
        try:
            await off_loop(lambda: backend.write_tags(list(owners.items()), [(key, True) for key in kept], whole=True))
        except Exception as exc:  # tags are bookkeeping: the store opens without them
            log.warning("kvtier: tenant tags of tier %s not rewritten: %s", backend.name, exc)

    async def flush_tags(self, *, sync: bool = True) -> None:
        """Save the tenant tags and pin changes of persistent tiers made since the last call
        (``sync=False``: without waiting for the disk; a process crash keeps them)."""
        mgr = self.manager  # also while closing: the last changes are saved then
        if mgr is None:
            return
        for i, backend in enumerate(self.backends):
            if backend.persistent:
                owners, pins = mgr.tenants.take_tags(i)
                if owners or pins:
                    try:
                        await off_loop(lambda b=backend, o=owners, p=pins: b.write_tags(o, p, sync=sync))
                    except Exception as exc:  # tags are bookkeeping: never an error for the caller
                        log.warning("kvtier: tenant tags of tier %s not saved: %s", backend.name, exc)
