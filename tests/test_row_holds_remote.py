"""The remote tiers (``redis``, ``s3``, ``mooncake``) when a row is pointed at other memory
(``row.set_(...)``: a finalizer or weakref callback run by a garbage collection, in any thread)
after its view or address was taken, on real servers.

A transfer straight to or from a row waits on the network, so these tiers do not hold collection
off across it: they keep the row's memory alive for the transfer and check afterwards that the
row still points at it (:mod:`kvtier.backends.remote_rows`). A read whose row moved is a miss; a
save whose row moved is not stored, and its record is removed. Where a record was received
whole before its copy into the row, collection is held off from the view to the copy.

Here the first row moves at the transfer (or at the copy out of a received record), once.
Before, reads answered ``found`` for a row that did not hold the record (redis, s3, mooncake's
whole records) or judged a sound record damaged and deleted it (mooncake's straight reads), and
saves were acknowledged for a record that then read back as damaged (the row's old memory,
overwritten, was what went out)."""

from __future__ import annotations

import asyncio
import gc
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_servers import BUCKET, unique_prefix

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.testing import random_block

_SIZES = [4096, 256 << 10]  # (256 KiB: mooncake's straight transfers to and from the row)
Arm = Callable[[pytest.MonkeyPatch, Callable[[], None]], None]
reached: list[bool] = []  # the armed point was reached (the row moved there unless collection was held off)


def _once(fire: Callable[[], None], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, its first call run after ``fire()``, where a collection could run: a collection
    (which any allocation may start) runs the finalizer that moves the row, unless automatic
    collection is held off there."""
    done = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            if gc.isenabled():
                fire()
            reached.append(True)
        return fn(*args, **kwargs)

    return wrapped


def _patch(target: Any, name: str) -> Arm:
    def arm(monkeypatch: pytest.MonkeyPatch, fire: Callable[[], None]) -> None:
        monkeypatch.setattr(target, name, _once(fire, getattr(target, name)))

    return arm


def _redis_sent_first(monkeypatch: pytest.MonkeyPatch, fire: Callable[[], None]) -> None:
    """Move once the first record is encoded (checksummed), before it goes out."""
    from kvtier.backends import redis_tier

    send = redis_tier.send_one_each

    def send_one_each(wires: Any, requests: Iterator[Any], *args: Any) -> Any:
        def moved_after_first() -> Iterator[Any]:
            for k, item in enumerate(requests):
                if k == 0:
                    if gc.isenabled():
                        fire()
                    reached.append(True)
                yield item

        return send(wires, moved_after_first(), *args)

    monkeypatch.setattr(redis_tier, "send_one_each", send_one_each)


def _open(tier: str, tmp_path: Path, size: int, options: dict[str, Any]) -> Any:
    backend = registry.backends.get(tier)(capacity=256 << 20, sync_interval_s=3600, prefix=unique_prefix(tmp_path), **options)
    digest = hashlib.sha256(str(tmp_path).encode()).digest()
    asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8", namespace_digest=digest)))
    return backend


def _keys(tmp_path: Path) -> list[bytes]:
    return [hashlib.sha256(f"{tmp_path}:{i}".encode()).digest() for i in range(3)]


def _read_through_a_moved_row(backend: Any, tmp_path: Path, size: int, arm: Arm, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys(tmp_path)
    records = [random_block(size, i) for i in range(3)]
    assert None not in backend.write_blocks(keys, records)
    old = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
    rows = [o.view(-1) for o in old]

    def fire() -> None:
        rows[0].set_(torch.zeros(size, dtype=torch.uint8))

    corrupt = backend.counters.corrupt_records
    reached.clear()
    with monkeypatch.context() as m:
        arm(m, fire)
        found = backend.read_blocks(keys, rows)
    assert reached
    assert not found[0] or torch.equal(rows[0], records[0]), "found, but the row does not hold the record"
    assert found[1:] == [True, True] and all(torch.equal(r, b) for r, b in zip(rows[1:], records[1:]))
    assert backend.counters.corrupt_records == corrupt, "a sound record was judged damaged"
    if not found[0]:
        assert backend.stats()["rows_moved"] == 1
    again = [torch.zeros(size, dtype=torch.uint8)]
    assert backend.read_blocks(keys[:1], again) == [True] and torch.equal(again[0], records[0])
    asyncio.run(backend.aclose())


def _save_through_a_moved_row(backend: Any, tmp_path: Path, size: int, arm: Arm, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys(tmp_path)
    first = random_block(size, 99)
    old = [first.clone()] + [random_block(size, i) for i in (1, 2)]
    rows = [o.view(-1) for o in old]

    def fire() -> None:
        rows[0].set_(first.clone())  # the row's bytes, elsewhere; its old memory then reused
        old[0].fill_(7)

    reached.clear()
    with monkeypatch.context() as m:
        arm(m, fire)
        sizes = backend.write_blocks(keys, rows)
    assert reached
    out = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
    found = backend.read_blocks(keys, out)
    assert not found[0] or torch.equal(out[0], first), "the key holds other bytes than the row's"
    assert sizes[0] is None or found[0], "the save was acknowledged, but its record does not read back"
    assert None not in sizes[1:] and found[1:] == [True, True]
    assert all(torch.equal(o, r) for o, r in zip(out[1:], old[1:]))
    if sizes[0] is None:
        assert backend.stats()["rows_moved"] == 1
    asyncio.run(backend.aclose())


def _run(kind: str, backend: Any, tmp_path: Path, size: int, arm: Arm, monkeypatch: pytest.MonkeyPatch) -> None:
    (_read_through_a_moved_row if kind == "read" else _save_through_a_moved_row)(backend, tmp_path, size, arm, monkeypatch)


@pytest.mark.parametrize("size", _SIZES)
@pytest.mark.parametrize("kind", ["read", "save"])
def test_redis_never_serves_nor_stores_through_a_moved_row(redis_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, size: int) -> None:
    from kvtier.backends.redis_wire import Wire

    backend = _open("redis", tmp_path, size, {"url": redis_server.url})
    _run(kind, backend, tmp_path, size, _patch(Wire, "read_into") if kind == "read" else _redis_sent_first, monkeypatch)


@pytest.mark.parametrize("size", _SIZES)
@pytest.mark.parametrize("kind", ["read", "save"])
def test_s3_never_serves_nor_stores_through_a_moved_row(seaweed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, size: int) -> None:
    from kvtier.backends import s3_tier
    from kvtier.backends.s3_tier import S3Backend

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    backend = _open("s3", tmp_path, size, {"endpoint_url": seaweed.endpoint_url, "bucket": BUCKET})
    _run(kind, backend, tmp_path, size, _patch(s3_tier, "decode_record") if kind == "read" else _patch(S3Backend, "_put_records"), monkeypatch)


@pytest.mark.parametrize("size", _SIZES)
@pytest.mark.parametrize("kind", ["read", "save"])
def test_mooncake_never_serves_nor_stores_through_a_moved_row(mooncake_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, size: int) -> None:
    from kvtier.backends import mooncake_tier
    from kvtier.backends.mooncake_session import MooncakeSession

    backend = _open("mooncake", tmp_path, size, mooncake_store.tier_options())
    if kind == "read":
        arm = _patch(MooncakeSession, "get_parts") if size >= mooncake_tier.ZERO_COPY_MIN_BYTES else _patch(mooncake_tier, "decode_record")
    else:  # (a small block is copied into staging under a hold before any put: the move then changes nothing)
        arm = _patch(MooncakeSession, "put_parts")
    _run(kind, backend, tmp_path, size, arm, monkeypatch)
