"""Errors at open name the setting (``tiers[i].path``, ``tiers[i].capacity``), its value and why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvtier
from kvtier import registry
from kvtier.errors import ConfigError, KVTierError

NS = kvtier.Namespace(model_id="open-errors", block_size=16)


def caches() -> list[torch.Tensor]:
    return [torch.zeros(8, 16, 2, 8, 64, dtype=torch.bfloat16) for _ in range(2)]  # 64 KiB blocks


async def open_error(config: dict) -> str:
    with pytest.raises(KVTierError) as info:
        async with kvtier.open(config, kv_caches=caches(), namespace=NS):
            pass
    return str(info.value)


@pytest.mark.parametrize("backend", ["lmdb", "file"])
async def test_a_path_that_is_a_regular_file(tmp_path: Path, backend: str) -> None:
    if backend not in registry.backends.names():
        pytest.skip(f"{backend} is not installed")
    regular = tmp_path / "passwd"
    regular.write_text("root:x:0:0\n")
    message = await open_error({"tiers": [{"backend": "cpu", "capacity": "1MiB"}, {"backend": backend, "capacity": "1GiB", "path": str(regular)}]})
    assert message.startswith(f"tiers[1].path: {str(regular)!r} exists and is not a directory"), message
    assert "Errno" not in message
    assert regular.read_text() == "root:x:0:0\n"


async def test_an_lmdb_tier_too_small_for_one_block_names_the_tier_by_index(tmp_path: Path) -> None:
    message = await open_error({"tiers": [{"backend": "lmdb", "capacity": "100KiB", "path": str(tmp_path / "db")}]})
    assert message.startswith("tiers[0].capacity: 100.0KiB holds no block: one block needs "), message
    assert "bookkeeping" in message and "tiers[lmdb]" not in message and "0 bytes" not in message


async def test_an_lmdb_capacity_that_cannot_be_mapped_says_so(tmp_path: Path) -> None:
    config = {"tiers": [{"backend": "lmdb", "capacity": "1000TiB", "path": str(tmp_path / "db")}]}
    try:
        async with kvtier.open(config, kv_caches=caches(), namespace=NS):
            pass
    except ConfigError as exc:
        message = str(exc)
    else:
        pytest.skip("this system maps 1000 TiB")
    assert message.startswith("tiers[0].capacity: 1000.0TiB cannot be mapped"), message
    assert "lower the capacity" in message


def _overcommit() -> str:
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip()
    except OSError:
        return "?"


@pytest.mark.skipif(_overcommit() not in ("0", "2"), reason="only a heuristic or strict overcommit refuses the allocation at once")
async def test_a_host_memory_capacity_beyond_the_machine_names_the_capacity() -> None:
    message = await open_error({"tiers": [{"backend": "cpu", "capacity": "100TiB", "pin_memory": False}]})
    assert message.startswith("tiers[0].capacity: cannot allocate 100.0TiB"), message
    assert "in all" in message and "lower the capacity" in message
