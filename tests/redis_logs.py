"""Helpers shared by the tests of the redis tier's key logs (one value per namespace, or one per
hash slot on a cluster): tiers opened as a store opens them, and the general listing (``SCAN``
through redis-py) their logs are compared with."""

from __future__ import annotations

import asyncio
from typing import Any

from redis_servers import open_redis_tier

from kvtier.testing import random_block

#: The block size of every tier these tests open.
BLOCK = 1024


def open_tier(namespace: bytes, url: str, **options: Any) -> Any:
    """A tier opened as a store opens it: its listing taken (which begins the log, or the slot
    logs, of a new namespace)."""
    backend = open_redis_tier(namespace, BLOCK, url=url, **options)
    backend.scan_columns()
    return backend


def reopen_tier(namespace: bytes, url: str, **options: Any) -> tuple[Any, list[bytes], dict[str, Any]]:
    """Another tier on the same namespace, the keys its open adopts (each once) and its log's counters."""
    backend = open_redis_tier(namespace, BLOCK, url=url, **options)
    keys = backend.scan_columns().distinct().keys
    return backend, keys, backend.stats()["key_log"]


def close_tier(backend: Any) -> None:
    asyncio.run(backend.aclose())


def write_keys(backend: Any, keys: list[bytes]) -> None:
    """Store ``keys`` (block ``i`` made from seed ``i``); every write must succeed."""
    assert all(s is not None for s in backend.write_blocks(keys, [random_block(BLOCK, i) for i in range(len(keys))]))


def general_keys(backend: Any) -> set[bytes]:
    """The keys a ``SCAN`` of the records lists."""
    return {key for key in map(backend.block_key, backend._list_keys()) if key is not None}
