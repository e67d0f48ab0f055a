"""Which S3 client the ``s3`` tier should use: put and get GB/s of each candidate against one
private SeaweedFS server on loopback, at 64 KiB and 2 MiB records.

Candidates: ``boto3`` (a thread pool of ``put_object`` / ``get_object`` calls on one client),
``obstore`` (its ``put_async`` / ``get_async`` gathered on one event loop: the requests run on
its Rust runtime) and NIXL's ``OBJ`` plugin (``nixl-cu12``, installed ``--no-deps``: one
``WRITE`` / ``READ`` transfer of registered host memory per batch), each where it is installed.
Every candidate moves the same ``--mib`` MiB per cell with ``--concurrency`` requests in flight,
and reads back what it wrote (checked byte for byte once per cell). Rounds rotate the
candidates' order; the report gives each cell's median over rounds and, per cell, each
candidate's ratio to boto3 (the raw baseline every S3 user has).

    python benchmarks/bench_s3_clients.py [--mib 64] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20}
BUCKET = "kvtier-bench"


class Boto3Client:
    name = "boto3"

    def __init__(self, endpoint: str, access: str, secret: str, concurrency: int) -> None:
        import boto3
        from botocore.config import Config

        self.client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id=access, aws_secret_access_key=secret, region_name="us-east-1",
            config=Config(max_pool_connections=concurrency, retries={"max_attempts": 1}),
        )
        self.pool = ThreadPoolExecutor(concurrency)

    def put(self, keys: list[str], payloads: list[memoryview]) -> None:
        list(self.pool.map(lambda kv: self.client.put_object(Bucket=BUCKET, Key=kv[0], Body=bytes(kv[1])), zip(keys, payloads)))

    def get(self, keys: list[str], out: list[memoryview]) -> None:
        def one(pair: tuple[str, memoryview]) -> None:
            body = self.client.get_object(Bucket=BUCKET, Key=pair[0])["Body"]
            pair[1][:] = body.read()

        list(self.pool.map(one, zip(keys, out)))

    def close(self) -> None:
        self.pool.shutdown()


class ObstoreClient:
    name = "obstore"

    def __init__(self, endpoint: str, access: str, secret: str, concurrency: int) -> None:
        from obstore.store import S3Store

        self.store = S3Store(
            BUCKET,
            config={"endpoint": endpoint, "access_key_id": access, "secret_access_key": secret, "region": "us-east-1",
                    "virtual_hosted_style_request": False},
            client_options={"allow_http": True, "pool_max_idle_per_host": str(concurrency)},
        )
        self.concurrency = concurrency
        self.loop = asyncio.new_event_loop()

    async def _bounded(self, calls: list[Callable[[], Any]]) -> None:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(call: Callable[[], Any]) -> None:
            async with gate:
                await call()

        await asyncio.gather(*(one(c) for c in calls))

    def put(self, keys: list[str], payloads: list[memoryview]) -> None:
        import obstore

        async def one(key: str, payload: memoryview) -> None:
            await obstore.put_async(self.store, key, payload)

        self.loop.run_until_complete(self._bounded([functools.partial(one, k, p) for k, p in zip(keys, payloads)]))

    def get(self, keys: list[str], out: list[memoryview]) -> None:
        import obstore

        async def one(key: str, dst: memoryview) -> None:
            got = await obstore.get_async(self.store, key)
            dst[:] = memoryview(await got.bytes_async())

        self.loop.run_until_complete(self._bounded([functools.partial(one, k, d) for k, d in zip(keys, out)]))

    def close(self) -> None:
        self.loop.close()


class NixlClient:
    name = "nixl-obj"

    def __init__(self, endpoint: str, access: str, secret: str, concurrency: int) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent("kvtier-bench", nixl_agent_config(backends=[]))
        host = endpoint.split("://", 1)[1]
        self.agent.create_backend("OBJ", {
            "access_key": access, "secret_key": secret, "bucket": BUCKET, "endpoint_override": host, "scheme": "http",
            "region": "us-east-1", "use_virtual_addressing": "false",
        })
        self._ids = 0

    def _run(self, op: str, keys: list[str], bufs: list[memoryview]) -> None:
        import numpy as np

        arrays = [np.frombuffer(b, dtype=np.uint8) for b in bufs]
        local = [(a.ctypes.data, a.nbytes, 0) for a in arrays]
        base = self._ids
        self._ids += len(keys)
        remote = [(0, a.nbytes, base + i, k) for i, (a, k) in enumerate(zip(arrays, keys))]
        dram = self.agent.register_memory([(*d, "") for d in local], "DRAM")
        objs = self.agent.register_memory(remote, "OBJ")
        try:
            handle = self.agent.initialize_xfer(
                op, self.agent.get_xfer_descs(local, "DRAM"),
                self.agent.get_xfer_descs([(0, a.nbytes, base + i) for i, a in enumerate(arrays)], "OBJ"), "kvtier-bench")
            state = self.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = self.agent.check_xfer_state(handle)
            self.agent.release_xfer_handle(handle)
            if state == "ERR":
                raise RuntimeError(f"nixl OBJ {op} failed")
        finally:
            self.agent.deregister_memory(objs)
            self.agent.deregister_memory(dram)

    def put(self, keys: list[str], payloads: list[memoryview]) -> None:
        self._run("WRITE", keys, payloads)

    def get(self, keys: list[str], out: list[memoryview]) -> None:
        self._run("READ", keys, out)

    def close(self) -> None:
        pass


CANDIDATES: list[Any] = [Boto3Client, ObstoreClient, NixlClient]


def _available(cls: Any) -> str | None:
    module = {"boto3": "boto3", "obstore": "obstore", "nixl-obj": "nixl_cu12"}[cls.name]
    try:
        __import__(module)
    except Exception as exc:
        return f"{module} does not import: {type(exc).__name__}: {exc}"
    return None


def _cell(client: Any, label: str, size: int, total: int) -> dict[str, float]:
    n = max(4, total // size)
    keys = [f"bench/{client.name}/{label}/{i:06d}" for i in range(n)]
    src = [memoryview(os.urandom(size)) for _ in range(min(n, 8))]
    payloads = [src[i % len(src)] for i in range(n)]
    out = [memoryview(bytearray(size)) for _ in range(n)]
    t0 = time.perf_counter()
    client.put(keys, payloads)
    t1 = time.perf_counter()
    client.get(keys, out)
    t2 = time.perf_counter()
    if any(out[i] != payloads[i] for i in range(n)):
        raise RuntimeError(f"{client.name} {label}: a record read back differs from what was written")
    return {"put_gbps": n * size / (t1 - t0) / 1e9, "get_gbps": n * size / (t2 - t1) / 1e9}


def _cell_of(medians: dict[str, dict[str, float]], cell: str, name: str) -> float:
    return medians[name].get(cell, 0.0)


def run(mib: int, rounds: int, concurrency: int, directory: Path) -> dict[str, Any]:
    from kvtier.tools.seaweed import SeaweedServer

    server = SeaweedServer(directory).start()
    try:
        server.create_bucket(BUCKET)
        skipped = {c.name: why for c in CANDIDATES if (why := _available(c))}
        clients: list[Any] = []
        for cls in CANDIDATES:
            if cls.name in skipped:
                continue
            try:
                clients.append(cls(server.endpoint_url, server.access_key, server.secret_key, concurrency))
            except Exception as exc:
                skipped[cls.name] = f"{type(exc).__name__}: {exc}"
        samples: dict[str, dict[str, list[float]]] = {}
        for _ in range(1):  # warm-up: connections, the server's first volumes
            for client in clients:
                _cell(client, "warm", 64 << 10, 4 << 20)
        for r in range(rounds):
            order = clients[r % len(clients):] + clients[: r % len(clients)]
            for client in order:
                for label, size in SIZES.items():
                    try:
                        got = _cell(client, f"{label}-{r}", size, mib << 20)
                    except Exception as exc:
                        skipped[client.name] = f"failed: {type(exc).__name__}: {exc}"
                        continue
                    for metric, value in got.items():
                        samples.setdefault(client.name, {}).setdefault(f"{label}.{metric}", []).append(value)
        for client in clients:
            client.close()
    finally:
        server.stop()
    medians = {name: {k: round(statistics.median(v), 4) for k, v in cells.items()} for name, cells in samples.items()}
    base = medians.get("boto3", {})
    ratios = {
        name: {k: round(v / base[k], 3) for k, v in cells.items() if base.get(k)}
        for name, cells in medians.items() if name != "boto3"
    }
    fastest = {
        cell: max(medians, key=functools.partial(_cell_of, medians, cell)) for cell in next(iter(medians.values()), {})
    }
    return {
        "bench": "s3_clients", "server": "seaweedfs (weed server, loopback)", "mib_per_cell": mib, "rounds": rounds,
        "concurrency": concurrency, "gbps": medians, "ratio_to_boto3": ratios, "fastest": fastest, "skipped": skipped,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def run_cli(doc: str, run: Callable[[int, int, int, Path], dict[str, Any]], argv: list[str] | None, *, mib: int, quick_mib: int) -> int:
    """The command line both S3 benchmarks share: ``--mib``, ``--rounds``, ``--concurrency``,
    ``--quick``, ``--json``; runs ``run(mib, rounds, concurrency, scratch folder)`` and prints
    its report."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--mib", type=int, default=mib, help=f"MiB moved per cell (default {mib})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--quick", action="store_true", help=f"{quick_mib} MiB per cell, one round")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.rounds = quick_mib, 1
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-s3-") as tmp:
        report = run(args.mib, args.rounds, args.concurrency, Path(tmp))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(__doc__ or "", run, argv, mib=64, quick_mib=8)


if __name__ == "__main__":
    sys.exit(main())
