"""Steps on which vLLM only waits for kvtier: give the load the CPU instead of spinning.

When every request that vLLM could run waits for its KV from kvtier, vLLM still steps: each
step schedules nothing, runs no forward pass (``kv_connector_no_forward``: ``start_load_kv``
sees no attention metadata) and asks the connector what finished. Those steps follow each
other with no pause, a few hundred microseconds apart. The step thread then runs Python all the
time and holds the GIL, and on vLLM's CPU backend it shares its core with kvtier's transfer
threads (they inherit the worker's CPU binding). Every torch copy of a load job releases the
GIL and must get it back, which takes up to the interpreter's switch interval (5 ms) against a
thread that never blocks. Measured on 2 CPUs (``benchmarks/profile_vllm_hit.py``, 1,472 tokens,
23 MiB of KV): a load job took 49 and 72 ms over 181 and 212 empty steps, 6.5 ms when it met
few of them.

So on such a step the worker side waits, up to ``idle_load_wait_s`` (in
``kv_connector_extra_config``; default :data:`DEFAULT_IDLE_LOAD_WAIT_S`, ``0`` turns it off),
for the oldest load job in flight, without the GIL. The wait ends the moment the job ends,
and only a step with no forward pass waits: a step that computes anything never does, so
decoding requests are never slowed. What it can delay is a request that arrives during the
wait: by at most ``idle_load_wait_s``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.errors import ConfigError

__all__ = ["DEFAULT_IDLE_LOAD_WAIT_S", "idle_load_wait", "is_idle_step", "wait_for_loads"]

#: Seconds an empty step waits for a load (a 23 MiB load job on one CPU core takes about 6 ms).
DEFAULT_IDLE_LOAD_WAIT_S = 0.005


class _LoadWaiter(Protocol):
    def wait_for_load(self, timeout: float) -> bool: ...


def idle_load_wait(value: Any) -> float:
    """``kv_connector_extra_config.idle_load_wait_s`` in seconds (``None``: the default)."""
    if value is None:
        return DEFAULT_IDLE_LOAD_WAIT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(
            f"kv_connector_extra_config.idle_load_wait_s: expected seconds between 0 and 1 (0: off), got {value!r}"
        )
    return float(value)


def is_idle_step(forward_context: Any) -> bool:
    """Whether vLLM runs this step without a forward pass (its ``kv_connector_no_forward``
    sets a forward context without attention metadata)."""
    return forward_context is not None and getattr(forward_context, "attn_metadata", True) is None


def wait_for_loads(sides: Sequence[_LoadWaiter], budget_s: float) -> None:
    """Wait, within ``budget_s`` in all, for the oldest load job of each side that has one."""
    deadline = time.monotonic() + budget_s
    for side in sides:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        side.wait_for_load(left)
