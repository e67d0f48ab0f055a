"""kvtier as SGLang's HiCache storage backend against raw LMDB on the same pages; prints one JSON object.

The backend's calls (``kvtier.integrations.sglang.core.SglangStore``, which the SGLang class
delegates to; no SGLang install is needed) over a CPU host pool with SGLang's ``page_first``
MHA layout (``kvtier.integrations.sglang.testing.HostPool``), one durable ``lmdb`` tier:

- ``set_gbps``: ``batch_set_v1`` of jobs of 32 pages (SGLang's batches go up to 128), new pages
  each time; ``raw_set_gbps``: python-lmdb, the same pages gathered from the pool's K and V
  chunks into one buffer and put one transaction per page, synced as the tier's durable mode
  is (``sync=True, metasync=False``, and the environment synced at the end of each job). ``set_vs_raw`` = ``set_gbps / raw_set_gbps``.
- ``get_gbps``: ``batch_get_v1`` of the same jobs into other pages; ``raw_get_gbps``: one read
  transaction per job, ``get`` and a copy into the page's chunks. ``get_vs_raw`` likewise.
- ``tier_set_gbps`` / ``tier_get_gbps``: the lmdb tier's own ``write_blocks`` / ``read_blocks``
  of the same jobs (other keys; the page bytes already gathered): ``set_vs_tier`` and
  ``get_vs_tier`` are what the SGLang calls cost on top of the tier (key folding, the pool's
  addresses, the hand-off to the store's loop, the copies between the pool and the records).
- ``exists_us_per_page``: ``batch_exists`` over 128 stored pages (the local index: no I/O),
  per page. ``call_us``: a ``batch_get_v1`` of one page that is not stored (the hand-off to the
  store's event loop and back, the fixed cost of every data call).

GB/s count page bytes. Figures are the best of ``--repeat`` runs.

    python benchmarks/bench_sglang.py [--quick] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import lmdb
import torch

from kvtier.integrations.sglang import extra_config
from kvtier.integrations.sglang.core import SglangStore
from kvtier.integrations.sglang.testing import HostPool

JOB = 32


def _seconds(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _chunks(pool: HostPool, page: int) -> list[torch.Tensor]:
    """Page ``page``'s K and V chunks (page_first MHA), as views of the pool."""
    s = slice(page * pool.page_size, (page + 1) * pool.page_size)
    return [pool.kv_buffer[0, s].reshape(-1).view(torch.uint8), pool.kv_buffer[1, s].reshape(-1).view(torch.uint8)]


def raw_lmdb(path: str, pool: HostPool, pages: list[int], targets: list[int], page_bytes: int) -> tuple[float, float]:
    """(put seconds, get seconds) of the raw baseline over ``pages``, read back into ``targets``."""
    env = lmdb.open(path, map_size=4 * len(pages) * page_bytes + (64 << 20), sync=True, metasync=False, meminit=False)
    keys = [f"page-{p}".encode() for p in pages]
    buf = torch.empty(page_bytes, dtype=torch.uint8)

    def put() -> None:
        for start in range(0, len(pages), JOB):
            for key, page in zip(keys[start : start + JOB], pages[start : start + JOB]):
                torch.cat(_chunks(pool, page), out=buf)
                with env.begin(write=True) as txn:
                    txn.put(key, buf.numpy())
            env.sync(True)

    def get() -> None:
        for start in range(0, len(pages), JOB):
            with env.begin(buffers=True) as txn:
                for key, target in zip(keys[start : start + JOB], targets[start : start + JOB]):
                    raw = txn.get(key)
                    k, v = (memoryview(c.numpy()) for c in _chunks(pool, target))
                    k[:] = raw[: len(k)]
                    v[:] = raw[len(k) :]

    try:
        return _seconds(put), _seconds(get)
    finally:
        env.close()


