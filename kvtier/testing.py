"""A conformance suite for backends, for kvtier's own and for plugin authors.

Subclass :class:`BackendTests` in a pytest module and implement ``make_backend``::

    from kvtier.testing import BackendTests

    class TestMyBackend(BackendTests):
        def make_backend(self, path, capacity):
            return MyBackend(capacity=capacity, path=str(path / "store"))

Every test opens the backend with a small :class:`~kvtier.backend.BlockFormat`, drives it through
the protocol and asserts the contract in :mod:`kvtier.backend`. Set ``persistent = True`` (taken
from the backend class by default) to also check that a reopened backend serves what an earlier
instance stored.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ClosedError, ConfigError, LayoutError

__all__ = ["BackendTests", "make_key", "random_block"]


def make_key(i: int) -> bytes:
    """A deterministic 32-byte key for tests."""
    return hashlib.sha256(b"kvtier-test-key" + i.to_bytes(8, "little")).digest()


def random_block(nbytes: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A 1-D uint8 block whose bytes look like KV activations of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point and itemsize >= 2:
        values = (torch.randn(nbytes // itemsize, generator=g) * 0.5).to(dtype)
        return values.view(torch.uint8).clone()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class BackendTests:
    """The protocol every backend must honour. Subclasses implement :meth:`make_backend`."""

    block_bytes: int = 4096
    capacity_blocks: int = 32
    dtype: str = "bfloat16"
    #: ``None``: take ``persistent`` from the backend class.
    persistent: bool | None = None

    def make_backend(self, path: Path, capacity: int) -> Backend:
        raise NotImplementedError("subclasses of BackendTests implement make_backend")

    # -- helpers ---------------------------------------------------------------------------
    def block_format(self) -> BlockFormat:
        return BlockFormat(
            block_bytes=self.block_bytes,
            dtype=self.dtype,
            namespace_digest=hashlib.sha256(b"kvtier-conformance").digest(),
            namespace={"model_id": "conformance"},
        )

    @contextmanager
    def opened(self, path: Path, capacity: int | None = None) -> Iterator[Backend]:
        cap = capacity if capacity is not None else self.block_bytes * self.capacity_blocks
        backend = self.make_backend(path, cap)
        asyncio.run(backend.open(self.block_format()))
        try:
            yield backend
        finally:
            asyncio.run(backend.aclose())

    def blocks(self, n: int, seed: int = 0) -> list[torch.Tensor]:
        return [random_block(self.block_bytes, seed * 100003 + i) for i in range(n)]

    def empty(self, n: int) -> list[torch.Tensor]:
        return [torch.zeros(self.block_bytes, dtype=torch.uint8) for _ in range(n)]

    # -- the contract ----------------------------------------------------------------------
    def test_constructor_does_no_io(self, tmp_path: Path) -> None:
        before = sorted(p.name for p in tmp_path.iterdir())
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        assert not backend.is_open
        assert sorted(p.name for p in tmp_path.iterdir()) == before

    def test_round_trip_is_byte_exact(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            keys = [make_key(i) for i in range(8)]
            data = self.blocks(8)
            sizes = backend.write_blocks(keys, data)
            assert all(isinstance(s, int) and s > 0 for s in sizes)
            out = self.empty(8)
            assert backend.read_blocks(keys, out) == [True] * 8
            for got, want in zip(out, data):
                assert torch.equal(got, want)

    def test_read_in_other_order_and_subset(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            keys = [make_key(i) for i in range(6)]
            data = self.blocks(6, seed=3)
            backend.write_blocks(keys, data)
            order = [4, 0, 5]
            out = self.empty(3)
            assert backend.read_blocks([keys[i] for i in order], out) == [True] * 3
            for got, i in zip(out, order):
                assert torch.equal(got, data[i])

    def test_missing_key_is_a_miss(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            backend.write_blocks([make_key(1)], self.blocks(1))
            out = self.empty(2)
            sentinel = out[1].clone()
            assert backend.read_blocks([make_key(1), make_key(2)], out) == [True, False]
            assert torch.equal(out[1], sentinel)

    def test_delete_makes_a_miss_and_keeps_others(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            keys = [make_key(i) for i in range(3)]
            data = self.blocks(3, seed=5)
            backend.write_blocks(keys, data)
            backend.delete_blocks([keys[1], make_key(99)])
            out = self.empty(3)
            assert backend.read_blocks(keys, out) == [True, False, True]
            assert torch.equal(out[0], data[0]) and torch.equal(out[2], data[2])

    def test_rewrite_after_delete_serves_new_bytes(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            key = make_key(7)
            first, second = self.blocks(2, seed=9)
            backend.write_blocks([key], [first])
            backend.delete_blocks([key])
            backend.write_blocks([key], [second])
            out = self.empty(1)
            assert backend.read_blocks([key], out) == [True]
            assert torch.equal(out[0], second)

    def test_wrong_block_shape_is_rejected_before_any_write(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            good = self.blocks(1)[0]
            bad = torch.zeros(self.block_bytes + 1, dtype=torch.uint8)
            with pytest.raises(LayoutError):
                backend.write_blocks([make_key(1), make_key(2)], [good, bad])
            assert backend.read_blocks([make_key(1)], self.empty(1)) == [False]

    def test_counters_track_io(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            keys = [make_key(i) for i in range(3)]
            backend.write_blocks(keys, self.blocks(3))
            backend.read_blocks(keys[:2], self.empty(2))
            stats = backend.stats()
            assert stats["blocks_written"] == 3
            assert stats["blocks_read"] == 2

    def test_capacity_below_one_block_is_a_config_error(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes // 2)
        with pytest.raises(ConfigError, match="capacity"):
            asyncio.run(backend.open(self.block_format()))

    def test_calls_after_close_raise(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        asyncio.run(backend.open(self.block_format()))
        asyncio.run(backend.aclose())
        with pytest.raises(ClosedError):
            backend.write_blocks([make_key(1)], self.blocks(1))
        with pytest.raises(ClosedError):
            backend.read_blocks([make_key(1)], self.empty(1))

    def test_async_forms_match_blocking_ones(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        data = self.blocks(2, seed=11)
        keys = [make_key(20), make_key(21)]

        async def scenario() -> list[bool]:
            async with backend:
                await backend.open(self.block_format())
                await backend.write(keys, data)
                out = self.empty(2)
                found = await backend.read(keys, out)
                assert all(torch.equal(a, b) for a, b in zip(out, data))
                await backend.delete(keys[:1])
                return found + await backend.read(keys, self.empty(2))

        assert asyncio.run(scenario()) == [True, True, False, True]

    def test_to_dict_round_trip(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        data = backend.to_dict()
        assert data["backend"] == backend.name
        again = type(backend).from_dict(data)
        assert again.to_dict() == data

    def test_reopen_serves_earlier_blocks_if_persistent(self, tmp_path: Path) -> None:
        persistent = self.persistent
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        if persistent is None:
            persistent = type(backend).persistent
        if not persistent:
            pytest.skip("backend is not persistent")
        keys = [make_key(i) for i in range(4)]
        data = self.blocks(4, seed=13)
        with self.opened(tmp_path) as first:
            assert all(s is not None for s in first.write_blocks(keys, data))
        with self.opened(tmp_path) as second:
            listed: dict[bytes, Any] = {r.key: r for r in second.scan()}
            assert set(listed) == set(keys)
            out = self.empty(4)
            assert second.read_blocks(keys, out) == [True] * 4
            assert all(torch.equal(a, b) for a, b in zip(out, data))
