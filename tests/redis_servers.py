"""Private Redis servers for the tests: a standalone server and a 3-master cluster on localhost.

Each server runs from the Debian ``redis-server`` binary on a free port, in its own temporary
directory, with persistence off, and is stopped at the end of the session (``.ci/run`` installs
the package). Where the binary is missing the redis tests are skipped, and the pytest header and
every skip reason say so in capitals.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
MISSING = (
    "REDIS-SERVER NOT INSTALLED: the redis tier tests are SKIPPED "
    "(apt-get install -y redis-server, as .ci/run does)"
)


def server_version() -> str | None:
    if REDIS_SERVER is None:
        return None
    out = subprocess.run([REDIS_SERVER, "--version"], capture_output=True, text=True, check=False).stdout
    return out.strip()


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free localhost port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free localhost port for a redis server")


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process; ``stop``/``kill`` and ``start`` again on the same port."""

    def __init__(self, directory: Path, *, port: int | None = None, cluster: bool = False, extra: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.port = port if port is not None else free_port()
        self.cluster = cluster
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert REDIS_SERVER is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--logfile", str(self.directory / "redis.log"),
            "--maxmemory", "1gb",
            "--maxmemory-policy", "allkeys-lru",
        ]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.directory / "nodes.conf"),
                     "--cluster-node-timeout", "3000"]
        args += list(self.extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:] if (self.directory / "redis.log").exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)
        return self

    def cli(self, *args: str) -> str:
        """Run one redis-cli command; an error reply raises (redis-cli itself exits 0)."""
        assert REDIS_CLI is not None
        out = subprocess.run(
            [REDIS_CLI, "-p", str(self.port), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout
        if out.startswith(("ERR", "(error)", "WRONGTYPE", "NOPERM")):
            raise RuntimeError(f"redis-cli {' '.join(args)}: {out.strip()}")
        return out

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


class RedisClusterServers:
    """Three masters on localhost, joined with ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, masters: int = 3, extra: tuple[str, ...] = ()) -> None:
        self.nodes = [RedisServer(directory / f"node{i}", cluster=True, extra=extra) for i in range(masters)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        assert REDIS_CLI is not None
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, check=True, timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def flush(self) -> None:
        for node in self.nodes:
            node.cli("flushall")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


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
