"""Blocking work off the event loop, also while the interpreter shuts down.

Engines often close their stores from exit hooks (vLLM's exit-time finalizer, ``atexit``). By
then ``concurrent.futures`` refuses new work ("cannot schedule new futures after interpreter
shutdown"), so a close that hands its write-back to a thread would lose every block held only
in memory tiers. :func:`off_loop` runs the call inline in that one case.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["off_loop"]


async def off_loop(fn: Any, *args: Any) -> Any:
    """Run blocking ``fn(*args)`` in a worker thread; inline when no new thread can start."""
    try:
        return await asyncio.to_thread(fn, *args)
    except RuntimeError as exc:
        if "shutdown" not in str(exc):
            raise
        return fn(*args)
