"""The backend protocol: what one tier of storage must do.

The manager owns key state (pending / ready / pinned), the policy owns ordering, and a backend
owns bytes. Every backend stores *records*: one offloaded block per 32-byte key, given to it as
a 1-D ``uint8`` tensor of exactly ``BlockFormat.block_bytes`` bytes.

Two families answer the same protocol:

* **memory backends** (``is_memory = True``: ``cpu``, ``gpu``) keep every block in one
  preallocated tensor pool. Besides the keyed calls they expose ``pool`` and ``slots(keys)`` so
  the transfer engine can gather from and scatter into the engine's KV cache without a staging
  copy.
* **byte backends** (``lmdb``, ``file``, ``compressed``, plugins) store one record per key,
  usually behind a codec, and are reached through a staging buffer.

Rules every backend follows (the conformance suite ``kvtier.testing.BackendTests`` checks them):

* The constructor does no I/O. ``await open(fmt)`` acquires resources, ``await aclose()``
  releases them; calls after close raise :class:`~kvtier.errors.ClosedError`.
* The bulk calls (``write_blocks``, ``read_blocks``, ``delete_blocks``, ``scan``) are *blocking*
  and take a whole job at once; the transfer engine calls them from its worker threads, and the
  async forms (``write``, ``read``, ``delete``) run them in a thread, one hop per call.
* ``write_blocks`` may read its blocks at any time until it returns (the ``lmdb`` tier builds
  a record, or takes its checksum, inside the write transaction, which may wait for another
  job's commit): the caller keeps them unchanged until then (the transfer engine's staging is
  the job's own, and a job gathers straight into a memory tier only while no earlier job's tier
  writes are under way).
* A per-key failure is a result, not an exception: ``write_blocks`` returns ``None`` for a key
  it could not store (disk full, map full) and ``read_blocks`` returns ``False`` for a key that
  is absent or corrupt (a corrupt record is deleted and counted). Only a failure of the whole
  call raises :class:`~kvtier.errors.BackendError`.
* A read never returns bytes other than those written under that key. When ``read_blocks``
  returns ``False`` for a key, the contents of its ``out`` row are unspecified (a corrupt record
  may have been copied in before its checksum failed); callers must not use them.
* ``reserve_bytes()`` is what the manager reserves per new block before it is written. Fixed-size
  tiers return the block size; variable-size tiers (compressed) may return an estimate, since the
  manager replaces each reservation with the size ``write_blocks`` reports.
* Access stamps (``RecordInfo.stamp``, ``touch_stamps``) are wall-clock seconds
  (``time.time()``), so they order records across processes and restarts.
* ``blocks`` and ``out`` are sequences of rows. A backend gets a ``list`` of views unless its
  class sets ``takes_pool_rows = True``: then the transfer engine may hand it a
  :class:`~kvtier.pool_rows.PoolRows` instead (a job's rows of one host pool, made once a job
  rather than a view per row). A backend that sets the flag must accept any
  ``Sequence[torch.Tensor]``, ``PoolRows`` included: it reads rows only by ``len``, iteration,
  indexing and slicing (a slice of a ``PoolRows`` is a ``PoolRows``), never by what only a
  ``list`` or ``tuple`` allows (``isinstance(blocks, list)``, ``blocks + other``,
  ``torch.stack(blocks)``, C code that takes a list's items without converting the sequence).
  A tier that wraps another sets the flag only where it passes the rows on unchanged and its
  inner tier sets it too. ``kvtier.testing.BackendTests`` runs its cases with ``PoolRows`` too for
  a backend that sets it.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvtier.errors import ClosedError, ConfigError, LifecycleError
from kvtier.units import parse_size

__all__ = ["BlockFormat", "RecordInfo", "Backend", "MemoryBackend", "BackendCounters"]


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """What every record of one store holds.

    ``dtype`` is the element type of the KV data (``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``,
    ``"float32"``, or ``"uint8"`` for mixed layouts); codecs use it to pick a byte-shuffle width.
    ``namespace`` is the namespace's public fields, written into persistent stores' meta records.
    """

    block_bytes: int
    dtype: str = "uint8"
    namespace_digest: bytes = b"\0" * 32
    namespace: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.block_bytes, int) or self.block_bytes < 1:
            raise ConfigError(f"block_bytes: expected a positive integer, got {self.block_bytes!r}")
        if len(self.namespace_digest) != 32:
            raise ConfigError("namespace_digest: expected 32 bytes")

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype`` (1 for unknown or mixed)."""
        try:
            return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        except (AttributeError, TypeError):
            return 1


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """One stored record, as a persistent backend reports it at open (to rebuild the index)."""

    key: bytes
    stored_bytes: int
    stamp: float = 0.0


