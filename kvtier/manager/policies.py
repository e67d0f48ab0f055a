"""Eviction policies: who goes when a tier is full.

A policy orders the *ready* keys of one tier and picks victims; it never touches bytes or slot
state. One small interface: ``insert``, ``touch`` (each with a batch form, ``insert_many`` and
``touch_many``, that a policy may override for speed; ``touch_held`` touches a batch only if it
holds every key), ``remove`` and an atomic
``evict(n, protected)`` that either returns ``n`` victims (and forgets them) or returns ``None``
and changes nothing. Keys in ``protected`` (pinned by a load, or part of the batch being stored)
are never chosen. All operations are O(1) amortised, except that ``evict`` steps over protected
keys. Third-party policies register in the ``kvtier.manager.policies`` entry-point group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from kvtier.errors import ConfigError
from kvtier.keys import exact_bytes
from kvtier.manager.key_order import KeyOrder, new_order

__all__ = ["EvictionPolicy", "LRUPolicy", "ARCPolicy"]


class EvictionPolicy(ABC):
    """Orders the keys of one tier. ``capacity`` is the tier's size in blocks (a hint)."""

    name: ClassVar[str] = ""

    def __init__(self, capacity: int = 0) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"policy capacity: expected a non-negative integer, got {capacity!r}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: bytes) -> None:
        """A key became ready in this tier."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """The key was used; unknown keys are ignored."""

    def insert_many(self, keys: Iterable[bytes]) -> None:
        """``insert`` each key in order; policies override it with a batch form."""
        for key in keys:
            self.insert(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """``touch`` each key in order; policies override it with a batch form."""
        for key in keys:
            self.touch(key)

    def touch_held(self, keys: Sequence[bytes]) -> bool:
        """``touch_many(keys)`` if the policy holds every key, and ``True``; else ``False`` and
        no change. The manager's ``touch`` of a one-tier cache validates by this: the policy
        orders exactly the tier's ready keys, each checked when it was stored. Keys must be
        exactly ``bytes`` here: ``touch_many`` may keep the objects it is given, and an object
        found equal to a stored key is not one (:class:`LRUPolicy` keeps none, and skips this)."""
        if exact_bytes(keys) and all(map(self.__contains__, keys)):
            self.touch_many(keys)
            return True
        return False

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """The key left the tier for another reason than eviction; unknown keys are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: Container[bytes] = ()) -> list[bytes] | None:
        """Choose and forget ``n`` victims not in ``protected``; ``None`` (no change) if impossible."""

    def adopt(self, keys: Sequence[bytes], ready: Mapping[bytes, object]) -> None:
        """Keys of stored records made ready at a store's open, oldest first: distinct, none
        known to this policy yet. ``ready`` is the tier's index (a key is ready while its value
        there is true; it stays the tier's, and the policy only reads it). A ``list`` of
        ``keys`` is handed over: the manager passes one that nothing else uses, so a policy may
        keep it and change it. The default inserts them; :class:`LRUPolicy` keeps that list
        itself (one slot each) until they are used."""
        self.insert_many(keys)

    def restore(self, victims: list[bytes]) -> None:
        """Undo the ``evict`` that returned ``victims``: they become the next victims again, in
        the same order (exactly the old order when no protected key was skipped).

        The manager calls this when a multi-step eviction turns out impossible, so a rejected
        store leaves the order as it was. The default re-inserts them (as most recent), which
        keeps them but loses their place; built-in policies put them back in front.
        """
        for key in victims:
            self.insert(key)

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def order(self) -> list[bytes]:
        """Keys from the next victim to the last; for tests and inspection."""

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.name}


