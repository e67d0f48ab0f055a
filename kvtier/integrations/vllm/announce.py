"""Which vLLM block each kvtier key stands for, kept next to a persistent tier so that a new
process can announce the blocks it adopted.

vLLM's KV events (``BlockStored`` / ``BlockRemoved``, which KV-aware routers consume) name
blocks by vLLM's block hash. A kvtier key is a one-way fold of that hash with the namespace, so
a process that adopts records from a persistent tier at start cannot tell a router what they
are from the keys alone. :class:`OffloadKeyLog` remembers the pair for every block stored:
one append-only file (``vllm-offload-keys-of-<world>.bin``) in the directory of the first
persistent tier that has a ``path``, written by the scheduler side when a store completes.
At start the scheduler side reads it, announces the adopted keys it names, and rewrites it
with those alone (entries of keys no longer held are dropped).

Entries are ``[u16 length][kvtier key][u16 length][vLLM offload key]``. A torn or damaged tail
(a process killed mid-append) ends the read there: the keys after it are simply not announced.
Nothing here touches KV bytes; a wrong or missing entry costs a router a wrong guess, never a
wrong block. I/O errors are logged and counted, never raised into vLLM.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["OffloadKeyLog", "adopted_announcements", "offload_key_log_path"]

log = logging.getLogger("kvtier.vllm")

_LEN = struct.Struct("<H")


def offload_key_log_path(store_cfg: Mapping[str, Any], world_size: int) -> str | None:
    """Where the log of an engine of ``world_size`` ranks lives (the user's ``path`` of its
    first persistent path-based tier, above the ranks' directories), or None (no such tier)."""
    for tier in store_cfg.get("tiers") or ():
        if isinstance(tier, Mapping) and tier.get("path") is not None:
            return os.path.join(str(tier["path"]), f"vllm-offload-keys-of-{world_size}.bin")
    return None


class OffloadKeyLog:
    """kvtier key -> vLLM offload key pairs in one append-only file (see the module doc)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.errors = 0

    def load(self) -> dict[bytes, bytes]:
        """The pairs in the file, up to its first torn or damaged entry."""
        if self.path is None or not os.path.exists(self.path):
            return {}
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError as exc:
            self._failed("read", exc)
            return {}
        pairs: dict[bytes, bytes] = {}
        pos = 0
        while True:
            parts = []
            for _ in range(2):
                if pos + _LEN.size > len(data):
                    return pairs
                (n,) = _LEN.unpack_from(data, pos)
                if n == 0 or pos + _LEN.size + n > len(data):
                    return pairs
                parts.append(data[pos + _LEN.size : pos + _LEN.size + n])
                pos += _LEN.size + n
            pairs[parts[0]] = parts[1]

    def append(self, pairs: Iterable[tuple[bytes, bytes]]) -> None:
        self._write(pairs, "ab")

    def rewrite(self, pairs: Mapping[bytes, bytes]) -> None:
        """Replace the file by ``pairs`` (atomically: a new file renamed over the old)."""
        if self.path is None:
            return
        tmp = f"{self.path}.tmp"
        if self._write(pairs.items(), "wb", tmp):
            try:
                os.replace(tmp, self.path)
            except OSError as exc:
                self._failed("rewrite", exc)

    def _write(self, pairs: Iterable[tuple[bytes, bytes]], mode: str, path: str | None = None) -> bool:
        target = path or self.path
        if target is None:
            return False
        blob = b"".join(_LEN.pack(len(k)) + k + _LEN.pack(len(v)) + v for k, v in pairs if 0 < len(k) and 0 < len(v) < 1 << 16)
        try:
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            with open(target, mode) as f:
                f.write(blob)
        except OSError as exc:
            self._failed("write", exc)
            return False
        return True

    def _failed(self, what: str, exc: OSError) -> None:
        self.errors += 1
        log.warning("kvtier: cannot %s the vLLM offload key log %s: %s (adopted blocks go unannounced)", what, self.path, exc)


def adopted_announcements(
    adopted: Mapping[int, Iterable[bytes]], known: Mapping[bytes, bytes]
) -> tuple[list[tuple[int, bytes]], dict[bytes, bytes]]:
    """The (tier, vLLM offload key) of each adopted key the log names, and the pairs to keep
    (those of adopted keys; the others' blocks are gone)."""
    events: list[tuple[int, bytes]] = []
    keep: dict[bytes, bytes] = {}
    for tier in sorted(adopted):
        for key in adopted[tier]:
            offload_key = known.get(key)
            if offload_key is not None:
                events.append((tier, offload_key))
                keep[key] = offload_key
    return events, keep
