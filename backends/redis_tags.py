"""Tenant tags and pins of a ``redis`` tier, on the server next to its records.

``<prefix>:<namespace digest, 16 hex>:tenants`` is a hash (record key -> tenant, UTF-8) and
``...:pins`` a set of pinned record keys; both are shared by every engine of the tier, as its
records are. Saving adds and removes entries (``HSET``/``SADD``/``SREM``); saving a tier's tags
whole (at open) also drops the entries of records that are gone. ``kvtier clear`` deletes them
with the records (they are under the prefix), and ``kvtier clear --tenant T`` reads the hash to
find ``T``'s records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TAGS_SUFFIX", "PINS_SUFFIX", "read_redis_tags", "write_redis_tags"]

TAGS_SUFFIX = b"tenants"
PINS_SUFFIX = b"pins"


def read_redis_tags(client: Any, prefix: bytes) -> tuple[dict[bytes, str], list[bytes]]:
    """(tenant of each tagged record key, pinned record keys) of the namespace at ``prefix``."""
    raw = client.hgetall(prefix + TAGS_SUFFIX)
    tenants = {}
    for key, value in raw.items():
        try:
            tenants[bytes(key)] = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            continue  # not written by kvtier: skipped
    return tenants, [bytes(k) for k in client.smembers(prefix + PINS_SUFFIX)]


def write_redis_tags(
    client: Any, prefix: bytes, tenants: Sequence[tuple[bytes, str]], pins: Sequence[tuple[bytes, bool]], *, whole: bool
) -> None:
    tags_key, pins_key = prefix + TAGS_SUFFIX, prefix + PINS_SUFFIX
    on = [key for key, pinned in pins if pinned]
    off = [key for key, pinned in pins if not pinned]
    if whole:  # every tag and pin of the tier: the others are of records gone
        off += [bytes(k) for k in client.smembers(pins_key) if bytes(k) not in set(on)]
        named = {key for key, _ in tenants}
        stale = [k for k in client.hkeys(tags_key) if bytes(k) not in named]
    else:
        stale = []
    pipe = client.pipeline(transaction=False)
    for i in range(0, len(tenants), 1000):
        pipe.hset(tags_key, mapping={key: tenant.encode("utf-8") for key, tenant in tenants[i : i + 1000]})
    for i in range(0, len(stale), 1000):
        pipe.hdel(tags_key, *stale[i : i + 1000])
    for keys, op in ((on, pipe.sadd), (off, pipe.srem)):
        for i in range(0, len(keys), 1000):
            op(pins_key, *keys[i : i + 1000])
    pipe.execute()
