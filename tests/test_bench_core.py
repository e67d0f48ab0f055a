"""``benchmarks/bench_core.py``'s bandwidth pairs: every arm copies in the same state (the raw
pool touched before the first round, the CPU caches evicted before each timed copy, warm-up
rounds left out) and the rounds are an odd count."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import sys

import pytest
import torch
from kvtier.tools.bench.scripts import bench_core


def resident_share(t: torch.Tensor) -> float:
    """The share of the whole pages inside ``t`` that are in memory now (``mincore``)."""
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    pages = (end - start) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        pytest.skip(f"mincore failed here (errno {ctypes.get_errno()})")
    return sum(v & 1 for v in vec) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore on anonymous memory is Linux's")
def test_raw_pool_is_in_memory_before_the_first_round() -> None:
    """An untouched raw pool put its page faults into the first raw copy of each region's first
    counted round; the tier's pool is filled at open. The pool is over 32 MiB so that it is a
    fresh mapping of its own, never memory an earlier allocation of the process left resident."""
    caches = [torch.zeros((9, 2, 1 << 18), dtype=torch.uint8) for _ in range(2)]  # 1 MiB a block
    raw = bench_core.RawCopies(caches, 4, 1, regions=10)  # a 40 MiB pool
    assert raw.pool.numel() == 40 << 20
    assert resident_share(raw.pool) == 1.0


class Recorder:
    """Stands in for the cache eviction and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.nbytes = 1
        self.on = True

    def __call__(self) -> None:
        self.calls += 1


def test_each_timed_copy_starts_after_a_cache_eviction_and_warm_ups_are_not_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every arm, the tier's save and load as much as each raw copy, is timed right after the
    CPU caches were evicted, so that no arm starts with what the copy before it left in them."""
    cold = Recorder()
    monkeypatch.setattr(bench_core, "COLD", cold)
    timed: list[float] = []
    real = bench_core.Timed.__init__

    def record(self: bench_core.Timed, seconds: float, wait: float, gc: float) -> None:
        timed.append(seconds)
        real(self, seconds, wait, gc)

    monkeypatch.setattr(bench_core.Timed, "__init__", record)
    caches = [torch.randn((9, *bench_core.LAYER_SHAPE)).to(torch.bfloat16) for _ in range(2)]
    reps = 3
    bw = asyncio.run(bench_core.bandwidth(caches, 4, reps, 1))
    arms = len(bw["times"])  # tier and engine save and load, and the raw copies
    assert arms >= 7
    assert all(len(ts) == reps for ts in bw["times"].values())  # warm-up rounds left out
    assert len(timed) == arms * (reps + bench_core.WARMUP_ROUNDS)
    assert cold.calls == len(timed)


@pytest.mark.parametrize("rounds", ["4", "0"])
def test_an_even_or_no_count_of_rounds_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rounds: str) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_core.py", "--quick", "--bandwidth-only", "--rounds", rounds])
    with pytest.raises(SystemExit) as exc:
        bench_core.main()
    assert exc.value.code == 2
    assert "--rounds: expected an odd count of rounds" in capsys.readouterr().err


def test_cold_caches_write_over_twice_the_last_level_cache() -> None:
    cold = bench_core.ColdCaches()
    assert cold.nbytes >= 2 * bench_core.last_level_cache_bytes() >= 2 << 20
    cold()
    assert cold.scratch is not None and int(cold.scratch[0]) == 1 and int(cold.scratch[-1]) == 1
    cold.on = False
    cold()
    assert int(cold.scratch[0]) == 1  # off: no write


def test_the_native_arm_moves_the_jobs_bytes_and_stays_apart_from_the_raw_shapes() -> None:
    """The straight native copy (the floor of the tier's small jobs) saves the job's blocks into
    the round's rows and loads them into the other blocks, as the raw shapes do; its arms are not
    ``save_*`` / ``load_*``, so the headline ratios never take it as the raw baseline."""
    caches = [torch.randn((9, 2, 1 << 16)).to(torch.bfloat16) for _ in range(2)]
    raw = bench_core.RawCopies(caches, 4, 1, regions=2)
    if raw.native is None:
        pytest.skip("kvtier.transfer._blockcopy is not built here")
    raw.next_round()  # region 1: rows 4..7
    saved, loaded = raw.native_copy()
    assert saved.seconds > 0 and loaded.seconds > 0
    for layer, c in enumerate(caches):
        rows = raw.pool[4:8].view(4, 2, -1)[:, layer]
        assert torch.equal(rows, c[raw.src_ids].view(torch.uint8).view(4, -1))
        assert torch.equal(c[raw.dst_ids], c[raw.src_ids])
    assert "native" in raw.variants() and not any(k.startswith(("save_", "load_")) and "native" in k for k in raw.variants())
    raw.close()
