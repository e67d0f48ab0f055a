"""kvtier's ``OffloadingSpec``, the object vLLM's offloading connector loads by name from
``kv_connector_extra_config`` (``spec_name`` / ``spec_module_path``; imports vLLM).

It reads kvtier's settings from the extra config (the store config under ``kvtier``,
``result_deadline_s``, ``idle_load_wait_s``), builds the scheduler side's manager
(:meth:`KvtierOffloadingSpec.get_manager`) and each rank's worker over the rank's own tiers
(:meth:`KvtierOffloadingSpec.get_worker`).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingSpec

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integrations._sync import run_sync
from kvtier.integrations.vllm.admin import AdminServer, admin_settings
from kvtier.integrations.vllm.admin_ops import AdminOps, NotReady, PrefixHasher
from kvtier.integrations.vllm.announce import OffloadKeyLog, offload_key_log_path
from kvtier.integrations.vllm.engines import (
    MODULE_PATH,
    RankEngine,
    SchedulerEngine,
    check_supported,
    page_views,
    rank_tiers,
    register_engine,
    store_config,
    vllm_namespace,
)
from kvtier.integrations.vllm.follow import SharedFollowing
from kvtier.integrations.vllm.group_config import group_layout, group_shares, group_tiers
from kvtier.integrations.vllm.groups import RankGroups, SchedulerGroups
from kvtier.integrations.vllm.head_layout import HeadShape, rank_head_groups, together_tiers
from kvtier.integrations.vllm.idle_steps import idle_load_wait
from kvtier.integrations.vllm.offloading import KvtierOffloadingManager, KvtierOffloadingWorker
from kvtier.integrations.vllm.ranks import describe_rank
from kvtier.integrations.vllm.replicated import WRITER_RANK, namespace_rank, shared_tiers
from kvtier.integrations.vllm.scheduler_side import DEFAULT_RESULT_DEADLINE_S
from kvtier.integrations.vllm.stats import METRICS, PREFIX
from kvtier.records.head_groups import HeadGroupLayout
from kvtier.store import KVStore
from kvtier.transfer.layout import KVLayout

__all__ = ["CHANNELS_KEY", "HASH_ALGO_KEY", "REPLICATED_KEY", "KvtierOffloadingSpec", "result_deadline", "vllm_prefix_hasher"]

log = logging.getLogger("kvtier.vllm")

#: set by KvtierConnector in the extra config: the spec may rely on its channels
CHANNELS_KEY = "kvtier_connector_channels"
#: set by KvtierConnector in the extra config: the KV is the same on every rank (MLA)
REPLICATED_KEY = "kvtier_replicated_kv"
#: set by KvtierConnector in the extra config: vLLM's prefix caching hash (its block hashes)
HASH_ALGO_KEY = "kvtier_hash_algo"


def vllm_prefix_hasher(hash_algo: str, tokens_per_hash: int) -> PrefixHasher:
    """A prompt's block hashes exactly as vLLM's engine computes a request's: its own request
    block hasher (``get_request_block_hasher``) with the hash function named by
    ``prefix_caching_hash_algo``, its ``NONE_HASH`` seed, and the ``cache_salt`` extra key on the
    first block (a request without multimodal inputs, LoRA or prompt embeddings)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hasher = kv_cache_utils.get_request_block_hasher(tokens_per_hash, get_hash_fn_by_name(hash_algo))

    def hashes(token_ids: Any, cache_salt: str | None) -> list[bytes]:
        if getattr(kv_cache_utils, "NONE_HASH", None) is None:
            raise NotReady("kvtier: vLLM has not set up its block hashes yet; try again")
        tokens = list(token_ids)
        request = SimpleNamespace(
            request_id="kvtier-admin",
            block_hashes=[],
            num_tokens=len(tokens),
            all_token_ids=tokens,
            mm_features=[],
            lora_request=None,
            cache_salt=cache_salt,
            prompt_embeds=None,
        )
        return [bytes(h) for h in hasher(request)]

    return hashes


