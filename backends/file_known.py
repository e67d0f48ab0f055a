"""The file tier's own view of which records it holds, their stored sizes and access stamps.

Capacity is enforced per instance over the blocks it knows: those listed at open and those
written since. Where every listed record has the same stored size (a store without a codec),
the listed keys are held as one sorted list of the listing's own ``bytes`` objects, the ones
the manager's index holds too (8 bytes a key, searched by bisection), their common size once
and their stamps in one array beside them (8 bytes a key); a listed key deleted, forgotten or
rewritten since goes into a small set, and a key written since the open into a dict. Listed
records of differing sizes (a compressing codec) go into that dict, their stamps into another.
A dict of every listed key (about 52 bytes a key at 10^5, beside the manager's own index of the
same keys) is what this replaces.

The listed records' stamps (the listing's, then each :meth:`KnownRecords.touch`) are what the
tier's table of records (:mod:`kvtier.backends.file_table`) saves at a clean close; a record
written since the open keeps no stamp here (its file's mtime is its write or its last touch,
read at that close).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import pairwise

import numpy as np

__all__ = ["KnownRecords"]


def _sorted_keys(keys: Sequence[bytes]) -> list[bytes]:
    """``sorted(set(keys))``, the same objects, with no set built where no key repeats. (Sorting
    by the keys' first eight bytes in numpy took 0.5 s less at 10^6 than ``sorted``, but left
    16 B per key more resident after the open.)"""
    listed = sorted(keys)
    if any(a == b for a, b in pairwise(listed)):  # never from a walk; kept exact anyway
        listed = sorted(set(listed))
    return listed


def _key_order(keys: Sequence[bytes]) -> list[int] | None:
    """The positions of ``keys`` in key order, the first of a repeated key only; ``None`` where
    they are in order already and distinct (a table's listing: one pass, no sort)."""
    if all(a < b for a, b in pairwise(keys)):
        return None
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return [i for n, i in enumerate(order) if n == 0 or keys[order[n - 1]] != keys[i]]


class KnownRecords:
    """``key -> stored bytes`` of the records an instance knows, with ``get``, ``set``, ``pop``;
    and each one's access stamp (``touch``, ``columns``)."""

    __slots__ = ("_fresh", "_fresh_stamps", "_gone", "_listed", "_listed_size", "_listed_stamps")

    def __init__(self) -> None:
        self._listed: list[bytes] = []  # sorted keys listed at open, all of _listed_size bytes
        self._listed_size = 0
        self._listed_stamps = np.empty(0, dtype=np.float64)  # _listed[i]'s stamp
        self._gone: set[bytes] = set()  # listed keys deleted, forgotten or rewritten since
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
            self._listed = keys if own and type(keys) is list else list(keys)
            self._listed_stamps = np.array(stamps, dtype=np.float64)
        else:
            self._listed, self._listed_stamps = [keys[i] for i in order], stamps[order]
        self._listed_size = int(stored[0]) if len(stored) else 0

    def _at(self, key: bytes) -> int:
        """``key``'s position among the listed keys still known, or -1."""
        listed = self._listed
        if not listed or key in self._gone:
            return -1
        i = bisect_left(listed, key)
        return i if i < len(listed) and listed[i] == key else -1

    def get(self, key: bytes, default: int = 0) -> int:
        size = self._fresh.get(key)
        if size is not None:
            return size
        return self._listed_size if self._at(key) >= 0 else default

    def set(self, key: bytes, size: int) -> None:
        """``key`` is (being) written with ``size`` stored bytes (its stamp is its file's)."""
        if key not in self._fresh and self._at(key) >= 0:
            self._leave(key)  # from now on known as written since the open
        self._fresh[key] = size
        self._fresh_stamps.pop(key, None)

    def touch(self, key: bytes, stamp: float) -> None:
        """``key``'s access stamp is ``stamp`` (kept for a listed key; a key written since the
        open, or not known, keeps none)."""
        if key in self._fresh_stamps:
            self._fresh_stamps[key] = stamp
        elif (i := self._at(key)) >= 0:
            self._listed_stamps[i] = stamp

    def pop(self, key: bytes, default: int = 0) -> int:
        size = self._fresh.pop(key, None)
        if size is not None:
            self._fresh_stamps.pop(key, None)
            return size
        if self._at(key) < 0:
            return default
        self._leave(key)
        return self._listed_size

    def _leave(self, key: bytes) -> None:
        """Mark a listed key as no longer listed; the list is rebuilt once half of it has left
        (so keys the manager has dropped do not stay alive here)."""
        gone = self._gone
        gone.add(key)
        if len(gone) * 2 > len(self._listed):
            keep = [i for i, k in enumerate(self._listed) if k not in gone]
            self._listed = [self._listed[i] for i in keep]
            self._listed_stamps = self._listed_stamps[keep]
            self._gone = set()

    def columns(self, stamp_of: Callable[[bytes], float | None]) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """Every known key in key order, with its stored size and stamp; ``stamp_of(key)``
        gives the stamp of a key written since the open (``None``: it has no record, and is
        left out)."""
        gone = self._gone
        keep = [i for i, k in enumerate(self._listed) if k not in gone] if gone else None
        listed = self._listed if keep is None else [self._listed[i] for i in keep]
        fresh, fresh_stamps = [], []
        for key in sorted(self._fresh):
            stamp = self._fresh_stamps.get(key)
            if stamp is None:
                stamp = stamp_of(key)
            if stamp is not None:
                fresh.append(key)
                fresh_stamps.append(stamp)
        keys = listed + fresh  # two sorted runs: one merge
        stored = np.concatenate([np.full(len(listed), self._listed_size, dtype=np.int64), np.array([self._fresh[k] for k in fresh], dtype=np.int64)])
        stamps = np.concatenate([self._listed_stamps if keep is None else self._listed_stamps[keep], np.array(fresh_stamps, dtype=np.float64)])
        order = _key_order(keys)
        if order is None:
            return keys, stored, stamps
        return [keys[i] for i in order], stored[order], stamps[order]

    def __len__(self) -> int:
        return len(self._listed) - len(self._gone) + len(self._fresh)

    def clear(self) -> None:
        self._listed, self._listed_size, self._listed_stamps = [], 0, np.empty(0, dtype=np.float64)
        self._gone = set()
        self._fresh = {}
        self._fresh_stamps = {}
