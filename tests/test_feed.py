"""Change feeds (file log, Redis stream) and the follower that applies them to a manager."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kvtier.backends.change_feed import FeedCursor, FeedEntry, FeedOp, decode_entry, encode_entry, new_writer_id
from kvtier.backends.feed_follower import TierChange, TierFollower
from kvtier.backends.file_feed import FileFeed
from redis_servers import redis_clients

from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.testing import make_key

K = [make_key(i) for i in range(20_000)]


_START = FeedCursor()


def _read_all(feed: Any, cursor: FeedCursor = _START, wait_s: float = 0.0) -> tuple[list[FeedEntry], FeedCursor, bool]:
    out: list[FeedEntry] = []
    gap = False
    while True:
        r = feed.read(cursor, wait_s)
        out += r.entries
        gap = gap or r.gap
        if not r.entries and not r.gap:
            return out, r.cursor, gap
        cursor = r.cursor


# -- encoding -----------------------------------------------------------------------------------
def test_an_entry_round_trips_and_a_damaged_one_is_refused() -> None:
    w = new_writer_id()
    value = encode_entry(FeedOp.REMOVED, K[:3], w, 12.5)
    entry = decode_entry(value)
    assert entry == FeedEntry(FeedOp.REMOVED, tuple(K[:3]), w, 12.5)
    assert decode_entry(value[:-1]) is None  # truncated
    assert decode_entry(b"\x02" + value[1:]) is None  # another version
    assert decode_entry(value[:1] + b"\x09" + value[2:]) is None  # no such op


# -- the file log -------------------------------------------------------------------------------
def test_file_feed_two_writers_one_reader_in_order(tmp_path: Path) -> None:
    a, b = FileFeed(str(tmp_path)), FileFeed(str(tmp_path))
    start = a.head()
    assert a.publish(FeedOp.STORED, K[:2])
    assert b.publish(FeedOp.STORED, K[2:3])
    assert a.publish(FeedOp.REMOVED, K[:1])
    reader = FileFeed(str(tmp_path))
    entries, cursor, gap = _read_all(reader, start)
    assert not gap
    assert [(e.op, e.keys, e.writer) for e in entries] == [
        (FeedOp.STORED, tuple(K[:2]), a.writer), (FeedOp.STORED, (K[2],), b.writer), (FeedOp.REMOVED, (K[0],), a.writer)
    ]
    assert reader.read(cursor, 0.0).entries == ()  # nothing new
    b.publish(FeedOp.STORED, K[5:6])
    assert [e.keys for e in reader.read(cursor, 1.0).entries] == [(K[5],)]


def test_file_feed_rotation_is_bounded_and_a_reader_left_behind_sees_a_gap(tmp_path: Path) -> None:
    w = FileFeed(str(tmp_path), segment_bytes=4096, segments=3)
    reader = FileFeed(str(tmp_path), segment_bytes=4096, segments=3)
    w.publish(FeedOp.STORED, K[:1])
    early, cursor, gap = _read_all(reader)
    assert len(early) == 1 and not gap
    for i in range(1, 200):  # ~550 bytes each: many rotations
        assert w.publish(FeedOp.STORED, K[i * 16 : i * 16 + 16])
    segs = sorted(os.listdir(tmp_path / "kvtier-feed"))
    assert len([s for s in segs if s.startswith("seg-")]) <= 3
    late, _, gap = _read_all(reader, cursor)
    assert gap  # the entries between were rotated away
    assert late and late[-1].keys == tuple(K[199 * 16 : 200 * 16])


def test_file_feed_a_reader_that_keeps_up_sees_every_entry_across_rotations(tmp_path: Path) -> None:
    w = FileFeed(str(tmp_path), segment_bytes=4096, segments=2)
    reader = FileFeed(str(tmp_path))
    cursor, seen = FeedCursor(), []
    for i in range(100):
        w.publish(FeedOp.STORED, K[i : i + 1])
        got, cursor, gap = _read_all(reader, cursor)
        assert not gap
        seen += [e.keys[0] for e in got]
    assert seen == K[:100]


def test_file_feed_a_frame_still_being_written_waits_and_damage_is_skipped_as_a_gap(tmp_path: Path) -> None:
    w = FileFeed(str(tmp_path))
    w.publish(FeedOp.STORED, K[:1])
    reader = FileFeed(str(tmp_path))
    _, cursor, _ = _read_all(reader)
    seg = tmp_path / "kvtier-feed" / "seg-0000000000000001"
    frame = seg.read_bytes()  # one whole frame
    with open(seg, "ab") as f:  # half of the next frame: not read yet
        f.write(frame[: len(frame) // 2])
    r = reader.read(cursor, 0.0)
    assert r.entries == () and not r.gap and r.cursor == cursor
    with open(seg, "ab") as f:  # a torn write, then a good frame: skipped to it, as a gap
        f.write(b"\0" * 7)
    w.publish(FeedOp.STORED, K[1:2])
    r = reader.read(cursor, 0.0)
    assert r.gap and r.skipped >= 1 and [e.keys for e in r.entries] == [(K[1],)]


def test_file_feed_a_wiped_log_is_a_gap_and_reading_starts_over(tmp_path: Path) -> None:
    w = FileFeed(str(tmp_path))
    w.publish(FeedOp.STORED, K[:1])
    reader = FileFeed(str(tmp_path))
    _, cursor, _ = _read_all(reader)
    w.close()
    for name in os.listdir(tmp_path / "kvtier-feed"):
        os.unlink(tmp_path / "kvtier-feed" / name)
    w2 = FileFeed(str(tmp_path))
    w2.publish(FeedOp.STORED, K[1:2])  # the same size as the first log: only the file tells
    r = reader.read(cursor, 0.0)
    assert r.gap and r.cursor == FeedCursor()
    assert [e.keys for e in _read_all(reader, r.cursor)[0]] == [(K[1],)]


# -- the follower on a real manager -------------------------------------------------------------
def _manager(blocks: int = 64) -> TierManager:
    return TierManager([TierSpec("shared", blocks * 100, 100, LRUPolicy(capacity=blocks), persistent=True)])


def test_the_follower_applies_others_entries_skips_its_own_and_tells_listeners(tmp_path: Path) -> None:
    mine, theirs = FileFeed(str(tmp_path)), FileFeed(str(tmp_path))
    manager = _manager()
    listed: set[bytes] = set()
    follower = TierFollower("t", sweep=lambda: set(listed), record_bytes=100, feed=mine, sweep_interval_s=3600, wait_s=0.05)
    follower.mark_start()
    changes: list[TierChange] = []
    follower.listen(changes.append)
    follower.bind(manager, 0)
    try:
        mine.publish(FeedOp.STORED, K[:2])  # our own: never applied by the follower
        theirs.publish(FeedOp.STORED, K[2:5])
        theirs.publish(FeedOp.REMOVED, K[3:4])
        deadline = time.monotonic() + 10
        while manager.lookup(K[2:3]) == 0 or manager.lookup(K[3:4]) == 1:
            assert time.monotonic() < deadline, follower.stats()
            time.sleep(0.01)
        assert manager.lookup(K[:1]) == 0
        assert manager.lookup(K[2:3]) == 1 and manager.lookup(K[4:5]) == 1 and manager.lookup(K[3:4]) == 0
        assert [k for c in changes for k in c.adopted] == K[2:5]
        assert [k for c in changes for k in c.removed] == [K[3]]
        events = [(e.kind, e.key) for e in manager.take_events()]
        assert ("stored", K[2]) in events and ("removed", K[3]) in events
        stats = follower.stats()
        assert stats["feed_own_entries"] == 1 and stats["adopted"] == 3 and stats["removed"] == 1
        assert 0 <= stats["lag_s"]["p99"] < 10
        assert follower.count_served([K[2], K[4], K[0]]) == 2 and follower.stats()["shared_hits"] == 2
    finally:
        follower.stop()


def test_a_feed_that_lost_entries_is_reconciled_by_the_sweep(tmp_path: Path) -> None:
    mine = FileFeed(str(tmp_path), segment_bytes=4096, segments=2)
    theirs = FileFeed(str(tmp_path), segment_bytes=4096, segments=2)
    manager = _manager(blocks=4096)
    on_server: set[bytes] = set()
    follower = TierFollower("t", sweep=lambda: set(on_server), record_bytes=100, feed=mine, sweep_interval_s=3600, wait_s=0.05)
    follower.mark_start()
    stop = threading.Event()
    follower.bind(manager, 0, start=False)  # the follower is not reading while entries are lost
    for i in range(100):  # far more than two segments: the first entries are rotated away
        keys = K[i * 16 : i * 16 + 16]
        on_server.update(keys)
        theirs.publish(FeedOp.STORED, keys)
    follower.bind(manager, 0)
    try:
        deadline = time.monotonic() + 10
        while manager.lookup(K[:1600]) < 1600:
            assert time.monotonic() < deadline, follower.stats()
            time.sleep(0.01)
        stats = follower.stats()
        assert stats["feed_gaps"] >= 1 and stats["index"]["sweeps"] >= 1
    finally:
        stop.set()
        follower.stop()


def test_live_adoption_into_a_full_tier_forgets_the_least_recent_keys_without_pinned_ones() -> None:
    manager = _manager(blocks=4)
    manager.adopt(0, [(k, 100, float(i)) for i, k in enumerate(K[:4])])
    manager.prepare_load(K[:1])  # pinned: never forgotten
    got = manager.adopt_live(0, [(K[10], 100, 0.0), (K[11], 100, 0.0), (K[0], 100, 0.0)])
    assert got == [K[10], K[11]]
    assert manager.lookup(K[:1]) == 1 and manager.lookup(K[1:2]) == 0 and manager.lookup(K[2:3]) == 0
    assert manager.lookup(K[10:12]) == 2
    events = [(e.kind, e.key) for e in manager.take_events()]
    assert ("removed", K[1]) in events and ("stored", K[10]) in events


# -- the Redis stream ---------------------------------------------------------------------------
def _redis_feed(url: str, stream: bytes, *, cluster: bool = False, maxlen: int = 100_000) -> Any:
    import redis
    from kvtier.backends.redis_feed import RedisFeed
    from redis.cluster import RedisCluster

    def make() -> Any:
        return RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url, socket_timeout=60)

    return RedisFeed(stream, make, maxlen=maxlen)


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_redis_feed_two_writers_one_reader_and_a_blocking_read_wakes_at_once(
    cluster: bool, redis_server: Any, redis_cluster: Any
) -> None:
    url = redis_cluster.url if cluster else redis_server.url
    stream = f"feedtest-{cluster}:feed".encode()
    a, b, reader = (_redis_feed(url, stream, cluster=cluster) for _ in range(3))
    try:
        start = reader.head()
        assert start == FeedCursor()  # no stream yet
        assert a.publish(FeedOp.STORED, K[:2]) and b.publish(FeedOp.REMOVED, K[:1])
        entries, cursor, gap = _read_all(reader, start)
        assert not gap and [(e.op, e.keys, e.writer) for e in entries] == [
            (FeedOp.STORED, tuple(K[:2]), a.writer), (FeedOp.REMOVED, (K[0],), b.writer)
        ]
        assert reader.head() == cursor
        got: list[Any] = []
        wait_s = 30.0  # far longer than any wake-up, however loaded the machine
        t = threading.Thread(target=lambda: got.append(reader.read(cursor, wait_s)))
        t.start()
        time.sleep(0.2)  # most likely blocked by now; a read that starts later finds the entry at once
        sent = time.monotonic()
        b.publish(FeedOp.STORED, K[5:6])
        t.join(2 * wait_s)
        # The blocked read answered with the entry, not at the end of its wait (then it is empty).
        assert time.monotonic() - sent < wait_s
        assert [e.keys for e in got[0].entries] == [(K[5],)]
        # a job larger than one entry goes out as several, in order, in one pipeline
        a.publish(FeedOp.STORED, K[:10_000])
        entries, _, gap = _read_all(reader, got[0].cursor)
        assert not gap and [k for e in entries for k in e.keys] == K[:10_000]
    finally:
        for feed in (a, b, reader):
            feed.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_redis_feed_wake_ends_a_blocked_read_at_once_and_the_next_read_goes_on(
    cluster: bool, redis_server: Any, redis_cluster: Any
) -> None:
    urls = [n.url for n in redis_cluster.nodes] if cluster else [redis_server.url]
    stream = f"feedtest-wake-{cluster}:feed".encode()
    known = set(redis_clients(urls))  # before the feeds connect
    w, reader = _redis_feed(urls[0], stream, cluster=cluster), _redis_feed(urls[0], stream, cluster=cluster)
    try:
        w.publish(FeedOp.STORED, K[:1])
        _, cursor, _ = _read_all(reader)
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(reader.read(cursor, 30.0)))
        t.start()
        deadline = time.monotonic() + 10
        while not (ours := {a for a, blocked in redis_clients(urls).items() if blocked and a not in known}):
            assert time.monotonic() < deadline and t.is_alive()  # until the read is blocked on the server
            time.sleep(0.01)
        reader.wake()
        t.join(10.0)  # a third of the block time: only a wake ends the read this early
        assert not t.is_alive()
        assert got[0].entries == () and got[0].cursor == cursor and not got[0].gap
        deadline = time.monotonic() + 10
        while ours & set(redis_clients(urls)):  # its connection was dropped: the server let the read go
            assert time.monotonic() < deadline
            time.sleep(0.01)
        w.publish(FeedOp.STORED, K[1:2])  # the feed reads on, on a new connection
        assert [e.keys for e in reader.read(cursor, 5.0).entries] == [(K[1],)]
        reader.wake()  # a wake before the read starts is kept: that read returns at once
        t = threading.Thread(target=lambda: got.append(reader.read(cursor, 30.0)))
        t.start()
        t.join(10.0)
        assert not t.is_alive() and got[1].entries == ()
        assert [e.keys for e in reader.read(cursor, 5.0).entries] == [(K[1],)]  # taken once only
    finally:
        w.close()
        reader.close()


def test_redis_feed_a_read_that_must_not_wait_sends_no_block(redis_server: Any) -> None:
    import redis

    stream = b"feedtest-noblock:feed"
    reader = _redis_feed(redis_server.url, stream)
    watcher = redis.Redis.from_url(redis_server.url)
    try:
        with watcher.monitor() as monitor:
            assert reader.read(FeedCursor(), 0.0).entries == ()
            assert reader.read(FeedCursor(), 0.01).entries == ()
            sent: list[str] = []
            while len(sent) < 2:  # what the server received, in order (other clients' left out)
                command = monitor.next_command()["command"]
                if command.startswith("XREAD") and stream.decode() in command:
                    sent.append(command)
        # A server ends even "BLOCK 1" only at its next timer tick (100 ms at the default hz).
        assert "BLOCK" not in sent[0].split() and "BLOCK 10" in sent[1]
    finally:
        watcher.close()
        reader.close()


def test_file_feed_wake_ends_a_waiting_read_at_once(tmp_path: Path) -> None:
    w = FileFeed(str(tmp_path))
    reader = FileFeed(str(tmp_path), poll_s=30.0)  # one poll outlasts the guard: only a wake ends it
    w.publish(FeedOp.STORED, K[:1])
    _, cursor, _ = _read_all(reader)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(reader.read(cursor, 60.0)))
    t.start()
    reader.wake()
    t.join(10.0)
    assert not t.is_alive() and got[0].entries == () and got[0].cursor == cursor
    w.publish(FeedOp.STORED, K[1:2])
    assert [e.keys for e in reader.read(cursor, 0.0).entries] == [(K[1],)]
    w.close()
    reader.close()


def test_redis_feed_a_trimmed_stream_is_a_gap_a_reader_in_step_never_sees_one(redis_server: Any) -> None:
    stream = b"feedtest-trim:feed"
    w, reader = _redis_feed(redis_server.url, stream, maxlen=100), _redis_feed(redis_server.url, stream, maxlen=100)
    try:
        w.publish(FeedOp.STORED, K[:1])
        _, cursor, gap = _read_all(reader)
        assert not gap
        for i in range(300):  # a reader in step: reads after every write, no gap
            w.publish(FeedOp.STORED, K[i : i + 1])
            _, cursor, gap = _read_all(reader, cursor)
            assert not gap
        behind = cursor
        for i in range(2000):  # far past MAXLEN ~100: the entries after `behind` are trimmed
            w.publish(FeedOp.STORED, K[i : i + 1])
        r = reader.read(behind, 0.1)
        assert r.gap and r.entries
        # a stream that vanished (FLUSHALL, a restart without persistence) comes back as a gap
        import redis

        redis.Redis.from_url(redis_server.url).delete(stream)
        w.publish(FeedOp.STORED, K[7:8])
        _, _, gap = _read_all(reader, r.cursor)
        assert gap
    finally:
        w.close()
        reader.close()


def test_redis_feed_a_dead_server_raises_oserror_and_publish_fails_cleanly(dead_port: int) -> None:
    feed = _redis_feed(f"redis://127.0.0.1:{dead_port}/0", b"x:feed")
    try:
        assert feed.publish(FeedOp.STORED, K[:1]) is False and feed.publish_failures == 1
        with pytest.raises(OSError):
            feed.read(FeedCursor(), 0.1)
        with pytest.raises(OSError):
            feed.head()
    finally:
        feed.close()
