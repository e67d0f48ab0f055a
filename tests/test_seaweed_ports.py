"""Ports of a SeaweedFS server: a server that opens several ports, each with its gRPC port at
+10000, gets picks that never meet."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tools import servers
from kvtier.tools.seaweed import SeaweedServer


def _picks(monkeypatch: pytest.MonkeyPatch, draws: list[int]) -> None:
    """``random.randint`` as the port picker calls it gives ``draws`` in turn (every port free)."""
    left = iter(draws)
    monkeypatch.setattr(servers.random, "randint", lambda lo, hi: next(left))
    monkeypatch.setattr(servers, "_port_free", lambda port: True)


def test_a_seaweed_server_gets_four_ports_that_never_meet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two picks of the same port (or one at another's +10000) made ``weed server`` fail to
    start: its volume server's gRPC port was its master's."""
    _picks(monkeypatch, [37999, 37999, 27999, 31000, 41000, 42000, 33000])
    ports = SeaweedServer(tmp_path).ports
    assert ports == {"master": 37999, "volume": 31000, "filer": 42000, "s3": 33000}
    opened = [p for port in ports.values() for p in (port, port + 10000)]
    assert len(set(opened)) == len(opened)


def test_free_ports_gives_up_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "free_port", lambda: 30000)
    with pytest.raises(RuntimeError, match="no 2 distinct free localhost ports"):
        servers.free_ports(2)
