"""The remote tiers (``redis``, ``s3``, ``mooncake``) when a row is pointed at memory of another
size (``row.set_(...)``: a finalizer or weakref callback run by a garbage collection, in any
thread) after the job's checks and before its transfer, on real servers.

The job's checks (a 1-D ``uint8`` row of the block's size) ran before the row moved, so what the
transfer finds is no longer a block: a read is a miss (the row did not get the record, which
stays stored), never bytes written past the row's end, and a save is not stored.

The row is pointed at the first bytes of a larger tensor (the canary), so bytes written past
the row's end show in the canary instead of corrupting the heap."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends.remote_tier import RemoteRecordBackend
from s3_servers import BUCKET, unique_prefix

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.testing import random_block

_SIZES = [4096, 256 << 10]  # (256 KiB: mooncake's straight transfers to and from the row)
_SHORT = 64  # the moved row's length


def _open(tier: str, tmp_path: Path, size: int, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    if tier == "redis":
        options = {"url": request.getfixturevalue("redis_server").url}
    elif tier == "s3":
        seaweed = request.getfixturevalue("seaweed")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
        options = {"endpoint_url": seaweed.endpoint_url, "bucket": BUCKET}
    else:
        options = request.getfixturevalue("mooncake_store").tier_options()
    backend = registry.backends.get(tier)(capacity=256 << 20, sync_interval_s=3600, prefix=unique_prefix(tmp_path), **options)
    digest = hashlib.sha256(str(tmp_path).encode()).digest()
    asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8", namespace_digest=digest)))
    return backend


def _keys(tmp_path: Path, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tmp_path}:{i}".encode()).digest() for i in range(n)]


def _move_once_after_checks(monkeypatch: pytest.MonkeyPatch, row: torch.Tensor, canary: torch.Tensor) -> list[bool]:
    """Point ``row`` at the canary's first bytes once the job's checks are over (its servers'
    shares about to run); the list says whether that point was reached."""
    reached: list[bool] = []
    run_io = RemoteRecordBackend._run_io

    def moved(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not reached:
            reached.append(True)
            row.set_(canary[:_SHORT])
        return run_io(self, *args, **kwargs)

    monkeypatch.setattr(RemoteRecordBackend, "_run_io", moved)
    return reached


@pytest.mark.parametrize("size", _SIZES)
@pytest.mark.parametrize("tier", ["redis", "s3", "mooncake"])
def test_a_read_into_a_row_resized_after_the_checks_is_a_miss(tier: str, size: int, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(tier, tmp_path, size, request, monkeypatch)
    keys = _keys(tmp_path, 3)
    records = [random_block(size, i) for i in range(3)]
    assert None not in backend.write_blocks(keys, records)
    rows = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
    canary = torch.full((2 * size,), 5, dtype=torch.uint8)
    corrupt = backend.counters.corrupt_records
    with monkeypatch.context() as m:
        reached = _move_once_after_checks(m, rows[0], canary)
        found = backend.read_blocks(keys, rows)
    assert reached
    assert torch.equal(canary[_SHORT:], torch.full((2 * size - _SHORT,), 5, dtype=torch.uint8)), "the read wrote past the row's end"
    assert found == [False, True, True]
    assert all(torch.equal(r, b) for r, b in zip(rows[1:], records[1:]))
    assert backend.counters.corrupt_records == corrupt, "a sound record was judged damaged"
    assert backend.stats()["rows_moved"] == 1
    again = [torch.zeros(size, dtype=torch.uint8)]
    assert backend.read_blocks(keys[:1], again) == [True] and torch.equal(again[0], records[0]), "the record was lost"
    asyncio.run(backend.aclose())


@pytest.mark.parametrize("size", _SIZES)
@pytest.mark.parametrize("tier", ["redis", "s3", "mooncake"])
def test_a_save_from_a_row_resized_after_the_checks_is_not_stored(tier: str, size: int, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(tier, tmp_path, size, request, monkeypatch)
    rows = [random_block(size, i) for i in range(3)]
    canary, keys = random_block(2 * size, 9), _keys(tmp_path, 3)
    with monkeypatch.context() as m:
        reached = _move_once_after_checks(m, rows[0], canary)
        sizes = backend.write_blocks(keys, rows)
    assert reached
    assert sizes[0] is None, "a save of a row that is no longer a block was acknowledged"
    assert None not in sizes[1:]
    assert backend.stats()["rows_moved"] == 1
    out = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
    assert backend.read_blocks(keys, out)[1:] == [True, True]
    assert all(torch.equal(o, r) for o, r in zip(out[1:], rows[1:]))
    asyncio.run(backend.aclose())


@pytest.mark.parametrize("layout", ["short", "strided"])
@pytest.mark.parametrize(("tier", "size"), [("redis", 4096), ("redis", 256 << 10), ("mooncake", 256 << 10)])
def test_a_row_pointed_at_part_of_its_memory_during_the_transfer_is_a_miss(tier: str, size: int, layout: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record lands in the row's memory, and the row is then pointed at the same address
    with another size or stride: the row does not hold the record, whatever its address says."""
    from kvtier.backends.mooncake_session import MooncakeSession
    from kvtier.backends.redis_wire import Wire

    backend = _open(tier, tmp_path, size, request, monkeypatch)
    keys = _keys(tmp_path, 2)
    records = [random_block(size, i) for i in range(2)]
    assert None not in backend.write_blocks(keys, records)
    pool = torch.zeros(2 * size, dtype=torch.uint8)
    rows = [pool[:size], torch.zeros(size, dtype=torch.uint8)]
    shape, stride = ((_SHORT,), (1,)) if layout == "short" else ((size,), (2,))
    target, name = (Wire, "read_into") if tier == "redis" else (MooncakeSession, "get_parts")
    transfer = getattr(target, name)
    reached: list[bool] = []

    def moved(*args: Any, **kwargs: Any) -> Any:
        try:
            return transfer(*args, **kwargs)
        finally:
            if not reached:
                reached.append(True)
                rows[0].set_(pool.untyped_storage(), 0, shape, stride)

    with monkeypatch.context() as m:
        m.setattr(target, name, moved)
        found = backend.read_blocks(keys, rows)
    assert reached
    assert not found[0] or torch.equal(rows[0], records[0]), "found, but the row does not hold the record"
    assert found[1] and torch.equal(rows[1], records[1])
    assert backend.stats()["rows_moved"] == 1
    asyncio.run(backend.aclose())


