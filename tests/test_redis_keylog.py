"""The redis tier's key log: a store's open reads the names of the stored records from one value
instead of a ``SCAN`` of the keyspace, and lists with ``SCAN`` whenever the log cannot be
trusted (see ``backends/redis_keylog.py``).

Against real private servers (tests/redis_servers.py). Each test compares the log's open with
the general listing (``SCAN`` through redis-py) of the same server.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
import torch
from kvtier.backends import redis_keylog
from kvtier.backends.redis_keylog import DELETED, HEADER_BYTES, KEYLOG_SUFFIX, MAGIC, STORED
from kvtier.backends.redis_tier import RedisBackend
from redis_logs import BLOCK, close_tier, general_keys, open_tier, reopen_tier, write_keys
from redis_servers import RedisServer

from kvtier.testing import make_key, random_block


def _log(backend: RedisBackend) -> bytes:
    client = redis.Redis.from_url(backend.url)
    try:
        return bytes(client.get(backend._prefix_bytes + KEYLOG_SUFFIX) or b"")
    finally:
        client.close()


def _ops(raw: bytes) -> list[tuple[bytes, bytes]]:
    """``(operation, key)`` of every entry of a log (after its header)."""
    assert raw.startswith(MAGIC) and (len(raw) - HEADER_BYTES) % 33 == 0
    return [(raw[i : i + 1], raw[i + 1 : i + 33]) for i in range(HEADER_BYTES, len(raw), 33)]


def _entries(raw: bytes) -> list[bytes]:
    """The keys a log's entries say were stored, in order."""
    return [key for op, key in _ops(raw) if op == STORED]


