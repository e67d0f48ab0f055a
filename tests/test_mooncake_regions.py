"""The memory a ``mooncake`` tier registers for RDMA follows the pools that live.

Against a real private Mooncake Store (tests/mooncake_servers.py). The client runs over TCP, whose
``register_buffer`` / ``unregister_buffer`` keep the same table as over RDMA (it refuses a region
that overlaps one it holds, and a base it does not hold), with the session told to register as it
does for ``protocol: rdma``. The client's own calls are recorded by wrapping its real methods, and
what it holds is asked of it: a one-byte region it accepts was not covered.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mooncake_servers import MooncakeServers

from kvtier.backend import BlockFormat
from kvtier.testing import make_key, random_block

BLOCK = 256 << 10  # the size that goes straight from and into the rows


class Recorded:
    """A real Mooncake client whose registrations are recorded (every other call passes)."""

    real_class: Any = None

    def __init__(self) -> None:
        self._real = self.real_class()
        self.calls: list[tuple[str, int, int, int]] = []

    def register_buffer(self, base: int, nbytes: int) -> int:
        rc = self._real.register_buffer(base, nbytes)
        self.calls.append(("register", base, nbytes, rc))
        return int(rc)

    def unregister_buffer(self, base: int) -> int:
        rc = self._real.unregister_buffer(base)
        self.calls.append(("unregister", base, 0, rc))
        return int(rc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def held(self) -> dict[int, int]:
        """What the recorded calls leave registered: base -> length."""
        out: dict[int, int] = {}
        for what, base, nbytes, rc in self.calls:
            if rc == 0:
                if what == "register":
                    out[base] = nbytes
                else:
                    out.pop(base, None)
        return out

    def covers(self, address: int) -> bool:
        """Whether the client holds a region over ``address`` (it refuses one overlapping it)."""
        if self._real.register_buffer(address, 1) == 0:
            assert self._real.unregister_buffer(address) == 0
            return False
        return True


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> type[Recorded]:
    from kvtier.backends import mooncake_session

    real = mooncake_session._load_store_class

    def load() -> Any:
        store_class, config_class, pin = real()
        Recorded.real_class = store_class
        return Recorded, config_class, pin

    monkeypatch.setattr(mooncake_session, "_load_store_class", load)
    return Recorded


def opened(servers: MooncakeServers, path: Path) -> Any:
    """A tier that registers the memory it moves, as with ``protocol: rdma`` (its client runs TCP)."""
    from kvtier.backends.mooncake_tier import MooncakeBackend

    prefix = "r" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    backend = MooncakeBackend(capacity=1 << 30, sync_interval_s=3600, prefix=prefix, **servers.tier_options())
    backend.session.registers = True
    fmt = BlockFormat(block_bytes=BLOCK, dtype="bfloat16", namespace_digest=hashlib.sha256(b"regions").digest())
    asyncio.run(backend.open(fmt))
    return backend


@pytest.fixture
def backend(mooncake_store: MooncakeServers, tmp_path: Path, recorded: Any) -> Iterator[Any]:
    backend = opened(mooncake_store, tmp_path)
    try:
        yield backend
    finally:
        asyncio.run(backend.aclose())


def pool_over(arena: bytearray, rows: int, offset_rows: int = 0) -> torch.Tensor:
    """``rows`` rows of a pool whose memory is ``arena``'s from row ``offset_rows`` (its own storage)."""
    pool = torch.frombuffer(arena, dtype=torch.uint8, count=rows * BLOCK, offset=offset_rows * BLOCK).view(rows, BLOCK)
    for i in range(rows):
        pool[i] = random_block(BLOCK, seed=offset_rows + i)
    return pool


def stored_and_read(backend: Any, pool: torch.Tensor, rows: list[int], seed: int) -> None:
    """Store ``rows`` of ``pool``, then read them back into the same rows (no other memory)."""
    keys = [make_key(seed * 100 + i) for i in rows]
    assert None not in backend.write_blocks(keys, [pool[i] for i in rows])
    want = pool[rows].clone()
    pool[rows] = 0
    assert backend.read_blocks(keys, [pool[i] for i in rows]) == [True] * len(rows)
    assert torch.equal(pool[rows], want)


