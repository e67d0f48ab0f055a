#!/usr/bin/env python3
"""End-to-end check of kvtier under vLLM (``kvtier.integrations.vllm``), on CPU.

Six fresh processes share one tiny random Llama and one LMDB tier under a temp dir, run in
this order (``docs/integrations/vllm.md`` describes each):

* **A**    - vLLM's default process layout (engine core and worker each in its own process),
  kvtier on ``[cpu, lmdb]`` written through, empty: generates for prompts ``P_i`` and stores
  their blocks;
* **B**    - the same layout, started after A exited: generates for ``P_0 + E`` (a longer
  prompt with the same prefix) and must load ``P_0``'s blocks;
* **A2**, **B2** - the same at TP=2 under vLLM's multiprocess executor, with offloaded chunks of
  2 vLLM blocks; B2 first computes ``P_0``'s first 3 blocks, so its load starts mid-chunk;
* **C**    - the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the
  spies can watch vLLM's scheduler), after this script damaged the payload of three of
  ``P_0``'s records in the LMDB file (python-lmdb, between processes; headers intact, so only
  the checksum can tell): the same prompt, then the same prompt again with vLLM's own prefix
  cache emptied (the retry);
* **ref**  - vLLM without kvtier: the recompute reference (tokens, log-probs, TTFT on misses).

Checks (any failure exits 1): A and A2 left the same records on every rank, A2's apart from
A's; B's, B2's and C's greedy tokens equal ref's; the log-prob of each generated token differs
by at most ``--atol`` (float32 model); B's and B2's ``num_cached_tokens`` equals the stored
prefix (what their own prefix cache did not hold came from kvtier), and every rank's kvtier
counters show its shard of those blocks loaded from the LMDB tier. Step C (see
``check_step_c``): kvtier counts, logs and deletes the damaged records and reports their
GPU block ids to vLLM, which recomputes from the first of them on (the blocks before it are
reused); on the retry kvtier serves the leading run without errors and stores the recomputed
blocks again, and no damaged record is left in the tier.
It also prints TTFT (one request, ``max_tokens=1``) with and without kvtier hits.

If vLLM cannot be imported it prints one line ``VLLM E2E SKIPPED: <reason>`` and exits 0.
Run with the interpreter of an environment that has vLLM and kvtier installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import vllm_e2e_hybrid as hybrid  # the hybrid model's processes (this script's directory)
from vllm_engine import BLOCK, VOCAB, make_llm, make_model, prompts

PREFIX_BLOCKS = 16  # tokens of each stored prompt: PREFIX_BLOCKS * BLOCK
EXTRA = 24  # tokens B appends to P_0
MAX_TOKENS = 16
NUM_TTFT = 4  # prompts per TTFT measurement
LMDB_CAPACITY = 2 << 30  # the LMDB tier's capacity (its map size; each rank has its share)
CPU_CAPACITY = 64 << 20  # the memory tier in front of it


def _corrupt_positions() -> dict[int, str]:
    """Blocks of P_0 that step C corrupts in the LMDB tier, and how (all in the payload)."""
    return {
        PREFIX_BLOCKS // 2: "every payload byte inverted",  # the first corrupt block: mid-prefix
        3 * PREFIX_BLOCKS // 4: "one bit flipped mid-payload",
        PREFIX_BLOCKS - 1: "last payload byte inverted",
    }


def _set_prefix_blocks(n: int) -> None:
    global PREFIX_BLOCKS
    PREFIX_BLOCKS = n


#: roles that run vLLM's default process layout (engine core in its own process, each worker
#: rank in its own under TP=2), and their tensor-parallel size; the others run the engine core
#: in the script's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), where the spies can see it.
DEFAULT_LAYOUT = {"A": 1, "B": 1, "A2": 2, "B2": 2}
#: vLLM blocks per offloaded chunk (kvtier record) of each role; 1 for the others
CHUNK_BLOCKS = {"A2": 2, "B2": 2}
#: processes that read kvtier's counters through vLLM's stats path (``LLM.get_metrics()``)
STATS_ROLES = ("B2",)
#: vLLM blocks of P_0 that B2 has in its GPU prefix cache before its target request: the
#: offloaded prefix then starts inside a chunk, and kvtier's load skips that chunk's first block
GPU_PREFIX_BLOCKS = 3


def _env(role: str) -> dict[str, str]:
    env = dict(os.environ)
    if role not in DEFAULT_LAYOUT:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:  # LLM.collective_rpc(_worker_view) sends a function to the engine core (pickled)
        env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if DEFAULT_LAYOUT.get(role, 1) == 2:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


_prompts = prompts


def _worker_view(worker: Any = None) -> dict[str, Any]:
    """Run in each vLLM worker (``LLM.collective_rpc``): the kvtier counters of the ranks in that
    process and the namespace of their records (rank 0's is the key namespace)."""
    from kvtier.integrations.vllm import engines

    ranks = [e for e in engines.live_engines() if isinstance(e, engines.RankEngine)]
    return {
        "stats": engines.engine_stats(),
        "namespaces": {e.rank: e.store.namespace for e in ranks},
    }


def _worker_drain(worker: Any = None, timeout: float = 120.0) -> bool:
    """Run in each vLLM worker: wait until the transfer jobs of every rank in that process have
    ended (their tier writes included). vLLM gives its workers a few seconds at exit before it
    kills them (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``), so on a loaded machine a store still
    queued for LMDB when the process exits would be lost (a later miss): the check counts
    records, so it waits for them first. False if some rank was still busy at the timeout."""
    from kvtier.integrations.vllm import engines

    ranks = [e for e in engines.live_engines() if isinstance(e, engines.RankEngine)]
    idle = True
    for engine in ranks:
        transfers = engine.store.transfers
        if transfers is None:
            continue
        try:
            transfers.wait_idle(timeout=timeout)
        except TimeoutError:
            idle = False
    return idle


def _block_hashes(llm: Any, tokens: list[int]) -> list[Any]:
    """vLLM's chained block hashes of the full blocks of ``tokens`` (its configured hash
    function, from the ``NONE_HASH`` it seeded at start-up). Plain token prompts carry no extra
    hash keys."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    hash_fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)  # as the engine core did (sha256: a fixed seed, the same in every process)
    parent, hashes = None, []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hash_block_tokens(hash_fn, parent, tokens[start : start + BLOCK])
        hashes.append(parent)
    return hashes


def _block_keys(llm: Any, tokens: list[int], namespace: Any) -> list[str]:
    """The kvtier keys (hex) of the full blocks of ``tokens``: vLLM's block hash plus KV-cache
    group 0, folded with the key namespace (rank 0's), as the integration's manager does."""
    from vllm.v1.kv_offload.base import make_offload_key

    from kvtier.keys import fold_block_hashes

    offload_keys = [make_offload_key(h, 0) for h in _block_hashes(llm, tokens)]
    return [k.hex() for k in fold_block_hashes(offload_keys, namespace=namespace)]


class _Spy:
    """What a process observes around its target request: tokens vLLM's scheduler scheduled,
    block ids kvtier reported to vLLM as failed loads, and warnings of vLLM's scheduler (its
    recovery message) and of kvtier."""

    def __init__(self) -> None:
        #: block hashes of every BlockStored event the connector handed vLLM (never reset)
        self.stored_hashes: set[Any] = set()
        self.reset()

    def reset(self) -> None:
        self.scheduled_tokens = 0
        self.reported_block_ids: list[int] = []
        self.warnings: list[str] = []

    def patch_connector(self, cls: Any) -> None:
        original = cls.get_block_ids_with_load_errors
        spy = self

        def get_block_ids_with_load_errors(connector: Any) -> set[int]:
            ids = original(connector)
            spy.reported_block_ids.extend(sorted(ids))
            return ids

        cls.get_block_ids_with_load_errors = get_block_ids_with_load_errors
        take_events = cls.take_events

        def spied_take_events(connector: Any) -> Any:
            events = list(take_events(connector))
            for event in events:
                if type(event).__name__ == "BlockStored":
                    spy.stored_hashes.update(event.block_hashes)
            return events

        cls.take_events = spied_take_events

    def patch_engine(self, llm: Any) -> None:
        """Count every scheduled token (in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0)
        and collect warnings; after the engine is built, since vLLM configures logging on start."""
        import logging

        spy = self
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        original = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            spy.scheduled_tokens += sum(output.num_scheduled_tokens.values())
            return output

        scheduler.schedule = schedule

        class _Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                spy.warnings.append(f"{record.name}: {record.getMessage()}")

        for name in (type(scheduler).__module__, "kvtier"):
            logging.getLogger(name).addHandler(_Handler(level=logging.WARNING))


def _tiers(role: str, lmdb_path: str) -> list[dict[str, Any]]:
    """A and B (and A2, B2) store to a memory tier and, written through, to the LMDB tier; C
    reads the LMDB tier alone (its checks count LMDB reads)."""
    lmdb = {"backend": "lmdb", "path": lmdb_path, "capacity": LMDB_CAPACITY}
    if role in DEFAULT_LAYOUT or role in hybrid.ROLES:
        return [{"backend": "cpu", "capacity": CPU_CAPACITY}, lmdb]
    return [lmdb]


def child(role: str, model: str, lmdb_path: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations import vllm as kv_vllm

    in_process = role not in DEFAULT_LAYOUT
    is_ref = role in ("ref", "Href")
    spy = _Spy() if in_process else None
    if spy is not None and not is_ref:
        spy.patch_connector(kv_vllm.KvtierConnector)
    failed_receives = hybrid.patch_failed_receives(kv_vllm.KvtierConnector) if role == "HC" else []
    kwargs: dict[str, Any] = {}
    kv_transfer = None
    if not is_ref:
        # Per-rank records: step C damages records found by their block key (head-group
        # records, the default, are checked across TP sizes by scripts/vllm_e2e_fleet.py).
        store = {
            "tiers": _tiers(role, lmdb_path),
            "write": "through",
            "head_groups": {"record_layout": "per_rank", "reason": "this check damages records by their block key"},
        }
        chunk = {"blocks_per_chunk": CHUNK_BLOCKS[role]} if role in CHUNK_BLOCKS else {}
        kv_transfer = kv_vllm.kv_transfer_config(store, **chunk)
    if role in STATS_ROLES:
        kwargs["disable_log_stats"] = False  # vLLM's stat loggers: kvtier's counters reach them
    llm = make_llm(
        model,
        max_model_len=-(-(PREFIX_BLOCKS * BLOCK + EXTRA + MAX_TOKENS) // BLOCK) * BLOCK,
        kv_transfer=kv_transfer,
        tp=DEFAULT_LAYOUT.get(role, 1),
        **kwargs,
    )
    if spy is not None:
        spy.patch_engine(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, detokenize=False)
    first = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    length = PREFIX_BLOCKS * BLOCK
    stored = _prompts(1, NUM_TTFT, length)  # P_0 .. P_3, stored by A
    unseen = _prompts(2, NUM_TTFT, length)  # never stored

    def run(tokens: list[int], params: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return outs[0], time.perf_counter() - start

    def vllm_metrics() -> dict[str, int]:
        """kvtier's counters as vLLM's own stats path delivers them to this process (connector
        stats from every rank and the scheduler side, added up by vLLM; its Prometheus logger)."""
        from vllm.v1.metrics.reader import Counter

        return {
            m.name.removeprefix("vllm:kvtier_"): int(m.value)
            for m in llm.get_metrics()
            if isinstance(m, Counter) and m.name.startswith("vllm:kvtier_")
        }

    def kvtier_stats() -> dict[str, Any]:
        """The kvtier counters: in this process (the engine core runs here), or summed over
        the worker processes (vLLM's default layout: the scheduler side is out of reach)."""
        if in_process:
            return kv_vllm.engine_stats()  # type: ignore[no-any-return]
        return _sum_stats([view["stats"] for view in llm.collective_rpc(_worker_view)])

    # Warm up on unrelated tokens: the first prefill of a shape is slow. (B stores its warm-up
    # prompts too, so C uses others: its LMDB traffic before the target is then all misses.)
    for warm in _prompts({"A": 3, "A2": 3, "HA": 3, "C": 6, "HC": 9}.get(role, 5), 2, length):
        run(warm, first)
    result: dict[str, Any] = {"role": role}

    def record(o: Any) -> dict[str, Any]:
        c = o.outputs[0]
        lps = [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)]
        return {"tokens": list(c.token_ids), "logprobs": lps, "num_cached_tokens": o.num_cached_tokens}

    if role in hybrid.ROLES:
        result["kv_cache_groups"] = hybrid.kv_cache_groups(llm)
    if role in ("A", "A2", "HA"):
        result["stored"] = [record(run(p, greedy)[0]) for p in stored]
        for warm in _prompts(8, 2, length):  # a few more engine steps: the last stores complete
            run(warm, first)
        result["workers_drained"] = all(llm.collective_rpc(_worker_drain))
        if role == "HA":
            result["kvtier"] = kvtier_stats()
            with open(out, "w") as f:
                json.dump(result, f)
            return
        views = [v for v in llm.collective_rpc(_worker_view) if v["namespaces"]]
        namespace = next(ns for v in views for r, ns in v["namespaces"].items() if int(r) == 0)
        result["p0_keys"] = _block_keys(llm, stored[0], namespace)
    else:
        if role == "B2":  # P_0's leading blocks, computed (and a kvtier hit for the first chunk)
            run(stored[0][: GPU_PREFIX_BLOCKS * BLOCK + 5], first)
        if role == "C":
            # Before its first request for P_0, C told vLLM's event stream (which routers read)
            # that it holds P_0's blocks: adopted at start, named by the offload key log.
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            assert spy is not None
            p0 = [maybe_convert_block_hash(h) for h in _block_hashes(llm, stored[0])]
            result["p0_blocks_announced"] = sum(h in spy.stored_hashes for h in p0)
        if spy is not None:
            spy.reset()
        failed_receives.clear()
        before = kvtier_stats() if not is_ref else {}
        groups_before = hybrid.group_counters()
        metrics_before = vllm_metrics() if role in STATS_ROLES else {}
        o, _ = run(stored[0] + _prompts(4, 1, EXTRA)[0], greedy)
        result["target"] = record(o)
        if role in ("HB", "HC"):
            result["groups_before_target"], result["groups_after_target"] = groups_before, hybrid.group_counters()
            result["failed_receives"] = failed_receives
        if role in STATS_ROLES:
            result["metrics_before_target"], result["metrics_after_target"] = metrics_before, vllm_metrics()
        if spy is not None:
            result["scheduled_tokens"] = spy.scheduled_tokens
            result["reported_block_ids"] = spy.reported_block_ids
            result["warnings"] = spy.warnings
        if not is_ref:
            result["kvtier_before_target"] = before
            result["kvtier_after_target"] = kvtier_stats()
        if role == "C":
            assert spy is not None
            # The same prompt again, with vLLM's own prefix cache emptied: kvtier now misses
            # the deleted records and serves the leading run before the first of them.
            llm.reset_prefix_cache()
            spy.reset()
            o, _ = run(stored[0] + _prompts(4, 1, EXTRA)[0], greedy)
            result["retry"] = record(o)
            result["retry_scheduled_tokens"] = spy.scheduled_tokens
            result["retry_reported_block_ids"] = spy.reported_block_ids
            result["retry_warnings"] = spy.warnings
            result["kvtier_after_retry"] = kv_vllm.engine_stats()
            for warm in _prompts(7, 2, length):  # a few more engine steps: stores complete
                run(warm, first)
    if role in ("B", "ref"):
        # Alternate hit and miss prompts so drift in machine load affects both alike.
        result["ttft_stored"], result["ttft_unseen"] = [], []
        for hit, miss in zip(stored[1:], unseen):
            result["ttft_stored"].append(run(hit, first)[1])
            result["ttft_unseen"].append(run(miss, first)[1])
    if not is_ref:
        result["kvtier"] = kvtier_stats()
    with open(out, "w") as f:
        json.dump(result, f)


def _sum_stats(views: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters of several processes' ``engine_stats()`` (one engine each) added up."""
    total: dict[str, Any] = {"ranks": []}
    for view in views:
        for name, value in view.items():
            if name == "ranks":
                total["ranks"] += value
            elif isinstance(value, int):
                total[name] = total.get(name, 0) + value
            elif name == "transfers":
                t = total.setdefault("transfers", {})
                for k, v in value.items():
                    t[k] = t.get(k, 0) + v
    return total


def _open_lmdb(path: str) -> Any:
    import lmdb

    env = lmdb.open(path, map_size=LMDB_CAPACITY, subdir=True, max_dbs=3, readahead=False, lock=True)
    return env, env.open_db(b"blocks"), env.open_db(b"index")


def _check_record(key: bytes, value: Any) -> str | None:
    """None if the record (head and payload joined) passes kvtier's checks, else the reason it
    does not."""
    from kvtier.errors import CorruptBlockError
    from kvtier.records.format import HEADER, decode_record

    raw_length = HEADER.unpack_from(value, 0)[5]
    try:
        decode_record(key, bytes(value), memoryview(bytearray(raw_length)))
    except CorruptBlockError as exc:
        return str(exc)
    return None


def corrupt_records(lmdb_path: str, keys: list[bytes], positions: dict[int, str]) -> int:
    """Damage the payload of the records of ``keys[p]`` for ``p`` in ``positions`` in place
    (header untouched: only the checksum can tell). Returns the payload bytes of one record."""
    from kvtier.backends.lmdb_layout import join_record

    from kvtier.records.format import HEADER_SIZE

    env, blocks, index = _open_lmdb(lmdb_path)
    try:
        with env.begin(write=True) as txn:
            for pos, how in positions.items():
                key = keys[pos]
                value = txn.get(key, db=blocks)
                entry = txn.get(key, db=index)
                if value is None:
                    raise SystemExit(f"VLLM E2E FAILED: block {pos} of P_0 ({key.hex()[:16]}…) is not in the LMDB tier")
                if _check_record(key, join_record(entry, value)) is not None:
                    raise SystemExit(f"VLLM E2E FAILED: block {pos} of P_0 is corrupt before step C corrupted it")
                # The payload alone is stored when the head is in the index entry; else it follows it.
                start = 0 if len(join_record(entry, value)) > len(value) else HEADER_SIZE
                stored = bytearray(value)
                payload = len(stored) - start
                if how.startswith("every"):
                    stored[start:] = bytes(b ^ 0xFF for b in stored[start:])
                elif how.startswith("one bit"):
                    stored[start + payload // 2] ^= 0x10
                else:
                    stored[-1] ^= 0xFF
                if _check_record(key, join_record(entry, stored)) is None:
                    raise SystemExit(f"VLLM E2E FAILED: the damaged record of block {pos} still passes its checksum")
                txn.put(key, bytes(stored), db=blocks)
    finally:
        env.close()
    return payload


def rank_dir(lmdb_path: str, rank: int, world: int) -> str:
    """Where rank ``rank`` of ``world`` keeps its records of the LMDB tier at ``lmdb_path``."""
    return os.path.join(lmdb_path, f"r{rank}-of-{world}")


def record_keys(path: str) -> set[bytes]:
    """The keys of the records in the LMDB tier directory ``path``."""
    env, blocks, _ = _open_lmdb(path)
    try:
        with env.begin() as txn:
            return {bytes(k) for k, _ in txn.cursor(db=blocks)}
    finally:
        env.close()


def inspect_records(lmdb_path: str, keys: list[bytes]) -> list[str]:
    """State of each key's record: "ok", "absent" or "corrupt"."""
    from kvtier.backends.lmdb_layout import join_record

    env, blocks, index = _open_lmdb(lmdb_path)
    try:
        with env.begin() as txn:
            out = []
            for key in keys:
                value = txn.get(key, db=blocks)
                entry = txn.get(key, db=index)
                if value is None:
                    out.append("absent" if entry is None else "absent (index entry left)")
                else:
                    out.append("ok" if _check_record(key, join_record(entry, value)) is None else "corrupt")
            return out
    finally:
        env.close()


def spawn(role: str, model: str, lmdb_path: str, work: str) -> dict[str, Any]:
    out = os.path.join(work, f"{role}.json")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        role,
        "--model",
        model,
        "--lmdb",
        lmdb_path,
        "--out",
        out,
        "--prefix-blocks",
        str(PREFIX_BLOCKS),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(role), capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"VLLM E2E FAILED: process {role} exited with {proc.returncode}")
    print(f"process {role}: {time.perf_counter() - start:.1f} s")
    with open(out) as f:
        return json.load(f)  # type: ignore[no-any-return]


def check_served(name: str, x: dict[str, Any], tr: dict[str, Any], world: int, atol: float, *, chunks: int) -> list[str]:
    """Failures of a fresh process ``name`` (``world`` worker ranks, vLLM's default process
    layout) that ran P_0 + E after A stored P_0: its tokens are the recompute's, the stored
    prefix was not prefilled (``num_cached_tokens``: what its own prefix cache did not hold came
    from kvtier), and every rank loaded ``chunks`` records of it from kvtier without a failure."""
    failures: list[str] = []
    t = x["target"]
    prefix = PREFIX_BLOCKS * BLOCK
    if t["tokens"] != tr["tokens"]:
        failures.append(f"{name}'s tokens differ from the recompute: {t['tokens']} != {tr['tokens']}")
    diffs = [abs(p - q) for p, q in zip(t["logprobs"], tr["logprobs"])]
    if not diffs or max(diffs) > atol:
        failures.append(f"{name}: log-probs differ by {max(diffs, default=float('inf')):.3g} > atol {atol}")
    if t["num_cached_tokens"] != prefix:
        failures.append(f"{name}'s num_cached_tokens is {t['num_cached_tokens']}, expected the {prefix} stored tokens")
    after, before = x["kvtier_after_target"], x["kvtier_before_target"]
    loaded, failed = _delta(after, before, "blocks_loaded"), _delta(after, before, "blocks_load_failed")
    if sorted(after.get("ranks", [])) != list(range(world)) or (loaded, failed) != (world * chunks, 0):
        failures.append(
            f"{name}: ranks {after.get('ranks')} loaded {loaded} / failed {failed} records, expected ranks "
            f"{list(range(world))} to load {world * chunks} (each rank its shard of {chunks}) / 0"
        )
    return failures


def check_vllm_stats(name: str, x: dict[str, Any], world: int, *, chunks: int) -> list[str]:
    """Failures of kvtier's counters read through vLLM's own stats path (connector stats of
    every rank and of the scheduler side, added up by vLLM, read from its Prometheus logger in
    the front-end process): they agree with the workers' own counters (``collective_rpc``) and
    include the scheduler side's, which ``collective_rpc`` cannot reach."""
    failures: list[str] = []
    after, before = x["metrics_after_target"], x["metrics_before_target"]
    rpc_after, rpc_before = x["kvtier_after_target"], x["kvtier_before_target"]
    for counter, want in (
        ("blocks_loaded", world * chunks),
        ("mid_chunk_loads", _delta(rpc_after, rpc_before, "mid_chunk_loads")),
        ("blocks_load_failed", 0),
        ("transfer_bytes_loaded", _delta(rpc_after, rpc_before, "bytes_loaded", "transfers")),
    ):
        got = _delta(after, before, counter)
        if got != want:
            failures.append(f"{name}: vLLM's stats path counted {counter} {got}, expected {want}")
    if _delta(after, before, "lookup_hits") < chunks:
        failures.append(f"{name}: vLLM's stats path counted {_delta(after, before, 'lookup_hits')} scheduler-side hits, expected >= {chunks}")
    return failures


def _delta(after: dict[str, Any], before: dict[str, Any], name: str, section: str | None = None) -> int:
    if section is not None:
        after, before = after.get(section, {}), before.get(section, {})
    return int(after.get(name, 0)) - int(before.get(name, 0))


def check_step_c(
    c: dict[str, Any],
    tr: dict[str, Any],
    before: list[str],
    after: list[str],
    positions: dict[int, str],
    atol: float,
) -> list[str]:
    """Failures of step C: process C ran P_0 + E after the payloads of P_0's records at
    ``positions`` were damaged in the LMDB tier, then ran it again with vLLM's prefix cache
    emptied (the retry).

    What vLLM 0.32 does (``kv_load_failure_policy="recompute"``): kvtier reports the GPU block ids
    of the records that failed their checksum; vLLM truncates the request's computed tokens at
    the first reported block and recomputes everything from there, so exactly the leading
    ``min(positions)`` blocks are reused although kvtier read the later good ones too.
    """
    failures: list[str] = []
    prefix, prompt = PREFIX_BLOCKS * BLOCK, PREFIX_BLOCKS * BLOCK + EXTRA
    bad, first_bad = len(positions), min(positions)
    reused = first_bad * BLOCK
    if before != ["ok"] * PREFIX_BLOCKS:
        failures.append(f"P_0's records before step C: {before}, expected all {PREFIX_BLOCKS} ok")

    def same_as_recompute(run: str, rec: dict[str, Any]) -> None:
        if rec["tokens"] != tr["tokens"]:
            failures.append(f"C ({run}): tokens differ from the recompute: {rec['tokens']} != {tr['tokens']}")
        diffs = [abs(x - y) for x, y in zip(rec["logprobs"], tr["logprobs"])]
        if not diffs or max(diffs) > atol:
            failures.append(f"C ({run}): log-probs differ by {max(diffs, default=float('inf')):.3g} > atol {atol}")

    # C adopted P_0's blocks at start and announced them before the first request.
    if c.get("p0_blocks_announced") != PREFIX_BLOCKS:
        failures.append(f"C announced {c.get('p0_blocks_announced')} of P_0's {PREFIX_BLOCKS} adopted blocks as events")
    kb = c["kvtier_before_target"]
    if not 0 < kb.get("blocks_announced", 0) <= kb.get("blocks_adopted", 0):
        failures.append(f"C announced {kb.get('blocks_announced')} adopted blocks, adopted {kb.get('blocks_adopted')}")

    # First run: every block was a lookup hit (the index still lists them), so one load job
    # read all of them; the damaged ones failed their checksum, were counted, logged, deleted
    # and reported to vLLM.
    tc, kc = c["target"], c["kvtier_after_target"]
    same_as_recompute("first run", tc)
    if kc.get("blocks_loaded") != PREFIX_BLOCKS - bad or kc.get("blocks_load_failed") != bad:
        failures.append(
            f"C: kvtier loaded {kc.get('blocks_loaded')} / failed {kc.get('blocks_load_failed')} blocks, "
            f"expected {PREFIX_BLOCKS - bad} / {bad}"
        )
    corrupt = kc.get("corrupt_records", 0)
    if corrupt != bad:
        failures.append(f"C: kvtier counted {corrupt} corrupt records, expected {bad}")
    logged = [w for w in c["warnings"] if "corrupt record" in w]
    if len(logged) != bad:
        failures.append(f"C: kvtier logged {len(logged)} corrupt records, expected {bad}")
    if len(set(c["reported_block_ids"])) != bad or len(c["reported_block_ids"]) != bad:
        failures.append(f"C: kvtier reported block ids {c['reported_block_ids']} to vLLM, expected {bad} distinct ids")
    prefilled = c["scheduled_tokens"] - (MAX_TOKENS - 1)
    if prefilled != prompt - reused:
        failures.append(
            f"C: vLLM prefilled {prefilled} tokens, expected {prompt - reused} "
            f"(reusing the {first_bad} blocks before the first corrupt one)"
        )
    recovered = [w for w in c["warnings"] if "Recovered from KV load failure" in w]
    want = f"1 request(s) rescheduled ({prefix - reused} tokens affected)"
    if len(recovered) != 1 or want not in recovered[0]:
        failures.append(f"C: vLLM's recovery warnings {recovered}, expected one saying {want!r}")
    # vLLM fixes num_cached_tokens when it first schedules the request (all the tokens the
    # connector offered) and does not lower it after a failed load: documented, checked here.
    if tc["num_cached_tokens"] != prefix:
        failures.append(f"C: num_cached_tokens is {tc['num_cached_tokens']}, vLLM 0.32 reports {prefix} here")

    # Retry: kvtier's lookup stops at the first deleted record; no error, nothing corrupt, and
    # the recomputed blocks that kvtier lacks are stored again (the others are skipped).
    tk, kr = c["retry"], c["kvtier_after_retry"]
    same_as_recompute("retry", tk)
    loaded, failed = _delta(kr, kc, "blocks_loaded"), _delta(kr, kc, "blocks_load_failed")
    if (loaded, failed) != (first_bad, 0) or c["retry_reported_block_ids"] or c["retry_warnings"]:
        failures.append(
            f"C (retry): kvtier loaded {loaded} / failed {failed} blocks, reported {c['retry_reported_block_ids']}, "
            f"warnings {c['retry_warnings']}; expected {first_bad} / 0, none, none"
        )
    if c["retry_scheduled_tokens"] - (MAX_TOKENS - 1) != prompt - reused or tk["num_cached_tokens"] != reused:
        failures.append(
            f"C (retry): vLLM prefilled {c['retry_scheduled_tokens'] - (MAX_TOKENS - 1)} tokens with "
            f"num_cached_tokens {tk['num_cached_tokens']}, expected {prompt - reused} and {reused}"
        )
    prepared, skipped = _delta(kr, kc, "store_prepared", "manager"), _delta(kr, kc, "store_skipped", "manager")
    if (prepared, skipped) != (bad, PREFIX_BLOCKS - first_bad - bad):
        failures.append(
            f"C (retry): kvtier prepared {prepared} / skipped {skipped} stores, "
            f"expected the {bad} deleted blocks / the {PREFIX_BLOCKS - first_bad - bad} it still had"
        )

    # The tier afterwards: no damaged record left; the deleted ones hold the recomputed KV.
    for pos in positions:
        if after[pos] != "ok":
            failures.append(f"C: block {pos}'s record after C is {after[pos]!r}, expected it rewritten (ok)")
    others = [after[i] for i in range(PREFIX_BLOCKS) if i not in positions]
    if others != ["ok"] * len(others):
        failures.append(f"C: the undamaged records of P_0 after C: {others}, expected all ok")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["ref", "A", "B", "C", "A2", "B2", *hybrid.ROLES])
    ap.add_argument("--model")
    ap.add_argument("--lmdb")
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the random Llama")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (64 per head, 2 query heads per KV head)")
    ap.add_argument("--prefix-blocks", type=int, default=PREFIX_BLOCKS, help=f"{BLOCK}-token blocks per stored prompt")
    ap.add_argument("--atol", type=float, default=1e-3, help="max |logprob_B - logprob_ref| per generated token")
    ap.add_argument("--hybrid-only", action="store_true", help="run the hybrid model's processes alone")
    args = ap.parse_args()
    if args.prefix_blocks < 4:
        ap.error("--prefix-blocks must be at least 4 (step C damages blocks in the middle of the prefix)")
    _set_prefix_blocks(args.prefix_blocks)
    if args.child:
        child(args.child, args.model, args.lmdb, args.out)
        return 0
    try:
        import vllm  # noqa: F401

        import kvtier.integrations.vllm as kv_vllm

        kv_vllm.KvtierConnector  # noqa: B018  (imports the vLLM classes: fails here if vLLM's API moved)
    except Exception as exc:
        print(f"VLLM E2E SKIPPED: cannot import vLLM / kvtier's vLLM classes: {type(exc).__name__}: {exc}")
        return 0
    hybrid_args = {
        "vocab": VOCAB,
        "block": BLOCK,
        "prefix_blocks": PREFIX_BLOCKS,
        "prompt": PREFIX_BLOCKS * BLOCK + EXTRA,
        "decode_steps": MAX_TOKENS - 1,
        "atol": args.atol,
    }
    if args.hybrid_only:
        with tempfile.TemporaryDirectory(prefix="kvtier-vllm-e2e-") as work:
            failures, summary = hybrid.run(spawn, _open_lmdb, work, **hybrid_args)
        print(json.dumps(summary, indent=1))
        for f in failures:
            print(f"VLLM E2E FAILED: {f}")
        print("VLLM E2E PASSED" if not failures else "", end="\n" if not failures else "")
        return 1 if failures else 0
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-e2e-") as work:
        model = os.path.join(work, "tiny-llama")
        make_model(model, args.layers, args.hidden)
        lmdb_path = os.path.join(work, "lmdb")
        a = spawn("A", model, lmdb_path, work)
        stored_keys = {r: record_keys(rank_dir(lmdb_path, r, 1)) for r in range(1)}
        b = spawn("B", model, lmdb_path, work)
        # TP=2 (and chunks of 2 blocks) on the same LMDB tier: each rank keeps its own
        # records, apart from TP=1's.
        a2 = spawn("A2", model, lmdb_path, work)
        stored_keys2 = {r: record_keys(rank_dir(lmdb_path, r, 2)) for r in range(2)}
        b2 = spawn("B2", model, lmdb_path, work)
        p0_keys = [bytes.fromhex(k) for k in a["p0_keys"]]
        positions = _corrupt_positions()
        tp1_dir = rank_dir(lmdb_path, 0, 1)
        before_c = inspect_records(tp1_dir, p0_keys)
        payload_bytes = corrupt_records(tp1_dir, p0_keys, positions)
        c = spawn("C", model, lmdb_path, work)
        after_c = inspect_records(tp1_dir, p0_keys)
        ref = spawn("ref", model, lmdb_path, work)
        failures, hybrid_summary = hybrid.run(spawn, _open_lmdb, work, **hybrid_args)
    prefix = PREFIX_BLOCKS * BLOCK
    tr = ref["target"]
    per_prompt = NUM_TTFT + 2 + 2  # A's stored prompts and its warm-ups before and after
    for name, keys, world, res in (("A", stored_keys, 1, a), ("A2", stored_keys2, 2, a2)):
        if not res.get("workers_drained"):
            failures.append(f"{name}: some rank's transfer jobs had not ended 120 s after its last request")
        want = per_prompt * PREFIX_BLOCKS // CHUNK_BLOCKS.get(name, 1)
        sizes = [len(keys[r]) for r in range(world)]
        if sizes != [want] * world or any(keys[r] != keys[0] for r in range(world)):
            failures.append(f"{name} left {sizes} records per rank in the LMDB tier, expected {want} on each, the same keys")
        if world == 2 and keys[0] & stored_keys[0]:
            failures.append("TP=2 and TP=1 records share keys: another TP size must never be served")
    failures += check_served("B", b, tr, 1, args.atol, chunks=PREFIX_BLOCKS)
    # B2's GPU prefix cache held P_0's first 3 blocks: kvtier loads chunks 1.. (2 blocks each),
    # the first of them from its second block on.
    n2 = CHUNK_BLOCKS["B2"]
    failures += check_served("B2", b2, tr, 2, args.atol, chunks=PREFIX_BLOCKS // n2 - GPU_PREFIX_BLOCKS // n2)
    mid = _delta(b2["kvtier_after_target"], b2["kvtier_before_target"], "mid_chunk_loads")
    if mid != 2:
        failures.append(f"B2: {mid} loads started inside a chunk, expected 2 (one per rank)")
    failures += check_vllm_stats("B2", b2, 2, chunks=PREFIX_BLOCKS // n2 - GPU_PREFIX_BLOCKS // n2)
    tb = b["target"]
    max_diff = max((abs(x - y) for x, y in zip(tb["logprobs"], tr["logprobs"])), default=float("inf"))
    loaded = _delta(b["kvtier_after_target"], b["kvtier_before_target"], "blocks_loaded")
    stored_blocks = len(stored_keys[0])
    if tr["num_cached_tokens"] != 0:
        failures.append(f"the recompute had {tr['num_cached_tokens']} cached tokens, expected 0")
    decode_steps = MAX_TOKENS - 1  # one token per step after the prefill step's first token
    prefilled = {r: x["scheduled_tokens"] - decode_steps for r, x in (("C", c), ("ref", ref))}
    if prefilled["ref"] != prefix + EXTRA:
        failures.append(f"vLLM prefilled {prefilled['ref']} tokens in ref, expected all {prefix + EXTRA}")

    # Step C: the same prompt after some of P_0's records were damaged in the LMDB tier.
    failures += check_step_c(c, tr, before_c, after_c, positions, args.atol)
    tc, kc, kr = c["target"], c["kvtier_after_target"], c["kvtier_after_retry"]
    c_diffs = [abs(x - y) for x, y in zip(tc["logprobs"], tr["logprobs"])]
    ms = 1000.0
    summary = {
        "prompt_tokens": prefix + EXTRA,
        "stored_prefix_tokens": prefix,
        "B_num_cached_tokens": tb["num_cached_tokens"],
        "blocks_in_lmdb_after_A": stored_blocks,
        "B_blocks_loaded": loaded,
        "B_bytes_loaded": b["kvtier_after_target"].get("transfers", {}).get("bytes_loaded"),
        "tokens_equal": tb["tokens"] == tr["tokens"],
        "max_logprob_abs_diff": max_diff,
        "ttft_ms_no_kvtier_median": statistics.median(ref["ttft_stored"] + ref["ttft_unseen"]) * ms,
        "ttft_ms_kvtier_hit_median": statistics.median(b["ttft_stored"]) * ms,
        "ttft_ms_kvtier_miss_median": statistics.median(b["ttft_unseen"]) * ms,
        "ttft_prompt_tokens": prefix,
        "ttft_ms_samples": {
            "no_kvtier": [round(x * ms, 1) for x in ref["ttft_stored"] + ref["ttft_unseen"]],
            "kvtier_hit": [round(x * ms, 1) for x in b["ttft_stored"]],
            "kvtier_miss": [round(x * ms, 1) for x in b["ttft_unseen"]],
        },
        "ref_tokens_prefilled": prefilled["ref"],
        "B2": {
            "tensor_parallel_size": 2,
            "blocks_per_chunk": CHUNK_BLOCKS["B2"],
            "gpu_prefix_blocks_before_target": GPU_PREFIX_BLOCKS,
            "loads_started_mid_chunk": _delta(b2["kvtier_after_target"], b2["kvtier_before_target"], "mid_chunk_loads"),
            "records_per_rank_after_A2": [len(stored_keys2[r]) for r in range(2)],
            "num_cached_tokens": b2["target"]["num_cached_tokens"],
            "kvtier_blocks_loaded_all_ranks": _delta(b2["kvtier_after_target"], b2["kvtier_before_target"], "blocks_loaded"),
            "vllm_stats_path": {
                k: _delta(b2["metrics_after_target"], b2["metrics_before_target"], k)
                for k in ("blocks_loaded", "mid_chunk_loads", "lookup_hits", "transfer_bytes_loaded")
            },
            "tokens_equal": b2["target"]["tokens"] == tr["tokens"],
        },
        "C": {
            "blocks_adopted": c["kvtier_before_target"].get("blocks_adopted"),
            "blocks_announced_as_events": c["kvtier_before_target"].get("blocks_announced"),
            "p0_blocks_announced": c.get("p0_blocks_announced"),
            "damaged_blocks_of_P0": {str(p): how for p, how in positions.items()},
            "payload_bytes_per_record": payload_bytes,
            "kvtier_blocks_loaded": kc.get("blocks_loaded"),
            "kvtier_blocks_load_failed": kc.get("blocks_load_failed"),
            "kvtier_corrupt_records": kc.get("corrupt_records", 0),
            "block_ids_reported_to_vllm": c["reported_block_ids"],
            "vllm_tokens_prefilled": prefilled["C"],
            "vllm_tokens_reused": prefix + EXTRA - prefilled["C"],
            "num_cached_tokens": tc["num_cached_tokens"],
            "tokens_equal": tc["tokens"] == tr["tokens"],
            "max_logprob_abs_diff": max(c_diffs, default=None),
            "warnings": c["warnings"],
            "retry_kvtier_blocks_loaded": _delta(kr, kc, "blocks_loaded"),
            "retry_kvtier_blocks_restored": _delta(kr, kc, "store_prepared", "manager"),
            "retry_vllm_tokens_prefilled": c["retry_scheduled_tokens"] - decode_steps,
            "retry_num_cached_tokens": c["retry"]["num_cached_tokens"],
            "retry_tokens_equal": c["retry"]["tokens"] == tr["tokens"],
            "records_after_C": {str(p): after_c[p] for p in positions},
        },
        "model": {"layers": args.layers, "hidden": args.hidden, "dtype": "float32", "block_size": BLOCK},
        "hybrid": hybrid_summary,
    }
    print(json.dumps(summary, indent=1))
    if failures:
        for f in failures:
            print(f"VLLM E2E FAILED: {f}")
        return 1
    print("VLLM E2E PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
