"""``redis``: a tier shared by every host, on a Redis server or a Redis Cluster.

One :mod:`kvtier.records.format` record (header, optional MAC tag, codec payload) per key, stored under
``<prefix>:<namespace digest, 16 hex>:<32-byte key>``, so namespaces never meet and one ``SCAN``
pattern lists a store's records. Records bind their key (checksum or, with ``mac_key``, an
HMAC): a record copied under another key, damaged, or planted by someone without the secret is a
miss, deleted and counted, never wrong data.

I/O: each job is one pipelined exchange per server node (cut into shares on a few connections,
see :mod:`kvtier.backends.redis_shares`), never a round trip per block. Writes are ``SET``
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

The index lives on the server. :class:`kvtier.backends.shared_index.SharedIndexView` keeps the manager's
local index of this tier in step (periodic ``SCAN``, every ``sync_interval_s``); lookups never
touch the network. A key the view still claims but the server evicted is a load miss.

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
construction.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import torch
from kvtier.backends.redis_meta import MetaVerdict, judge_meta, meta_value
from kvtier.backends.redis_pool import ConnectionBudget, PoolBusy, PoolGate
from kvtier.backends.redis_shares import run_all, split_shares
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
from kvtier.backends.shared_index import SharedIndexView

from kvtier.backend import BlockFormat, RecordInfo
from kvtier.errors import BackendError, ConfigError, CorruptBlockError, MissingDependencyError
from kvtier.records.codec import Codec, UnsupportedRecordError
from kvtier.records.format import (
    DEFAULT_MAC_ALGORITHM,
    RecordBackend,
)

try:
    import redis
    from redis.cluster import RedisCluster
    from redis.exceptions import (
        AskError,
        ClusterDownError,
        InvalidResponse,
        MaxConnectionsError,
        MovedError,
        RedisError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - redis is a dependency; a broken install says so
    raise MissingDependencyError(f"the redis backend needs redis-py: pip install 'redis[hiredis]' ({exc})") from exc

__all__ = ["RedisBackend"]

log = logging.getLogger("kvtier")

_HIDDEN = "<hidden>"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_KEY_BYTES = 32
#: Bytes of GET replies in flight per connection (at least one reply). A job runs on up to
#: ``job_connections`` connections at once (see :mod:`kvtier.backends.redis_shares`), so about
#: 4 MiB in flight in all: with 16 MiB on one connection the server spent half again as much CPU
#: per job on its output buffers (64 KiB records, measured here).
_READ_WINDOW_BYTES = 1 << 20
#: Records at least this large are read striped over the put's connections (see ``read_blocks``):
#: redis-server writes at most 64 KiB to one client per turn of its event loop, so a 2 MiB reply
#: on one connection takes 32 turns, where four connections are filled four at a time. Measured
#: here (2 cores, redis-server 7.0, 256 GETs of 2 MiB): the server's CPU per GB 0.35-0.37 s
#: against 0.39-0.45, and 2.6-2.8 GB/s against 2.3-2.4. Smaller records stay on one connection:
#: 4096 GETs of 64 KiB striped over four cost the client a quarter more CPU per GB (0.69 s
#: against 0.56-0.62) and ran at 1.44 GB/s against 1.57-1.71.
_STRIPE_MIN_BYTES = 256 << 10
#: Keys remembered as not loadable (see ``RedisBackend._unreadable``): 32 bytes each.
_UNREADABLE_MAX = 100_000
#: Socket read size of the hiredis parser (redis-py's default is 64 KiB): fewer recv calls.
_SOCKET_READ_BYTES = 1 << 20
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0
_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class _Down(Exception):
    """A node could not be reached; the caller fails the group and marks the tier down."""


class _Health:
    """Up/down state with exponential backoff, shared by the data path and the index sweeps."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = _BACKOFF_FIRST_S
        self._lock = threading.Lock()
        self.outages = 0
        self.connection_errors = 0
        self.fast_failures = 0

    @property
    def up(self) -> bool:
        return self.down_since is None

    def allow(self) -> bool:
        """Whether to touch the network now (up, or the backoff since the last failure ran out)."""
        return self.down_since is None or time.monotonic() >= self._retry_at

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self.connection_errors += 1
            if self.down_since is None:
                self.down_since = now
                self.outages += 1
                self._backoff = _BACKOFF_FIRST_S
                log.warning(
                    "redis: %s unreachable (%s: %s); stores fail and loads miss until it is back",
                    self.where, type(exc).__name__, exc,
                )
            else:
                self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)
            self._retry_at = now + self._backoff

    def succeeded(self) -> bool:
        """Mark up; ``True`` if this ended an outage."""
        if self.down_since is None:
            return False
        with self._lock:
            since, self.down_since = self.down_since, None
            self._backoff = _BACKOFF_FIRST_S
        if since is not None:
            log.warning("redis: %s is back after %.1f s", self.where, time.monotonic() - since)
            return True
        return False


