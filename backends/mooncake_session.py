"""One Mooncake Store client for the ``mooncake`` tier: set-up, registered staging, batched calls.

:class:`MooncakeSession` owns a ``mooncake.store.MooncakeDistributedStore`` and everything the
tier hands to it:

* **set-up and teardown** off the event loop. A client with ``global_segment_size: 0`` mounts no
  memory: its records live in the segments of other clients (a standalone ``mooncake_client``,
  or engines that do mount memory), so they outlive this process. A client that mounts memory
  serves its records to others only while it lives: Mooncake keeps an object in the segment of
  the client that stored it.
* **registered staging** (:class:`Staging`): kvtier's own buffer for record heads (and for
  whole records where a block cannot be sent as it is: a compressed payload, a read of unknown
  length), allocated and registered with the client once. The blocks themselves go straight
  from and into the caller's rows (``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers``: a record is two slices, its head in staging and its payload
  in the row), so no Python ``bytes`` is made per block. With ``protocol: rdma`` the rows'
  memory is registered too (the NIC may only touch registered memory), and unregistered once
  the engine freed it (:mod:`~kvtier.backends.mooncake_regions`); over TCP the client reads and
  writes any address of this process.
* **outcomes** of Mooncake's calls, which return a status per key (:data:`RPC_FAIL` and kin:
  the master is unreachable, see :func:`master_unreachable`), never exceptions.
* **its log level**: Mooncake's client logs every step to stderr; unless ``MC_LOG_LEVEL`` is set
  when the client is first loaded, it is set to ``ERROR``.
* **the master's admin HTTP** (``admin_url``): ``/get_all_keys`` for the shared index, read as a
  stream of lines, and ``/health``.

A dead master makes every Mooncake call take about 4.3 s before it returns :data:`RPC_FAIL`
(``MC_RPC_TIMEOUT_MS`` does not shorten it), so while the tier is down it asks
:meth:`MooncakeSession.master_answers` (a TCP connect with a short timeout) before it lets a
call through.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from kvtier.backends.mooncake_regions import Regions

from kvtier.errors import MissingDependencyError

__all__ = [
    "BUFFER_TOO_SMALL",
    "NO_SPACE",
    "NOT_FOUND",
    "RPC_FAIL",
    "TRANSFER_FAIL",
    "MooncakeSession",
    "Staging",
    "master_unreachable",
]

log = logging.getLogger("kvtier")

#: Mooncake status codes the tier tells apart (``mooncake-store/include/types.h``).
NO_SPACE = -200  #: no segment with room (full, or no segment mounted yet)
BUFFER_TOO_SMALL = -600  #: the object is larger than the buffer given (INVALID_PARAMS)
NOT_FOUND = -704
HAS_LEASE = -706  #: a read lease blocks a plain remove (the tier removes with ``force``)
TRANSFER_FAIL = -800  #: the slices do not match the object, or its segment's owner is gone
RPC_FAIL = -900
_MASTER_GONE = frozenset({RPC_FAIL, -901, -902})


def master_unreachable(codes: Sequence[int]) -> bool:
    """Whether a batch's status codes say the master could not be reached."""
    return any(c in _MASTER_GONE for c in codes)


def _load_store_class() -> Any:
    # Mooncake's client logs every set-up step to stderr (glog, INFO and up) unless told
    # otherwise; an engine's stderr gets its errors only, unless the operator set a level.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
    except ImportError as exc:
        raise MissingDependencyError(
            "the mooncake tier needs Mooncake's Python store: pip install 'kvtier[mooncake]' "
            f"(and the libibverbs1 system package, which its binaries link even for TCP) ({exc})"
        ) from exc
    return MooncakeDistributedStore, ReplicateConfig, SoftPinAction


