"""kvtier inside the continuous-batching engine of ``transformers``, on CPU.

A tiny random ``LlamaForCausalLM`` (2 layers, hidden 256, 4 heads, 2 KV heads, vocab 1000,
``initializer_range=0.2`` so that its output depends on its context) is served by
``ContinuousBatchingManager`` with a paged cache of 16-token pages, float32, sdpa, greedy.

What is compared:

* **bit-identical**: a 3-turn chat over 3 conversations at once. The reference run reuses each
  turn's prefix from the engine's own in-memory prefix cache; the kvtier runs switch the
  engine's cache off (``engine_prefix_cache=False``), so every reused prefix block comes from
  kvtier: the cpu tier, an lmdb-only tier, and a fresh process that reads that lmdb tier for the
  last turn. Turn lengths are chosen so that no block completes in a finishing step, so both
  sides reuse exactly the same number of tokens and run exactly the same batches; token ids and
  logprobs must then be equal bit for bit.
* **within tolerance**: the last turn recomputed from scratch (no reuse at all) gives the same
  greedy tokens and logprobs within 1e-4 (a prefill of a different length is not bit-identical).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch_numerics import default_numerics, numerics

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "kvtier[hf]" to run these tests)'
)

from kvtier.integrations.transformers import TransformersKVTier, attach  # noqa: E402

PAGE = 16
MODEL_ID = "tiny-llama-seed0"
LMDB_CAPACITY = "64MiB"
TOL = 1e-4

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


# -- engine helpers ------------------------------------------------------------------------------
def build_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def start_manager(num_blocks: int = 64) -> Any:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = build_model()
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=256, return_logprobs=True, use_async_batching=False
    )
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    # The batch processor (the paged cache and the engine's input tensors) is built here, on the
    # calling thread, for every run: attach() builds it so, and a manager without kvtier would
    # otherwise build it in its loop thread, so the compared runs would not be set up alike.
    manager.warmup()
    return manager


def run_turn(manager: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Any]:
    # All of a turn's requests enter the engine together: added one by one to a running loop, a
    # client thread preempted between two adds lets the loop start the first alone, the batches
    # differ, and so do the last bits of the logprobs (the batch shape changes the float math).
    with manager.pause():
        ids = manager.add_requests(prompts, max_new_tokens=max_new_tokens)
    done: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            assert result.error is None, result.error
            done[result.request_id] = result
        assert time.monotonic() < deadline, "the engine did not finish in time"
    return [done[i] for i in ids]


def conversations() -> tuple[list[list[int]], list[list[list[int]]]]:
    """Three opening prompts of 40 tokens and, per turn, three user messages of 11 tokens."""
    g = torch.Generator().manual_seed(1)
    openings = [torch.randint(1, 1000, (40,), generator=g).tolist() for _ in range(3)]
    users = [[torch.randint(1, 1000, (11,), generator=g).tolist() for _ in range(3)] for _ in range(3)]
    return openings, users


NEW_TOKENS = 8  # 40 + 8 - 1 = 47, 59 + 7 = 66, 78 + 7 = 85 computed at finish: never a full page


def record_steps(manager: Any, steps: list[tuple[Any, ...]]) -> Any:
    """Append to ``steps``, for every forward pass of the engine's model, what could change the
    last bits of its output: the batch's token ids and positions, and the intra-op thread count
    of the thread that runs it. Returns the hook's handle."""

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        steps.append((
            None if ids is None else ids.flatten().tolist(),
            None if pos is None else pos.flatten().tolist(),
            torch.get_num_threads(),
        ))

    return manager.model.register_forward_pre_hook(hook, with_kwargs=True)