def _split_url(url: str) -> tuple[str, str | None, str | None]:
    """``(url without credentials, username, password)``; checks the scheme. Credentials come
    out of the user part (``redis://user:secret@host``) and out of the query
    (``?username=...&password=...``, which redis-py accepts too): the URL kept (for ``repr``,
    ``to_dict`` and every log line) holds neither."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"url: expected a redis:// or rediss:// URL, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"url: expected a redis:// or rediss:// URL, got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise ConfigError("url: the URL names no host")
    found = {"username": unquote(parts.username) if parts.username else None}
    found["password"] = unquote(parts.password) if parts.password is not None else None
    query = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in found:
            query.append((name, value))
        elif found[name] is not None:
            raise ConfigError(f"url: the {name} is given twice in the URL (user part or query)")
        else:
            found[name] = value
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    clean = urlunsplit((parts.scheme, netloc, parts.path, urlencode(query), ""))
    return clean, found["username"], found["password"]


def _credentials(
    url: str, username: str | None, password: str | None, password_env: str | None
) -> tuple[str, str | None, str | None, bool]:
    """``(url without credentials, username, password, password given inline)``."""
    clean, url_user, url_password = _split_url(url)
    if url_user is not None and username is not None and url_user != username:
        raise ConfigError("username: given both in the URL and as an option, with different values")
    if password == _HIDDEN:
        raise ConfigError("password: secrets are not serialised; give the password again, or use password_env")
    given = [n for n, v in (("password", password), ("password_env", password_env), ("url", url_password)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"password: give it one way only, got {' and '.join(given)}")
    inline = password is not None or url_password is not None
    if password_env is not None:
        if not isinstance(password_env, str) or not password_env:
            raise ConfigError(f"password_env: expected an environment variable name, got {password_env!r}")
        password = os.environ.get(password_env)
        if password is None:
            raise ConfigError(f"password_env: the environment variable {password_env!r} is not set")
    return clean, username if username is not None else url_user, password if password is not None else url_password, inline


def _probe_problem(exc: BaseException, url: str) -> str:
    """What a failed probe means, in the operator's terms (the exception's own text kept)."""
    text = f"{type(exc).__name__}: {exc}"
    causes = [exc, exc.__cause__, exc.__context__]
    if any(isinstance(c, ssl.SSLError) for c in causes) or "SSL" in str(exc):
        return f"the TLS handshake failed (check tls_ca_file, tls_cert_file, tls_key_file): {text}"
    if url.startswith("rediss://") and isinstance(exc, RedisTimeoutError):
        return f"no TLS handshake within the timeout (is this the server's TLS port?): {text}"
    if isinstance(exc, InvalidResponse):
        return f"what answered is not a Redis server (check host and port): {text}"
    upper = str(exc).upper()
    if isinstance(exc, redis.AuthenticationError) or any(w in upper for w in ("WRONGPASS", "NOAUTH", "NOPERM", "INVALID USERNAME")):
        return f"authentication refused (check username and password / password_env): {text}"
    if "DB INDEX" in upper:
        return f"the database number in the URL does not exist on the server: {text}"
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
        return f"not reachable (check host and port, or raise connect_timeout_s): {text}"
    return f"the server refused the connection: {text}"


def _check_seconds(**values: Any) -> None:
    for field, value in values.items():
        if value is None and field == "ttl_s":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{field}: expected a positive number of seconds, got {value!r}")


def _client_options(
    username: str | None, password: str | None, tls: dict[str, str | None], timeout: float, connect_timeout: float, connections: int
) -> dict[str, Any]:
    """Keyword arguments for redis-py's ``from_url`` (secrets included: never log them)."""
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": connect_timeout,
        "socket_read_size": _SOCKET_READ_BYTES,
        "max_connections": connections,
        "health_check_interval": 0,
        "protocol": 2,  # the wire module reads RESP2 replies
    }
    if username is not None:
        options["username"] = username
    if password is not None:
        options["password"] = password
    for ours, theirs in (("tls_ca_file", "ssl_ca_certs"), ("tls_cert_file", "ssl_certfile"), ("tls_key_file", "ssl_keyfile")):
        if tls.get(ours):
            options[theirs] = tls[ours]
    return options


