from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat, MemoryBackend
from kvtier.errors import ClosedError, ConfigError, LifecycleError
from kvtier.testing import BackendTests, make_key, mapping_flags


class TestCpuBackend(BackendTests):
    def make_backend(self, path: Path, capacity: int) -> Backend:
        return registry.backends.get("cpu")(capacity=capacity)

    def test_full_pool_stores_what_fits(self, tmp_path: Path) -> None:
        with self.opened(tmp_path, capacity=self.block_bytes * 2) as backend:
            sizes = backend.write_blocks([make_key(i) for i in range(3)], self.blocks(3))
            assert sizes[:2] == [self.block_bytes] * 2 and sizes[2] is None
            assert backend.stats()["write_failures"] == 1
            assert backend.read_blocks([make_key(0)], self.empty(1)) == [True]

    def test_pool_is_allocated_in_open(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes * 4)
        with pytest.raises(LifecycleError):
            _ = backend.pool
        asyncio.run(backend.open(self.block_format()))
        assert backend.pool.shape == (4, self.block_bytes)
        assert backend.pool.dtype == torch.uint8

    def test_capacity_becomes_slot_count_and_slots_are_reused(self, tmp_path: Path) -> None:
        with self.opened(tmp_path, capacity=self.block_bytes * 3 + 17) as backend:
            assert backend.max_blocks == 3
            first = backend.reserve([make_key(1), make_key(2), make_key(3)])
            assert first is not None and sorted(first) == [0, 1, 2]
            assert backend.reserve([make_key(4)]) is None
            backend.delete_blocks([make_key(2)])
            again = backend.reserve([make_key(4)])
            assert again == [first[1]]
            assert backend.slots([make_key(4), make_key(1)]) == [first[1], first[0]]

    @pytest.mark.parametrize("order", ["as_stored", "reversed", "shuffled"])
    def test_the_slots_of_a_deleted_job_come_back_as_one_ascending_run(self, tmp_path: Path, order: str) -> None:
        """The slots one delete frees go to the next reserve of as many keys lowest first,
        whatever order the keys were deleted in: a job that takes an evicted job's room gets
        its rows as one ascending run."""
        with self.opened(tmp_path, capacity=self.block_bytes * 8) as backend:
            old = [make_key(i) for i in range(8)]
            assert backend.reserve(old) == list(range(8))
            victims = old[2:6]
            gone = {"as_stored": victims, "reversed": victims[::-1], "shuffled": [victims[i] for i in (2, 0, 3, 1)]}[order]
            backend.delete_blocks([*gone, gone[0]])  # (a repeat frees its slot once)
            assert backend.stats()["deleted"] == 4
            assert backend.reserve([make_key(100 + i) for i in range(4)]) == [2, 3, 4, 5]

    @pytest.mark.parametrize("case", ["evicts", "no_victims", "victim_not_stored", "full", "a_victim_repeats"])
    def test_evict_and_reserve_is_delete_then_reserve(self, tmp_path: Path, case: str) -> None:
        """The pool's one-call room for a store job against the two calls it replaces (the
        MemoryBackend default): the same slots, free list, stored keys and counters."""
        old = [make_key(i) for i in range(6)]  # 8 slots: 2 free
        victims, fresh = {
            "evicts": (old[1:4], 4),
            "no_victims": ([], 2),
            "victim_not_stored": ([old[2], make_key(999), old[4]], 4),
            "full": (old[:1], 4),  # 3 free slots, 4 new keys
            "a_victim_repeats": ([old[3], old[3], old[0]], 4),
        }[case]
        new = [make_key(100 + i) for i in range(fresh)]
        seen = []
        for fused in (True, False):
            with self.opened(tmp_path / str(fused), capacity=self.block_bytes * 8) as backend:
                assert backend.reserve(old) == list(range(6))
                if fused:
                    got = backend.evict_and_reserve(victims, new)
                else:
                    got = MemoryBackend.evict_and_reserve(backend, victims, new)  # type: ignore[arg-type]
                seen.append((got, backend.stored_keys(), list(backend._free), backend.stats()))  # type: ignore[attr-defined]
        assert seen[0] == seen[1]
        got, stored = seen[0][0], seen[0][1]
        assert (got is None) == (case == "full")
        assert set(stored) == (set(old) - set(victims)) | (set() if got is None else set(new))

    def test_evict_and_reserve_of_a_closed_pool_raises(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes * 2)
        with pytest.raises(LifecycleError):
            backend.evict_and_reserve([make_key(1)], [make_key(2)])  # type: ignore[attr-defined]

    @pytest.mark.parametrize("case", ["none_held", "one_held", "repeats", "held_and_repeated"])
    def test_reserve_gives_new_keys_free_slots_in_order_and_held_keys_their_own(self, tmp_path: Path, case: str) -> None:
        """``reserve`` where no key is held (the usual store: taken in C) and where some are or
        repeat (the general path) against a plain model: each new key, in first-seen order,
        takes the next free slot; a held key keeps its slot; a repeat gets its first's."""
        held = [make_key(i) for i in range(3)]
        ask = {
            "none_held": [make_key(10), make_key(11), make_key(12)],
            "one_held": [make_key(10), held[1], make_key(11)],
            "repeats": [make_key(10), make_key(11), make_key(10)],
            "held_and_repeated": [held[2], make_key(10), held[2], make_key(10), make_key(11)],
        }[case]
        with self.opened(tmp_path, capacity=self.block_bytes * 8) as backend:
            assert backend.reserve(held) == [0, 1, 2]
            free = list(backend._free)  # type: ignore[attr-defined]
            model = dict(zip(held, [0, 1, 2]))
            for key in ask:
                if key not in model:
                    model[key] = free.pop()
            assert backend.reserve(ask) == [model[key] for key in ask]
            assert backend._free == free  # type: ignore[attr-defined]
            assert backend.stored_keys() == list(model)

    def test_the_pool_of_a_closed_tier_raises(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes * 2)
        asyncio.run(backend.open(self.block_format()))
        assert backend.pool.shape[0] == 2  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())
        with pytest.raises(ClosedError):
            _ = backend.pool  # type: ignore[attr-defined]

    def test_reserve_is_atomic_when_full(self, tmp_path: Path) -> None:
        with self.opened(tmp_path, capacity=self.block_bytes * 2) as backend:
            backend.reserve([make_key(1)])
            assert backend.reserve([make_key(2), make_key(3)]) is None
            assert len(backend) == 1
            with pytest.raises(LifecycleError):
                backend.slots([make_key(2)])


