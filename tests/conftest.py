"""Shared pytest fixtures."""

from __future__ import annotations

from redis_servers import (  # noqa: F401  (fixtures)
    MISSING,
    own_redis_cluster,
    own_redis_server,
    redis_cluster,
    redis_server,
    server_version,
)
from s3_servers import own_seaweed, seaweed  # noqa: F401  (fixtures)


def pytest_report_header(config: object) -> str:
    version = server_version()
    return f"redis: {version}" if version else f"redis: {MISSING}"