def client(backend: Any) -> Recorded:
    store = backend.session.store
    assert isinstance(store, Recorded)
    return store


def test_a_pool_grown_at_its_old_base_is_registered_again_whole(backend: Any) -> None:
    store = client(backend)
    arena = bytearray(8 * BLOCK)
    small = pool_over(arena, 2)
    base = small.data_ptr()
    stored_and_read(backend, small, [0, 1], seed=1)
    assert store.held()[base] == 2 * BLOCK
    del small
    gc.collect()
    grown = pool_over(arena, 6)  # the engine's new pool, at the old one's base, larger
    assert grown.data_ptr() == base
    stored_and_read(backend, grown, [4, 5], seed=2)
    assert store.held()[base] == 6 * BLOCK
    assert store.covers(base + 5 * BLOCK)
    assert ("unregister", base, 0, 0) in store.calls
    assert backend.stats()["registrations"]["register_failures"] == 0


def kept_and_freed(backend: Any, seed: int) -> tuple[Recorded, torch.Tensor, int]:
    """Two pools stored and read back, then the second freed: the client, the pool kept, and
    where the freed one was."""
    store = client(backend)
    pool, gone = pool_over(bytearray(2 * BLOCK), 2), pool_over(bytearray(2 * BLOCK), 2)
    gone_base = gone.data_ptr()
    stored_and_read(backend, pool, [0, 1], seed=seed)
    stored_and_read(backend, gone, [0, 1], seed=seed + 1)
    assert store.covers(gone_base)
    del gone
    gc.collect()
    return store, pool, gone_base


def test_a_pool_the_engine_freed_is_unregistered(backend: Any) -> None:
    store, pool, gone_base = kept_and_freed(backend, seed=3)
    backend.session.regions.sweep_interval_s = 0.0  # the next job looks at once
    stored_and_read(backend, pool, [1], seed=5)  # nothing new to register
    assert gone_base not in store.held()
    assert not store.covers(gone_base)  # the NIC no longer has it pinned
    assert store.held().get(pool.data_ptr()) == 2 * BLOCK
    counts = backend.stats()["registrations"]
    assert counts["unregister_failures"] == 0 and counts["unregistered"] >= 1


def test_a_freed_pool_is_let_go_when_new_memory_is_registered(backend: Any) -> None:
    store = client(backend)
    first = pool_over(bytearray(2 * BLOCK), 2)
    first_base = first.data_ptr()
    stored_and_read(backend, first, [0], seed=6)
    del first
    gc.collect()
    second = pool_over(bytearray(3 * BLOCK), 3)
    stored_and_read(backend, second, [2], seed=7)
    assert ("unregister", first_base, 0, 0) in store.calls
    held = store.held()
    assert held.get(second.data_ptr()) == 3 * BLOCK and len(held) == 3


def test_live_pools_over_one_memory_share_one_region(backend: Any) -> None:
    store = client(backend)
    arena = bytearray(4 * BLOCK)
    low, high = pool_over(arena, 2), pool_over(arena, 2, offset_rows=1)  # rows 0-1 and 1-2 of one memory
    stored_and_read(backend, low, [0], seed=8)
    stored_and_read(backend, high, [1], seed=9)
    assert store.held()[low.data_ptr()] == 3 * BLOCK
    assert store.covers(high.data_ptr() + 2 * BLOCK - 1)
    del low
    gc.collect()
    assert backend.session.regions.sweep() == 0  # kept while one of them lives
    stored_and_read(backend, high, [0, 1], seed=10)
    assert backend.stats()["registrations"]["register_failures"] == 0


def test_close_unregisters_every_region(mooncake_store: MooncakeServers, tmp_path: Path, recorded: Any) -> None:
    backend = opened(mooncake_store, tmp_path)
    store = client(backend)
    pools = [pool_over(bytearray(2 * BLOCK), 2) for _ in range(2)]
    for n, pool in enumerate(pools):
        stored_and_read(backend, pool, [0, 1], seed=11 + n)
    assert len(store.held()) == 4
    asyncio.run(backend.aclose())
    assert store.held() == {}
    counts = backend.stats()["registrations"]
    assert counts["registered"] == counts["unregistered"] == 4 and counts["regions"] == 0


