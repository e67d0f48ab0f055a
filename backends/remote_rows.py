"""A row's memory kept for a remote transfer that goes straight to or from it.

A row's view (its address, or a ``memoryview`` over it) holds nothing: Python run while the view
is in use (a finalizer or weakref callback run by a garbage collection that any allocation may
start, in any thread, while the transfer waits on the network) may point the row at other
memory (``row.set_(...)``) and free the memory the view names. The disk tiers hold automatic
collection off from the view to the copy (:data:`kvtier.records.xxcopy.rows_hold`); a remote
transfer may wait on the network for seconds, so these tiers keep the memory instead:

- :class:`RowLease` takes a tensor of its own on the row's storage (``row.detach()``), so the
  memory the transfer reads or writes stays allocated, whatever the row is made to point at;
  the transfer goes to or from that tensor's memory (:meth:`RowLease.view`, :attr:`RowLease.ptr`);
- once the transfer is over, :meth:`RowLease.held` says whether the row still points at that
  memory. Where it does not, a read is a miss (its bytes landed where the row used to be) and a
  save is not stored: its record, which may hold bytes the row no longer has, is removed.

What this does not cover: the row's storage resized in place during the transfer
(``row.untyped_storage().resize_(...)``) frees the memory under every tensor on it; the check
still turns the block into a miss or removes its record, but the transfer has then used freed
memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.records.record_backend import RecordBackend, _in_host_memory
from kvtier.records.xxcopy import rows_held

__all__ = ["RowLease", "fill_row"]


class RowLease:
    """The memory ``row`` (a contiguous host row) points at, kept allocated while this lives."""

    __slots__ = ("kept", "ptr", "row")

    def __init__(self, row: torch.Tensor) -> None:
        kept = row.detach()  # one C call: the row's storage, offset and size at one instant
        self.row = row
        #: a tensor of the lease's own on the kept memory (what a save encodes)
        self.kept = kept
        #: the kept memory's address: where a transfer goes
        self.ptr: int = kept.data_ptr()

    def view(self) -> memoryview:
        """A writable view of the kept memory (it keeps the memory alive while it lives)."""
        return self.kept.numpy().data

    def held(self) -> bool:
        """Whether the row still points at the kept memory (call once the transfer is over). Its
        address says so: the kept memory cannot be freed, so no other memory can be at that
        address, and a storage resized in place moves its bytes (the row's address changes)."""
        return self.row.data_ptr() == self.ptr


def fill_row(row: torch.Tensor, fill: Callable[[memoryview], Any], lease: RowLease | None = None, landing: bool = False) -> bool:
    """Let ``fill`` land a record in ``row`` (its errors raised); whether it landed there.

    ``fill`` copies a record already received: collection is held off from the row's view to
    its copy (:data:`~kvtier.records.xxcopy.rows_hold`). Where the record lands in the row as it
    is received (``landing``), or has landed already at ``lease.ptr``, a network wait is inside
    the window: the row's memory is kept instead, and ``False`` (a miss) if the row no longer
    points at it afterwards."""
    if lease is None and landing and _in_host_memory(row):
        lease = RowLease(row)
    if lease is not None:
        fill(lease.view())
        return lease.held()
    with rows_held:
        view, staging = RecordBackend._host_view(row)
        fill(view)
    if staging is not None:
        row.copy_(staging)
    return True
