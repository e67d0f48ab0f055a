"""A test's hook into an ``lmdb`` tier's lookups: every value lookup of a read, on whichever
path makes it (the one-pass read, the general read, the cold read's thread), calls ``hook(key)``
first, on the thread that looks the key up. A hook that raises an ``lmdb.Error`` is an error of
that lookup; one that advances a clock the reader reads makes the lookup slow.

The tier's cold rule (a lookup over ``COLD_GET_S`` whose thread waited for the disk sends the
next job another way: ``Temperature.slow``) hangs on the machine: a cold page cache or a loaded
host makes real lookups slow now and then, and would move the paths tests count.
:func:`warm_lmdb_lookups` (autouse, through conftest) makes every lookup warm in every test;
:func:`slow_lookups_read_the_disk` gives a test of the rule the rule back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

#: ``Temperature.slow`` as the tier has it (taken by the first :func:`warm_lmdb_lookups`,
#: before it pins it; each test's pin is undone at its end).
_REAL: dict[str, Any] = {}


def _never_slow(self: Any, start: float) -> bool:
    return False


@pytest.fixture(autouse=True)
def warm_lmdb_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``lmdb`` lookup counts as a disk read, whatever this machine's page cache and load
    (see the module doc); :func:`slow_lookups_read_the_disk` undoes it for a test."""
    from kvtier.backends import lmdb_layout

    _REAL.setdefault("slow", lmdb_layout.Temperature.__dict__["slow"])
    monkeypatch.setattr(lmdb_layout.Temperature, "slow", _never_slow)


class _Txn:
    """A read transaction whose lookups in ``blocks`` call ``hook(key)`` first."""

    def __init__(self, txn: Any, blocks: Any, hook: Callable[[bytes], None]) -> None:
        self._txn = txn
        self._blocks = blocks
        self._hook = hook

    def get(self, key: bytes, default: Any = None, db: Any = None) -> Any:
        if db is self._blocks:
            self._hook(key)
        return self._txn.get(key, default, db=db)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


def hook_lookups(monkeypatch: pytest.MonkeyPatch, hook: Callable[[bytes], None]) -> None:
    """Call ``hook(key)`` before each value lookup of every ``lmdb`` read from now on."""
    from kvtier.backends import lmdb_layout, lmdb_one

    # The job reader's paths (the straight line of warm jobs opens its transactions itself, and
    # its tests wrap the environment instead: test_lmdb_one_read).
    monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", False)
    real = lmdb_layout.JobReader._begin

    def begin(self: Any, env: Any) -> Any:
        return _Txn(real(self, env), self.blocks, hook)

    monkeypatch.setattr(lmdb_layout.JobReader, "_begin", begin)


def slow_lookups_read_the_disk(monkeypatch: pytest.MonkeyPatch, *, thread: bool | None = True) -> None:
    """Every lookup the reader finds slow counts as a disk read (as if the thread had a major
    page fault each time it looked), whatever this machine's page cache holds; the cold rest
    of a job is looked up on a thread of its own (``thread``, as where a core is spare) or read
    in one pass on the calling thread (as on a busy machine); ``None``: as the reader decides."""
    import itertools

    from kvtier.backends import lmdb_layout

    monkeypatch.setattr(lmdb_layout.Temperature, "slow", _REAL["slow"])  # the rule, as the tier has it
    monkeypatch.setattr(lmdb_layout, "major_faults", itertools.count().__next__)
    if thread is not None:
        monkeypatch.setattr(lmdb_layout.JobReader, "_cold_way", lambda self: int(thread))


