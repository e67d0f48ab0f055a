"""Two hosts sharing a tier, for real: each host is a separate Python process running a store.

``run_host("A", tiers)`` saves 12 blocks through a store of ``tiers`` (the shared tier last) and
exits; ``run_host("B", tiers)`` then opens its own store, looks the blocks up and loads them,
comparing every byte with what A saved. A's process has ended before B starts, so whatever B
is served outlived its writer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

__all__ = ["CPU_TIER", "HOST_SCRIPT", "run_host"]

HOST_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, torch, kvtier, kvtier.testing
    role, tiers, reads, write = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    def caches(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, 256, (16, 2, 512), generator=g, dtype=torch.uint8).view(torch.bfloat16) for _ in range(2)]
    keys = [kvtier.testing.make_key(i) for i in range(12)]
    cfg = {"tiers": tiers, "write": write, "namespace": {"model_id": "two-hosts"}}
    async def main():
        if role == "A":
            kv = caches(11)
            async with kvtier.open(cfg, kv_caches=kv) as store:
                print(json.dumps({"saved": await store.save(keys, list(range(12)))}))
        else:
            kv = caches(99)
            async with kvtier.open(cfg, kv_caches=kv) as store:
                hits = await store.lookup(keys)
                loaded = await store.load(keys, list(range(4, 16)))
                ref = caches(11)
                same = all(torch.equal(kv[l][4 + i].view(torch.uint8), ref[l][i].view(torch.uint8)) for l in range(2) for i in range(loaded))
                answer = {"hits": hits, "loaded": loaded, "byte_exact": same}
                if reads:  # blocks each tier served, by backend name
                    answer["reads"] = {b["backend"]: b["blocks_read"] for b in store.stats()["backends"]}
                print(json.dumps(answer))
    asyncio.run(main())
    """
)

#: What each host's private first tier is: room for all 16 blocks of its cache.
CPU_TIER = {"backend": "cpu", "capacity": 16 * 2048}


def run_host(role: str, tiers: list[dict[str, Any]], *, reads: bool = False, write: str = "through") -> dict[str, Any]:
    """Run host ``role`` (``"A"`` saves, ``"B"`` loads) with ``tiers`` and the store's ``write``
    mode; its JSON answer (with ``reads``, B also says how many blocks each tier served, by
    backend name)."""
    proc = subprocess.run(
        # faulthandler: a host killed by a signal (a crash at exit, say) says where on stderr
        [sys.executable, "-X", "faulthandler", "-c", HOST_SCRIPT, role, json.dumps(tiers), "1" if reads else "0", write],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.returncode == 0, f"host {role} exited with {proc.returncode}; stdout: {proc.stdout[-500:]!r}; stderr: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
