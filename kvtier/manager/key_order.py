"""The LRU policy's order of keys, oldest first: the C ``KeyOrder`` where the extension
``kvtier.manager._probe`` is built, else a ``collections.OrderedDict``. Both give the same
answers to the calls the policy makes (``tests/test_key_order.py`` runs random sequences of
them on both).

The ordered dict finds a node through an array beside its dict's table, and every growth of the
table rebuilds that array by looking every key up again (50-100 ns a key over a tier's fill);
``KeyOrder`` keeps its nodes in one array and rebuilds its table from their stored hashes
(``kvtier/manager/_keyorder.c``). It holds exact ``bytes`` keys only: the manager's keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol, overload

from kvtier.manager.lookups import NATIVE, native_module

__all__ = ["KeyOrder", "new_order"]


class KeyOrder(Protocol):
    """What the LRU policy and the native touch use of an ordered dict of keys."""

    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def __setitem__(self, key: bytes, value: None) -> None: ...
    def __delitem__(self, key: bytes) -> None: ...
    def move_to_end(self, key: bytes, last: bool = True) -> None: ...
    @overload
    def pop(self, key: bytes, /) -> None: ...
    @overload
    def pop(self, key: bytes, default: None, /) -> None: ...


def new_order(native: bool = NATIVE) -> KeyOrder:
    """An empty order: the C ``KeyOrder`` where ``native`` (the default where the extension is
    built, and where the built extension has it), else an ``OrderedDict``."""
    make = getattr(native_module(), "KeyOrder", None) if native else None  # (None: built before it)
    if make is None:
        fallback: OrderedDict[bytes, None] = OrderedDict()
        return fallback
    order: KeyOrder = make()
    return order
