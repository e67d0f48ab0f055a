"""A tier that lives in a directory reaches its tag log and, shared, its records' listing by the
directory's path: once its close has begun, neither its tag writes nor its sweep touch or take
what is at that path, which may be a store opened there since (its tag log appended to or
replaced by the closed tier's entries, or its records taken for the closed tier's)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kvtier.backends import tag_log

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.errors import ClosedError
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=4096, dtype="uint8")


def _opened(kind: str, path: Path) -> Any:
    backend = registry.backends.get(kind)(capacity=16 << 20, path=str(path), sync_mode="fast")
    asyncio.run(backend.open(FMT))
    return backend


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("kind", ["file", "lmdb"])
def test_tags_written_by_a_closed_tier_leave_the_tag_log_of_a_store_opened_since_alone(tmp_path: Path, kind: str, whole: bool) -> None:
    closed = _opened(kind, tmp_path)
    asyncio.run(closed.aclose())
    since = _opened(kind, tmp_path)
    try:
        since.write_tags([(make_key(1), "new")], [(make_key(1), True)])
        closed.write_tags([(make_key(2), "old")], [(make_key(2), True)], whole=whole)
        assert since.read_tags() == ({make_key(1): "new"}, [make_key(1)])
    finally:
        asyncio.run(since.aclose())


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("kind", ["file", "lmdb"])
def test_tags_under_way_across_the_close_leave_the_tag_log_of_a_store_opened_since_alone(
    tmp_path: Path, kind: str, whole: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    closing = _opened(kind, tmp_path)
    opened: list[Any] = []
    lines = tag_log._lines

    def close_meanwhile(tenants: Any, pins: Any) -> bytes:  # the write's lines made, then the close and a new open
        data = lines(tenants, pins)
        if opened:  # (the new store's own write)
            return data
        asyncio.run(closing.aclose())
        opened.append(_opened(kind, tmp_path))
        opened[0].write_tags([(make_key(1), "new")], [(make_key(1), True)])
        return data

    monkeypatch.setattr(tag_log, "_lines", close_meanwhile)
    closing.write_tags([(make_key(2), "old")], [(make_key(2), True)], whole=whole)
    monkeypatch.setattr(tag_log, "_lines", lines)
    try:
        assert opened[0].read_tags() == ({make_key(1): "new"}, [make_key(1)])
    finally:
        asyncio.run(opened[0].aclose())


def _close_and_open_another(closing: Any, path: Path, opened: list[Any]) -> None:
    """As a walk of ``closing`` begins: its close, then a ``file`` store opened at ``path``
    (appended to ``opened``) and its own record written."""
    asyncio.run(closing.aclose())
    opened.append(_opened("file", path))
    opened[0].write_blocks([make_key(2)], [random_block(FMT.block_bytes, 2)])


def test_a_sweep_under_way_across_the_close_takes_no_record_of_a_store_opened_since(tmp_path: Path) -> None:
    closing = _opened("file", tmp_path)
    closing.write_blocks([make_key(1)], [random_block(FMT.block_bytes, 1)])
    assert closing._sweep_keys() == {make_key(1)}
    opened: list[Any] = []
    walk = closing._leaf_entries

    def close_meanwhile(*args: Any, **kwargs: Any) -> Any:
        _close_and_open_another(closing, tmp_path, opened)
        yield from walk(*args, **kwargs)

    closing._leaf_entries = close_meanwhile
    try:
        assert closing._sweep_keys() is None
    finally:
        asyncio.run(opened[0].aclose())


def test_a_scan_whose_walk_the_close_began_during_lists_no_record_of_a_store_opened_since(tmp_path: Path) -> None:
    closing = _opened("file", tmp_path)
    closing.write_blocks([make_key(1)], [random_block(FMT.block_bytes, 1)])
    closing.scan_columns()  # (the walk at open used: a scan walks again)
    opened: list[Any] = []
    columns = closing._record_columns

    def close_meanwhile(*args: Any, **kwargs: Any) -> Any:
        _close_and_open_another(closing, tmp_path, opened)
        return columns(*args, **kwargs)

    closing._record_columns = close_meanwhile
    try:
        with pytest.raises(ClosedError):
            list(closing.scan())
    finally:
        asyncio.run(opened[0].aclose())