def test_gpu_backend_needs_an_accelerator() -> None:
    gpu = registry.backends.get("gpu")
    with pytest.raises(ConfigError, match="device"):
        gpu(capacity="1MiB", device="cpu")
    if not torch.cuda.is_available():
        backend = gpu(capacity="1MiB")
        with pytest.raises(ConfigError, match="CUDA"):
            asyncio.run(backend.open(BlockFormat(block_bytes=4096)))


def test_cpu_backend_rejects_unknown_options() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        registry.backends.get("cpu")(capacity="lots")
    with pytest.raises(TypeError):
        registry.backends.get("cpu")(capacity="1MiB", colour="red")


def test_a_host_pool_is_advised_huge_pages_before_its_first_touch() -> None:
    """The 2 MiB-aligned part of an unpinned host pool is marked for transparent huge pages
    (``hg`` in its mapping's flags) and holds what is written; a pool too small for one huge
    page, or a refused ``madvise``, is advised nothing and works the same."""
    from kvtier.backends import memory

    fmt = BlockFormat(block_bytes=1 << 20)
    backend = registry.backends.get("cpu")(capacity=12 << 20, pin_memory=False)
    asyncio.run(backend.open(fmt))
    pool = backend.pool
    start = -(-pool.data_ptr() // (2 << 20)) * (2 << 20)
    flags = mapping_flags(start)
    if flags is None:
        pytest.skip("no /proc/self/smaps here")
    assert "hg" in flags
    assert memory.advise_huge_pages(pool[:1]) == 0  # less than one aligned huge page
    assert not pool.any()  # the fill still ran
    key = make_key(1)
    assert backend.write_blocks([key], [torch.full((1 << 20,), 7, dtype=torch.uint8)]) == [1 << 20]
    out = torch.zeros(1 << 20, dtype=torch.uint8)
    assert backend.read_blocks([key], [out]) == [True] and bool((out == 7).all())


def test_a_refused_huge_page_advice_is_only_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.backends import memory

    class NoLibc:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise OSError("no libc here")

    monkeypatch.setattr(memory.ctypes, "CDLL", NoLibc)
    assert memory.advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8)) == 0
    backend = registry.backends.get("cpu")(capacity=4 << 20, pin_memory=False)
    asyncio.run(backend.open(BlockFormat(block_bytes=1 << 20)))
    assert backend.pool.shape == (4, 1 << 20)
