"""Random tier stacks on the CUDA stand-in, with exceptions injected at every copy and chunk.

Each example builds a stack of up to three tiers (a gpu pool on the engine's device, one on a
second device, a pinned cpu pool, a byte tier), in write-back or write-through mode, arms a few
faults (a whole gather or scatter, one chunk of a staged copy, one tier call), and runs a short
random schedule of stores and loads through :class:`device_world.DeviceWorld`. It asserts:

* no job stays unfinished (no deadline is set: only the job itself can report it);
* nothing a kvtier thread queued on a device is unordered with the host once its job is
  reported, and nothing a tier call queued touches its rows once the call returned;
* every load fills its leading run with exactly the bytes stored under those keys, or misses.

The examples are bounded (a hundred, a handful of jobs each: about 15 s here) for CI.
"""

from __future__ import annotations

import pytest
from cuda_standin import CudaStandIn
from device_world import DeviceWorld, Faults
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.testing import make_key

K = [make_key(4000 + i) for i in range(8)]
COPY_SITES = ["gather", "scatter", "gather_chunk", "scatter_chunk"]
TIER_SITES = [f"{call}:{t}" for call in ("write", "read") for t in range(3)]

stacks = st.lists(st.sampled_from(["gpu", "gpu1", "cpu", "bytes"]), min_size=1, max_size=3)
#: steps of (store K[a : a + n], then load K[b : b + m]); loads mostly hit what was stored
schedules = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(0, 6), st.integers(1, 4)), min_size=1, max_size=6
)
fault_plans = st.lists(st.tuples(st.sampled_from(COPY_SITES + TIER_SITES), st.integers(0, 3)), min_size=1, max_size=3)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tiers=stacks,
    caps=st.lists(st.integers(2, 6), min_size=3, max_size=3),
    write=st.sampled_from(["back", "through"]),
    chunk_blocks=st.sampled_from([1, 2, 8]),
    schedule=schedules,
    plan=fault_plans,
)
def test_random_stacks_with_injected_faults_finish_every_job_in_order_and_never_serve_wrong_bytes(
    tiers: list[str],
    caps: list[int],
    write: str,
    chunk_blocks: int,
    schedule: list[tuple[int, int, int, int]],
    plan: list[tuple[str, int]],
) -> None:
    faults = Faults()
    for site, n in plan:
        call, _, tier = site.partition(":")
        faults.arm(f"{call}:{int(tier) % len(tiers)}" if tier else site, n)
    with pytest.MonkeyPatch.context() as mp:
        standin = CudaStandIn(devices=2)
        standin.install(mp)
        world = DeviceWorld(standin, tiers, blocks=caps[: len(tiers)], write=write, chunk_blocks=chunk_blocks, faults=faults)
        try:
            for a, n, b, m in schedule:
                stored = K[a : a + n]
                world.store(stored, list(range(a, a + len(stored))))  # key K[i] is engine block i
                loaded = K[b : b + m]
                world.load(loaded, list(range(8, 8 + len(loaded))))  # into blocks 8.., never stored
                assert world.engine.pending_jobs() == 0
            assert world.violations == []
        finally:
            world.close()
            standin.uninstall()