def result_deadline(value: Any) -> float | None:
    """``kv_connector_extra_config.result_deadline_s``: seconds the scheduler side waits for
    every rank's result of a job before the silent ranks are told to settle it as failed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(
            f"kv_connector_extra_config.result_deadline_s: expected a positive number of seconds, got {value!r}"
        )
    return float(value)


class KvtierOffloadingSpec(OffloadingSpec):
    """The offloading spec vLLM's OffloadingConnector loads: kvtier's manager and worker."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """kvtier's counters (:mod:`.stats`), registered by vLLM's Prometheus logger."""
        return {PREFIX + name: OffloadingCounterMetadata(documentation=doc) for name, doc in METRICS.items()}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        check_supported(config)
        if not self.extra_config.get(CHANNELS_KEY):
            raise ConfigError(
                "kvtier needs its own connector: set kv_connector 'KvtierConnector' with kv_connector_module_path "
                f"{MODULE_PATH!r} (kv_transfer_config() does); vLLM's stock OffloadingConnector has no channel for "
                "each worker's job results, which kvtier's scheduler side needs"
            )
        cfg_dict = dict(store_config(self.extra_config))
        self._overrides = dict(cfg_dict.pop("namespace", None) or {})
        cfg_dict["engine_blocks_per_block"] = self.blocks_per_chunk  # one record per offloaded chunk
        cfg_dict.pop("block_bytes", None)
        self._store_dict = cfg_dict
        self._result_deadline_s = result_deadline(self.extra_config.get("result_deadline_s"))
        self._idle_load_wait_s = idle_load_wait(self.extra_config.get("idle_load_wait_s"))
        #: KV the same on every rank: the tiers all ranks share hold one copy (.replicated)
        self._replicated = bool(self.extra_config.get(REPLICATED_KEY)) and config.parallel.world_size > 1
        self._shared = shared_tiers(cfg_dict) if self._replicated else frozenset()
        #: per KV-cache group id: where the heads are in vLLM's pages (set by KvtierConnector
        #: from the per-layer tensors before vLLM builds the worker; see .head_layout)
        self.head_shapes: dict[int, HeadShape | None] = {}

    def get_manager(self) -> Any:
        parallel = self.config.parallel
        # One block's size is only known on the workers; 1 passes the config's checks here.
        store_cfg = load_config(
            rank_tiers(self._store_dict, 0, parallel.world_size, shared=self._shared),
            source="kv_connector_extra_config.kvtier",
            block_bytes=1,
        )
        deadline = self._result_deadline_s
        if deadline is None:  # past the ranks' own job deadline, so a live rank reports first
            job_deadline = store_cfg.job_deadline_s
            deadline = DEFAULT_RESULT_DEADLINE_S if job_deadline is None else job_deadline + 60.0
        engines = [
            SchedulerEngine(self.config.engine_id, parallel.world_size, group=g.group_id) for g in self.config.groups
        ]
        for engine in engines:
            register_engine(engine)
        key_log = OffloadKeyLog(offload_key_log_path(self._store_dict, parallel.world_size))

        def namespace_of(gpos: int, layout: str) -> Any:
            return vllm_namespace(self.config, self.tokens_per_block[gpos], layout, self._overrides)

        shared = SharedFollowing(self._store_dict, parallel.world_size)
        groups = SchedulerGroups(engines, store_cfg, key_log, namespace_of, result_deadline_s=deadline, shared=shared)
        manager = KvtierOffloadingManager(engines, groups, key_log)
        settings = admin_settings(self.extra_config)
        if settings is not None:  # the operator's endpoint (off by default): see .admin
            hasher = vllm_prefix_hasher(str(self.extra_config.get(HASH_ALGO_KEY, "sha256")), self.tokens_per_hash)
            per_chunk = [tpb * self.blocks_per_chunk // self.tokens_per_hash for tpb in self.tokens_per_block]
            ops = AdminOps(groups, hasher, per_chunk, hash_ids=store_cfg.tenancy.hash_ids)
            manager.admin = AdminServer(settings, ops).start()
        return manager

    def get_worker(self, kv_caches: Any) -> Any:
        group_ids = tuple(int(g.group_id) for g in self.config.groups)
        if len(kv_caches.group_data_refs) != len(group_ids):
            raise ConfigError(
                f"kvtier: vLLM registered {len(kv_caches.group_data_refs)} KV-cache groups, its offloading config "
                f"names {len(group_ids)}"
            )
        parallel = self.config.parallel
        rank, world = int(parallel.rank), int(parallel.world_size)
        views = page_views(kv_caches, str(self.config.model.dtype))

        # One group: every tensor, as before (its records stay valid). Several: each
        # group's own tensors (groups may share a tensor, each with its own block ids).
        group_views = [views] if len(group_ids) == 1 else [
            [views[i] for i in dict.fromkeys(ref.tensor_idx for ref in refs)] for refs in kv_caches.group_data_refs
        ]
        layouts = [KVLayout(v, engine_blocks_per_block=self.blocks_per_chunk) for v in group_views]
        shares = group_shares([layout.block_bytes for layout in layouts])
        head_groups = self._head_groups(group_ids, group_views, rank)
        together = together_tiers(self._store_dict) if all(hg is not None for hg in head_groups) else frozenset()
        per_rank = rank_tiers(self._store_dict, rank, world, shared=self._shared, together=together)
        # Replicated KV: every rank's bytes are rank 0's, and so is the namespace of its records.
        ns_rank = namespace_rank(rank, self._replicated)
        skip = self._shared if rank != WRITER_RANK else frozenset()
        engines, descriptions = [], []
        for gpos, (gid, layout, v) in enumerate(zip(group_ids, layouts, group_views)):
            fingerprint = group_layout(layout.fingerprint(), gid, len(group_ids))
            namespace = vllm_namespace(self.config, self.tokens_per_block[gpos], fingerprint, self._overrides, rank=ns_rank)
            cfg = load_config(
                group_tiers(per_rank, gid, shares[gpos], len(group_ids)),
                source="kv_connector_extra_config.kvtier",
                block_bytes=layout.block_bytes,
            )
            store = run_sync(KVStore(cfg, kv_caches=v, namespace=namespace, head_groups=head_groups[gpos]).start())
            engine = RankEngine(self.config.engine_id, store, rank=rank, group=gid, skip_tiers=skip)
            descriptions.append(describe_rank(self.config.engine_id, rank, world, store, fingerprint, together=together))
            register_engine(engine)
            engines.append(engine)
            log.info(
                "kvtier: rank %d of %d, KV-cache group %d: %d tiers under vLLM engine %s, %d-byte blocks, %d records found",
                rank,
                world,
                gid,
                len(store.backends),
                self.config.engine_id,
                layout.block_bytes,
                sum(len(t.records) for t in descriptions[-1].tiers),
            )
        description = RankGroups(rank, world, group_ids, tuple(descriptions))
        return KvtierOffloadingWorker(engines, description, idle_load_wait_s=self._idle_load_wait_s)

    def _head_groups(self, group_ids: tuple[int, ...], group_views: list[list[Any]], rank: int) -> list[HeadGroupLayout | None]:
        """Each KV-cache group's head groups on this rank (None: records per rank; KV the same
        on every rank keeps its one shared copy, see .replicated)."""
        if self._replicated:
            return [None] * len(group_ids)
        settings = self._store_dict.get("head_groups")
        out = []
        for gid, views in zip(group_ids, group_views):
            tag = group_layout(f"vllm:{self.config.kv_cache_layout}", gid, len(group_ids))
            out.append(
                rank_head_groups(
                    settings,
                    self.head_shapes.get(gid),
                    len(views),
                    tp_size=int(self.config.parallel.tp_size),
                    rank=rank,
                    blocks_per_chunk=self.blocks_per_chunk,
                    tag=tag,
                )
            )
        return out
