"""The read transaction an ``lmdb`` tier's direct lookups keep between jobs
(``backends/_lmdbkeep.c``): renewed by each job, so a job reads every commit made before it (an
overwrite's new bytes, a deletion's miss), as python-lmdb's transactions and the general path
read them; reset between jobs, so it pins no snapshot; aborted by the store's close; never
touched by a fork's child; and one kept however many threads read at once. The outcomes beside
the general path on damaged, missing and closed cases are ``test_lmdb_direct``'s and
``test_lmdb_one_read``'s, whose direct routes read in this transaction."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_direct, lmdb_one, lmdb_plain

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.testing import make_key, random_block

pytestmark = pytest.mark.skipif(
    lmdb_plain._rowguard is None or not hasattr(lmdb_plain._rowguard, "direct_kept") or lmdb.__version__ != lmdb_direct.LAYOUT_VERSION,
    reason="needs the native row guard and the python-lmdb the direct lookups were written for",
)

FMT = BlockFormat(block_bytes=4096, dtype="uint8")
KEYS = [make_key(i) for i in range(4)]


def _open(path: Path) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path))
    asyncio.run(backend.open(FMT))
    return backend


def _kept(backend: Backend) -> bool:
    return bool(lmdb_plain._rowguard.direct_kept(backend._direct))  # type: ignore[union-attr, attr-defined]


def _jobs() -> int:
    return int(lmdb_plain._rowguard.direct_jobs())  # type: ignore[union-attr]


def _slots(env: lmdb.Environment) -> list[str]:
    """This process's reader slots in ``env``'s table: each one's txnid column (``-``: reset)."""
    rows = [line.split() for line in env.readers().splitlines()[1:]]
    return [row[2] for row in rows if row and row[0] == str(os.getpid())]


def _read(backend: Backend, keys: list[bytes], rows: list[torch.Tensor]) -> tuple[list[bool], list[bytes], dict[str, int]]:
    for row in rows:
        row.fill_(7)
    found = backend.read_blocks(keys, rows)
    stats = backend.stats()
    return found, [bytes(row.numpy()) for row in rows], {k: stats[k] for k in ("blocks_read", "read_misses")}


@pytest.mark.parametrize("n", [1, 3])
def test_a_kept_transaction_reads_each_commit_made_before_its_job_as_the_general_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Written, read (the transaction kept), overwritten, read, deleted, read: each read gives
    the bytes and misses of the last commit, in the kept transaction renewed after it (the
    direct jobs counted), and the general path's read of the same store right after gives the
    same."""
    backend = _open(tmp_path / "store")
    try:
        keys = KEYS[:n]
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        first = [random_block(FMT.block_bytes, i) for i in range(n)]
        second = [random_block(FMT.block_bytes, 100 + i) for i in range(n)]
        backend.write_blocks(keys, first)
        backend.read_blocks(keys, rows)  # the rows seen (a new row is the general path's)
        backend.read_blocks(keys, rows)
        assert _kept(backend)
        steps = [("first", lambda: None), ("second", lambda: backend.write_blocks(keys, second)), ("gone", lambda: backend.delete_blocks(keys[:1]))]
        for name, change in steps:
            change()
            # A save that grew the data file: the next read notes it (the file guard's Python
            # lines, python-lmdb's transaction); the kept one stays reset and untouched.
            _read(backend, keys, rows)
            jobs = _jobs()
            direct = _read(backend, keys, rows)
            assert _jobs() == jobs + 1 and _kept(backend), name  # read in the kept transaction
            with monkeypatch.context() as patch:
                patch.setattr(lmdb_one, "STRAIGHT_READS", False)
                general = _read(backend, keys, rows)
            assert direct[:2] == general[:2], name
            want = {"first": first, "second": second, "gone": second}[name]
            for i, (hit, got) in enumerate(zip(direct[0], direct[1])):
                if name == "gone" and i == 0:
                    assert hit is False
                else:
                    assert hit is True and got == bytes(want[i].numpy()), (name, i)
    finally:
        asyncio.run(backend.aclose())


def test_the_kept_transaction_pins_no_snapshot_between_jobs(tmp_path: Path) -> None:
    """Between jobs every reader slot of this process is reset (``-``): the writer may reuse
    every page a job read; a live snapshot would hold the slot at its transaction id."""
    backend = _open(tmp_path / "store")
    try:
        rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in KEYS]
        backend.write_blocks(KEYS, [random_block(FMT.block_bytes, i) for i in range(4)])
        for _ in range(3):
            assert backend.read_blocks(KEYS, rows) == [True] * 4
            assert backend.read_blocks(KEYS[:1], rows[:1]) == [True]
        assert _kept(backend)
        slots = _slots(backend._env)  # type: ignore[attr-defined]
        assert slots and set(slots) == {"-"}
    finally:
        asyncio.run(backend.aclose())


def test_the_close_aborts_the_kept_transaction_and_a_reopen_reads_on(tmp_path: Path) -> None:
    backend = _open(tmp_path / "store")
    block = random_block(FMT.block_bytes, 1)
    row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    backend.write_blocks(KEYS[:1], [block])
    for _ in range(2):
        assert backend.read_blocks(KEYS[:1], [row]) == [True]
    direct = backend._direct  # type: ignore[attr-defined]
    env = backend._env  # type: ignore[attr-defined]
    slots = len(_slots(env))
    assert _kept(backend)
    lmdb_direct.drop_kept(direct)  # what the close does just before the environment's
    assert not lmdb_plain._rowguard.direct_kept(direct)  # type: ignore[union-attr]
    assert len(_slots(env)) == slots - 1  # its reader slot given back
    assert backend.read_blocks(KEYS[:1], [row]) == [True] and torch.equal(row, block)  # read on, nothing kept after
    assert not lmdb_plain._rowguard.direct_kept(direct)  # type: ignore[union-attr]
    asyncio.run(backend.aclose())
    assert backend._direct is None  # type: ignore[attr-defined]
    backend = _open(tmp_path / "store")
    try:
        row.zero_()
        for _ in range(2):
            assert backend.read_blocks(KEYS[:1], [row]) == [True]
        assert torch.equal(row, block) and _kept(backend)
    finally:
        asyncio.run(backend.aclose())


def test_the_stores_close_drops_the_kept_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dropped: list[Any] = []
    real = lmdb_direct.drop_kept
    from kvtier.backends import lmdb_tier

    monkeypatch.setattr(lmdb_tier, "drop_kept", lambda direct: (dropped.append(lmdb_plain._rowguard.direct_kept(direct)), real(direct)))  # type: ignore[union-attr]
    backend = _open(tmp_path / "store")
    row = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
    backend.write_blocks(KEYS[:1], [random_block(FMT.block_bytes, 1)])
    for _ in range(2):
        backend.read_blocks(KEYS[:1], [row])
    direct = backend._direct  # type: ignore[attr-defined]
    asyncio.run(backend.aclose())
    assert dropped == [True] and not lmdb_plain._rowguard.direct_kept(direct)  # type: ignore[union-attr]


_CHILD = r"""
import asyncio, os, sys
import torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_layout, lmdb_plain
from kvtier.testing import make_key, random_block

