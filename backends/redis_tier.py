"""``redis``: a tier shared by every host, on a Redis server or a Redis Cluster.

One :mod:`kvtier.records.format` record (header, optional MAC tag, codec payload) per key, stored under
``<prefix>:<namespace digest, 16 hex>:<32-byte key>``, so namespaces never meet and one ``SCAN``
pattern lists a store's records. Records bind their key (checksum or, with ``mac_key``, an
HMAC): a record copied under another key, damaged, or planted by someone without the secret is a
miss, deleted and counted, never wrong data.

I/O: each job is one pipelined exchange per server node (cut into shares on a few connections,
see :mod:`kvtier.backends.remote_shares`), never a round trip per block. Writes are ``SET``
(``PX`` with ``ttl_s``) sent as header and payload buffers, without joining them, one request in
flight on each of a few connections (:func:`kvtier.backends.redis_wire.send_one_each`, from the
share's one thread): each record is checksummed right before it goes out, so the checksums
overlap the server's storing of the records in flight, and every read the server makes is one
whole command, which it keeps as the value instead of copying it out. Reads are ``GET`` (``GETEX ...
PX`` with ``ttl_s``, a sliding expiry) with a bounded window of requests in flight (about 1 MiB
of replies per connection: whole-job pipelines of large replies measured slower than a serial
loop); records of 256 KiB and more are read striped over the put's connections and received in
order (``_STRIPE_MIN_BYTES``). With ``cluster: true`` a job is split by hash slot into one batch per primary, and the
batches run in parallel.

What every remote tier shares (the index view, records, health and backoff, secrets, job
shares) is :class:`kvtier.backends.remote_tier.RemoteRecordBackend`'s; this module keeps what is
Redis's own: the URL and connections, the wire exchanges, hash slots and the ``SCAN`` sweep
(the primaries' routes, health and listings: :mod:`kvtier.backends.redis_nodes`).

The index lives on the server. Each job's writes and deletes are published to a capped stream
per namespace (:mod:`kvtier.backends.redis_feed`; ``feed: false`` turns it off), which every
engine's :class:`~kvtier.backends.feed_follower.TierFollower` reads to keep its manager's index
in step; a ``SCAN`` sweep every ``sync_interval_s`` (60 s with the feed, 1 s without) is the
backstop. A store's open reads the keys from the namespace's key log instead of a ``SCAN``
(each put share appends the keys it stored; :mod:`kvtier.backends.redis_keylog`, which also
says when the log is not trusted; a cluster keeps a log per hash slot,
:mod:`kvtier.backends.redis_slotlogs`). Lookups never touch the network. A key the index still claims but the server
evicted is a load miss.

Faults: every socket call has a timeout (``socket_timeout_s``, ``connect_timeout_s``). A
connection failure marks the tier *down*: one warning is logged, ``outages`` counts it, and
until the next retry (exponential backoff, 0.1 s to 5 s) stores fail at once (``None``) and
loads miss, with no network wait. The next call or index sweep after the backoff reconnects;
success logs the outage's length. A pool with no connection to give is not a dead server: the
share waits for one (see :mod:`kvtier.backends.redis_pool`, which also sizes the pool's users).
Nothing here raises into the engine for a dead server. In a
cluster each primary has its own down state (one dead primary misses its own slots only), and a
call returns only once every primary's share has ended, failed ones included, so nothing writes
into the caller's rows after it returned.

Secrets (``password``, ``mac_key``) are never logged, never in ``repr`` or ``to_dict``; give them
through ``password_env`` / ``mac_key_env`` to keep them out of config files. A password in the
URL (``redis://user:secret@host``, or ``?password=secret`` in its query) is moved out of it at
construction (:mod:`kvtier.backends.redis_client`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from functools import partial
from typing import Any, ClassVar

from kvtier.backends.feed_follower import TierFollower
from kvtier.backends.redis_client import client_options, credentials, probe_problem
from kvtier.backends.redis_feed import RedisFeed
from kvtier.backends.redis_keylog import DELETED, KeyLog, TierKeyLog
from kvtier.backends.redis_nodes import DOWN_ERRORS as _DOWN_ERRORS
from kvtier.backends.redis_nodes import RedisNodes
from kvtier.backends.redis_pool import ConnectionBudget, PoolGate
from kvtier.backends.redis_scan import SCAN_COUNT, scan_block_keys
from kvtier.backends.redis_slotlogs import SlotLogs
from kvtier.backends.redis_tags import read_redis_tags, write_redis_tags
from kvtier.backends.redis_wire import (
    ErrorReply,
    Wire,
    get_command,
    receive_record,
    send_one_each,
    set_command,
    unlink_command,
)
from kvtier.backends.remote_health import Down, Health
from kvtier.backends.remote_listing import Listed
from kvtier.backends.remote_tier import (
    FEED_MAXLEN,
    KEY_BYTES,
    ReadJob,
    RemoteRecordBackend,
    Route,
    WriteJob,
    check_seconds,
)

from kvtier.errors import BackendError, ConfigError, MissingDependencyError
from kvtier.records.codec import Codec
from kvtier.records.format import DEFAULT_MAC_ALGORITHM

try:
    import redis
    from redis.cluster import RedisCluster
    from redis.exceptions import RedisError, ResponseError
except ImportError as exc:  # pragma: no cover - redis is a dependency; a broken install says so
    raise MissingDependencyError(f"the redis backend needs redis-py: pip install 'redis[hiredis]' ({exc})") from exc

__all__ = ["RedisBackend"]

log = logging.getLogger("kvtier")

#: Bytes of GET replies in flight per connection (at least one reply). A job runs on up to
#: ``job_connections`` connections at once (see :mod:`kvtier.backends.remote_shares`), so about
#: 4 MiB in flight in all: with 16 MiB on one connection the server spent half again as much CPU
#: per job on its output buffers (64 KiB records, measured here).
_READ_WINDOW_BYTES = 1 << 20
#: Records at least this large are read striped over the put's connections (see ``_read_share``):
#: redis-server writes at most 64 KiB to one client per turn of its event loop, so a 2 MiB reply
#: on one connection takes 32 turns, where four connections are filled four at a time. Measured
#: here (2 cores, redis-server 7.0, 256 GETs of 2 MiB): the server's CPU per GB 0.35-0.37 s
#: against 0.39-0.45, and 2.6-2.8 GB/s against 2.3-2.4. Smaller records stay on one connection:
#: 4096 GETs of 64 KiB striped over four cost the client a quarter more CPU per GB (0.69 s
#: against 0.56-0.62) and ran at 1.44 GB/s against 1.57-1.71.
_STRIPE_MIN_BYTES = 256 << 10


def _receive(wire: Wire, key: bytes, length: int, mac: Any, view: memoryview) -> None:
    receive_record(wire, key, view, length, mac)


class RedisBackend(RemoteRecordBackend):
    """Records on a Redis server (``url``) or a Redis Cluster (``cluster: true``)."""

    name: ClassVar[str] = "redis"
    down_errors: ClassVar[tuple[type[BaseException], ...]] = _DOWN_ERRORS
    refused_errors: ClassVar[tuple[type[BaseException], ...]] = (RedisError,)

    def __init__(
        self,
        *,
        capacity: int | str,
        url: str = "redis://127.0.0.1:6379/0",
        cluster: bool = False,
        username: str | None = None,
        password: str | None = None,
        password_env: str | None = None,
        prefix: str = "kvtier",
        ttl_s: float | None = None,
        codec: str | dict[str, Any] | Codec | None = "none",
        mac_key: bytes | str | None = None,
        mac_key_env: str | None = None,
        mac_algorithm: str = DEFAULT_MAC_ALGORITHM,
        max_connections: int = 32,
        job_connections: int | str = "auto",
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        sync_interval_s: float | None = None,
        feed: bool = True,
        feed_maxlen: int = FEED_MAXLEN,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        url, self.username, self._secret = credentials(url, username, password, password_env)
        super().__init__(
            capacity=capacity, where=url, prefix=prefix, codec=codec, mac_key=mac_key, mac_key_env=mac_key_env,
            mac_algorithm=mac_algorithm, sync_interval_s=sync_interval_s, feed=feed, feed_maxlen=feed_maxlen,
        )
        self.url = url
        self._password = self._secret.value
        if not isinstance(cluster, bool):
            raise ConfigError(f"cluster: expected true or false, got {cluster!r}")
        check_seconds(ttl_s=ttl_s, socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s)
        # One store and one load in flight, each at its widest, fit in the pool with the index
        # sweep (see kvtier.backends.redis_pool): checked here, with both fields named.
        self.budget = ConnectionBudget.of(max_connections, job_connections)
        #: as configured ("auto" or a count); ``job_connections`` is the count in use
        self.job_connections_setting = job_connections
        self.job_connections = self.budget.job_connections
        self.ttl_s = None if ttl_s is None else float(ttl_s)
        self.cluster = cluster
        self.max_connections = max_connections
        self.socket_timeout_s = float(socket_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.tls = {"tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file, "tls_key_file": tls_key_file}
        if any(self.tls.values()) and not self.url.startswith("rediss://"):
            raise ConfigError("url: TLS files are given, so the URL must use rediss://")
        # An exhausted pool is back-pressure: wait for a connection, at most one socket timeout.
        self._gate = PoolGate(self.socket_timeout_s)
        self._client: Any = None  # redis.Redis or RedisCluster, built in open()
        self._client_lock = threading.Lock()
        #: the primaries: routes, health per cluster node, listings (kvtier.backends.redis_nodes)
        self._nodes = RedisNodes(self)
        #: the names of the records stored, read at open instead of a SCAN (kvtier.backends.redis_keylog;
        #: a cluster's, one per hash slot: kvtier.backends.redis_slotlogs)
        self._keylog: TierKeyLog = SlotLogs(self, KEY_BYTES) if cluster else KeyLog(self, KEY_BYTES)
        self._ttl_ms = b""

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        return f"RedisBackend({kind} {self.url!r}, prefix={self.prefix!r})"

    # -- configuration ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data.update(url=self.url, cluster=self.cluster)
        if self.username is not None:
            data["username"] = self.username
        data.update(self._secret.describe())  # never the secret; from_dict asks for it again
        if self.ttl_s is not None:
            data["ttl_s"] = self.ttl_s
        data.update(
            max_connections=self.max_connections,
            job_connections=self.job_connections_setting,
            socket_timeout_s=self.socket_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
        )
        data.update({k: v for k, v in self.tls.items() if v is not None})
        return data

    def probe(self, timeout_s: float) -> str | None:
        """Connect once and ``PING``, waiting at most ``timeout_s`` per socket call; ``None`` when
        the server answers, else what went wrong (unreachable, authentication, TLS, a bad
        database number), naming the URL and never a secret. Opens nothing the tier keeps: this
        is what ``kvtier config check`` asks of a remote tier."""
        options = client_options(self.username, self._password, self.tls, timeout_s, timeout_s, 1)
        try:
            if self.cluster:
                client: Any = RedisCluster.from_url(self.url, **options)
            else:
                client = redis.Redis.from_url(self.url, **options)
            try:
                client.ping()
            finally:
                client.close()
        except (RedisError, OSError) as exc:  # OSError: a TLS file that cannot be read, say
            return f"{self.url}: {probe_problem(exc, self.url)}"
        return None

    # -- connections -----------------------------------------------------------------------------
    def _make_feed(self) -> RedisFeed:
        """A capped stream next to the namespace's records, on a client of its own (two
        connections: the follower's blocking read never holds one a job waits for). In a
        cluster that client is one of the primary that holds the stream's slot, found in the
        tier's own client's slot map (read again for every client after the first: the feed
        drops its client when the slot moved or the connection was lost). A cluster client of
        its own kept a second slot map and command table, about 2 MB a process."""
        wait = TierFollower.wait_s_default
        options = client_options(
            self.username, self._password, self.tls, max(self.socket_timeout_s, wait + 1.0), self.connect_timeout_s, 2
        )
        stream = self._prefix_bytes + b"feed"
        made = 0

        def make_client() -> Any:
            nonlocal made
            if not self.cluster:
                return redis.Redis.from_url(self.url, **options)
            cluster = self._get_client()
            if made:  # the slot may have moved since the map was read
                cluster.nodes_manager.initialize()
            made += 1
            node = cluster.get_node_from_key(stream)
            return redis.Redis(host=node.host, port=node.port, ssl=self.url.startswith("rediss://"), **options)

        return RedisFeed(stream, make_client, maxlen=self.feed_maxlen)

    async def open(self, fmt: Any) -> None:
        if self.ttl_s is not None:
            self._ttl_ms = str(max(1, round(self.ttl_s * 1000))).encode()
        await super().open(fmt)

    def _connect(self) -> None:
        self._get_client()

    def _read_meta(self) -> bytes | None:
        raw = self._get_client().get(self._meta_key)
        return None if raw is None else bytes(raw)

    def _write_meta(self, value: bytes, only_new: bool) -> None:
        self._get_client().set(self._meta_key, value, nx=only_new)

    def _get_client(self) -> Any:
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._client is None:
                self._check_open()
                options = client_options(
                    self.username, self._password, self.tls, self.socket_timeout_s, self.connect_timeout_s, self.max_connections
                )
                nodes = 1
                if self.cluster:
                    # The constructor reads the slot map: I/O, hence here and not in __init__.
                    self._client = RedisCluster.from_url(self.url, **options)
                    nodes = max(1, len(self._client.get_primaries()))
                else:
                    self._client = redis.Redis.from_url(self.url, **options)
                self._start_io_threads(self.budget.io_threads(nodes))
            return self._client

    def _disconnect(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- routing ---------------------------------------------------------------------------------
    def _rkey(self, key: bytes) -> bytes:
        return self.remote_key(key)

    def _routes(self, rkeys: Sequence[bytes]) -> list[Route]:
        """``(health, connection pool, positions)`` per node that holds the keys' slots: the
        tier's health for a single server, the node's own in a cluster."""
        return self._nodes.routes(rkeys)

    def _healths(self) -> list[Health]:
        return self._nodes.healths()

    def _note_failure(self, exc: BaseException) -> None:
        self._nodes.note_failure(exc)

    def _exchange(self, pool: Any, body: Any) -> None:
        """Run ``body(wire)`` on a pooled connection; a dead socket raises :class:`Down`."""
        self._exchange_many(pool, 1, lambda wires: body(wires[0]))

    def _exchange_many(self, pool: Any, count: int, body: Any) -> None:
        """Run ``body(wires)`` on up to ``count`` pooled connections at once (at least one: when
        the pool has no more to give, fewer); a dead socket raises :class:`Down`. Each
        connection goes back to the pool, disconnected unless every reply on it was read."""
        conns = [self._gate.borrow(pool)]  # connected and authenticated by redis-py
        drained: list[bool] = []  # per connection, once ``body`` has returned
        try:
            while len(conns) < count:
                try:
                    conns.append(pool.get_connection())
                except _DOWN_ERRORS as exc:  # "Too many connections": do with those in hand
                    log.debug("redis: a share on %d connections instead of %d: %s", len(conns), count, exc)
                    break
            wires = [Wire(conn._sock) for conn in conns]
            body(wires)
            drained = [wire.drained for wire in wires]
        except _DOWN_ERRORS as exc:
            raise Down(exc) from exc
        finally:
            for k, conn in enumerate(conns):
                if k >= len(drained) or not drained[k]:  # unknown stream position: never hand it out again
                    conn.disconnect()
                pool.release(conn)
            self._gate.returned()

    def _refused(self, what: str, exc: ErrorReply) -> None:
        text = str(exc)
        if text.startswith(("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")):
            self._nodes.refresh_slots = True
        log.debug("redis: %s refused: %s", what, text)

    # -- one share's exchange --------------------------------------------------------------------
    def _write_share(self, pool: Any, positions: list[int], *, job: WriteJob) -> None:
        keys, rkeys, sizes = job.keys, job.rkeys, job.sizes
        ttl = self._ttl_ms
        stored: dict[int, int] = {}

        def requests() -> Iterator[tuple[int, tuple[Any, ...]]]:
            # Encoded (checksummed) one by one as connections come free: each record goes
            # out while its bytes are still in the CPU cache, and the server stores the
            # ones in flight while the next is hashed (see redis_wire.send_one_each).
            for i in positions:
                block = job.sent_from(i)
                if block is None:
                    continue  # no longer a block (WriteJob.refused)
                head, payload = self._encode_one(keys[i], block)
                if job.left(i):
                    continue  # its row left the memory encoded: not sent (WriteJob.left)
                size = stored[i] = len(head) + len(payload)
                before, after = set_command(rkeys[i], head, size, ttl)
                yield i, (before, payload, after)

        def on_reply(i: int, error: ErrorReply | None) -> None:
            if error is not None:
                self._refused("SET", error)
            else:
                sizes[i] = stored[i]

        def body(wires: list[Wire]) -> None:
            send_one_each(wires, requests(), on_reply, self.socket_timeout_s)
            # The stored records' names, once the server has them all (kvtier.backends.redis_keylog).
            append, count = self._keylog.append_commands(keys[i] for i in positions if sizes[i] is not None)
            if count:
                wires[0].send([append])
                self._keylog.appended(wires[0], count)

        self._exchange_many(pool, min(len(positions), self.budget.put_connections), body)

    def _read_share(self, pool: Any, positions: list[int], *, job: ReadJob) -> None:
        keys, rkeys = job.keys, job.rkeys
        size = self.format.block_bytes
        window = max(1, _READ_WINDOW_BYTES // (size + self._head_bytes()))
        stripes = self.budget.stripes if size >= _STRIPE_MIN_BYTES else 1
        ttl = self._ttl_ms

        def body(wires: list[Wire]) -> None:
            # Striped: the j-th record of the share on connection j % len(wires), received
            # in order, each connection's window topped up as its replies come in.
            count = len(wires)
            lanes = [positions[k::count] for k in range(count)]
            commands = [[get_command(rkeys[i], ttl) for i in lane] for lane in lanes]
            per = max(1, window // count)
            refill = max(1, per // 2)
            sent = [0] * count
            for k, wire in enumerate(wires):
                sent[k] = min(per, len(lanes[k]))
                wire.send([b"".join(commands[k][: sent[k]])])
            for j, i in enumerate(positions):
                k, received = j % count, j // count + 1
                wire = wires[k]
                try:
                    length = wire.bulk_length()
                except ErrorReply as exc:
                    self._refused("GET", exc)
                    length = -1
                    if str(exc).startswith("WRONGTYPE"):  # not a record at all
                        job.unreadable.append(keys[i])
                total = len(lanes[k])
                if sent[k] < total and sent[k] - received < refill:
                    # Top the window up in batches, before this value arrives: the server
                    # works on the next requests while this one is being received.
                    upto = min(total, sent[k] + refill)
                    wire.send([b"".join(commands[k][sent[k] : upto])])
                    sent[k] = upto
                if length >= 0:
                    job.found[i] = self._accept(job, i, partial(_receive, wire, keys[i], length, self.mac), landing=True)

        self._exchange_many(pool, min(len(positions), stripes), body)

    def _delete_records(self, pool: Any, rkeys: list[bytes]) -> int:
        deleted = 0

        def body(wire: Wire) -> None:
            nonlocal deleted
            # One UNLINK per key: a multi-key UNLINK is refused across cluster slots.
            plen = len(self._prefix_bytes)
            append, count = self._keylog.append_commands((rk[plen:] for rk in rkeys), DELETED)  # replayed by the next open
            wire.send([b"".join(unlink_command(rk) for rk in rkeys) + append])
            for _ in rkeys:
                try:
                    deleted += int(wire.reply())
                except ErrorReply as exc:
                    self._refused("UNLINK", exc)
            if count:
                self._keylog.appended(wire, count)

        self._exchange(pool, body)
        return deleted

    # -- the shared index --------------------------------------------------------------------------
    def _list_keys(self) -> Iterator[bytes]:
        """Every key under the prefix (``SCAN`` through redis-py on each primary, ``SCAN_COUNT`` at
        a time): the general listing; the sweeps use :meth:`_list_block_keys`."""
        pattern = self._prefix_bytes + b"*"
        return self._nodes.each(lambda node: node.scan_iter(match=pattern, count=SCAN_COUNT))

    def _open_table(self) -> Listed | None:
        """The open's keys: read from the key log where it is trusted, else listed with ``SCAN``
        (and the log written again): :mod:`kvtier.backends.redis_keylog`; as a list, a key maybe
        more than once (:meth:`RemoteListing._listing`)."""
        return self._keylog.open_table(partial(self._listing, as_list=True))

    def _sweep(self) -> AbstractSet[bytes] | None:
        """A ``SCAN`` sweep of the index; the key log rewritten from it when it grew over twice
        the keys listed, or is untrusted (its state read before the listing begins). While the
        server is down and its backoff runs, nothing is tried (the listing would skip it too)."""
        if self._closed or not self._health.allow():
            return None
        state = self._keylog.sweep_state()
        found = self._listing()
        if found is None:
            return None
        self._keylog.after_sweep(state, found)
        return found.keys()

    def _list_block_keys(self) -> Iterator[list[bytes]]:
        """The block keys of every record under the prefix, a ``SCAN`` step at a time: records
        only, the prefix cut off, parsed a reply at a time (:mod:`kvtier.backends.redis_scan`);
        a cluster's primaries are listed at once."""
        prefix = self._prefix_bytes

        def listing(node: Any) -> Iterator[list[bytes]]:
            pool = node.connection_pool
            conn = pool.get_connection()  # MaxConnectionsError: the pool is busy (see RedisNodes.each)
            wire = Wire(conn._sock)
            try:
                yield from scan_block_keys(wire, prefix, KEY_BYTES, SCAN_COUNT)
            except ErrorReply as exc:  # refused (an ACL without SCAN, say): as redis-py reports it
                raise ResponseError(str(exc)) from exc
            finally:
                if not wire.drained:  # an error, or a caller that stopped early: replies unread
                    conn.disconnect()
                pool.release(conn)

        return self._nodes.each(listing, parallel=True)

    def read_tags(self) -> tuple[dict[bytes, str], list[bytes]] | None:
        self._check_open()
        try:
            return read_redis_tags(self._get_client(), self._prefix_bytes)
        except RedisError as exc:
            raise BackendError(f"redis: tenant tags not read from {self.url}: {exc}") from exc

    def write_tags(
        self, tenants: Sequence[tuple[bytes, str]], pins: Sequence[tuple[bytes, bool]], *, whole: bool = False, sync: bool = True
    ) -> None:
        if self._closed or not self._health.allow():
            return
        try:
            write_redis_tags(self._get_client(), self._prefix_bytes, tenants, pins, whole=whole)
        except RedisError as exc:  # tags are bookkeeping: the tier serves blocks without them
            log.warning("redis: tenant tags not saved to %s: %s", self.url, exc)

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        data.update(url=self.url, cluster=self.cluster, pool_waits=self._gate.waits, pool_busy=self._gate.busy)
        data["key_log"] = self._keylog.stats()
        if self.cluster:
            data["nodes_down"] = sum(1 for h in self._nodes.health.values() if not h.up)
        return data
