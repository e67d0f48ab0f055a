"""One SGLang process for the two-process tests: ``python sglang_child.py SPEC_JSON``.

SPEC: ``mode`` ("write" or "read"), ``layout``, ``mla``, ``tp_size``, ``pages``, ``seed`` and
``extra`` (the extra config); a read may list ``variants`` too (each a dict of ``layout`` /
``tp_size`` to read under as well, one after the other). It builds the backend through
SGLang's factory over a fresh :class:`sglang_env.HostPool` and prints one JSON line:

* write: stores pages ``0..pages-1`` of a pool filled from ``seed`` under hashes ``h0..``;
* read: zeroes its own pool, asks ``batch_exists``, loads the hits into pages in reverse
  order, and reports whether each loaded page equals the writer's page (rebuilt from ``seed``);
  then the same for each variant, under ``"variants"``.
"""

from __future__ import annotations

import json
import sys

from sglang_env import build_backend, sglang_storage

from kvtier.integrations.sglang.testing import HostPool


def main(spec: dict) -> dict:
    out = run(spec)
    if spec["mode"] == "read":
        out["variants"] = [run({**spec, **variant}) for variant in spec.get("variants", [])]
    return out


def run(spec: dict) -> dict:
    sgl = sglang_storage()
    pool = HostPool(spec["layout"], mla=spec["mla"], seed=spec["seed"])
    n = spec["pages"]
    hashes = [f"{spec['seed']:08x}{i:056x}" for i in range(n)]
    backend = build_backend(sgl, pool, spec["extra"], tp_size=spec["tp_size"])
    try:
        if spec["mode"] == "write":
            return {"stored": backend.batch_set_v1(hashes, pool.indices(list(range(n))))}
        want = [pool.page(p) for p in range(n)]
        pool.kv_buffer.zero_()
        hits = backend.batch_exists(hashes)
        targets = list(range(pool.size // pool.page_size - 1, -1, -1))[:hits]
        loaded = backend.batch_get_v1(hashes[:hits], pool.indices(targets))
        exact = [bool(pool.page(t).equal(w)) for t, w in zip(targets, want)]
        return {"hits": hits, "loaded": loaded, "exact": exact}
    finally:
        backend.close()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
