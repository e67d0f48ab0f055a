"""The ``file`` tier's table of records (``backends/file_table.py``): a clean close writes it, the
next open takes it instead of a ``stat`` per record when it names exactly the records there,
and lists every record as before when it does not (none, damaged, a record added or removed
behind it, a crash after an open); in both layouts."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_tier
from kvtier.backends.file_table import TABLE_NAME, key_sums

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=8192, dtype="bfloat16", namespace={"model_id": "m"})
LAYOUTS = pytest.mark.parametrize("layout", ["flat", "sharded"])


def _place(root: Path, key: bytes, layout: str) -> Path:
    h = key.hex()
    return root / f"{h}.kvb" if layout == "flat" else root / h[:2] / h[2:4] / f"{h}.kvb"


def _open(path: Path, monkeypatch: pytest.MonkeyPatch, walks: list[int] | None = None, **options: Any) -> Backend:
    """An open tier; ``walks`` gets a 1 for every ``stat`` walk its open made."""
    if walks is not None:
        real = file_tier.FileBackend._walk
        monkeypatch.setattr(file_tier.FileBackend, "_walk", lambda self, *, sweep: walks.append(1) or real(self, sweep=sweep))
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(path), **options)
    asyncio.run(backend.open(FMT))
    return backend


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst)


def _stat_listing(backend: Backend) -> dict[bytes, tuple[int, float]]:
    """Every record's stored size and stamp by a ``stat`` of each (the walk's way)."""
    keys, sizes, stamps = backend._record_columns(backend._root, layout=backend.store_layout)  # type: ignore[attr-defined]
    return {k: (-(-n // 4096) * 4096, s) for k, n, s in zip(keys, sizes, stamps)}


def _filled(root: Path, monkeypatch: pytest.MonkeyPatch, layout: str, n: int = 12) -> list[bytes]:
    """A closed store of ``n`` records, the first half touched to stamps apart (oldest first),
    the other half as written; its keys."""
    keys = [make_key(i) for i in range(n)]
    backend = _open(root, monkeypatch, layout=layout)
    backend.write_blocks(keys, [random_block(FMT.block_bytes, i) for i in range(n)])
    backend.touch_stamps([(k, 1_000_000.0 + 7 * i) for i, k in enumerate(keys[: n // 2])])
    asyncio.run(backend.aclose())
    return keys


@LAYOUTS
def test_a_reopen_takes_the_table_for_the_stat_walk_and_lists_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    root = tmp_path / "store"
    keys = _filled(root, monkeypatch, layout)
    assert (root / TABLE_NAME).is_file()
    walks: list[int] = []
    backend = _open(root, monkeypatch, walks)
    try:
        assert walks == [] and not (root / TABLE_NAME).exists()  # taken, and unlinked
        columns = backend.scan_columns()  # type: ignore[attr-defined]
        assert columns is not None and columns.oldest_first
        truth = _stat_listing(backend)
        assert sorted(columns.keys) == sorted(keys) == sorted(truth)
        for key, stored, stamp in columns:
            assert stored == truth[key][0]
            assert abs(stamp - truth[key][1]) < 1e-6  # touched: the stamp set; written: the file's
        assert list(columns.stamps) == sorted(columns.stamps) and columns.keys[:6] == keys[:6]  # the order restored
        assert backend.stats()["used_bytes"] == sum(n for n, _ in truth.values())
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(2)]
        assert backend.read_blocks(keys[:2], out) == [True, True]
        assert all(torch.equal(o, random_block(FMT.block_bytes, i)) for i, o in enumerate(out))
        backend.touch_stamps([(keys[-1], 900_000.0)])  # now the oldest
        backend.delete_blocks([keys[0]])
        backend.write_blocks([make_key(40), make_key(41)], [random_block(FMT.block_bytes, 40), random_block(FMT.block_bytes, 41)])
        backend.touch_stamps([(make_key(41), 800_000.0)])  # written since the open: its file keeps the stamp
        _place(root, make_key(40), layout).unlink()  # gone behind the tier: the table leaves it out
    finally:
        asyncio.run(backend.aclose())
    backend = _open(root, monkeypatch, walks)  # the second table: the changes since the first
    try:
        assert walks == []
        columns = backend.scan_columns()  # type: ignore[attr-defined]
        assert columns is not None
        assert sorted(columns.keys) == sorted([*keys[1:], make_key(41)]) == sorted(_stat_listing(backend))
        assert columns.keys[:2] == [make_key(41), keys[-1]] and list(columns.stamps[:2]) == [800_000.0, 900_000.0]
    finally:
        asyncio.run(backend.aclose())


@LAYOUTS
def test_a_record_added_removed_or_swapped_behind_the_table_makes_the_open_list_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    root = tmp_path / "store"
    keys = _filled(root, monkeypatch, layout)
    spare = tmp_path / "spare"
    _filled(spare, monkeypatch, layout, n=14)  # keys 12 and 13 to add
    saved = (root / TABLE_NAME).read_bytes()
    added = _place(spare, make_key(12), layout)
    cases = {
        "added": lambda: _copy(added, _place(root, make_key(12), layout)),
        "removed": lambda: _place(root, keys[3], layout).unlink(),
        "swapped": lambda: (_place(root, keys[3], layout).unlink(), _copy(_place(spare, make_key(13), layout), _place(root, make_key(13), layout))),
    }
    for case, change in cases.items():
        (root / TABLE_NAME).write_bytes(saved)
        held = {k for k in map(make_key, range(14)) if _place(root, k, layout).exists()}
        change()
        expected = {k for k in map(make_key, range(14)) if _place(root, k, layout).exists()}
        assert expected != held, case
        walks: list[int] = []
        backend = _open(root, monkeypatch, walks)
        try:
            assert walks == [1], case  # listed by a stat per record
            assert not (root / TABLE_NAME).exists()
            columns = backend.scan_columns()  # type: ignore[attr-defined]
            assert columns is not None and set(columns.keys) == expected, case
        finally:
            asyncio.run(backend.aclose())
        (root / TABLE_NAME).unlink(missing_ok=True)
        for key in expected - held:  # the store back as the table has it
            _place(root, key, layout).unlink()
        for key in held - expected:
            _copy(_place(spare, key, layout), _place(root, key, layout))


@LAYOUTS
def test_a_crash_after_an_open_leaves_no_table_and_a_table_back_from_before_it_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """The open unlinks the table before it writes anything; a crash after it (no close) leaves
    none, and the next open lists every record. Should the unlink be lost (a power loss before
    the directory reached the disk), the table back from before that open names records that
    differ from the directory's, and is not trusted either."""
    root = tmp_path / "store"
    keys = _filled(root, monkeypatch, layout)
    before = (root / TABLE_NAME).read_bytes()
    crashed = _open(root, monkeypatch, layout=layout)
    assert not (root / TABLE_NAME).exists()
    crashed.write_blocks([make_key(30)], [random_block(FMT.block_bytes, 30)])
    crashed.delete_blocks([keys[5]])
    crashed._beneath.close()  # type: ignore[attr-defined]  # it dies here: no close
    for table in (None, before):
        if table is not None:
            (root / TABLE_NAME).write_bytes(table)
        walks: list[int] = []
        backend = _open(root, monkeypatch, walks)
        try:
            assert walks == [1]
            columns = backend.scan_columns()  # type: ignore[attr-defined]
            assert columns is not None and sorted(columns.keys) == sorted([*keys[:5], *keys[6:], make_key(30)])
        finally:
            asyncio.run(backend.aclose())
        (root / TABLE_NAME).unlink(missing_ok=True)


