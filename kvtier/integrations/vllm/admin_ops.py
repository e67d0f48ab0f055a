"""What the vLLM admin endpoint does to the scheduler side: pins, unpins, deletes, lookups and
usage per tenant, over every offloaded KV-cache group (no vLLM import; see :mod:`.admin`).

Under vLLM the scheduler side's managers (one per KV-cache group) decide everything and the
worker ranks only carry out their plans, each over its own tiers (or a tier they share). So:

* **a pin holds on every rank**: a pinned block is never chosen as a victim by the manager,
  and a rank evicts only what a plan tells it to;
* **a delete frees the bytes everywhere they are**: the managers forget the blocks at once (a
  lookup misses from then on), and their (tier, key) pairs go to each group's
  :class:`~kvtier.connector.DeleteLedger`, whose deletes every rank runs with the engine's next
  step (the connector metadata, before that step's stores), the same way as the deletes of a
  failed job. A shared tier's copy is deleted by the rank that writes it.

Threads: these calls run on the endpoint's own thread. Each manager call holds that manager's
lock for one bounded batch (:data:`BATCH` keys), as any lifecycle call does, so the step loop
waits at most one batch. The ledgers belong to the step thread: deletes wait in
:class:`PendingDeletes` (its lock is held only to swap a list) until the connector hands them
to the ledgers at the start of the next step (:meth:`AdminOps.to_ledgers`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.config.tenants import hashed_tenant
from kvtier.errors import ConfigError, QuotaError
from kvtier.integrations.vllm.groups import SchedulerGroups
from kvtier.keys import fold_block_hashes
from kvtier.manager import TierManager
from kvtier.manager.tenants import check_tenant

__all__ = ["BATCH", "AdminOps", "NotReady", "PendingDeletes", "offload_keys"]

#: keys per manager call of a delete (the manager's lock is released between batches)
BATCH = 4096

#: the block hashes of a prompt as vLLM's scheduler computes them for a request: (token ids,
#: cache salt or None) -> one hash per ``tokens_per_hash`` tokens, chained over the prefix
PrefixHasher = Callable[[Sequence[int], "str | None"], list[bytes]]


class NotReady(RuntimeError):
    """The engine has not started its tiers yet (the ranks have not described them)."""


def offload_keys(block_hashes: Sequence[bytes], group_id: int, hashes_per_chunk: int) -> list[bytes]:
    """vLLM's offload keys of a prompt's chunks in KV-cache group ``group_id``: the hash of each
    chunk's last block with the group index packed after it (its ``make_offload_key``; the
    offloading scheduler's ``update_offload_keys`` takes every ``hashes_per_chunk``-th hash)."""
    tail = group_id.to_bytes(4, "big", signed=False)
    return [bytes(block_hashes[i]) + tail for i in range(hashes_per_chunk - 1, len(block_hashes), hashes_per_chunk)]