def assert_same_turns(name: str, got: dict[str, Any], reference: dict[str, Any]) -> None:
    """``got``'s turns equal the reference's first turns bit for bit; a difference names its turn,
    the largest logprob change, and whether the two runs' forward passes differed (see
    ``record_steps``)."""
    assert len(got["turns"]) <= len(reference["turns"]), (len(got["turns"]), len(reference["turns"]))
    for t, (mine, theirs) in enumerate(zip(got["turns"], reference["turns"])):
        if mine == theirs:
            continue
        diffs = [max((abs(x - y) for x, y in zip(a[1], b[1], strict=True)), default=0.0) for a, b in zip(mine, theirs, strict=True)]
        steps, ref_steps = got["steps"][t], reference["steps"][t]
        first = next((i for i, (a, b) in enumerate(zip(steps, ref_steps)) if a != b), None)
        raise AssertionError(
            f"{name} turn {t} differs from the reference: tokens equal "
            f"{[a[0] == b[0] for a, b in zip(mine, theirs)]}, largest logprob change per conversation {diffs}; "
            f"forward passes {len(steps)} against {len(ref_steps)}, first differing pass {first} "
            f"(token ids, positions, threads): {steps[first] if first is not None else None} "
            f"against {ref_steps[first] if first is not None else None}; torch settings at the start "
            f"{got.get('numerics')} against {reference.get('numerics')}; found at the module's start "
            f"(before torch_defaults): {reference.get('found')}"
        )


def chat(config: dict[str, Any] | None, *, turns: int = 3, engine_prefix_cache: bool = False) -> dict[str, Any]:
    """Run the chat; return per turn the (tokens, logprobs) of each conversation and the engine's
    forward passes (``record_steps``), the adapter's prefix matches, and the prompts of every turn."""
    manager = start_manager()
    kv = attach(manager, config, model_id=MODEL_ID, engine_prefix_cache=engine_prefix_cache) if config else None
    openings, users = conversations()
    history = [o[:] for o in openings]
    out: dict[str, Any] = {"turns": [], "matches": [], "prompts": [], "steps": [], "numerics": numerics()}
    steps: list[tuple[Any, ...]] = []
    hook = record_steps(manager, steps)
    manager.start()
    try:
        for t in range(turns):
            out["prompts"].append([h[:] for h in history])
            steps.clear()
            results = run_turn(manager, history, NEW_TOKENS)
            out["steps"].append(list(steps))
            out["turns"].append([(r.generated_tokens, r.logprobs) for r in results])
            for i, r in enumerate(results):
                history[i] = history[i] + r.generated_tokens + users[t][i]
    finally:
        manager.stop(block=True)
        hook.remove()
        if kv is not None:
            out["matches"] = list(kv.matches.values())
            out["stats"] = kv.stats()
            kv.close()
            c = kv.connector
            out["leftover"] = (c.num_request_states, c.num_jobs, c.num_fenced_blocks, len(kv._pinned))
    return out


def fresh_process_turn(lmdb_path: str, prompts: list[list[int]]) -> dict[str, Any]:
    """The last turn in a new process whose only prefix source is the lmdb tier."""
    manager = start_manager()
    kv = attach(manager, lmdb_config(lmdb_path), model_id=MODEL_ID, engine_prefix_cache=False)
    manager.start()
    try:
        results = run_turn(manager, prompts, NEW_TOKENS)
    finally:
        manager.stop(block=True)
        matches = [m.kvtier_tokens for m in kv.matches.values()]
        kv.close()
    return {"turn": [(r.generated_tokens, r.logprobs) for r in results], "kvtier_tokens": matches}


def cpu_config() -> dict[str, Any]:
    return {"tiers": [{"backend": "cpu", "capacity": "32MiB"}]}


def lmdb_config(path: str) -> dict[str, Any]:
    return {"tiers": [{"backend": "lmdb", "path": path, "capacity": LMDB_CAPACITY}]}


def assert_close(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> None:
    for (tok_a, lp_a), (tok_b, lp_b) in zip(a, b, strict=True):
        assert tok_a == tok_b
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b, strict=True)) <= TOL


