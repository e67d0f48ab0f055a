"""Whether a save's records are written into the room LMDB's own put reserves is decided once per
store (``LoneSave.reserve_with``, at the open and again whenever ``lmdb_lone.RESERVED_PUTS`` or
``lmdb_lone.put_reserved`` is set), and the lone save and the job save read that one decision:
flipping each input it is made from (the open's probe, each flag, the ``xxh3_joined`` builder)
flips both paths the same way, after the open as before it, and its undo flips them back; what
either path stores is the same bytes either way."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import lmdb_lone, lmdb_tier

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block

_rowguard = pytest.importorskip("kvtier.backends._rowguard")

FMT = BlockFormat(block_bytes=4096, dtype="uint8")
KEYS = [make_key(i) for i in range(4)]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Backend]:
    backend = _open(tmp_path / "store")
    if backend._lone is None or backend._lone.direct is None:  # type: ignore[attr-defined]
        asyncio.run(backend.aclose())
        pytest.skip("LMDB's own put is not probed sound here (lmdb_direct.direct_gets)")
    try:
        yield backend
    finally:
        asyncio.run(backend.aclose())


def _open(path: Path) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=16 << 20, path=str(path), sync_mode="fast")
    asyncio.run(backend.open(FMT))
    return backend


def _paths(backend: Backend, seed: int) -> tuple[int, int]:
    """A lone save and a job save of 3, their rows seen before: how many of the two jobs were
    written reserved (``_rowguard.reserved_jobs``); each stored and read back whole."""
    rows = [random_block(4096, seed + i) for i in range(4)]
    backend.write_blocks(KEYS, rows)  # the rows' views are kept from now on
    for i, row in enumerate(rows):
        row.copy_(random_block(4096, seed + 10 + i))
    ran = []
    for keys, job in ((KEYS[:1], rows[:1]), (KEYS[1:], rows[1:])):
        before = _rowguard.reserved_jobs()
        assert None not in backend.write_blocks(keys, job)
        ran.append(_rowguard.reserved_jobs() - before)
    out = [torch.zeros(4096, dtype=torch.uint8) for _ in KEYS]
    assert all(backend.read_blocks(KEYS, out))
    assert [bytes(o.numpy()) for o in out] == [bytes(r.numpy()) for r in rows]
    return ran[0], ran[1]


def _python_joined(head: Any, key: bytes, view: Any) -> bytes:
    return xxcopy.xxh3_joined_python(head, key, view)


@pytest.mark.parametrize("name, value", [("RESERVED_PUTS", False), ("put_reserved", None), ("xxh3_joined", _python_joined)])
def test_each_input_flipped_after_the_open_flips_both_paths_and_its_undo_flips_them_back(store: Backend, name: str, value: Any) -> None:
    assert _paths(store, 0) == (1, 1)
    with pytest.MonkeyPatch.context() as flip:
        flip.setattr(xxcopy if name == "xxh3_joined" else lmdb_lone, name, value)
        assert _paths(store, 100) == (0, 0)
    assert _paths(store, 200) == (1, 1)


def test_both_paths_read_the_one_decision(store: Backend) -> None:
    lone = store._lone  # type: ignore[attr-defined]
    decided = lone.reserve_with
    assert decided is xxcopy.xxh3_joined_native
    lone.reserve_with = None
    assert _paths(store, 0) == (0, 0)
    lone.reserve_with = decided
    assert _paths(store, 100) == (1, 1)


def test_a_flag_set_before_the_open_and_after_it_decides_every_live_store(tmp_path: Path, store: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_lone, "RESERVED_PUTS", False)
    other = _open(tmp_path / "other")  # opened with the flag off
    try:
        assert other._lone.reserve_with is None and store._lone.reserve_with is None  # type: ignore[attr-defined]
        assert _paths(other, 0) == (0, 0)
        lmdb_lone.RESERVED_PUTS = True  # a plain assignment is seen too
        assert other._lone.reserve_with is xxcopy.xxh3_joined_native  # type: ignore[attr-defined]
        assert _paths(other, 100) == (1, 1) and _paths(store, 100) == (1, 1)
    finally:
        asyncio.run(other.aclose())


def test_a_store_whose_open_did_not_probe_the_put_never_reserves(tmp_path: Path, store: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_tier, "direct_gets", lambda *args: None)
    other = _open(tmp_path / "other")
    try:
        assert other._lone is not None and other._lone.direct is None and other._lone.reserve_with is None  # type: ignore[attr-defined]
        assert _paths(other, 0) == (0, 0)
        monkeypatch.setattr(lmdb_lone, "RESERVED_PUTS", True)  # set again: decided again, still not probed
        assert other._lone.reserve_with is None  # type: ignore[attr-defined]
        assert _paths(other, 100) == (0, 0) and _paths(store, 100) == (1, 1)
    finally:
        asyncio.run(other.aclose())
