"""Live following through head-group records: a shared tier's follower sees *record* keys (one
per block and head group), the manager's index holds *block* keys.

:class:`GroupIndexTarget` stands between them, answering the follower's duck-typed target calls
(``holds``, ``adopt``, ``adopt_live``, ``remove``) in record keys and applying them to the
manager in block keys:

* a block is adopted once **every** group of it has been seen (the writer's ranks publish their
  groups in entries of their own, in any order): records of incomplete blocks wait in a bounded
  table (a writer that died between groups leaves its block there until it is pushed out: a
  miss, never a partial load);
* a record that is removed removes its block (it can no longer be loaded whole);
* ``holds`` is true for a record of a block the manager holds.

A record key does not say its group, so each is tried as the record of every group: the block
``block_key_of(record, g)`` is the candidate, taken only when all its groups' records are there
(as :meth:`~kvtier.records.head_groups.HeadGroupLayout.blocks_present` does for a listing).

:class:`GroupFollower` is what a head-group tier shows as its ``follower``: the inner tier's
follower, with changes told in block keys.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvtier.records.head_groups import HeadGroupLayout, block_key_of

__all__ = ["ChangeListeners", "GroupFollower", "GroupIndexTarget"]

log = logging.getLogger("kvtier")

#: Records of incomplete blocks remembered (32 bytes each); the oldest are pushed out.
PARTIAL_MAX = 1 << 20


class ChangeListeners:
    """Callables told each change of a followed tier; registration is thread-safe, and a
    listener that raises is logged and kept (it never stops the following)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._listeners: tuple[Callable[[Any], None], ...] = ()
        self._lock = threading.Lock()

    def add(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``listener`` with every change; returns a function that stops it."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def remove() -> None:
            with self._lock:
                self._listeners = tuple(fn for fn in self._listeners if fn is not listener)

        return remove

    def tell(self, change: Any) -> None:
        for listener in self._listeners:
            try:
                listener(change)
            except Exception:
                log.exception("%s: a listener of the shared tier failed", self.name)


class GroupIndexTarget:
    """The manager's index of a head-group tier, as the inner tier's follower sees it."""

    def __init__(self, manager: Any, layout: HeadGroupLayout, block_bytes: int) -> None:
        self.manager = manager
        self.layout = layout
        self.block_bytes = block_bytes
        self._all = tuple(range(layout.groups.num_groups))
        self._partial: dict[bytes, None] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- what happened on this thread since the follower last told its listeners ---------------
    def take_blocks(self) -> tuple[list[bytes], list[bytes]]:
        local = self._local
        adopted, removed = getattr(local, "adopted", []), getattr(local, "removed", [])
        local.adopted, local.removed = [], []
        return adopted, removed

    def _note(self, name: str, blocks: list[bytes]) -> None:
        if blocks:
            local = self._local
            if not hasattr(local, name):
                setattr(local, name, [])
            getattr(local, name).extend(blocks)

    def _candidates(self, record_keys: Iterable[bytes]) -> dict[bytes, None]:
        return {block_key_of(rk, g): None for rk in record_keys for g in self._all}

    # -- the target calls ----------------------------------------------------------------------
    def holds(self, record_key: bytes, tier: int) -> bool:
        holds = self.manager.holds
        return any(holds(block_key_of(record_key, g), tier) for g in self._all)

    def adopt_live(self, tier: int, records: Iterable[tuple[bytes, int, float]]) -> list[bytes]:
        """Adopt the blocks these records complete; the record keys of the blocks adopted."""
        records = list(records)
        if not records:
            return []
        stamp = max(r[2] for r in records)
        record_keys = self.layout.record_keys
        with self._lock:
            partial = self._partial
            for rk, _, _ in records:
                partial[rk] = None
            complete: list[bytes] = []
            for block in self._candidates(r[0] for r in records):
                rks = record_keys([block], self._all)
                if all(rk in partial for rk in rks):
                    complete.append(block)
                    for rk in rks:
                        partial.pop(rk, None)
            while len(partial) > PARTIAL_MAX:
                del partial[next(iter(partial))]
        if not complete:
            return []
        blocks = [(b, self.block_bytes, stamp) for b in complete]
        live = getattr(self.manager, "adopt_live", None)
        if live is not None:
            adopted = list(live(tier, blocks))
        else:
            excess = set(self.manager.adopt(tier, blocks))
            adopted = [b for b in complete if b not in excess]
        self._note("adopted", adopted)
        return record_keys(adopted, self._all)

    def adopt(self, tier: int, records: Iterable[tuple[bytes, int, float]]) -> list[bytes]:
        """``adopt``'s contract (the record keys not adopted); incomplete blocks wait."""
        records = list(records)
        adopted = set(self.adopt_live(tier, records))
        return [r[0] for r in records if r[0] not in adopted]

    def remove(self, record_keys: Sequence[bytes], tier: int) -> list[bytes]:
        """Forget the blocks these records belong to; the record keys whose block went."""
        with self._lock:
            for rk in record_keys:
                self._partial.pop(rk, None)
        holds = self.manager.holds
        blocks = [b for b in self._candidates(record_keys) if holds(b, tier)]
        if not blocks:
            return []
        gone = list(self.manager.remove(blocks, tier))
        self._note("removed", gone)
        gone_records = set(self.layout.record_keys(gone, self._all))
        return [rk for rk in record_keys if rk in gone_records]


class GroupFollower:
    """A head-group tier's follower: the inner tier's, with changes told in block keys."""

    def __init__(self, inner: Any, target: GroupIndexTarget) -> None:
        self.inner = inner
        self.target = target
        self.feed = inner.feed
        self._listeners = ChangeListeners(getattr(inner, "name", "head groups"))
        inner.listen(self._translate)

    def _translate(self, change: Any) -> None:
        adopted, removed = self.target.take_blocks()
        if adopted or removed:
            self._listeners.tell(dataclasses.replace(change, adopted=tuple(adopted), removed=tuple(removed)))

    def listen(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``listener`` with every change, in block keys; returns a function that stops it."""
        return self._listeners.add(listener)

    def count_served(self, keys: Sequence[bytes]) -> int:
        """Shared hits of a load of these blocks (counted per record of the groups held)."""
        held = self.target.layout.groups.held
        return int(self.inner.count_served(self.target.layout.record_keys(keys, held)))

    def sweep_now(self) -> None:
        self.inner.sweep_now()

    def stats(self) -> dict[str, Any]:
        return dict(self.inner.stats())