class PendingDeletes:
    """(group position, tier, keys) the managers forgot, until the step thread hands them to the
    groups' ledgers. Thread-safe; its lock is held only to append or swap the list."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[int, int, list[bytes]]] = []

    def __len__(self) -> int:
        with self._lock:
            return sum(len(keys) for _, _, keys in self._items)

    def add(self, gpos: int, tier: int, keys: list[bytes]) -> None:
        if keys:
            with self._lock:
                self._items.append((gpos, tier, keys))

    def take(self) -> list[tuple[int, int, list[bytes]]]:
        with self._lock:
            items, self._items = self._items, []
        return items


class AdminOps:
    """The endpoint's operations over the scheduler side of one engine (see the module doc).

    ``hasher`` computes a prompt's block hashes as vLLM does; ``hashes_per_chunk[g]`` is how
    many of them make one offloaded chunk of the group at position ``g``. Every call checks its
    input before it changes anything and raises :class:`~kvtier.errors.ConfigError` (bad input,
    naming the field), :class:`~kvtier.errors.QuotaError` (a pin over budget: nothing pinned) or
    :class:`NotReady`."""

    def __init__(
        self, groups: SchedulerGroups, hasher: PrefixHasher, hashes_per_chunk: Sequence[int], *, hash_ids: bool = False
    ) -> None:
        self._groups = groups
        #: tenant ids hashed in metric labels (the config's ``tenancy.hash_ids``)
        self.hash_ids = hash_ids
        self._hasher = hasher
        self._per_chunk = tuple(int(n) for n in hashes_per_chunk)
        self.pending = PendingDeletes()

    # -- helpers ---------------------------------------------------------------------------
    def _managers(self) -> list[TierManager]:
        if not self._groups.ready:
            raise NotReady("kvtier: the engine has not opened its tiers yet (no step has run); try again")
        out = []
        for group in self._groups.groups:
            assert group.engine.manager is not None
            out.append(group.engine.manager)
        return out

    def tier_names(self) -> list[str]:
        mgr = self._managers()[0]
        return [mgr.tier_spec(i).name for i in range(mgr.num_tiers)]

    def _tier(self, tier: Any) -> int | None:
        if tier is None:
            return None
        return self._managers()[0].tenants.tier_index(tier)

    def prefix_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> list[list[bytes]]:
        """Per group (position order): the kvtier keys of the full chunks of ``token_ids``, as a
        request with those tokens and ``cache_salt`` stores them."""
        managers = self._managers()
        hashes = self._hasher(token_ids, cache_salt)
        out = []
        for group, per_chunk, _mgr in zip(self._groups.groups, self._per_chunk, managers):
            vkeys = offload_keys(hashes, group.engine.group, per_chunk)
            out.append(fold_block_hashes(vkeys, namespace=group.namespace) if vkeys else [])
        return out

    # -- operations ------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], cache_salt: str | None) -> dict[str, Any]:
        """How many of the prompt's chunks each tier holds ready, and how many are pinned."""
        names = self.tier_names()
        per_group = self.prefix_keys(token_ids, cache_salt)
        by_tier = dict.fromkeys(names, 0)
        pinned = dict.fromkeys(names, 0)
        chunks = 0
        for mgr, keys in zip(self._managers(), per_group):
            chunks += len(keys)
            for ti, name in enumerate(names):
                kept = set(mgr.tenants.pinned(ti))
                by_tier[name] += sum(1 for k in keys if mgr.holds(k, ti))
                pinned[name] += sum(1 for k in keys if k in kept)
        stored = sum(1 for mgr, keys in zip(self._managers(), per_group) for k in keys if mgr.status(k).tier is not None)
        return {"chunks": chunks, "stored": stored, "by_tier": by_tier, "pinned": pinned}

    def pin(self, token_ids: Sequence[int], cache_salt: str | None, tier: Any = None) -> dict[str, Any]:
        """Pin the prompt's stored chunks (in ``tier``, default the fastest holding each). All
        or nothing over the groups: a pin over a budget pins nothing and raises QuotaError."""
        ti = self._tier(tier)
        managers = self._managers()
        per_group = self.prefix_keys(token_ids, cache_salt)
        before = [{t: set(mgr.tenants.pinned(t)) for t in range(mgr.num_tiers)} for mgr in managers]
        newly, done = 0, 0
        try:
            for mgr, keys in zip(managers, per_group):
                if keys:
                    newly += mgr.tenants.pin(keys, ti)
                done += 1
        except QuotaError:
            for mgr, was in zip(managers[:done], before):  # the groups pinned already: undone
                for t, kept in was.items():
                    fresh = [k for k in mgr.tenants.pinned(t) if k not in kept]
                    if fresh:
                        mgr.tenants.unpin(fresh, t)
            raise
        stored = sum(1 for mgr, keys in zip(managers, per_group) for k in keys if mgr.status(k).tier is not None)
        chunks = sum(len(keys) for keys in per_group)
        return {"chunks": chunks, "stored": stored, "pinned": newly, "noop": newly == 0}

    def unpin(self, token_ids: Sequence[int], cache_salt: str | None, tier: Any = None) -> dict[str, Any]:
        ti = self._tier(tier)
        per_group = self.prefix_keys(token_ids, cache_salt)
        gone = sum(mgr.tenants.unpin(keys, ti) for mgr, keys in zip(self._managers(), per_group) if keys)
        return {"chunks": sum(len(k) for k in per_group), "unpinned": gone, "noop": gone == 0}

    def delete_prefix(self, token_ids: Sequence[int], cache_salt: str | None, wait_s: float = 2.0) -> dict[str, Any]:
        """Forget the prompt's chunks in every tier; their bytes go with the next step."""
        per_group = self.prefix_keys(token_ids, cache_salt)
        return self._delete(per_group, wait_s)

    def delete_tenant(self, tenant: str, wait_s: float = 2.0) -> dict[str, Any]:
        """Forget every block of ``tenant`` (a cache salt, or ``default``) in every tier."""
        check_tenant(tenant)
        per_group = [mgr.tenants.keys_of(tenant) for mgr in self._managers()]
        return self._delete(per_group, wait_s)

    def _delete(self, per_group: list[list[bytes]], wait_s: float) -> dict[str, Any]:
        names = self.tier_names()
        by_tier = dict.fromkeys(names, 0)
        deleted = skipped = 0
        deadline = time.monotonic() + wait_s
        for gpos, (mgr, keys) in enumerate(zip(self._managers(), per_group)):
            todo = keys
            while todo:
                busy: list[bytes] = []
                for start in range(0, len(todo), BATCH):
                    gone = mgr.tenants.forget(todo[start : start + BATCH])
                    for ti, ks in gone.removed.items():
                        self.pending.add(gpos, ti, ks)
                        by_tier[names[ti]] += len(ks)
                    deleted += len(gone.keys)
                    busy.extend(gone.busy)
                if not busy or time.monotonic() >= deadline:
                    skipped += len(busy)
                    break
                todo = busy
                time.sleep(0.01)  # a load reads them: wait for it (this is not the step thread)
        return {
            "deleted": deleted,
            "by_tier": {n: c for n, c in by_tier.items() if c},
            "skipped": skipped,
            "noop": deleted == 0 and skipped == 0,
        }

    def usage(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per tier name, per tenant: blocks, bytes, hits, evictions, pinned (and quota_bytes),
        added up over the KV-cache groups. Engine-wide: every rank holds the same blocks."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for mgr in self._managers():
            for tier, rows in mgr.tenants.usage().items():
                mine = out.setdefault(tier, {})
                for tenant, row in rows.items():
                    acc = mine.setdefault(tenant, {})
                    for name, value in row.items():
                        acc[name] = acc.get(name, 0) + value
        return out

    def metrics(self) -> bytes:
        """:meth:`usage` as Prometheus's ``kvtier_tenant_*`` series (``store`` label: the engine
        id; tenant ids hashed when the config asks)."""
        from kvtier.metrics import tenant_metrics_text

        rows = self.usage()
        labelled = {tier: {hashed_tenant(u, self.hash_ids): row for u, row in by.items()} for tier, by in rows.items()}
        return tenant_metrics_text(labelled, self._groups.engines[0].engine_id)

    # -- the step thread -------------------------------------------------------------------
    def to_ledgers(self) -> int:
        """Hand the deletes waiting since the last step to the groups' ledgers (on the step
        thread, before the connector takes the step's deletes); returns how many keys."""
        items = self.pending.take()
        groups = self._groups.groups
        n = 0
        for gpos, tier, keys in items:
            if 0 <= gpos < len(groups):
                groups[gpos].side.ledger.remember(tier, keys)
                n += len(keys)
        return n


def check_token_ids(value: Any, *, limit: int) -> list[int]:
    """``token_ids`` of a request body: a non-empty list of at most ``limit`` non-negative ints."""
    if not isinstance(value, list) or not value:
        raise ConfigError("token_ids: expected a non-empty list of token ids")
    if len(value) > limit:
        raise ConfigError(f"token_ids: {len(value)} tokens, at most {limit}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ConfigError(f"token_ids[{i}]: expected a non-negative integer, got {t!r}")
    return value
