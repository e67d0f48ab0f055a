"""Shared pytest fixtures."""

from __future__ import annotations

from redis_servers import (  # noqa: F401  (fixtures and the hook that runs redis tests on both kinds)
    MISSING,
    _shared_servers,
    own_redis_cluster,
    own_redis_server,
    pytest_generate_tests,
    redis_cluster,
    redis_server,
    report_header,
    server_kind,
    server_version,
)


def pytest_report_header(config: object) -> list[str]:
    return report_header()
