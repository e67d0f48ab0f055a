"""The native copy of a small host job (kvtier.transfer.block_copy) against torch's copy of the
same pieces: the same bytes in the pool and in the cache, on every store path the CPU runs,
aligned or not, small jobs (memcpy) and large ones (streamed); bad rows and ids refused before
a byte moves; without the extension the layout copies with torch; and the extension is built
wherever a C compiler is."""

from __future__ import annotations

import os
import shutil
import sysconfig

import pytest
import torch

from kvtier.transfer import block_copy
from kvtier.transfer.copies import TeamPace
from kvtier.transfer.layout import KVLayout

native = pytest.mark.skipif(not block_copy.NATIVE, reason="kvtier.transfer._blockcopy not built (no C compiler)")


def layouts() -> dict[str, KVLayout]:
    """Two layouts: pieces of an odd size (shares of a record start off any 64-byte line, a
    2-block job is over the 1 MiB a streamed job needs) and of 64 KiB bf16 pages (the bench's)."""
    g = torch.Generator().manual_seed(7)
    odd = [torch.randint(0, 256, (12, n), dtype=torch.uint8, generator=g) for n in (300_007, 262_147, 129)]
    pages = [torch.randint(0, 256, (12, 16, 2, 8, 256), dtype=torch.uint8, generator=g).view(torch.bfloat16) for _ in range(4)]
    return {"odd": KVLayout(odd), "pages": KVLayout(pages)}


def record_of(layout: KVLayout, block: int) -> torch.Tensor:
    return torch.cat([c[block].reshape(-1).view(torch.uint8) for c in layout.kv_caches])


