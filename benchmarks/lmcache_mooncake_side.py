"""LMCache's Mooncake connector on a running Mooncake Store: put and get GB/s, one JSON line.

Run in a Python that has LMCache and Mooncake's store (the peer environment of
``benchmarks/bench_mooncake.py --peer-python``), never in kvtier's: it imports nothing of kvtier.
It drives ``lmcache.v1.storage_backend.remote_backend.RemoteBackend`` with
``remote_url="mooncakestore://MASTER/"`` as LMCache builds it for a remote-only setup (a
``LocalCPUBackend`` as the allocator, an asyncio loop on a thread), ``save_chunk_meta: false``
(the connector's zero-copy ``batch_put_from`` / ``batch_get_into`` path, no header), and
``global_segment_size: 0`` as kvtier's side runs. Calls are StorageManager's:
``batched_submit_put_task`` (timed until every completion callback fired) and
``batched_get_blocking``, in jobs of ``--job`` chunks; every get is checked byte for byte.

    PEER/bin/python benchmarks/lmcache_mooncake_side.py --master H:P --metadata URL \\
        --cases 48x2048x16,768x64x128 --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import statistics
import threading
import time
from typing import Any

TOKENS, HEAD_SIZE = 256, 64
UNIT = 2 * TOKENS * HEAD_SIZE * 2  # bytes per (layer, kv head) of one chunk: 64 KiB


def _quiet() -> None:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.WARNING)


class LMCacheMooncake:
    """RemoteBackend(mooncakestore://) with its LocalCPUBackend allocator and loop thread."""

    def __init__(self, master: str, metadata: str, n: int, chunk: int) -> None:
        _quiet()
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        _quiet()
        units = chunk // UNIT
        heads = math.gcd(units, 8)
        self.torch, self.key_class, self.dtype = torch, CacheEngineKey, torch.bfloat16
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=TOKENS,
            local_cpu=False,
            max_local_cpu_size=(3 * n * chunk + 256 * 1024**2) / 1024**3,
            remote_url=f"mooncakestore://{master}/",
            remote_serde="naive",
            extra_config={
                "save_chunk_meta": False,
                # mooncake_-prefixed keys go to Mooncake's setup(dict) as they are, without the
                # prefix (its dict API names the master master_server_addr)
                "mooncake_local_hostname": "127.0.0.1",
                "mooncake_metadata_server": metadata,
                "mooncake_master_server_addr": master,
                "mooncake_global_segment_size": 0,
                "mooncake_local_buffer_size": 16 << 20,
                "mooncake_protocol": "tcp",
                "transfer_timeout": 600,
            },
        )
        md = LMCacheMetadata(
            model_name="peerbench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=self.dtype, kv_shape=(units // heads, 2, TOKENS, heads, HEAD_SIZE), chunk_size=TOKENS,
        )
        self.shape, self.obj_dtype, self.fmt = md.get_shapes()[0], md.get_dtypes()[0], MemoryFormat.KV_2LTD
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.cpu = LocalCPUBackend(cfg, md, dst_device="cpu")
        self.rb = RemoteBackend(cfg, md, self.loop, self.cpu, dst_device="cpu")
        assert self.rb.connection is not None, "RemoteBackend did not connect"

    def keys(self, start: int, n: int) -> list[Any]:
        return [self.key_class("peerbench", 1, 0, start + i, self.dtype) for i in range(n)]

    def filled(self, src: Any, n: int, chunk: int) -> list[Any]:
        objs = []
        for i in range(n):
            obj = self.cpu.allocate(self.shape, self.obj_dtype, self.fmt)
            assert obj is not None and obj.get_size() == chunk, "allocation failed"
            obj.tensor.view(self.torch.uint8).view(-1).copy_(src[i])
            objs.append(obj)
        return objs

    def put(self, keys: list[Any], objs: list[Any]) -> None:
        done, left = threading.Event(), [len(keys)]

        def landed(_key: Any) -> None:
            left[0] -= 1
            if left[0] == 0:
                done.set()

        self.rb.batched_submit_put_task(keys, objs, on_complete_callback=landed)
        assert done.wait(600), f"{left[0]} put callbacks missing"


def run_case(master: str, metadata: str, n: int, chunk: int, job: int, reps: int) -> dict[str, Any]:
    import torch

    lmc = LMCacheMooncake(master, metadata, n, chunk)
    src = torch.randint(0, 256, (n, chunk), dtype=torch.uint8)
    puts, gets = [], []
    for rep in range(reps + 1):  # the first is a warm-up
        keys = lmc.keys(rep * n, n)
        objs = lmc.filled(src, n, chunk)
        t0 = time.perf_counter()
        for i in range(0, n, job):
            lmc.put(keys[i : i + job], objs[i : i + job])
        put_s = time.perf_counter() - t0
        for obj in objs:
            obj.ref_count_down()
        t0 = time.perf_counter()
        got: list[Any] = []
        for i in range(0, n, job):
            got += lmc.rb.batched_get_blocking(keys[i : i + job])
        get_s = time.perf_counter() - t0
        assert all(g is not None for g in got), "LMCache get returned None (a miss)"
        for i, g in enumerate(got):
            assert torch.equal(g.tensor.view(torch.uint8).view(-1), src[i]), "LMCache get mismatch"
            g.ref_count_down()
        store = lmc.rb.connection.getWrappedConnector().store
        store.batch_remove([k.to_string() for k in keys], True)
        if rep:
            puts.append(n * chunk / put_s / 1e9)
            gets.append(n * chunk / get_s / 1e9)
    return {"lmcache_put_gbps": round(statistics.median(puts), 3), "lmcache_get_gbps": round(statistics.median(gets), 3),
            "lmcache_put_all": [round(x, 3) for x in puts], "lmcache_get_all": [round(x, 3) for x in gets]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", required=True)
    parser.add_argument("--metadata", required=True)
    parser.add_argument("--cases", default="48x2048x16,768x64x128", help="CHUNKSxKIBxJOB, comma separated")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import lmcache

    result: dict[str, Any] = {"lmcache": getattr(lmcache, "__version__", "?")}
    for case in args.cases.split(","):
        n, kib, job = (int(x) for x in case.split("x"))
        result[case] = run_case(args.master, args.metadata, n, kib << 10, job, args.reps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
