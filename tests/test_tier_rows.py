"""The engine hands a byte tier its rows of one pool as one PoolRows where the tier says it takes
one (``takes_pool_rows``), else a list of views; the bytes stored and served are the same."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends.file_tier import FileBackend
from kvtier.backends.lmdb_tier import LmdbBackend

import kvtier
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import LayoutError
from kvtier.pool_rows import PoolRows
from kvtier.testing import BackendTests, make_key
from kvtier.transfer import TransferEngine
from kvtier.transfer.flush import _copy_out
from kvtier.transfer.layout import KVLayout
from kvtier.transfer.tier_rows import gives_pool_rows, kept_rows, rows_at, rows_for, takes_pool_rows
from kvtier.transfer.write_group import _joined
from tests.test_transfer import DictBackend, make_layout, manager_for, record_of

K = [make_key(i) for i in range(64)]


class PoolDict(DictBackend):
    """A dict tier that says it takes PoolRows, and records what it was handed."""

    name = "pooldict"
    takes_pool_rows = True

    def __init__(self, *, capacity: int) -> None:
        super().__init__(capacity=capacity)
        self.handed: list[tuple[str, Sequence[torch.Tensor]]] = []

    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        self.handed.append(("write", blocks))
        size = self._check_open().block_bytes
        bad = [i for i, b in enumerate(blocks) if b.dtype != torch.uint8 or tuple(b.shape) != (size,)]
        if bad:
            raise LayoutError(f"{self.name}: blocks{bad} are not 1-D uint8 tensors of {size} bytes")
        return super().write_blocks(keys, blocks)

    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        self.handed.append(("read", out))
        return super().read_blocks(keys, out)


class ListDict(PoolDict):
    """The same tier without the flag (a plugin that may need a list)."""

    name = "listdict"
    takes_pool_rows = False


# -- the helper ----------------------------------------------------------------------------------
def _opened(cls: type[DictBackend], block_bytes: int = 16) -> DictBackend:
    backend = cls(capacity=64 * block_bytes)
    asyncio.run(backend.open(BlockFormat(block_bytes=block_bytes)))
    return backend


def test_rows_for_a_tier_without_the_flag_are_a_list_of_the_pools_rows() -> None:
    pool = torch.arange(6 * 16, dtype=torch.int64).to(torch.uint8).reshape(6, 16)
    for backend in (_opened(ListDict), _opened(DictBackend)):
        assert not takes_pool_rows(backend)
        rows = rows_for(backend, pool, 4)
        assert type(rows) is list and [r.data_ptr() for r in rows] == [pool[i].data_ptr() for i in range(4)]
        picked = rows_at(backend, pool, [5, 1])
        assert type(picked) is list and [r.data_ptr() for r in picked] == [pool[5].data_ptr(), pool[1].data_ptr()]


def test_rows_for_a_tier_with_the_flag_are_one_pool_rows_of_that_pool() -> None:
    pool = torch.zeros(6, 16, dtype=torch.uint8)
    backend = _opened(PoolDict)
    assert takes_pool_rows(backend) and gives_pool_rows(backend, pool)
    rows = rows_for(backend, pool, 4)
    assert isinstance(rows, PoolRows) and rows.pool is pool and list(rows.numbers) == [0, 1, 2, 3]
    picked = rows_at(backend, pool, [5, 1])
    assert isinstance(picked, PoolRows) and picked.pool is pool and list(picked.numbers) == [5, 1]
    kept = kept_rows(picked, [1])
    assert isinstance(kept, PoolRows) and kept.pool is pool and list(kept.numbers) == [1]
    listed = kept_rows([pool[5], pool[1]], [1])
    assert type(listed) is list and listed[0].data_ptr() == pool[1].data_ptr()


def test_a_flag_that_is_not_true_or_a_class_without_one_gets_a_list() -> None:
    class Truthy(ListDict):
        takes_pool_rows = 1  # type: ignore[assignment]

    class Bare:  # duck-typed, not a Backend
        pass

    pool = torch.zeros(3, 16, dtype=torch.uint8)
    assert type(rows_for(_opened(Truthy), pool, 2)) is list
    assert type(rows_for(Bare(), pool, 2)) is list  # type: ignore[arg-type]


def test_rows_of_several_copies_join_into_one_pool_rows_only_of_one_pool() -> None:
    a, b = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.uint8)
    one = _joined([PoolRows(a, [3, 0])])
    assert isinstance(one, PoolRows) and list(one.numbers) == [3, 0]
    same = _joined([PoolRows(a, [3, 0]), PoolRows(a, range(1, 3))])
    assert isinstance(same, PoolRows) and same.pool is a and list(same.numbers) == [3, 0, 1, 2]
    mixed = _joined([PoolRows(a, [3]), PoolRows(b, [1]), [a[2]]])
    assert type(mixed) is list and [r.data_ptr() for r in mixed] == [a[3].data_ptr(), b[1].data_ptr(), a[2].data_ptr()]


# -- the engine with plugin tiers ----------------------------------------------------------------
@pytest.fixture
def layout() -> KVLayout:
    return make_layout()


def _engine(layout: KVLayout, backends: list[Backend], staging: int = 4) -> TransferEngine:
    for b in backends:
        if not b.is_open:
            asyncio.run(b.open(BlockFormat(block_bytes=layout.block_bytes)))
    return TransferEngine(layout, backends, staging_blocks=staging)


def _store_and_load(engine: TransferEngine, backend: Backend, layout: KVLayout) -> None:
    manager = manager_for(backend, 64)
    plan = manager.prepare_store(K[:6])
    assert plan is not None
    (result,) = engine.wait([engine.submit_store(plan, [0, 1, 2, 3, 4, 5])], timeout=30)
    assert result.success, result.error
    manager.complete_store(plan.keys, True)
    want = [record_of(layout, b) for b in range(6)]
    for c in layout.kv_caches:
        c.view(torch.uint8)[8:].zero_()
    load = manager.prepare_load(K[:6])
    (result,) = engine.wait([engine.submit_load(load, [10, 11, 12, 13, 14, 15])], timeout=30)
    assert result.success and result.missed == ()
    for i in range(6):
        assert torch.equal(record_of(layout, 10 + i), want[i])


def test_a_plugin_tier_without_the_flag_gets_lists_from_the_engine(layout: KVLayout) -> None:
    backend = ListDict(capacity=64 * layout.block_bytes)
    engine = _engine(layout, [backend])
    try:
        _store_and_load(engine, backend, layout)
    finally:
        engine.close()
    assert [kind for kind, _ in backend.handed] == ["write", "read", "read"]  # one write from the job's staging; reads in chunks of 4 staging rows
    assert all(type(rows) is list for _, rows in backend.handed)


def test_a_tier_with_the_flag_gets_pool_rows_of_the_staging_rows(layout: KVLayout) -> None:
    backend = PoolDict(capacity=64 * layout.block_bytes)
    engine = _engine(layout, [backend])
    try:
        _store_and_load(engine, backend, layout)
        loads = engine._staging_rows("load")
    finally:
        engine.close()
    assert [kind for kind, _ in backend.handed] == ["write", "read", "read"]
    for kind, rows in backend.handed:
        assert isinstance(rows, PoolRows), f"{kind}: handed a {type(rows).__name__}"
        assert rows.pool.shape[1] == layout.block_bytes and rows.numbers == range(len(rows))
    reads = [rows for kind, rows in backend.handed if kind == "read"]
    assert all(isinstance(r, PoolRows) and r.pool is loads for r in reads)  # the load's staging rows themselves
    assert [len(r) for r in reads] == [4, 2]


def test_promotion_into_a_tier_with_the_flag_hands_it_the_staging_rows_read(layout: KVLayout) -> None:
    first, second = PoolDict(capacity=64 * layout.block_bytes), ListDict(capacity=64 * layout.block_bytes)
    engine = _engine(layout, [first, second])
    try:
        from kvtier.manager import TierManager, TierSpec
        from kvtier.manager.policies import LRUPolicy

        bb = layout.block_bytes
        manager = TierManager([TierSpec("a", 2 * bb, bb, LRUPolicy(2)), TierSpec("b", 64 * bb, bb, LRUPolicy(64))], write="back")
        for i in range(3):  # the first tier holds 2: the oldest block goes down
            plan = manager.prepare_store([K[i]])
            assert plan is not None
            (result,) = engine.wait([engine.submit_store(plan, [i])], timeout=30)
            assert result.success, result.error
            manager.complete_store(plan.keys, True)
        assert manager.lookup_detail([K[0]])[0].tier == 1
        manager.remove([K[2]], 0)  # room in the first tier: a load promotes
        want = record_of(layout, 0)
        first.handed.clear()
        load = manager.prepare_load([K[0]], promote=True)
        assert load.promote
        (result,) = engine.wait([engine.submit_load(load, [9])], timeout=30)
        assert result.success
        loads = engine._staging_rows("load")
    finally:
        engine.close()
    assert torch.equal(record_of(layout, 9), want) and torch.equal(first.data[K[0]], want)
    (_, rows), *_ = [h for h in first.handed if h[0] == "write"]
    assert isinstance(rows, PoolRows) and rows.pool is loads and list(rows.numbers) == [0]
    assert all(type(rows) is list for _, rows in second.handed)


def test_a_flush_reads_a_tier_with_the_flag_into_one_pool_rows(layout: KVLayout) -> None:
    bb = layout.block_bytes
    with_flag, without = _opened(PoolDict, bb), _opened(ListDict, bb)
    for backend in (with_flag, without):
        backend.data.update({K[i]: record_of(layout, i).clone() for i in range(3)})
    for backend in (with_flag, without):
        rows, ok = _copy_out([backend, backend], [K[0], K[9], K[2]], [0, 0, 0], 1)
        assert ok == [K[0], K[2]] and torch.equal(rows[0], record_of(layout, 0)) and torch.equal(rows[1], record_of(layout, 2))
    (kind, handed), = with_flag.handed
    assert kind == "read" and isinstance(handed, PoolRows) and handed.numbers == range(3)
    (kind, handed), = without.handed
    assert kind == "read" and type(handed) is list and len(handed) == 3


# -- the engine with lmdb and file tiers, flag on and off ----------------------------------------
WIDTHS = {"small": 16, "split": 640}  # 2 KiB records; ~80 KiB, past lmdb's joined records


def _caches(width: int, blocks: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(width)
    return [torch.randn(blocks, 2, 8, width, generator=g) for _ in range(2)]


def _block_bytes(caches: list[torch.Tensor]) -> int:
    return sum(c[0].numel() * c.element_size() for c in caches)


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str, bool]]]:
    """(tier, call, PoolRows?) for every read_blocks/write_blocks of the lmdb and file tiers."""
    seen: list[tuple[str, str, bool]] = []
    for cls in (LmdbBackend, FileBackend):
        for call in ("read_blocks", "write_blocks"):
            inner = getattr(cls, call)

            def spy(self: Any, keys: Sequence[bytes], rows: Sequence[torch.Tensor], _inner: Any = inner, _call: str = call) -> Any:
                seen.append((self.name, _call, isinstance(rows, PoolRows)))
                return _inner(self, keys, rows)

            monkeypatch.setattr(cls, call, spy)
    yield seen


def _flag(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setattr(LmdbBackend, "takes_pool_rows", on)
    monkeypatch.setattr(FileBackend, "takes_pool_rows", on)


async def _run(
    config: dict[str, Any], caches: list[torch.Tensor], steps: str, handed: list[tuple[str, str, bool]]
) -> tuple[list[torch.Tensor], dict[str, dict[bytes, bytes]], list[tuple[str, str, bool]]]:
    """Saves of blocks 0-11 (in jobs of 3), loads of them into blocks 12-23 (``promote``), then
    each tier's records read back through lists: what the engine left in the caches and tiers,
    and what the engine handed the tiers (``handed`` until then)."""
    async with kvtier.open(config, kv_caches=caches) as store:
        for i in range(0, 12, 3):
            assert await store.save(K[i : i + 3], [i, i + 1, i + 2]) == 3
        if "flush" in steps:
            await store.flush()
        assert await store.lookup(K[:12]) == 12
        assert await store.load(K[:12], list(range(12, 24)), promote="promote" in steps) == 12
        engine_calls = list(handed)
        tiers: dict[str, dict[bytes, bytes]] = {}
        for backend in store.backends:
            if backend.is_memory:
                continue
            out = [torch.zeros(backend.format.block_bytes, dtype=torch.uint8) for _ in K[:12]]
            found = backend.read_blocks(K[:12], out)
            tiers[backend.name] = {k: bytes(o.numpy()) for k, o, ok in zip(K[:12], out, found) if ok}
        return [c.clone() for c in caches], tiers, engine_calls


SCENARIOS = {
    # name: (tiers as (backend, blocks of room), write mode, steps, the calls the engine makes: each
    # gets a PoolRows with the flag on, a list with it off)
    "lmdb alone": ([("lmdb", 0)], "through", "", {("lmdb", "write_blocks"), ("lmdb", "read_blocks")}),
    "cpu over lmdb, write-through": ([("cpu", 4), ("lmdb", 0)], "through", "promote", {("lmdb", "write_blocks"), ("lmdb", "read_blocks")}),
    "cpu over file, write-back": ([("cpu", 4), ("file", 0)], "back", "", {("file", "write_blocks"), ("file", "read_blocks")}),
    "lmdb over file, write-back": (
        [("lmdb", 5), ("file", 0)],
        "back",
        "promote",
        {("lmdb", "write_blocks"), ("lmdb", "read_blocks"), ("file", "write_blocks"), ("file", "read_blocks")},
    ),
    "lmdb over file, write-through": (
        [("lmdb", 6), ("file", 0)],
        "through",
        "promote",
        {("lmdb", "write_blocks"), ("lmdb", "read_blocks"), ("file", "write_blocks"), ("file", "read_blocks")},
    ),
}


def _tier(name: str, room: int, block_bytes: int, path: Path) -> dict[str, Any]:
    """A tier of ``name`` with room for ``room`` blocks (0: plenty)."""
    if name == "cpu":
        return {"backend": "cpu", "capacity": room * block_bytes}
    if not room:
        return {"backend": name, "capacity": 16 << 20, "path": str(path)}
    cls = {"lmdb": LmdbBackend, "file": FileBackend}[name]
    fmt = BlockFormat(block_bytes=block_bytes)
    capacity = block_bytes
    while cls(capacity=capacity, path=str(path)).blocks_for(fmt) < room:  # (the constructor does no I/O)
        capacity += 4096
    return {"backend": name, "capacity": capacity, "path": str(path)}


@pytest.mark.parametrize("width", list(WIDTHS.values()), ids=list(WIDTHS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_lmdb_and_file_tiers_serve_the_same_bytes_with_the_flag_on_and_off(
    scenario: str, width: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handed: list[tuple[str, str, bool]]
) -> None:
    tiers, write, steps, pooled = SCENARIOS[scenario]
    got = {}
    for on in (True, False):
        _flag(monkeypatch, on)
        handed.clear()
        caches = _caches(width)
        want = [c[:12].clone() for c in caches]
        bb = _block_bytes(caches)
        config = {"tiers": [_tier(name, room, bb, tmp_path / f"{on}-{name}") for name, room in tiers], "write": write, "namespace": {"model_id": "tier-rows"}}
        caches_after, stored, calls_made = asyncio.run(_run(config, caches, steps, handed))
        assert all(torch.equal(c[12:24], w) for c, w in zip(caches_after, want)), f"flag {on}: the loads gave other bytes"
        got[on] = stored
        calls = {(name, call) for name, call, _ in calls_made}
        assert calls == pooled, f"the engine called {sorted(calls)}"
        assert all(pool is on for _, _, pool in calls_made), f"flag {on}: the engine handed {calls_made}"
    assert got[True] == got[False]
    assert all(got[True].values())  # each byte tier holds records


# -- the conformance suite with the flag ---------------------------------------------------------
class StackingDict(PoolDict):
    """Says it takes PoolRows, then treats its blocks as a list (what the flag forbids)."""

    name = "stacking"

    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        stacked = torch.stack(blocks)  # type: ignore[arg-type]  # a list or tuple only
        return super().write_blocks(keys, list(stacked.unbind(0)))


class _Suite(BackendTests):
    backend_cls: type[Backend] = PoolDict

    def make_backend(self, path: Path, capacity: int) -> Backend:
        return self.backend_cls(capacity=capacity)  # type: ignore[call-arg]


def test_the_conformance_suite_runs_a_flagged_backend_with_pool_rows(tmp_path: Path) -> None:
    suite = _Suite()
    suite.test_pool_rows_if_the_backend_takes_them(tmp_path / "good")
    suite.backend_cls = StackingDict
    with pytest.raises(TypeError, match="stack"):
        suite.test_pool_rows_if_the_backend_takes_them(tmp_path / "stacking")
    suite.backend_cls = ListDict
    with pytest.raises(pytest.skip.Exception, match="does not set takes_pool_rows"):
        suite.test_pool_rows_if_the_backend_takes_them(tmp_path / "list")


# -- every path of the lmdb and file tiers, from a PoolRows and from a list ----------------------
OPTIONS = {
    "plain": {},
    "keyed": {"mac_key": b"k" * 32},
    "zstd-fast": {"codec": {"name": "zstd-shuffle", "level": 1}, "sync_mode": "fast"},
    "keyed-zstd": {"codec": {"name": "zstd", "level": 1}, "mac_key": b"k" * 32},
}
FORMS = ("native", "no-straight", "python")  # lmdb reads: native straight read, its lines, the general path


class _TierSuite(BackendTests):
    def __init__(self, name: str, options: dict[str, Any], block_bytes: int) -> None:
        self.name, self.options, self.block_bytes = name, options, block_bytes

    def make_backend(self, path: Path, capacity: int) -> Backend:
        cls = {"lmdb": LmdbBackend, "file": FileBackend}[self.name]
        return cls(capacity=max(capacity, 4 << 20), path=str(path / "store"), **self.options)


CASES = [("lmdb", options, form) for options in OPTIONS for form in FORMS] + [("file", options, "native") for options in OPTIONS]


@pytest.mark.parametrize("block_bytes", [4096, 81920])
@pytest.mark.parametrize(("name", "options", "form"), CASES)
def test_every_path_of_the_lmdb_and_file_tiers_takes_pool_rows(
    name: str, options: str, form: str, block_bytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.backends import lmdb_one, lmdb_plain

    if form != "native":
        monkeypatch.setattr(lmdb_plain, "straight_read", None)
    if form == "python":
        monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", False)
    _TierSuite(name, OPTIONS[options], block_bytes).test_pool_rows_if_the_backend_takes_them(tmp_path)


def test_tiers_that_wrap_or_are_not_checked_keep_lists() -> None:
    from kvtier.backends.compressed import CompressedBackend
    from kvtier.backends.memory import CpuBackend

    from kvtier.records.head_group_tier import HeadGroupTier

    assert LmdbBackend.takes_pool_rows is True and FileBackend.takes_pool_rows is True
    # The head-group tier splits or passes its rows to its inner tier as a list; the others were not checked.
    assert HeadGroupTier.takes_pool_rows is False and CompressedBackend.takes_pool_rows is False
    assert CpuBackend.takes_pool_rows is False and Backend.takes_pool_rows is False


def test_a_copy_out_of_a_host_pool_hands_its_pool_rows_and_a_missing_key_fails_alone(layout: KVLayout) -> None:
    from kvtier.backends.memory import CpuBackend

    from kvtier.transfer.plan_writes import rows_of

    bb = layout.block_bytes
    source = CpuBackend(capacity=8 * bb)
    asyncio.run(source.open(BlockFormat(block_bytes=bb)))
    slots = source.reserve(K[:3])
    assert slots is not None
    for i, slot in enumerate(slots):
        source.pool[slot].copy_(record_of(layout, i))
    staging = torch.zeros(4, bb, dtype=torch.uint8)
    with_flag, without = _opened(PoolDict, bb), _opened(ListDict, bb)
    rows, found = rows_of(source, [K[2], K[0]], staging, with_flag)
    assert found == [True, True] and isinstance(rows, PoolRows) and rows.pool is source.pool and list(rows.numbers) == [slots[2], slots[0]]
    listed, found = rows_of(source, [K[2], K[0]], staging, without)
    assert found == [True, True] and type(listed) is list
    assert [r.data_ptr() for r in listed] == [r.data_ptr() for r in rows] == [source.pool[slots[2]].data_ptr(), source.pool[slots[0]].data_ptr()]
    for target in (with_flag, without):  # a key the source no longer holds: a placeholder row, not found
        rows, found = rows_of(source, [K[1], K[9]], staging, target)
        assert found == [True, False] and type(rows) is list
        assert rows[0].data_ptr() == source.pool[slots[1]].data_ptr() and rows[1].data_ptr() == staging[0].data_ptr()
