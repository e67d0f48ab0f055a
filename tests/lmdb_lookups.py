"""A test's hook into an ``lmdb`` tier's lookups: every value lookup of a read, on whichever
path makes it (the one-pass read, the general read, the cold read's thread), calls ``hook(key)``
first, on the thread that looks the key up. A hook that raises an ``lmdb.Error`` is an error of
that lookup; one that advances a clock the reader reads makes the lookup slow."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


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

    monkeypatch.setattr(lmdb_layout, "major_faults", itertools.count().__next__)
    if thread is not None:
        monkeypatch.setattr(lmdb_layout.JobReader, "_cold_way", lambda self: int(thread))


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
