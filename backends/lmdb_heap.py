"""Large LMDB commits without a heap trim after each: glibc's own dynamic threshold, raised once.

Without ``writemap`` LMDB ``malloc``s each value's overflow pages for the length of the write
transaction and frees them at the commit. A commit of 16 records of 2 MiB frees 32 MiB at once,
and glibc gives the top of its heap back to the kernel when the free space there exceeds its
trim threshold, so the next commit faults all of it in again (``brk`` and a minor fault per
4 KiB page, 8,200 faults per 32 MiB job on this host), where one value per transaction reuses
one chunk.

glibc's threshold is dynamic: when a program frees a chunk it had mapped on its own (one of more
than the current mapping threshold and at most 32 MiB on 64-bit), glibc raises the mapping
threshold to that chunk's size and the trim threshold to twice it, for the process. It makes that
adaptation after any program frees one large buffer (a tensor, a file read whole). Before its
first commit of ``n`` bytes, the tier makes glibc adapt to that size: it ``malloc``s one chunk of
``n`` bytes (capped at 32 MiB less a page), which glibc maps without touching a page, and frees it at once
(:func:`keep_heap_for`). From then on a commit of up to ``n`` bytes leaves its pages free on the
heap for the next one. It never lowers a threshold and does not switch the adaptation off, as
``mallopt`` or the ``MALLOC_*_`` variables would: those stay the engine's to set, and where an
engine set them (glibc then no longer adapts) this changes nothing.

Its cost: up to twice the largest commit (at most 64 MiB) of free heap kept at the top of each
arena of the process (the thresholds are the process's: every thread's arena, not only the
committing one's), instead of handed back after each commit. Elsewhere than glibc (another C
library, or glibc's ``malloc`` replaced by a preloaded one) it does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Any

__all__ = ["MOST_BYTES", "keep_heap_for", "kept_bytes"]

#: glibc's cap on its dynamic mapping threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``): a
#: freed mapped chunk above it raises nothing.
MOST_BYTES = 32 << 20
#: glibc's starting mapping threshold: a chunk of at most this many bytes raises nothing.
_START_BYTES = 128 << 10

_lock = threading.Lock()
_kept = _START_BYTES  # the largest chunk freed here so far (process-wide, as glibc's threshold)


def _glibc() -> Any:
    """The process's ``malloc`` and ``free`` when they are glibc's; else ``None``."""
    try:
        libc = ctypes.CDLL(None)  # the process's symbols: the ``malloc`` LMDB calls
        if not hasattr(libc, "gnu_get_libc_version"):
            return None
        # A malloc that replaced glibc's (jemalloc, tcmalloc preloaded) does not adapt so, and
        # some also take the name ``__libc_malloc``: glibc's is the process's exactly when
        # ``malloc`` and ``free`` are ``__libc_malloc`` and ``__libc_free`` as glibc's own
        # library defines them (looked up in it, not in the process).
        own = ctypes.CDLL("libc.so.6")
        for name in ("malloc", "free"):
            if _address(getattr(libc, name)) != _address(getattr(own, f"__libc_{name}")):
                return None
    except (OSError, AttributeError):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.restype = None
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _address(function: Any) -> int | None:
    return ctypes.cast(function, ctypes.c_void_p).value


_libc: Any = None
_looked = False
_ALL = 1 << 62  # nothing more to adapt to: capped, or not glibc


def kept_bytes() -> int:
    """The largest commit size glibc was adapted to here (its starting threshold until then;
    :data:`MOST_BYTES` less a page once capped)."""
    return min(_kept, MOST_BYTES - mmap.PAGESIZE)


def keep_heap_for(nbytes: int) -> bool:
    """Make glibc keep a commit of ``nbytes`` bytes' freed pages on its heap (see the module
    doc): once per larger size, one mapped chunk of that size (at most :data:`MOST_BYTES` less
    a page) allocated and freed untouched. True when it freed one now."""
    global _kept, _libc, _looked
    if nbytes <= _kept:
        return False
    with _lock:
        if not _looked:
            _libc, _looked = _glibc(), True
        if _libc is None:
            _kept = _ALL
            return False
        if nbytes <= _kept:
            return False
        page = mmap.PAGESIZE
        # A chunk of exactly ``size`` bytes: glibc maps the request plus its 16-byte header
        # rounded up to a page. glibc compares the chunk's size field, flag bits included, with
        # its cap: a chunk of exactly the cap raises nothing, one page less does.
        most = MOST_BYTES - page
        size = min(most, -(-nbytes // page) * page)
        pointer = _libc.malloc(size - page)
        if pointer:
            _libc.free(pointer)
        _kept = _ALL if size == most else size
        return bool(pointer)
