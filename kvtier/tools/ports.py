"""Servers started on free localhost ports, again on new ports when one was taken.

A launcher probes a free port, closes the probe and hands the number to the server, which binds
it a moment later. In between, anything on the host (another server, another test run, a
client's ephemeral port) can take it; the server then exits (``Address already in use``) or,
worse, its readiness check is answered by the server that took the port.

:func:`start_on_free_ports` builds the server again, on newly probed ports, and starts it once
more when a start failed because a port was taken, at most :data:`TRIES` times. What counts as a
taken port is read from the server itself: its error (which carries its log's tail) names the
bind failure (``RedisServer`` also says so when the server answering its port is not the process
it started), or one of its ports has a listener now that its own process is gone, or its start
raised :class:`PortTaken`. Any other failure is raised at once.

kvtier's tests start their servers through it, and so do the benchmarks that start their own
(``benchmarks/bench_mooncake.py``).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["TRIES", "PortTaken", "listening", "port_taken_in", "start_on_free_ports"]

S = TypeVar("S")
T = TypeVar("T")

#: How many times a server is built and started before its last failure is raised.
TRIES = 5

#: What the servers kvtier starts write when a port they were handed is taken: redis-server and
#: valkey-server (``bind: Address already in use`` / ``Failed listening on port``), weed (Go's
#: ``bind: address already in use``), mooncake_master (``Failed to start ... server``: it names
#: the HTTP server it could not start, not why).
_TAKEN = re.compile(
    r"address already in use|failed listening on port|could not create server tcp listening socket"
    r"|failed to start (?:c\+\+ )?(?:http metadata|master admin) server",
    re.IGNORECASE,
)


class PortTaken(RuntimeError):
    """A server's start found one of its ports held by something else."""


def port_taken_in(text: str) -> bool:
    """Whether a server's error or log says that it could not bind a port it was given."""
    return _TAKEN.search(text) is not None


def listening(port: int) -> bool:
    """Whether something listens on localhost ``port`` (a probe with ``SO_REUSEADDR`` binds a
    port that only closed connections hold, so those do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _start(server: Any) -> Any:
    return server.start()


def start_on_free_ports(
    make: Callable[[int], S],
    *,
    start: Callable[[S], T] = _start,
    ports: Callable[[S], Iterable[int]] | None = None,
    tries: int = TRIES,
) -> T:
    """``start(make(n))``, with ``make`` building the server of try ``n`` (0, 1, ...) on newly
    probed free ports (in a folder of its own, say); a start that failed because a port was
    taken (see the module doc; ``ports`` lists the server's ports for the check that something
    else listens there now) is tried again, at most ``tries`` times in all. ``start`` stops what
    it started when it fails (the launchers' ``start`` methods do)."""
    if tries < 1:
        raise ValueError(f"tries: expected at least 1, got {tries}")
    seen: list[str] = []
    for n in range(tries):
        server = make(n)
        try:
            return start(server)
        except PortTaken as exc:
            seen.append(str(exc))
        except RuntimeError as exc:
            taken = [p for p in ports(server) if listening(p)] if ports is not None else []
            if not (port_taken_in(str(exc)) or taken):
                raise
            seen.append(f"{exc}\n(ports held by something else: {taken})" if taken else str(exc))
    raise RuntimeError(f"a port was taken at each of {tries} starts; the last said:\n{seen[-1][-2000:]}")
