"""An eviction policy: first in, first out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import ClassVar

from kvtier.manager.policies import EvictionPolicy


class FifoPolicy(EvictionPolicy):
    """Evicts in insertion order; ``touch`` does not change the order."""

    name: ClassVar[str] = "demo-fifo"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order.setdefault(key, None)

    def touch(self, key: bytes) -> None:
        pass

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, protected: Container[bytes] = ()) -> list[bytes] | None:
        victims = [k for k in self._order if k not in protected][: max(n, 0)]
        if len(victims) < n:
            return None  # atomic: no change when n victims cannot be found
        for key in victims:
            del self._order[key]
        return victims

    def restore(self, victims: list[bytes]) -> None:
        for key in reversed(victims):  # back in front, in their old order
            self._order[key] = None
            self._order.move_to_end(key, last=False)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def order(self) -> list[bytes]:
        return list(self._order)
