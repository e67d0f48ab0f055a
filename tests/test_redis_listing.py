"""The redis tier's listing at scale: ``SCAN`` parsed a reply at a time, a fixed-size index, and
a shared index view that keeps no key set of its own.

Against real private servers (tests/redis_servers.py); the reply parser's error paths against
bytes written into a socket pair (a server cannot be made to send a malformed reply).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from typing import Any

import pytest
import redis
import torch
from kvtier.backends import redis_tier
from kvtier.backends.redis_scan import record_pattern, scan_block_keys, scan_command
from kvtier.backends.redis_tier import RedisBackend
from kvtier.backends.redis_wire import Wire
from redis_servers import RedisClusterServers, RedisServer, open_redis_tier

import kvtier
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key, random_block

BLOCK = 1024

# Keys whose bytes look like RESP or glob syntax: the parser and the pattern must not care.
ODD_KEYS = [b"\r\n" * 16, b"$32\r\n" + b"?" * 27, b"*" * 32, b"[a-z]\\" + b"\x00" * 26, b"\xff" * 31 + b"\n"]


def _open(namespace: bytes, url: str, **options: Any) -> RedisBackend:
    backend: RedisBackend = open_redis_tier(namespace, BLOCK, url=url, **options)
    return backend


def _close(backend: RedisBackend) -> None:
    asyncio.run(backend.aclose())


def _fast(backend: RedisBackend) -> list[bytes]:
    batches = backend._list_block_keys()
    assert batches is not None
    return [key for batch in batches for key in batch]


def _general(backend: RedisBackend) -> set[bytes]:
    return {key for key in map(backend.block_key, backend._list_keys()) if key is not None}


def _write(backend: RedisBackend, keys: list[bytes]) -> None:
    assert all(s is not None for s in backend.write_blocks(keys, [random_block(BLOCK, i) for i in range(len(keys))]))


def test_the_bulk_listing_lists_what_the_general_one_does(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Record keys only (not the meta record, the feed, tags, other namespaces' records or junk
    of any length under the prefix), odd bytes included, over many pipelined SCAN steps."""
    monkeypatch.setattr(redis_tier, "SCAN_COUNT", 7)  # many steps, each answered while the last is parsed
    backend = _open(b"redis-listing", redis_server.url)
    other = _open(b"redis-listing-other", redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = [make_key(i) for i in range(300)] + ODD_KEYS
        _write(backend, keys)
        _write(other, [make_key(i) for i in range(1000, 1050)])
        prefix = backend._prefix_bytes
        for junk in (prefix + b"x" * 31, prefix + b"y" * 33, prefix + b"z", prefix[:-1] + b"!" + b"k" * 32):
            client.set(junk, b"junk")
        backend.write_tags([(keys[0], "tenant-a")], [(keys[1], True)])
        fast = _fast(backend)
        assert set(fast) == _general(backend) == set(keys)
        assert len(fast) >= len(keys)  # SCAN may list a key twice, never leave one out
        assert sorted(backend.scan_columns().keys) == sorted(keys)
        # Every reply was read: the connection went back to the pool usable.
        out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(3)]
        assert backend.read_blocks(keys[:3], out) == [True] * 3
        assert all(torch.equal(o, random_block(BLOCK, i)) for i, o in enumerate(out))
    finally:
        client.close()
        _close(other)
        _close(backend)


def test_the_bulk_listing_of_a_cluster_covers_every_primary(redis_cluster: RedisClusterServers) -> None:
    backend = _open(b"redis-listing-cluster", redis_cluster.url, cluster=True)
    try:
        keys = [make_key(i) for i in range(200)] + ODD_KEYS
        _write(backend, keys)
        assert set(_fast(backend)) == _general(backend) == set(keys)
    finally:
        _close(backend)


def test_an_empty_namespace_lists_nothing(redis_server: RedisServer) -> None:
    backend = _open(b"redis-listing-empty", redis_server.url)
    try:
        assert _fast(backend) == [] and len(backend.scan_columns()) == 0
    finally:
        _close(backend)


# -- the reply parser ------------------------------------------------------------------------------

PREFIX = b"kv:0123456789abcdef:"


def _row(key: bytes, prefix: bytes = PREFIX) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(prefix) + len(key), prefix + key)


def _reply(cursor: bytes, rows: list[bytes]) -> bytes:
    return b"*2\r\n$%d\r\n%b\r\n*%d\r\n" % (len(cursor), cursor, len(rows)) + b"".join(rows)