class LRUPolicy(EvictionPolicy):
    """Least recently used first.

    The keys used since the store opened (stored, loaded, touched) are in an ordered dict,
    oldest first (:mod:`kvtier.manager.key_order`: the C ``KeyOrder`` where the extension is
    built, which holds exact ``bytes`` keys only). The records adopted at open and not used since (``adopt``) are older than all
    of them: they stay in a plain list, oldest first, behind a cursor, so a tier of millions of
    records costs one list slot per key rather than an ordered-dict node (about 100 bytes;
    ``benchmarks/bench_scale.py``). Such a *cold* key's slot is live while the tier's index holds
    it ready and it is not in the ordered dict: a use moves it into the ordered dict (its slot
    goes stale), a removal from the index makes the slot stale. A key has at most one slot; slots
    behind the cursor are free, and a victim taken from a slot goes back in front of the cursor
    when its eviction is undone (``restore``), so eviction and its undo stay O(victims).
    """

    name: ClassVar[str] = "lru"
    #: Keys taken from the cold list and not restored that ``restore`` remembers (beyond this,
    #: the oldest are forgotten: such a key, if restored, goes to the front of the ordered dict).
    TAKEN_MEMORY = 4096

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._order: KeyOrder = new_order()
        self._cold: list[bytes | None] = []
        self._at = 0  # the cold list's cursor: slots before it are free
        self._ready: Callable[[bytes], object] | None = None
        self._taken: dict[bytes, None] = {}  # cold keys handed out by evict, for restore

    def adopt(self, keys: Sequence[bytes], ready: Mapping[bytes, object]) -> None:
        if self._at < len(self._cold):  # cold keys left: a later adoption (a shared tier's) is used now
            self.insert_many(keys)
            return
        # The list handed over is kept as it is: a copy made on the adopting thread while the
        # listing thread's list is freed left that list's bytes free, and resident, at the top
        # of the listing thread's heap (8 B a key; see docs/tiers.md, "How many records").
        self._cold = keys if type(keys) is list else list(keys)
        self._at = 0
        self._ready = ready.get
        self._taken.clear()

    def _is_cold(self, key: bytes) -> bool:
        """Whether ``key``, not in the ordered dict, is one of the cold keys (see the class doc)."""
        ready = self._ready
        return ready is not None and bool(ready(key)) and key not in self._order

    def insert(self, key: bytes) -> None:
        order = self._order
        if key in order:
            order.move_to_end(key)
        else:
            order[key] = None

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        elif self._is_cold(key):
            self._order[key] = None

    def insert_many(self, keys: Iterable[bytes]) -> None:
        order = self._order
        before = len(order)
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        for key in keys:
            order[key] = None
        if len(order) - before != len(keys):  # some were there (or repeated): insert moves them last
            for key in keys:
                order.move_to_end(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        order = self._order
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        try:
            deque(map(order.move_to_end, keys), 0)  # every key known (the manager's case): a loop in C
        except KeyError:  # a cold or unknown key: moving the known ones again, in order, gives the same order
            move, cold = order.move_to_end, self._is_cold
            for key in keys:
                if key in order:
                    move(key)
                elif cold(key):
                    order[key] = None

    def ordered(self) -> KeyOrder:
        """The order of the keys used since the open (see the class doc), oldest first: the
        same object for the policy's life, which a native ``touch`` moves keys in."""
        return self._order

    def touch_held(self, keys: Sequence[bytes]) -> bool:
        # ``move_to_end`` moves the stored key object: nothing of the caller's is kept, so a
        # value found equal to a stored key touches that key, with no check of its type. Plain
        # loops: ``in`` and a bound method called from the loop cost less per key than
        # ``all(map(order.__contains__, ...))`` (a slot wrapper) and ``deque(map(...), 0)``.
        order = self._order
        for key in keys:  # finding every key first also brings its entry into the cache
            if key not in order:
                return False
        move = order.move_to_end
        for key in keys:
            move(key)
        return True

    def remove(self, key: bytes) -> None:
        # A cold key's slot goes stale when the tier's index drops the key.
        self._order.pop(key, None)

    def evict(self, n: int, protected: Container[bytes] = ()) -> list[bytes] | None:
        if n <= 0:
            return []
        victims: list[bytes] = []
        cold = self._at < len(self._cold)
        if cold:
            walked, held = self._walk_cold(n, protected, victims)
        from_cold = len(victims)
        if from_cold < n:
            for key in self._order:
                if key not in protected:
                    victims.append(key)
                    if len(victims) == n:
                        break
            else:
                return None
        if cold:
            self._take_cold(walked, held, victims[:from_cold])
        order = self._order
        for key in victims[from_cold:]:
            del order[key]
        return victims

    def _walk_cold(self, n: int, protected: Container[bytes], victims: list[bytes]) -> tuple[int, list[bytes]]:
        """Live cold keys from the cursor on, not in ``protected``, into ``victims`` (up to ``n``);
        the index after the last slot walked and the protected live keys met, in order."""
        cold, order, ready = self._cold, self._order, self._ready
        assert ready is not None
        held: list[bytes] = []
        i, end = self._at, len(cold)
        while i < end and len(victims) < n:
            key = cold[i]
            i += 1
            if key is None or key in order or not ready(key):
                continue
            if key in protected:
                held.append(key)
            else:
                victims.append(key)
        return i, held

    def _take_cold(self, walked: int, held: list[bytes], victims: list[bytes]) -> None:
        """Free the slots walked (the protected keys met move to the last of them, in order)."""
        cold, taken = self._cold, self._taken
        start = walked - len(held)
        cold[self._at : start] = [None] * (start - self._at)
        cold[start:walked] = held
        self._at = start
        if len(taken) > self.TAKEN_MEMORY:
            taken.clear()
        taken.update(dict.fromkeys(victims))
        if start >= len(cold):  # every cold key used or gone: drop the list
            self._cold, self._at = [], 0
            taken.clear()

    def restore(self, victims: list[bytes]) -> None:
        order, taken, cold = self._order, self._taken, self._cold
        for key in reversed(victims):
            if key in taken and self._at > 0:  # back into the cold slot before the cursor
                del taken[key]
                self._at -= 1
                cold[self._at] = key
            else:
                order[key] = None
                order.move_to_end(key, last=False)

    def _cold_keys(self) -> list[bytes]:
        if self._ready is None:
            return []
        live = self._is_cold
        return [key for key in self._cold[self._at :] if key is not None and live(key)]

    def __len__(self) -> int:
        return len(self._order) + (len(self._cold_keys()) if self._at < len(self._cold) else 0)

    def __contains__(self, key: object) -> bool:
        return key in self._order or (isinstance(key, bytes) and key in self._cold_keys())

    def order(self) -> list[bytes]:
        return [*self._cold_keys(), *self._order]


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    ``T1`` holds keys seen once, ``T2`` keys seen again; the ghost lists ``B1``/``B2`` remember
    recent victims of each, and a hit on a ghost moves the target size ``p`` of ``T1``. Scans of
    one-off prefixes therefore do not flush the frequently reused ones (system prompts).
    """

    name: ClassVar[str] = "arc"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self.p = 0.0

    def _ghost_limit(self) -> int:
        return max(self.capacity, len(self._t1) + len(self._t2), 1)

    def insert(self, key: bytes) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        c = self._ghost_limit()
        if key in self._b1:
            self.p = min(float(c), self.p + max(len(self._b2) / max(len(self._b1), 1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / max(len(self._b2), 1), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    @staticmethod
    def _unprotected(lst: OrderedDict[bytes, None], protected: Container[bytes]) -> Iterator[bytes]:
        return (k for k in lst if k not in protected)

    def _plan(self, n: int, protected: Container[bytes]) -> list[tuple[bytes, bool]] | None:
        it1 = self._unprotected(self._t1, protected)
        it2 = self._unprotected(self._t2, protected)
        t1_left = len(self._t1)
        plan: list[tuple[bytes, bool]] = []
        exhausted1 = exhausted2 = False
        while len(plan) < n:
            prefer_t1 = t1_left > 0 and (t1_left > self.p or exhausted2)
            key = None
            if prefer_t1 and not exhausted1:
                key = next(it1, None)
                exhausted1 = key is None
                from_t1 = True
            if key is None and not exhausted2:
                key = next(it2, None)
                exhausted2 = key is None
                from_t1 = False
            if key is None and not exhausted1:
                key = next(it1, None)
                exhausted1 = key is None
                from_t1 = True
            if key is None:
                return None
            plan.append((key, from_t1))
            if from_t1:
                t1_left -= 1
        return plan

    def evict(self, n: int, protected: Container[bytes] = ()) -> list[bytes] | None:
        if n <= 0:
            return []
        plan = self._plan(n, protected)
        if plan is None:
            return None
        for key, from_t1 in plan:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        limit = self._ghost_limit()
        while len(self._b1) > limit:
            self._b1.popitem(last=False)
        while len(self._b2) > limit:
            self._b2.popitem(last=False)
        return [k for k, _ in plan]

    def restore(self, victims: list[bytes]) -> None:
        # Victims went to the tail of a ghost list; take them back to the head of their list.
        for key in reversed(victims):
            if key in self._t1 or key in self._t2:
                continue
            target = self._t2 if self._b2.pop(key, False) is None else self._t1
            self._b1.pop(key, None)
            target[key] = None
            target.move_to_end(key, last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def order(self) -> list[bytes]:
        plan = self._plan(len(self), ())
        return [k for k, _ in plan] if plan else []
