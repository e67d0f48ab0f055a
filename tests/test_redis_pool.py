"""A redis tier's connection pool: sized so one store and one load fit with the index sweep
(checked at construction), and an exhausted pool is back-pressure, never an outage.

Against a real private server (tests/redis_servers.py); see backends/redis_pool.py.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from kvtier.backends import redis_tier
from kvtier.backends.redis_pool import JOBS_IN_FLIGHT, SWEEP_CONNECTIONS, ConnectionBudget
from kvtier.backends.redis_tier import RedisBackend
from kvtier.backends.redis_wire import PUT_CONNECTIONS, Wire
from redis_servers import RedisServer, open_redis_tier

from kvtier.errors import ConfigError
from kvtier.testing import make_key, random_block

LARGE = 512 << 10  # at least _STRIPE_MIN_BYTES: a load is striped over the put's connections


def _open(block: int = LARGE, **options: Any) -> RedisBackend:
    backend: RedisBackend = open_redis_tier(b"redis-pool", block, **options)
    return backend


def _close(backend: RedisBackend) -> None:
    asyncio.run(backend.aclose())


def _up_and_never_down(backend: RedisBackend) -> None:
    stats = backend.stats()
    assert stats["up"] is True and stats["outages"] == 0 and stats["connection_errors"] == 0, stats


# -- the invariant ----------------------------------------------------------------------------
@pytest.mark.parametrize("cpus", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("job_connections", ["auto", 1, 2, 3, 4, 8])
@pytest.mark.parametrize("max_connections", [3, 4, 5, 8, 9, 16, 17, 32, 64])
def test_one_store_and_one_load_always_fit_with_the_sweep(max_connections: int, job_connections: Any, cpus: int) -> None:
    """Every accepted pair of settings gives shares, put connections, stripes and I/O threads
    under which a store and a load at their widest, and the sweep, fit in the pool."""
    try:
        budget = ConnectionBudget.of(max_connections, job_connections, cpus)
    except ConfigError as exc:
        assert job_connections != "auto"
        assert JOBS_IN_FLIGHT * job_connections + SWEEP_CONNECTIONS > max_connections
        assert "job_connections" in str(exc) and "max_connections" in str(exc)
        return
    widest = JOBS_IN_FLIGHT * budget.job_connections * max(budget.put_connections, budget.stripes)
    assert budget.per_node == widest + SWEEP_CONNECTIONS <= max_connections
    assert 1 <= budget.put_connections <= PUT_CONNECTIONS
    if job_connections != "auto":
        assert budget.job_connections == job_connections
    for nodes in (1, 3):
        # every share but each job's first (on its calling thread), of both jobs at once
        assert budget.io_threads(nodes) == JOBS_IN_FLIGHT * (nodes * budget.job_connections - 1)


@pytest.mark.parametrize("max_connections", [1, 2])
def test_a_pool_too_small_for_a_store_and_a_load_is_refused(max_connections: int) -> None:
    with pytest.raises(ConfigError, match=r"max_connections: .* one store and one load"):
        RedisBackend(capacity="1MiB", max_connections=max_connections, job_connections=1)


def test_a_refusal_names_both_fields_and_a_way_out() -> None:
    with pytest.raises(ConfigError, match=r"job_connections: 4 with max_connections 8 .* raise max_connections to 9 or lower job_connections to 3"):
        RedisBackend(capacity="1MiB", max_connections=8, job_connections=4)


# -- against a server -------------------------------------------------------------------------
class _Hold:
    """Holds a put (``send_one_each``) and a load (its first ``Wire.send``) once each has taken
    its connections, until ``go`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.write_in, self.read_in, self.go = threading.Event(), threading.Event(), threading.Event()
        send_one_each, send = redis_tier.send_one_each, Wire.send

        def held_put(*args: Any) -> Any:
            self.write_in.set()
            self.go.wait(30)
            return send_one_each(*args)

        def held_send(wire: Wire, buffers: Any) -> None:
            if threading.current_thread().name == "load" and not self.read_in.is_set():
                self.read_in.set()
                self.go.wait(30)
            send(wire, buffers)

        monkeypatch.setattr(redis_tier, "send_one_each", held_put)
        monkeypatch.setattr(Wire, "send", held_send)


def test_a_store_and_a_load_in_flight_leave_the_index_sweep_a_connection(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_connections`` 8 with ``job_connections`` 1 (what ``auto`` gives on 2 CPUs): a put
    and a striped load of large records at their widest, and a sweep in between, find the
    server up; nothing is counted as an outage."""
    backend = _open(url=redis_server.url, prefix="pool-fit", max_connections=8, job_connections=1)
    try:
        n = 8
        old = [make_key(i) for i in range(n)]
        new = [make_key(100 + i) for i in range(n)]
        old_data = [random_block(LARGE, i) for i in range(n)]
        new_data = [random_block(LARGE, 100 + i) for i in range(n)]
        assert None not in backend.write_blocks(old, old_data)
        hold = _Hold(monkeypatch)
        results: dict[str, Any] = {}
        out = [torch.zeros(LARGE, dtype=torch.uint8) for _ in range(n)]
        writer = threading.Thread(target=lambda: results.update(put=backend.write_blocks(new, new_data)), name="store")
        reader = threading.Thread(target=lambda: results.update(got=backend.read_blocks(old, out)), name="load")
        writer.start()
        reader.start()
        try:
            assert hold.write_in.wait(30) and hold.read_in.wait(30)
            listed = {info.key for info in backend.scan()}  # the sweep, with both jobs at their widest
        finally:
            hold.go.set()
            writer.join()
            reader.join()
        assert set(old) <= listed
        assert None not in results["put"] and results["got"] == [True] * n
        assert all(torch.equal(a, b) for a, b in zip(out, old_data))
        _up_and_never_down(backend)
    finally:
        _close(backend)


def test_an_exhausted_pool_is_waited_for_not_an_outage(redis_server: RedisServer) -> None:
    backend = _open(url=redis_server.url, prefix="pool-wait", max_connections=8, job_connections=1)
    pool = backend._get_client().connection_pool
    held = [pool.get_connection() for _ in range(8)]  # every connection out
    try:
        keys = [make_key(200 + i) for i in range(4)]
        data = [random_block(LARGE, 200 + i) for i in range(4)]
        # A connection comes back a moment later, well within the wait (one socket timeout, 5 s).
        timer = threading.Timer(0.2, pool.release, args=(held.pop(),))
        timer.start()
        sizes = backend.write_blocks(keys, data)
        timer.join()
        assert None not in sizes
        _up_and_never_down(backend)
        assert backend.stats()["pool_waits"] == 1 and backend.stats()["pool_busy"] == 0
        out = [torch.zeros(LARGE, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * len(keys)
        assert all(torch.equal(a, b) for a, b in zip(out, data))
    finally:
        for conn in held:
            pool.release(conn)
        _close(backend)


def test_a_pool_that_stays_exhausted_fails_the_job_cleanly_and_the_tier_stays_up(redis_server: RedisServer) -> None:
    backend = _open(url=redis_server.url, prefix="pool-busy", max_connections=8, job_connections=1, socket_timeout_s=0.3)
    pool = backend._get_client().connection_pool
    held = [pool.get_connection() for _ in range(8)]
    keys = [make_key(300 + i) for i in range(4)]
    data = [random_block(LARGE, 300 + i) for i in range(4)]
    try:
        assert backend.write_blocks(keys, data) == [None] * len(keys)  # no connection came back
        assert list(backend.scan()) == []  # a sweep skipped for want of a connection
        _up_and_never_down(backend)
        assert backend.stats()["pool_busy"] == 2
        for conn in held:
            pool.release(conn)
        held = []
        # No backoff to wait out: the next job runs at once.
        assert None not in backend.write_blocks(keys, data)
        assert {info.key for info in backend.scan()} >= set(keys)
    finally:
        for conn in held:
            pool.release(conn)
        _close(backend)