@LAYOUTS
def test_a_damaged_table_is_dropped_and_every_record_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    root = tmp_path / "store"
    keys = _filled(root, monkeypatch, layout)
    saved = (root / TABLE_NAME).read_bytes()
    n = len(keys)
    damages = {
        "a flipped stamp bit": lambda b: b[: 16 + 40 * n + 3] + bytes([b[16 + 40 * n + 3] ^ 0x10]) + b[16 + 40 * n + 4 :],
        "a flipped key bit": lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:],
        "cut short": lambda b: b[:-1],
        "empty": lambda b: b"",
        "another magic": lambda b: b"XX" + b[2:],
    }
    for case, damage in damages.items():
        (root / TABLE_NAME).write_bytes(damage(saved))
        walks: list[int] = []
        backend = _open(root, monkeypatch, walks)
        try:
            assert walks == [1], case
            assert not (root / TABLE_NAME).exists()
            columns = backend.scan_columns()  # type: ignore[attr-defined]
            assert columns is not None and sorted(columns.keys) == sorted(keys), case
        finally:
            asyncio.run(backend.aclose())


def test_a_shared_tier_writes_and_takes_no_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    keys = _filled(root, monkeypatch, "flat")
    walks: list[int] = []
    backend = _open(root, monkeypatch, walks, shared=True)
    try:
        assert walks == [1] and (root / TABLE_NAME).exists()  # left for no one: the next plain open checks it
    finally:
        asyncio.run(backend.aclose())
    backend = _open(root, monkeypatch, walks)
    try:
        assert walks == [1]  # the table, still true
        assert sorted(backend.scan_columns().keys) == sorted(keys)  # type: ignore[attr-defined]
    finally:
        asyncio.run(backend.aclose())


