"""How many connections a redis tier borrows from each node's pool, and what it does when the
pool has none to give.

:class:`ConnectionBudget` sizes every use of a node's pool from the two settings
(``max_connections``, ``job_connections``), and checks them once, at construction:

* a job's records on a node are cut into up to ``job_connections`` shares
  (:mod:`kvtier.backends.remote_shares`);
* a put share keeps one ``SET`` in flight on each of up to ``put_connections`` connections, and
  a get share of large records is striped over as many (``stripes``);
* the index sweep (``SCAN``) takes one more;
* the tier's I/O threads run every share but the first of each job (that one runs on the
  calling thread).

The invariant: one store and one load in flight at once (the transfer engine's tier-write and
load threads), each at its widest, together with the sweep, fit in ``max_connections``::

    JOBS_IN_FLIGHT × job_connections × put_connections + SWEEP_CONNECTIONS <= max_connections

and the I/O threads run both jobs' shares at once. ``put_connections`` is the largest count (at
most :data:`kvtier.backends.redis_wire.PUT_CONNECTIONS`) that keeps it; settings that cannot
keep it even with one connection per share are a :class:`~kvtier.errors.ConfigError` naming
both fields.

Anything past that (a third caller, connections redis-py holds a moment longer) is
back-pressure, not an outage: :class:`PoolGate` waits for a connection to come back, bounded by
the socket timeout, and a share that still gets none fails its records (a failed write, a load
miss; counted in ``pool_busy``) without marking the server down.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from kvtier.backends.redis_wire import PUT_CONNECTIONS
from kvtier.backends.remote_health import Busy
from kvtier.backends.remote_shares import auto_job_connections
from redis.exceptions import MaxConnectionsError

from kvtier.errors import ConfigError
from kvtier.records.counts import counts_add

__all__ = ["JOBS_IN_FLIGHT", "SWEEP_CONNECTIONS", "ConnectionBudget", "PoolBusy", "PoolGate"]

#: Jobs of one tier that run at once: a store (the tier-write thread) and a load.
JOBS_IN_FLIGHT = 2
#: Connections the index sweep holds (one ``SCAN`` at a time).
SWEEP_CONNECTIONS = 1
#: How often a waiting share looks at the pool again when no release wakes it (connections
#: redis-py's own commands return, such as the sweep's, give no notice).
_POLL_S = 0.01


@dataclass(frozen=True, slots=True)
class ConnectionBudget:
    """The connections and threads a redis tier uses per node; see the module doc."""

    max_connections: int
    job_connections: int
    #: connections per put share (one ``SET`` in flight on each)
    put_connections: int

    @property
    def stripes(self) -> int:
        """Connections a get share of large records is striped over."""
        return self.put_connections

    @property
    def per_node(self) -> int:
        """The most connections the tier holds on one node: one store, one load, the sweep."""
        return JOBS_IN_FLIGHT * self.job_connections * self.put_connections + SWEEP_CONNECTIONS

    def io_threads(self, nodes: int) -> int:
        """Threads that run the shares of one store and one load at once on ``nodes`` primaries
        (each job's first share runs on its calling thread)."""
        return JOBS_IN_FLIGHT * (nodes * self.job_connections - 1)

    @classmethod
    def of(cls, max_connections: Any, job_connections: Any, cpus: int | None = None) -> ConnectionBudget:
        """Check the two settings and size the rest; ``job_connections: auto`` is
        :func:`~kvtier.backends.remote_shares.auto_job_connections` of ``cpus``, lowered to what
        ``max_connections`` holds."""
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ConfigError(f"max_connections: expected a positive integer, got {max_connections!r}")
        widest = (max_connections - SWEEP_CONNECTIONS) // JOBS_IN_FLIGHT  # job_connections with one put connection
        if widest < 1:
            raise ConfigError(
                f"max_connections: {max_connections} cannot hold one store and one load in flight with the index "
                f"sweep (at least {JOBS_IN_FLIGHT + SWEEP_CONNECTIONS} connections per node)"
            )
        if job_connections == "auto":
            jobs = min(widest, auto_job_connections(cpus))
        elif isinstance(job_connections, bool) or not isinstance(job_connections, int) or job_connections < 1:
            raise ConfigError(f"job_connections: expected 'auto' or a positive integer, got {job_connections!r}")
        elif job_connections > widest:
            need = JOBS_IN_FLIGHT * job_connections + SWEEP_CONNECTIONS
            raise ConfigError(
                f"job_connections: {job_connections} with max_connections {max_connections} leaves no room for one store "
                f"and one load in flight with the index sweep ({JOBS_IN_FLIGHT} x {job_connections} + {SWEEP_CONNECTIONS} "
                f"= {need} connections per node); raise max_connections to {need} or lower job_connections to {widest}"
            )
        else:
            jobs = job_connections
        put = max(1, min(PUT_CONNECTIONS, (max_connections - SWEEP_CONNECTIONS) // (JOBS_IN_FLIGHT * jobs)))
        return cls(max_connections, jobs, put)


class PoolBusy(Busy):
    """No connection came back to a node's pool within the wait: back-pressure, not an outage."""


class PoolGate:
    """Borrows connections from redis-py pools, waiting (bounded) when a pool is exhausted.

    redis-py's ``ConnectionPool`` raises ``MaxConnectionsError`` at once when every connection
    is out; that is the tier's own load, not a dead server. ``borrow`` waits for one to be
    returned (``returned`` wakes it; it also looks again every few milliseconds) for at most
    ``wait_s``, then raises :class:`PoolBusy`."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._returned = threading.Condition()
        #: shares that waited for a connection, and those that got none in time
        self.waits = 0
        self.busy = 0

    def borrow(self, pool: Any) -> Any:
        try:
            return pool.get_connection()
        except MaxConnectionsError:
            pass
        counts_add(self, "waits", 1)  # (shares on threads of their own: no add lost)
        deadline = time.monotonic() + self.wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                counts_add(self, "busy", 1)
                raise PoolBusy(f"no connection came back to the pool within {self.wait_s:g} s")
            with self._returned:
                self._returned.wait(min(left, _POLL_S))
            try:
                return pool.get_connection()
            except MaxConnectionsError:
                continue

    def returned(self) -> None:
        """Connections went back to a pool: wake the shares waiting for one."""
        with self._returned:
            self._returned.notify_all()
