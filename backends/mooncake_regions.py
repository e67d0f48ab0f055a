"""The memory a Mooncake client has registered for RDMA, kept true to the memory that lives.

With ``protocol: rdma`` the NIC may only touch memory registered with the client
(``register_buffer``), and the client refuses a region that overlaps one it holds. The rows a
job moves live in the engine's pools, which an engine may free, resize or replace between jobs;
so each region is kept with weak references to the storages it serves
(``torch.multiprocessing.reductions.StorageWeakRef``: a weak reference keeps the storage's
bookkeeping, never its memory):

* a storage seen for the first time is registered; one inside a region already held is not
  registered again;
* a region that lies over memory that is no longer the one it was registered for (a pool freed,
  then new memory at its base, or a larger storage over it) is unregistered first; one whose
  storages all still live is merged into one region with the new storage (the client takes no
  overlapping regions);
* a region whose storages are all freed, or resized in place (``resize_`` moves a storage's
  bytes to new memory and frees the old), is unregistered: when a new region is registered, and
  at most every ``sweep_interval_s`` when a job asks (its memory is then no longer pinned for
  the NIC); a storage seen at its new memory is registered there;
* everything is unregistered when the client closes.

Whether a storage still lives at its address is asked through torch's private
``UntypedStorage._new_with_weak_ptr`` (the storage a weak reference names, as torch's own
``storage_from_cache`` asks it). A torch without it is met safely, logged once at import: a
region then counts as freed once every storage it serves has expired (``StorageWeakRef.expired``),
so a storage resized in place keeps its old region until it is freed (its new memory is
registered beside it when a job moves it; nothing is read from the old); and where even that
cannot be asked, a region counts as freed: let go at the next sweep, registered again by the next
job that moves its memory (a transfer into it meanwhile fails, and so does one through the
staging, registered once: a failed store or a miss, never a read of the wrong memory).

Where its storages can be asked, a region let go is one whose memory is freed, and a transfer
never targets freed memory (a job keeps its rows' memory until it is checked), so unregistering
it cannot fail a transfer. Merging two live regions unregisters one
for a moment: a transfer of another job into it in that moment fails, a failed store or a miss,
never wrong data (every record is checked where it lands). Failed registrations and
unregistrations are counted and logged once each kind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Regions"]

log = logging.getLogger("kvtier")

#: The storage a weak reference's id names while it lives, else ``None``: torch's own call for it
#: (private); ``None`` where a torch lacks it (see the module doc and :meth:`_Region.freed`).
_storage_of: Callable[[int], Any] | None = getattr(torch.UntypedStorage, "_new_with_weak_ptr", None)
if _storage_of is None:
    log.warning(
        "mooncake: this torch has no UntypedStorage._new_with_weak_ptr; a region registered for rdma is let go "
        "only once its storages are freed (a storage resized in place keeps its old memory registered until then)"
    )


class _Region:
    __slots__ = ("base", "end", "served")

    def __init__(self, base: int, end: int) -> None:
        self.base, self.end = base, end
        #: each storage it serves (by ``_cdata``: a weak reference keeps that id from being
        #: reused) -> the weak reference and the address the storage had when it was taken
        self.served: dict[int, tuple[StorageWeakRef, int]] = {}

    def serve(self, storage: Any, at: int) -> None:
        """Keep the region while ``storage`` lives at ``at`` (its address now)."""
        cdata = storage._cdata
        kept = self.served.get(cdata)
        if kept is None:
            self.served[cdata] = (StorageWeakRef(storage), at)
        elif kept[1] != at:
            self.served[cdata] = (kept[0], at)

    def serves(self, cdata: int, at: int) -> bool:
        """Whether it took the storage ``cdata`` at the address ``at``."""
        kept = self.served.get(cdata)
        return kept is not None and kept[1] == at

    def freed(self) -> bool:
        """Whether no storage it serves is still at the memory it was taken at: each freed, or
        resized in place (``resize_`` moves a storage's bytes to new memory and frees the old).
        Without torch's call (:data:`_storage_of`): whether each has expired. Where neither can
        be asked (the call fails), ``True``: the region is let go and registered again when a
        job next moves its memory, which costs registrations, never a read of the wrong memory."""
        storage_of = _storage_of
        for ref, at in self.served.values():
            try:
                if storage_of is None:
                    if not ref.expired():
                        return False
                    continue
                storage = storage_of(ref.cdata)
            except Exception:  # (another torch's calls of these names: not known to be live)
                return True
            if storage is not None and storage.data_ptr() == at:
                return False
        return True


class Regions:
    """The regions one client holds; ``register`` / ``unregister`` are the client's calls."""

    def __init__(
        self, register: Callable[[int, int], int], unregister: Callable[[int], int], *, sweep_interval_s: float = 1.0
    ) -> None:
        self._register, self._unregister = register, unregister
        self._regions: dict[int, _Region] = {}  # base -> region
        self._lock = threading.Lock()
        self.sweep_interval_s = sweep_interval_s
        self._last_sweep = time.monotonic()
        self.counts = {"registered": 0, "unregistered": 0, "register_failures": 0, "unregister_failures": 0}
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return len(self._regions)

    def spans(self) -> list[tuple[int, int]]:
        """``(base, length)`` of each region held, lowest first."""
        with self._lock:
            return sorted((r.base, r.end - r.base) for r in self._regions.values())

    def storages(self, storages: Iterable[Any]) -> None:
        """Have the memory of each storage registered (each at most once a call)."""
        seen: set[int] = set()
        for storage in storages:
            cdata = storage._cdata
            if cdata in seen:
                continue
            seen.add(cdata)
            self.add(storage.data_ptr(), storage.nbytes(), storage)
        if time.monotonic() - self._last_sweep >= self.sweep_interval_s:
            self.sweep()

    def add(self, base: int, nbytes: int, storage: Any) -> bool:
        """Have ``[base, base + nbytes)`` registered, kept while ``storage`` lives; whether it is."""
        end = base + nbytes
        with self._lock:
            held = self._regions.get(base)
            if held is not None and end <= held.end and (held.serves(storage._cdata, base) or not held.freed()):
                held.serve(storage, base)
                return True
            for region in self._regions.values():  # a region of memory given back: inside one, or holding it
                if region.base <= base and end <= region.end and not region.freed():
                    region.serve(storage, base)
                    return True
            merged = _Region(base, end)
            live: list[_Region] = []
            for region in [r for r in self._regions.values() if r.base < end and base < r.end]:
                self._drop(region)
                if not region.freed():  # both live over the same memory: one region for both
                    live.append(region)
                    merged.base, merged.end = min(merged.base, region.base), max(merged.end, region.end)
                    merged.served.update(region.served)
            merged.serve(storage, base)
            ok = self._add(merged)
            if not ok:
                for region in live:  # as they were, so their own transfers go on
                    self._add(region)
            self._sweep_locked(merged)
            return ok

    def sweep(self) -> int:
        """Unregister the regions whose storages are all freed; how many."""
        with self._lock:
            return self._sweep_locked()

    def close(self) -> None:
        """Unregister every region (the client is about to close)."""
        with self._lock:
            for region in list(self._regions.values()):
                self._drop(region)

    # -- under the lock ----------------------------------------------------------------------
    def _sweep_locked(self, kept: _Region | None = None) -> int:
        """Unregister the regions whose storages are all freed, but ``kept`` (one just
        registered for a job's storage, kept at least to the next sweep: where its storages
        cannot be asked it counts as freed, and the job's own transfer needs it)."""
        self._last_sweep = time.monotonic()
        gone = [r for r in self._regions.values() if r is not kept and r.freed()]
        return sum(1 for r in gone if self._drop(r))

    def _add(self, region: _Region) -> bool:
        nbytes = region.end - region.base
        rc = self._register(region.base, nbytes)
        if rc != 0:
            self._failed("register_failures", f"registering {nbytes} bytes at {region.base:#x} for rdma failed ({rc}); "
                         "transfers from and into it fail (stores fail, loads miss)")
            return False
        self._regions[region.base] = region
        self.counts["registered"] += 1
        return True

    def _drop(self, region: _Region) -> bool:
        """Unregister ``region`` and forget it (a client that refuses to let go of it is not asked
        again: it is counted, and a region over it then fails to register, counted too)."""
        del self._regions[region.base]
        rc = self._unregister(region.base)
        if rc != 0:
            self._failed("unregister_failures", f"unregistering {region.end - region.base} bytes at {region.base:#x} "
                         f"failed ({rc})")
            return False
        self.counts["unregistered"] += 1
        return True

    def _failed(self, kind: str, message: str) -> None:
        self.counts[kind] += 1
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("mooncake: %s (counted in %s)", message, kind)
