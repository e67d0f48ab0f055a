"""Running kvtier's async set-up and tear-down from an engine's synchronous code."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_sync"]

_T = TypeVar("_T")


def run_sync(coro: Coroutine[Any, Any, _T], *, name: str = "kvtier-sync") -> _T:
    """Run ``coro`` to completion from synchronous code, even under a running event loop
    (then on a short-lived thread with its own loop, since a loop cannot be re-entered)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]