# -- the chat runs, shared by the comparisons ----------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def torch_defaults() -> Iterator[dict[str, Any]]:
    """Every test of this module runs with torch's numeric settings at their defaults, whatever an
    earlier test in the same process left behind (:mod:`torch_numerics`); set back after."""
    with default_numerics() as found:
        yield found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, torch_defaults: dict[str, Any]) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    lmdb_path = str(root / "lmdb")
    # No compared run is the process's first: the first forward passes of a process also start
    # torch's thread pools and pick its kernels, and in long pytest processes the first run (the
    # reference, then) was the one whose bits differed. One turn, not compared.
    chat(None, turns=1, engine_prefix_cache=True)
    data: dict[str, Any] = {"engine": {**chat(None, engine_prefix_cache=True), "found": torch_defaults}}
    data["cpu"] = chat(cpu_config())
    data["lmdb"] = chat(lmdb_config(lmdb_path))
    last = data["lmdb"]["prompts"][-1]
    prompts_file = root / "prompts.json"
    prompts_file.write_text(json.dumps(last))
    proc = subprocess.run(
        [sys.executable, __file__, "fresh", lmdb_path, str(prompts_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data["fresh"] = json.loads(proc.stdout.strip().splitlines()[-1])
    # The last turn with nothing reused: a brand-new engine and no kvtier.
    manager = start_manager()
    manager.start()
    try:
        data["recompute"] = [(r.generated_tokens, r.logprobs) for r in run_turn(manager, last, NEW_TOKENS)]
    finally:
        manager.stop(block=True)
    return data


def test_prefixes_come_from_kvtier(runs: dict[str, Any]) -> None:
    for name in ("cpu", "lmdb"):
        matches = runs[name]["matches"]
        assert [m.engine_tokens for m in matches] == [0] * 9
        # turn 1: nothing; turn 2: 47 computed tokens -> 2 pages; turn 3: 66 -> 4 pages
        assert [m.kvtier_tokens for m in matches] == [0] * 3 + [2 * PAGE] * 3 + [4 * PAGE] * 3
        assert runs[name]["stats"]["errors"] == 0
        # Every lookup, load and store went through the connector, and nothing is left behind.
        connector = runs[name]["stats"]["connector"]
        assert connector["load_jobs"] == 6 and connector["load_blocks"] == 6 * 3
        assert connector["last_block_jobs"] == 9
        assert runs[name]["leftover"] == (0, 0, 0, 0)
    assert runs["fresh"]["kvtier_tokens"] == [4 * PAGE] * 3


def test_chat_bit_identical_to_engine_prefix_cache(runs: dict[str, Any]) -> None:
    reference = runs["engine"]["turns"]
    assert_same_turns("cpu", runs["cpu"], runs["engine"])
    assert_same_turns("lmdb", runs["lmdb"], runs["engine"])
    fresh = [(list(t), list(lp)) for t, lp in runs["fresh"]["turn"]]
    assert fresh == [(list(t), list(lp)) for t, lp in reference[-1]]


def test_turn_batches_do_not_depend_on_client_timing(runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A client thread preempted between the adds of one turn (here: a pause after each) must not
    change the engine's batches: the first turn must still be bit-identical to the reference.
    Before ``run_turn`` paused the loop while adding, the engine started the first request alone
    and the bit-identical comparison failed under CPU load."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    add = ContinuousBatchingManager.add_request

    def slow_add(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = add(self, *args, **kwargs)
        time.sleep(0.05)
        return out

    monkeypatch.setattr(ContinuousBatchingManager, "add_request", slow_add)
    slow = chat(None, turns=1, engine_prefix_cache=True)
    assert_same_turns("slow adds", slow, runs["engine"])


def test_turn_batches_do_not_depend_on_store_timing(runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores that read the engine's blocks late (their thread starved on a loaded host) keep
    those blocks fenced while the engine schedules its next steps. Fenced blocks count as used,
    so they could shrink a batch (the engine's safety margin, or a request that no longer fits)
    and change the last bits of the logprobs. This chat never comes near the margin: with every
    store late, the batches and so the bits must be those of the reference."""
    from kvtier.transfer.movers import StoreMover

    read = StoreMover._read_engine_blocks
    steps = threading.Condition()
    scheduled = [0]  # steps scheduled so far
    fenced: list[int] = []  # blocks held for stores at the start of each step

    def late(self: Any, rec: Any, copy: Any) -> None:
        # Read only once the engine has begun another step (or after 1 s: the chat's last stores).
        with steps:
            seen = scheduled[0]
            steps.wait_for(lambda: scheduled[0] > seen, timeout=1.0)
        read(self, rec, copy)

    schedule = TransformersKVTier._schedule_batch

    def watched(self: TransformersKVTier, token_budget: int, cache_budget: int) -> Any:
        fenced.append(len(self._pinned))
        with steps:
            scheduled[0] += 1
            steps.notify_all()
        return schedule(self, token_budget, cache_budget)

    monkeypatch.setattr(StoreMover, "_read_engine_blocks", late)
    monkeypatch.setattr(TransformersKVTier, "_schedule_batch", watched)
    slow = chat(cpu_config())
    assert max(fenced) > 0, "no step was scheduled while a store held engine blocks"
    assert slow["stats"]["fence_waits"] == 0
    assert_same_turns("late stores", slow, runs["engine"])


def test_a_turn_that_differs_is_named_with_its_forward_passes() -> None:
    steps = [[([1, 2], [0, 1], 2), ([3], [2], 2)]]
    reference = {"turns": [[([5], [-0.5])]], "steps": steps}
    assert_same_turns("same", {"turns": [[([5], [-0.5])]], "steps": steps}, reference)
    other = {"turns": [[([5], [-0.5000001])]], "steps": [[([1, 2], [0, 1], 2), ([3], [2], 1)]]}
    with pytest.raises(AssertionError, match=r"other turn 0 differs .*first differing pass 1 .*\(\[3\], \[2\], 1\)"):
        assert_same_turns("other", other, reference)


#: Settings an earlier test could leave behind, each with its undo.
LEAKS: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
    "default dtype float64": (
        lambda: torch.set_default_dtype(torch.float64),
        lambda: torch.set_default_dtype(torch.float32),
    ),
    "fused attention off": (
        lambda: torch.backends.cuda.enable_flash_sdp(False),
        lambda: torch.backends.cuda.enable_flash_sdp(True),
    ),
}


@pytest.mark.parametrize("leak", list(LEAKS))
def test_chat_bits_do_not_depend_on_torch_settings_left_behind(runs: dict[str, Any], leak: str) -> None:
    """A setting left changed by an earlier test in the same process changes the chat's bits (the
    control), and this module's runs take torch's defaults whatever was left: the first turn
    under ``default_numerics`` is the reference's bit for bit, and the leak is set back after."""
    leave, undo = LEAKS[leak]
    leave()
    try:
        left = chat(None, turns=1, engine_prefix_cache=True)
        with default_numerics() as found:
            pinned = chat(None, turns=1, engine_prefix_cache=True)
        after = numerics()
    finally:
        undo()
    assert left["turns"][0] != runs["engine"]["turns"][0], f"{leak} did not change the bits: the test sees nothing"
    assert_same_turns(leak, pinned, runs["engine"])
    assert found != numerics() and after == found  # it was on inside, and set back as found


def test_a_mode_left_on_fails_with_its_name() -> None:
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    with Passing(), pytest.raises(AssertionError, match="function_modes"), default_numerics():
        pass


def test_greedy_tokens_match_full_recompute(runs: dict[str, Any]) -> None:
    assert_close(runs["cpu"]["turns"][-1], runs["recompute"])
    assert_close(runs["engine"]["turns"][-1], runs["recompute"])


# -- byte-level checks ---------------------------------------------------------------------------
def spy_stores(kv: TransformersKVTier) -> dict[bytes, torch.Tensor]:
    """Record, at the moment each store job is submitted, the bytes of the blocks it will read."""
    snapshots: dict[bytes, torch.Tensor] = {}
    transfers = kv.store.transfers
    assert transfers is not None
    submit = transfers.submit_store

    def spy(plan: Any, block_ids: Any) -> int:
        for key, block in zip(plan.keys, block_ids, strict=True):
            snapshots[key] = kv.kv_cache[block].clone()
        return submit(plan, block_ids)

    transfers.submit_store = spy  # type: ignore[method-assign]
    return snapshots


def load_back(kv: TransformersKVTier, keys: list[bytes]) -> list[torch.Tensor]:
    """Load ``keys`` into spare engine blocks (the engine is stopped) and return their contents."""
    pool, idx = kv.cache.pool, kv.allocator.index
    while pool.count_free_blocks(idx) < len(keys):
        pool.allocate_sector(idx)
    blocks = pool.get_free_blocks(idx, len(keys))
    for b in blocks:
        kv.kv_cache[b].fill_(float("nan"))
    loaded = asyncio.run(kv.store.load(keys, blocks))
    assert loaded == len(keys)
    out = [kv.kv_cache[b].clone() for b in blocks]
    pool.free_blocks(idx, blocks)
    return out


@pytest.mark.parametrize("tier", ["cpu", "lmdb"])
def test_stored_bytes_equal_loaded_bytes(tier: str, tmp_path: Path) -> None:
    manager = start_manager()
    config = cpu_config() if tier == "cpu" else lmdb_config(str(tmp_path / "db"))
    kv = attach(manager, config, model_id=MODEL_ID)
    snapshots = spy_stores(kv)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (37, 70)]
    manager.start()
    try:
        run_turn(manager, prompts, 12)
    finally:
        manager.stop(block=True)
    try:
        kv.flush()
        # 37 + 11 = 48 and 70 + 11 = 81 computed tokens: 3 + 5 full pages
        assert len(snapshots) == 8
        assert kv.stats()["blocks_stored"] == 8
        keys = list(snapshots)
        for key, got in zip(keys, load_back(kv, keys), strict=True):
            want = snapshots[key]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                "a loaded block differs from the stored one"
            )
    finally:
        kv.close()


def test_last_block_completed_at_finish_is_served(tmp_path: Path) -> None:
    # 40 prompt + 9 new: the finishing step computes token 47 and so completes page 2, which the
    # engine never hashes; kvtier stores it and serves it to the next turn on top of the engine's 2.
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 1000, (40,), generator=g).tolist()
    user = torch.randint(1, 1000, (10,), generator=g).tolist()
    manager = start_manager()
    kv = attach(manager, cpu_config(), model_id=MODEL_ID, engine_prefix_cache=True)
    manager.start()
    try:
        first = run_turn(manager, [prompt], 9)[0]
        second_prompt = prompt + first.generated_tokens + user  # 59 tokens: 3 pages may be reused
        second = run_turn(manager, [second_prompt], 6)[0]
    finally:
        manager.stop(block=True)
    matches = list(kv.matches.values())
    kv.close()
    assert (matches[1].engine_tokens, matches[1].kvtier_tokens) == (2 * PAGE, PAGE)
    fresh = start_manager()
    fresh.start()
    try:
        recomputed = run_turn(fresh, [second_prompt], 6)[0]
    finally:
        fresh.stop(block=True)
    assert_close([(second.generated_tokens, second.logprobs)], [(recomputed.generated_tokens, recomputed.logprobs)])


@pytest.mark.parametrize("fence", [True, False], ids=["fenced", "unfenced"])
def test_freed_block_reused_at_once_is_not_overwritten_before_stored(fence: bool) -> None:
    """Request A finishes and its blocks go back to the engine's pool; B is admitted at once and
    its prefill takes them (the pool hands out the most recently freed first) while A's store is
    still in flight (its gather is held back: until B's turn has ended in the control, else for
    half a second). With the fence the stored bytes are A's; without it (the control) they are
    B's, which shows the test sees the race."""
    manager = start_manager(num_blocks=16)
    kv = attach(manager, cpu_config(), model_id=MODEL_ID, engine_prefix_cache=False)
    kv._fence = fence
    snapshots = spy_stores(kv)
    transfers = kv.store.transfers
    assert transfers is not None
    gather = transfers.layout.gather
    release = threading.Event()

    def held_gather(*args: Any, **kwargs: Any) -> None:
        assert release.wait(120), "the test never let the gather go"
        gather(*args, **kwargs)

    transfers.layout.gather = held_gather  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(5)
    a = torch.randint(1, 1000, (40,), generator=g).tolist()
    b = torch.randint(1, 1000, (100,), generator=g).tolist()
    manager.start()
    try:
        run_turn(manager, [a], 9)  # 48 computed tokens: 3 full pages stored at finish
        a_keys = list(snapshots)
        assert len(a_keys) == 3
        if fence:  # B's prefill waits for the fence, which waits for the gather: let it go soon
            threading.Timer(0.5, release.set).start()
        run_turn(manager, [b], 2)
        release.set()  # the control: A's gather reads the pages only after B's prefill wrote them
    finally:
        release.set()
        manager.stop(block=True)
    try:
        kv.flush()
        same = [
            torch.equal(got.view(torch.uint8), snapshots[k].view(torch.uint8))
            for k, got in zip(a_keys, load_back(kv, a_keys))
        ]
    finally:
        kv.close()
    if fence:
        assert all(same)
    else:
        assert not all(same)


def test_cancelled_requests_leave_no_connector_state() -> None:
    """The engine removes cancelled requests without ``finish_request``; the connector must
    still forget them (before the fix, 4 of 4 left their state behind after ``close()``)."""
    manager = start_manager()
    kv = attach(manager, cpu_config(), model_id=MODEL_ID)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 1000, (40,), generator=g).tolist() for _ in range(4)]
    sched = kv.scheduler
    manager.start()
    try:
        ids = manager.add_requests(prompts, max_new_tokens=200)
        deadline = time.monotonic() + 60
        while not all(i in kv.matches for i in ids):  # each went through the connector
            assert time.monotonic() < deadline, "the engine did not admit the requests in time"
            time.sleep(0.005)
        for i in ids:
            manager.cancel_request(i)
        while any(i in sched.active_requests or i in sched.waiting_requests for i in ids):
            assert time.monotonic() < deadline, "the engine did not drop the cancelled requests in time"
            time.sleep(0.005)
    finally:
        manager.stop(block=True)
    kv.close()
    c = kv.connector
    assert c.counters["last_block_jobs"] == 0  # none of them finished normally: all were cancelled
    assert (c.num_request_states, c.num_jobs, c.num_fenced_blocks, len(kv._pinned)) == (0, 0, 0, 0)
    assert kv.stats()["errors"] == 0


def test_stalled_tier_write_does_not_hold_engine_blocks(tmp_path: Path) -> None:
    """A finish store to lmdb whose disk write hangs: once the store has read the engine's
    blocks, the adapter gives them back (unpins them), while the write is still under way."""
    import threading

    manager = start_manager()
    kv = attach(manager, lmdb_config(str(tmp_path / "db")), model_id=MODEL_ID)
    release = threading.Event()
    disk = kv.store.backends[0]
    write = disk.write_blocks

    def stalled_write(keys: Any, blocks: Any) -> Any:
        release.wait()
        return write(keys, blocks)

    disk.write_blocks = stalled_write  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(13)
    prompt = torch.randint(1, 1000, (40,), generator=g).tolist()
    manager.start()
    try:
        run_turn(manager, [prompt], 9)  # 48 computed tokens: 3 pages stored at finish
    finally:
        manager.stop(block=True)
    try:
        kv._apply(kv.worker.get_finished(block=True, device_only=True))  # the reads, not the disk
        assert kv._pinned == set() and kv.connector.num_fenced_blocks == 0
        assert kv.connector.num_jobs == 1  # the store itself is still writing
    finally:
        release.set()
    kv.flush()
    assert kv.stats()["blocks_stored"] == 3
    kv.close()
    assert (kv.connector.num_request_states, kv.connector.num_jobs) == (0, 0)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "fresh":
    result = fresh_process_turn(sys.argv[2], json.loads(Path(sys.argv[3]).read_text()))
    print(json.dumps(result))
