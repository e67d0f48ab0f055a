"""The primaries of the redis tier's server or cluster: which one holds which keys, whether each
is up, and a listing run on each.

:class:`RedisNodes` routes a job's keys to the primaries that hold their hash slots (one route
for a single server, under the tier's own health), keeps an up/down state per cluster primary
(a dead primary misses its own slots only), notes when the slot map must be fetched again (a
failover, a ``MOVED`` reply), and runs a listing (``SCAN``) on each live primary, in turn or a
thread per primary. :class:`~kvtier.backends.redis_tier.RedisBackend` hands its hooks
(``_routes``, ``_healths``, ``_note_failure``) and its sweeps to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

from kvtier.backends.redis_pool import PoolGate
from kvtier.backends.redis_scan import interleaved
from kvtier.backends.remote_health import Down, Health
from kvtier.backends.remote_tier import Route, SweepSkipped

from kvtier.errors import MissingDependencyError
from kvtier.records.counts import counts_add

try:
    from redis.exceptions import AskError, ClusterDownError, MaxConnectionsError, MovedError, TryAgainError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - redis is a dependency; a broken install says so
    raise MissingDependencyError(f"the redis backend needs redis-py: pip install 'redis[hiredis]' ({exc})") from exc

__all__ = ["DOWN_ERRORS", "NodeHost", "RedisNodes"]

T = TypeVar("T")
#: what a dead server or node raises
DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class NodeHost(Protocol):
    """What :class:`RedisNodes` uses of the tier."""

    name: str
    url: str
    cluster: bool
    view: Any
    _health: Health
    _client_lock: threading.Lock
    _gate: PoolGate

    def _get_client(self) -> Any: ...


class RedisNodes:
    """Routes, per-primary health and per-primary listings of ``tier``; see the module doc."""

    def __init__(self, tier: NodeHost) -> None:
        self.t = tier
        #: cluster primaries' health, by node name
        self.health: dict[str, Health] = {}
        #: fetch the cluster's slot map again before the next sweep
        self.refresh_slots = False

    def routes(self, rkeys: Sequence[bytes]) -> list[Route]:
        """``(health, connection pool, positions)`` per node that holds the keys' slots: the
        tier's health for a single server, the node's own in a cluster."""
        client = self.t._get_client()
        if not self.t.cluster:
            return [(self.t._health, client.connection_pool, list(range(len(rkeys))))]
        nodes = client.nodes_manager
        slot_of = client.keyslot
        groups: dict[str, Route] = {}
        for i, rk in enumerate(rkeys):
            node = nodes.get_node_from_slot(slot_of(rk))
            entry = groups.get(node.name)
            if entry is None:
                pool = client.get_redis_connection(node).connection_pool
                positions: list[int] = []
                entry = groups[node.name] = (self.node_health(node.name), pool, positions)
            entry[2].append(i)
        return list(groups.values())

    def node_health(self, name: str) -> Health:
        """The up/down state of one cluster node: a dead primary misses its own slots only."""
        health = self.health.get(name)
        if health is None:
            with self.t._client_lock:
                health = self.health.setdefault(name, Health(f"{self.t.url} node {name}", kind=self.t.name))
        return health

    def healths(self) -> list[Health]:
        return [self.t._health, *self.health.values()]

    def note_failure(self, exc: BaseException) -> None:
        if isinstance(exc, (Down, *DOWN_ERRORS)):
            self.refresh_slots = self.t.cluster  # after a failover the next sweep finds the new primary
        elif isinstance(exc, (MovedError, AskError, TryAgainError, ClusterDownError)):
            self.refresh_slots = True

    def each(self, listing: Callable[[Any], Iterable[T]], *, parallel: bool = False) -> Iterator[T]:
        """``listing(client)`` on each primary (the server's own client, or each cluster
        primary's): in turn, or with ``parallel`` on a thread per primary (each is a process of
        its own; each primary's items come as they are listed: ``interleaved``). A dead primary is skipped
        (its keys drop out of the index: they miss anyway); a pool with no connection to spare
        skips the round."""
        try:
            client = self.t._get_client()
            nodes: list[tuple[Health | None, Any]]
            if self.t.cluster:
                if self.refresh_slots:
                    self.refresh_slots = False
                    client.nodes_manager.initialize()
                healths = [(self.node_health(n.name), n) for n in client.get_primaries()]
                nodes = [(health, client.get_redis_connection(n)) for health, n in healths if health.allow()]
            else:
                nodes = [(None, client)]
            if parallel and len(nodes) > 1:  # each primary's items as they come
                yield from interleaved([partial(self._one, health, node, listing) for health, node in nodes], f"kvtier-{self.t.name}-scan")
            else:
                for health, node in nodes:
                    yield from self._one(health, node, listing)
        except MaxConnectionsError as exc:  # back-pressure: the index stays as it is until the next round
            counts_add(self.t._gate, "busy", 1)
            raise SweepSkipped(f"no connection to spare: {exc}") from exc

    def _one(self, health: Health | None, node: Any, listing: Callable[[Any], Iterable[T]]) -> Iterator[T]:
        """``listing(node)``; a cluster primary that fails is marked down and lists no more."""
        try:
            yield from listing(node)
        except MaxConnectionsError:
            raise  # the pool is busy, not the node down: skip this round (each)
        except DOWN_ERRORS as exc:
            if health is None:
                raise
            health.failed(exc)
            self.refresh_slots = True
            return
        if health is not None and health.succeeded() and self.t.view is not None:
            self.t.view.wake()
