"""GPU benchmark: kvtier's device <-> tier copies against the raw link, and stream ordering.

Usage: ``python benchmarks/bench_gpu.py [--quick] [--out FILE]``. Needs a CUDA device: without
one it prints "no CUDA" on stderr and exits with status 2. Prints one JSON object on stdout
(and writes it to ``--out``), a readable summary on stderr. About a minute on an H200.

Cache: 32 layers of ``[blocks, 2, 16, 8, 128]`` bf16 (64 KiB per layer and block, 2 MiB per
offloaded block); jobs of 256 blocks (512 MiB) through ``kvtier.open(...).save`` / ``load``
into a ``cpu`` tier (pinned host pool), a ``gpu`` tier (a pool on the same device) and an
``lmdb`` tier. The raw limits are measured in the same run: one contiguous copy of the same
bytes device -> pinned host (``d2h_GBps``), back (``h2d_GBps``) and device -> device
(``d2d_GBps``); ``*_ratio`` is kvtier's bandwidth over that limit (best of several runs each).
A small-page case (80 layers of 8 KiB per layer and block, 640 KiB blocks, 320 MiB jobs, like
a TP=4 70B model) gives ``small_cpu_save_ratio`` / ``small_cpu_load_ratio``.

Ordering (20 trials each; every trial delays the compute stream with ``torch.cuda._sleep``):
``store_ordering_wrong`` counts saves submitted right after a kernel that writes the block and
that stored the old bytes; ``load_ordering_wrong`` counts kernels, queued on the compute stream
and still reading a block when a load into it was submitted, that saw the loaded bytes.
Both must be 0.

``fence_wait_ms``: a ``cpu`` tier written through to an ``lmdb`` tier whose writes stall for
1 s; the time from submitting a store job to the end of its device read (the fence the engine
waits on before reusing the blocks). It must not include the stall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import kvtier
from kvtier.testing import make_key

GB = 1e9
STALL_S = 1.0
SLEEP_CYCLES = 50_000_000  # ~25-50 ms of a spinning kernel on current GPUs


def no_cuda() -> None:
    print("bench_gpu: no CUDA device (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
    sys.exit(2)


class Keys:
    """Fresh keys on demand, so every save stores new blocks."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[bytes]:
        out = [make_key(i) for i in range(self.next, self.next + n)]
        self.next += n
        return out


def make_caches(layers: int, shape: tuple[int, ...], blocks: int) -> list[torch.Tensor]:
    """Random bf16 bit patterns (any bits must survive a copy)."""
    return [
        torch.randint(-(2**15), 2**15, (blocks, *shape), dtype=torch.int16, device="cuda").view(torch.bfloat16)
        for _ in range(layers)
    ]


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def raw_links(nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of one contiguous copy of ``nbytes``: D2H, H2D (pinned), D2D."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {
        "d2h": nbytes / min(timed(lambda: host.copy_(dev, non_blocking=True), reps)) / GB,
        "h2d": nbytes / min(timed(lambda: dev.copy_(host, non_blocking=True), reps)) / GB,
        "d2d": nbytes / min(timed(lambda: dev2.copy_(dev), reps)) / GB,
    }
    return out


def raw_gather_dma(caches: list[torch.Tensor], job: int, reps: int) -> float:
    """GB/s of a gather of ``job`` blocks into one device buffer plus one DMA (no pipeline)."""
    per = [c[0].numel() * c.element_size() for c in caches]
    total = job * sum(per)
    buf = torch.empty((job, sum(per)), dtype=torch.uint8, device="cuda")
    host = torch.empty_like(buf, device="cpu").pin_memory()
    idx = torch.arange(job, device="cuda")
    views = [c.view(c.shape[0], -1).view(torch.uint8) for c in caches]
    offs = [sum(per[:i]) for i in range(len(per))]

    def run() -> None:
        for v, o, p in zip(views, offs, per):
            torch.index_select(v, 0, idx, out=buf[:, o : o + p])
        host.copy_(buf, non_blocking=True)

    return total / min(timed(run, reps)) / GB


