"""The reference engine end to end: every workload, the finish walk, a long random run with a
tiny GPU pool, and the ``kvtier sim`` command."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvtier.errors import KVTierError
from kvtier.sim import BlockPool, SimConfig, kv_content, make_workload, run_sim
from kvtier.sim.workloads import Session, Turn
from kvtier.tools.cli import main

CPU = {"tiers": [{"backend": "cpu", "capacity": "16MiB"}]}


@pytest.mark.parametrize("workload", ["chat", "shared", "docqa"])
def test_workloads_run_clean_and_account_for_every_prefill_token(workload: str) -> None:
    report = run_sim(CPU, workload=workload, requests=24, sim=SimConfig(num_gpu_blocks=2048))
    assert report.ok, report.to_dict()
    assert report.preemptions == 0
    assert report.prefill_tokens == report.gpu_hit_tokens + report.loaded_tokens + report.recomputed_tokens
    assert report.hit_tokens > 0


@pytest.mark.parametrize("workload", ["chat", "shared", "docqa"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_with_preemptions_the_prefill_rows_still_add_up(workload: str, async_scheduling: bool) -> None:
    # A GPU pool small enough to preempt: a preempted request's admitted tokens that were not
    # yet computed are prefilled (and counted) again at readmission; that is its own row.
    sim = SimConfig(num_gpu_blocks=160, async_scheduling=async_scheduling)
    r = run_sim(CPU, workload=workload, requests=48, sim=sim)
    assert r.ok, r.to_dict()
    assert r.preemptions > 0
    assert r.preempted_unfinished_tokens > 0 and r.reprefill_tokens > 0
    assert r.prefill_tokens == r.gpu_hit_tokens + r.loaded_tokens + r.recomputed_tokens + r.preempted_unfinished_tokens
    assert r.prefill_tokens == r.prompt_tokens + r.reprefill_tokens


def test_cli_table_names_every_tier_its_path_and_shows_a_tier_that_served_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "store.yaml"
    db = tmp_path / "db"
    cfg.write_text(f"tiers:\n  - {{backend: cpu, capacity: 64MiB}}\n  - {{backend: lmdb, capacity: 64MiB, path: {db}}}\n")
    assert main(["sim", "--config", str(cfg), "--requests", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"cpu 64.0MiB (host memory) -> lmdb 64.0MiB at {db}" in out
    lmdb_row = [line.split() for line in out.splitlines() if line.strip().startswith("from lmdb (tiers[1])")]
    assert lmdb_row == [["from", "lmdb", "(tiers[1])", "0"]]  # the host tier held everything: 0, shown
    assert f"{db}: " in out  # where the records went


def test_cli_config_runs_start_from_an_empty_disk_tier_unless_keep_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "store.yaml"
    cfg.write_text(f"tiers:\n  - {{backend: cpu, capacity: 2MiB}}\n  - {{backend: lmdb, capacity: 256MiB, path: {tmp_path / 'db'}}}\n")
    args = ["sim", "--json", "--no-progress", "--config", str(cfg)]
    runs = []
    for extra in ([], [], ["--keep-disk"]):
        assert main(args + extra) == 0
        runs.append(json.loads(capsys.readouterr().out))
    first, second, kept = runs
    assert first["hit_tokens"] <= first["oracle_hit_tokens"]
    assert second["emptied_records"] > 0 and second["hit_tokens"] == first["hit_tokens"]
    assert second["hit_tokens"] <= second["oracle_hit_tokens"]
    # Kept records are served on top of this run's own: more than the oracle of this run alone.
    assert kept["emptied_records"] == 0 and kept["hit_tokens"] > kept["oracle_hit_tokens"]


def test_emptying_never_touches_a_tier_of_another_namespace(tmp_path: Path) -> None:
    import asyncio

    import kvtier

    db = tmp_path / "db"
    cfg = {"tiers": [{"backend": "lmdb", "capacity": "64MiB", "path": str(db)}], "block_bytes": "64KiB"}

    async def fill() -> None:
        async with kvtier.open(cfg, namespace=kvtier.Namespace(model_id="real-model")) as store:
            plan = await store.prepare_store([bytes([7]) * 32])
            assert plan is not None
            await store.complete_store([bytes([7]) * 32])

    asyncio.run(fill())
    before = sorted(p.stat().st_size for p in db.iterdir())
    with pytest.raises(KVTierError, match=r"tiers\[0\].*namespace"):
        run_sim({"tiers": cfg["tiers"]}, requests=4, empty_persistent=True)
    assert sorted(p.stat().st_size for p in db.iterdir()) == before


def test_small_gpu_pool_serves_from_kvtier_and_verifies_every_loaded_block() -> None:
    report = run_sim(CPU, workload="chat", requests=48, sim=SimConfig(num_gpu_blocks=256))
    assert report.ok, report.to_dict()
    assert report.loaded_tokens > 0 and report.verified_blocks > 0
    assert report.loaded_tokens_by_tier.get("cpu", 0) == report.loaded_tokens
    assert report.hit_tokens >= 0.95 * report.oracle_hit_tokens


def test_finish_walk_adds_hits_under_async_scheduling() -> None:
    # The engine's own prefix cache off and no memory pressure: every hit is a kvtier hit, and
    # the two runs schedule identically until a walked block is served.
    def sim(flag: bool) -> SimConfig:
        return SimConfig(
            async_scheduling=True,
            prefix_caching=False,
            num_gpu_blocks=2048,
            engine_blocks_per_block=1,
            store_last_block_at_finish=flag,
        )

    on = run_sim(CPU, workload="chat", requests=100, sim=sim(True))
    off = run_sim(CPU, workload="chat", requests=100, sim=sim(False))
    assert on.ok and off.ok
    assert on.preemptions == off.preemptions == 0
    assert on.last_block_jobs > 0 and off.last_block_jobs == 0
    assert on.loaded_tokens > off.loaded_tokens


def _random_sessions(rng: random.Random, count: int) -> list[Session]:
    shared = [rng.randrange(3, 500) for _ in range(rng.randint(8, 40))]
    sessions = []
    for i in range(count):
        turns = []
        for t in range(rng.randint(1, 3)):
            head = shared if (t == 0 and rng.random() < 0.6) else []
            turns.append(
                Turn(tuple(head + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]), rng.randint(1, 24))
            )
        # The last session arrives at step 10000, so the run spans at least that many steps.
        start = 10_000 if i == count - 1 else rng.randint(0, 10_000)
        sessions.append(Session(f"s{i}", start_step=start, turns=tuple(turns), think_steps=rng.randint(0, 3)))
    return sessions


def test_tiny_gpu_pool_random_run_never_reuses_a_fenced_block_nor_serves_corrupt_bytes() -> None:
    """A seeded random driver: 10k+ steps with a GPU pool a few requests wide, async
    scheduling, preemption, and a host tier small enough to evict."""
    rng = random.Random(1234)
    sim = SimConfig(
        block_size=4,
        engine_blocks_per_block=2,
        num_gpu_blocks=64,
        num_layers=2,
        head_dim=4,
        max_num_batched_tokens=48,
        max_running=6,
        async_scheduling=True,
        answer_mean=12,
    )
    import asyncio

    import kvtier
    from kvtier.sim.engine import Simulator, make_caches, sim_namespace

    caches = make_caches(sim)
    layout = kvtier.KVLayout(caches, engine_blocks_per_block=2)
    cfg = {"tiers": [{"backend": "cpu", "capacity": 96 * layout.block_bytes}], "engine_blocks_per_block": 2}

    async def _open():
        return await kvtier.open(cfg, kv_caches=caches, namespace=sim_namespace(sim, layout.fingerprint()))

    loop = asyncio.new_event_loop()
    store = loop.run_until_complete(_open())
    try:
        engine = Simulator(store, sim)
        report = engine.run(_random_sessions(rng, 900))
    finally:
        loop.run_until_complete(store.aclose())
        loop.close()
    assert report.steps >= 10_000
    assert report.preemptions > 0 and report.flushed_jobs > 0 and report.verified_blocks > 0
    assert report.fence_violations == 0
    assert report.corrupt_blocks == 0
    assert (report.live_request_states, report.live_jobs, report.fenced_blocks) == (0, 0, 0)


def test_kv_content_is_deterministic_finite_and_prefix_dependent() -> None:
    seeds = torch.tensor([1, 2, 3], dtype=torch.int64)
    a = kv_content(seeds, 0, 16)
    assert torch.equal(a.view(torch.int16), kv_content(seeds, 0, 16).view(torch.int16))
    assert torch.isfinite(a.float()).all()
    assert not torch.equal(a[0].view(torch.int16), a[1].view(torch.int16))
    assert not torch.equal(a.view(torch.int16), kv_content(seeds, 1, 16).view(torch.int16))


def test_block_pool_reuses_most_recently_freed_blocks_last_and_evicts_their_hash() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [0, 1] and b == [2, 3]
    pool.cache(a[0], 111)
    pool.free(a)
    pool.free(b)
    assert pool.allocate(1) == [1]  # a's tail went back first
    assert pool.lookup([111]) == [0]
    assert pool.allocate(1) == [0]
    assert pool.lookup([111]) == []  # reallocation evicted it from the prefix cache


def test_workloads_are_deterministic() -> None:
    assert make_workload("docqa", requests=7, seed=3) == make_workload("docqa", requests=7, seed=3)
    assert make_workload("chat", requests=7, seed=3) != make_workload("chat", requests=7, seed=4)


def test_cli_sim_json_with_config_file(tmp_path, capsys) -> None:
    cfg = tmp_path / "store.yaml"
    cfg.write_text("tiers:\n  - backend: cpu\n    capacity: 8MiB\npolicy: lru\n")
    rc = main(["sim", "--json", "--config", str(cfg), "--requests", "8", "--workload", "shared", "--seed", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    assert data["ok"] is True and data["requests"] == 8 and data["corrupt_blocks"] == 0
    assert [t["backend"] for t in data["tiers"]] == ["cpu"] and data["tiers"][0]["capacity_bytes"] == 8 * 2**20


def test_cli_sim_default_tiers_live_under_the_user_cache_dir(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from kvtier.sim.cli import default_sim_config

    tiers = default_sim_config()["tiers"]
    assert tiers[0]["backend"] == "cpu"
    assert [t["backend"] for t in tiers] == ["cpu", "lmdb"]
    assert tiers[1]["path"].startswith(str(tmp_path))
    rc = main(["sim", "--requests", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "corrupt blocks" in out and "hit tokens / unbounded oracle" in out


def test_cli_sim_rejects_a_bad_config(tmp_path, capsys) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tiers: []\n")
    assert main(["sim", "--config", str(cfg), "--requests", "2"]) == 1
    assert "kvtier sim" in capsys.readouterr().err


def test_cli_default_run_uses_both_tiers_and_keep_disk_reuses_an_earlier_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["sim", "--json", "--no-progress"]) == 0
    first = json.loads(capsys.readouterr().out)
    # The default host tier is small: blocks are demoted and some hits come from disk.
    assert first["loaded_tokens_by_tier"].get("lmdb", 0) > 0
    assert first["corrupt_blocks"] == 0 and first["live_jobs"] == 0
    assert main(["sim", "--json", "--no-progress"]) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert fresh["recomputed_tokens"] == first["recomputed_tokens"]  # a fresh tier each run
    assert main(["sim", "--json", "--no-progress", "--keep-disk"]) == 0
    kept = json.loads(capsys.readouterr().out)
    # What the earlier process stored on disk is served: fewer tokens recomputed.
    assert kept["recomputed_tokens"] < first["recomputed_tokens"]
    assert kept["corrupt_blocks"] == 0
    # ... and the report says how much of it came from there (never anything on an emptied tier).
    assert first["earlier_process_tokens"] == fresh["earlier_process_tokens"] == 0
    assert 0 < kept["earlier_process_tokens"] <= kept["loaded_tokens"]
    assert main(["sim", "--no-progress", "--keep-disk"]) == 0
    table = capsys.readouterr().out
    assert "    stored by an earlier process" in table and "(blocks this run never computed)" in table


def _labels(table: str) -> list[str]:
    return [line.strip().split("  ")[0] for line in table.splitlines() if line.strip()]


def test_every_line_of_the_sim_table_is_explained_in_the_docs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import re

    from kvtier.sim.cli import _table

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["sim", "--no-progress", "--requests", "6", "--keep-disk"]) == 0
    labels = _labels(capsys.readouterr().out)
    report = run_sim(CPU, requests=2).to_dict()
    report.update(emptied=True, tiers=[{**report["tiers"][0], "outages": 2, "up_at_end": False}])
    down = [label for label in _labels(_table(report)) if label.endswith("DOWN")]
    assert down == ["cpu (tiers[0]) DOWN"]
    doc = (Path(__file__).resolve().parent.parent / "docs" / "quickstart.md").read_text()
    documented = set(re.findall(r"`([^`]+)`", doc.split("## Reading the `kvtier sim` table")[1].split("\n## ")[0]))
    generic = {r"from \w+ \(tiers\[\d+\]\)": "loaded from kvtier", r"\w+ \(tiers\[\d+\]\) DOWN": "<tier> (tiers[i]) DOWN"}
    missing = []
    for label in [*labels, *down]:
        shown = next((doc_name for pattern, doc_name in generic.items() if re.fullmatch(pattern, label)), label)
        if shown not in documented:
            missing.append(label)
    assert not missing, f"lines of the kvtier sim table that docs/quickstart.md does not explain: {missing}"
    for jargon in ("hit tokens / unbounded oracle", "last-block stores at finish", "flushed store jobs",
                   "fence violations", "live request states", "live jobs", "stored by an earlier process"):
        assert jargon in labels and jargon in documented


def test_promotion_brings_disk_hits_back_to_host_memory(tmp_path: Path) -> None:
    """Host memory (1 MiB) over LMDB, the engine's own prefix cache off so every reuse is served
    by kvtier: promoting lower-tier hits serves more from host memory and less from disk, with
    every loaded block verified and the fence intact."""
    reports = {}
    for promote in (True, False):
        cfg = {
            "tiers": [
                {"backend": "cpu", "capacity": "1MiB"},
                {"backend": "lmdb", "capacity": "64MiB", "path": str(tmp_path / f"db-{promote}")},
            ],
            "policy": "lru",
            "write": "back",
        }
        sim = SimConfig(prefix_caching=False, promote=promote)
        reports[promote] = run_sim(cfg, workload="chat", requests=48, sim=sim)
    on, off = reports[True], reports[False]
    for r in (on, off):
        assert r.ok, r.to_dict()
        assert r.corrupt_blocks == 0 and r.fence_violations == 0 and r.verified_blocks > 0
    assert on.loaded_tokens_by_tier["cpu"] > off.loaded_tokens_by_tier["cpu"]
    assert on.loaded_tokens_by_tier["lmdb"] < off.loaded_tokens_by_tier["lmdb"]


def test_cli_default_run_starts_over_when_its_own_directory_holds_another_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import kvtier
    from kvtier.sim.cli import sim_disk_path

    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    stale = {"tiers": [{"backend": "lmdb", "capacity": "64MiB", "path": sim_disk_path()}], "block_bytes": "64KiB"}

    async def write_stale() -> None:  # e.g. left by an older kvtier's simulator
        async with kvtier.open(stale, namespace=kvtier.Namespace(model_id="kvtier-sim", revision="older")):
            pass

    asyncio.run(write_stale())
    assert main(["sim", "--requests", "4", "--no-progress"]) == 0
    assert "emptied before the run" in capsys.readouterr().out
