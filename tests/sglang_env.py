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

SGLang's own host pool classes (``pool_host.mha`` / ``pool_host.mla``) import its server
(``psutil``, ``msgspec``, ``zmq``, ``triton``, ``starlette``, ...), so they cannot load here.
:class:`HostPool` stands in for them: it allocates ``kv_buffer`` with the shapes those classes
use and computes ``get_page_buffer_meta`` with their formulas (MHA ``page_first`` /
``layer_first``; MLA ``page_first`` / ``layer_first``), as SGLang's own backend tests fake the
pool. ``page(p)`` slices a page out of ``kv_buffer`` by shape alone, an oracle independent of
those addresses.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest
import torch

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


class HostPool:
    """A CPU host KV pool with SGLang's shapes and ``get_page_buffer_meta`` (see the module doc)."""

    def __init__(
        self,
        layout: str = "page_first",
        *,
        mla: bool = False,
        pages: int = 16,
        page_size: int = 4,
        layer_num: int = 3,
        head_num: int = 2,
        head_dim: int = 8,
        kv_cache_dim: int = 24,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        self.layout, self.mla = layout, mla
        self.page_size, self.size, self.layer_num, self.dtype = page_size, pages * page_size, layer_num, dtype
        self.head_num, self.head_dim, self.kv_cache_dim = head_num, head_dim, kv_cache_dim
        if mla:
            dims = {"page_first": (self.size, layer_num, 1, kv_cache_dim), "layer_first": (layer_num, self.size, 1, kv_cache_dim)}
        else:
            dims = {
                "page_first": (2, self.size, layer_num, head_num, head_dim),
                "layer_first": (2, layer_num, self.size, head_num, head_dim),
            }
        gen = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(dims[layout], generator=gen).to(dtype)

    def page(self, p: int) -> torch.Tensor:
        """Every element of page ``p``, sliced by shape (the test oracle)."""
        s = slice(p * self.page_size, (p + 1) * self.page_size)
        if self.mla:
            return (self.kv_buffer[s] if self.layout == "page_first" else self.kv_buffer[:, s]).clone()
        return (self.kv_buffer[:, s] if self.layout == "page_first" else self.kv_buffer[:, :, s]).clone()

    def indices(self, pages: list[int]) -> torch.Tensor:
        """The host indices (token slots) of whole pages, as SGLang's allocator hands them out."""
        runs = [torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]
        return torch.cat(runs).to(torch.int64) if runs else torch.empty(0, dtype=torch.int64)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        base, item, idx = self.kv_buffer.data_ptr(), self.dtype.itemsize, indices.tolist()
        starts = idx[:: self.page_size]
        ptrs: list[int] = []
        if self.mla:  # pool_host/mla.py
            dim = self.kv_cache_dim
            if self.layout == "layer_first":
                for i in starts:
                    ptrs += [base + i * dim * item + layer * self.size * dim * item for layer in range(self.layer_num)]
                return ptrs, [item * self.page_size * dim] * len(ptrs)
            ptrs = [base + i * self.layer_num * dim * item for i in starts]
            return ptrs, [self.layer_num * item * self.page_size * dim] * len(ptrs)
        hd = self.head_num * self.head_dim  # pool_host/mha.py
        v_offset = self.layer_num * self.size * hd * item
        if self.layout == "layer_first":
            for i in starts:
                for layer in range(self.layer_num):
                    k = base + i * hd * item + layer * self.size * hd * item
                    ptrs += [k, k + v_offset]
            return ptrs, [item * self.page_size * hd] * len(ptrs)
        for i in starts:
            k = base + i * self.layer_num * hd * item
            ptrs += [k, k + v_offset]
        return ptrs, [self.layer_num * item * self.page_size * hd] * len(ptrs)


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