def test_the_key_sums_are_the_same_for_any_order_and_differ_for_another_set() -> None:
    keys = [make_key(i) for i in range(50)]
    packed = b"".join(keys)
    assert key_sums(packed) == key_sums(b"".join(reversed(keys)))
    assert key_sums(packed) != key_sums(b"".join([*keys[:-1], make_key(50)]))
    assert len(key_sums(packed)) == 32 and key_sums(b"") == bytes(32)


@LAYOUTS
def test_a_table_temp_left_by_a_crash_mid_close_is_swept_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """A close that died while writing its table (or an open while writing its scratch file)
    leaves a temp file in the root, beside no record in a sharded store: the next open sweeps
    it once stale, as it does a record's, and keeps a young one (a live writer's)."""
    root = tmp_path / "store"
    backend = _open(root, monkeypatch, layout=layout)
    backend.write_blocks([make_key(1)], [random_block(FMT.block_bytes, 1)])
    asyncio.run(backend.aclose())
    stale, young = root / f"{TABLE_NAME}.123.0.tmp", root / "kvtier-listed.124.0.tmp"
    stale.write_bytes(b"a table cut short")
    young.write_bytes(b"a listing being written")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    again = _open(root, monkeypatch, layout=layout)
    try:
        assert not stale.exists() and young.exists()
        assert [c[0] for c in again.scan_columns()] == [make_key(1)]  # type: ignore[attr-defined]
    finally:
        asyncio.run(again.aclose())


@LAYOUTS
def test_a_write_and_a_delete_that_end_after_the_close_saved_its_table_are_what_the_next_open_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """A close saves its table before its root waits for the jobs under way (``FileBackend.aclose``):
    a write and a delete that end in between make the table differ from the directory, so the
    next open lists every record by a ``stat``: what it lists is what the directory holds (none
    lost, none stale), and it serves the record written."""
    import threading

    from kvtier.backends import file_saves

    root = tmp_path / "store"
    keys = _filled(root, monkeypatch, layout)
    backend = _open(root, monkeypatch, layout=layout)
    saved, inside = threading.Event(), threading.Semaphore(0)

    def held(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            inside.release()
            assert saved.wait(60)  # until the close has saved its table
            return real(*args, **kwargs)

        return call

    for name in ("commit_files", "commit_one"):
        monkeypatch.setattr(file_saves, name, held(getattr(file_saves, name)))
    monkeypatch.setattr(backend, "_unlink_record", held(backend._unlink_record))  # type: ignore[attr-defined]
    real_save = file_tier.save_table
    monkeypatch.setattr(file_tier, "save_table", lambda *a, **k: (real_save(*a, **k), saved.set()))
    added = make_key(40)
    jobs = [
        threading.Thread(target=backend.write_blocks, args=([added], [random_block(FMT.block_bytes, 40)])),
        threading.Thread(target=backend.delete_blocks, args=([keys[0]],)),
    ]
    for job in jobs:
        job.start()
    for _ in jobs:
        assert inside.acquire(timeout=60)  # both under way, counted beneath the root
    asyncio.run(backend.aclose())
    for job in jobs:
        job.join(60)
    assert saved.is_set() and not any(job.is_alive() for job in jobs)
    assert _place(root, added, layout).exists()
    backend = _open(root, monkeypatch)
    try:
        columns = backend.scan_columns()  # type: ignore[attr-defined]
        assert columns is not None and sorted(columns.keys) == sorted(_stat_listing(backend))
        assert added in columns.keys
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8)]
        assert backend.read_blocks([added], out) == [True] and torch.equal(out[0], random_block(FMT.block_bytes, 40))
    finally:
        asyncio.run(backend.aclose())
