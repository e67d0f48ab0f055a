"""The native straight read of an ``lmdb`` tier (``lmdb_plain.straight_read``) reads the file
guard's ``fd`` and ``seen`` and adds to the counters through the slots of their own classes
(``kvtier/records/_hostrow.h``: ``host_member_slot``), and reads ``devices.locate`` from the module's
dict. Whatever else those objects are (a subclass, a property, a plain object, a slotted class
with a ``__setattr__`` of its own, a counter that is not an int), it asks them by ``getattr`` and ``setattr`` as before: the job's outcome, bytes
and counts are the same either way, and the same as the general path's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import lmdb_one, lmdb_plain

from kvtier import devices, registry
from kvtier.backend import BackendCounters, BlockFormat
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block

SIZE = 4096
N = 6  # records saved; keys N.. are missing
P_GUARD, P_COUNTERS = 5, 9  # their places in StraightRead.native_parts (backends/_rowguard.h)
COUNTED = ("blocks_read", "bytes_read", "read_misses")

native = pytest.mark.skipif(lmdb_plain.straight_read is None, reason="built without the native row guard")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Any]:
    fmt = BlockFormat(block_bytes=SIZE, dtype="uint8")
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(tmp_path / "store"), sync_mode="fast")
    asyncio.run(backend.open(fmt))
    blocks = [random_block(SIZE, i) for i in range(N)]
    backend.write_blocks([make_key(i) for i in range(N)], blocks)
    backend.blocks = blocks
    yield backend
    asyncio.run(backend.aclose())


def _rows(n: int) -> list[torch.Tensor]:
    return [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(n)]


def _jobs() -> list[list[int]]:
    """Jobs of one key (a hit, a miss) and of several (hits and misses mixed)."""
    return [[0], [N + 1], [1, 2, N + 2, 3], [4, 5]]


def _read(backend: Any, parts: tuple[Any, ...], ids: list[int], rows: list[torch.Tensor]) -> Any:
    keys = [make_key(i) for i in ids]
    return lmdb_plain.straight_read(parts, backend._env, keys, rows, time.perf_counter, lmdb_one.COLD_GET_S, xxcopy.xxh3_check_copy)  # type: ignore[misc]


def _general(backend: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[bytes], dict[str, int]]:
    """Each job of :func:`_jobs` read by the general path: its outcome, its rows' bytes, the counts it made."""
    before = {name: getattr(backend.counters, name) for name in COUNTED}
    found, data = [], []
    with monkeypatch.context() as m:
        m.setattr(lmdb_one, "STRAIGHT_READS", False)
        for ids in _jobs():
            rows = _rows(len(ids))
            found.append(backend.read_blocks([make_key(i) for i in ids], rows))
            data.extend(bytes(r.numpy()) for r in rows)
    return found, data, {name: getattr(backend.counters, name) - before[name] for name in COUNTED}


def _warm(backend: Any) -> list[list[torch.Tensor]]:
    """Rows for each job of :func:`_jobs`, their views made by a read through the tier (the
    straight read takes only rows it has seen), zeroed again."""
    rows = [_rows(len(ids)) for ids in _jobs()]
    for ids, job in zip(_jobs(), rows):
        backend.read_blocks([make_key(i) for i in ids], job)
        for r in job:
            r.zero_()
    return rows


def _straight(backend: Any, parts: tuple[Any, ...], rows: list[list[torch.Tensor]], counters: Any) -> tuple[list[Any], list[bytes], dict[str, int]]:
    before = {name: getattr(counters, name) for name in COUNTED}
    found = [_read(backend, parts, ids, job) for ids, job in zip(_jobs(), rows)]
    data = [bytes(r.numpy()) for job in rows for r in job]
    return found, data, {name: getattr(counters, name) - before[name] for name in COUNTED}


class _Sub(BackendCounters):
    """A subclass: its members are its base's (their slots those of the base's instances)."""


class _Recorded:
    """Counters and a guard that are no slotted class: every read and write goes by name."""

    def __init__(self, source: Any, names: tuple[str, ...]) -> None:
        self.__dict__["_log"] = []
        for name in names:
            self.__dict__[name] = getattr(source, name)

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            object.__getattribute__(self, "_log").append(("get", name))
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._log.append(("set", name))
        self.__dict__[name] = value

    def check(self) -> None:  # (the guard's Python form: asked only when the size moved)
        raise AssertionError("the data file's size did not move")


