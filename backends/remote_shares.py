"""One remote tier job on several connections at once: the job's share of a server, cut in pieces.

A job's records on one server (the single server, or one primary of a cluster) are cut into
contiguous *shares*, and each share is one batched exchange on its own connection, all of
them at the same time: the first on the calling thread, the others on the tier's I/O threads
(:class:`kvtier.backends.remote_tier.RemoteRecordBackend` runs them). The figures below are the
redis tier's, which chose the sizes.

Why several connections rather than one deeper pipeline: redis-server writes at most 64 KiB to one
client per turn of its event loop, and the replies queued for a connection grow that client's
output buffer, memory the server allocates and touches anew for every reply. With four connections
and a 1 MiB window each, the server fills four sockets per turn and keeps about 4 MiB of replies in
flight. Measured here (2 cores, one private redis-server 7.0, 4096 reads of 64 KiB records): server
CPU per job 0.11-0.16 s against 0.21-0.27 s for one connection with 16 MiB in flight, and about 1.5x
the throughput.

A share is never smaller than :data:`SHARE_MIN_BYTES` of records, so a small job stays one exchange
on the calling thread, with no thread hop.

Each share receives and checksums on its own thread, so shares need cores: ``job_connections:
auto`` (the default) is half the CPUs this process may run on, 1 to :data:`AUTO_MAX_SHARES`. On a
quiet 2-core host, 4 connections lost to one on 64 KiB records (puts 0.48-0.55 against
0.57-0.66 GB/s, gets 0.88-0.91 against 1.03-1.14, same process, alternating), while the server's
CPU saving above showed only when the host was loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.devices import usable_cpus
from kvtier.shares import run_all

__all__ = ["AUTO_MAX_SHARES", "SHARE_MIN_BYTES", "auto_job_connections", "run_all", "split_shares"]

#: The fewest record bytes worth a connection (and a thread hop) of their own.
SHARE_MIN_BYTES = 1 << 20

#: The most connections ``job_connections: auto`` gives one job.
AUTO_MAX_SHARES = 4


def auto_job_connections(cpus: int | None = None) -> int:
    """Connections per job for ``job_connections: auto``: half the CPUs this process may run
    on, between 1 and :data:`AUTO_MAX_SHARES` (1 on a 2-CPU host)."""
    if cpus is None:
        cpus = usable_cpus()
    return max(1, min(AUTO_MAX_SHARES, cpus // 2))


def split_shares(positions: Sequence[int], record_bytes: int, most: int) -> list[list[int]]:
    """``positions`` cut into at most ``most`` contiguous shares of near-equal length, each of at
    least :data:`SHARE_MIN_BYTES` when ``record_bytes`` is the size of one record (one share,
    the whole of ``positions``, when that cannot be had). Order is kept: the shares, joined, are
    ``positions``."""
    n = len(positions)
    k = min(most, n, max(1, n * record_bytes // SHARE_MIN_BYTES))
    if k <= 1:
        return [list(positions)]
    return [list(positions[j * n // k : (j + 1) * n // k]) for j in range(k)]