def test_a_redis_reply_for_a_device_row_is_received_with_collection_on(redis_server: Any, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row off the host gets its record through staging of the tier's own: no view of the row
    is in use while the reply comes in, so collection is not held off across that network wait."""
    import gc

    from kvtier.backends.redis_wire import Wire

    from kvtier import devices

    size = 4096
    backend = _open("redis", tmp_path, size, request, monkeypatch)
    keys = _keys(tmp_path, 2)
    records = [random_block(size, i) for i in range(2)]
    assert None not in backend.write_blocks(keys, records)
    rows = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
    device_row = rows[0]
    collecting: list[bool] = []
    read_into = Wire.read_into

    def recorded(*args: Any, **kwargs: Any) -> Any:
        collecting.append(gc.isenabled())
        return read_into(*args, **kwargs)

    assert gc.isenabled()
    with monkeypatch.context() as m:
        m.setattr(devices, "locate", lambda t: torch.device("cuda", 0) if t is device_row else torch.device("cpu"))
        m.setattr(Wire, "read_into", recorded)
        found = backend.read_blocks(keys, rows)
    assert found == [True, True] and all(torch.equal(r, b) for r, b in zip(rows, records))
    assert collecting and all(collecting), "a reply was received with collection held off"
    asyncio.run(backend.aclose())


@pytest.mark.parametrize(("tier", "size"), [("redis", 4096), ("redis", 256 << 10), ("s3", 4096), ("mooncake", 256 << 10)])
def test_a_record_of_memory_the_row_left_before_its_checksum_is_never_sent(tier: str, size: int, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row is moved (its bytes with it) and its old memory reused before the record's
    checksum is taken over that memory: such a record is consistent, so a reader that finds it
    before the save's own removal gets bytes the row never had. It must not be sent at all."""
    backend = _open(tier, tmp_path, size, request, monkeypatch)
    keys = _keys(tmp_path, 2)
    first = random_block(size, 99)
    old = [first.clone(), random_block(size, 1)]
    rows = [o.view(-1) for o in old]
    encode = type(backend)._encode_one
    seen: list[Any] = []

    def encoded(self: Any, key: bytes, block: torch.Tensor) -> Any:
        if key == keys[0] and not seen:
            seen.append("moved")
            rows[0].set_(first.clone())  # the row's bytes, elsewhere; its old memory then reused
            old[0].fill_(7)
        return encode(self, key, block)

    delete = type(backend)._delete

    def deleted(self: Any, doomed: list[bytes]) -> Any:
        out = [torch.zeros(size, dtype=torch.uint8)]
        if keys[0] in doomed:  # what a reader finds before the removal
            seen.append((self.read_blocks(keys[:1], out)[0], torch.equal(out[0], first)))
        return delete(self, doomed)

    with monkeypatch.context() as m:
        m.setattr(type(backend), "_encode_one", encoded)
        m.setattr(type(backend), "_delete", deleted)
        sizes = backend.write_blocks(keys, rows)
    assert seen and seen[0] == "moved"
    assert sizes[0] is None and sizes[1] is not None
    assert all(found is False or same for found, same in seen[1:]), "a reader was served bytes the row never had"
    asyncio.run(backend.aclose())


def test_each_record_is_sent_under_its_own_key_whatever_the_leases_answer_later(seaweed: Any, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row that leaves its kept memory and comes back (its lease answers "not held", then
    "held"): the records a share sends stay paired with their keys."""
    from kvtier.backends.remote_rows import RowLease

    size = 4096
    backend = _open("s3", tmp_path, size, request, monkeypatch)
    keys = _keys(tmp_path, 3)
    rows = [random_block(size, i) for i in range(3)]
    held = RowLease.held
    answers: list[bool] = []

    def flickers(self: RowLease) -> bool:
        if self.row is rows[0] and not answers:
            answers.append(False)
            return False
        return held(self)

    with monkeypatch.context() as m:
        m.setattr(RowLease, "held", flickers)
        sizes = backend.write_blocks(keys, rows)
    assert answers and sizes[0] is None and None not in sizes[1:]
    out = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
    found = backend.read_blocks(keys, out)
    for k in range(3):
        assert not found[k] or torch.equal(out[k], rows[k]), f"key {k} holds another row's bytes"
    assert found[1:] == [True, True]
    asyncio.run(backend.aclose())
