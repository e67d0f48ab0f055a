"""The ``mooncake`` tier against a raw Mooncake Store client on the same bytes, in the same run;
prints one JSON object.

Raw: ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` of whole jobs, from and into
one buffer registered with the client once (Mooncake's own zero-copy calls; the values carry no
header). kvtier: ``write_blocks`` / ``read_blocks`` of the same jobs (records with header and
checksum, put as head and row slices, checked in place). Both clients mount no memory
(``global_segment_size: 0``): the records live in a standalone ``mooncake_client``, as in a
deployment where they outlive the writer. The raw and kvtier runs alternate, and each ratio is
taken from one adjacent pair, so a noisy host moves both sides; the median ratio is reported,
with the load average. GB/s count block bytes.

With ``--peer-python PEER/bin/python`` (a Python with LMCache and Mooncake's store, such as the
peer environment of the shared peerbench), LMCache's own Mooncake connector moves the same cases
on the same servers next to kvtier's pairs (``benchmarks/lmcache_mooncake_side.py``, in that
Python), in ``--rounds`` rounds whose order reverses every round, and ``vs_lmcache_put`` /
``vs_lmcache_get`` are kvtier's median over LMCache's median in each round (above 1: kvtier is
faster).

Servers: a private ``mooncake_master`` and ``mooncake_client`` on loopback
(:mod:`kvtier.tools.mooncake_servers`; ``pip install 'kvtier[mooncake]'``).

    python benchmarks/bench_mooncake.py [--repeat 5] [--quick] [--peer-python PEER/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.backend import BlockFormat
from kvtier.testing import make_key
from kvtier.tools.mooncake_servers import MooncakeServers, mooncake_missing
from kvtier.tools.ports import start_on_free_ports

SHAPES = {"2MiB": (2 << 20, 48, 16), "64KiB": (64 << 10, 768, 128)}  # block bytes, blocks, blocks per job


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _raw_client(servers: MooncakeServers) -> Any:
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", servers.metadata_server, 0, 0, "tcp", "", servers.master)
    if rc != 0:
        raise RuntimeError(f"the raw Mooncake client did not set up ({rc})")
    return client


def _open_tier(servers: MooncakeServers, block: int) -> Any:
    from kvtier.backends.mooncake_tier import MooncakeBackend

    backend = MooncakeBackend(capacity=1 << 40, sync_interval_s=3600, prefix="bench", **servers.tier_options())
    digest = hashlib.sha256(f"bench-mooncake-{block}".encode()).digest()
    asyncio.run(backend.open(BlockFormat(block_bytes=block, dtype="bfloat16", namespace_digest=digest)))
    return backend


def measure_shape(servers: MooncakeServers, raw: Any, block: int, n: int, job: int, repeat: int) -> dict[str, Any]:
    values = torch.randint(0, 256, (n, block), dtype=torch.uint8)
    out = torch.zeros_like(values)
    for buf in (values, out):
        raw.register_buffer(buf.data_ptr(), buf.numel())
    rows, out_rows = list(values.unbind(0)), list(out.unbind(0))
    backend = _open_tier(servers, block)
    jobs = [range(i, min(n, i + job)) for i in range(0, n, job)]
    pairs: list[dict[str, float]] = []
    try:
        for rep in range(repeat + 1):  # the first round warms both clients up and is dropped
            raw_keys = [f"bench-raw-{block}-{rep}-{i}" for i in range(n)]
            keys = [make_key(rep * n + i) for i in range(n)]

            def raw_put(raw_keys: list[str] = raw_keys) -> None:
                for part in jobs:
                    codes = raw.batch_put_from([raw_keys[i] for i in part], [values[i].data_ptr() for i in part], [block] * len(part))
                    assert all(c == 0 for c in codes), codes

            def raw_get(raw_keys: list[str] = raw_keys) -> None:
                for part in jobs:
                    codes = raw.batch_get_into([raw_keys[i] for i in part], [out[i].data_ptr() for i in part], [block] * len(part))
                    assert all(c == block for c in codes), codes

            def tier_put(keys: list[bytes] = keys) -> None:
                for part in jobs:
                    sizes = backend.write_blocks([keys[i] for i in part], [rows[i] for i in part])
                    assert None not in sizes, sizes

            def tier_get(keys: list[bytes] = keys) -> None:
                for part in jobs:
                    found = backend.read_blocks([keys[i] for i in part], [out_rows[i] for i in part])
                    assert all(found), found

            times = {"raw_put": _timed(raw_put), "raw_get": _timed(raw_get)}
            assert torch.equal(out, values)
            out.zero_()
            times.update(kvtier_put=_timed(tier_put), kvtier_get=_timed(tier_get))
            assert torch.equal(out, values), "kvtier read other bytes than it wrote"
            out.zero_()
            raw.batch_remove(raw_keys, True)
            backend.delete_blocks(keys)
            if rep:
                pairs.append({k: n * block / t / 1e9 for k, t in times.items()})
    finally:
        asyncio.run(backend.aclose())
        for buf in (values, out):
            raw.unregister_buffer(buf.data_ptr())
    figures: dict[str, Any] = {"block_bytes": block, "blocks": n, "blocks_per_job": job, "repeat": repeat}
    for name in ("raw_put", "raw_get", "kvtier_put", "kvtier_get"):
        figures[f"{name}_gbps"] = round(statistics.median(p[name] for p in pairs), 3)
    for op in ("put", "get"):
        ratios = [p[f"kvtier_{op}"] / p[f"raw_{op}"] for p in pairs]
        figures[f"{op}_ratio"] = round(statistics.median(ratios), 3)
        figures[f"{op}_ratios"] = [round(r, 3) for r in ratios]
    return figures


def lmcache_side(peer_python: str, servers: MooncakeServers, block: int, n: int, job: int, repeat: int) -> dict[str, Any]:
    """LMCache's Mooncake connector on the same case and servers, in the peer's Python."""
    script = Path(__file__).with_name("lmcache_mooncake_side.py")
    case = f"{n}x{block >> 10}x{job}"
    proc = subprocess.run(
        [peer_python, "-W", "ignore", str(script), "--master", servers.master, "--metadata", servers.metadata_server,
         "--cases", case, "--reps", str(repeat)],
        capture_output=True, text=True, timeout=1800,
    )
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-800:]}"}
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"lmcache_version": found["lmcache"], **found[case]}


def against_lmcache(
    peer_python: str, servers: MooncakeServers, raw: Any, case: tuple[int, int, int], repeat: int, rounds: int
) -> dict[str, Any]:
    """``rounds`` rounds of kvtier's pairs and LMCache's run of one case, the order reversed every
    round; a ratio to LMCache per round (kvtier's median over LMCache's)."""
    block, n, job = case
    figures: dict[str, Any] = {"rounds": []}
    for r in range(rounds):
        sides = ["kvtier", "lmcache"] if r % 2 == 0 else ["lmcache", "kvtier"]
        found: dict[str, Any] = {}
        for side in sides:
            if side == "kvtier":
                found["kvtier"] = measure_shape(servers, raw, block, n, job, repeat)
            else:
                found["lmcache"] = lmcache_side(peer_python, servers, block, n, job, repeat)
        kv, peer = found["kvtier"], found["lmcache"]
        entry: dict[str, Any] = {"first": sides[0], "kvtier": kv, "lmcache": peer}
        if "error" not in peer:
            entry["vs_lmcache_put"] = round(kv["kvtier_put_gbps"] / peer["lmcache_put_gbps"], 3)
            entry["vs_lmcache_get"] = round(kv["kvtier_get_gbps"] / peer["lmcache_get_gbps"], 3)
        figures["rounds"].append(entry)
    for key in ("vs_lmcache_put", "vs_lmcache_get"):
        figures[key] = [e[key] for e in figures["rounds"] if key in e]
    for key in ("put_ratio", "get_ratio"):
        figures[key] = [e["kvtier"][key] for e in figures["rounds"]]
    return figures


def _report_servers(servers: MooncakeServers, exc: BaseException) -> None:
    """On stderr, before the temporary directory and its logs go: the failure, then whether each
    server still runs and the end of its log (a server that died is the usual reason)."""
    print(f"bench_mooncake: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    for name, process in servers.processes().items():
        if process.alive:
            state = "running"
        else:
            state = f"exited {process.proc.returncode}" if process.proc is not None else "stopped"
        print(f"--- {name} ({state}), end of {process.log}:\n{process.tail()[-1500:]}", file=sys.stderr)


def start_servers(folder: Path, segment_size: str = "1GB") -> MooncakeServers:
    """A started master and client in ``folder``, started again on new ports (each try in a
    folder of its own) when one was taken between its probe and the server's bind: anything on
    the host can take a free port in that moment."""
    return start_on_free_ports(
        lambda n: MooncakeServers(folder / f"servers-{n}", segment_size=segment_size), ports=lambda m: m.ports
    )


def measure(
    repeat: int, shapes: dict[str, tuple[int, int, int]], peer_python: str | None = None, rounds: int = 2
) -> dict[str, Any]:
    result: dict[str, Any] = {"load_average_before": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-mooncake-") as tmp:
        servers = start_servers(Path(tmp))
        try:
            raw = _raw_client(servers)
            try:
                for name, (block, n, job) in shapes.items():
                    if peer_python is None:
                        result[name] = measure_shape(servers, raw, block, n, job, repeat)
                    else:
                        result[name] = against_lmcache(peer_python, servers, raw, (block, n, job), repeat, rounds)
            finally:
                raw.close()
        except BaseException as exc:
            _report_servers(servers, exc)
            raise
        finally:
            servers.stop()
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two repetitions of small jobs")
    parser.add_argument("--peer-python", help="a Python with LMCache and Mooncake: measure LMCache's Mooncake connector too")
    parser.add_argument("--rounds", type=int, default=2, help="with --peer-python: rounds of both sides, the order reversed each round")
    args = parser.parse_args()
    missing = mooncake_missing()
    if missing is not None:
        print(json.dumps({"skipped": missing}))
        sys.exit(0)
    shapes = SHAPES
    if args.quick:
        shapes = {"2MiB": (2 << 20, 8, 4), "64KiB": (64 << 10, 64, 32)}
    print(json.dumps(measure(2 if args.quick else args.repeat, shapes, args.peer_python, args.rounds), indent=2))


if __name__ == "__main__":
    main()