lmdb_layout.Temperature.slow = lambda self, start: False
guard = lmdb_plain._rowguard
FMT = BlockFormat(block_bytes=4096, dtype="uint8")
key, block = make_key(0), random_block(4096, 0)
backend = registry.backends.get("lmdb")(capacity=8 << 20, path=sys.argv[1])
asyncio.run(backend.open(FMT))
backend.write_blocks([key], [block])
row = torch.zeros(4096, dtype=torch.uint8)
for _ in range(2):
    assert backend.read_blocks([key], [row]) == [True]
env, direct = backend._env, backend._direct
assert guard.direct_kept(direct)
def mine():
    return sum(1 for line in env.readers().splitlines()[1:] if line.split()[:1] == [str(os.getpid())])
before = mine()
how = sys.argv[2]
if how == "fork":
    pid = os.fork()
    if pid == 0:  # the child: the parent's transaction is not its to abort
        guard.direct_drop(direct)
        os._exit(0)
    os.waitpid(pid, 0)
    assert mine() == before, ("the child freed the parent's reader slot", mine(), before)
    row.zero_()
    assert backend.read_blocks([key], [row]) == [True] and torch.equal(row, block)
    assert guard.direct_kept(direct)
    asyncio.run(backend.aclose())
else:  # python-lmdb's own close under the store, its transaction kept: left alone
    env.close()
    try:
        backend.read_blocks([key], [row])
    except Exception:
        pass
    else:
        raise AssertionError("a closed environment was read")
    asyncio.run(backend.aclose())
    del backend, env, direct
print("ok")
"""


@pytest.mark.parametrize("how", ["fork", "close"])
def test_a_forks_child_and_pythons_own_close_never_touch_the_kept_transaction(tmp_path: Path, how: str) -> None:
    """A child of a fork holds the parent's kept transaction in its copy of memory: dropping it
    there must leave the parent's reader slot alone (an abort in the child frees it in the
    shared reader table). python-lmdb's own close under the store, with a transaction kept: the
    next read is refused by python-lmdb, the store's close and the capsule's end touch nothing
    of the closed environment. In a child process: a touch of a closed environment may crash."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "store"), how], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_threads_reading_at_once_read_right_and_keep_one_transaction(tmp_path: Path) -> None:
    """Jobs on four threads at once: each takes the kept transaction or begins its own, and
    gives it back (one kept, the others aborted): every job reads the right bytes, and this
    process holds no more reader slots after than one kept and python-lmdb's own."""
    backend = _open(tmp_path / "store")
    try:
        blocks = [random_block(FMT.block_bytes, i) for i in range(4)]
        backend.write_blocks(KEYS, blocks)
        want = [bytes(b.numpy()) for b in blocks]
        errors: list[str] = []
        start = threading.Barrier(4)

        def reader(t: int) -> None:
            rows = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(2)]
            start.wait()
            for j in range(300):
                keys = [KEYS[(t + j) % 4], KEYS[(t + j + 1) % 4]]
                found = backend.read_blocks(keys, rows) if j % 2 else [backend.read_blocks(keys[:1], rows[:1])[0], True]
                if found != [True, True] or bytes(rows[0].numpy()) != want[(t + j) % 4]:
                    errors.append(f"thread {t} job {j}: {found}")

        threads = [threading.Thread(target=reader, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert _kept(backend)
        slots = _slots(backend._env)  # type: ignore[attr-defined]
        assert set(slots) == {"-"} and len(slots) <= 2, slots
    finally:
        asyncio.run(backend.aclose())