@dataclass(slots=True)
class BackendCounters:
    """Counters every backend keeps; ``stats()`` returns them as a dict."""

    blocks_written: int = 0
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_failures: int = 0
    read_misses: int = 0
    corrupt_records: int = 0
    #: Of ``corrupt_records``, those refused by a keyed MAC (forged, unkeyed, another secret).
    auth_failures: int = 0
    deleted: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


class Backend(ABC):
    """One tier's storage. Subclasses set ``name`` and implement the abstract methods."""

    name: ClassVar[str] = ""
    is_memory: ClassVar[bool] = False
    persistent: ClassVar[bool] = False
    #: ``True``: ``write_blocks``/``read_blocks`` take any ``Sequence[torch.Tensor]``, a
    #: :class:`~kvtier.pool_rows.PoolRows` included, and the transfer engine hands it one per job
    #: instead of a list of views (see the module doc); ``False``: the engine hands it a ``list``.
    takes_pool_rows: ClassVar[bool] = False

    def __init__(self, *, capacity: int | str, **options: Any) -> None:
        if options:
            raise ConfigError(
                f"{self.name or type(self).__name__}: unknown option(s) {sorted(options)}"
            )
        self.capacity_bytes = parse_size(capacity, field="capacity")
        if self.capacity_bytes <= 0:
            raise ConfigError(f"capacity: expected a positive byte size, got {capacity!r}")
        self.counters = BackendCounters()
        self._fmt: BlockFormat | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def format(self) -> BlockFormat:
        if self._fmt is None:
            raise LifecycleError(f"backend {self.name!r} is not open; await open(fmt) first")
        return self._fmt

    @property
    def is_open(self) -> bool:
        return self._fmt is not None and not self._closed

    def _check_open(self) -> BlockFormat:
        if self._closed:
            raise ClosedError(f"backend {self.name!r} is closed")
        fmt = self._fmt  # (the property only where it raises: every job of a memory tier asks)
        return fmt if fmt is not None else self.format

    async def open(self, fmt: BlockFormat) -> None:
        """Acquire resources for records of ``fmt``. Subclasses call ``super().open(fmt)`` first."""
        if self._closed:
            raise ClosedError(f"backend {self.name!r} is closed and cannot be reopened")
        if self.capacity_bytes < fmt.block_bytes:
            raise ConfigError(
                f"capacity: {self.capacity_bytes} bytes is below one block ({fmt.block_bytes} bytes)"
            )
        self._fmt = fmt

    async def aclose(self) -> None:
        """Release resources. Idempotent."""
        self._closed = True

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- configuration ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The options that rebuild this backend with ``from_dict``; always has ``backend``."""
        return {"backend": self.name, "capacity": self.capacity_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Backend:
        options = dict(data)
        options.pop("backend", None)
        return cls(**options)

    # -- capacity --------------------------------------------------------------------------
    def reserve_bytes(self) -> int:
        """Bytes the manager reserves for one new block before it is written (worst case)."""
        return self.format.block_bytes

    def usable_bytes(self) -> int:
        """Bytes the manager may fill with reservations: the capacity less what the backend's own
        bookkeeping needs (a database's index pages and free-page slack, for instance)."""
        return self.capacity_bytes

    @property
    def max_blocks(self) -> int:
        """How many blocks fit at the worst-case reservation."""
        return self.usable_bytes() // self.reserve_bytes()

    def blocks_for(self, fmt: BlockFormat) -> int:
        """How many blocks of ``fmt`` this tier will hold, worked out without opening it (what
        ``kvtier config check`` shows): the same ``usable_bytes() // reserve_bytes()`` the store
        gives the manager at open, so a database's bookkeeping and a record's header and page
        rounding are counted. A tier behind a compressing codec holds more once it learns the
        stored sizes."""
        if self.is_open:
            return self.max_blocks
        saved, self._fmt = self._fmt, fmt
        try:
            return max(0, self.usable_bytes() // max(1, self.reserve_bytes()))
        finally:
            self._fmt = saved

    # -- bulk, blocking I/O (one call per job) -----------------------------------------------
    @abstractmethod
    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        """Store ``blocks[i]`` under ``keys[i]``; return the bytes each now occupies, ``None`` on failure."""

    @abstractmethod
    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        """Fill ``out[i]`` with the block stored under ``keys[i]``; ``False`` means a miss."""

    @abstractmethod
    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        """Remove the records of ``keys``; absent keys are ignored. A key that is not ``bytes`` of 32
        raises ``InvalidKeyError`` naming it before any record is removed (``check_keys``)."""

    def scan(self) -> Iterator[RecordInfo]:
        """Yield every stored record (persistent backends), for rebuilding the index at open."""
        return iter(())

    def stored_keys(self) -> list[bytes] | None:
        """The keys a tier that forgets its records at exit holds now, oldest stored first
        (a read-only listing: what a flush writes back without a manager's index); ``None``
        where the backend cannot list them. Persistent tiers answer ``scan`` instead."""
        return None

    def touch_stamps(self, stamps: Sequence[tuple[bytes, float]]) -> None:  # noqa: B027
        """Persist access stamps so eviction order survives a restart (persistent backends)."""

    def read_tags(self) -> tuple[dict[bytes, str], list[bytes]] | None:
        """The tenant of each tagged record and the pinned keys saved with this tier, read at
        open before ``scan`` is adopted (persistent backends); ``None``: it keeps none. Entries
        of records that are gone may be listed: the store drops them."""
        return None

    def write_tags(  # noqa: B027
        self, tenants: Sequence[tuple[bytes, str]], pins: Sequence[tuple[bytes, bool]], *, whole: bool = False, sync: bool = True
    ) -> None:
        """Save tenant tags (``(key, tenant)``) and pin changes (``(key, pinned)``); with
        ``whole``, they are every tag and pin of the tier, replacing what was saved. ``sync=False``
        may leave them in the OS's cache (a process crash keeps them, a power cut may not). A
        failure is logged, never raised: tags are bookkeeping."""

    def stats(self) -> dict[str, Any]:
        return {"backend": self.name, "capacity_bytes": self.capacity_bytes, **self.counters.as_dict()}

    # -- async forms: one worker-thread hop per call ------------------------------------------
    async def write(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        return await asyncio.to_thread(self.write_blocks, keys, blocks)

    async def read(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        return await asyncio.to_thread(self.read_blocks, keys, out)

    async def delete(self, keys: Sequence[bytes]) -> None:
        await asyncio.to_thread(self.delete_blocks, keys)


class MemoryBackend(Backend):
    """A backend whose blocks live in one tensor pool ``[num_slots, block_bytes]`` (uint8).

    ``slots(keys)`` gives the pool rows of stored keys and ``reserve(keys)`` allocates rows for
    new keys, so the transfer engine moves bytes between the engine's KV cache and the pool
    directly with batched tensor ops.
    """

    is_memory: ClassVar[bool] = True

    @property
    @abstractmethod
    def pool(self) -> torch.Tensor:
        """The ``[num_slots, block_bytes]`` uint8 pool (allocated in ``open``)."""

    @abstractmethod
    def slots(self, keys: Sequence[bytes]) -> list[int]:
        """Pool rows of ``keys``; raises ``LifecycleError`` naming a key that is not stored."""

    @abstractmethod
    def reserve(self, keys: Sequence[bytes]) -> list[int] | None:
        """Allocate rows for new ``keys`` (existing keys keep theirs); ``None`` and no change if full."""

    def evict_and_reserve(self, victims: Sequence[bytes], keys: Sequence[bytes]) -> list[int] | None:
        """A store job that makes its own room: ``delete_blocks(victims)`` (keys its manager
        chose, checked when they were stored), then ``reserve(keys)``. A pool may do both in
        one step."""
        if victims:
            self.delete_blocks(victims)
        return self.reserve(keys)