def _parse(replies: bytes) -> tuple[list[list[bytes]], bytes]:
    """What ``scan_block_keys`` yields from ``replies``, and every request it sent."""
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(replies)
        wire = Wire(ours)
        got = list(scan_block_keys(wire, PREFIX, 32, 5))
        assert wire.drained
        ours.shutdown(socket.SHUT_WR)
        sent = b""
        while chunk := theirs.recv(1 << 16):
            sent += chunk
        return got, sent
    finally:
        ours.close()
        theirs.close()


def test_the_parser_cuts_keys_and_sends_each_cursor_back() -> None:
    keys = [bytes([i]) * 32 for i in range(7)] + ODD_KEYS
    replies = _reply(b"17", [_row(k) for k in keys[:4]]) + _reply(b"3", []) + _reply(b"0", [_row(k) for k in keys[4:]])
    got, sent = _parse(replies)
    assert got == [keys[:4], keys[4:]]
    pattern = record_pattern(PREFIX, 32)
    assert sent == b"".join(scan_command(c, pattern, 5) for c in (b"0", b"17", b"3"))


@pytest.mark.parametrize(
    "bad",
    [
        _row(b"k" * 32, b"kv:0123456789abcdeX:"),  # another prefix
        b"$52\r\n" + PREFIX + b"k" * 32 + b"\n\n",  # a row that does not end its line
        _row(b"k" * 31) + b"\r\n",  # a shorter key (the stride is right, the length line is not)
    ],
)
def test_a_row_that_is_not_a_record_key_fails_the_sweep(bad: bytes) -> None:
    with pytest.raises(ConnectionError, match="SCAN"):
        _parse(_reply(b"0", [_row(b"a" * 32), bad]))


def test_a_reply_of_another_shape_fails_the_sweep() -> None:
    with pytest.raises(ConnectionError, match="SCAN"):
        _parse(b"*3\r\n")
    with pytest.raises(ValueError, match="glob"):
        record_pattern(b"kv*:", 32)


# -- the index: a size per tier, not per key; one key set ----------------------------------------

def _config(url: str, prefix: str, **redis: Any) -> dict[str, Any]:
    tier = {"backend": "redis", "capacity": 4096 * (BLOCK + 64), "url": url, "prefix": prefix, "sync_interval_s": 3600, **redis}
    return {"block_bytes": BLOCK, "tiers": [tier], "namespace": {"model_id": "redis-listing"}}


@pytest.mark.parametrize("options", [{}, {"mac_key": "a-fleet-wide-secret-of-32-bytes!"}])
def test_records_without_a_codec_make_a_fixed_size_tier(redis_server: RedisServer, options: dict[str, Any]) -> None:
    """Every record is its header and the whole block: the manager accounts each at the
    reserve and keeps no size per key, at open and after stores."""
    prefix = f"fixed{len(options)}"

    async def run() -> None:
        async with kvtier.open(_config(redis_server.url, prefix, **options)) as store:
            backend = store.backends[0]
            sizes = backend.write_blocks([make_key(i) for i in range(20)], [random_block(BLOCK, i) for i in range(20)])
            assert sizes == [backend.reserve_bytes()] * 20
        async with kvtier.open(_config(redis_server.url, prefix, **options)) as store:
            manager = store.manager
            assert manager is not None and not manager.tier_spec(0).variable_size
            assert manager.stats()["tiers"][0]["ready"] == 20
            assert manager.stats()["tiers"][0]["used_bytes"] == 20 * store.backends[0].reserve_bytes()
            assert manager._tiers[0].sizes == {}

    asyncio.run(run())


def test_a_compressing_codec_keeps_sizes_per_key(redis_server: RedisServer) -> None:
    async def run() -> None:
        async with kvtier.open(_config(redis_server.url, "zstdsizes", codec="zstd")) as store:
            assert store.manager is not None and store.manager.tier_spec(0).variable_size

    asyncio.run(run())


