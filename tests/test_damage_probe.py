"""Damage probe: a persistent store damaged page by page must open, and serve right bytes or miss.

For each tier (``lmdb``, ``file``) and block size (1 KiB: values inside LMDB's leaf pages;
64 KiB: overflow pages), a small store is written through the public API, then every 4 KiB
page of every file it holds is damaged in turn, three ways: one bit flipped in the page's first
64 bytes (the page header and the first node pointers), the page zeroed, and the file
truncated at the page's start. Each damaged copy is opened with ``kvtier.open`` and loaded in a
child process, so a crash (LMDB aborts on a failed assertion; a mapped page past the end of a
file faults) is counted rather than taking the test run down. The test asserts zero signals,
zero exceptions and zero wrong bytes over all trials.

One child runs many trials (it reports each before and after it runs); after a crash the parent
starts a new child at the next trial, so the whole sweep costs a few interpreter starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

PAGE = 4096
MODES = ("flip", "zero", "truncate")
WIDTH_FLOATS = {1024: 256, 65536: 16384}  # one engine block of that many bytes (float32)
BLOCKS = {1024: 8, 65536: 2}  # blocks stored per probe store: a few pages of each kind
ENGINE_BLOCKS = 16


def _config(kind: str, root: Path) -> dict[str, Any]:
    tier: dict[str, Any] = {"backend": kind, "capacity": "8MiB", "path": str(root / "tier")}
    if kind == "lmdb":
        tier["sync_mode"] = "fast"  # the probe damages files; how they were synced does not matter
    return {"tiers": [tier], "namespace": {"model_id": "damage-probe"}, "flush_on_close_s": 0}


def _caches(block_bytes: int) -> list[Any]:
    import torch

    return [torch.zeros((ENGINE_BLOCKS, WIDTH_FLOATS[block_bytes]), dtype=torch.float32)]


def _expected(block_bytes: int, i: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1000 + i)
    return torch.rand(WIDTH_FLOATS[block_bytes], generator=gen)


def _keys(store: Any, n: int) -> list[bytes]:
    import kvtier

    return kvtier.block_keys(list(range(16 * n)), block_size=16, namespace=store.namespace)


async def _write_store(kind: str, block_bytes: int, root: Path) -> None:
    import kvtier

    caches = _caches(block_bytes)
    n = BLOCKS[block_bytes]
    for i in range(n):
        caches[0][i] = _expected(block_bytes, i)
    async with kvtier.open(_config(kind, root), kv_caches=caches) as store:
        assert await store.save(_keys(store, n), list(range(n))) == n


async def _open_and_load(kind: str, block_bytes: int, root: Path) -> dict[str, int]:
    """One trial in the child: open the damaged store, load every key, count bad bytes."""
    import kvtier

    caches = _caches(block_bytes)
    n = BLOCKS[block_bytes]
    async with kvtier.open(_config(kind, root), kv_caches=caches) as store:
        caches[0].fill_(-1.0)
        filled = await store.load(_keys(store, n), list(range(n)), promote=False)
        wrong = sum(not bool((caches[0][i] == _expected(block_bytes, i)).all()) for i in range(filled))
        # Writes walk the free-page tree: a damaged one must not abort them either.
        fresh = kvtier.block_keys(list(range(10**6, 10**6 + 32)), block_size=16, namespace=store.namespace)
        await store.save(fresh, [0, 1])
    return {"filled": filled, "wrong": wrong}


def _damage(path: Path, page: int, mode: str) -> None:
    offset = page * PAGE
    if mode == "truncate":
        os.truncate(path, offset)
        return
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(PAGE))
        if not data:  # an empty file (the tenant tag log before any tag) has no byte to damage
            return
        if mode == "zero":
            data = bytearray(len(data))
        else:
            rng = random.Random(f"{path.name}:{page}")
            data[rng.randrange(min(64, len(data)))] ^= 1 << rng.randrange(8)
        f.seek(offset)
        f.write(data)


def _trials(pristine: Path) -> list[tuple[str, int, str]]:
    """(file relative to the store, page, mode) for every page of every file the store holds."""
    out = []
    for path in sorted(p for p in pristine.rglob("*") if p.is_file() and p.name not in ("kvtier.lock", "lock.mdb")):
        pages = max(1, -(-path.stat().st_size // PAGE))
        rel = str(path.relative_to(pristine))
        out += [(rel, page, mode) for page in range(pages) for mode in MODES]
    return out


def _child(kind: str, block_bytes: int, pristine: Path, work: Path, trials_file: Path, start: int) -> None:
    warnings.simplefilter("ignore")
    trials = json.loads(trials_file.read_text())
    for i in range(start, len(trials)):
        rel, page, mode = trials[i]
        print(f"BEGIN {i}", flush=True)
        trial = work / f"t{i}"
        shutil.copytree(pristine, trial)
        _damage(trial / rel, page, mode)
        try:
            result = asyncio.run(_open_and_load(kind, block_bytes, trial))
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        shutil.rmtree(trial, ignore_errors=True)
        print(f"END {i} {json.dumps(result)}", flush=True)


def run_probe(kind: str, block_bytes: int, root: Path) -> dict[str, Any]:
    """Write a store, damage it every way, and count what went wrong (see the module doc)."""
    pristine = root / "pristine"
    asyncio.run(_write_store(kind, block_bytes, pristine))
    trials = _trials(pristine)
    trials_file = root / "trials.json"
    trials_file.write_text(json.dumps(trials))
    work = root / "work"
    work.mkdir()
    results: dict[int, dict[str, Any]] = {}
    start = 0
    while start < len(trials):
        args = [sys.executable, __file__, kind, str(block_bytes), str(pristine), str(work), str(trials_file), str(start)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
        began = None
        for line in proc.stdout.splitlines():
            word, _, rest = line.partition(" ")
            if word == "BEGIN":
                began = int(rest)
            elif word == "END":
                index, _, payload = rest.partition(" ")
                results[int(index)] = json.loads(payload)
                began = None
        if proc.returncode == 0:
            break
        if began is None:  # died outside a trial: report it rather than loop
            raise AssertionError(f"probe child failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
        results[began] = {"signal": -proc.returncode, "stderr": proc.stderr[-300:]}
        shutil.rmtree(work / f"t{began}", ignore_errors=True)
        start = began + 1
    counts = {"trials": len(trials), "signals": 0, "exceptions": 0, "wrong_blocks": 0, "missed_blocks": 0}
    bad = []
    for i, (rel, page, mode) in enumerate(trials):
        r = results.get(i, {"error": "no result"})
        if "signal" in r:
            counts["signals"] += 1
        elif "error" in r:
            counts["exceptions"] += 1
        else:
            counts["wrong_blocks"] += r["wrong"]
            counts["missed_blocks"] += BLOCKS[block_bytes] - r["filled"]
            if not r["wrong"]:
                continue
        bad.append((rel, page, mode, r))
    counts["bad"] = bad[:10]
    return counts


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]), int(sys.argv[6]))
else:
    import pytest

    @pytest.mark.parametrize("block_bytes", [1024, 65536], ids=["1KiB", "64KiB"])
    @pytest.mark.parametrize("kind", ["lmdb", "file"])
    def test_no_damaged_page_crashes_an_open_or_serves_wrong_bytes(kind: str, block_bytes: int, tmp_path: Path) -> None:
        counts = run_probe(kind, block_bytes, tmp_path)
        print(f"damage probe {kind} {block_bytes}: {counts}")
        assert counts["trials"] >= 3 * BLOCKS[block_bytes]  # every page of every file was damaged
        assert (counts["signals"], counts["exceptions"], counts["wrong_blocks"]) == (0, 0, 0), counts["bad"]
