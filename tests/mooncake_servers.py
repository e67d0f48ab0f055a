"""A private Mooncake Store for the tests: ``mooncake_master`` and a standalone ``mooncake_client``
on free loopback ports (:mod:`kvtier.tools.mooncake_servers`), stopped by pid at the end; started
again on new ports when one was taken between its probe and the bind (:mod:`server_ports`).

Where the ``mooncake-transfer-engine-non-cuda`` wheel (or the ``libibverbs1`` library its
binaries link) is missing, the mooncake tests are skipped, and the pytest header and every skip
reason say so in capitals.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_ports import folder_of_try, start_on_free_ports

from kvtier.tools.mooncake_servers import MISSING, MooncakeServers, mooncake_binaries, mooncake_missing

__all__ = ["MISSING", "MooncakeServers", "mooncake_binaries", "mooncake_missing", "mooncake_store", "open_mooncake_tier", "own_mooncake_store"]


def _need_mooncake() -> None:
    missing = mooncake_missing()
    if missing is not None:
        pytest.skip(missing)


def started(directory: Path, **options: Any) -> MooncakeServers:
    """Started ``MooncakeServers(directory, **options)``, on new ports if one was taken
    (:mod:`server_ports`; the master exits without saying which port, so a port with a listener
    after the master is gone counts)."""
    return start_on_free_ports(
        lambda n: MooncakeServers(folder_of_try(directory, n), **options),
        ports=lambda m: m.ports,
    )


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeServers]:
    """A master and a 512 MB standalone client for the whole session (tests use distinct prefixes)."""
    _need_mooncake()
    servers = started(tmp_path_factory.mktemp("mooncake"))
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def own_mooncake_store(tmp_path: Path) -> Iterator[MooncakeServers]:
    """A store of this test's own, for tests that kill its master or its client. The master
    drops a silent client after 2 s (``--client_ttl``), so a dead client's records go soon."""
    _need_mooncake()
    servers = started(tmp_path / "mooncake-own", segment_size="128MB", master_flags=("--client_ttl=2",))
    try:
        yield servers
    finally:
        servers.stop()


def open_mooncake_tier(servers: MooncakeServers, namespace: bytes, block_bytes: int, **options: Any) -> Any:
    """A ``mooncake`` tier on ``servers`` opened for ``block_bytes``-byte bfloat16 blocks in a
    namespace named by ``namespace``, its periodic sweep held off; 1 GiB unless ``capacity`` is
    given. Close it with ``asyncio.run(backend.aclose())``."""
    import asyncio
    import hashlib

    from kvtier.backends.mooncake_tier import MooncakeBackend

    from kvtier.backend import BlockFormat

    options = {"capacity": 1 << 30, "sync_interval_s": 3600, **servers.tier_options(), **options}
    backend = MooncakeBackend(**options)
    digest = hashlib.sha256(namespace).digest()
    asyncio.run(backend.open(BlockFormat(block_bytes=block_bytes, dtype="bfloat16", namespace_digest=digest)))
    return backend
