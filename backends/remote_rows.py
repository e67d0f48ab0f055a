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
  save is not stored: its record, which may hold bytes the row no longer has, is removed. A save
  asks first once its record is encoded (its checksum taken over the kept memory), and does not
  send it where the row left: the kept memory may have been reused by then, and a record of it
  would be consistent, so any reader would take it until its removal.

The job's checks (a 1-D ``uint8`` row of the block's size) ran before the transfer, and the row
may be pointed at memory of another size or layout in between. A lease therefore checks the
memory it took: where that is no longer such a row, the transfer gets memory of its own instead
(a read lands there and is a miss; a save sends nothing, :meth:`RowLease.sound`), never bytes
past the row's end. :meth:`RowLease.held` asks the row's size and layout as well as its address:
a row pointed at a shorter or strided view of the same memory did not get the record.

What this does not cover: the row's storage resized in place during the transfer
(``row.untyped_storage().resize_(...)``) frees the memory under every tensor on it; the check
still turns the block into a miss or removes its record, but the transfer has then used freed
memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.records.counts import counts_add
from kvtier.records.record_backend import _in_host_memory
from kvtier.records.xxcopy import rows_held

__all__ = ["Count", "RowLease", "fill_row", "is_block"]


def is_block(t: torch.Tensor, size: int) -> bool:
    """Whether ``t`` is what a job's checks pass: one contiguous run of ``size`` bytes of host memory."""
    return t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == size and t.is_cpu and t.is_contiguous()


class RowLease:
    """The memory ``row`` (a contiguous host row of ``size`` bytes) points at, kept allocated
    while this lives; memory of the lease's own where the row no longer is such a row."""

    __slots__ = ("kept", "ptr", "row", "size", "sound")

    def __init__(self, row: torch.Tensor, size: int) -> None:
        kept = row.detach()  # one C call: the row's storage, offset and size at one instant
        #: whether the row was still a block when its memory was taken (else nothing is sent from it)
        self.sound = is_block(kept, size)
        if not self.sound:  # pointed at other memory since the job's checks: never past its end
            kept = torch.empty(size, dtype=torch.uint8)
        self.row = row
        self.size = size
        #: a tensor of the lease's own on the kept memory (what a save encodes)
        self.kept = kept
        #: the kept memory's address: where a transfer goes
        self.ptr: int = kept.data_ptr()

    def view(self) -> memoryview:
        """A writable view of the kept memory (it keeps the memory alive while it lives)."""
        return self.kept.numpy().data

    def held(self) -> bool:
        """Whether the row still is the kept memory (call once the transfer is over). Its address
        says where: the kept memory cannot be freed, so no other memory can be at that address,
        and a storage resized in place moves its bytes (the row's address changes); its size and
        layout say it still covers all of it, byte for byte."""
        row = self.row
        return row.data_ptr() == self.ptr and is_block(row, self.size)


def fill_row(row: torch.Tensor, size: int, fill: Callable[[memoryview], Any], lease: RowLease | None = None, landing: bool = False) -> bool:
    """Let ``fill`` land a ``size``-byte record in ``row`` (its errors raised); whether it landed there.

    ``fill`` copies a record already received: collection is held off from a host row's view to
    its copy (:data:`~kvtier.records.xxcopy.rows_hold`). Where the record lands in the row as it
    is received (``landing``), or has landed already at ``lease.ptr``, a network wait is inside
    the window: the row's memory is kept instead, and ``False`` (a miss) if the row no longer
    points at it afterwards. A row off the host gets the record through staging of its own
    (no view of the row in use, no hold), then one copy. A row that no longer is a ``size``-byte
    row is a miss: the record is still read (and checked) into memory of its own, never past
    the row's end."""
    if lease is None and landing and _in_host_memory(row):
        lease = RowLease(row, size)
    if lease is not None:
        fill(lease.view())
        return lease.held()
    with rows_held:
        block = row.dtype == torch.uint8 and row.dim() == 1 and row.numel() == size
        if block and _in_host_memory(row):
            fill(row.numpy().data)
            return True
    staging = torch.empty(size, dtype=torch.uint8)  # (pointed at other memory since the job's checks, or off the host)
    fill(staging.numpy().data)
    if not block:
        return False
    try:
        row.copy_(staging)
    except RuntimeError:  # (resized meanwhile)
        return False
    return True


class Count:
    """A count added to from several threads at once (``rows_moved``: engine threads' jobs, and
    a job's shares, each on a thread of its own): each add one :func:`~kvtier.records.counts.counts_add`,
    so that none is lost (``+=`` on an attribute reads, adds and stores in steps another thread
    may come between). An add of nothing is not made: the count moves only when a row did."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def add(self, n: int) -> None:
        if n:
            counts_add(self, "value", n)