def test_the_view_holds_no_key_set_and_forgets_what_the_server_lost(redis_server: RedisServer) -> None:
    """The keys adopted at open are the manager's alone; a sweep finds the ones the server lost
    among them."""
    n = 2000

    async def run() -> None:
        async with kvtier.open(_config(redis_server.url, "viewset")) as store:
            backend = store.backends[0]
            keys = [make_key(i) for i in range(n)]
            for start in range(0, n, 500):
                backend.write_blocks(keys[start : start + 500], [random_block(BLOCK, 0)] * 500)
        async with kvtier.open(_config(redis_server.url, "viewset")) as store:
            backend = store.backends[0]
            assert isinstance(backend, RedisBackend)
            view = backend.view
            assert view is not None and view.known_count() == n
            held = sum(sys.getsizeof(v) for v in vars(view).values())
            assert held < n * 8, f"the view holds {held} bytes for {n} keys"
            client = redis.Redis.from_url(redis_server.url)
            client.delete(*(backend.remote_key(k) for k in keys[:10]))
            client.close()
            assert await asyncio.to_thread(view.sweep_once) == (0, 10)
            assert await store.lookup(keys[:10]) == 0 and await store.lookup(keys[10:]) == n - 10
            assert view.known_count() == n - 10

    asyncio.run(run())


def test_ready_keys_are_the_ready_ones_only() -> None:
    manager = TierManager([TierSpec("t", capacity_bytes=10 * BLOCK, block_reserve=BLOCK, policy=LRUPolicy())])
    keys = [make_key(i) for i in range(3)]
    plan = manager.prepare_store(keys)
    assert plan is not None
    manager.complete_store(keys[:2])
    assert sorted(manager.ready_keys(0)) == sorted(keys[:2])


class _OldTarget:
    """An index target of an older release: no ``ready_keys``."""

    def holds(self, key: bytes, tier: int) -> bool:
        return False

    def adopt(self, tier: int, records: Any) -> list[bytes]:
        return []

    def remove(self, keys: list[bytes], tier: int) -> list[bytes]:
        return []


def test_a_target_without_ready_keys_is_refused_at_bind() -> None:
    from kvtier.backends.shared_index import SharedIndexView

    view = SharedIndexView("old", lambda: set(), record_bytes=1)
    with pytest.raises(TypeError, match="ready_keys"):
        view.bind(_OldTarget(), 0, start=False)


