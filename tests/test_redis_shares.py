"""A redis tier job on several connections at once, and raw payloads checksummed as they land.

Against real private servers (tests/redis_servers.py). Every fast path is compared with the
general one: a job cut into shares on ``job_connections`` connections against the same job on
one connection, and the piecewise checksum of a received payload against the whole-buffer one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import pytest
import redis
import torch
from kvtier.backends.redis_tier import RedisBackend
from kvtier.backends.redis_wire import RECV_PIECE, Wire
from kvtier.backends.remote_shares import SHARE_MIN_BYTES, run_all, split_shares
from redis_servers import RedisClusterServers, RedisServer, open_redis_tier

from kvtier.errors import ConfigError
from kvtier.records.format import HEADER
from kvtier.testing import make_key, random_block

BLOCK = 64 << 10
BIG = 2 * RECV_PIECE + 4096  # a payload received in several pieces
MAC = "a-fleet-wide-secret-of-32-bytes!"


def _open(block: int = BLOCK, **options: Any) -> RedisBackend:
    backend: RedisBackend = open_redis_tier(b"redis-shares", block, **options)
    return backend


def _close(backend: RedisBackend) -> None:
    asyncio.run(backend.aclose())


def _empty(n: int, block: int = BLOCK) -> list[torch.Tensor]:
    return [torch.zeros(block, dtype=torch.uint8) for _ in range(n)]


class _Borrows:
    """Counts the connections a pool hands out (one per exchange)."""

    def __init__(self, pool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.threads: set[int] = set()
        real = pool.get_connection

        def get_connection(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            self.threads.add(threading.get_ident())
            return real(*args, **kwargs)

        monkeypatch.setattr(pool, "get_connection", get_connection)


# -- the pieces ------------------------------------------------------------------------------------

def test_split_shares_keeps_the_order_and_never_cuts_below_the_floor() -> None:
    positions = list(range(100, 150))
    per_record = SHARE_MIN_BYTES // 8  # 8 records fill a share's floor
    shares = split_shares(positions, per_record, 4)
    assert len(shares) == 4 and [p for s in shares for p in s] == positions
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert split_shares(positions[:15], per_record, 4) == [positions[:15]]  # not two shares' worth
    assert len(split_shares(positions[:16], per_record, 4)) == 2
    assert split_shares(positions, per_record, 1) == [positions]
    assert split_shares(positions, 0, 4) == [positions]  # deletes: no bytes to speak of
    assert split_shares([7], SHARE_MIN_BYTES * 9, 4) == [[7]]
    assert split_shares([], per_record, 4) == [[]]


def test_run_all_waits_for_every_call_even_when_the_first_one_raises() -> None:
    ended: list[int] = []

    def slow(i: int) -> int:
        time.sleep(0.2)
        ended.append(i)
        return i

    def boom() -> int:
        raise RuntimeError("first share")

    with ThreadPoolExecutor(3) as threads:
        assert run_all(threads, [lambda: 0, lambda: slow(1), lambda: slow(2)]) == [0, 1, 2]
        ended.clear()
        with pytest.raises(RuntimeError, match="first share"):
            run_all(threads, [boom, lambda: slow(1), lambda: slow(2)])
        assert sorted(ended) == [1, 2]  # both had ended before the error came out
    assert run_all(None, [lambda: 1, lambda: 2]) == [1, 2]


class _RefusesAfter(Executor):
    """A pool that takes the first ``accepts`` calls and then refuses (``queue_then_raise``: queues
    the call and raises anyway, as a pool that could not start a thread does)."""

    def __init__(self, real: ThreadPoolExecutor, accepts: int, error: Exception, *, queue_then_raise: bool = False) -> None:
        self.real, self.accepts, self.error, self.queue_then_raise = real, accepts, error, queue_then_raise

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self.accepts > 0:
            self.accepts -= 1
            return self.real.submit(fn, *args, **kwargs)
        if self.queue_then_raise:
            self.real.submit(fn, *args, **kwargs)
        raise self.error


def test_run_all_runs_the_calls_a_shut_down_pool_refuses_on_this_thread() -> None:
    """At interpreter exit every pool refuses work; the write must still happen, here."""
    threads = ThreadPoolExecutor(3)
    threads.shutdown()
    ran_on: list[tuple[int, int]] = []
    calls = [lambda i=i: ran_on.append((i, threading.get_ident())) or i for i in range(4)]  # type: ignore[func-returns-value]
    assert run_all(threads, calls) == [0, 1, 2, 3]
    assert ran_on == [(i, threading.get_ident()) for i in range(4)]


@pytest.mark.parametrize("error", [RuntimeError("cannot schedule new futures after shutdown"), OSError("no thread")])
def test_run_all_waits_for_a_running_share_when_a_later_hand_over_fails(error: Exception) -> None:
    ended: list[int] = []

    def slow(i: int) -> int:
        time.sleep(0.3)
        ended.append(i)
        return i

    with ThreadPoolExecutor(3) as real:
        out = run_all(_RefusesAfter(real, 1, error), [lambda: 0, lambda: slow(1), lambda: slow(2), lambda: 3])
        assert sorted(ended) == [1, 2]  # the pooled share had ended before run_all returned
        assert out == [0, 1, 2, 3]


def test_run_all_runs_each_call_once_when_a_refusing_pool_ran_it_anyway() -> None:
    runs = [0, 0, 0]
    lock = threading.Lock()

    def count(i: int) -> int:
        time.sleep(0.05)
        with lock:
            runs[i] += 1
        return i

    with ThreadPoolExecutor(2) as real:
        pool = _RefusesAfter(real, 0, RuntimeError("can't start new thread"), queue_then_raise=True)
        assert run_all(pool, [lambda i=i: count(i) for i in range(3)]) == [0, 1, 2]  # type: ignore[misc]
    assert runs == [1, 1, 1]


@pytest.mark.parametrize("buffered", [0, 5, 4096])
@pytest.mark.parametrize("size", [1000, RECV_PIECE, BIG])
def test_read_into_hands_over_every_piece_in_order_and_none_larger_than_a_piece(buffered: int, size: int) -> None:
    payload = bytes(random_block(size, size + buffered).numpy())
    a, b = socket.socketpair()
    try:
        b.settimeout(10)
        wire = Wire(b)
        line = b"$%d\r\n" % size
        first = min(buffered, size)
        a.sendall(line + payload[:first])  # the length line and what the read buffer catches of the value

        def rest() -> None:
            for i in range(first, size, 9973):  # odd sizes, so pieces straddle every boundary
                a.sendall(payload[i : i + 9973])

        sender = threading.Thread(target=rest)
        sender.start()
        if first:
            time.sleep(0.05)  # let the buffered part arrive with the line
        assert wire.bulk_length() == size
        out = bytearray(size)
        pieces: list[bytes] = []
        wire.read_into(memoryview(out), lambda piece: pieces.append(bytes(piece)))
        sender.join()
        assert b"".join(pieces) == payload == bytes(out)
        assert max(map(len, pieces)) <= max(RECV_PIECE, first)
        plain = bytearray(size)  # the general path: no update, the same bytes
        sender = threading.Thread(target=a.sendall, args=(payload,))
        sender.start()
        wire.read_into(memoryview(plain))
        sender.join()
        assert bytes(plain) == payload
    finally:
        a.close()
        b.close()


# -- a job on several connections ------------------------------------------------------------------

def _plant(client: redis.Redis, backend: RedisBackend, keys: list[bytes], data: list[torch.Tensor]) -> list[bool]:
    """Write ``data`` and spoil some records in place; the found list a read must give."""
    assert all(s is not None for s in backend.write_blocks(keys, data))
    rk = [backend._rkey(k) for k in keys]
    flipped = bytearray(client.get(rk[3]))
    flipped[HEADER.size] ^= 0x01  # the payload's first byte
    client.set(rk[3], bytes(flipped))
    flipped = bytearray(client.get(rk[20]))
    flipped[-1] ^= 0x80  # its last byte
    client.set(rk[20], bytes(flipped))
    client.delete(rk[33])  # gone (evicted, say)
    client.delete(rk[40])
    client.rpush(rk[40], b"not a record")  # WRONGTYPE
    newer = bytearray(client.get(rk[50]))
    newer[4] = 99  # a record version from the future
    client.set(rk[50], bytes(newer))
    client.set(rk[60], bytes(client.get(rk[61])))  # a record copied under another key
    return [i not in (3, 20, 33, 40, 50, 60) for i in range(len(keys))]


def test_a_large_job_runs_on_several_connections_and_reads_what_one_connection_reads(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = _open(url=redis_server.url, prefix="shares-many", job_connections=4)
    single = _open(url=redis_server.url, prefix="shares-many", job_connections=1)
    client = redis.Redis.from_url(redis_server.url)
    try:
        n = 64  # 4 MiB of 64 KiB records: four shares of 1 MiB
        keys = [make_key(9000 + i) for i in range(n)]
        data = [random_block(BLOCK, i) for i in range(n)]
        borrows = _Borrows(shared._get_client().connection_pool, monkeypatch)
        one = _Borrows(single._get_client().connection_pool, monkeypatch)
        outcome = []
        for backend, counter in ((shared, borrows), (single, one)):
            want = _plant(client, backend, keys, data)
            counter.count = 0
            out = _empty(n)
            found = backend.read_blocks(keys, out)
            assert found == want
            assert all(torch.equal(out[i], data[i]) for i in range(n) if want[i])
            outcome.append((found, counter.count, len(counter.threads)))
            # the bad records were deleted, the unreadable ones kept and remembered, by both paths
            assert client.exists(*(backend._rkey(keys[i]) for i in (3, 20, 60))) == 0
            assert client.exists(backend._rkey(keys[40]), backend._rkey(keys[50])) == 2
            assert set(backend._unreadable) == {keys[40], keys[50]}
        (found_shared, used_shared, threads_shared), (found_single, used_single, threads_single) = outcome
        assert found_shared == found_single
        # the read's exchanges, then one to delete the bad records: 4 shares at once, on the I/O threads too
        assert used_shared == 4 + 1 and threads_shared > 1
        assert used_single == 1 + 1 and threads_single == 1
        for backend in (shared, single):
            stats = backend.stats()
            assert stats["corrupt_records"] == 3 and stats["blocks_read"] == n - 6
        assert shared.stats()["read_misses"] == single.stats()["read_misses"] == 3
    finally:
        client.close()
        _close(shared)
        _close(single)


@pytest.mark.redis_only  # kvtier's own share machinery, slow; the server side runs on both kinds elsewhere
def test_a_write_from_an_exit_hook_stores_every_share(redis_server: RedisServer) -> None:
    """At interpreter exit the tier's I/O threads refuse work: a close-time write-back from an
    ``atexit`` hook (vLLM's finalizer) runs every share on the calling thread and stores them all."""
    tests = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(
        f"""
        import atexit, sys
        sys.path.insert(0, {tests!r})
        from redis_servers import open_redis_tier
        from kvtier.testing import make_key, random_block

        backend = open_redis_tier(b"redis-shares", {BLOCK}, url={redis_server.url!r}, prefix="shares-exit", job_connections=4)

        def bye():
            sizes = backend.write_blocks([make_key(7000 + i) for i in range(64)], [random_block({BLOCK}, i) for i in range(64)])
            print("written", sum(s is not None for s in sizes))

        atexit.register(bye)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip() == "written 64"  # 4 MiB: four shares, three of them refused by the pool
    backend = _open(url=redis_server.url, prefix="shares-exit", job_connections=1)
    try:
        out = _empty(64)
        assert backend.read_blocks([make_key(7000 + i) for i in range(64)], out) == [True] * 64
        assert all(torch.equal(out[i], random_block(BLOCK, i)) for i in range(64))
    finally:
        _close(backend)


def test_a_small_job_stays_on_the_calling_thread(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(url=redis_server.url, prefix="shares-small", job_connections=4)
    try:
        keys = [make_key(i) for i in range(8)]  # 512 KiB: below a share's floor
        data = [random_block(BLOCK, i) for i in range(8)]
        borrows = _Borrows(backend._get_client().connection_pool, monkeypatch)
        assert all(s is not None for s in backend.write_blocks(keys, data))
        out = _empty(8)
        assert backend.read_blocks(keys, out) == [True] * 8
        # one share each: the put's connections (one SET in flight on each), the read's one
        assert backend.budget.put_connections == 3  # (32 - the sweep's 1) // (2 jobs x 4)
        assert borrows.count == backend.budget.put_connections + 1 and borrows.threads == {threading.get_ident()}
        assert all(torch.equal(a, b) for a, b in zip(out, data))
    finally:
        _close(backend)


def test_a_dead_server_fails_every_share_cleanly_and_counts_one_outage(own_redis_server: RedisServer) -> None:
    backend = _open(url=own_redis_server.url, prefix="shares-dead", job_connections=4, socket_timeout_s=1.0, connect_timeout_s=0.5)
    try:
        n = 64
        keys = [make_key(i) for i in range(n)]
        data = [random_block(BLOCK, i) for i in range(n)]
        assert all(s is not None for s in backend.write_blocks(keys, data))
        own_redis_server.kill()
        out = _empty(n)
        assert backend.read_blocks(keys, out) == [False] * n
        stats = backend.stats()
        # four shares failed, the server went down once: one error, one outage, one backoff step
        assert stats["up"] is False and stats["outages"] == 1 and stats["connection_errors"] == 1
        assert backend.write_blocks(keys, data) == [None] * n  # inside the backoff: no network wait
        assert backend.stats()["fast_failures"] == n
    finally:
        _close(backend)


@pytest.mark.redis_only  # kvtier's own share machinery, slow; the server side runs on both kinds elsewhere
def test_big_records_are_checked_piece_by_piece_plain_and_keyed(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    for options in ({}, {"mac_key": MAC}, {"mac_key": MAC, "mac_algorithm": "hmac-sha256"}):
        backend = _open(BIG, url=redis_server.url, prefix="shares-big", **options)
        try:
            n = 8
            keys = [make_key(500 + i) for i in range(n)]
            data = [random_block(BIG, i) for i in range(n)]
            assert all(s is not None for s in backend.write_blocks(keys, data))
            head = HEADER.size + (32 if options else 0)
            for i, where in ((1, head), (2, head + RECV_PIECE - 1), (3, head + RECV_PIECE), (4, head + BIG - 1)):
                value = bytearray(client.get(backend._rkey(keys[i])))
                value[where] ^= 0x10  # the first byte, both sides of a piece boundary, the last
                client.set(backend._rkey(keys[i]), bytes(value))
            out = _empty(n, BIG)
            assert backend.read_blocks(keys, out) == [True, False, False, False, False, True, True, True], options
            assert all(torch.equal(out[i], data[i]) for i in (0, 5, 6, 7))
            assert backend.stats()["corrupt_records"] == 4
            backend.delete_blocks(keys)
        finally:
            _close(backend)
    client.close()


@pytest.mark.redis_only  # kvtier's own share machinery, slow; the server side runs on both kinds elsewhere
def test_a_cluster_job_runs_in_shares_on_every_primary(redis_cluster: RedisClusterServers) -> None:
    shared = _open(url=redis_cluster.url, cluster=True, prefix="shares-cluster", job_connections=4)
    single = _open(url=redis_cluster.url, cluster=True, prefix="shares-cluster", job_connections=1)
    try:
        n = 192  # 12 MiB over three primaries: several shares on each
        keys = [make_key(3000 + i) for i in range(n)]
        data = [random_block(BLOCK, i) for i in range(n)]
        assert all(s is not None for s in shared.write_blocks(keys, data))
        for backend in (shared, single):
            out = _empty(n)
            assert backend.read_blocks(keys, out) == [True] * n
            assert all(torch.equal(a, b) for a, b in zip(out, data))
        shared.delete_blocks(keys)
        assert single.read_blocks(keys, _empty(n)) == [False] * n
    finally:
        _close(shared)
        _close(single)


@pytest.mark.parametrize("value", [0, 33, True, 2.0])
def test_job_connections_must_be_a_count_within_max_connections(value: Any) -> None:
    with pytest.raises(ConfigError, match="job_connections"):
        RedisBackend(capacity="1MiB", max_connections=32, job_connections=value)


def test_job_connections_round_trips_through_the_config() -> None:
    backend = RedisBackend(capacity="1MiB", job_connections=2)
    assert backend.to_dict()["job_connections"] == 2
    assert RedisBackend.from_dict(backend.to_dict()).job_connections == 2



def test_job_connections_auto_is_half_the_cpus_from_one_to_four(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.backends import remote_shares

    assert [remote_shares.auto_job_connections(c) for c in (1, 2, 3, 4, 8, 64)] == [1, 1, 1, 2, 4, 4]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert RedisBackend(capacity="1MiB").job_connections == 4  # the default is auto
    assert RedisBackend(capacity="1MiB", max_connections=5).job_connections == 2  # a store and a load fit, with the sweep
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    backend = RedisBackend(capacity="1MiB", job_connections="auto")
    assert backend.job_connections == 1
    assert backend.to_dict()["job_connections"] == "auto"
    assert RedisBackend.from_dict(backend.to_dict()).job_connections_setting == "auto"


@pytest.mark.parametrize("value", ["many", "4", None])
def test_job_connections_other_words_are_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="job_connections: expected 'auto'"):
        RedisBackend(capacity="1MiB", job_connections=value)
