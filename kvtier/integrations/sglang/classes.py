"""The ``HiCacheStorage`` subclass SGLang loads, built on first use (it needs SGLang's base class).

Every call delegates to :class:`~kvtier.integrations.sglang.core.SglangStore` and answers a
whole result: a list with one entry per page, an ``int`` for ``batch_exists``, never ``None``
(a ``None`` kills SGLang's prefetch or backup thread for the life of the process).
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.sglang.core import SglangStore

__all__ = ["build_storage_class"]

#: The only host pool this backend stores (hybrid models' extra pools are refused at attach).
KV_POOL = "kv"


def build_storage_class() -> type:
    """``KvtierHiCacheStorage``, a subclass of SGLang's ``HiCacheStorage``."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

    class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
        """kvtier's tiers as SGLang HiCache's L3 (``--hicache-storage-backend dynamic``)."""

        def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
            self.kvtier = SglangStore(storage_config, getattr(storage_config, "extra_config", None))

        # -- memory --------------------------------------------------------------------------
        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            super().register_mem_pool_host(mem_pool_host)
            self.kvtier.attach(mem_pool_host)

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            name = str(getattr(host_pool_name, "value", host_pool_name))
            if name != KV_POOL:
                raise ConfigError(
                    f"kvtier's SGLang backend stores the {KV_POOL!r} pool only; the {name!r} pool of this model "
                    "(a hybrid model's extra state) is not supported yet: use another storage backend for it"
                )
            super().register_mem_host_pool_v2(host_pool, host_pool_name)

        # -- zero-copy calls -----------------------------------------------------------------
        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
            return self.kvtier.leading_hits(keys)

        def exists(self, key: str) -> bool:
            return self.kvtier.leading_hits([key]) == 1

        def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
            return self.kvtier.read(keys, host_indices)

        def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
            return self.kvtier.write(keys, host_indices)

        # -- per-pool calls (the kv pool only) -----------------------------------------------
        def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
            if any(str(getattr(t.name, "value", t.name)) != KV_POOL for t in pool_transfers or ()):
                return PoolTransferResult.empty()
            hits = self.kvtier.leading_hits(keys)
            return PoolTransferResult(hits, {KV_POOL: hits} if hits else {}, list(range(1, hits + 1)))

        def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
            return self._per_pool(transfers, self.kvtier.read)

        def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
            return self._per_pool(transfers, self.kvtier.write)

        def _per_pool(self, transfers: Any, call: Any) -> dict[str, list[bool]]:
            out: dict[str, list[bool]] = {}
            for t in transfers or ():
                name = str(getattr(t.name, "value", t.name))
                keys = list(t.keys or [])
                ok = name == KV_POOL and t.host_indices is not None
                out[name] = call(keys, t.host_indices) if ok else [False] * len(keys)
            return out

        # -- copying calls: misses (kvtier needs interface_v1, checked at construction) ---------
        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
            self.kvtier.note_legacy_call("get")
            return None

        def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
            self.kvtier.note_legacy_call("batch_get")
            return [None] * len(keys)

        def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
            self.kvtier.note_legacy_call("set")
            return False

        def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
            self.kvtier.note_legacy_call("batch_set")
            return False

        # -- housekeeping --------------------------------------------------------------------
        def clear(self) -> bool:
            return self.kvtier.clear()

        def get_stats(self) -> None:
            # SGLang expects its own StorageMetrics here (or None); kvtier's counters are in
            # kvtier_stats().
            return None

        def kvtier_stats(self) -> dict[str, Any]:
            return self.kvtier.stats()

        def close(self) -> None:
            self.kvtier.close()

    KvtierHiCacheStorage.__module__ = "kvtier.integrations.sglang"
    return KvtierHiCacheStorage
