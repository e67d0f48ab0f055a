"""The set-up the tests of the ``lmdb`` tier's straight saves share
(``tests/test_lmdb_lone_save.py``: a lone save, ``tests/test_lmdb_job_save.py``: a job of
several keys): a store opened with eight host rows whose views it keeps, a plan run on the
straight line and on the general path (``LONE_SAVES = False``) and compared (:func:`compare`),
the forms each test runs in (:func:`guard_form`), and environments that fail on purpose."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_lone, lmdb_plain
from kvtier.backends.group_commit import GroupCommit
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import make_key

FMT = BlockFormat(block_bytes=4096, dtype="uint8")
_STATS = ("blocks_written", "bytes_written", "write_failures")
#: The forms each test runs in (:func:`guard_form`).
FORMS = ["reserved", "native", "python"]


def guard_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, python: Sequence[str]) -> str:
    """The form ``request.param`` of :data:`FORMS` set up: the row checks native and each record
    written into the room LMDB's own put reserves (``lmdb_lone.RESERVED_PUTS``); then built and
    put through python-lmdb, native; then the same with the ``lmdb_plain`` and ``lmdb_lone``
    functions named in ``python`` in their Python forms (``NAME_python``). Native forms are skipped in a build
    without them."""
    if request.param != "reserved":
        monkeypatch.setattr(lmdb_lone, "RESERVED_PUTS", False)
    if request.param == "python":
        for name in python:
            module = lmdb_plain if hasattr(lmdb_plain, f"{name}_python") else lmdb_lone
            monkeypatch.setattr(module, name, getattr(module, f"{name}_python"))
    elif not lmdb_plain.NATIVE_GUARD:
        pytest.skip("built without the native row guard (kvtier.backends._rowguard)")
    return str(request.param)


def open_store(path: Path, capacity: int = 8 << 20, **options: Any) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=capacity, path=str(path), sync_mode="fast", **options)
    asyncio.run(backend.open(FMT))
    return backend


def dump(backend: Backend) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]]]:
    """Every record of the store's ``blocks`` and ``index`` databases, in key order (an index
    entry without its access stamp, the time of its save)."""
    env = backend._env  # type: ignore[attr-defined]
    with env.begin() as txn:
        return (
            [(bytes(k), bytes(v)) for k, v in txn.cursor(db=backend._blocks)],  # type: ignore[attr-defined]
            [(bytes(k), bytes(v[8:])) for k, v in txn.cursor(db=backend._index)],  # type: ignore[attr-defined]
        )


def counted_general(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The jobs the general path commits from now on (their record counts)."""
    general: list[int] = []
    real = GroupCommit.submit

    def submit(self: Any, batch: Any) -> Any:
        general.append(len(batch))
        return real(self, batch)

    monkeypatch.setattr(GroupCommit, "submit", submit)
    return general


def while_a_commit_runs(backend: Backend, monkeypatch: pytest.MonkeyPatch, first: tuple[list[Any], list[Any]], second: tuple[list[Any], list[Any]], describe: Callable[[Any], Any]) -> list[list[Any]]:
    """Save the job ``first`` (keys, rows) in a thread, hold its group commit, save ``second``
    in another thread once the first commits, and let both finish once ``second`` waits for the
    group: ``describe(job)`` of each job of each group commit, in order."""
    entered, release = threading.Event(), threading.Event()
    real = backend._commit_jobs  # type: ignore[attr-defined]
    commits = backend._commits  # type: ignore[attr-defined]
    committed: list[list[Any]] = []

    def held(jobs: list[Any]) -> Any:
        committed.append([describe(job) for job in jobs])
        if len(committed) == 1:
            entered.set()
            assert release.wait(30)
        return real(jobs)

    monkeypatch.setattr(commits, "_commit", held)
    one = threading.Thread(target=backend.write_blocks, args=first)
    one.start()
    assert entered.wait(30)
    two = threading.Thread(target=backend.write_blocks, args=second)
    two.start()
    for _ in range(3000):
        if commits._waiting:
            break
        threading.Event().wait(0.01)
    release.set()
    one.join(30)
    two.join(30)
    return committed


def saves(path: Path, monkeypatch: pytest.MonkeyPatch, lone: bool, plan: Callable[[Backend, list[torch.Tensor]], list[Any]], *, capacity: int = 8 << 20) -> tuple[list[Any], dict[str, int], Any, list[int]]:
    """Run ``plan(backend, rows)`` on a new store with the straight line on (``lone``) or off:
    what it returned, the counters it moved, the dump of the store after it, and the jobs the
    general path committed. ``rows``: eight host rows, each saved once first (so the store
    keeps their views, as it keeps those of a pool saved from again and again)."""
    monkeypatch.setattr(lmdb_lone, "LONE_SAVES", lone)
    backend = open_store(path, capacity)
    rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(8)]
    try:
        for i, row in enumerate(rows):
            backend.write_blocks([make_key(1000 + i)], [row])
        backend.delete_blocks([make_key(1000 + i) for i in range(len(rows))])
        general = counted_general(monkeypatch)
        before = {k: v for k, v in backend.stats().items() if k in _STATS}
        got = plan(backend, rows)
        after = {k: v - before[k] for k, v in backend.stats().items() if k in _STATS}
        return got, after, dump(backend), general
    finally:
        monkeypatch.undo()
        asyncio.run(backend.aclose())


def compare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: Callable[[Backend, list[torch.Tensor]], list[Any]], **options: Any) -> tuple[Any, Any]:
    """``plan`` on the straight line and on the general path: the same outcome, counters and
    store; the straight line committed none of its lone jobs through the general path."""
    guard = lmdb_plain.host_view
    fast = saves(tmp_path / "lone", monkeypatch, True, plan, **options)
    monkeypatch.setattr(lmdb_plain, "host_view", guard)  # (undone with the rest: the form under test)
    slow = saves(tmp_path / "general", monkeypatch, False, plan, **options)
    assert fast[:3] == slow[:3]
    return fast, slow


def read_back(backend: Backend, keys: list[bytes]) -> list[Any]:
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    found = backend.read_blocks(keys, out)
    return [bytes(o.numpy()) if hit else None for o, hit in zip(out, found)]


class Passing(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class Dispatching(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class FailingEnv:
    """An environment whose write transactions' puts raise ``error`` (reads as ever)."""

    def __init__(self, env: Any, error: type[lmdb.Error]) -> None:
        self._env, self._error = env, error

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        txn = self._env.begin(*args, **kwargs)
        write = kwargs.get("write", args[2] if len(args) > 2 else False)
        return FailingTxn(txn, self._error) if write else txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


class FailingTxn:
    def __init__(self, txn: Any, error: type[lmdb.Error]) -> None:
        self._txn, self._error = txn, error

    def put(self, *args: Any, **kwargs: Any) -> bool:
        raise self._error("injected")

    def __enter__(self) -> FailingTxn:
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is None:
            self._txn.commit()
        else:
            self._txn.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


class RefusingEnv:
    """An environment whose write transactions cannot begin (``error``; reads as ever), as one
    in LMDB's fatal state after a failed meta page write refuses them."""

    def __init__(self, env: Any, error: type[lmdb.Error]) -> None:
        self._env, self._error = env, error

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("write", args[2] if len(args) > 2 else False):
            raise self._error("injected")
        return self._env.begin(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)