class _HookedTxn:
    """A transaction whose every lookup calls ``hook(key)`` first."""

    def __init__(self, txn: Any, hook: Callable[[bytes], None]) -> None:
        self._txn = txn
        self._hook = hook

    def get(self, key: bytes, *args: Any, **kwargs: Any) -> Any:
        self._hook(key)
        return self._txn.get(key, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


class HookedEnv:
    """An ``lmdb`` tier's environment whose transactions call ``hook(key)`` before each lookup
    (with ``reads_only``, only the reads' transactions, those begun with ``buffers``; not the
    deletion of a bad record). For the paths that open their transactions themselves (the
    straight line of warm jobs): put it in place with ``backend._env = HookedEnv(env, hook)``
    and put ``env`` back before closing."""

    def __init__(self, env: Any, hook: Callable[[bytes], None], *, reads_only: bool = False) -> None:
        self._env = env
        self._hook = hook
        self._reads_only = reads_only

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        """``lmdb.Environment.begin(db, parent, write, buffers)``, by name or by position."""
        txn = self._env.begin(*args, **kwargs)
        if self._reads_only and not kwargs.get("buffers", len(args) > 3 and args[3]):
            return txn
        return _HookedTxn(txn, self._hook)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def damaged_store(path: Any, fmt: Any, *, head_at: int, mac_key: str | None = None) -> tuple[list[bytes], list[Any]]:
    """An ``lmdb`` tier at ``path`` for ``fmt`` holding eight keys: 0, 4 and 7 raw and sound;
    1 absent; 2 with a flipped payload bit; 3 with a flipped bit at byte ``head_at`` of its
    head, where its layout keeps it (0: the magic; 12: the raw length, its payload and checksum
    intact); 5 in the whole
    layout of earlier code; 6 compressed. Keyed records with ``mac_key``. Returns the keys and
    the blocks they were written from."""
    import asyncio

    import lmdb
    import torch
    from kvtier.backends.lmdb_layout import INDEX

    from kvtier import registry
    from kvtier.records.codec import NoneCodec
    from kvtier.records.format import RecordMac, encode_record
    from kvtier.testing import make_key, random_block

    def tier(**options: Any) -> Any:
        backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path), **options)
        asyncio.run(backend.open(fmt))
        return backend

    keyed = {} if mac_key is None else {"mac_key": mac_key}
    keys = [make_key(i) for i in range(8)]
    data = [random_block(fmt.block_bytes, 500 + i) for i in range(8)]
    data[6] = torch.zeros(fmt.block_bytes, dtype=torch.uint8)  # compressible
    backend = tier(**keyed)
    backend.write_blocks([keys[i] for i in (0, 2, 3, 4, 7)], [data[i] for i in (0, 2, 3, 4, 7)])
    asyncio.run(backend.aclose())
    zstd = tier(codec={"name": "zstd", "level": 1}, **keyed)
    zstd.write_blocks([keys[6]], [data[6]])
    asyncio.run(zstd.aclose())
    env = lmdb.open(str(path), max_dbs=3)
    blocks, index = env.open_db(b"blocks"), env.open_db(b"index")
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(keys[2], db=blocks))
        value[777] ^= 0x10
        txn.put(keys[2], bytes(value), db=blocks)
        flip_head_bit(txn, keys[3], blocks, index, head_at, 0x01)
        mac = None if mac_key is None else RecordMac(mac_key)
        head, payload = encode_record(keys[5], data[5].numpy().data, NoneCodec(), 1, mac)
        txn.put(keys[5], head + bytes(payload), db=blocks)
        txn.put(keys[5], INDEX.pack(1.0, len(head) + len(payload)), db=index)
    env.close()
    return keys, data


def layouts(monkeypatch: pytest.MonkeyPatch, layout: str) -> str:
    """Saves from now on write ``layout``: ``joined`` (the default for records of up to
    ``JOIN_MAX`` bytes) or ``split`` (every record, as larger ones are)."""
    from kvtier.backends import lmdb_entries

    if layout == "split":
        monkeypatch.setattr(lmdb_entries, "JOIN_MAX", 0)
    return layout


def flip_head_bit(txn: Any, key: bytes, blocks: Any, index: Any, at: int, bit: int) -> None:
    """Flip ``bit`` of byte ``at`` of ``key``'s record head, where its layout keeps it: in its
    index entry (split) or at the start of its value (joined)."""
    from kvtier.backends.lmdb_entries import INDEX

    entry = txn.get(key, db=index)
    if entry is not None and len(entry) > INDEX.size:
        changed = bytearray(entry)
        changed[INDEX.size + at] ^= bit
        txn.put(key, bytes(changed), db=index)
    else:
        value = bytearray(txn.get(key, db=blocks))
        value[at] ^= bit
        txn.put(key, bytes(value), db=blocks)


def reads_all_but_one(backend: Any, keys: list[bytes], data: list[Any], bad: int) -> None:
    """Read ``keys`` from the opened ``backend`` (closed after): every block but ``keys[bad]``
    is found with its bytes ``data[i]``, and that one is the one counted corrupt record."""
    import asyncio

    import torch

    try:
        out = [torch.zeros_like(d) for d in data]
        found = backend.read_blocks(keys, out)
        stats = backend.stats()
    finally:
        asyncio.run(backend.aclose())
    assert found == [i != bad for i in range(len(keys))]
    assert all(torch.equal(out[i], data[i]) for i in range(len(keys)) if i != bad)
    assert stats["corrupt_records"] == 1


def read_as_damaged(found: list[bool], out: list[Any], data: list[Any], stats: dict[str, Any]) -> None:
    """What a read of all eight keys of :func:`damaged_store` must give, whichever path read
    them: 0, 4, 5, 6 and 7 found with their bytes; 1 (absent), 2 and 3 (damaged) missed; the
    two damaged ones counted corrupt and deleted."""
    import torch

    assert found == [True, False, False, False, True, True, True, True]
    for i in (0, 4, 5, 6, 7):
        assert torch.equal(out[i], data[i]), i
    assert stats["corrupt_records"] == 2 and stats["deleted"] == 2  # the flipped payload and head bits


def record_check_calls(path: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``xxcopy.xxh3_check_copy`` on one path (``"python"`` or ``"native"``) for the rest of the
    test, recording the outcome of each call in the list returned."""
    from kvtier.records import xxcopy

    fn = xxcopy.xxh3_check_copy_python if path == "python" else xxcopy.xxh3_check_copy_native
    seen: list[int] = []

    def recording(*args: Any) -> int:
        status = fn(*args)  # type: ignore[misc]
        seen.append(status)
        return status

    monkeypatch.setattr(xxcopy, "xxh3_check_copy", recording)
    return seen
