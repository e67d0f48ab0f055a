"""Shared plumbing for byte backends that store one record per key: codec and MAC options,
job validation, record encoding, and counting what a read found."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch

from kvtier import devices
from kvtier.backend import Backend
from kvtier.devices import tensor_device
from kvtier.errors import ConfigError, CorruptBlockError, LayoutError
from kvtier.keys import check_keys
from kvtier.records.codec import Codec, resolve_codec
from kvtier.records.counts import counts_add
from kvtier.records.mac import DEFAULT_MAC_ALGORITHM, HIDDEN_SECRET, MAC_TAG_SIZE, RecordAuthError, RecordMac
from kvtier.records.record import HEADER_SIZE, dtype_code, encode_record

__all__ = ["PersistentRecordBackend", "RecordBackend"]


def _in_host_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is one contiguous run of host memory (its bytes can be viewed, not copied).
    Asked once per record: ``is_cpu`` costs a fifth of building ``t.device`` (the tests'
    ``devices.locate`` stand-in, when set, decides instead)."""
    if devices.locate is None:
        return t.is_cpu and t.is_contiguous()
    return tensor_device(t).type == "cpu" and t.is_contiguous()


class RecordBackend(Backend):
    """Base for byte backends that keep one :mod:`kvtier.records.format` record per key behind a codec.

    Subclasses get option handling for ``codec``, block/key validation, record encoding and a
    uniform way to treat corrupt or unsupported records on read.
    """

    def __init__(
        self,
        *,
        capacity: int | str,
        codec: str | dict[str, Any] | Codec | None = "none",
        mac_key: bytes | str | None = None,
        mac_key_env: str | None = None,
        mac_algorithm: str = DEFAULT_MAC_ALGORITHM,
    ) -> None:
        super().__init__(capacity=capacity)
        self.codec = resolve_codec(codec)
        #: The keyed MAC records are written and checked with, or ``None`` (plain checksums).
        self.mac = RecordMac.from_options(mac_key, mac_key_env, algorithm=mac_algorithm)
        self._mac_key_env = mac_key_env
        self._mac_inline = mac_key is not None

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["codec"] = self.codec.to_dict()
        if self._mac_key_env is not None:
            data["mac_key_env"] = self._mac_key_env
        elif self._mac_inline:
            data["mac_key"] = HIDDEN_SECRET  # never the secret; from_dict asks for it again
        if self.mac is not None:
            data["mac_algorithm"] = self.mac.algorithm
        return data

    def _head_bytes(self) -> int:
        """Bytes every record carries before its payload: the header, and the tag when keyed."""
        return HEADER_SIZE + (MAC_TAG_SIZE if self.mac is not None else 0)

    def _dtype_code(self) -> int:
        return dtype_code(self.format.dtype)

    def _check_io(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> int:
        """Validate a job before anything is touched; returns the block size."""
        size = self._check_open().block_bytes
        check_keys(keys)
        if len(tensors) != len(keys):
            raise LayoutError(f"{self.name}: {len(keys)} keys but {len(tensors)} blocks")
        for i, t in enumerate(tensors):
            if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != size:
                raise LayoutError(
                    f"{self.name}: blocks[{i}] must be a 1-D uint8 tensor of {size} bytes, got {tuple(t.shape)} {t.dtype}"
                )
        return size

    def _encode(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[tuple[bytes, Any]]:
        """(header, payload) per block; raw payloads are views of the (host) block, not copies."""
        return [self._encode_one(key, block) for key, block in zip(keys, blocks)]

    def _encode_one(self, key: bytes, block: torch.Tensor) -> tuple[bytes, Any]:
        host = block if _in_host_memory(block) else block.contiguous().cpu()
        return encode_record(key, host.numpy().data, self.codec, self._dtype_code(), self.mac)

    @staticmethod
    def _host_view(out: torch.Tensor) -> tuple[memoryview, torch.Tensor | None]:
        """A writable view of ``out``, or of a host staging tensor to copy back afterwards."""
        if _in_host_memory(out):
            return out.numpy().data, None
        staging = torch.empty(out.numel(), dtype=torch.uint8)
        return staging.numpy().data, staging

    # A job's counts, each one add (kvtier.records.counts: jobs run on several threads at once).
    def _count_auth(self, exc: CorruptBlockError) -> None:
        """Count a record refused by the keyed MAC (it is also counted as corrupt)."""
        if isinstance(exc, RecordAuthError):
            counts_add(self.counters, "auth_failures", 1)

    def _count_reads(self, found: list[bool], size: int, *, corrupt: int, auth: int = 0) -> None:
        """A read job's counts: ``corrupt`` of its records bad, ``auth`` of those refused by the MAC."""
        hits = sum(found)
        misses = len(found) - hits - corrupt
        counts_add(self.counters, "blocks_read", hits, "bytes_read", hits * size, "read_misses", misses, "corrupt_records", corrupt, "auth_failures", auth)

    def _count_writes(self, stored: int, nbytes: int, failed: int) -> None:
        counts_add(self.counters, "blocks_written", stored, "bytes_written", nbytes, "write_failures", failed)

    def _count_deleted(self, n: int) -> None:
        counts_add(self.counters, "deleted", n)


class PersistentRecordBackend(RecordBackend):
    """A record backend that lives under a filesystem ``path`` and honours ``sync_mode``:
    ``durable`` (a write returns once its data is on stable storage) or ``fast`` (no syncs)."""

    persistent: ClassVar[bool] = True
    #: What ``path`` names, for the error when it is missing.
    path_meaning: ClassVar[str] = "a directory"

    def __init__(
        self,
        *,
        capacity: int | str,
        path: str | os.PathLike[str] | None = None,
        codec: str | dict[str, Any] | Codec | None = "none",
        sync_mode: Literal["durable", "fast"] = "durable",
        mac_key: bytes | str | None = None,
        mac_key_env: str | None = None,
        mac_algorithm: str = DEFAULT_MAC_ALGORITHM,
    ) -> None:
        super().__init__(capacity=capacity, codec=codec, mac_key=mac_key, mac_key_env=mac_key_env, mac_algorithm=mac_algorithm)
        if path is None or not str(path):
            raise ConfigError(f"path: the {self.name} backend needs {self.path_meaning} (option 'path')")
        if sync_mode not in ("durable", "fast"):
            raise ConfigError(f"sync_mode: expected 'durable' or 'fast', got {sync_mode!r}")
        self.path = os.fspath(path)
        self.sync_mode: Literal["durable", "fast"] = sync_mode

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data.update(path=self.path, sync_mode=self.sync_mode)
        return data
