"""The redis tier's key logs on a Redis Cluster, one per hash slot: a store's open reads each
primary's logs instead of a ``SCAN``, and lists a primary with ``SCAN`` whenever its logs cannot
be trusted (see ``backends/redis_slotlogs.py``).

Against real private 3-primary clusters (tests/redis_servers.py). Each test compares the logs'
open with the general listing (``SCAN`` through redis-py on every primary) of the same cluster.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
import torch
from kvtier.backends import redis_slotlogs
from kvtier.backends.redis_keylog import HEADER_BYTES, MAGIC
from kvtier.backends.redis_slotlogs import SLOTS, SlotLogs, slot_tags
from kvtier.backends.redis_tier import RedisBackend
from redis.crc import key_slot
from redis_logs import BLOCK, close_tier, general_keys, open_tier, reopen_tier, write_keys
from redis_servers import RedisClusterServers, RedisServer, open_redis_tier

from kvtier.testing import make_key, random_block


def _open(namespace: bytes, url: str) -> RedisBackend:
    backend: RedisBackend = open_tier(namespace, url, cluster=True)
    return backend


def _opened(namespace: bytes, url: str) -> tuple[RedisBackend, list[bytes], dict[str, Any]]:
    return reopen_tier(namespace, url, cluster=True)


def _logs(backend: RedisBackend) -> SlotLogs:
    assert isinstance(backend._keylog, SlotLogs)
    return backend._keylog


def _no_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any SCAN of the records (the tier's sweep listing, or a primary's fallback) fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("SCAN")

    monkeypatch.setattr(RedisBackend, "_list_block_keys", refuse)
    monkeypatch.setattr(redis_slotlogs, "scan_block_keys", refuse)


def _owned(node: RedisServer) -> set[int]:
    """The slots ``node`` serves, by its own ``CLUSTER NODES``."""
    slots: set[int] = set()
    for line in node.cli("cluster", "nodes").splitlines():
        fields = line.split()
        if "myself" in fields[2]:
            for part in fields[8:]:
                lo, _, hi = part.partition("-")
                if lo.isdigit():
                    slots.update(range(int(lo), int(hi or lo) + 1))
    return slots


def _owns(node: RedisServer, slot: int) -> bool:
    return slot in _owned(node)


def test_the_tag_table_keeps_no_object_per_slot() -> None:
    """The slots' tags, kept for the process, are one number a slot (formatted when asked), not
    a ``bytes`` object each: a fresh table holds well under the ~0.9 MB of 16,384 objects."""
    import tracemalloc

    from kvtier.backends import redis_slotlogs

    tracemalloc.start()
    try:
        tags = slot_tags.__wrapped__()  # a table of its own, not the process's cached one
        # What the module's own lines hold (another test's thread allocating meanwhile is not counted)
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, redis_slotlogs.__file__)])
    finally:
        tracemalloc.stop()
    held = sum(stat.size for stat in snapshot.statistics("filename"))
    assert len(tags) == SLOTS and held < 128 << 10, held
    assert tags[0] == slot_tags()[0] and tags[SLOTS - 1] == slot_tags()[SLOTS - 1]


def test_the_tag_table_is_made_in_small_columns() -> None:
    """Making the table never holds columns of every searched integer at once (about 3 MB, which
    stayed resident at the top of the heap of the open's thread): its peak stays under 1 MiB.
    Measured in an interpreter of its own, where no other test's thread allocates meanwhile."""
    import subprocess
    import sys

    code = (
        "import tracemalloc; from kvtier.backends.redis_slotlogs import slot_tags; tracemalloc.start(); "
        "tags = slot_tags(); print(len(tags), tracemalloc.get_traced_memory()[1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert int(out[0]) == SLOTS and int(out[1]) < 1 << 20, out


def test_every_slot_logs_name_hashes_to_its_slot(redis_cluster: RedisClusterServers) -> None:
    """The tag table (CRCs computed as columns) is the one its definition gives, a CRC at a time:
    each slot's smallest integer; it covers every slot once, and the server agrees on names."""
    tags = slot_tags()
    assert len(tags) == SLOTS and len(set(tags)) == SLOTS
    smallest: dict[int, bytes] = {}
    n = 0
    while len(smallest) < SLOTS:
        smallest.setdefault(key_slot(b"%d" % n), b"%d" % n)
        n += 1
    assert tuple(tags) == tuple(smallest[slot] for slot in range(SLOTS))
    assert [tags[slot] for slot in range(SLOTS)] == list(tags)
    backend = _open(b"slotlogs-names", redis_cluster.url)
    try:
        logs = _logs(backend)
        assert all(key_slot(logs.name(slot)) == slot for slot in range(SLOTS))
        client = redis.Redis(port=redis_cluster.nodes[0].port)
        for slot in (0, 1, 5461, 10923, SLOTS - 1):
            assert int(client.execute_command("CLUSTER", "KEYSLOT", logs.name(slot))) == slot
        client.close()
    finally:
        close_tier(backend)


def test_an_open_reads_the_slot_logs_and_lists_what_scan_does(
    redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys written in several jobs, some deleted and one stored again, open from every primary's
    logs (no SCAN), as the set a SCAN lists; the records read back byte-exact."""
    writer = _open(b"slotlogs-read", redis_cluster.url)
    try:
        keys = [make_key(i) for i in range(300)]
        for start in range(0, 300, 70):
            write_keys(writer, keys[start : start + 70])
        writer.delete_blocks(keys[:20])
        write_keys(writer, keys[5:6])
        _no_scan(monkeypatch)
        reader, opened, counters = _opened(b"slotlogs-read", redis_cluster.url)
        monkeypatch.undo()
        try:
            live = keys[5:6] + keys[20:]
            assert sorted(opened) == sorted(live) == sorted(general_keys(reader))
            assert counters["opens"] == 3 and counters["fallbacks"] == 0 and counters["rewrites"] == 0
            out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(4)]
            assert reader.read_blocks([keys[5], *keys[20:23]], out) == [True] * 4
            # keys[5] was stored again alone (its job's first block); keys[20:23] in the first job
            for row, seed in zip(out, (0, 20, 21, 22)):
                assert torch.equal(row, random_block(BLOCK, seed).view(torch.uint8))
        finally:
            close_tier(reader)
    finally:
        close_tier(writer)


def _damage(client: Any, name: bytes, damage: str) -> None:
    if damage == "missing":
        client.delete(name)
    elif damage == "headerless":
        client.delete(name)
        client.append(name, b"+" + b"k" * 32)  # an APPEND begins a value without a header
    elif damage == "torn":
        client.append(name, b"x" * 7)
    elif damage == "wrong type":
        client.delete(name)
        client.sadd(name, b"k")
    else:  # an entry that is neither stored nor deleted
        client.setrange(name, HEADER_BYTES, b"?")


@pytest.mark.parametrize("damage", ["missing", "headerless", "torn", "wrong type", "bad entry"])
def test_a_primary_with_an_untrusted_slot_log_falls_back_to_scan(redis_cluster: RedisClusterServers, damage: str) -> None:
    """One slot log damaged: its primary is listed with SCAN and its logs written again, the two
    others read their logs; the open adopts exactly the records, and the next open reads all."""
    namespace = b"slotlogs-untrusted-" + damage.encode()
    writer = _open(namespace, redis_cluster.url)
    client = writer._get_client()
    try:
        keys = [make_key(i) for i in range(120)]
        write_keys(writer, keys)
        _damage(client, _logs(writer).name(key_slot(writer.remote_key(keys[0]))), damage)
        reader, opened, counters = _opened(namespace, redis_cluster.url)
        try:
            assert sorted(opened) == sorted(keys) == sorted(general_keys(reader))
            assert counters["fallbacks"] == 1 and counters["opens"] == 2 and counters["rewrites"] >= SLOTS // 4
            assert counters["last_problem"] is not None
        finally:
            close_tier(reader)
        again, opened, counters = _opened(namespace, redis_cluster.url)
        try:
            assert sorted(opened) == sorted(keys) and counters["opens"] == 3 and counters["fallbacks"] == 0
        finally:
            close_tier(again)
    finally:
        close_tier(writer)


def test_an_older_store_without_slot_logs_is_listed_and_logged(
    redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records stored by a build that kept no cluster logs: every primary is listed with SCAN,
    exactly the records are adopted, every slot's log is begun, and the next open reads them."""
    monkeypatch.setattr(SlotLogs, "append_commands", lambda self, keys, op=b"": (b"", 0))
    monkeypatch.setattr(SlotLogs, "open_table", lambda self, listing: listing(None))
    writer = open_redis_tier(b"slotlogs-older", BLOCK, url=redis_cluster.url, cluster=True)
    try:
        keys = [make_key(i) for i in range(90)]
        write_keys(writer, keys)
        assert sorted(writer.scan_columns().keys) == sorted(keys)
    finally:
        close_tier(writer)
    monkeypatch.undo()
    reader, opened, counters = _opened(b"slotlogs-older", redis_cluster.url)
    try:
        assert sorted(opened) == sorted(keys) and counters["fallbacks"] == 3 and counters["rewrites"] == SLOTS
        assert "no key log" in counters["last_problem"]
    finally:
        close_tier(reader)
    _no_scan(monkeypatch)
    again, opened, counters = _opened(b"slotlogs-older", redis_cluster.url)
    try:
        assert sorted(opened) == sorted(keys) and counters["opens"] == 3
    finally:
        close_tier(again)


def test_records_lost_behind_the_logs_back_are_misses_never_other_bytes(redis_cluster: RedisClusterServers) -> None:
    """A few records the server evicted while their logs still name them: the open adopts them,
    their loads miss (the others load byte-exact), the first sweep is asked for at once and
    forgets them."""
    writer = _open(b"slotlogs-evicted", redis_cluster.url)
    client = writer._get_client()
    try:
        keys = [make_key(i) for i in range(40)]
        write_keys(writer, keys)
        for key in keys[:3]:
            client.unlink(writer.remote_key(key))
        reader, opened, counters = _opened(b"slotlogs-evicted", redis_cluster.url)
        try:
            assert sorted(opened) == sorted(keys) and counters["opens"] == 3 and counters["sampled_gone"] == 3
            assert reader.follower is not None and reader.follower.view._wake.is_set()
            out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(5)]
            assert reader.read_blocks(keys[:5], out) == [False, False, False, True, True]
            assert torch.equal(out[3], random_block(BLOCK, 3).view(torch.uint8))
            assert torch.equal(out[4], random_block(BLOCK, 4).view(torch.uint8))
            assert reader._sweep() == set(keys[3:])
        finally:
            close_tier(reader)
    finally:
        close_tier(writer)


def test_a_restarted_primary_that_lost_its_data_is_listed_with_scan(own_redis_cluster: RedisClusterServers) -> None:
    """A primary restarted without its data (persistence off) has no slot logs: it is listed
    with SCAN (nothing), the others read their logs; the open adopts the records that are left,
    and the lost ones are never served."""
    writer = _open(b"slotlogs-restart", own_redis_cluster.url)
    try:
        keys = [make_key(i) for i in range(120)]
        write_keys(writer, keys)
    finally:
        close_tier(writer)
    node = own_redis_cluster.nodes[1]
    owned = _owned(node)
    lost = {key for key in keys if key_slot(writer.remote_key(key)) in owned}
    assert 0 < len(lost) < len(keys)
    node.kill()
    node.start()
    deadline = time.monotonic() + 30
    while not all("cluster_state:ok" in n.cli("cluster", "info") for n in own_redis_cluster.nodes):
        assert time.monotonic() < deadline, "the cluster did not come back"
        time.sleep(0.1)
    reader, opened, counters = _opened(b"slotlogs-restart", own_redis_cluster.url)
    try:
        assert sorted(opened) == sorted(set(keys) - lost) == sorted(general_keys(reader))
        assert counters["fallbacks"] == 1 and counters["opens"] == 2
        out = [torch.zeros(BLOCK, dtype=torch.uint8)]
        assert reader.read_blocks([next(iter(lost))], out) == [False]
    finally:
        close_tier(reader)
    again, opened, counters = _opened(b"slotlogs-restart", own_redis_cluster.url)
    try:
        assert sorted(opened) == sorted(set(keys) - lost) and counters["opens"] == 3
    finally:
        close_tier(again)


def _move_slot(cluster: RedisClusterServers, slot: int, source: RedisServer, target: RedisServer) -> None:
    """Migrate ``slot`` from ``source`` to ``target`` as ``redis-cli --cluster reshard`` does."""
    src, dst = redis.Redis(port=source.port), redis.Redis(port=target.port)
    try:
        src_id, dst_id = src.execute_command("CLUSTER", "MYID"), dst.execute_command("CLUSTER", "MYID")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        for node in cluster.nodes:
            redis.Redis(port=node.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    finally:
        src.close()
        dst.close()


def test_a_slot_that_moved_carries_its_log_with_it(
    own_redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resharding: a slot migrated to another primary takes its log along with its records (the
    same slot), so the next open reads it there, without a SCAN, and adopts exactly the records."""
    writer = _open(b"slotlogs-moved", own_redis_cluster.url)
    try:
        keys = [make_key(i) for i in range(60)]
        write_keys(writer, keys)
        slot = key_slot(writer.remote_key(keys[0]))
        name = _logs(writer).name(slot)
    finally:
        close_tier(writer)
    source = next(n for n in own_redis_cluster.nodes if _owns(n, slot))
    target = next(n for n in own_redis_cluster.nodes if n is not source)
    _move_slot(own_redis_cluster, slot, source, target)
    assert _owns(target, slot) and redis.Redis(port=target.port).exists(name) == 1
    _no_scan(monkeypatch)
    reader, opened, counters = _opened(b"slotlogs-moved", own_redis_cluster.url)
    try:
        assert sorted(opened) == sorted(keys) and counters["opens"] == 3 and counters["fallbacks"] == 0
        out = [torch.zeros(BLOCK, dtype=torch.uint8)]
        assert reader.read_blocks(keys[:1], out) == [True]
        assert torch.equal(out[0], random_block(BLOCK, 0).view(torch.uint8))
    finally:
        monkeypatch.undo()
        close_tier(reader)


def test_a_slot_mid_migration_is_listed_with_scan(own_redis_cluster: RedisClusterServers) -> None:
    """A slot whose log has moved while the slot map still names the source (a migration under
    way): the source answers ASK for the log, so that primary is listed with SCAN, never read
    from a log of the wrong node; the open adopts only records a primary holds."""
    writer = _open(b"slotlogs-migrating", own_redis_cluster.url)
    try:
        keys = [make_key(i) for i in range(60)]
        write_keys(writer, keys)
        slot = key_slot(writer.remote_key(keys[0]))
        name = _logs(writer).name(slot)
    finally:
        close_tier(writer)
    source = next(n for n in own_redis_cluster.nodes if _owns(n, slot))
    target = next(n for n in own_redis_cluster.nodes if n is not source)
    src, dst = redis.Redis(port=source.port), redis.Redis(port=target.port)
    try:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.execute_command("CLUSTER", "MYID"))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.execute_command("CLUSTER", "MYID"))
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", name)  # the log first
        reader, opened, counters = _opened(b"slotlogs-migrating", own_redis_cluster.url)
        try:
            assert counters["fallbacks"] == 1 and "ASK" in counters["last_problem"]
            assert set(opened) <= set(keys) and len(opened) >= len(keys) - 1
            out = [torch.zeros(BLOCK, dtype=torch.uint8)]
            assert reader.read_blocks(keys[:1], out) in ([True], [False])
            if out[0].any():
                assert torch.equal(out[0], random_block(BLOCK, 0).view(torch.uint8))
        finally:
            close_tier(reader)
    finally:
        src.close()
        dst.close()


def test_a_sweep_rewrites_overgrown_and_damaged_slot_logs_and_keeps_appends_made_meanwhile(
    redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys written again and again grow the logs past twice the live keys, and one slot's log is
    damaged: the next sweep writes those logs again from its listing, and a job that stores keys
    while that sweep lists is kept; the next open reads every primary's logs."""
    monkeypatch.setattr(redis_slotlogs, "REWRITE_SLACK", 10)
    backend = _open(b"slotlogs-rewrite", redis_cluster.url)
    client = backend._get_client()
    try:
        keys = [make_key(i) for i in range(60)]
        for _ in range(3):
            write_keys(backend, keys)
        damaged = key_slot(backend.remote_key(keys[1]))
        client.append(_logs(backend).name(damaged), b"x")
        before = backend.stats()["key_log"]["rewrites"]
        late = [make_key(1000 + i) for i in range(8)]
        listing = RedisBackend._list_block_keys

        def listing_with_a_write(self: RedisBackend) -> Any:
            batches = list(listing(self))
            write_keys(backend, late)  # after the sweep read the logs' state, before the rewrite
            return iter(batches)

        monkeypatch.setattr(RedisBackend, "_list_block_keys", listing_with_a_write)
        assert backend._sweep() == set(keys)
        monkeypatch.setattr(RedisBackend, "_list_block_keys", listing)
        rewrites = backend.stats()["key_log"]["rewrites"] - before
        slots = {key_slot(backend.remote_key(k)) for k in keys}
        assert len(slots) <= rewrites <= len(slots | {damaged})
        states = _logs(backend).sweep_state()
        assert states is not None
        assert all(s.problem(33) is None for s in states.values())
        assert sum(s.entries(33) for s in states.values()) == len(keys) + len(late)
        assert backend._sweep() == set(keys + late)  # under twice the keys now: left alone
        assert backend.stats()["key_log"]["rewrites"] - before == rewrites
        _no_scan(monkeypatch)
        reader, opened, counters = _opened(b"slotlogs-rewrite", redis_cluster.url)
        try:
            assert sorted(opened) == sorted(keys + late) and counters["opens"] == 3
        finally:
            close_tier(reader)
    finally:
        close_tier(backend)


def test_a_rewrite_that_another_came_before_is_dropped(redis_cluster: RedisClusterServers) -> None:
    """Two hosts rewrite a slot log from the same state: the second finds the header changed and
    leaves the first's log; a log whose header a rewrite began keeps its later appends."""
    backend = _open(b"slotlogs-two-rewrites", redis_cluster.url)
    client = backend._get_client()
    try:
        keys = [make_key(i) for i in range(20)]
        write_keys(backend, keys)
        logs = _logs(backend)
        slot = key_slot(backend.remote_key(keys[0]))
        mine = [k for k in keys if key_slot(backend.remote_key(k)) == slot]
        states = logs.sweep_state()
        assert states is not None
        state = {slot: states[slot]}
        node = client.get_redis_connection(client.nodes_manager.get_node_from_slot(slot))
        list(logs._on_node(node, lambda wire: logs._rewrite(wire, state, {slot: mine})))
        first = bytes(client.get(logs.name(slot)))
        assert first.startswith(MAGIC) and first[HEADER_BYTES:] == b"".join(b"+" + k for k in mine)
        list(logs._on_node(node, lambda wire: logs._rewrite(wire, state, {slot: []})))
        assert bytes(client.get(logs.name(slot))) == first
    finally:
        close_tier(backend)


def test_a_sweep_reads_the_live_primaries_logs_only(own_redis_cluster: RedisClusterServers) -> None:
    """A dead primary in its backoff: the sweep's state holds the live primaries' slot logs, and
    the sweep lists their records and rewrites nothing of the dead one's."""
    backend = _open(b"slotlogs-down", own_redis_cluster.url)
    try:
        keys = [make_key(i) for i in range(60)]
        write_keys(backend, keys)
        dead = own_redis_cluster.nodes[2]
        dead_slots = _owned(dead)
        gone = {k for k in keys if key_slot(backend.remote_key(k)) in dead_slots}
        dead.kill()
        backend._sweep()
        health = backend._nodes.health[f"127.0.0.1:{dead.port}"]
        assert not health.up
        health._retry_at = float("inf")  # its backoff has not run out
        states = backend._keylog.sweep_state()
        assert states is not None and len(states) == SLOTS - len(dead_slots)
        assert all(s.problem(33) is None for s in states.values())
        assert backend._sweep() == set(keys) - gone
        assert backend.stats()["key_log"]["rewrite_failures"] == 0
    finally:
        close_tier(backend)


def test_clearing_a_tenant_logs_its_deletions_in_the_slot_logs(redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvtier clear --tenant`` on a cluster appends the records it deleted to their slot logs:
    the next open, read from the logs, leaves them out."""
    from kvtier.tools.clear import redis_keys

    backend = _open(b"slotlogs-clear-tenant", redis_cluster.url)
    try:
        keys = [make_key(i) for i in range(40)]
        write_keys(backend, keys)
        backend.write_tags([(k, "chat") for k in keys[:10]] + [(k, "batch") for k in keys[10:]], [])
        doomed = redis_keys(0, backend, "chat")
        assert len(doomed) == 1 and doomed[0].delete() == 10
    finally:
        close_tier(backend)
    _no_scan(monkeypatch)
    reader, opened, counters = _opened(b"slotlogs-clear-tenant", redis_cluster.url)
    try:
        assert sorted(opened) == sorted(keys[10:]) and counters["opens"] == 3
    finally:
        close_tier(reader)


def test_bulk_bodies_read_what_a_reply_at_a_time_reads() -> None:
    """The wire's bulk reads (in Python, values taken straight from its buffer when whole there;
    with hiredis, a buffer's replies at a time; each value's head checked and the rest kept as
    it is read) give the lengths, bodies, errors and first unmarked value that reading the same
    stream a reply at a time gives: values small and large (over the read buffer and the scratch
    buffer's first size), shorter than a head, with and without the mark, empty, nil, errors,
    and values cut by the buffer's edge."""
    import random as rnd
    import socket
    import threading as th

    from kvtier.backends.redis_wire import ErrorReply, Scratch, Wire

    head, skip = b"mark", HEADER_BYTES
    gen = rnd.Random(7)

    def stream_of(marked_only: bool) -> tuple[bytes, int]:
        replies: list[bytes] = []
        for i in range(3000):
            kind = gen.random()
            if kind < 0.05 and not marked_only:
                replies.append(b"$-1\r\n")
            elif kind < 0.08 and not marked_only:
                replies.append(b"-MOVED %d 127.0.0.1:1\r\n" % i)
            else:
                n = gen.choice([0, 1, 31, 32, 33, 65, 500, 4000, 70_000]) + gen.randrange(3)
                if marked_only:
                    n = max(n, skip)
                value = bytes(gen.getrandbits(8) for _ in range(min(n, 64))) * (n // 64 + 1)
                if marked_only or gen.random() < 0.9:
                    value = head + value
                replies.append(b"$%d\r\n%b\r\n" % (n, value[:n]))
        return b"".join(replies), len(replies)

    def read(stream: bytes, count: int, bulk: bool, fast: bool = False) -> tuple[bytes, list[int], dict[int, str], int]:
        a, b = socket.socketpair()
        feeder = th.Thread(target=lambda: (a.sendall(stream), a.close()))
        feeder.start()
        wire = Wire(b)
        try:
            if bulk:
                body = Scratch(4096)
                parse = wire.bulk_bodies if fast else wire.bulk_bodies_general
                lengths, errors, unmarked = parse(count, head, skip, body)
                with body.view() as view:
                    rest = bytes(view)
                body.close()
                return rest, lengths, errors, unmarked
            rest, lengths, errors, unmarked = b"", [], {}, -1
            for i in range(count):
                try:
                    value = wire.reply()
                except ErrorReply as exc:
                    lengths.append(-2)
                    errors[i] = str(exc)
                    unmarked = i if unmarked < 0 else unmarked
                    continue
                lengths.append(-1 if value is None else len(value))
                if value is None or len(value) < skip or not value.startswith(head):
                    unmarked = i if unmarked < 0 else unmarked
                rest += (value or b"")[skip:]
            return rest, lengths, errors, unmarked
        finally:
            feeder.join()
            b.close()

    for marked_only in (False, True):
        stream, count = stream_of(marked_only)
        got = read(stream, count, True)
        assert got == read(stream, count, False) == read(stream, count, True, fast=True)
        assert (got[3] == -1) == marked_only


def test_an_open_reads_the_slot_logs_off_the_heap(redis_cluster: RedisClusterServers) -> None:
    """A primary's slot logs are read into a mapping of their own, never into a buffer from the
    allocator (one left on a worker thread's heap stays resident after the open): reading 6 MB
    of entries traces under a quarter of that (the pipeline's commands, the heads and lengths:
    under 1 MB for 5,461 slots), and the entries come out whole, in slot order."""
    import tracemalloc

    from kvtier.backends.redis_wire import Scratch, Wire

    backend = _open(b"slotlogs-off-heap", redis_cluster.url)
    try:
        logs = _logs(backend)
        primary = backend._get_client().get_primaries()[0]
        node = backend._get_client().get_redis_connection(primary)
        slots = logs._slots_of(node)
        per_slot = 6_000_000 // 33 // len(slots) + 1
        client = backend._get_client()
        expected = []
        pipe = client.pipeline(transaction=False)
        for slot in slots:
            entries = b"".join(b"+" + make_key(slot * 1000 + i) for i in range(per_slot))
            pipe.set(logs.name(slot), MAGIC + bytes(HEADER_BYTES - len(MAGIC)) + entries)
            expected.append(entries)
        pipe.execute()
        conn = node.connection_pool.get_connection()
        entries_read = Scratch()
        try:
            tracemalloc.start()
            try:
                problem = logs._read_logs(Wire(conn._sock), slots, entries_read)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            with entries_read.view() as view:
                got = bytes(view)
        finally:
            entries_read.close()
            node.connection_pool.release(conn)
        assert problem is None
        assert got == b"".join(expected) and len(got) > 6_000_000
        assert peak < len(got) // 4
        # each connection's hiredis buffer lives as long as it does: redis-py's default, not 1 MiB
        pools = [client.get_redis_connection(n).connection_pool for n in client.get_primaries()]
        assert all(pool.connection_kwargs["socket_read_size"] <= 1 << 16 for pool in pools)
    finally:
        close_tier(backend)


@pytest.mark.parametrize("prefix", [b"kvtier:0123456789abcdef:", b"odd{tag}:0123456789abcdef:", b"open{:"])
def test_a_put_shares_appends_are_the_general_ones(prefix: bytes) -> None:
    """The put path's slot grouping (the prefix's CRC once, each key's continued from it) and its
    ``APPEND`` commands (one format each) are the cluster's own rule (``key_slot`` of the whole
    name) and the general command's: random keys, keys holding braces that make a hash tag or
    do not, and prefixes with braces, whose keys all take the general rule."""
    import random as rnd

    from kvtier.backends.redis_keylog import DELETED, STORED, command, entries_of
    from kvtier.backends.redis_slotlogs import append_commands, slot_log_name, slots_of

    gen = rnd.Random(5)
    keys = [gen.randbytes(32) for _ in range(3000)]
    keys += [gen.randbytes(5) + b"{" + gen.randbytes(7) + b"}" + gen.randbytes(18) for _ in range(200)]
    keys += [b"{}" + gen.randbytes(30), b"}" * 16 + b"{" * 16, b"{" + bytes(31)]
    general: dict[int, list[bytes]] = {}
    for key in keys:
        general.setdefault(key_slot(prefix + key), []).append(key)
    assert slots_of(prefix, keys) == general
    for op in (STORED, DELETED):
        want = b"".join(command(b"APPEND", slot_log_name(prefix, slot), entries_of(part, op)) for slot, part in general.items())
        assert append_commands(prefix, keys, op) == (want, len(general))


def test_an_opens_slot_map_and_gets_are_the_general_ones(redis_cluster: RedisClusterServers) -> None:
    """The slots given each primary (the client's slot map walked a range of slots at a time) and
    the open's ``GET`` pipeline (one format a slot) are those of a walk slot by slot and of the
    general command: every slot once, each on the primary ``CLUSTER NODES`` says serves it."""
    from kvtier.backends.redis_keylog import command

    backend = _open(b"slotlogs-map", redis_cluster.url)
    try:
        logs = _logs(backend)
        client = backend._get_client()
        general: dict[str, list[int]] = {}
        for slot, nodes in client.nodes_manager.slots_cache.items():
            general.setdefault(nodes[0].name, []).append(slot)
        seen: list[int] = []
        for primary in client.get_primaries():
            node = client.get_redis_connection(primary)
            slots = logs._slots_of(node)
            assert slots == sorted(general[primary.name])
            pieces = logs._gets(slots)
            assert all(len(piece) < 64 << 10 for piece in pieces)  # small buffers, never one of every slot
            assert b"".join(pieces) == b"".join(command(b"GET", logs.name(slot)) for slot in slots)
            seen += slots
        assert sorted(seen) == list(range(SLOTS))
        for server in redis_cluster.nodes:
            owned = _owned(server)
            node = next(client.get_redis_connection(p) for p in client.get_primaries() if p.port == server.port)
            assert set(logs._slots_of(node)) == owned
    finally:
        close_tier(backend)


def test_the_feed_follows_its_stream_to_the_primary_its_slot_moved_to(own_redis_cluster: RedisClusterServers) -> None:
    """The change feed reads and writes its stream through a client of the primary that holds
    the stream's slot, not a cluster client of its own (a second slot map and command table,
    about 2 MB a process). When the slot moves to another primary, the first command redirected
    drops that client, and the next one reaches the stream where it is now, entries included."""
    from kvtier.backends.change_feed import FeedOp, encode_entry

    backend = _open(b"slotlogs-feed", own_redis_cluster.url)
    feed = backend._make_feed()  # the feed the tier's follower reads, on a client of its own
    try:
        keys = [make_key(i) for i in range(3)]

        def entry(key: bytes) -> bytes:
            return encode_entry(FeedOp.STORED, [key], feed.writer, 1.0)

        start = feed.head()
        assert feed.append([entry(keys[0])])
        assert type(feed._client) is redis.Redis  # one primary's client, no slot map
        slot = key_slot(feed.stream)
        source = next(n for n in own_redis_cluster.nodes if _owns(n, slot))
        target = next(n for n in own_redis_cluster.nodes if n is not source)
        _move_slot(own_redis_cluster, slot, source, target)
        assert not feed.append([entry(keys[1])]) and feed._client is None  # redirected: dropped
        assert feed.append([entry(keys[2])])
        assert feed._client.connection_pool.connection_kwargs["port"] == target.port
        assert [e.keys for e in feed.read(start, 0.01).entries] == [(keys[0],), (keys[2],)]
    finally:
        feed.close()
        close_tier(backend)
