"""The vLLM classes (spec, manager, worker, connector), built on first access because they subclass vLLM's."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection
from typing import Any, TypeVar

import torch

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integrations._sync import run_sync
from kvtier.integrations.vllm.engines import (
    _ENGINES,
    _ENGINES_LOCK,
    MODULE_PATH,
    _check_supported,
    _Engine,
    _namespace,
    _page_views,
    _store_config,
)
from kvtier.integrations.vllm.scheduler_side import _SchedulerSide
from kvtier.integrations.vllm.worker_side import _WorkerSide
from kvtier.keys import fold_block_hashes
from kvtier.manager import LoadPlan, StorePlan, TierManager
from kvtier.store import KVStore

log = logging.getLogger("kvtier.vllm")
_T = TypeVar("_T")


def build_classes() -> dict[str, type]:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.base import (
        GPULoadStoreSpec,
        LoadStoreSpec,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        RequestOffloadingContext,
        TransferResult,
    )

    class KvtierStoreSpec(LoadStoreSpec):
        """Where a store goes: a kvtier store plan (drops, demotions, new keys)."""

        def __init__(self, plan: StorePlan) -> None:
            self.plan = plan

        def __repr__(self) -> str:
            return f"KvtierStoreSpec(plan={self.plan.plan_id}, keys={len(self.plan.keys)})"

    class KvtierLoadSpec(LoadStoreSpec):
        """Where a load comes from: a kvtier load plan (the tier of each key)."""

        def __init__(self, load_id: int, plan: LoadPlan) -> None:
            self.load_id = load_id
            self.plan = plan

        def __repr__(self) -> str:
            return f"KvtierLoadSpec(load={self.load_id}, keys={len(self.plan.keys)})"

    class KvtierOffloadingManager(OffloadingManager):
        """vLLM's OffloadingManager over the engine's kvtier :class:`TierManager`."""

        def __init__(self, engine: _Engine) -> None:
            self._engine = engine
            store = engine.store
            assert store.manager is not None
            self._mgr: TierManager = store.manager
            self._ns = store.namespace
            self._key_cache: OrderedDict[bytes, bytes] = OrderedDict()  # offload key -> kvtier key
            self._offload_key: OrderedDict[bytes, bytes] = OrderedDict()  # kvtier key -> offload key
            self._cap = max(
                1024,
                4
                * sum(
                    self._mgr.tier_spec(i).capacity_bytes // self._mgr.tier_spec(i).block_reserve
                    for i in range(self._mgr.num_tiers)
                ),
            )
            self._side = _SchedulerSide(engine)
            self._media = [
                Medium.CPU if store.backends[i].is_memory else Medium.STORAGE for i in range(self._mgr.num_tiers)
            ]
            self._tier_index = {self._mgr.tier_spec(i).name: i for i in range(self._mgr.num_tiers)}

        # keys
        def _k(self, key: bytes) -> bytes:
            k = self._key_cache.get(key)
            if k is None:
                k = fold_block_hashes([bytes(key)], namespace=self._ns)[0]
                self._key_cache[key] = k
                if len(self._key_cache) > self._cap:
                    self._key_cache.popitem(last=False)
            return k

        def _remember(self, kkeys: Collection[bytes], keys: Collection[bytes]) -> None:
            for k, v in zip(kkeys, keys):
                self._offload_key[k] = v
                self._offload_key.move_to_end(k)
            while len(self._offload_key) > self._cap:
                self._offload_key.popitem(last=False)

        # lifecycle
        def lookup(self, key: Any, req_context: Any) -> Any:
            if self._mgr.lookup([self._k(key)]) == 1:
                self._engine.counters["lookup_hits"] += 1
                return LookupResult.HIT
            self._engine.counters["lookup_misses"] += 1
            return LookupResult.MISS

        def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
            keys = list(keys)
            kkeys = [self._k(k) for k in keys]
            load_id, plan = self._side.prepare_load(kkeys)
            self._remember(kkeys, keys)
            return KvtierLoadSpec(load_id, plan)

        def touch(self, keys: Collection[Any], req_context: Any) -> None:
            self._mgr.touch([self._k(k) for k in keys])

        def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
            self._side.complete_load([self._k(k) for k in keys])

        def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
            keys = list(keys)
            kkeys = [self._k(k) for k in keys]
            plan = self._side.prepare_store(kkeys)
            if plan is None:
                return None
            chosen = [keys[p] for p in plan.positions]
            if plan.keys:
                self._remember(plan.keys, chosen)
            return PrepareStoreOutput(keys_to_store=chosen, store_spec=KvtierStoreSpec(plan), evicted_keys=[])

        def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
            self._side.complete_store([self._k(k) for k in keys], success)

        def on_new_request(self, req_context: Any) -> Any:
            return RequestOffloadingContext()

        def take_events(self) -> Any:
            for event in self._mgr.take_events():
                vkey = self._offload_key.get(event.key)
                if vkey is None:
                    continue  # adopted from a persistent tier: vLLM never named it in this process
                if event.kind == "removed" and self._mgr.status(event.key).tier is None:
                    self._offload_key.pop(event.key, None)
                medium = self._media[self._tier_index.get(event.tier, 0)]
                yield OffloadingEvent(keys=[vkey], medium=medium, removed=event.kind == "removed")

        def shutdown(self) -> None:
            return

    class KvtierOffloadingWorker(OffloadingWorker):
        """Executes kvtier plans between vLLM's paged KV cache and the tiers."""

        def __init__(self, engine: _Engine) -> None:
            self._engine = engine
            self._side = _WorkerSide(engine)

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            if not (isinstance(src_spec, GPULoadStoreSpec) and isinstance(dst_spec, KvtierStoreSpec)):
                log.warning("kvtier: store job %d with unexpected specs %r -> %r; ignored", job_id, src_spec, dst_spec)
                return False
            self._side.submit_store(job_id, dst_spec.plan, src_spec.block_ids)
            return True

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            if not (isinstance(src_spec, KvtierLoadSpec) and isinstance(dst_spec, GPULoadStoreSpec)):
                log.warning("kvtier: load job %d with unexpected specs %r -> %r; ignored", job_id, src_spec, dst_spec)
                return False
            self._side.submit_load(job_id, src_spec.load_id, src_spec.plan, dst_spec.block_ids)
            return True

        def get_finished(self) -> list[Any]:
            return [
                TransferResult(job_id, success, transfer_size=nbytes, transfer_time=seconds)
                for job_id, success, nbytes, seconds in self._side.finished()
            ]

        def take_failed_block_ids(self) -> set[int]:
            return self._side.take_failed_block_ids()

        def wait(self, job_ids: set[int]) -> None:
            self._side.wait(job_ids)

        def shutdown(self) -> None:
            with _ENGINES_LOCK:
                if _ENGINES.get(self._engine.engine_id) is self._engine:
                    del _ENGINES[self._engine.engine_id]
            run_sync(self._engine.store.aclose())

    class KvtierOffloadingSpec(OffloadingSpec):
        """The offloading spec vLLM's OffloadingConnector loads: kvtier's manager and worker."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            _check_supported(config, self.blocks_per_chunk)
            self._store_cfg = _store_config(self.extra_config)

        def get_manager(self) -> Any:
            with _ENGINES_LOCK:
                engine = _ENGINES.get(self.config.engine_id)
            if engine is None:
                raise ConfigError(
                    "kvtier: the scheduler side found no kvtier worker for engine "
                    f"{self.config.engine_id!r} in this process; kvtier's vLLM integration needs the scheduler "
                    "and the worker in one process (one device, vLLM's 'uni' executor)"
                )
            return KvtierOffloadingManager(engine)

        def get_worker(self, kv_caches: Any) -> Any:
            if len(kv_caches.group_data_refs) != 1:
                raise ConfigError(
                    f"kvtier's vLLM integration supports one offloaded KV-cache group; got {len(kv_caches.group_data_refs)}"
                )
            views = _page_views(kv_caches, str(self.config.model.dtype))
            cfg_dict = dict(self._store_cfg)
            overrides = dict(cfg_dict.pop("namespace", None) or {})
            cfg_dict["engine_blocks_per_block"] = 1
            cfg_dict.pop("block_bytes", None)
            from kvtier.transfer.layout import KVLayout

            layout = KVLayout(views)
            namespace = _namespace(self.config, self.tokens_per_block[0], layout.fingerprint(), overrides)
            cfg = load_config(cfg_dict, source="kv_connector_extra_config.kvtier", block_bytes=layout.block_bytes)
            store = run_sync(KVStore(cfg, kv_caches=views, namespace=namespace).start())
            engine = _Engine(self.config.engine_id, store)
            assert store.manager is not None
            engine.counters["blocks_adopted"] = sum(t["ready"] for t in store.manager.stats()["tiers"])
            with _ENGINES_LOCK:
                _ENGINES[self.config.engine_id] = engine
            log.info(
                "kvtier: %d tiers under vLLM engine %s, %d-byte blocks, %d ready blocks adopted",
                len(store.backends),
                self.config.engine_id,
                layout.block_bytes,
                engine.counters["blocks_adopted"],
            )
            return KvtierOffloadingWorker(engine)

    class KvtierConnector(OffloadingConnector):
        """vLLM's OffloadingConnector with kvtier's spec, reporting failed loads to vLLM."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            extra.setdefault("spec_name", "KvtierOffloadingSpec")
            extra.setdefault("spec_module_path", MODULE_PATH)
            super().__init__(vllm_config, role, kv_cache_config)

        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            super().register_kv_caches(kv_caches)
            worker = self._kvtier_worker()
            if worker is not None:
                worker._engine.reports_load_errors = True

        def _kvtier_worker(self) -> Any:
            cw = self.connector_worker
            worker = getattr(cw, "worker", None) if cw is not None else None
            return worker if isinstance(worker, KvtierOffloadingWorker) else None

        def get_block_ids_with_load_errors(self) -> set[int]:
            worker = self._kvtier_worker()
            return worker.take_failed_block_ids() if worker is not None else set()

    return {
        "KvtierOffloadingSpec": KvtierOffloadingSpec,
        "KvtierConnector": KvtierConnector,
        "KvtierOffloadingManager": KvtierOffloadingManager,
        "KvtierOffloadingWorker": KvtierOffloadingWorker,
        "KvtierStoreSpec": KvtierStoreSpec,
        "KvtierLoadSpec": KvtierLoadSpec,
    }

