"""kvtier behind SGLang's HiCache storage calls, without SGLang: thread-safe and never raising.

:class:`SglangStore` is what the ``HiCacheStorage`` subclass delegates to. It drives one
:class:`~kvtier.store.KVStore` whose KV cache is SGLang's host pool (one kvtier block per SGLang
page, seen through :class:`~kvtier.integrations.sglang.pages.HostPages`) and whose tiers are
byte tiers only. Why a ``KVStore`` rather than the backends with an index of our own: the store
already has everything this needs and nothing here repeats it: the tier manager's local index
(rebuilt from persistent tiers at open, kept current by a shared tier's sweeps), capacity and
eviction across several tiers, checksummed records, and the transfer engine that copies a
job's pages in one batch.

Threads. SGLang calls from its prefetch thread and its backup thread at once. The store's
lifecycle calls run on one event loop, on a thread this object owns, so the manager sees one
caller; the SGLang threads hand their call to it and wait for the answer. ``leading_hits``
(``batch_exists``) does not wait for that thread: it reads the manager's index directly, which
takes no lock and never touches the network (a shared tier's index is swept in the background).

Faults. A dead server, a full disk or a damaged record is a miss or a failed write inside the
store already. Anything else that goes wrong in a call (a closed store, a pool that gives
addresses outside its pages, a bug) is caught here: the call answers a full list of ``False``
(``0`` hits) and a counter records it. Nothing raises into SGLang, whose storage threads die
on an exception. Only :meth:`attach` raises, at start-up, where a bad config must stop SGLang.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch

from kvtier.errors import ClosedError, LayoutError, LifecycleError
from kvtier.integrations.sglang.identity import (
    SglangIdentity,
    engine_ranks,
    page_namespace,
    place_tiers,
    read_settings,
    shard_dir,
    whole_copy_tiers,
)
from kvtier.integrations.sglang.pages import HostPages
from kvtier.keys import fold_block_hashes
from kvtier.manager import KeyState, KeyStatus
from kvtier.store import KVStore

__all__ = ["SglangStore"]

log = logging.getLogger("kvtier.sglang")

_T = TypeVar("_T")
_COUNTERS = (
    "exists_calls", "exists_pages", "exists_hits",
    "read_calls", "pages_read", "pages_read_missed",
    "write_calls", "pages_written", "pages_write_failed",
    "exists_errors", "read_errors", "write_errors", "clear_errors",
    "legacy_calls",
)


class _LoopThread:
    """One event loop on a daemon thread; ``run`` hands it a coroutine and waits for the result."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise LifecycleError("kvtier's SGLang loop cannot wait on itself")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()


def _leading_ready(statuses: Sequence[KeyStatus]) -> int:
    for i, status in enumerate(statuses):
        if status.state is not KeyState.READY:
            return i
    return len(statuses)


