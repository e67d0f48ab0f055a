"""A failing transfer releases everything it reserved: no slot leaks, later stores succeed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvtier
from kvtier.testing import make_key


def caches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(16, 4, 8, generator=g) for _ in range(2)]


async def test_a_store_whose_gather_fails_leaks_no_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = caches()
    bb = 2 * 4 * 8 * 4
    async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 2 * bb}]}, kv_caches=kv) as store:
        assert store.transfers is not None
        real = store.transfers.layout.gather

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(store.transfers.layout, "gather", broken)
        assert await store.save([make_key(1), make_key(2)], [0, 1]) == 0
        assert len(store.backends[0]) == 0  # type: ignore[arg-type]
        assert store.stats()["tiers"][0]["used_bytes"] == 0
        assert store.stats()["transfers"]["failed_jobs"] == 1
        monkeypatch.setattr(store.transfers.layout, "gather", real)
        assert await store.save([make_key(1), make_key(2)], [0, 1]) == 2
        assert await store.load([make_key(2)], [9]) == 1
        assert torch.equal(kv[0][9], kv[0][1])


async def test_a_failing_demotion_frees_the_source_and_the_store_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = caches()
    bb = 2 * 4 * 8 * 4
    cfg = {"tiers": [{"backend": "cpu", "capacity": 2 * bb}, {"backend": "cpu", "capacity": 4 * bb}], "write": "back"}
    async with kvtier.open(cfg, kv_caches=kv) as store:
        assert await store.save([make_key(1), make_key(2)], [0, 1]) == 2

        def broken(keys: Any, blocks: Any) -> list[int | None]:
            raise RuntimeError("injected disk failure")

        monkeypatch.setattr(store.backends[1], "write_blocks", broken)
        # Both old blocks must move down; their demotion fails, the new blocks still land.
        assert await store.save([make_key(3), make_key(4)], [2, 3]) == 2
        assert len(store.backends[0]) == 2  # type: ignore[arg-type]
        assert await store.lookup([make_key(3), make_key(4)]) == 2
        # The lost victims are a miss, never wrong bytes.
        assert await store.lookup([make_key(1)]) == 0
        assert await store.load([make_key(3)], [10]) == 1
        assert torch.equal(kv[1][10], kv[1][2])


async def test_a_failing_delete_of_evicted_blocks_does_not_stop_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = caches()
    bb = 2 * 4 * 8 * 4
    async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": 2 * bb}, {"backend": "cpu", "capacity": 2 * bb}]}, kv_caches=kv) as store:
        for i in range(4):
            assert await store.save([make_key(i)], [i]) == 1
        real = store.backends[1].delete_blocks

        def broken(keys: Any) -> None:
            raise RuntimeError("injected delete failure")

        monkeypatch.setattr(store.backends[1], "delete_blocks", broken)
        # Tier 1 is full: this store drops its oldest block (the delete fails) and demotes one.
        assert await store.save([make_key(10)], [10]) == 1
        monkeypatch.setattr(store.backends[1], "delete_blocks", real)
        assert await store.load([make_key(10)], [11]) == 1
        assert torch.equal(kv[0][11], kv[0][10])
        assert store.stats()["transfers"]["failed_jobs"] == 0
