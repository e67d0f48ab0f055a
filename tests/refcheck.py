"""A check shared by the tests of the C extensions: calls that keep or lose no reference."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable
from typing import Any


def runs_without_leaks(watched: tuple[Any, ...], one_round: Callable[[], None], rounds: int) -> None:
    """Run ``one_round`` ``rounds`` times: every object of ``watched`` ends with the references
    it began with, and traced memory grows by less than 64 KiB. Warm the calls first (objects
    made lazily on a first call are not leaks)."""
    before = [sys.getrefcount(x) for x in watched]
    tracemalloc.start()
    try:
        first, _ = tracemalloc.get_traced_memory()
        for _ in range(rounds):
            one_round()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - first < 64 << 10, after - first
    assert [sys.getrefcount(x) for x in watched] == before