async def tier_bandwidth(
    tier: dict[str, Any], caches: list[torch.Tensor], job: int, reps: int, staging_bytes: int | None = None
) -> dict[str, Any]:
    """Save and load bandwidth (GB/s, best and median) of ``job``-block jobs through ``tier``."""
    cfg: dict[str, Any] = {"tiers": [tier]}
    if staging_bytes is not None:
        cfg["staging_bytes"] = staging_bytes
    keys = Keys()
    async with kvtier.open(cfg, kv_caches=caches) as store:
        assert store.layout is not None
        nbytes = job * store.layout.block_bytes
        src = list(range(job))
        dst = list(range(job, 2 * job))
        await store.save(keys.take(job), src)  # warm up: staging, pools, allocator
        saves, loads = [], []
        last: list[bytes] = []
        for _ in range(reps):
            last = keys.take(job)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            stored = await store.save(last, src)
            saves.append(time.perf_counter() - t0)
            if stored != job:
                raise RuntimeError(f"{tier['backend']}: stored {stored} of {job} blocks")
        await store.load(last, dst)
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = await store.load(last, dst)
            loads.append(time.perf_counter() - t0)
            if got != job:
                raise RuntimeError(f"{tier['backend']}: loaded {got} of {job} blocks")
        for c in caches:  # the loaded bytes are the saved ones
            if not torch.equal(c[dst].view(torch.uint8), c[src].view(torch.uint8)):
                raise RuntimeError(f"{tier['backend']}: loaded bytes differ from the saved ones")
        staging = store.stats().get("staging", {})
    return {
        "save": nbytes / min(saves) / GB,
        "load": nbytes / min(loads) / GB,
        "save_median": nbytes / statistics.median(saves) / GB,
        "load_median": nbytes / statistics.median(loads) / GB,
        "staging": staging,
    }


async def ordering(trials: int) -> dict[str, int]:
    """Trials in which a save read bytes still being written, or a load overwrote bytes still
    being read by a kernel queued on the compute stream."""
    caches = make_caches(4, (2, 16, 8, 128), 2 * trials + 4)
    keys = Keys()
    store_wrong = load_wrong = 0
    cfg = {"tiers": [{"backend": "cpu", "capacity": (4 * trials + 8) * 4 * 65536}]}
    async with kvtier.open(cfg, kv_caches=caches) as store:
        pool_backend = store.backends[0]
        layer_bytes = caches[0][0].numel() * caches[0].element_size()
        for t in range(trials):
            b = t
            value = float(t + 1)
            caches[0][b].zero_()
            torch.cuda.synchronize()
            # store: a kernel writes the block (late: the stream is busy), then the save.
            torch.cuda._sleep(SLEEP_CYCLES)
            caches[0][b].fill_(value)
            key = keys.take(1)
            await store.save(key, [b])
            torch.cuda.synchronize()
            row = pool_backend.pool[pool_backend.slots(key)[0]]  # type: ignore[attr-defined]
            stored = row[:layer_bytes].view(torch.bfloat16)
            if not bool((stored == value).all()):
                store_wrong += 1
            # load: a kernel still reads block c when a load into it is submitted.
            c = trials + t
            caches[0][c].zero_()
            snapshot = torch.empty_like(caches[0][c])
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            snapshot.copy_(caches[0][c])
            await store.load(key, [c])
            torch.cuda.synchronize()
            if bool((snapshot != 0).any()):
                load_wrong += 1
            if not bool((caches[0][c] == value).all()):
                raise RuntimeError("the load did not deliver the stored bytes")
    return {"store_ordering_wrong": store_wrong, "load_ordering_wrong": load_wrong}


