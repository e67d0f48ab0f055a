"""A CPU stand-in for SGLang's host KV pools, for tests and benchmarks without SGLang's server.

SGLang's own pool classes (``sglang.srt.mem_cache.pool_host.mha`` / ``.mla``) import its server
(``psutil``, ``msgspec``, ``zmq``, ``triton``, ``starlette``, ...), so they do not load without
SGLang's full install. :class:`HostPool` allocates ``kv_buffer`` with the shapes those classes
use and answers ``get_page_buffer_meta`` with their formulas (SGLang 0.5.23: MHA
``page_first`` / ``layer_first``, MLA ``page_first`` / ``layer_first``), as SGLang's own
storage-backend tests fake the pool. ``page(p)`` slices a page out of ``kv_buffer`` by shape
alone: an oracle that does not go through those addresses.
"""

from __future__ import annotations

import torch

__all__ = ["HostPool"]


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
        dims: dict[str, tuple[int, ...]]
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