class RedisBackend(RecordBackend):
    """Records on a Redis server (``url``) or a Redis Cluster (``cluster: true``)."""

    name: ClassVar[str] = "redis"
    #: Records outlive the process; at open the store adopts what the server holds.
    persistent: ClassVar[bool] = True
    #: Other hosts write here too: the store never deletes records it has no room to adopt.
    shared: ClassVar[bool] = True

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
        sync_interval_s: float = 1.0,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        super().__init__(capacity=capacity, codec=codec, mac_key=mac_key, mac_key_env=mac_key_env, mac_algorithm=mac_algorithm)
        self.url, self.username, self._password, self._password_inline = _credentials(url, username, password, password_env)
        self._password_env = password_env
        if not isinstance(cluster, bool):
            raise ConfigError(f"cluster: expected true or false, got {cluster!r}")
        if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
            raise ConfigError(f"prefix: expected 1-64 characters of [A-Za-z0-9_.-], got {prefix!r}")
        self.prefix = prefix
        _check_seconds(ttl_s=ttl_s, socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s, sync_interval_s=sync_interval_s)
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
        self.sync_interval_s = float(sync_interval_s)
        self.tls = {"tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file, "tls_key_file": tls_key_file}
        if any(self.tls.values()) and not self.url.startswith("rediss://"):
            raise ConfigError("url: TLS files are given, so the URL must use rediss://")
        self._health = _Health(self.url)
        # An exhausted pool is back-pressure: wait for a connection, at most one socket timeout.
        self._gate = PoolGate(self.socket_timeout_s)
        self._client: Any = None  # redis.Redis or RedisCluster, built in open()
        self._client_lock = threading.Lock()
        self._pool_threads: ThreadPoolExecutor | None = None
        self._nodes: dict[str, _Health] = {}  # cluster nodes by name
        self._prefix_bytes = b""
        self._meta_key = b""
        self._ttl_ms = b""
        self._refresh_slots = False
        self.view: SharedIndexView | None = None
        #: The server holds another store's meta record under this prefix: serve nothing from it.
        self._foreign = False
        #: Keys under the prefix that failed to load as ours (wrong type, unknown version): the
        #: sweeps do not adopt them again until this tier writes them (bounded, oldest dropped).
        self._unreadable: dict[bytes, None] = {}
        self._unreadable_lock = threading.Lock()

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        return f"RedisBackend({kind} {self.url!r}, prefix={self.prefix!r})"

    # -- configuration ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data.update(url=self.url, cluster=self.cluster, prefix=self.prefix)
        if self.username is not None:
            data["username"] = self.username
        if self._password_env is not None:
            data["password_env"] = self._password_env
        elif self._password_inline:
            data["password"] = _HIDDEN  # never the secret; from_dict asks for it again
        if self.ttl_s is not None:
            data["ttl_s"] = self.ttl_s
        data.update(
            max_connections=self.max_connections,
            job_connections=self.job_connections_setting,
            socket_timeout_s=self.socket_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            sync_interval_s=self.sync_interval_s,
        )
        data.update({k: v for k, v in self.tls.items() if v is not None})
        return data

    def reserve_bytes(self) -> int:
        return self.format.block_bytes + self._head_bytes()

    def probe(self, timeout_s: float) -> str | None:
        """Connect once and ``PING``, waiting at most ``timeout_s`` per socket call; ``None`` when
        the server answers, else what went wrong (unreachable, authentication, TLS, a bad
        database number), naming the URL and never a secret. Opens nothing the tier keeps: this
        is what ``kvtier config check`` asks of a remote tier."""
        options = _client_options(self.username, self._password, self.tls, timeout_s, timeout_s, 1)
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
            return f"{self.url}: {_probe_problem(exc, self.url)}"
        return None

    # -- lifecycle -------------------------------------------------------------------------------
    async def open(self, fmt: BlockFormat) -> None:
        await super().open(fmt)
        self._prefix_bytes = f"{self.prefix}:{fmt.namespace_digest[:8].hex()}:".encode()
        self._meta_key = self._prefix_bytes + b"meta"
        if self.ttl_s is not None:
            self._ttl_ms = str(max(1, round(self.ttl_s * 1000))).encode()
        self.view = SharedIndexView(
            f"redis {self.url}", self._sweep, record_bytes=self.reserve_bytes(), interval_s=self.sync_interval_s
        )
        await asyncio.to_thread(self._connect_and_check)

    def _connect_and_check(self) -> None:
        """Connect and check the meta record. An unreachable server is an outage, not an error:
        the tier starts empty and fills once the server answers. What a meta record found there
        means is :mod:`kvtier.backends.redis_meta`'s to judge: a foreign one makes this tier
        serve nothing, never a refusal to start."""
        try:
            client = self._get_client()
            raw = client.get(self._meta_key)
            ours = meta_value(self.format, self.mac, self._meta_key)
            if raw is None:
                client.set(self._meta_key, ours, nx=True)
            else:
                where = f"redis {self.url} prefix {self._prefix_bytes.decode()}"
                verdict, reason = judge_meta(bytes(raw), self.format, self.mac, self._meta_key, where=where)
                if verdict is MetaVerdict.REPLACE:
                    log.warning("redis: the meta record under %r is not ours (%s); rewriting it", self._meta_key, reason)
                    client.set(self._meta_key, ours)
                elif verdict is MetaVerdict.FOREIGN:
                    self._foreign = True
                    message = (
                        f"redis: {where} holds a meta record of another store ({reason}); this tier serves "
                        "nothing from it (reads miss, writes are refused). Use another prefix, or a mac_key "
                        "shared by the fleet so a planted record is told apart"
                    )
                    log.warning(message)
                    warnings.warn(message, RuntimeWarning, stacklevel=2)
        except _DOWN_ERRORS as exc:
            self._health.failed(exc)
        except RedisError as exc:  # refused auth, ACL denial, cluster not ready: loud, but not fatal
            log.error("redis: %s refused the connection set-up: %s", self.url, exc)
            self._health.failed(exc)
        else:
            self._health.succeeded()

    def _get_client(self) -> Any:
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._client is None:
                self._check_open()
                options = _client_options(
                    self.username, self._password, self.tls, self.socket_timeout_s, self.connect_timeout_s, self.max_connections
                )
                nodes = 1
                if self.cluster:
                    # The constructor reads the slot map: I/O, hence here and not in __init__.
                    self._client = RedisCluster.from_url(self.url, **options)
                    nodes = max(1, len(self._client.get_primaries()))
                else:
                    self._client = redis.Redis.from_url(self.url, **options)
                workers = self.budget.io_threads(nodes)
                if workers > 0:
                    self._pool_threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-redis")
            return self._client

    async def aclose(self) -> None:
        if self._closed:
            return
        await super().aclose()
        view, self.view = self.view, None
        if view is not None:
            await asyncio.to_thread(view.stop)
        threads, self._pool_threads = self._pool_threads, None
        if threads is not None:
            threads.shutdown(wait=True)
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # closing sockets of a dead server must not fail a close
                log.debug("redis: close: %s", exc)

    def bind_index(self, manager: Any, tier: int) -> None:
        """Keep ``manager``'s index of ``tier`` in step with the server (called by the store)."""
        if self.view is not None:
            self.view.bind(manager, tier)

    # -- routing ---------------------------------------------------------------------------------
    def _rkey(self, key: bytes) -> bytes:
        return self._prefix_bytes + key

    def _groups(self, rkeys: Sequence[bytes]) -> list[tuple[_Health, Any, list[int]]]:
        """``(health, connection pool, positions)`` per node that holds the keys' slots: the
        tier's health for a single server, the node's own in a cluster."""
        client = self._get_client()
        if not self.cluster:
            return [(self._health, client.connection_pool, list(range(len(rkeys))))]
        nodes = client.nodes_manager
        slot_of = client.keyslot
        groups: dict[str, tuple[_Health, Any, list[int]]] = {}
        for i, rk in enumerate(rkeys):
            node = nodes.get_node_from_slot(slot_of(rk))
            entry = groups.get(node.name)
            if entry is None:
                pool = client.get_redis_connection(node).connection_pool
                entry = groups[node.name] = (self._node_health(node.name), pool, [])
            entry[2].append(i)
        return list(groups.values())

    def _node_health(self, name: str) -> _Health:
        """The up/down state of one cluster node: a dead primary misses its own slots only."""
        health = self._nodes.get(name)
        if health is None:
            with self._client_lock:
                health = self._nodes.setdefault(name, _Health(f"{self.url} node {name}"))
        return health

    def _run_groups(self, fn: Any, groups: list[tuple[_Health, Any, list[int]]], record_bytes: int = 0) -> list[int]:
        """Run ``fn(pool, positions)`` per group, cut into shares of ``record_bytes``-byte records
        run on connections of their own (:mod:`kvtier.backends.redis_shares`), each node whose
        backoff has not run out skipped; return the positions of the shares that failed or were
        skipped. A node is marked down (or up) once per job, however many of its shares failed.

        Every share has ended when this returns, failed ones included: a share still running
        would go on writing into the caller's rows after the call returned."""
        runnable: list[tuple[_Health, Any, list[int]]] = []
        failed: list[int] = []
        for health, pool, positions in groups:
            if health.allow():
                runnable += ((health, pool, share) for share in split_shares(positions, record_bytes, self.job_connections))
            else:
                health.fast_failures += len(positions)
                failed.extend(positions)
        errors = run_all(self._pool_threads, [partial(self._run_share, fn, pool, share) for _, pool, share in runnable])
        verdict: dict[int, tuple[_Health, BaseException | None]] = {}
        for (health, _, positions), exc in zip(runnable, errors):
            if exc is not None:
                failed.extend(positions)
            if isinstance(exc, PoolBusy):
                continue  # says nothing of the node's health
            if verdict.get(id(health), (None, None))[1] is None:
                verdict[id(health)] = (health, exc)
        for health, exc in verdict.values():
            if exc is not None:
                health.failed(exc)
            elif health.succeeded() and self.view is not None:
                self.view.wake()
        return failed

    def _run_share(self, fn: Any, pool: Any, positions: list[int]) -> BaseException | None:
        """One share of a job on one node; what made it fail (the node is then down, unless it
        is :class:`PoolBusy`: the pool had no connection to give), or ``None``."""
        try:
            fn(pool, positions)
        except PoolBusy as exc:  # our own load, not the server's state
            log.debug("redis: a share of %d records got no connection: %s", len(positions), exc)
            return exc
        except (_Down, *_DOWN_ERRORS) as exc:  # a dead node
            self._refresh_slots = self.cluster  # after a failover the next sweep finds the new primary
            return exc.__cause__ or exc if isinstance(exc, _Down) else exc
        except RedisError as exc:  # auth refused, cluster down
            self._note_cluster_error(exc)
            return exc
        return None

    def _exchange(self, pool: Any, body: Any) -> None:
        """Run ``body(wire)`` on a pooled connection; a dead socket raises :class:`_Down`."""
        self._exchange_many(pool, 1, lambda wires: body(wires[0]))

    def _exchange_many(self, pool: Any, count: int, body: Any) -> None:
        """Run ``body(wires)`` on up to ``count`` pooled connections at once (at least one: when
        the pool has no more to give, fewer); a dead socket raises :class:`_Down`. Each
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
            raise _Down(exc) from exc
        finally:
            for k, conn in enumerate(conns):
                if k >= len(drained) or not drained[k]:  # unknown stream position: never hand it out again
                    conn.disconnect()
                pool.release(conn)
            self._gate.returned()

    def _note_cluster_error(self, exc: BaseException) -> None:
        if isinstance(exc, (MovedError, AskError, TryAgainError, ClusterDownError)):
            self._refresh_slots = True

    def _refused(self, what: str, exc: ErrorReply) -> None:
        text = str(exc)
        if text.startswith(("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")):
            self._refresh_slots = True
        log.debug("redis: %s refused: %s", what, text)

    def _run_io(self, fn: Any, rkeys: list[bytes], record_bytes: int = 0) -> list[int]:
        """Run ``fn(pool, positions)`` per node (in shares, when the ``record_bytes``-byte records
        are worth several connections); return the positions that failed (a dead node's: that
        node is marked down; every position when there is no client or slot map to be had: the
        tier is)."""
        try:
            groups = self._groups(rkeys)
        except (*_DOWN_ERRORS, RedisError) as exc:
            if isinstance(exc, RedisError):
                self._note_cluster_error(exc)
            self._health.failed(exc)
            self._refresh_slots = self.cluster
            return list(range(len(rkeys)))
        failed = self._run_groups(fn, groups, record_bytes)
        if self.cluster and len(failed) < len(rkeys) and self._health.succeeded() and self.view is not None:
            self.view.wake()
        return failed

    # -- bulk I/O --------------------------------------------------------------------------------
    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        self._check_io(keys, blocks)
        n = len(keys)
        if self._foreign or not self._health.allow():
            self._health.fast_failures += n
            self.counters.write_failures += n
            return [None] * n
        rkeys = [self._rkey(k) for k in keys]
        sizes: list[int | None] = [None] * n
        ttl = self._ttl_ms

        def write_group(pool: Any, positions: list[int]) -> None:
            stored: dict[int, int] = {}

            def requests() -> Iterator[tuple[int, tuple[Any, ...]]]:
                # Encoded (checksummed) one by one as connections come free: each record goes
                # out while its bytes are still in the CPU cache, and the server stores the
                # ones in flight while the next is hashed (see redis_wire.send_one_each).
                for i in positions:
                    head, payload = self._encode_one(keys[i], blocks[i])
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

            self._exchange_many(pool, min(len(positions), self.budget.put_connections), body)

        self._run_io(write_group, rkeys, self.reserve_bytes())
        done = [keys[i] for i in range(n) if sizes[i] is not None]
        self.counters.blocks_written += len(done)
        self.counters.bytes_written += sum(s for s in sizes if s is not None)
        self.counters.write_failures += n - len(done)
        if done and self.view is not None:
            self.view.note_written(done)
        if done and self._unreadable:
            with self._unreadable_lock:
                for key in done:
                    self._unreadable.pop(key, None)
        return sizes

    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        size = self._check_io(keys, out)
        n = len(keys)
        found = [False] * n
        if self._foreign or not self._health.allow():
            self._health.fast_failures += n
            self._count_reads(found, size, corrupt=0)
            return found
        rkeys = [self._rkey(k) for k in keys]
        bad: list[bytes] = []
        unreadable: list[bytes] = []
        window = max(1, _READ_WINDOW_BYTES // (size + self._head_bytes()))
        stripes = self.budget.stripes if size >= _STRIPE_MIN_BYTES else 1
        ttl = self._ttl_ms

        def read_group(pool: Any, positions: list[int]) -> None:
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
                            unreadable.append(keys[i])
                    total = len(lanes[k])
                    if sent[k] < total and sent[k] - received < refill:
                        # Top the window up in batches, before this value arrives: the server
                        # works on the next requests while this one is being received.
                        upto = min(total, sent[k] + refill)
                        wire.send([b"".join(commands[k][sent[k] : upto])])
                        sent[k] = upto
                    if length >= 0:
                        found[i] = self._receive(wire, keys[i], out[i], length, bad, unreadable)

            self._exchange_many(pool, min(len(positions), stripes), body)

        for i in self._run_io(read_group, rkeys, self.reserve_bytes()):
            found[i] = False  # a node that failed mid-reply: its whole share is a miss
        if bad:
            self._delete(bad)
        if unreadable:
            self._remember_unreadable(unreadable)
        self._count_reads(found, size, corrupt=len(bad))
        return found

    def _remember_unreadable(self, keys: list[bytes]) -> None:
        with self._unreadable_lock:
            book = self._unreadable
            for key in keys:
                book[key] = None
            while len(book) > _UNREADABLE_MAX:
                del book[next(iter(book))]

    def _receive(
        self, wire: Wire, key: bytes, dst: torch.Tensor, length: int, bad: list[bytes], unreadable: list[bytes]
    ) -> bool:
        """Read one record of ``length`` bytes into ``dst``; ``False`` for a miss. A bad record
        is consumed, logged and queued in ``bad`` for deletion; one of another format in
        ``unreadable``, so the sweeps stop offering it."""
        view, staging = self._host_view(dst)
        try:
            receive_record(wire, key, view, length, self.mac)
        except UnsupportedRecordError as exc:
            # Another writer's format or secret: a miss here, theirs to keep.
            log.debug("redis: record %s… not readable here (%s)", key.hex()[:16], exc)
            unreadable.append(key)
            return False
        except CorruptBlockError as exc:
            log.warning("redis: bad record %s… on %s (%s); deleting it", key.hex()[:16], self.url, exc)
            self._count_auth(exc)
            bad.append(key)
            return False
        if staging is not None:
            dst.copy_(staging)
        return True

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        self._delete(list(keys))

    def _delete(self, keys: list[bytes]) -> None:
        if not keys:
            return
        if self.view is not None:
            self.view.note_deleted(keys)
        if not self._health.allow():
            self._health.fast_failures += len(keys)
            return  # the server is gone; its LRU (or TTL) reclaims the records later
        rkeys = [self._rkey(k) for k in keys]
        deleted = 0

        def delete_group(pool: Any, positions: list[int]) -> None:
            def body(wire: Wire) -> None:
                nonlocal deleted
                # One UNLINK per key: a multi-key UNLINK is refused across cluster slots.
                wire.send([b"".join(unlink_command(rkeys[i]) for i in positions)])
                for _ in positions:
                    try:
                        deleted += int(wire.reply())
                    except ErrorReply as exc:
                        self._refused("UNLINK", exc)

            self._exchange(pool, body)

        self._run_io(delete_group, rkeys)
        self.counters.deleted += deleted

    # -- the shared index --------------------------------------------------------------------------
    def _sweep(self) -> set[bytes] | None:
        """Every key of this namespace on the server (``SCAN`` on each primary), or ``None``
        when the server is down or its backoff has not run out."""
        if self._closed or not self._health.allow():
            return None
        plen = len(self._prefix_bytes)
        pattern = self._prefix_bytes + b"*"
        want = plen + _KEY_BYTES
        found: set[bytes] = set()
        try:
            client = self._get_client()
            nodes: list[tuple[_Health | None, Any]]
            if self.cluster:
                if self._refresh_slots:
                    self._refresh_slots = False
                    client.nodes_manager.initialize()
                nodes = [(self._node_health(n.name), client.get_redis_connection(n)) for n in client.get_primaries()]
            else:
                nodes = [(None, client)]
            for health, node in nodes:
                if health is not None and not health.allow():
                    continue  # a dead primary: its keys drop out of the index (they miss anyway)
                try:
                    for rk in node.scan_iter(match=pattern, count=1000):
                        if len(rk) == want:
                            found.add(rk[plen:])
                except MaxConnectionsError:
                    raise  # the pool is busy, not the node down: skip this round (below)
                except _DOWN_ERRORS as exc:
                    if health is None:
                        raise
                    health.failed(exc)
                    self._refresh_slots = True
                    continue
                if health is not None and health.succeeded() and self.view is not None:
                    self.view.wake()
        except MaxConnectionsError as exc:  # back-pressure: the index stays as it is until the next round
            log.debug("redis: index sweep skipped, no connection to spare: %s", exc)
            self._gate.busy += 1
            return None
        except _DOWN_ERRORS as exc:
            self._health.failed(exc)
            return None
        except RedisError as exc:
            self._note_cluster_error(exc)
            self._health.failed(exc)
            return None
        self._health.succeeded()
        if self._foreign:
            return set()
        if self._unreadable:
            with self._unreadable_lock:
                found.difference_update(self._unreadable)
        return found

    def scan(self) -> Iterator[RecordInfo]:
        self._check_open()
        found = self._sweep()
        if found is None:
            return iter(())
        if self.view is not None:
            self.view.note_listed(found)
        now = time.time()
        size = self.reserve_bytes()
        return iter([RecordInfo(k, size, now) for k in found])

    def read_tags(self) -> tuple[dict[bytes, str], list[bytes]] | None:
        self._check_open()
        try:
            return read_redis_tags(self._get_client(), self._prefix_bytes)
        except RedisError as exc:
            raise BackendError(f"redis: tenant tags not read from {self.url}: {exc}") from exc

    def write_tags(self, tenants: Sequence[tuple[bytes, str]], pins: Sequence[tuple[bytes, bool]], *, whole: bool = False) -> None:
        if self._closed or not self._health.allow():
            return
        try:
            write_redis_tags(self._get_client(), self._prefix_bytes, tenants, pins, whole=whole)
        except RedisError as exc:  # tags are bookkeeping: the tier serves blocks without them
            log.warning("redis: tenant tags not saved to %s: %s", self.url, exc)

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        every = [self._health, *self._nodes.values()]
        data.update(
            url=self.url,
            cluster=self.cluster,
            up=self._health.up,
            outages=sum(h.outages for h in every),
            connection_errors=sum(h.connection_errors for h in every),
            fast_failures=sum(h.fast_failures for h in every),
            pool_waits=self._gate.waits,
            pool_busy=self._gate.busy,
        )
        if self.cluster:
            data["nodes_down"] = sum(1 for h in self._nodes.values() if not h.up)
        if self.view is not None:
            data["index"] = self.view.stats()
        return data
