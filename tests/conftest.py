"""Shared pytest fixtures."""

from __future__ import annotations

from mooncake_servers import MISSING as MOONCAKE_MISSING
from mooncake_servers import mooncake_binaries, mooncake_store, own_mooncake_store  # noqa: F401  (fixtures)
from redis_servers import (  # noqa: F401  (fixtures)
    MISSING,
    own_redis_cluster,
    own_redis_server,
    redis_cluster,
    redis_server,
    server_version,
)


def pytest_report_header(config: object) -> str:
    version = server_version()
    lines = [f"redis: {version}" if version else f"redis: {MISSING}"]
    lines.append("mooncake: " + (MOONCAKE_MISSING if mooncake_binaries() is None else "mooncake_master and mooncake_client of the installed wheel"))
    return "\n".join(lines)
