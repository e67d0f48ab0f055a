"""A short form of ``scripts/soak_vllm_sides.py``: the vLLM sides below vLLM (two ranks,
``[cpu, lmdb]``) under a random schedule of stores, loads, aborts mid-load, deadline expiries,
lost results and deletes end with every table empty, no pin, no orphan record and no thread
left. (The script's full 10-minute run also bounds RSS growth; this test measures neither time
nor RSS: it runs a fixed number of steps.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak_vllm_sides.py"


def _soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak_vllm_sides", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
async def test_a_short_soak_of_the_vllm_sides_leaves_nothing_behind(tmp_path: Path, seed: int) -> None:
    soak = _soak_module()
    report = await soak.soak(float("inf"), seed=seed, root=str(tmp_path), rounds=800)
    counts = report["counts"]
    # the schedule did what it is for
    for what in ("stores", "loads", "loads_aborted", "notices", "keys_deleted", "stores_failing_on_a_rank"):
        assert counts.get(what, 0) > 0, (what, counts)
    assert set(report["idle"].values()) == {0}, report["idle"]
    assert report["threads_leaked"] == [], report["threads_leaked"]
    assert soak.failures(report, max_rss_growth=float("inf")) == []  # no orphan record either