class SglangStore:
    """A kvtier store over an SGLang host pool, answering HiCache's storage calls."""

    def __init__(self, storage_config: Any, extra_config: Mapping[str, Any] | None) -> None:
        self.identity = SglangIdentity.from_storage_config(storage_config)
        self.settings = read_settings(extra_config)
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._counter_lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self.store: KVStore | None = None
        self.pages: HostPages | None = None
        self._loop: _LoopThread | None = None
        self._closed = False

    # -- start and end ---------------------------------------------------------------------------
    def attach(self, pool: Any) -> None:
        """Open the store over ``pool`` (SGLang's ``register_mem_pool_host``). Raises
        :class:`~kvtier.errors.ConfigError` / :class:`~kvtier.errors.LayoutError` naming the
        problem: at attach, a config that cannot work must stop SGLang."""
        with self._attach_lock:
            if self._closed:
                raise ClosedError("kvtier's SGLang backend is closed")
            if self.store is not None:
                if self.pages is not None and self.pages.pool is pool:
                    return
                raise LifecycleError("kvtier's SGLang backend already has a host pool; one backend serves one pool")
            pages = HostPages(pool)
            namespace = page_namespace(
                self.identity, dtype=pages.dtype, page_size=pages.page_size, layout=pages.layout,
                overrides=self.settings.namespace,
            )
            config = place_tiers(
                self.settings.store, shard_dir(self.identity, pages.layout),
                ranks=engine_ranks(self.identity), whole=whole_copy_tiers(self.identity, self.settings.store),
            )
            store = KVStore(config, kv_caches=pages.views, namespace=namespace)
            loop = _LoopThread(f"kvtier-sglang-tp{self.identity.tp_rank}")
            try:
                loop.run(store.start())
            except BaseException:
                loop.stop()
                raise
            self.pages, self.store, self._loop = pages, store, loop
            log.info(
                "kvtier SGLang backend open: %d pages of %d tokens (%s, %s), tiers %s",
                pages.num_pages, pages.page_size, pages.layout, "MLA" if self.identity.is_mla else "MHA",
                [t.backend for t in config.tiers],
            )

    def close(self) -> None:
        """Finish queued jobs and close the tiers. Idempotent; never raises."""
        with self._attach_lock:
            self._closed = True
            store, loop, self.store, self._loop = self.store, self._loop, None, None
        if store is None or loop is None:
            return
        try:
            loop.run(store.aclose())
        except Exception as exc:
            log.warning("kvtier: closing the SGLang backend's store failed: %s", exc)
        loop.stop()

    # -- the calls SGLang makes ------------------------------------------------------------------
    def keys(self, hashes: Sequence[str | bytes | int]) -> list[bytes]:
        """kvtier keys for SGLang page hashes (hex strings), folded with the store's namespace."""
        store = self._open()
        return fold_block_hashes([h.encode() if isinstance(h, str) else h for h in hashes], namespace=store.namespace)

    def leading_hits(self, hashes: Sequence[str]) -> int:
        """How many leading pages are stored; the local index only (``batch_exists``)."""
        self._count(exists_calls=1, exists_pages=len(hashes))
        try:
            store = self._open()
            assert store.manager is not None
            hits = _leading_ready(store.manager.lookup_detail(self.keys(hashes)))
        except Exception as exc:
            self._fault("exists", exc)
            return 0
        self._count(exists_hits=hits)
        return hits

    def read(self, hashes: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Load the leading stored run of ``hashes`` into their host pages (``batch_get_v1``)."""
        n = len(hashes)
        self._count(read_calls=1)
        try:
            store, ids = self._job(hashes, host_indices)
            filled = self._run(store.load(self.keys(hashes), ids))
        except Exception as exc:
            self._fault("read", exc)
            return [False] * n
        self._count(pages_read=filled, pages_read_missed=n - filled)
        return [True] * filled + [False] * (n - filled)

    def write(self, hashes: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Store the host pages of ``hashes`` (``batch_set_v1``). The pages have been copied out
        when this returns: SGLang may reuse them at once."""
        n = len(hashes)
        self._count(write_calls=1)
        try:
            store, ids = self._job(hashes, host_indices)
            keys = self.keys(hashes)
            self._run(store.save(keys, ids))
            assert store.manager is not None
            results = [s.state is KeyState.READY for s in store.manager.lookup_detail(keys)]
        except Exception as exc:
            self._fault("write", exc)
            return [False] * n
        stored = sum(results)
        self._count(pages_written=stored, pages_write_failed=n - stored)
        return results

    def clear(self) -> bool:
        """Forget and delete every record this store knows (SGLang's storage flush)."""
        try:
            store = self._open()
            self._run(_clear(store))
        except Exception as exc:
            self._fault("clear", exc)
            return False
        return True

    def note_legacy_call(self, name: str) -> None:
        """A copying call (``get``/``set``/``batch_get``/``batch_set``): answered as a miss."""
        with self._counter_lock:  # (SGLang's two threads may make the first such call at once)
            self.counters["legacy_calls"] += 1
            first = self.counters["legacy_calls"] == 1
        if first:
            log.warning("kvtier: SGLang called %s; kvtier serves the zero-copy calls only (interface_v1)", name)

    def stats(self) -> dict[str, Any]:
        """This backend's counters, and the store's when it is open."""
        with self._counter_lock:
            data: dict[str, Any] = dict(self.counters)
        store = self.store
        if store is not None and store.manager is not None:
            try:
                data["store"] = store.stats()
            except Exception as exc:  # a store closing under us: the counters still answer
                log.debug("kvtier: store stats unavailable: %s", exc)
        return data

    # -- helpers ---------------------------------------------------------------------------------
    def _open(self) -> KVStore:
        store = self.store
        if store is None:
            raise ClosedError("kvtier's SGLang backend is closed" if self._closed else "no host pool registered yet")
        return store

    def _job(self, hashes: Sequence[str], host_indices: torch.Tensor) -> tuple[KVStore, list[int]]:
        store = self._open()
        assert self.pages is not None
        ids = self.pages.page_ids(host_indices)
        if len(ids) != len(hashes):
            raise LayoutError(f"host_indices: {len(ids)} pages for {len(hashes)} page hashes")
        return store, ids

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        loop = self._loop
        if loop is None:
            coro.close()
            raise ClosedError("kvtier's SGLang backend is closed")
        return loop.run(coro)

    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            for name, delta in deltas.items():
                self.counters[name] += delta

    def _fault(self, kind: str, exc: BaseException) -> None:
        self._count(**{f"{kind}_errors": 1})
        log.warning("kvtier: SGLang %s call failed, answered as a miss: %s: %s", kind, type(exc).__name__, exc)


async def _clear(store: KVStore) -> None:
    manager = store.manager
    assert manager is not None
    for tier, backend in enumerate(store.backends):
        removed = manager.remove(manager.tier_keys(tier), tier)
        if removed:
            await backend.delete(removed)