def test_a_refused_registration_is_counted_and_logged(backend: Any, caplog: pytest.LogCaptureFixture) -> None:
    store = client(backend)
    pool = pool_over(bytearray(2 * BLOCK), 2)
    assert store._real.register_buffer(pool.data_ptr() + BLOCK, 16) == 0  # someone else's region over the pool
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        keys = [make_key(900)]
        backend.write_blocks(keys, [pool[0]])  # over TCP the transfer itself still runs
    assert backend.stats()["registrations"]["register_failures"] == 1
    assert any("register_failures" in r.getMessage() for r in caplog.records)
    assert pool.data_ptr() not in store.held()
    assert store._real.unregister_buffer(pool.data_ptr() + BLOCK) == 0


def test_a_tcp_tier_registers_nothing(mooncake_store: MooncakeServers, tmp_path: Path, recorded: Any) -> None:
    from kvtier.backends.mooncake_tier import MooncakeBackend

    backend = MooncakeBackend(capacity=1 << 30, sync_interval_s=3600, prefix="tcp-regions", **mooncake_store.tier_options())
    fmt = BlockFormat(block_bytes=BLOCK, dtype="bfloat16", namespace_digest=hashlib.sha256(b"regions").digest())
    asyncio.run(backend.open(fmt))
    try:
        stored_and_read(backend, pool_over(bytearray(2 * BLOCK), 2), [0, 1], seed=20)
        assert client(backend).calls == []
        assert "registrations" not in backend.stats()
    finally:
        asyncio.run(backend.aclose())


def resizable_pool(rows: int, seed: int) -> torch.Tensor:
    """A pool of ``rows`` rows over memory of its own (a storage ``resize_`` may move: a device
    pool's; a host pool's stops being resizable once its bytes were lent to numpy, as a CPU job's
    copies do, so here its rows are registered as a job's, then moved after the resize)."""
    pool = torch.empty(rows * BLOCK, dtype=torch.uint8).view(rows, BLOCK)
    for i in range(rows):
        pool[i] = random_block(BLOCK, seed=seed + i)
    return pool


