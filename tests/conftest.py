"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
from lmdb_lookups import warm_lmdb_lookups  # noqa: F401  (autouse: every lmdb lookup warm, whatever the machine)
from mooncake_servers import MISSING as MOONCAKE_MISSING
from mooncake_servers import mooncake_binaries, mooncake_store, own_mooncake_store  # noqa: F401  (fixtures)
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
from s3_servers import MISSING as S3_MISSING
from s3_servers import own_seaweed, s3_available, seaweed  # noqa: F401  (fixtures)
from server_ports import dead_port  # noqa: F401  (fixture)


@pytest.fixture(autouse=True)
def fresh_row_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``lmdb`` and ``file`` tiers keep views of host rows per process, by address. A row
    freed by an earlier test can leave its address to a row of the next, which a one-record
    read would then take as seen; each test starts with none seen, so no test's count of the
    general path's jobs hangs on the tests run before it."""
    from kvtier.backends import lmdb_plain

    monkeypatch.setattr(lmdb_plain, "_VIEWS", {})


def pytest_report_header(config: object) -> list[str]:
    lines = report_header()
    lines.append("mooncake: " + (MOONCAKE_MISSING if mooncake_binaries() is None else "mooncake_master and mooncake_client of the installed wheel"))
    lines.append("s3: " + (f"SeaweedFS {s3_available()} and obstore" if s3_available() else S3_MISSING))
    return lines