def test_an_open_reads_the_log_and_lists_what_scan_does(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys written in several jobs (one written twice) open from the log, in several reads, as
    the set a SCAN lists; the log holds each write once, after a header; no SCAN at open."""
    monkeypatch.setattr(redis_keylog, "READ_CHUNK", 33 * 7)  # many pieces, the last one short
    writer = open_tier(b"keylog-read", redis_server.url)
    try:
        keys = [make_key(i) for i in range(100)]
        for start in range(0, 100, 30):
            write_keys(writer, keys[start : start + 30])
        write_keys(writer, keys[:1])
        assert _entries(_log(writer)) == keys + keys[:1]
        # The open reads the log: a SCAN there would fail it.
        monkeypatch.setattr(RedisBackend, "_list_block_keys", lambda self: (_ for _ in ()).throw(AssertionError("SCAN")))
        reader, opened, counters = reopen_tier(b"keylog-read", redis_server.url)
        monkeypatch.undo()
        try:
            assert sorted(opened) == sorted(set(keys)) and set(opened) == general_keys(reader)
            assert counters["opens"] == 1 and counters["fallbacks"] == 0 and counters["sampled_gone"] == 0
            assert reader.follower is not None and not reader.follower.view._wake.is_set()  # no early sweep
            out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(3)]
            assert reader.read_blocks(keys[:3], out) == [True] * 3
            for i, row in enumerate(out):
                assert torch.equal(row, random_block(BLOCK, i).view(torch.uint8))
        finally:
            close_tier(reader)
    finally:
        close_tier(writer)


@pytest.mark.parametrize("damage", ["missing", "headerless", "torn", "wrong type"])
def test_an_untrusted_log_falls_back_to_scan_and_is_written_again(redis_server: RedisServer, damage: str) -> None:
    """A store with no log (written by an older build), one begun again by an APPEND after the
    server evicted it, one cut mid-entry, and a value of another type: the open lists with SCAN,
    adopts exactly the records, and writes the log again, so the next open reads it."""
    namespace = b"keylog-untrusted-" + damage.encode()
    writer = open_tier(namespace, redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    name = writer._prefix_bytes + KEYLOG_SUFFIX
    try:
        keys = [make_key(i) for i in range(50)]
        write_keys(writer, keys)
        if damage == "missing":
            client.delete(name)
        elif damage == "headerless":
            client.delete(name)
            write_keys(writer, keys[:5])  # APPEND makes a new value: no header
        elif damage == "torn":
            client.append(name, b"x" * 7)
        else:
            client.delete(name)
            client.sadd(name, b"k")
        reader, opened, counters = reopen_tier(namespace, redis_server.url)
        try:
            assert sorted(opened) == sorted(keys) == sorted(general_keys(reader))
            assert counters["fallbacks"] == 1 and counters["opens"] == 0 and counters["rewrites"] == 1
            assert sorted(set(_entries(_log(reader)))) == sorted(keys)
        finally:
            close_tier(reader)
        again, opened, counters = reopen_tier(namespace, redis_server.url)
        try:
            assert sorted(opened) == sorted(keys) and counters["opens"] == 1 and counters["fallbacks"] == 0
        finally:
            close_tier(again)
    finally:
        client.close()
        close_tier(writer)


def test_a_log_whose_records_are_mostly_gone_is_not_trusted(redis_server: RedisServer) -> None:
    """The server evicted most records the log names (more than half of a sample): the open lists
    with SCAN, adopts the live ones only, and the log is written again with those."""
    writer = open_tier(b"keylog-evicted", redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = [make_key(i) for i in range(200)]
        write_keys(writer, keys)
        client.unlink(*(writer.remote_key(k) for k in keys[:150]))  # as the server's eviction would
        reader, opened, counters = reopen_tier(b"keylog-evicted", redis_server.url)
        try:
            assert sorted(opened) == sorted(keys[150:]) and counters["fallbacks"] == 1
            assert "sampled keys of the key log have no record" in counters["last_problem"]
            assert sorted(_entries(_log(reader))) == sorted(keys[150:])
        finally:
            close_tier(reader)
    finally:
        client.close()
        close_tier(writer)


def test_deletions_are_replayed_in_order(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records this tier deleted (a bad one, or an operator's delete) are logged as deleted: the
    next open leaves them out, unless they were stored again after; a deletion in the middle of
    a piece of the log splits it where it stands."""
    monkeypatch.setattr(redis_keylog, "READ_CHUNK", 33 * 16)
    writer = open_tier(b"keylog-deleted", redis_server.url)
    try:
        keys = [make_key(i) for i in range(60)]
        write_keys(writer, keys)
        writer.delete_blocks(keys[10:20] + keys[40:41])
        write_keys(writer, keys[15:16])  # stored again after its deletion
        ops = _ops(_log(writer))
        assert ops[60:71] == [(DELETED, k) for k in keys[10:20] + keys[40:41]] and ops[71] == (STORED, keys[15])
        reader, opened, counters = reopen_tier(b"keylog-deleted", redis_server.url)
        try:
            live = keys[:10] + keys[15:16] + keys[20:40] + keys[41:]
            assert sorted(opened) == sorted(live) == sorted(general_keys(reader)) and counters["opens"] == 1
        finally:
            close_tier(reader)
    finally:
        close_tier(writer)


def test_an_entry_of_another_form_falls_back_to_scan(redis_server: RedisServer) -> None:
    """An entry that is neither stored nor deleted (damage inside the log, whole entries long):
    the open drops what it read of the log, lists with SCAN and writes the log again."""
    writer = open_tier(b"keylog-bad-entry", redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = [make_key(i) for i in range(40)]
        write_keys(writer, keys)
        client.setrange(writer._prefix_bytes + KEYLOG_SUFFIX, HEADER_BYTES + 33 * 39, b"?")  # the last entry's op
        reader, opened, counters = reopen_tier(b"keylog-bad-entry", redis_server.url)
        try:
            assert sorted(opened) == sorted(keys) and counters["fallbacks"] == 1
            assert "another form" in counters["last_problem"]
            assert sorted(_entries(_log(reader))) == sorted(keys)
        finally:
            close_tier(reader)
    finally:
        client.close()
        close_tier(writer)


def test_a_few_evicted_records_are_adopted_and_miss_when_loaded(redis_server: RedisServer) -> None:
    """A trusted log that names a few records the server evicted (the sample, here every entry,
    finds them): the open adopts them, their loads are misses (never other bytes), the first
    sweep is asked for at once, and it forgets them."""
    writer = open_tier(b"keylog-few-gone", redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = [make_key(i) for i in range(40)]
        write_keys(writer, keys)
        client.unlink(*(writer.remote_key(k) for k in keys[:3]))
        reader, opened, counters = reopen_tier(b"keylog-few-gone", redis_server.url)
        try:
            assert sorted(opened) == sorted(keys) and counters["opens"] == 1 and counters["sampled_gone"] == 3
            assert reader.follower is not None and reader.follower.view._wake.is_set()
            out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(5)]
            assert reader.read_blocks(keys[:5], out) == [False, False, False, True, True]
            assert torch.equal(out[4], random_block(BLOCK, 4).view(torch.uint8))
            assert reader._sweep() == set(keys[3:])
        finally:
            close_tier(reader)
    finally:
        client.close()
        close_tier(writer)


def test_a_sweep_rewrites_a_log_over_twice_the_keys_and_keeps_appends_made_meanwhile(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys written again and again grow the log past twice the live keys: the next sweep writes
    it again from its listing, and a job that stores a key while that sweep lists is kept."""
    monkeypatch.setattr(redis_keylog, "REWRITE_SLACK", 10)
    backend = open_tier(b"keylog-rewrite", redis_server.url)
    try:
        keys = [make_key(i) for i in range(40)]
        for _ in range(3):
            write_keys(backend, keys)
        assert len(_ops(_log(backend))) == 120
        rewrites = backend.stats()["key_log"]["rewrites"]  # the open's, which began the log
        late = [make_key(1000), make_key(1001)]
        listing = RedisBackend._list_block_keys

        def listing_with_a_write(self: RedisBackend) -> Any:
            batches = list(listing(self))
            write_keys(backend, late)  # lands after the sweep read the log's state, before the rewrite
            return iter(batches)

        monkeypatch.setattr(RedisBackend, "_list_block_keys", listing_with_a_write)
        assert backend._sweep() == set(keys)
        monkeypatch.setattr(RedisBackend, "_list_block_keys", listing)
        assert sorted(_entries(_log(backend))) == sorted(keys + late)
        assert backend.stats()["key_log"]["rewrites"] == rewrites + 1
        assert backend._sweep() == set(keys + late)  # under twice the keys now: left alone
        assert backend.stats()["key_log"]["rewrites"] == rewrites + 1
    finally:
        close_tier(backend)


def test_a_rewrite_that_another_came_before_is_dropped(redis_server: RedisServer) -> None:
    """Two hosts rewrite the log from the same state: the second finds the header changed and
    leaves the first's log as it is."""
    backend = open_tier(b"keylog-two-rewrites", redis_server.url)
    try:
        keys = [make_key(i) for i in range(20)]
        write_keys(backend, keys)
        log = backend._keylog
        state = log.sweep_state()
        assert state is not None
        assert log.rewrite(state, keys[:10] + keys[10:])
        first = _log(backend)
        assert not log.rewrite(state, keys[:5])
        assert _log(backend) == first
    finally:
        close_tier(backend)


def test_a_refused_append_fails_no_write(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that refuses the log's APPEND (an ACL without it): the records are stored and
    served all the same; the refusal is counted; the log names none of them (until a sweep
    writes it again)."""
    backend = open_tier(b"keylog-refused", redis_server.url)
    refused = b"*2\r\n$13\r\nNOSUCHCOMMAND\r\n$1\r\nx\r\n"  # answered with an error, as a denied APPEND is
    monkeypatch.setattr(redis_keylog.KeyLog, "append_commands", lambda self, keys: (refused, 1))
    try:
        keys = [make_key(i) for i in range(10)]
        write_keys(backend, keys)
        assert backend.stats()["key_log"]["append_failures"] >= 1
        out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(2)]
        assert backend.read_blocks(keys[:2], out) == [True, True]
        assert _entries(_log(backend)) == []
    finally:
        close_tier(backend)


def test_a_server_that_dies_while_the_log_is_read_leaves_the_tier_empty(
    own_redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server goes away once the log was judged, before its pieces are read: the open
    completes, adopts nothing, and the tier is down."""
    writer = open_tier(b"keylog-dies", own_redis_server.url)
    write_keys(writer, [make_key(i) for i in range(100)])
    close_tier(writer)
    batches = redis_keylog.KeyLog.batches

    def dying(self: Any, *args: Any) -> Any:
        own_redis_server.kill()
        yield from batches(self, *args)

    monkeypatch.setattr(redis_keylog.KeyLog, "batches", dying)
    reader, opened, counters = reopen_tier(b"keylog-dies", own_redis_server.url)
    try:
        assert opened == [] and counters["opens"] == 1
        stats = reader.stats()
        assert not stats["up"] and stats["outages"] == 1
    finally:
        close_tier(reader)


def test_stores_of_two_threads_all_reach_the_log(redis_server: RedisServer) -> None:
    """Jobs stored at once from two threads each append their own keys: the log names all."""
    backend = open_tier(b"keylog-threads", redis_server.url)
    try:
        groups = [[make_key(1000 * t + i) for i in range(64)] for t in range(2)]
        threads = [threading.Thread(target=write_keys, args=(backend, g)) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(_entries(_log(backend))) == sorted(groups[0] + groups[1])
    finally:
        close_tier(backend)


def test_a_sweep_while_the_server_is_down_tries_no_connection(
    own_redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the server is down and its backoff runs, a sweep returns at once: neither the log's
    state nor the listing tries a connection (each would wait on the dead server)."""
    import redis.connection

    backend = open_tier(b"keylog-down-sweep", own_redis_server.url)
    try:
        own_redis_server.kill()
        backend._get_client().connection_pool.disconnect()
        assert backend._sweep() is None  # this one meets the dead server and marks it down
        assert not backend.stats()["up"]
        backend._health._retry_at = float("inf")  # the backoff has not run out
        tries: list[object] = []
        connect = redis.connection.AbstractConnection.connect

        def counted(self: Any) -> None:
            tries.append(self)
            connect(self)

        monkeypatch.setattr(redis.connection.AbstractConnection, "connect", counted)
        assert backend._sweep() is None and backend._sweep() is None
        assert tries == []
    finally:
        monkeypatch.undo()
        close_tier(backend)


def test_both_kinds_of_key_log_keep_one_book() -> None:
    """The server's key log and a cluster's slot logs keep their counters and check their entries
    in one collaborator: the same counters, and an entry neither stored nor deleted found by the
    same column check wherever it sits."""
    from kvtier.backends.redis_keylog import DELETED, STORED, KeyLog, LogBook
    from kvtier.backends.redis_slotlogs import SlotLogs

    class Host:
        cluster, follower, _foreign, _prefix_bytes, _nodes = False, None, False, b"p:", None

    single, sharded = KeyLog(Host(), 32), SlotLogs(Host(), 32)
    assert isinstance(single.book, LogBook) and isinstance(sharded.book, LogBook)
    assert set(single.stats()) == set(sharded.stats()) - {"per_slot"}
    book = LogBook(32, "the key log")
    good = b"".join(op + bytes([i]) * 32 for i, op in enumerate([STORED, DELETED, STORED]))
    assert book.foreign(good) is None
    for at in range(3):
        bad = bytearray(good)
        bad[at * 33] = ord("?")
        assert book.foreign(bad) == "entries of another form in the key log"
    book.count("sampled_gone", 3)
    assert book.stats(True)["sampled_gone"] == 3


def test_a_piece_of_the_log_is_replayed_in_small_lists_with_the_same_keys_and_deletions() -> None:
    """``replay_pieces`` (what an open reads a piece with) gives the keys and deletions that one
    ``replay`` of the piece gives, in the same order, in lists of at most ``REPLAY_ENTRIES``; a
    bad entry raises, naming where it is in the log."""
    from kvtier.backends.redis_keylog import REPLAY_ENTRIES, KeyLogChanged, entries_of, replay, replay_pieces
    from kvtier.backends.remote_listing import Dropped

    n = 2 * REPLAY_ENTRIES + 123
    keys = [make_key(i) for i in range(n)]
    cut = REPLAY_ENTRIES - 2  # a run of deletions across the first pieces' boundary
    raw = entries_of(keys[:cut], STORED) + entries_of(keys[cut : cut + 5], DELETED) + entries_of(keys[cut + 5 :], STORED)

    def flat(batches: list[list[bytes]]) -> list[tuple[bool, bytes]]:
        return [(type(batch) is Dropped, key) for batch in batches for key in batch]

    whole, pieces = list(replay(raw, 32)), list(replay_pieces(raw, 32))
    assert flat(pieces) == flat(whole) and len(flat(whole)) == n
    assert max(map(len, pieces)) <= REPLAY_ENTRIES < max(map(len, whole)), [len(b) for b in pieces]
    # Where a piece starts in the log (for the message) counts from the offset given.
    bad = bytearray(raw)
    bad[(REPLAY_ENTRIES + 7) * 33] = ord("?")
    with pytest.raises(KeyLogChanged, match=f"between bytes {1000 + REPLAY_ENTRIES * 33} and"):
        list(replay_pieces(bytes(bad), 32, 1000))


def test_an_open_makes_its_keys_from_the_log_a_few_thousand_at_a_time(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's open hands the listing lists of at most ``REPLAY_ENTRIES`` keys, not one list of
    a whole 4 MiB piece (which stayed on the heap of the open's thread), and adopts every key."""
    monkeypatch.setattr(redis_keylog, "REPLAY_ENTRIES", 8)
    seen: list[int] = []
    real = redis_keylog.replay

    def spy(raw: Any, key_bytes: int, where: int = 0) -> Any:
        for batch in real(raw, key_bytes, where):
            seen.append(len(batch))
            yield batch

    writer = open_tier(b"keylog-pieces", redis_server.url)
    try:
        keys = [make_key(i) for i in range(100)]
        write_keys(writer, keys)
        monkeypatch.setattr(redis_keylog, "replay", spy)
        reader, opened, counters = reopen_tier(b"keylog-pieces", redis_server.url)
        try:
            assert sorted(opened) == sorted(keys) and counters["opens"] == 1 and counters["fallbacks"] == 0
            assert sum(seen) == 100 and max(seen) <= 8, seen
        finally:
            close_tier(reader)
    finally:
        close_tier(writer)