def resized(pool: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """``pool``'s storage resized in place to ``rows`` rows (its bytes moved to new memory, the
    old freed); the pool over it, the new rows filled."""
    storage = pool.untyped_storage()
    kept = pool.shape[0]
    storage.resize_(rows * BLOCK)
    pool.set_(storage, 0, (rows, BLOCK), (BLOCK, 1))
    for i in range(kept, rows):
        pool[i] = random_block(BLOCK, seed=seed + i)
    return pool


def test_a_pool_resized_in_place_lets_its_old_memory_go_and_is_registered_where_it_moved(backend: Any) -> None:
    store = client(backend)
    pool = resizable_pool(2, seed=40)
    old = pool.data_ptr()
    backend.session.register_rows([pool[0], pool[1]])  # as a job's rows (a CPU job's copies leave it not resizable)
    assert store.held()[old] == 2 * BLOCK
    resized(pool, 4, seed=42)
    new = pool.data_ptr()
    assert new != old  # (resize_ moved it: the old memory is freed, the storage lives)
    stored_and_read(backend, pool, [1, 3], seed=43)
    held = store.held()
    assert old not in held and not store.covers(old)  # the freed memory is no longer pinned
    assert held[new] == 4 * BLOCK and store.covers(new + 4 * BLOCK - 1)
    spans = backend.session.regions.spans()
    assert (new, 4 * BLOCK) in spans and not any(base <= old < base + n for base, n in spans)
    counts = backend.stats()["registrations"]
    assert counts["unregister_failures"] == 0 and counts["register_failures"] == 0


def test_a_pool_resized_in_place_and_not_used_again_is_let_go_at_the_next_sweep(backend: Any) -> None:
    store = client(backend)
    pool, other = resizable_pool(2, seed=50), pool_over(bytearray(2 * BLOCK), 2)
    old = pool.data_ptr()
    backend.session.register_rows([pool[0], pool[1]])
    stored_and_read(backend, other, [0], seed=52)
    assert store.held()[old] == 2 * BLOCK
    resized(pool, 3, seed=53)
    backend.session.regions.sweep_interval_s = 0.0  # the next job looks at once
    stored_and_read(backend, other, [1], seed=54)  # another pool's job: nothing new to register
    assert old not in store.held() and not store.covers(old)
    assert store.held()[other.data_ptr()] == 2 * BLOCK
    assert pool.data_ptr() not in store.held()  # registered again the first time a job moves it
    stored_and_read(backend, pool, [2], seed=55)
    assert store.held()[pool.data_ptr()] == 3 * BLOCK


class _Missing:
    """A class attribute that is not there: its lookup raises ``AttributeError`` (torch's own is
    defined on its immutable C base, which cannot lose it; this one, set on the subclass, is
    found first)."""

    def __get__(self, instance: Any, owner: Any) -> Any:
        raise AttributeError(f"type object {owner.__name__!r} has no attribute '_new_with_weak_ptr'")


@pytest.fixture
def without_weak_storage_call() -> Iterator[Any]:
    """``mooncake_regions`` as imported under a torch without the private
    ``UntypedStorage._new_with_weak_ptr`` (reloaded with the attribute hidden; reloaded again with
    it after the test). The open tier's regions run the reloaded module's code."""
    import importlib

    from kvtier.backends import mooncake_regions

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.UntypedStorage, "_new_with_weak_ptr", _Missing())
            assert not hasattr(torch.UntypedStorage, "_new_with_weak_ptr")
            yield importlib.reload(mooncake_regions)  # (the module's import raised AttributeError before)
    finally:
        importlib.reload(mooncake_regions)


def test_a_torch_without_its_weak_storage_call_keeps_live_regions_and_lets_freed_ones_go(backend: Any, without_weak_storage_call: Any) -> None:
    """Without the call the regions ask whether their storages expired: a freed pool is let go
    at the sweep; a live pool and the staging stay registered, and jobs go on."""
    assert without_weak_storage_call._storage_of is None
    regions = backend.session.regions
    regions.sweep_interval_s = 3600.0  # (sweeps only where the test asks)
    store, kept, freed_base = kept_and_freed(backend, seed=60)
    assert regions.sweep() == 1  # the freed pool alone
    assert freed_base not in store.held() and not store.covers(freed_base)
    assert store.held().get(kept.data_ptr()) == 2 * BLOCK
    assert backend.session.put_staging.base in store.held()
    stored_and_read(backend, kept, [1], seed=62)
    counts = backend.stats()["registrations"]
    assert counts["register_failures"] == 0 and counts["unregister_failures"] == 0


def test_a_region_whose_storages_cannot_be_asked_counts_as_freed_and_is_registered_again(
    backend: Any, without_weak_storage_call: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where neither torch's call nor the weak reference's ``expired`` answers, a region counts
    as freed: kept for the job that registered it, let go at the sweep, registered again by the
    next job that moves its memory, whose bytes are read back right."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def cannot(self: Any) -> bool:
        raise RuntimeError("not in this torch")

    monkeypatch.setattr(StorageWeakRef, "expired", cannot)
    store = client(backend)
    regions = backend.session.regions
    regions.sweep_interval_s = 3600.0
    pool = pool_over(bytearray(2 * BLOCK), 2)
    base = pool.data_ptr()
    stored_and_read(backend, pool, [0, 1], seed=63)
    assert store.held().get(base) == 2 * BLOCK  # kept for its job
    assert regions.sweep() >= 1
    assert base not in store.held() and not store.covers(base)
    stored_and_read(backend, pool, [0, 1], seed=64)
    assert store.held().get(base) == 2 * BLOCK
    counts = backend.stats()["registrations"]
    assert counts["register_failures"] == 0 and counts["unregister_failures"] == 0
