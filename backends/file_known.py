"""The file tier's own view of which records it holds, their stored sizes and access stamps.

Capacity is enforced per instance over the blocks it knows: those listed at open and those
written since. Where every listed record has the same stored size (a store without a codec),
the listed keys are held in key order with their stamps (:mod:`kvtier.backends.file_listed`):
left in the table of records the open took (no memory of the process per key), or, after a
``stat`` walk, as one sorted list of the listing's own ``bytes`` objects, the ones the
manager's index holds too (8 bytes a key), and their stamps in one array (8 bytes a key); their
common size once. A listed key deleted, forgotten or rewritten since is marked in a bitmap (one
bit a key), and a key written since the open goes into a dict. Listed records of differing
sizes (a compressing codec) go into that dict, their stamps into another. A dict of every
listed key (about 52 bytes a key at 10^5, beside the manager's own index of the same keys) is
what this replaces.

The listed records' stamps (the listing's, then each :meth:`KnownRecords.touch`) are what the
tier's table of records (:mod:`kvtier.backends.file_table`) saves at a clean close; a record
written since the open keeps no stamp here (its file's mtime is its write or its last touch,
read at that close).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise

import numpy as np
from kvtier.backends.file_listed import ListedInMemory, ListedOnDisk

__all__ = ["KnownRecords", "in_key_order"]


def _sorted_keys(keys: Sequence[bytes]) -> list[bytes]:
    """``sorted(set(keys))``, the same objects, with no set built where no key repeats. (Sorting
    by the keys' first eight bytes in numpy took 0.5 s less at 10^6 than ``sorted``, but left
    16 B per key more resident after the open.)"""
    listed = sorted(keys)
    if any(a == b for a, b in pairwise(listed)):  # never from a walk; kept exact anyway
        listed = sorted(set(listed))
    return listed


def in_key_order(keys: Sequence[bytes]) -> bool:
    """Whether ``keys`` are strictly increasing: in key order and distinct (one pass)."""
    return all(a < b for a, b in pairwise(keys))


def _key_order(keys: Sequence[bytes]) -> list[int] | None:
    """The positions of ``keys`` in key order, the first of a repeated key only; ``None`` where
    they are in order already and distinct (a table's listing: one pass, no sort)."""
    if in_key_order(keys):
        return None
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return [i for n, i in enumerate(order) if n == 0 or keys[order[n - 1]] != keys[i]]


class KnownRecords:
    """``key -> stored bytes`` of the records an instance knows, with ``get``, ``set``, ``pop``;
    and each one's access stamp (``touch``, ``columns``)."""

    __slots__ = ("_fresh", "_fresh_stamps", "_gone", "_gone_count", "_listed", "_listed_size")

    def __init__(self) -> None:
        self._listed: ListedInMemory | ListedOnDisk = ListedInMemory([], np.empty(0))  # keys listed at open, all of _listed_size bytes
        self._listed_size = 0
        self._gone = bytearray()  # a bit per listed key: deleted, forgotten or rewritten since
        self._gone_count = 0
        self._fresh: dict[bytes, int] = {}  # the other known keys (none of them listed and not gone)
        self._fresh_stamps: dict[bytes, float] = {}  # the stamps of listed records of differing sizes

    def adopt(
        self, keys: Sequence[bytes], stored: np.ndarray, stamps: np.ndarray | None = None, *, own: bool = False, in_order: bool = False
    ) -> None:
        """Take a listing's keys, stored sizes and stamps (``stored[i]`` is ``keys[i]``'s; no
        stamps: 0), replacing what was known. A key listed twice keeps one entry. ``own``: the
        caller hands ``keys`` (a list) over, and it is kept as it is where it is in key order;
        ``in_order``: the caller has checked that it is (strictly increasing: no pass here)."""
        self.clear()
        stored = np.asarray(stored, dtype=np.int64)
        stamps = np.zeros(len(keys)) if stamps is None else np.asarray(stamps, dtype=np.float64)
        if len(stored) and stored.min() != stored.max():
            self._fresh = dict(zip(keys, stored.tolist()))
            self._fresh_stamps = dict(zip(keys, stamps.tolist()))
            return
        order = None if in_order else _key_order(keys)
        if order is None:
            listed = keys if own and type(keys) is list else list(keys)
            self._listed = ListedInMemory(listed, np.array(stamps, dtype=np.float64))
        else:
            self._listed = ListedInMemory([keys[i] for i in order], stamps[order])
        self._listed_size = int(stored[0]) if len(stored) else 0

    def adopt_listed(self, listed: ListedOnDisk, size: int) -> None:
        """Take keys listed in key order, distinct, each of ``size`` stored bytes, as
        ``listed`` holds them (handed over: closed by :meth:`clear`), replacing what was known."""
        self.clear()
        self._listed, self._listed_size = listed, size

    def _at(self, key: bytes) -> int:
        """``key``'s position among the listed keys still known, or -1."""
        listed = self._listed
        if not len(listed):
            return -1
        i = listed.find(key)
        return i if i >= 0 and not (self._gone and self._gone[i >> 3] >> (i & 7) & 1) else -1

    def get(self, key: bytes, default: int = 0) -> int:
        size = self._fresh.get(key)
        if size is not None:
            return size
        return self._listed_size if self._at(key) >= 0 else default

    def set(self, key: bytes, size: int) -> None:
        """``key`` is (being) written with ``size`` stored bytes (its stamp is its file's)."""
        if key not in self._fresh and (i := self._at(key)) >= 0:
            self._leave(i)  # from now on known as written since the open
        self._fresh[key] = size
        self._fresh_stamps.pop(key, None)

    def touch(self, key: bytes, stamp: float) -> None:
        """``key``'s access stamp is ``stamp`` (kept for a listed key; a key written since the
        open, or not known, keeps none)."""
        if key in self._fresh_stamps:
            self._fresh_stamps[key] = stamp
        elif (i := self._at(key)) >= 0:
            self._listed.touch(i, stamp)

    def pop(self, key: bytes, default: int = 0) -> int:
        size = self._fresh.pop(key, None)
        if size is not None:
            self._fresh_stamps.pop(key, None)
            return size
        i = self._at(key)
        if i < 0:
            return default
        self._leave(i)
        return self._listed_size

    def _leave(self, i: int) -> None:
        """Mark the listed key at ``i`` as no longer listed; a list of the keys' objects is
        rebuilt once half of it has left (so keys the manager has dropped do not stay alive
        here)."""
        listed = self._listed
        if not self._gone:
            self._gone = bytearray((len(listed) + 7) // 8)
        self._gone[i >> 3] |= 1 << (i & 7)
        self._gone_count += 1
        if listed.rebuilds and self._gone_count * 2 > len(listed):
            rebuilt = listed.without(np.flatnonzero(~self._gone_mask()).tolist())  # type: ignore[union-attr]
            self._listed, self._gone, self._gone_count = rebuilt, bytearray(), 0

    def _gone_mask(self) -> np.ndarray:
        n = len(self._listed)
        if not self._gone:
            return np.zeros(n, dtype=bool)
        return np.unpackbits(np.frombuffer(self._gone, dtype=np.uint8), bitorder="little")[:n].astype(bool)

    def columns(self, stamp_of: Callable[[bytes], float | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every known key in key order (one ``S32`` column), with its stored size and stamp;
        ``stamp_of(key)`` gives the stamp of a key written since the open (``None``: it has no
        record, and is left out). ``OSError`` if the listed keys cannot be read back."""
        listed = self._listed
        keys, stamps = listed.packed_keys(), listed.stamps_now()
        if self._gone_count:
            keep = ~self._gone_mask()
            keys, stamps = keys[keep], stamps[keep]
        fresh, fresh_stored, fresh_stamps = [], [], []
        for key in sorted(self._fresh):
            stamp = self._fresh_stamps.get(key)
            if stamp is None:
                stamp = stamp_of(key)
            if stamp is not None:
                fresh.append(key)
                fresh_stored.append(self._fresh[key])
                fresh_stamps.append(stamp)
        stored = np.full(len(keys), self._listed_size, dtype=np.int64)
        if not fresh:
            return keys, stored, np.asarray(stamps, dtype=np.float64)
        added = np.array(fresh, dtype="S32")
        at = np.searchsorted(keys, added)  # two sorted runs, no key in both: one merge
        return np.insert(keys, at, added), np.insert(stored, at, fresh_stored), np.insert(np.asarray(stamps, dtype=np.float64), at, fresh_stamps)

    def __len__(self) -> int:
        return len(self._listed) - self._gone_count + len(self._fresh)

    def clear(self) -> None:
        self._listed.close()
        self._listed, self._listed_size = ListedInMemory([], np.empty(0)), 0
        self._gone, self._gone_count = bytearray(), 0
        self._fresh = {}
        self._fresh_stamps = {}