class Staging:
    """A registered host buffer of ``nbytes``, lent whole to one job chunk at a time."""

    def __init__(self, session: MooncakeSession, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.base = self.buffer.data_ptr()
        self.nbytes = nbytes
        self.bytes = memoryview(self.buffer.numpy()).cast("B")
        self.lock = threading.Lock()
        session.register_storages([self.buffer.untyped_storage()])

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.bytes[offset : offset + nbytes]


class MooncakeSession:
    """A Mooncake client configured as the tier's options say; ``open`` / ``close`` on a worker thread."""

    def __init__(
        self,
        *,
        master: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        local_hostname: str,
        global_segment_size: int,
        local_buffer_size: int,
        admin_url: str,
        replica_num: int,
        soft_pin_ttl_ms: int | None,
    ) -> None:
        self.master = master
        self.metadata_server = metadata_server
        self.protocol = protocol
        self.device_name = device_name
        self.local_hostname = local_hostname
        self.global_segment_size = global_segment_size
        self.local_buffer_size = local_buffer_size
        self.admin_url = admin_url.rstrip("/")
        self.replica_num = replica_num
        self.soft_pin_ttl_ms = soft_pin_ttl_ms
        self.store: Any = None
        self._config: Any = None
        self.put_staging: Staging | None = None
        self.get_staging: Staging | None = None
        #: Whether the memory transfers touch must be registered with the client (rdma).
        self.registers = protocol == "rdma"
        #: The memory registered with the client while it is open (where ``registers``).
        self.regions: Regions | None = None
        self._counts_closed: dict[str, int] = {}  # of the clients closed so far
        self._lock = threading.Lock()

    # -- set-up -----------------------------------------------------------------------------------
    def open(self) -> bool:
        """Set the client up; ``False`` when the master or metadata server did not take it (the
        tier is then down and tries again later). Raises ``MissingDependencyError`` without
        Mooncake."""
        with self._lock:
            if self.store is not None:
                return True
            store_class, config_class, pin_action = _load_store_class()
            store = store_class()
            rc = store.setup(
                self.local_hostname, self.metadata_server, self.global_segment_size, 0,
                self.protocol, self.device_name, self.master,
            )
            if rc != 0:
                log.debug("mooncake: setup against %s returned %s", self.master, rc)
                try:
                    store.close()
                except Exception:  # a half set-up client; nothing to keep
                    pass
                return False
            config = config_class()
            config.replica_num = self.replica_num
            if self.soft_pin_ttl_ms is not None:
                config.soft_pin_action = pin_action.ENABLE
                config.soft_pin_ttl_ms = self.soft_pin_ttl_ms
            self.store, self._config = store, config
            if self.registers:
                self.regions = Regions(store.register_buffer, store.unregister_buffer)
            half = self.local_buffer_size // 2
            self.put_staging = Staging(self, half)
            self.get_staging = Staging(self, self.local_buffer_size - half)
            return True

    def close(self) -> None:
        with self._lock:
            store, self.store = self.store, None
            regions, self.regions = self.regions, None
            self.put_staging = self.get_staging = None
        if regions is not None:
            regions.close()  # every region let go while the client still knows them
            for name, n in regions.counts.items():
                self._counts_closed[name] = self._counts_closed.get(name, 0) + n
        if store is not None:
            store.close()

    def register_storages(self, storages: Sequence[Any]) -> None:
        """Have the memory of ``storages`` registered with the client (only rdma needs it: TCP
        reads and writes any address); see :class:`~kvtier.backends.mooncake_regions.Regions`."""
        regions = self.regions
        if regions is not None:
            regions.storages(storages)

    def register_rows(self, rows: Sequence[torch.Tensor]) -> None:
        """Have the memory ``rows`` live in registered (their storages: a staging buffer or a pool)."""
        if self.regions is not None:
            self.register_storages([row.untyped_storage() for row in rows])

    def registration_counts(self) -> dict[str, int]:
        """Registrations made, let go and failed so far, and the regions held (empty over TCP)."""
        regions = self.regions
        counts = dict(self._counts_closed)
        if regions is not None:
            for name, n in regions.counts.items():
                counts[name] = counts.get(name, 0) + n
        if counts or regions is not None:
            counts["regions"] = 0 if regions is None else len(regions)
        return counts

    # -- batched calls (each returns one status per key: 0 / a length, or a negative code) ----------
    def put_parts(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Put each object from its slices (one call); objects of one slice each take the plain call."""
        if all(len(p) == 1 for p in ptrs):
            return list(self.store.batch_put_from(keys, [p[0] for p in ptrs], [s[0] for s in sizes], self._config))
        return list(self.store.batch_put_from_multi_buffers(keys, ptrs, sizes, self._config))

    def upsert(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return list(self.store.batch_upsert_from(keys, ptrs, sizes, self._config))

    def put_new(self, key: str, ptr: int, size: int) -> int:
        """Store only if ``key`` is absent (Mooncake's ``put`` keeps an existing object)."""
        return int(self.store.put_from(key, ptr, size, self._config))

    def get_parts(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return list(self.store.batch_get_into_multi_buffers(keys, ptrs, sizes))

    def get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return list(self.store.batch_get_into(keys, ptrs, sizes))

    def size_of(self, key: str) -> int:
        return int(self.store.get_size(key))

    def remove(self, keys: list[str]) -> list[int]:
        """Remove with ``force``: a reader's lease (−706 for about 10 s after a read) must not
        keep a bad record alive. A reader mid-transfer then reads freed memory, which its
        checksum refuses."""
        return list(self.store.batch_remove(keys, True))

    # -- the master ---------------------------------------------------------------------------------
    def master_answers(self, timeout_s: float) -> bool:
        """Whether the master's RPC port accepts a connection within ``timeout_s``."""
        host, _, port = self.master.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            return False

    def list_keys(self, timeout_s: float) -> Iterator[str]:
        """Every key the master holds (``/get_all_keys``), read as a stream of lines. Raises
        ``OSError`` when the admin port does not answer."""
        try:
            with urllib.request.urlopen(f"{self.admin_url}/get_all_keys", timeout=timeout_s) as reply:
                for line in reply:
                    key = line.strip()
                    if key:
                        yield key.decode("utf-8", "replace")
        except urllib.error.URLError as exc:
            raise OSError(f"{self.admin_url}/get_all_keys: {exc.reason}") from exc

    def health(self, timeout_s: float) -> str | None:
        """``None`` when the admin port says the master serves, else what is wrong."""
        try:
            with urllib.request.urlopen(f"{self.admin_url}/health", timeout=timeout_s) as reply:
                text = reply.read(4096).decode("utf-8", "replace")
        except (OSError, urllib.error.URLError) as exc:
            return f"the master's admin port {self.admin_url} does not answer ({exc})"
        if '"ok"' not in text:
            return f"the master's admin port {self.admin_url} says it does not serve: {text[:200]}"
        return None
