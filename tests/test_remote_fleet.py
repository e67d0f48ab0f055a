"""A fleet's tiers on real servers: ``[cpu, mooncake, s3]`` across separate processes.

Each host is its own Python process (tests/two_hosts.py) with a private ``cpu`` tier in front of
a Mooncake Store pool (``mooncake_master`` and a standalone ``mooncake_client``) and an S3 bucket
(SeaweedFS), both written through. What one host stored is served to another after the writer
exited; with the pool's master killed the bucket serves it; with both servers dead every lookup
is a miss, and nothing raises. Without the Mooncake wheel or SeaweedFS the test is skipped, and
says so in capitals.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from mooncake_servers import MooncakeServers
from s3_servers import BUCKET, SeaweedServer
from two_hosts import CPU_TIER, run_host


def _fleet_tiers(pool: MooncakeServers, bucket: SeaweedServer, prefix: str) -> list[dict[str, Any]]:
    return [
        CPU_TIER,
        {"backend": "mooncake", "capacity": "8MiB", **pool.tier_options(), "prefix": prefix},
        {"backend": "s3", "capacity": "8MiB", "endpoint_url": bucket.endpoint_url, "bucket": BUCKET, "prefix": prefix},
    ]


def test_cpu_mooncake_s3_across_processes_survives_the_writer_and_a_killed_server_is_a_miss(
    own_mooncake_store: MooncakeServers, own_seaweed: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", own_seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", own_seaweed.secret_key)
    tiers = _fleet_tiers(own_mooncake_store, own_seaweed, "f" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12])
    assert run_host("A", tiers) == {"saved": 12}  # stored in both shared tiers; A has exited
    served = run_host("B", tiers, reads=True)
    assert served["hits"] == served["loaded"] == 12 and served["byte_exact"] is True
    assert served["reads"]["mooncake"] == 12 and served["reads"]["s3"] == 0  # the faster shared tier first

    own_mooncake_store.kill_master()  # the pool is gone: its copies are misses, the bucket's serve
    served = run_host("B", tiers, reads=True)
    assert served["hits"] == served["loaded"] == 12 and served["byte_exact"] is True
    assert served["reads"]["mooncake"] == 0 and served["reads"]["s3"] == 12

    own_seaweed.kill()  # both servers dead: misses, never an exception
    assert run_host("B", tiers) == {"hits": 0, "loaded": 0, "byte_exact": True}