class _PropertyCounters(BackendCounters):
    """``blocks_read`` a property over a member of another name: the member is not the counter."""

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        super().__init__()
        self._blocks = 0

    @property  # type: ignore[misc]
    def blocks_read(self) -> int:  # type: ignore[override]
        return self._blocks

    @blocks_read.setter
    def blocks_read(self, value: int) -> None:
        self._blocks = value


class _Hooked:
    """Counters of a slotted class of their own that writes them by code of its own (its
    ``__setattr__``): setattr runs that code, so the native read must too."""

    __slots__ = (*COUNTED, "log")

    def __init__(self) -> None:
        for name in COUNTED:
            object.__setattr__(self, name, 0)
        object.__setattr__(self, "log", [])

    def __setattr__(self, name: str, value: Any) -> None:
        self.log.append(name)
        object.__setattr__(self, name, value)


def _counters(kind: str, own: BackendCounters) -> Any:
    if kind == "own":
        return own
    if kind == "subclass":
        return _Sub()
    if kind == "property":
        return _PropertyCounters()
    if kind == "hooked":
        return _Hooked()
    if kind == "float":
        made = BackendCounters()
        made.blocks_read = 0.0  # type: ignore[assignment]
        made.bytes_read = 0.0  # type: ignore[assignment]
        return made
    return _Recorded(own, COUNTED)


@native
@pytest.mark.parametrize("kind", ["own", "subclass", "property", "float", "hooked", "plain object"])
def test_counts_through_any_counters_are_the_general_paths(store: Any, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    found, data, counted = _general(store, monkeypatch)
    assert found == [[True], [False], [True, True, False, True], [True, True]]
    blank = bytes(SIZE)
    assert data == [bytes(store.blocks[i].numpy()) if i < N else blank for ids in _jobs() for i in ids]
    rows = _warm(store)
    parts = list(store._straight.native_parts)
    counters = parts[P_COUNTERS] = _counters(kind, parts[P_COUNTERS])
    got = _straight(store, tuple(parts), rows, counters)
    assert got == (found, data, counted)
    if kind == "plain object":
        assert ("set", "blocks_read") in counters._log and ("set", "read_misses") in counters._log
    if kind == "hooked":
        assert {"blocks_read", "bytes_read", "read_misses"} <= set(counters.log)
    if kind == "property":
        assert counters._blocks == counted["blocks_read"] == N
    if kind == "float":
        assert type(counters.blocks_read) is float and type(counters.bytes_read) is float


@native
@pytest.mark.parametrize("kind", ["own", "plain object"])
def test_the_guard_is_read_by_name_where_it_is_no_slotted_class(store: Any, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    found, data, counted = _general(store, monkeypatch)
    rows = _warm(store)
    parts = list(store._straight.native_parts)
    if kind == "plain object":
        parts[P_GUARD] = _Recorded(parts[P_GUARD], ("fd", "seen"))
    assert _straight(store, tuple(parts), rows, parts[P_COUNTERS]) == (found, data, counted)
    if kind == "plain object":
        assert parts[P_GUARD]._log.count(("get", "fd")) == len(_jobs())


@native
def test_a_guard_whose_size_moved_hands_the_job_to_the_python_form(store: Any) -> None:
    """``seen`` read from the guard's slot: a size other than the file's is told (``False``:
    the Python form's guard then checks the file), nothing read, nothing counted."""
    rows = _warm(store)
    guard = store._straight.guard
    before = store.counters.as_dict()
    seen = guard.seen
    guard.seen = seen + 4096
    try:
        assert _read(store, store._straight.native_parts, [0], rows[0]) is False
        assert _read(store, store._straight.native_parts, [1, 2, N + 2, 3], rows[2]) is False
    finally:
        guard.seen = seen
    assert store.counters.as_dict() == before
    assert all(not r.any() for job in rows for r in job)


@native
def test_devices_locate_set_hands_every_job_over(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``devices.locate`` read from the module's dict: set there, the native read takes no job."""
    rows = _warm(store)
    monkeypatch.setattr(devices, "locate", lambda tensor: None)
    assert _read(store, store._straight.native_parts, [0], rows[0]) is None
    assert _read(store, store._straight.native_parts, [1, 2, N + 2, 3], rows[2]) is None
    monkeypatch.undo()
    assert _read(store, store._straight.native_parts, [0], rows[0]) == [True]
