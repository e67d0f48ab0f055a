"""The ``lmdb`` tier's rows of unkeyed jobs, checked and viewed in one loop and their views kept
by address (``lmdb_plain.RowViews``), against the general checks (``_check_io``) and the
general views (``host_rows``): the same errors for bad input, the same bytes for good input."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import lmdb_layout, lmdb_one
from kvtier.backends.lmdb_plain import RowViews

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import InvalidKeyError, LayoutError
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=4096, dtype="uint8")


def _open(path: Path, **options: Any) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path), **options)
    asyncio.run(backend.open(FMT))
    return backend


def _bad_jobs() -> list[tuple[str, list[Any], list[torch.Tensor], type[Exception]]]:
    keys = [make_key(i) for i in range(3)]
    rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    return [
        ("a short key", [keys[0], keys[1][:31], keys[2]], rows, InvalidKeyError),
        ("a str key", [keys[0], "k" * 32, keys[2]], rows, InvalidKeyError),
        ("one key as bytes", keys[0], rows, InvalidKeyError),  # type: ignore[list-item]
        ("fewer rows", keys, rows[:2], LayoutError),
        ("a float row", keys, [rows[0], torch.zeros(FMT.block_bytes // 4), rows[2]], LayoutError),
        ("a short row", keys, [rows[0], rows[1][:100], rows[2]], LayoutError),
        ("a 2-D row", keys, [rows[0], rows[1].view(2, -1), rows[2]], LayoutError),
    ]


@pytest.mark.parametrize("case", range(len(_bad_jobs())))
def test_a_bad_job_is_refused_by_name_as_the_general_checks_refuse_it(tmp_path: Path, case: int) -> None:
    """``RowViews.of`` gives no views for a job the general checks refuse, so read_blocks
    raises their error (naming the key or the row), and nothing is written into any row."""
    what, keys, rows, error = _bad_jobs()[case]
    views = RowViews(FMT.block_bytes)
    assert views.of(keys, rows) is None, what
    backend = _open(tmp_path / "store")
    try:
        backend.write_blocks([make_key(i) for i in range(3)], [random_block(FMT.block_bytes, i) for i in range(3)])
        with pytest.raises(error) as raised:
            backend.read_blocks(keys, rows)
        print(what, "->", raised.value)
        assert "blocks[1]" in str(raised.value) or "keys[1]" in str(raised.value) or what in ("one key as bytes", "fewer rows")
        assert all(int(r.count_nonzero()) == 0 for r in rows if r.dtype == torch.uint8)
    finally:
        asyncio.run(backend.aclose())


def test_rows_that_are_not_plain_host_rows_get_no_views() -> None:
    """Strided rows, and host tensors standing in for a device's, are left to the general read."""
    views = RowViews(64)
    keys = [make_key(i) for i in range(2)]
    strided = list(torch.zeros((64, 2), dtype=torch.uint8).unbind(1))
    assert views.of(keys, strided) is None
    own = [torch.zeros(64, dtype=torch.uint8) for _ in keys]
    assert views.of(keys, own) is not None


def test_a_view_kept_by_address_writes_into_the_row_now_at_that_address() -> None:
    """A view is kept by the row's address: a later row at that address (the allocator gives
    freed memory back) is written through the same view, and only within its own bytes; the
    views kept are bounded (all dropped once ``most`` are held)."""
    views = RowViews(256, most=3)
    views.views.clear()
    pool = torch.zeros((4, 256), dtype=torch.uint8)
    first = views.of([make_key(0)], [pool[1]])
    assert first is not None
    again = views.of([make_key(1)], [pool[1]])
    assert again is not None and again[0] is first[0]  # the same view, kept
    fresh = pool[1].view(256)  # another tensor object on the same bytes
    (view,) = views.of([make_key(2)], [fresh]) or []
    view[:] = b"\x05" * 256
    assert torch.equal(fresh, torch.full((256,), 5, dtype=torch.uint8))
    assert pool[0].count_nonzero() == 0 and pool[2].count_nonzero() == 0
    assert views.of([make_key(i) for i in range(3)], [pool[0], pool[2], pool[3]]) is not None
    assert len(views.views) <= 3


@pytest.mark.parametrize("rows", ["own", "staging"])
def test_a_job_read_through_kept_views_reads_what_the_general_views_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: str) -> None:
    """The same job read twice into the same rows through the kept views, and once with no
    views (``host_rows``, as before): the same finds and bytes; a missing key is a miss."""
    keys = [make_key(i) for i in range(6)]
    data = [random_block(FMT.block_bytes, 40 + i) for i in range(6)]
    backend = _open(tmp_path / "store")
    try:
        backend.write_blocks(keys[:5], data[:5])
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys] if rows == "own" else list(torch.zeros((6, FMT.block_bytes), dtype=torch.uint8).unbind(0))
        reader = backend._reader  # type: ignore[attr-defined]
        assert reader.views is not None
        got = [backend.read_blocks(keys, out) for _ in range(2)]
        assert got == [[True] * 5 + [False]] * 2
        assert all(torch.equal(o, d) for o, d in zip(out[:5], data[:5])) and out[5].count_nonzero() == 0
        assert {o.data_ptr() for o in out} <= set(reader.views.views)  # kept, for every store of this row size
        for o in out:
            o.zero_()
        monkeypatch.setattr(RowViews, "of", lambda self, keys, out: None)  # the general checks and views
        monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", False)  # (which keeps views of its own: test_lmdb_one_read)
        seen = []
        real = lmdb_layout.host_rows
        monkeypatch.setattr(lmdb_layout, "host_rows", lambda *a, **k: seen.append(1) or real(*a, **k))
        assert backend.read_blocks(keys, out) == [True] * 5 + [False]
        assert seen == [1] and all(torch.equal(o, d) for o, d in zip(out[:5], data[:5])) and out[5].count_nonzero() == 0
    finally:
        asyncio.run(backend.aclose())
