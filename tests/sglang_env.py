"""SGLang for the tests: its real storage interface and factory, and host pools that answer its
zero-copy contract.

The ``sglang`` wheel (``sglang>=0.5.23,<0.6``) is installed with ``--no-deps`` by ``.ci/run``:
its dependencies are CUDA packages and the server. ``import sglang`` runs the package's
``__init__``, which pulls in that server; the storage interface
(``sglang.srt.mem_cache.hicache_storage``) and the factory
(``sglang.srt.mem_cache.storage.backend_factory``) need only torch, numpy and tqdm. So
:func:`sglang_storage` registers the top-level package as a bare namespace (its ``__path__``,
not its ``__init__``) and imports those two modules from it. Where the wheel is missing every
SGLang test is skipped with a reason in capitals.

SGLang's own host pool classes import its server, so they cannot load here; the tests use
:class:`kvtier.integrations.sglang.testing.HostPool`, which has their shapes and their
``get_page_buffer_meta`` formulas.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest

from kvtier.integrations.sglang.testing import HostPool

MISSING = (
    "SGLANG WHEEL NOT INSTALLED: the SGLang storage-backend tests are SKIPPED "
    "(pip install --no-deps 'sglang>=0.5.23,<0.6', as .ci/run does)"
)


def sglang_storage() -> types.SimpleNamespace:
    """SGLang's ``HiCacheStorage``, ``HiCacheStorageConfig``, ``StorageBackendFactory`` and
    ``HiCacheStorageFailureInjector``, imported without the top-level ``sglang/__init__``;
    skips the test (loudly) where the wheel cannot be imported."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip(MISSING)
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["sglang"] = package
    try:
        from sglang.srt.mem_cache import hicache_storage
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except ImportError as exc:
        pytest.skip(f"SGLANG STORAGE INTERFACE DOES NOT IMPORT: the SGLang tests are SKIPPED ({exc})")
    return types.SimpleNamespace(
        HiCacheStorage=hicache_storage.HiCacheStorage,
        HiCacheStorageConfig=hicache_storage.HiCacheStorageConfig,
        FailureInjector=hicache_storage.HiCacheStorageFailureInjector,
        PoolTransfer=hicache_storage.PoolTransfer,
        StorageBackendFactory=StorageBackendFactory,
    )


def storage_config(sgl: Any, pool: HostPool, extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1,
                   model: str = "org/tiny-model") -> Any:
    """SGLang's ``HiCacheStorageConfig`` for ``pool`` (what its cache controller builds)."""
    return sgl.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=pool.mla, enable_storage_metrics=False, is_page_first_layout=pool.layout == "page_first",
        model_name=model, extra_config=extra,
    )


def build_backend(sgl: Any, pool: HostPool, extra: dict[str, Any], **identity: Any) -> Any:
    """The backend as SGLang's cache controller builds it: the factory, then the pool."""
    backend = sgl.StorageBackendFactory.create_backend("dynamic", storage_config(sgl, pool, extra, **identity), pool)
    backend.register_mem_pool_host(pool)
    return backend
