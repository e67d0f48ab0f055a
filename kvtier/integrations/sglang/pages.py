"""SGLang's host pool as kvtier's KV cache, found through the pool's own zero-copy contract.

SGLang's host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``, ...) answer
``get_page_buffer_meta(indices)`` for zero-copy storage backends: for the token indices of whole
pages it returns one list of buffer addresses and one of byte sizes, ``c`` entries per page in
a fixed order (``page_first``: K then V of the page, every layer; ``layer_first``: K and V of
each layer in turn; MLA: one latent chunk, or one per layer). :class:`HostPages` reads that
contract and nothing else of the pool's internals:

* at attach it asks for the first, second and last page, and derives for each chunk position a
  base address and a page stride. Every standard layout stores chunk ``j`` of all pages back to
  back (stride == size), so chunk ``j`` of every page is one contiguous ``[pages, size]`` view
  of the pool tensor that holds those addresses. These views are kvtier's KV cache (page index
  first, one tensor per chunk position); a record is the concatenation of a page's chunks.
* at each call it asks the pool again for the call's pages and turns the returned addresses back
  into page indices, checking that every chunk of a page names the same page, that the sizes
  are the ones seen at attach and that the page lies inside the views. A pool that breaks the
  contract fails the call (a miss), never a copy to or from a wrong address.

A pool whose chunks are not laid out this way is refused at attach with a :class:`LayoutError`
naming the chunk, so a layout this module does not understand is never guessed at.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvtier.errors import LayoutError

__all__ = ["HostPages"]


def _meta(pool: Any, first_token: int, page_size: int) -> tuple[list[int], list[int]]:
    indices = torch.arange(first_token, first_token + page_size, dtype=torch.int64)
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def _pool_tensors(pool: Any) -> Iterator[torch.Tensor]:
    """Every CPU tensor the pool holds as an attribute (directly, or in a list or tuple)."""
    for value in vars(pool).values():
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor) and item.device.type == "cpu" and item.numel() > 0:
                yield item


class HostPages:
    """The pool's pages as per-chunk ``[num_pages, chunk]`` views, and page ids from addresses."""

    def __init__(self, pool: Any) -> None:
        for name in ("page_size", "size", "layout", "dtype", "get_page_buffer_meta"):
            if not hasattr(pool, name):
                raise LayoutError(f"host pool {type(pool).__name__}: has no {name!r}; it is not an SGLang host KV pool")
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.layout = str(pool.layout)
        self.dtype = str(pool.dtype).removeprefix("torch.")
        total_pages = int(pool.size) // self.page_size
        if self.page_size < 1 or total_pages < 1:
            raise LayoutError(f"host pool: {pool.size} tokens in pages of {pool.page_size} hold no whole page")
        try:
            bases, sizes = _meta(pool, 0, self.page_size)
            last, last_sizes = _meta(pool, (total_pages - 1) * self.page_size, self.page_size)
            if total_pages > 1:
                second, _ = _meta(pool, self.page_size, self.page_size)
            else:
                second = [b + s for b, s in zip(bases, sizes)]
        except (ValueError, NotImplementedError, AssertionError) as exc:
            raise LayoutError(f"host pool layout {self.layout!r}: get_page_buffer_meta refused: {exc}") from exc
        if not bases or len(sizes) != len(bases) or len(last) != len(bases) or last_sizes != sizes:
            raise LayoutError(
                f"host pool layout {self.layout!r}: get_page_buffer_meta gave {len(bases)} addresses and "
                f"{len(sizes)} sizes per page; expected the same non-zero count for every page"
            )
        self.chunks = len(bases)
        self.sizes = sizes
        tensors = list(_pool_tensors(pool))
        self.views: list[torch.Tensor] = []
        for j, (base, size, nxt, end) in enumerate(zip(bases, sizes, second, last)):
            if nxt - base != size or end - base != (total_pages - 1) * size:
                raise LayoutError(
                    f"host pool layout {self.layout!r}: chunk {j} of a page is {size} bytes but pages are "
                    f"{nxt - base} bytes apart; only layouts that keep each chunk of every page back to back are supported"
                )
            self.views.append(_view(tensors, base, size, total_pages, f"{self.layout!r} chunk {j}"))
        self.num_pages = total_pages
        self._bases = torch.tensor(bases, dtype=torch.int64)
        self._sizes = torch.tensor(sizes, dtype=torch.int64)

    def page_ids(self, host_indices: torch.Tensor) -> list[int]:
        """The page index of each whole page in ``host_indices`` (token indices, ``page_size``
        per page), from the addresses the pool gives for them. Raises :class:`LayoutError`
        naming the page when the pool's answer does not fit the views."""
        if not isinstance(host_indices, torch.Tensor):
            raise LayoutError(f"host_indices: expected a tensor of token indices, got {type(host_indices).__name__}")
        count = host_indices.numel()
        if count % self.page_size:
            raise LayoutError(f"host_indices: {count} token indices are not whole pages of {self.page_size}")
        pages = count // self.page_size
        if pages == 0:
            return []
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices.reshape(-1).cpu())
        if len(ptrs) != pages * self.chunks or len(sizes) != len(ptrs):
            raise LayoutError(
                f"host_indices: the pool gave {len(ptrs)} addresses for {pages} pages; expected {self.chunks} per page"
            )
        offsets = torch.tensor(ptrs, dtype=torch.int64).view(pages, self.chunks) - self._bases
        got_sizes = torch.tensor(sizes, dtype=torch.int64).view(pages, self.chunks)
        ids = torch.div(offsets, self._sizes, rounding_mode="floor")
        bad = (
            (got_sizes != self._sizes).any(dim=1)
            | (offsets % self._sizes != 0).any(dim=1)
            | (ids != ids[:, :1]).any(dim=1)
            | (ids[:, 0] < 0)
            | (ids[:, 0] >= self.num_pages)
        )
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise LayoutError(f"host_indices: page {i} (token {int(host_indices.reshape(-1)[i * self.page_size])}) "
                              "is not a page of the registered host pool")
        return [int(p) for p in ids[:, 0].tolist()]


def _view(tensors: Sequence[torch.Tensor], base: int, size: int, pages: int, what: str) -> torch.Tensor:
    """``pages`` rows of ``size`` bytes from address ``base``, as a view of the pool tensor that
    holds them (in the KV dtype where it divides the rows)."""
    for t in tensors:
        start = t.data_ptr()
        nbytes = t.numel() * t.element_size()
        if start <= base and base + pages * size <= start + nbytes and t.is_contiguous():
            flat = t.reshape(-1).view(torch.uint8)[base - start : base - start + pages * size]
            rows = flat.view(pages, size)
            width = t.element_size()
            if width > 1 and size % width == 0 and (base - start) % width == 0:
                return rows.view(t.dtype)  # codecs pick their byte-shuffle width from the dtype
            return rows
    raise LayoutError(f"host pool {what}: address {base:#x} is not inside any contiguous CPU tensor of the pool")
