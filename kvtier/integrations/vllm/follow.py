"""Blocks other engines store in a shared tier, followed by the scheduler side and announced to
routers as KV events (nothing here imports vLLM).

A shared tier (Redis, a ``file`` tier with ``shared: true``) holds blocks that other engines
stored: replicas of this model, of any tensor-parallel size. With head-group records
(:mod:`.head_layout`), the scheduler side opens each shared tier's backend in its own process
(:func:`follow_shared_tiers`; no bytes move there) and binds the tier's follower (its change
feed, or its sweep: ``kvtier.backends.feed_follower``, ``kvtier.backends.shared_index``) through
the tier's head-group view (``kvtier.records.head_group_tier.GroupIndex``), which adopts a block
into the group's manager once every head group of it is on the tier, and forgets it when one
goes. The manager announces both as its own
*stored* / *removed* events; the step never waits on the network (lookups stay in memory).

vLLM's KV events name a block by vLLM's block hash (its *offload key*); a kvtier key is a
one-way fold of it, so an engine that adopts another engine's block cannot name it from the
key alone. Each engine therefore publishes, for every block it stores in a shared tier, the
pair (kvtier key, offload key) in an :class:`OffloadKeyDirectory` next to the tier; a follower
looks the offload keys of the keys it adopted up there. Both run on the directory's own
thread: the step never waits on the network. A key whose pair is missing (never published,
evicted by the server, a directory that is down) is simply not announced: a router's guess is
then wrong, a block never is.

:class:`RedisOffloadKeys` keeps the pairs on the tier's Redis server, one string per block
(``<prefix>:vllm-key:<kvtier key>``, with the tier's ``ttl_s``), so the server's own eviction
policy bounds them as it bounds the records. The prefix is the tier's configured one, without a
rank or TP size: engines of every TP size share the directory.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvtier.config import build_backend, load_config
from kvtier.integrations._sync import run_sync
from kvtier.integrations.vllm.engines import rank_tiers
from kvtier.integrations.vllm.group_config import group_shares, group_tiers
from kvtier.integrations.vllm.head_layout import together_tiers
from kvtier.integrations.vllm.ranks import RankTiers
from kvtier.records.head_group_tier import HeadGroupTier

__all__ = [
    "OffloadKeyDirectory",
    "RedisOffloadKeys",
    "SharedFollowing",
    "directory_for",
    "follow_shared_tiers",
]

log = logging.getLogger("kvtier.vllm")

#: requests queued for a directory's thread; past it a request is dropped (counted)
QUEUE_LIMIT = 1024
#: kvtier keys per Redis pipeline
_BATCH = 512


def follow_shared_tiers(
    store_dict: Mapping[str, Any],
    world_size: int,
    group_ids: Sequence[int],
    described: Sequence[RankTiers],
    managers: Sequence[Any],
) -> list[Any]:
    """In the scheduler's process, open the shared tiers (Redis; ``file`` with ``shared: true``)
    that hold head-group records, and bind each tier's follower (its change feed, or its sweep)
    to the manager of each KV-cache group (``group_ids``, vLLM's) through its head-group view. ``described``: rank 0's description of each group. Returns the backends opened (closed by the caller).
    Records of the per-rank layout are not followed (each rank's prefix is its own)."""
    if not described or any(d.head_groups is None or d.block_format is None for d in described):
        return []
    together = together_tiers(store_dict)
    per_rank = rank_tiers(store_dict, 0, world_size, together=together)
    shares = group_shares([d.block_bytes for d in described])
    opened: list[Any] = []
    for gpos, (desc, manager) in enumerate(zip(described, managers)):
        assert desc.head_groups is not None and desc.block_format is not None and desc.key_namespace is not None
        cfg = load_config(
            group_tiers(per_rank, group_ids[gpos], shares[gpos], len(described)),
            source="kv_connector_extra_config.kvtier",
            block_bytes=desc.block_bytes,
        )
        for i, room in enumerate(desc.tiers):
            if not room.shared or i not in together:
                continue
            backend = build_backend(cfg.tiers[i], i)
            if not getattr(backend, "shared", False):  # a file tier without ``shared: true``: read at start only
                continue
            view = HeadGroupTier(backend, desc.head_groups, desc.key_namespace)
            try:
                run_sync(backend.open(view.record_format(desc.block_format)))
                if getattr(backend, "bind_index", None) is None:
                    run_sync(backend.aclose())
                    continue
                # The view's GroupIndex adopts a block once every head group of it is on the tier.
                view.bind_index(manager, i)  # adopt_live: other engines' blocks are stored events
            except Exception as exc:  # a server down at start: adopted at the next start instead
                log.warning("kvtier: cannot follow shared tier %d (%s) from the scheduler: %s", i, room.name, exc)
                continue
            opened.append(backend)
            log.info("kvtier: the scheduler side follows shared tier %d (%s), KV-cache group position %d", i, room.name, gpos)
    return opened


class OffloadKeyDirectory(Protocol):
    """(kvtier key, vLLM offload key) pairs of the blocks in a shared tier, for every engine that
    shares it. Neither call blocks: the work runs on the directory's own thread."""

    counters: dict[str, int]

    def publish(self, pairs: Sequence[tuple[bytes, bytes]]) -> None: ...
    def request(self, keys: Sequence[bytes]) -> None: ...
    def take_found(self) -> list[tuple[bytes, bytes]]: ...
    def close(self) -> None: ...


class RedisOffloadKeys:
    """An :class:`OffloadKeyDirectory` on a Redis server or cluster (see the module doc)."""

    def __init__(self, client: Any, prefix: str, *, ttl_s: float | None = None) -> None:
        self._client = client
        self._prefix = f"{prefix}:vllm-key:".encode()
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._queue: queue.Queue[tuple[str, list[Any]] | None] = queue.Queue(QUEUE_LIMIT)
        self._found: list[tuple[bytes, bytes]] = []
        self._lock = threading.Lock()
        self.counters = {"published": 0, "requested": 0, "found": 0, "dropped": 0, "errors": 0}
        self._thread = threading.Thread(target=self._run, name="kvtier-vllm-offload-keys", daemon=True)
        self._thread.start()

    def publish(self, pairs: Sequence[tuple[bytes, bytes]]) -> None:
        if pairs:
            self._put(("set", list(pairs)))

    def request(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._put(("get", list(keys)))

    def take_found(self) -> list[tuple[bytes, bytes]]:
        with self._lock:
            out, self._found = self._found, []
        return out

    def close(self) -> None:
        """Finish what is queued (bounded by the client's timeouts), then stop."""
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=10.0)
        try:
            self._client.close()
        except Exception as exc:  # closing sockets of a dead server must not fail a close
            log.debug("kvtier: closing the offload key directory: %s", exc)

    def _put(self, item: tuple[str, list[Any]]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.counters["dropped"] += len(item[1])

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, values = item
            try:
                for start in range(0, len(values), _BATCH):
                    chunk = values[start : start + _BATCH]
                    if kind == "set":
                        self._set(chunk)
                    else:
                        self._get(chunk)
            except Exception as exc:  # a server down or refusing: those pairs go unannounced
                self.counters["errors"] += 1
                log.debug("kvtier: offload key directory %s failed: %s", kind, exc)

    def _set(self, pairs: list[tuple[bytes, bytes]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key, offload_key in pairs:
            pipe.set(self._prefix + key, offload_key, px=self._ttl_ms)
        pipe.execute()
        self.counters["published"] += len(pairs)

    def _get(self, keys: list[bytes]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._prefix + key)
        values = pipe.execute()
        found = [(k, bytes(v)) for k, v in zip(keys, values) if isinstance(v, (bytes, bytearray)) and v]
        self.counters["requested"] += len(keys)
        self.counters["found"] += len(found)
        with self._lock:
            self._found.extend(found)


def _redis_client(tier: Mapping[str, Any]) -> Any:
    """A redis-py client for the server of a ``redis`` tier config (its url, credentials, TLS
    files and timeouts), or a cluster client with ``cluster: true``."""
    import redis
    from redis.cluster import RedisCluster

    options: dict[str, Any] = {
        "socket_timeout": float(tier.get("socket_timeout_s", 5.0)),
        "socket_connect_timeout": float(tier.get("connect_timeout_s", 2.0)),
    }
    if tier.get("username") is not None:
        options["username"] = tier["username"]
    password = tier.get("password")
    if tier.get("password_env"):
        password = os.environ.get(str(tier["password_env"]))
    if password is not None:
        options["password"] = password
    for ours, theirs in (("tls_ca_file", "ssl_ca_certs"), ("tls_cert_file", "ssl_certfile"), ("tls_key_file", "ssl_keyfile")):
        if tier.get(ours):
            options[theirs] = tier[ours]
    url = str(tier.get("url", "redis://127.0.0.1:6379/0"))
    if tier.get("cluster"):
        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


def directory_for(tiers: Sequence[Mapping[str, Any]]) -> OffloadKeyDirectory | None:
    """The offload key directory of the first shared Redis tier in an engine's store config
    (the user's tiers, before any rank suffix), or None when there is none."""
    for tier in tiers:
        if isinstance(tier, Mapping) and tier.get("backend") == "redis":
            ttl = tier.get("ttl_s")
            return RedisOffloadKeys(_redis_client(tier), str(tier.get("prefix", "kvtier")), ttl_s=None if ttl is None else float(ttl))
    return None


class SharedFollowing:
    """The scheduler side's part in shared tiers, for all its KV-cache groups: the followed
    backends (:func:`follow_shared_tiers`), the offload key directory, and the adopted keys
    whose offload keys are being looked up (at most ``PENDING_LIMIT``, oldest dropped)."""

    PENDING_LIMIT = 1 << 16

    def __init__(self, store_dict: Mapping[str, Any], world_size: int) -> None:
        self._store_dict = store_dict
        self._world_size = world_size
        self.backends: list[Any] = []
        self.directory: OffloadKeyDirectory | None = None
        self._pending: dict[bytes, tuple[int, int]] = {}
        self._asked: list[bytes] = []

    def start(self, group_ids: Sequence[int], described: Sequence[RankTiers], managers: Sequence[Any]) -> None:
        """Follow the shared tiers and open the directory (failures are logged: nothing is
        followed or announced then, and everything else works as before)."""
        try:
            self.directory = directory_for(self._store_dict.get("tiers") or ())
        except Exception as exc:
            log.warning("kvtier: no offload key directory (blocks of other engines go unannounced): %s", exc)
        self.backends = follow_shared_tiers(self._store_dict, self._world_size, group_ids, described, managers)

    def publish(self, pairs: Sequence[tuple[bytes, bytes]]) -> None:
        """(kvtier key, offload key) of blocks this engine stored, for the other engines."""
        if self.directory is not None and pairs:
            self.directory.publish(pairs)

    def ask(self, gpos: int, key: bytes, tier: int) -> None:
        """``key`` was adopted from another engine: look its offload key up (see take_found)."""
        if self.directory is None:
            return
        if len(self._pending) >= self.PENDING_LIMIT:
            self._pending.pop(next(iter(self._pending)))
        self._pending[key] = (gpos, tier)
        self._asked.append(key)

    def take_found(self) -> list[tuple[int, bytes, bytes, int]]:
        """Send the lookups asked since the last call; (group position, kvtier key, offload
        key, tier) of those answered since."""
        if self.directory is None:
            return []
        if self._asked:
            asked, self._asked = self._asked, []
            self.directory.request(asked)
        out = []
        for key, offload_key in self.directory.take_found():
            where = self._pending.pop(key, None)
            if where is not None:
                out.append((where[0], key, offload_key, where[1]))
        return out

    def close(self) -> None:
        for backend in self.backends:
            try:
                run_sync(backend.aclose())
            except Exception as exc:
                log.debug("kvtier: closing a followed tier: %s", exc)
        self.backends = []
        if self.directory is not None:
            self.directory.close()
            self.directory = None
