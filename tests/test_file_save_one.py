"""The ``file`` tier's save of a job of one plain record in one straight line
(``FileSaves._save_one`` and ``file_commit.commit_one``) against the general save (``SAVE_ONE``
off): the same files byte for byte, the same sizes, counters and room, and the same outcome
when the capacity is full or a step fails (the temporary file's open, its sync, the rename, the
directory's sync)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_commit, file_saves

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import DiskError
from kvtier.records.codec import NoneCodec
from kvtier.records.record import encode_record
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
RECORD = 20480  # a record's stored bytes: header and payload, in 4 KiB filesystem blocks


def _open(path: Path, **options: Any) -> Backend:
    backend = registry.backends.get("file")(path=str(path), **{"capacity": 8 << 20, **options})
    asyncio.run(backend.open(FMT))
    return backend


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.rglob("*") if p.is_file() and (p.suffix in (".kvb", ".tmp"))}


def _both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Callable[[Backend], Any], **options: Any
) -> dict[bool, tuple[Any, dict[str, Any], dict[str, bytes], int, int]]:
    """``run(backend)`` on a fresh store by each path: its result (or the type of what it raised),
    the store's counters, its record and temporary files, its room in use, and how many jobs
    took the straight line."""
    seen: dict[bool, tuple[Any, dict[str, Any], dict[str, bytes], int, int]] = {}
    real = file_commit.commit_one
    for straight in (True, False):
        calls: list[int] = []
        monkeypatch.setattr(file_saves, "SAVE_ONE", straight)
        monkeypatch.setattr(file_saves, "commit_one", lambda *a, calls=calls, **k: calls.append(1) or real(*a, **k))
        root = tmp_path / ("straight" if straight else "general")
        backend = _open(root, **options)
        try:
            try:
                result: Any = run(backend)
            except Exception as exc:  # compared by type
                result = type(exc)
            stats = {k: v for k, v in backend.stats().items() if k in ("blocks_written", "bytes_written", "write_failures")}
            used = backend._used  # type: ignore[attr-defined]
        finally:
            monkeypatch.undo()  # (the failure injected: the close and its table are not failed)
            asyncio.run(backend.aclose())
        seen[straight] = (result, stats, _files(root), used, len(calls))
    return seen


@pytest.mark.parametrize("sync_mode", ["durable", "fast"])
def test_jobs_of_one_are_saved_as_the_general_path_saves_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync_mode: str) -> None:
    keys = [make_key(i) for i in range(5)]
    data = [random_block(FMT.block_bytes, 40 + i) for i in range(5)]

    def run(backend: Backend) -> Any:
        sizes = [backend.write_blocks([k], [d.clone()]) for k, d in zip(keys, data)]
        sizes.append(backend.write_blocks([keys[0]], [data[1].clone()]))  # saved again: its room is not counted twice
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 5
        assert torch.equal(out[0], data[1]) and all(torch.equal(o, d) for o, d in zip(out[1:], data[1:]))
        return sizes

    seen = _both(tmp_path, monkeypatch, run, sync_mode=sync_mode)
    assert seen[True][4] == 6 and seen[False][4] == 0  # every job took the straight line, or none did
    assert seen[True][:4] == seen[False][:4]
    assert seen[True][0] == [[RECORD]] * 6 and seen[True][3] == 5 * RECORD
    assert seen[True][1] == {"blocks_written": 6, "bytes_written": 6 * (32 + FMT.block_bytes), "write_failures": 0}
    files = seen[True][2]
    assert len(files) == 5  # no temporary file left
    head, payload = encode_record(keys[3], data[3].numpy().data, NoneCodec(), 1, None)  # bfloat16: dtype code 1
    assert files[keys[3].hex() + ".kvb"] == head + bytes(payload)


def test_a_full_store_refuses_a_job_of_one_as_the_general_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(backend: Backend) -> Any:
        return [backend.write_blocks([make_key(i)], [random_block(FMT.block_bytes, i)]) for i in range(4)]

    seen = _both(tmp_path, monkeypatch, run, capacity=2 * RECORD + 100)
    assert seen[True][4] == 2 and seen[False][4] == 0  # (the refused ones return before a commit)
    assert seen[True][:4] == seen[False][:4]
    assert seen[True][0] == [[RECORD], [RECORD], [None], [None]]
    assert seen[True][1]["write_failures"] == 2 and len(seen[True][2]) == 2


def _failing(name: str, when: Callable[..., bool]) -> Callable[[pytest.MonkeyPatch], None]:
    def install(monkeypatch: pytest.MonkeyPatch) -> None:
        real = getattr(os, name)

        def fail(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs):
                raise OSError(5, f"injected {name} failure")
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, fail)

    return install


FAILURES = {
    "open": _failing("open", lambda path, *a, **k: str(path).endswith(".tmp")),
    "file sync": _failing("fdatasync", lambda fd: True),
    "rename": _failing("replace", lambda *a, **k: True),
}


@pytest.mark.parametrize("step", sorted(FAILURES))
def test_a_failed_step_fails_the_job_of_one_as_it_fails_the_general_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """The key is a write failure, its room is given back (the next save fits a store of one
    record), and no temporary file is left."""
    first, second = make_key(1), make_key(2)

    def run(backend: Backend) -> Any:
        mp = pytest.MonkeyPatch()
        FAILURES[step](mp)
        try:
            failed = backend.write_blocks([first], [random_block(FMT.block_bytes, 1)])
        finally:
            mp.undo()
        return failed, backend.write_blocks([second], [random_block(FMT.block_bytes, 2)])

    seen = _both(tmp_path, monkeypatch, run, capacity=RECORD + 100)
    assert seen[True][4] == 2 and seen[False][4] == 0
    assert seen[True][:4] == seen[False][:4]
    assert seen[True][0] == ([None], [RECORD])
    assert seen[True][1]["write_failures"] == 1 and list(seen[True][2]) == [second.hex() + ".kvb"]


def test_a_failed_directory_sync_raises_and_the_record_keeps_its_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_key(1)
    fail_dir_sync = _failing("fsync", lambda fd: True)

    def run(backend: Backend) -> Any:
        mp = pytest.MonkeyPatch()
        fail_dir_sync(mp)
        try:
            return backend.write_blocks([key], [random_block(FMT.block_bytes, 1)])
        finally:
            mp.undo()

    seen = _both(tmp_path, monkeypatch, run)
    assert seen[True][:4] == seen[False][:4]
    assert seen[True][0] is DiskError and seen[True][3] == RECORD
    assert list(seen[True][2]) == [key.hex() + ".kvb"] and seen[True][1]["blocks_written"] == 0
