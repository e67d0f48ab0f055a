"""Private Redis servers for the tests: a standalone server and a 3-master cluster on localhost,
launched by :mod:`kvtier.tools.servers` (shipped, so the Redis benchmarks use it too).

Each server runs from the Debian ``redis-server`` binary on a free port, in its own temporary
directory, with persistence off, and is stopped at the end of the session (``.ci/run`` installs
the package). Where the binary is missing the redis tests are skipped, and the pytest header and
every skip reason say so in capitals.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.tools.servers import REDIS_CLI, REDIS_SERVER, RedisClusterServers, RedisServer, free_port, server_version

__all__ = ["MISSING", "REDIS_CLI", "REDIS_SERVER", "RedisClusterServers", "RedisServer", "free_port", "server_version"]

MISSING = (
    "REDIS-SERVER NOT INSTALLED: the redis tier tests are SKIPPED "
    "(apt-get install -y redis-server, as .ci/run does)"
)


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
    tls_port = free_port()
    server = RedisServer(directory / "tls", extra=(
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
    )).start()
    return server, tls_port, cert


def _need_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(MISSING)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private standalone server for the whole session (tests use distinct key prefixes)."""
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A private 3-master Redis Cluster for the whole session."""
    _need_redis()
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def own_redis_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A 3-master cluster of this test's own, for tests that kill a primary. It keeps serving
    the live primaries' slots when one is down (``cluster-require-full-coverage no``)."""
    _need_redis()
    cluster = RedisClusterServers(tmp_path / "redis-cluster-own", extra=("--cluster-require-full-coverage", "no"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own, for tests that kill or reconfigure it."""
    _need_redis()
    server = RedisServer(tmp_path / "redis-own").start()
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
