"""kvtier's tiers as SGLang HiCache's storage backend (L3), tested with SGLang 0.5.23.

SGLang's hierarchical cache keeps KV pages in GPU memory (L1) and a host pool (L2) and hands
L3 to a storage backend that it loads by module path. This package is that backend:

* :class:`KvtierHiCacheStorage` subclasses SGLang's ``HiCacheStorage`` (built on first access,
  so this package imports without SGLang). SGLang's ``StorageBackendFactory`` builds it from
  ``--hicache-storage-backend dynamic`` and the extra config that :func:`extra_config` writes.
* It answers the zero-copy calls (``batch_get_v1`` / ``batch_set_v1`` with host indices,
  ``batch_exists`` as the length of the leading run of stored pages), the per-pool ``_v2``
  calls for the ``kv`` pool, ``exists``, ``clear`` and ``close``. It finds the host pool's
  memory through ``register_mem_pool_host`` and the pool's ``get_page_buffer_meta``
  (:mod:`kvtier.integrations.sglang.pages`).
* SGLang's page hashes become kvtier keys folded with a namespace of the model, KV dtype, page
  size, TP / PP ranks and sizes, MLA or MHA and the pool's layout
  (:mod:`kvtier.integrations.sglang.identity`); the tiers come from the extra config's
  ``kvtier`` entry (inline, or a kvtier YAML / TOML file) and are byte tiers only.
* Every call answers a full result and never raises (:mod:`kvtier.integrations.sglang.core`).

Launch (see ``docs/integrations/sglang.md``)::

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
            "interface_v1": 1, "kvtier": "/etc/kvtier/sglang.yaml"}'

SGLang internals this package relies on: ``HiCacheStorage`` and its method set,
``PoolTransferResult``, the ``HiCacheStorageConfig`` fields ``model_name``, ``tp_rank``,
``tp_size``, ``pp_rank``, ``pp_size``, ``is_mla_model``, ``attn_cp_rank``, ``attn_cp_size``,
``dcp_rank``, ``dcp_size``, ``dp_rank``, ``should_split_heads`` and ``extra_config``; the
factory's ``backend_class(storage_config, kwargs)`` call; the host pool's ``page_size``,
``size``, ``layout``, ``dtype`` and ``get_page_buffer_meta``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.integrations.sglang.identity import EXTRA_CONFIG_KEY

if TYPE_CHECKING:  # built on first access by the module's __getattr__ (needs SGLang)
    KvtierHiCacheStorage: type

__all__ = ["CLASS_NAME", "MODULE_PATH", "KvtierHiCacheStorage", "extra_config"]

#: Where SGLang's factory finds the class: ``module_path`` and ``class_name`` of the extra config.
MODULE_PATH = __name__
CLASS_NAME = "KvtierHiCacheStorage"


def extra_config(kvtier: Mapping[str, Any] | str, **extra: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` dict (``json.dumps`` it for the flag) that
    loads kvtier with ``--hicache-storage-backend dynamic``. ``kvtier`` is a kvtier store config
    (a dict with byte ``tiers``, or a YAML / TOML file path); ``extra`` adds SGLang's own keys
    (``prefetch_threshold``, ...)."""
    return {
        "backend_name": "kvtier",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        EXTRA_CONFIG_KEY: kvtier if isinstance(kvtier, str) else dict(kvtier),
        **extra,
    }


_CLASS: type | None = None
_CLASS_LOCK = threading.Lock()


def __getattr__(name: str) -> Any:
    global _CLASS
    if name == CLASS_NAME:
        with _CLASS_LOCK:
            if _CLASS is None:
                try:
                    from kvtier.integrations.sglang.classes import build_storage_class

                    _CLASS = build_storage_class()
                except ImportError as exc:
                    from kvtier.errors import MissingDependencyError

                    raise MissingDependencyError(
                        f"kvtier.integrations.sglang.{name} needs SGLang (tested with 0.5.23): {exc}"
                    ) from exc
        return _CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
