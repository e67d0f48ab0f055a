"""The tests' servers start again on new ports when a port handed to them was taken meanwhile
(tests/server_ports.py): each test takes the first port handed out before the server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from redis_servers import MISSING, started_cluster
from server_ports import PortTaken, folder_of_try, listening, port_taken_in, start_on_free_ports

from kvtier.tools.servers import REDIS_CLI, REDIS_SERVER, RedisClusterServers, RedisServer

needs_redis = pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None, reason=MISSING)


def _answering_pid(server: RedisServer) -> int:
    info = server.cli("info", "server")
    return int(info.split("process_id:")[1].split()[0])


@needs_redis
def test_a_redis_server_whose_port_was_taken_starts_on_a_new_one(tmp_path: Path) -> None:
    made: list[RedisServer] = []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:

        def make(n: int) -> RedisServer:
            made.append(RedisServer(folder_of_try(tmp_path / "r", n)))
            if n == 0:  # the first port handed out is taken before the server binds it
                holder.bind(("127.0.0.1", made[0].port))
                holder.listen()
            return made[-1]

        server = start_on_free_ports(make)
        try:
            assert len(made) == 2 and server is made[1] and server.port != made[0].port
            assert made[0].proc is None  # the first try's process is gone
            assert "Address already in use" in (tmp_path / "r" / "redis.log").read_text()
            assert server.proc is not None and _answering_pid(server) == server.proc.pid
            assert server.directory == tmp_path / "r-try1"
        finally:
            server.stop()


@needs_redis
def test_a_port_another_redis_server_answers_on_is_not_taken_for_ours(tmp_path: Path) -> None:
    """The launcher's readiness PING is answered by the server that took the port: the start
    fails (it had returned a server the test did not start), and the helper starts a new one."""
    other = RedisServer(tmp_path / "other").start()
    try:
        with pytest.raises(RuntimeError, match=r"another server .* answers there"):
            RedisServer(tmp_path / "alone", port=other.port).start()
        made: list[RedisServer] = []

        def make(n: int) -> RedisServer:
            made.append(RedisServer(folder_of_try(tmp_path / "mine", n), port=other.port if n == 0 else None))
            return made[-1]

        server = start_on_free_ports(make)
        try:
            assert len(made) == 2 and server.port != other.port
            assert server.proc is not None and _answering_pid(server) == server.proc.pid
            assert other.proc is not None and _answering_pid(other) == other.proc.pid  # left running, untouched
        finally:
            server.stop()
    finally:
        other.stop()


@needs_redis
def test_a_cluster_whose_bus_port_was_taken_starts_on_new_ports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster node also binds its port + 10000 (the cluster bus); the whole cluster is made
    again, and the nodes started before the failed one are stopped."""
    made: list[RedisClusterServers] = []
    real = RedisClusterServers.__init__

    def counted(self: RedisClusterServers, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(RedisClusterServers, "__init__", counted)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        real_start = RedisServer.start
        taken: list[int] = []

        def start(node: RedisServer) -> RedisServer:
            if not taken and node is made[0].nodes[1]:
                taken.append(node.port + 10000)
                holder.bind(("127.0.0.1", taken[0]))
                holder.listen()
            return real_start(node)

        monkeypatch.setattr(RedisServer, "start", start)
        cluster = started_cluster(tmp_path / "c")
        try:
            assert len(made) == 2 and cluster is made[1]
            assert all(node.proc is None for node in made[0].nodes)  # the first node, started, is stopped too
            assert taken[0] not in [n.port + 10000 for n in cluster.nodes]
            assert all("cluster_state:ok" in n.cli("cluster", "info") for n in cluster.nodes)
        finally:
            cluster.stop()


@needs_redis
def test_a_failure_that_is_not_a_taken_port_is_raised_at_once(tmp_path: Path) -> None:
    made: list[int] = []

    def make(n: int) -> RedisServer:
        made.append(n)
        return RedisServer(folder_of_try(tmp_path / "bad", n), extra=("--no-such-option", "1"))

    with pytest.raises(RuntimeError, match="did not start") as caught:
        start_on_free_ports(make)
    assert made == [0] and not port_taken_in(str(caught.value))


@needs_redis
def test_tries_are_bounded(tmp_path: Path) -> None:
    """Every port handed out is taken: the last failure is raised after ``tries`` starts."""
    made: list[RedisServer] = []
    holders: list[socket.socket] = []

    def make(n: int) -> RedisServer:
        made.append(RedisServer(folder_of_try(tmp_path / "r", n)))
        holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        holders.append(holder)
        holder.bind(("127.0.0.1", made[-1].port))
        holder.listen()
        return made[-1]

    try:
        with pytest.raises(RuntimeError, match="a port was taken at each of 3 starts"):
            start_on_free_ports(make, tries=3)
    finally:
        for holder in holders:
            holder.close()
    assert len(made) == 3 and all(server.proc is None for server in made)


class _Silent:
    """A server that exits without saying why (as mooncake_master does when its RPC port is taken)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.starts = 0

    def start(self) -> _Silent:
        self.starts += 1
        if listening(self.port):
            raise RuntimeError("did not start")
        return self


def test_a_silent_exit_counts_as_a_taken_port_only_when_something_listens_there() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        servers = [_Silent(busy), _Silent(free)]
        assert start_on_free_ports(lambda n: servers[n], ports=lambda s: [s.port]) is servers[1]
        assert [s.starts for s in servers] == [1, 1]
        with pytest.raises(RuntimeError, match="did not start"):  # no ports to look at: raised at once
            start_on_free_ports(lambda n: servers[0])
        assert servers[0].starts == 2


def test_port_taken_reaches_the_next_try_and_bad_tries_are_refused() -> None:
    calls: list[int] = []

    def start(n: int) -> int:
        calls.append(n)
        if n < 2:
            raise PortTaken(f"try {n}")
        return n

    assert start_on_free_ports(lambda n: n, start=start) == 2 and calls == [0, 1, 2]
    with pytest.raises(ValueError, match="tries"):
        start_on_free_ports(lambda n: n, tries=0)


def test_what_the_servers_say_when_a_port_is_taken() -> None:
    """The bind failures of redis-server/valkey-server, weed and mooncake_master, as they log them."""
    assert port_taken_in("# Warning: Could not create server TCP listening socket 127.0.0.1:47113: bind: Address already in use")
    assert port_taken_in("# Failed listening on port 54865 (cluster), aborting.")
    assert port_taken_in("F1205 master.go:212 Master startup error: listen tcp 127.0.0.1:20889: bind: address already in use")
    assert port_taken_in("E1205 http_metadata_server.cpp:121] Failed to start HTTP metadata server on 127.0.0.1:22074")
    assert port_taken_in("E1205 master.cpp:1651] Failed to start master admin server")
    assert not port_taken_in("*** FATAL CONFIG FILE ERROR (Redis 7.0.15) ***\nBad directive or wrong number of arguments")


def test_a_seaweed_server_whose_s3_port_was_taken_starts_on_new_ports(tmp_path: Path) -> None:
    from s3_servers import BUCKET, need_s3, started

    from kvtier.tools.seaweed import SeaweedServer

    need_s3()
    made: list[SeaweedServer] = []
    real = SeaweedServer.__init__

    def counted(self: SeaweedServer, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder, pytest.MonkeyPatch.context() as patch:
        real_start = SeaweedServer.start

        def start(server: SeaweedServer, timeout_s: float = 60.0) -> SeaweedServer:
            if server is made[0]:  # the first S3 port handed out is taken before weed binds it
                holder.bind(("127.0.0.1", server.s3_port))
                holder.listen()
            return real_start(server, timeout_s)

        patch.setattr(SeaweedServer, "__init__", counted)
        patch.setattr(SeaweedServer, "start", start)
        server = started(tmp_path / "s3")
    try:
        # (a port another program on the machine took meanwhile may cost one more try: never fewer than two)
        assert len(made) >= 2 and server is made[-1] and all(failed.proc is None for failed in made[:-1])
        assert "address already in use" in (tmp_path / "s3" / "weed.log").read_text()
        server.create_bucket(BUCKET)  # there already: the started server is the one the helper made
        assert server.proc is not None and server.proc.poll() is None
    finally:
        server.stop()


def test_a_mooncake_master_whose_port_was_taken_starts_on_new_ports(tmp_path: Path) -> None:
    from mooncake_servers import mooncake_missing, started

    from kvtier.tools.mooncake_servers import MooncakeServers

    missing = mooncake_missing()
    if missing is not None:
        pytest.skip(missing)
    made: list[MooncakeServers] = []
    real = MooncakeServers.__init__

    def counted(self: MooncakeServers, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder, pytest.MonkeyPatch.context() as patch:
        real_start = MooncakeServers.start

        def start(servers: MooncakeServers) -> MooncakeServers:
            if servers is made[0]:  # the master's first metadata port is taken before it binds it
                holder.bind(("127.0.0.1", servers.metadata_port))
                holder.listen()
            return real_start(servers)

        patch.setattr(MooncakeServers, "__init__", counted)
        patch.setattr(MooncakeServers, "start", start)
        servers = started(tmp_path / "mc", segment_size="64MB")
    try:
        # (a port another program on the machine took meanwhile may cost one more try: never fewer than two)
        assert len(made) >= 2 and servers is made[-1]
        assert "Failed to start HTTP metadata server" in (tmp_path / "mc" / "master.log").read_text()
        assert len(servers.segments()) == 1  # its own client's segment, on its own master
    finally:
        servers.stop()


def test_a_dead_port_refuses_connections_and_cannot_be_taken(dead_port: int) -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", dead_port), timeout=5).close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind (redis-server does)
        other.bind(("127.0.0.1", dead_port))