def test_a_clusters_primaries_are_listed_at_once(redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each primary is a process of its own: the sweep lists them on a thread each."""
    backend = _open(b"redis-listing-parallel", redis_cluster.url, cluster=True)
    threads: set[str] = set()
    scan = redis_tier.scan_block_keys
    together = threading.Barrier(len(redis_cluster.nodes), timeout=20)  # broken unless every primary is listed at once

    def spy(*args: Any) -> Any:
        threads.add(threading.current_thread().name)
        together.wait()
        return scan(*args)

    monkeypatch.setattr(redis_tier, "scan_block_keys", spy)
    try:
        keys = [make_key(i) for i in range(60)]
        _write(backend, keys)
        assert set(_fast(backend)) == set(keys)
        assert len(threads) == len(redis_cluster.nodes) > 1 and threading.current_thread().name not in threads
        assert not together.broken
    finally:
        _close(backend)


# -- the open's table: the listing's dict is the index's ------------------------------------------

@pytest.mark.parametrize("source", ["key log", "scan"])
def test_the_open_hands_the_manager_its_keys_as_listed(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """A store's open gathers the keys into one list as they come, and builds no dict on the
    listing thread (a key written or listed twice comes twice); ``distinct()``, on the adopting
    thread, keeps each key once, where first listed, with its table: the keys, order and table
    of the dict the listing builds for the sweeps (and built for the open before)."""
    from kvtier.backends.redis_keylog import KeyLog

    from kvtier.bulk import READY

    monkeypatch.setattr(redis_tier, "SCAN_COUNT", 7)
    scan = redis_tier.scan_block_keys

    def twice(*args: Any) -> Any:  # every batch listed again, as a server whose table grows may
        for batch in scan(*args):
            yield batch
            yield batch[::-1]

    backend = _open(b"redis-listing-open-" + source.encode()[:4], redis_server.url)
    try:
        keys = [make_key(i) for i in range(120)] + ODD_KEYS
        _write(backend, keys)
        _write(backend, keys[:5])  # written again: the key log names them twice
        monkeypatch.setattr(redis_tier, "scan_block_keys", twice)
        if source == "scan":
            monkeypatch.setattr(KeyLog, "enabled", property(lambda self: False))
        columns = backend.scan_columns()
        assert columns.table is None and columns.repeats and len(columns) > len(keys)
        kept = columns.distinct()
        assert kept.table is not None and list(kept.table) == kept.keys and set(kept.table.values()) == {READY}
        assert sorted(kept.keys) == sorted(keys) and kept.keys == list(dict.fromkeys(columns.keys))
        assert backend._sweep() == set(keys)
    finally:
        _close(backend)


def test_the_opens_list_equals_the_listings_dict(redis_server: RedisServer) -> None:
    """The same batches gathered as the open's list (``as_list``) and as the sweeps' dict give
    the same keys in the same order once the repeats are dropped; a batch of deletions (a key
    log's) turns the list into the dict, replayed in order; keys to leave out (records that
    failed to load as ours) are left out of both."""
    from kvtier.backends.remote_listing import Dropped

    from kvtier.bulk import RecordColumns

    backend = _open(b"redis-listing-same", redis_server.url)
    try:
        k = [make_key(1000 + i) for i in range(40)]
        plain = [k[:10], k[5:20], k[:3], k[20:40]]
        dropping = [k[:10], Dropped(k[2:6]), k[4:12], k[30:40]]

        def columns(listed: Any) -> Any:
            keys = listed if type(listed) is list else list(listed)
            one = torch.zeros(len(keys), dtype=torch.int64).numpy()
            return RecordColumns(keys, one, one.astype("f8"), oldest_first=True, repeats=type(listed) is list).distinct()

        for batches in (plain, dropping):
            as_list = backend._listing(lambda b=batches: iter(b), as_list=True)
            as_dict = backend._listing(lambda b=batches: iter(b))
            assert as_dict is not None and as_list is not None
            assert (type(as_list) is list) == (batches is plain)
            assert columns(as_list).keys == list(as_dict)
        assert list(backend._listing(lambda: iter(dropping))) == k[:2] + k[6:10] + k[4:6] + k[10:12] + k[30:40]
        with backend._unreadable_lock:
            backend._unreadable[k[7]] = None
        as_list = backend._listing(lambda: iter(plain), as_list=True)
        assert type(as_list) is dict and k[7] not in as_list and list(as_list) == [x for x in dict.fromkeys(k) if x != k[7]]
    finally:
        _close(backend)


@pytest.mark.parametrize("capacity", [200, 90], ids=["fits", "over"])
def test_adopting_a_table_equals_adopting_the_keys(capacity: int) -> None:
    """The manager's index taken from a listing's table holds what it builds from the key column
    alone: the same index, order, eviction order, usage and excess; a table of another length
    than the keys is refused."""
    from kvtier.bulk import READY, RecordColumns

    keys = [make_key(i) for i in range(120)]
    stored = torch.full((120,), BLOCK, dtype=torch.int64).numpy()
    stamps = torch.zeros(120, dtype=torch.float64).numpy()
    managers = [
        TierManager([TierSpec("r", capacity_bytes=capacity * BLOCK, block_reserve=BLOCK, policy=LRUPolicy(), persistent=True)])
        for _ in range(2)
    ]
    managers.append(TierManager([TierSpec("r", capacity_bytes=capacity * BLOCK, block_reserve=BLOCK, policy=LRUPolicy(), persistent=True)]))
    repeated = keys + keys[3:20:2]  # a listing that names some keys twice (a key log)
    n = len(repeated)
    excess = [
        managers[0].adopt(0, RecordColumns(list(keys), stored, stamps, oldest_first=True)),
        managers[1].adopt(0, RecordColumns(list(keys), stored, stamps, oldest_first=True, table=dict.fromkeys(keys, READY))),
        managers[2].adopt(0, RecordColumns(repeated, stored[:1].repeat(n), stamps[:1].repeat(n), oldest_first=True, repeats=True)),
    ]
    assert excess[0] == excess[1] == excess[2] and len(excess[0]) == max(0, 120 - capacity)
    states = [m._tiers[0] for m in managers]
    assert list(states[0].index.items()) == list(states[1].index.items()) == list(states[2].index.items())
    assert managers[0].tier_keys(0) == managers[1].tier_keys(0) == managers[2].tier_keys(0)
    assert managers[0].stats()["tiers"] == managers[1].stats()["tiers"] == managers[2].stats()["tiers"]
    assert managers[1].lookup(keys[-5:]) == 5
    with pytest.raises(ValueError, match="120 keys and a table of 119"):
        RecordColumns(list(keys), stored, stamps, table=dict.fromkeys(keys[1:], READY))


def test_a_server_that_dies_mid_open_leaves_the_tier_empty(own_redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server goes away after the first ``SCAN`` reply of a store's open: the open still
    completes, the tier adopts nothing (the keys listed so far are dropped), and the tier is down."""
    config = _config(own_redis_server.url, "diesmidopen")

    async def fill() -> None:
        async with kvtier.open(config) as store:
            store.backends[0].write_blocks([make_key(i) for i in range(200)], [random_block(BLOCK, 0)] * 200)

    asyncio.run(fill())
    # No key log (a store an older build wrote): the open lists with SCAN.
    client = redis.Redis.from_url(own_redis_server.url)
    assert client.delete(*client.keys("diesmidopen:*:keys")) == 1
    client.close()
    monkeypatch.setattr(redis_tier, "SCAN_COUNT", 7)
    scan = redis_tier.scan_block_keys

    def dying(*args: Any) -> Any:
        for i, batch in enumerate(scan(*args)):
            if i == 1:
                own_redis_server.kill()
            yield batch

    monkeypatch.setattr(redis_tier, "scan_block_keys", dying)

    async def reopen() -> None:
        async with kvtier.open(config) as store:
            assert store.manager is not None
            assert store.manager.stats()["tiers"][0]["ready"] == 0
            assert await store.lookup([make_key(0)]) == 0
            stats = store.backends[0].stats()
            assert not stats["up"] and stats["outages"] == 1

    asyncio.run(reopen())


# -- a cluster's primaries, listed at once: their batches as they come -----------------------------

def test_interleaved_hands_over_items_while_other_listings_run() -> None:
    """The caller gets a listing's items while another listing is still running (it waits here
    for the caller to have taken one); every item of every listing comes, once."""
    from kvtier.backends.redis_scan import interleaved

    taken = threading.Event()

    def slow() -> Any:
        yield "s1"
        assert taken.wait(30), "no item reached the caller while this listing ran"
        yield "s2"

    def quick() -> Any:
        yield from ("q1", "q2")

    got = []
    for item in interleaved([slow, quick], "test-listing"):
        got.append(item)
        taken.set()
    assert sorted(got) == ["q1", "q2", "s1", "s2"]


def test_interleaved_raises_a_listings_error_after_every_thread_ended() -> None:
    from kvtier.backends.redis_scan import interleaved

    ended = threading.Event()

    def failing() -> Any:
        yield 1
        raise ConnectionError("primary gone")

    def other() -> Any:
        yield from range(100, 103)
        ended.set()

    with pytest.raises(ConnectionError, match="primary gone"):
        for _ in interleaved([failing, other], "test-listing"):
            pass
    assert ended.is_set()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-listing")]
    stopped = interleaved([other, other], "test-listing")
    assert next(stopped) in range(100, 103)
    stopped.close()  # a caller that stops early: the threads end too
    assert not [t for t in threading.enumerate() if t.name.startswith("test-listing")]


# -- the open's listing counts as the view's last sweep --------------------------------------------

def test_the_first_sweep_waits_ten_listings_after_the_open(redis_server: RedisServer) -> None:
    """A store's open lists the whole namespace; the view's first sweep then comes no sooner than
    ten of that listing's durations later (not one ``sync_interval_s`` later: a tier of 10^6
    keys would be listed twice in a row)."""
    from kvtier.backends.shared_index import SharedIndexView

    class Target(_OldTarget):
        def ready_keys(self, tier: int) -> list[bytes]:
            return []

    view = SharedIndexView("first-sweep", lambda: set(), record_bytes=1, interval_s=0.01)
    view.note_listed(5, seconds=600.0)
    view.bind(Target(), 0)
    try:
        threading.Event().wait(0.3)  # thirty intervals
        assert view.stats()["sweeps"] == 0 and view.known_count() == 5
    finally:
        view.stop()

    async def run() -> None:
        async with kvtier.open(_config(redis_server.url, "firstsweep")) as store:
            store.backends[0].write_blocks([make_key(i) for i in range(50)], [random_block(BLOCK, 0)] * 50)
        async with kvtier.open(_config(redis_server.url, "firstsweep")) as store:
            index = store.backends[0].stats()["index"]
            assert index["known_keys"] == 50 and index["last_sweep_s"] > 0 and index["sweeps"] == 0

    asyncio.run(run())
