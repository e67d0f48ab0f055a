"""The ``s3`` tier against its raw client, in the same run, on one private SeaweedFS server.

Per record size (64 KiB and 2 MiB) and round, each side moves the same ``--mib`` MiB as one
batch: the raw side with ``obstore`` itself (``put_async`` / ``get_async`` gathered on an event
loop, ``--concurrency`` requests in flight, bytes in and out, nothing checked), the tier with
one ``write_blocks`` and one ``read_blocks`` job (records with header and checksum, each read
checked and decoded into its row, the same concurrency). Rounds alternate which side goes
first. The report gives GB/s per side and cell (median over rounds) and ``ratio``: the tier over
raw for each cell and direction (1.0: the tier costs nothing over the client). Every tier read
is compared byte for byte with what was written. The host's load average is printed beside the
figures: on a shared 2-core host, compare ratios from adjacent runs only.

    python benchmarks/bench_s3.py [--mib 32] [--rounds 3] [--quick] [--json OUT]
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20}
BUCKET = "kvtier-bench"


def _raw_cell(server: Any, label: str, size: int, n: int, concurrency: int) -> dict[str, float]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        config={"endpoint": server.endpoint_url, "access_key_id": server.access_key, "secret_access_key": server.secret_key,
                "region": "us-east-1", "virtual_hosted_style_request": False},
        client_options={"allow_http": True, "pool_max_idle_per_host": str(concurrency)},
    )
    payloads = [memoryview(os.urandom(size)) for _ in range(min(n, 8))]
    keys = [f"raw/{label}/{i:06d}" for i in range(n)]
    out = [bytearray(size) for _ in range(n)]

    async def bounded(calls: list[Any]) -> None:
        gate = asyncio.Semaphore(concurrency)

        async def one(call: Any) -> None:
            async with gate:
                await call()

        await asyncio.gather(*(one(c) for c in calls))

    async def put(i: int) -> None:
        await obstore.put_async(store, keys[i], payloads[i % len(payloads)], use_multipart=False)

    async def get(i: int) -> None:
        got = await obstore.get_async(store, keys[i])
        out[i][:] = memoryview(await got.bytes_async())

    loop = asyncio.new_event_loop()
    try:
        t0 = time.perf_counter()
        loop.run_until_complete(bounded([lambda i=i: put(i) for i in range(n)]))
        t1 = time.perf_counter()
        loop.run_until_complete(bounded([lambda i=i: get(i) for i in range(n)]))
        t2 = time.perf_counter()
    finally:
        loop.close()
    return {"put_gbps": n * size / (t1 - t0) / 1e9, "get_gbps": n * size / (t2 - t1) / 1e9}


class _Missed(RuntimeError):
    """The tier failed writes or missed reads (a fault it counts, not wrong data)."""


def _tier_cell(server: Any, label: str, size: int, n: int, concurrency: int) -> dict[str, float]:
    from kvtier.backends.s3_tier import S3Backend

    from kvtier.backend import BlockFormat

    os.environ["KVTIER_BENCH_S3_ID"], os.environ["KVTIER_BENCH_S3_SECRET"] = server.access_key, server.secret_key
    backend = S3Backend(
        capacity=4 * n * size, endpoint_url=server.endpoint_url, bucket=BUCKET, prefix=f"tier-{label}",
        access_key_id_env="KVTIER_BENCH_S3_ID", secret_access_key_env="KVTIER_BENCH_S3_SECRET", concurrency=concurrency,
        sync_interval_s=3600, timeout_s=60.0, connect_timeout_s=10.0,  # a throughput bench: a busy host is no fault
    )
    fmt = BlockFormat(block_bytes=size, dtype="bfloat16", namespace_digest=hashlib.sha256(label.encode()).digest())
    asyncio.run(backend.open(fmt))
    try:
        source = [torch.frombuffer(bytearray(os.urandom(size)), dtype=torch.uint8) for _ in range(min(n, 8))]
        blocks = [source[i % len(source)] for i in range(n)]
        keys = [hashlib.sha256(f"{label}/{i}".encode()).digest() for i in range(n)]
        out = [torch.empty(size, dtype=torch.uint8) for _ in range(n)]
        t0 = time.perf_counter()
        sizes = backend.write_blocks(keys, blocks)
        t1 = time.perf_counter()
        found = backend.read_blocks(keys, out)
        t2 = time.perf_counter()
        if not all(torch.equal(o, b) for o, b, hit in zip(out, blocks, found) if hit):
            raise RuntimeError(f"tier {label}: a block read back differs from what was written")
        if None in sizes or not all(found):
            raise _Missed(f"tier {label}: {sizes.count(None)} writes failed, {found.count(False)} reads missed ({backend.stats()})")
    finally:
        asyncio.run(backend.aclose())
    return {"put_gbps": n * size / (t1 - t0) / 1e9, "get_gbps": n * size / (t2 - t1) / 1e9}


def _measured(cell: Any, server: Any, label: str, size: int, n: int, concurrency: int, retried: list[str]) -> dict[str, float]:
    """One cell; a cell whose tier failed a write or missed a read (the server shed a request
    on a busy host: the tier marks itself down, as it should) is measured again under a new
    label, at most twice, and named in the report's ``retried``. Wrong bytes are never retried."""
    for attempt in range(3):
        try:
            return cell(server, label if attempt == 0 else f"{label}-again{attempt}", size, n, concurrency)
        except _Missed as exc:
            if attempt == 2:
                raise
            retried.append(str(exc))
            print(f"bench_s3: {exc}; measuring the cell again", file=sys.stderr)
    raise AssertionError("unreachable")


def run(mib: int, rounds: int, concurrency: int, directory: Path) -> dict[str, Any]:
    from kvtier.tools.seaweed import SeaweedServer

    server = SeaweedServer(directory).start()
    samples: dict[str, dict[str, list[float]]] = {"raw": {}, "tier": {}}
    retried: list[str] = []
    try:
        server.create_bucket(BUCKET)
        sides = {"raw": _raw_cell, "tier": _tier_cell}
        for name, cell in sides.items():  # warm-up: connections, the server's volumes
            _measured(cell, server, f"warm-{name}", 64 << 10, 8, concurrency, retried)
        for r in range(rounds):
            order = ["raw", "tier"] if r % 2 == 0 else ["tier", "raw"]
            for label, size in SIZES.items():
                n = max(4, (mib << 20) // size)
                for name in order:
                    got = _measured(sides[name], server, f"{label}-r{r}-{name}", size, n, concurrency, retried)
                    for metric, value in got.items():
                        samples[name].setdefault(f"{label}.{metric}", []).append(value)
    finally:
        server.stop()
    medians = {side: {k: round(statistics.median(v), 4) for k, v in cells.items()} for side, cells in samples.items()}
    ratio = {k: round(medians["tier"][k] / medians["raw"][k], 3) for k in medians["raw"] if medians["raw"][k]}
    return {
        "bench": "s3", "server": "seaweedfs (weed server, loopback)", "client": "obstore", "mib_per_cell": mib,
        "rounds": rounds, "concurrency": concurrency, "gbps": medians, "ratio": ratio,
        "retried": retried, "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    from kvtier.tools.bench.scripts.bench_s3_clients import run_cli

    return run_cli(__doc__ or "", run, argv, mib=32, quick_mib=4)


if __name__ == "__main__":
    sys.exit(main())
