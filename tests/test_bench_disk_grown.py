"""The LMDB saves of ``bench_disk.py`` and ``bench_disk_sizes.py`` are counted into a grown
``data.mdb`` (no timing asserts): each arm fills a fresh store, empties it untimed, and only
then makes its counted save, which must not grow the file."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_modules import bench_module

pytest.importorskip("lmdb")


def _sizes_bench():  # type: ignore[no-untyped-def]
    return bench_module("bench_disk_sizes")


def _fill(env, db, keys, blocks) -> None:  # type: ignore[no-untyped-def]
    for start in range(0, len(keys), 2):  # jobs of two, a transaction each
        with env.begin(write=True, db=db) as txn:
            for key, block in zip(keys[start : start + 2], blocks[start : start + 2]):
                txn.put(key, block.numpy())


@pytest.mark.parametrize("spare", [True, False])
def test_an_emptied_raw_store_takes_the_same_save_without_growing(tmp_path: Path, spare: bool) -> None:
    """After :func:`raw_empty` the same save reuses freed pages only; emptied without the spare
    record (the deletions alone), LMDB's free-page bookkeeping keeps a piece of the freed pages
    and the save grows the file by about one record: why the spare is there."""
    import torch
    from kvtier.tools.bench.scripts import disk_common

    from kvtier.testing import make_key

    size, n = 256 << 10, 8
    blocks = [torch.full((size,), i, dtype=torch.uint8) for i in range(n)]
    keys = [make_key(i) for i in range(n)]
    env, db = disk_common.raw_env(str(tmp_path), 64 << 20)
    try:
        _fill(env, db, keys, blocks)
        if spare:
            disk_common.raw_empty(env, db, keys, blocks[0], str(tmp_path))
        else:
            for part in disk_common.halves(keys):
                with env.begin(write=True, db=db) as txn:
                    for key in part:
                        assert txn.delete(key)
        with env.begin(db=db) as txn:
            assert txn.stat(db)["entries"] == 0  # every record and the spare went
        before = disk_common.data_bytes(str(tmp_path))
        _fill(env, db, keys, blocks)
        grew = disk_common.data_bytes(str(tmp_path)) - before
        with env.begin(db=db, buffers=True) as txn:
            assert all(bytes(txn.get(k)) == b.numpy().tobytes() for k, b in zip(keys, blocks))
    finally:
        env.close()
    if spare:
        assert grew == 0
    else:
        assert grew >= size


def test_an_emptied_tier_takes_the_same_save_without_growing(tmp_path: Path) -> None:
    import asyncio

    import torch
    from kvtier.tools.bench.scripts import disk_common

    from kvtier.backend import BlockFormat
    from kvtier.testing import make_key

    size, n = 256 << 10, 8
    blocks = [torch.full((size,), i, dtype=torch.uint8) for i in range(n)]
    keys = [make_key(i) for i in range(n)]
    backend = disk_common.open_backend("lmdb", BlockFormat(block_bytes=size, dtype="uint8"), capacity=64 << 20, path=str(tmp_path))
    try:
        for start in range(0, n, 2):
            assert None not in backend.write_blocks(keys[start : start + 2], blocks[start : start + 2])
        disk_common.tier_empty(backend, keys, blocks[0], str(tmp_path))
        assert not any(backend.read_blocks([*keys, disk_common.SPARE_KEY], [torch.empty(size, dtype=torch.uint8) for _ in range(n + 1)]))
        before = disk_common.data_bytes(str(tmp_path))
        for start in range(0, n, 2):
            assert None not in backend.write_blocks(keys[start : start + 2], blocks[start : start + 2])
        assert disk_common.data_bytes(str(tmp_path)) == before
        outs = [torch.empty(size, dtype=torch.uint8) for _ in range(n)]
        assert all(backend.read_blocks(keys, outs))
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    finally:
        asyncio.run(backend.aclose())


def test_a_sizes_cell_counts_lmdb_saves_into_a_grown_file_and_reports_the_fresh_ones(tmp_path: Path) -> None:
    bench = _sizes_bench()
    cell = bench._cell(str(tmp_path), "lmdb", 256 << 10, 2, 1, 1, 8)
    arms = ("tier", "raw_value", "raw_job", "raw_checked")
    for arm in arms:
        assert cell[f"{arm}_save_grew_bytes"] == 0, arm  # the counted save reused freed pages only
        assert cell[f"{arm}_fresh_save_blocks_s"] > 0 and cell[f"{arm}_fresh_save_time_ratio"] > 0, arm
    low, high = cell["fresh_save_ratio_paired_spread"]
    assert 0 < low <= cell["fresh_save_ratio_paired"] <= high
    files = bench._cell(str(tmp_path), "file", 4096, 2, 1, 1, 4)
    assert not [k for k in files if "fresh" in k or "grew" in k]  # file stores have no data.mdb to grow


def test_bench_disk_reports_grown_and_fresh_lmdb_saves(tmp_path: Path) -> None:
    import torch
    from kvtier.tools.bench.scripts import bench_disk
    from kvtier.tools.bench.scripts.disk_common import BLOCK

    blocks = [torch.full((BLOCK,), i, dtype=torch.uint8) for i in range(3)]
    res = bench_disk.bench_lmdb(str(tmp_path), blocks, 2)
    for name in ("lmdb_save_ratio", "lmdb_fresh_save_ratio", "lmdb_save_best_raw_ratio", "lmdb_fresh_save_best_raw_ratio"):
        spread = res[f"{name}_spread"]
        assert spread["min"] <= spread["median"] <= spread["max"], name
        assert res[f"{name}_paired"] == spread["median"] > 0, name
    for name in ("lmdb_fresh_save_gbps", "raw_lmdb_fresh_put_gbps", "lmdb_txn_per_job_fresh_put_gbps"):
        assert res[name] > 0, name
