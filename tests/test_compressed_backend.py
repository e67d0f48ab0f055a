"""The compressed memory tier: conformance suite plus capacity in stored bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records.format import HEADER_SIZE
from kvtier.testing import BackendTests, make_key, random_block


class TestCompressedBackend(BackendTests):
    def make_backend(self, path: Path, capacity: int) -> Backend:
        return registry.backends.get("compressed")(capacity=capacity)


class TestCompressedBackendPlainZstd(BackendTests):
    dtype = "float16"

    def make_backend(self, path: Path, capacity: int) -> Backend:
        return registry.backends.get("compressed")(capacity=capacity, codec={"name": "zstd", "level": 3})


FMT = BlockFormat(block_bytes=32768, dtype="bfloat16")


def _kv_like(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 0.5, 128)
    out = []
    for _ in range(n):
        values = torch.randn(FMT.block_bytes // 2 // 128, 128, generator=g) * scales
        out.append(values.to(torch.bfloat16).view(-1).view(torch.uint8).clone())
    return out


def _open(capacity: int, **options: object) -> Backend:
    backend = registry.backends.get("compressed")(capacity=capacity, **options)
    asyncio.run(backend.open(FMT))
    return backend


def test_more_blocks_fit_than_in_the_cpu_tier() -> None:
    capacity = 16 * FMT.block_bytes
    backend = _open(capacity)
    try:
        data = _kv_like(40, seed=1)
        keys = [make_key(i) for i in range(40)]
        sizes = backend.write_blocks(keys, data)
        stored = [s for s in sizes if s is not None]
        assert len(stored) > 16  # the cpu tier holds exactly 16 blocks in this capacity
        assert sum(stored) <= capacity and backend.stats()["used_bytes"] == sum(stored)
        assert backend.stats()["write_failures"] == sizes.count(None) > 0
        ok = [i for i, s in enumerate(sizes) if s is not None]
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in ok]
        assert backend.read_blocks([keys[i] for i in ok], out) == [True] * len(ok)
        assert all(torch.equal(o, data[i]) for o, i in zip(out, ok))
    finally:
        asyncio.run(backend.aclose())


def test_reserve_bytes_starts_at_worst_case_and_learns() -> None:
    backend = _open(64 * FMT.block_bytes)
    try:
        assert backend.reserve_bytes() == FMT.block_bytes + HEADER_SIZE
        sizes = backend.write_blocks([make_key(i) for i in range(30)], _kv_like(30, seed=2))
        assert all(s is not None for s in sizes)
        reserve = backend.reserve_bytes()
        assert max(s for s in sizes if s is not None) <= reserve < FMT.block_bytes
        assert backend.max_blocks > 64
    finally:
        asyncio.run(backend.aclose())


def test_incompressible_blocks_are_stored_raw_within_header_bound() -> None:
    backend = _open(8 * FMT.block_bytes)
    try:
        noise = torch.randint(0, 256, (FMT.block_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        size = backend.write_blocks([make_key(1)], [noise])[0]
        assert size == FMT.block_bytes + HEADER_SIZE
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8)]
        assert backend.read_blocks([make_key(1)], out) == [True] and torch.equal(out[0], noise)
    finally:
        asyncio.run(backend.aclose())


def test_delete_and_overwrite_keep_the_byte_count_exact() -> None:
    backend = _open(32 * FMT.block_bytes)
    try:
        a, b = _kv_like(2, seed=4)
        backend.write_blocks([make_key(1)], [a])
        backend.write_blocks([make_key(1)], [b])
        assert len(backend) == 1
        used = backend.stats()["used_bytes"]
        backend.delete_blocks([make_key(1), make_key(2)])
        assert backend.stats()["used_bytes"] == 0 < used
        assert backend.stats()["deleted"] == 1
    finally:
        asyncio.run(backend.aclose())


def test_a_damaged_record_is_a_counted_miss() -> None:
    backend = _open(32 * FMT.block_bytes)
    try:
        backend.write_blocks([make_key(1)], _kv_like(1, seed=5))
        record = bytearray(backend._records[make_key(1)])  # type: ignore[attr-defined]
        record[-5] ^= 0xFF
        backend._records[make_key(1)] = bytes(record)  # type: ignore[attr-defined]
        assert backend.read_blocks([make_key(1)], [torch.zeros(FMT.block_bytes, dtype=torch.uint8)]) == [False]
        stats = backend.stats()
        assert stats["corrupt_records"] == 1 and stats["used_bytes"] == 0 and len(backend) == 0
    finally:
        asyncio.run(backend.aclose())


def test_to_dict_carries_the_codec() -> None:
    backend = registry.backends.get("compressed")(capacity="1MiB", codec={"name": "zstd", "level": 5})
    data = backend.to_dict()
    assert data["codec"] == {"name": "zstd", "level": 5, "threads": 0}
    assert type(backend).from_dict(data).codec == backend.codec
    default = registry.backends.get("compressed")(capacity="1MiB")
    assert default.to_dict()["codec"]["name"] == "zstd-shuffle"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "float32"])
def test_round_trip_for_every_dtype(dtype: str) -> None:
    fmt = BlockFormat(block_bytes=8192, dtype=dtype)
    backend = registry.backends.get("compressed")(capacity="1MiB")
    asyncio.run(backend.open(fmt))
    try:
        tdtype = getattr(torch, dtype)
        block = random_block(8192, 7, tdtype if torch.empty((), dtype=tdtype).element_size() >= 2 else torch.uint8)
        if tdtype == torch.float8_e4m3fn:
            block = (torch.randn(8192) * 0.3).to(tdtype).view(torch.uint8)
        backend.write_blocks([make_key(1)], [block])
        out = [torch.zeros(8192, dtype=torch.uint8)]
        assert backend.read_blocks([make_key(1)], out) == [True] and torch.equal(out[0], block)
    finally:
        asyncio.run(backend.aclose())


def test_before_open_the_slot_estimate_starts_at_the_worst_case(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """kvtier config check counts a compressed tier's slots without opening it: raw block + header
    each, as the docs say, not one byte each (4294967296+ slots for 4 GiB)."""
    backend = registry.backends.get("compressed")(capacity="4GiB")
    block = 2 << 20
    assert backend.blocks_for(BlockFormat(block_bytes=block)) == (4 << 30) // (block + HEADER_SIZE)
    from kvtier.tools.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("tiers:\n  - {backend: compressed, capacity: 4GiB}\n")
    assert main(["config", "check", str(cfg), "--block-bytes", "2MiB", "--no-deploy-check"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["0", "compressed", "compressed", "4.0GiB", f"{(4 << 30) // (block + HEADER_SIZE)}+", "lru"] in rows