async def fence_under_stall(caches: list[torch.Tensor], job: int) -> dict[str, float]:
    """Milliseconds until a store job's device read ends while its lmdb write stalls."""
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-gpu-") as root:
        block = sum(c[0].numel() * c.element_size() for c in caches)
        cfg = {
            "write": "through",
            "tiers": [
                {"backend": "cpu", "capacity": 4 * job * block},
                {"backend": "lmdb", "capacity": 8 * job * block, "path": f"{root}/lmdb"},
            ],
        }
        async with kvtier.open(cfg, kv_caches=caches) as store:
            lower = store.backends[1]
            write = lower.write_blocks

            def stalled(keys: Any, blocks: Any) -> Any:
                time.sleep(STALL_S)
                return write(keys, blocks)

            lower.write_blocks = stalled  # type: ignore[method-assign]
            keys = Keys().take(job)
            plan = await store.prepare_store(keys)
            assert plan is not None and store.transfers is not None
            ids = list(range(job))
            chosen = [ids[p] for p in plan.positions]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            jid = store.transfers.submit_store(plan, chosen)
            await asyncio.to_thread(store.transfers.wait_device, [jid])
            fence = time.perf_counter() - t0
            result = await store.transfers.wait_async(jid)
            total = time.perf_counter() - t0
            store.transfers.forget([jid])
            store.finish_store(plan, result)
    return {"fence_wait_ms": fence * 1000, "fence_job_ms": total * 1000}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    reps = 1 if args.smoke else 3 if args.quick else 5
    job = 4 if args.smoke else 64 if args.quick else 256
    layers, shape = 32, (2, 16, 8, 128)
    caches = make_caches(layers, shape, 2 * job + 8)
    block = sum(c[0].numel() * c.element_size() for c in caches)
    nbytes = job * block
    raw = raw_links(nbytes, reps)
    gather_dma = raw_gather_dma(caches, job, reps)
    cpu = await tier_bandwidth({"backend": "cpu", "capacity": 2 * nbytes}, caches, job, reps)
    gpu = await tier_bandwidth({"backend": "gpu", "capacity": 2 * nbytes, "device": "cuda"}, caches, job, reps)
    unstaged = await tier_bandwidth({"backend": "cpu", "capacity": 2 * nbytes}, caches, job, reps, staging_bytes=0)
    lmdb_job = max(4, job // 4)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-gpu-") as root:
        lmdb = await tier_bandwidth(
            {"backend": "lmdb", "capacity": 8 * lmdb_job * block, "path": f"{root}/lmdb"}, caches, lmdb_job, 3
        )
    fence = await fence_under_stall(caches, lmdb_job)
    del caches
    torch.cuda.empty_cache()

    # Small pages: 80 layers of 8 KiB per layer and block.
    small_shape = (2, 16, 1, 128)
    small_job = 8 if args.smoke else 128 if args.quick else 512
    small = make_caches(80, small_shape, 2 * small_job + 8)
    small_block = sum(c[0].numel() * c.element_size() for c in small)
    small_bytes = small_job * small_block
    small_raw = raw_links(small_bytes, reps)
    small_cpu = await tier_bandwidth({"backend": "cpu", "capacity": 2 * small_bytes}, small, small_job, reps)
    del small
    torch.cuda.empty_cache()

    order = await ordering(20)
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "quick": args.quick,
        "block_bytes": block,
        "job_blocks": job,
        "job_bytes": nbytes,
        "d2h_GBps": round(raw["d2h"], 2),
        "h2d_GBps": round(raw["h2d"], 2),
        "d2d_GBps": round(raw["d2d"], 1),
        "raw_gather_dma_GBps": round(gather_dma, 2),
        "cpu_save_GBps": round(cpu["save"], 2),
        "cpu_load_GBps": round(cpu["load"], 2),
        "cpu_save_ratio": round(cpu["save"] / raw["d2h"], 3),
        "cpu_load_ratio": round(cpu["load"] / raw["h2d"], 3),
        "cpu_save_median_ratio": round(cpu["save_median"] / raw["d2h"], 3),
        "cpu_load_median_ratio": round(cpu["load_median"] / raw["h2d"], 3),
        "gpu_save_GBps": round(gpu["save"], 1),
        "gpu_load_GBps": round(gpu["load"], 1),
        "gpu_save_ratio": round(gpu["save"] / raw["d2d"], 3),
        "gpu_load_ratio": round(gpu["load"] / raw["d2d"], 3),
        "unstaged_cpu_save_ratio": round(unstaged["save"] / raw["d2h"], 3),
        "unstaged_cpu_load_ratio": round(unstaged["load"] / raw["h2d"], 3),
        "unstaged_mode": unstaged["staging"].get("save_mode"),
        "lmdb_save_GBps": round(lmdb["save"], 3),
        "lmdb_load_GBps": round(lmdb["load"], 3),
        "small_block_bytes": small_block,
        "small_job_bytes": small_bytes,
        "small_d2h_GBps": round(small_raw["d2h"], 2),
        "small_h2d_GBps": round(small_raw["h2d"], 2),
        "small_cpu_save_ratio": round(small_cpu["save"] / small_raw["d2h"], 3),
        "small_cpu_load_ratio": round(small_cpu["load"] / small_raw["h2d"], 3),
        **order,
        "fence_wait_ms": round(fence["fence_wait_ms"], 1),
        "fence_job_ms": round(fence["fence_job_ms"], 1),
        "fence_stall_ms": STALL_S * 1000,
        "staging": cpu["staging"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller jobs and fewer repetitions")
    parser.add_argument("--out", help="also write the JSON object to this file")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny jobs: checks that the script runs; figures meaningless"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        no_cuda()
    result = asyncio.run(run(args))
    result["smoke"] = args.smoke
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(
        f"cpu tier save {result['cpu_save_GBps']} GB/s ({result['cpu_save_ratio']}x D2H {result['d2h_GBps']}), "
        f"load {result['cpu_load_GBps']} GB/s ({result['cpu_load_ratio']}x H2D {result['h2d_GBps']}); "
        f"gpu tier {result['gpu_save_ratio']}/{result['gpu_load_ratio']}x D2D {result['d2d_GBps']}; "
        f"small pages {result['small_cpu_save_ratio']}/{result['small_cpu_load_ratio']}x; "
        f"lmdb {result['lmdb_save_GBps']}/{result['lmdb_load_GBps']} GB/s; "
        f"ordering wrong: store {result['store_ordering_wrong']}/20, load {result['load_ordering_wrong']}/20; "
        f"fence {result['fence_wait_ms']} ms under a {result['fence_stall_ms']:.0f} ms stall",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