def copy_both_ways(layout: KVLayout, rows: list[int], ids: list[int], back: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Save ``ids`` into ``rows`` of a fresh pool (the layout's small-run copy, as an inline job
    makes it), change the rows, load them into ``back``: the pool and the blocks written."""
    pool = torch.full((10, layout.block_bytes), 0xA5, dtype=torch.uint8)
    with layout.copies.on_callers_team():
        assert layout._small_run(ids, pool, rows, True)
        pool[rows] ^= 0x5A
        assert layout._small_run(back, pool, rows, False)
    return pool, [record_of(layout, b).clone() for b in back]


@native
@pytest.mark.parametrize("name", ["odd", "pages"])
@pytest.mark.parametrize("blocks", [1, 2, 4, 8])
def test_the_native_copy_matches_torchs_on_every_path(name: str, blocks: int) -> None:
    paths = block_copy._blockcopy.paths()
    before = block_copy._blockcopy.path()
    rows = list(range(2, 2 + blocks))
    ids = [9, 0, 5, 3, 11, 1, 7, 2][:blocks]
    back = [4, 6, 8, 10, 0, 2, 1, 3][:blocks]
    try:
        outs = []
        for path in (None, *paths):  # None: torch's _foreach_copy_
            layout = layouts()[name]
            assert layout.native is not None
            expected = [record_of(layout, b) for b in ids]
            layout.native.enabled = path is not None
            if path is not None:
                block_copy._blockcopy.set_path(path)
            pool, loaded = copy_both_ways(layout, rows, ids, back)
            assert all(torch.equal(pool[r], rec ^ 0x5A) for r, rec in zip(rows, expected)), path
            assert all(torch.equal(got, rec ^ 0x5A) for got, rec in zip(loaded, expected)), path
            outs.append((pool, loaded))
        for pool, loaded in outs[1:]:  # untouched rows too: nothing written outside the job
            assert torch.equal(pool, outs[0][0]) and all(torch.equal(a, b) for a, b in zip(loaded, outs[0][1]))
    finally:
        block_copy._blockcopy.set_path(before)


@native
def test_bad_rows_and_ids_are_refused_before_a_byte_moves() -> None:
    layout = layouts()["pages"]
    nb = layout.native
    assert nb is not None
    pool = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
    cache = record_of(layout, 0).clone()
    with pytest.raises(IndexError, match=r"rows\[1\]: 4 is out of range \[0, 4\)"):
        nb.gather([0, 1], pool, [3, 4])
    with pytest.raises(IndexError, match=r"ids\[0\]: 12 is out of range \[0, 12\)"):
        nb.gather([12, 1], pool, [0, 1])
    with pytest.raises(IndexError, match=r"rows\[0\]: -1"):
        nb.scatter(pool, [-1], [0])
    with pytest.raises(TypeError, match=r"ids\[1\]: expected an int, got float"):
        nb.scatter(pool, [0, 1], [0, 1.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="ids: expected 2 block ids"):
        nb.gather([0], pool, [0, 1])
    with pytest.raises(ValueError, match="pool: expected"):
        nb.gather([0], torch.zeros((4, 8), dtype=torch.uint8), [0])
    with pytest.raises(ValueError, match="pool: expected a contiguous"):
        nb.gather([0], torch.zeros((4, layout.block_bytes), dtype=torch.int16), [0])
    assert not pool.any() and torch.equal(record_of(layout, 0), cache)


@native
def test_a_copier_checks_what_it_is_given() -> None:
    t = torch.zeros((3, 64), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"offsets\[0\]: a piece of 64 bytes at 10"):
        block_copy._blockcopy.BlockCopier([t.data_ptr()], 3, [64], [10], 64, t)
    with pytest.raises(ValueError, match="piece_bytes: expected 1 values"):
        block_copy._blockcopy.BlockCopier([t.data_ptr()], 3, [64, 64], [0], 64, t)
    with pytest.raises(ValueError, match=r"sources\[0\]: expected a contiguous host tensor"):
        block_copy.NativeBlocks([t.t()], [3], [0], 3)
    with pytest.raises(ValueError, match=r"piece_bytes\[0\]: 32"):
        block_copy.NativeBlocks([t], [32], [0], 64)


def test_without_the_extension_the_layout_copies_with_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_copy, "_blockcopy", None)
    layout = layouts()["odd"]
    assert layout.native is None
    ids, rows, back = [9, 0, 5], [3, 4, 5], [1, 2, 6]
    expected = [record_of(layout, b) for b in ids]
    pool, loaded = copy_both_ways(layout, rows, ids, back)
    assert all(torch.equal(pool[r], rec ^ 0x5A) for r, rec in zip(rows, expected))
    assert all(torch.equal(got, rec ^ 0x5A) for got, rec in zip(loaded, expected))
    with pytest.raises(RuntimeError, match="not built"):
        block_copy.NativeBlocks(layout._src, [1], [0], 1)


def test_a_compiler_means_the_extension_is_built() -> None:
    """An install with a C compiler must build the native copy: a silent fallback would leave
    every small job on torch's slower copy unnoticed."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if shutil.which(cc) is None or not os.path.exists(header):
        pytest.skip(f"NO C COMPILER ({cc}) OR NO Python.h: kvtier.transfer._blockcopy NOT BUILT, torch copies")
    assert block_copy.NATIVE, "kvtier.transfer._blockcopy did not build although a C compiler exists (reinstall: pip install -e .)"


@native
def test_a_pool_resized_in_place_is_copied_where_it_now_is() -> None:
    """The copier checks a pool once but reads its address and rows at every call: a pool
    whose storage moved (``resize_`` past its size) is written where it is now."""
    layout = layouts()["pages"]
    nb = layout.native
    assert nb is not None
    pool = torch.zeros((2, layout.block_bytes), dtype=torch.uint8)
    nb.gather([3], pool, [1])
    before = pool.data_ptr()
    pool.resize_((64, layout.block_bytes))
    assert pool.data_ptr() != before  # (the storage moved)
    nb.gather([5, 7], pool, [63, 40])
    nb.scatter(pool, [1], [0])
    assert torch.equal(pool[63], record_of(layout, 5)) and torch.equal(pool[40], record_of(layout, 7))
    assert torch.equal(record_of(layout, 0), record_of(layout, 3))


@native
def test_a_larger_job_is_copied_natively_on_the_team_or_alone_as_the_pace_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past 8 blocks an inline job is one native call too: on the caller's OpenMP team (as many
    threads as torch's ops there take) where the pace keeps jobs on the team, on the thread alone
    while it sends them alone; the same bytes either way, and the pace counts the job as what it
    was (a team job, a job alone)."""
    layout = layouts()["pages"]
    nb = layout.native
    assert nb is not None
    ids, rows = [11, 0, 9, 2, 7, 4, 5, 6, 3, 8], [9, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    calls: list[tuple[int, int]] = []
    inner = nb.copy
    nb.copy = lambda save, i, pool, r, threads=1: calls.append((len(i), threads)) is None and inner(save, i, pool, r, threads)  # type: ignore[method-assign]
    noted: list[bool] = []
    note = TeamPace.note
    monkeypatch.setattr(TeamPace, "note", lambda pace, solo, *a: noted.append(solo) or note(pace, solo, *a))
    pools = {}
    for alone in (False, True):
        pool = torch.zeros((12, layout.block_bytes), dtype=torch.uint8)
        layout.copies.pace.until = float("inf") if alone else 0.0
        with layout.copies.on_callers_team(len(ids) * layout.block_bytes):  # timed: the pace applies
            assert layout.copies.alone_now() is alone
            assert layout.copies.team_now() == (0 if alone else max(1, torch.get_num_threads()))
            layout.gather(ids, pool, rows, kept=True, checked=True)
        assert not layout.copies.alone_now() and layout.copies.team_now() == 0
        pools[alone] = pool
    assert calls == [(len(ids), max(1, torch.get_num_threads())), (len(ids), 1)]
    team_noted = block_copy.TEAM and torch.get_num_threads() > 1  # (one thread: a native job alone, not noted)
    assert noted == ([False, True] if team_noted else [True])
    assert layout.copies.pace.alone > 0  # noted as a job alone
    assert torch.equal(pools[False], pools[True])
    assert all(torch.equal(pools[True][r], record_of(layout, b)) for r, b in zip(rows, ids))


@native
def test_a_cache_whose_storage_moved_is_never_copied_at_its_old_address() -> None:
    """The copier takes the caches' addresses once; a cache whose storage moved since
    (``resize_`` past its size) turns the native copy off, and the layout's torch copy (whose
    views follow the storage) moves the right bytes; the native calls themselves refuse. Without
    the check the native copy read and wrote the freed memory (a fault, or wrong bytes)."""
    layout = layouts()["pages"]
    nb = layout.native
    assert nb is not None and nb.enabled
    cache = layout.kv_caches[1]
    before = cache.data_ptr()
    cache.resize_((cache.shape[0] * 64, *cache.shape[1:]))  # same first blocks, new storage
    assert cache.data_ptr() != before
    cache[3].view(torch.uint8).fill_(0x5C)  # written where the cache is now
    pool = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
    with layout.copies.on_callers_team():
        assert layout._small_run([3], pool, [2], True)
    assert not nb.enabled
    assert torch.equal(pool[2], record_of(layout, 3))
    with pytest.raises(RuntimeError, match="storage moved"):
        nb.gather([3], pool, [1])
    with pytest.raises(RuntimeError, match="storage moved"):
        nb.scatter(pool, [1], [0])
