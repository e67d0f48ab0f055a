"""Blocking work off the event loop, also while the interpreter shuts down.

Engines often close their stores from exit hooks (vLLM's exit-time finalizer, ``atexit``). By
then ``concurrent.futures`` refuses new work ("cannot schedule new futures after interpreter
shutdown"), so a close that hands its write-back to a thread would lose every block held only
in memory tiers. :func:`off_loop` runs the call inline in that one case.

Only the executor's refusal runs the call inline: the refusal comes out of the hand-over itself,
before anything ran, while whatever the call raises comes out of its future. So a call that
itself raises a ``RuntimeError`` (about a shutdown or anything else) is never run a second time.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from typing import Any

__all__ = ["off_loop"]


async def off_loop(fn: Any, *args: Any) -> Any:
    """Run blocking ``fn(*args)`` in a worker thread; inline when no new thread can start."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    try:
        future = loop.run_in_executor(None, call)
    except RuntimeError:  # the executor refused the work (interpreter exit): nothing ran yet
        return fn(*args)
    return await future