def _tier_jobs(store: SglangStore, pool: HostPool, pages: list[int], page_bytes: int) -> tuple[float, float]:
    """(write seconds, read seconds) of the store's first tier over the same pages, job by job."""
    assert store.store is not None
    backend = store.store.backends[0]
    keys = store.keys([f"tier-{p}" for p in pages])
    blocks = [torch.cat(_chunks(pool, p)) for p in pages]
    outs = [torch.empty(page_bytes, dtype=torch.uint8) for _ in pages]
    spans = [slice(i, i + JOB) for i in range(0, len(pages), JOB)]
    write = _seconds(lambda: [backend.write_blocks(keys[j], blocks[j]) for j in spans])
    read = _seconds(lambda: [backend.read_blocks(keys[j], outs[j]) for j in spans])
    backend.delete_blocks(keys)
    return write, read


def one_round(root: str, pool: HostPool, pages: int, round_: int) -> dict[str, float]:
    """Every figure of one run, in pages or calls per second (higher is better)."""
    page_bytes = 2 * pool.page_size * pool.layer_num * pool.head_num * pool.head_dim * pool.dtype.itemsize
    total = pages * page_bytes
    sources, targets = list(range(pages)), list(range(pages, 2 * pages))
    put_s, get_s = raw_lmdb(f"{root}/raw", pool, sources, targets, page_bytes)
    figures = {"raw_set_gbps": total / put_s / 1e9, "raw_get_gbps": total / get_s / 1e9}
    identity = types.SimpleNamespace(model_name="bench/model", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False)
    tiers = [{"backend": "lmdb", "path": f"{root}/kvtier", "capacity": 4 * total + (64 << 20)}]
    store = SglangStore(identity, extra_config({"tiers": tiers}))
    store.attach(pool)
    try:
        hashes = [f"{round_:08x}{p:056x}" for p in sources]
        jobs = [(hashes[i : i + JOB], pool.indices(sources[i : i + JOB]), pool.indices(targets[i : i + JOB]))
                for i in range(0, pages, JOB)]
        figures["set_gbps"] = total / _seconds(lambda: [store.write(h, src) for h, src, _ in jobs]) / 1e9
        figures["get_gbps"] = total / _seconds(lambda: [store.read(h, dst) for h, _, dst in jobs]) / 1e9
        assert store.counters["pages_written"] == store.counters["pages_read"] == pages
        tier_set_s, tier_get_s = _tier_jobs(store, pool, sources, page_bytes)
        figures.update(tier_set_gbps=total / tier_set_s / 1e9, tier_get_gbps=total / tier_get_s / 1e9)
        probe = hashes[:128]
        figures["exists_pages_per_s"] = len(probe) * 200 / _seconds(lambda: [store.leading_hits(probe) for _ in range(200)])
        miss = pool.indices(targets[:1])
        figures["calls_per_s"] = 200 / _seconds(lambda: [store.read(["f" * 64], miss) for _ in range(200)])
    finally:
        store.close()
    return figures


def run(pages: int, repeat: int) -> dict[str, Any]:
    pool = HostPool("page_first", pages=2 * pages, page_size=16, layer_num=16, head_num=8, head_dim=64)
    best: dict[str, float] = {}
    for round_ in range(repeat):
        with tempfile.TemporaryDirectory() as root:
            for name, value in one_round(root, pool, pages, round_).items():
                best[name] = max(best.get(name, 0.0), value)
    out: dict[str, Any] = {"page_bytes": pool.kv_buffer[:, : pool.page_size].numel() * pool.dtype.itemsize,
                           "pages": pages, "job_pages": JOB}
    for name in ("set", "get"):
        ours = best[f"{name}_gbps"]
        out.update({
            f"{name}_gbps": round(ours, 3),
            f"raw_{name}_gbps": round(best[f"raw_{name}_gbps"], 3),
            f"tier_{name}_gbps": round(best[f"tier_{name}_gbps"], 3),
            f"{name}_vs_raw": round(ours / best[f"raw_{name}_gbps"], 3),
            f"{name}_vs_tier": round(ours / best[f"tier_{name}_gbps"], 3),
        })
    out["exists_us_per_page"] = round(1e6 / best["exists_pages_per_s"], 3)
    out["call_us"] = round(1e6 / best["calls_per_s"], 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer pages and one run (a few seconds)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    pages, repeat = (64, 1) if args.quick else (128, args.repeat)
    print(json.dumps(run(pages, repeat), sort_keys=True))


if __name__ == "__main__":
    main()
