"""Torch's process-wide settings that change the float math of a CPU forward pass, for tests that
compare runs bit for bit.

Every setting here is global to the process (or to the calling thread), so a test that changed
one and did not set it back changes the bits of every later test in the same pytest process,
and of none run alone. :func:`numerics` reads them all; :func:`default_numerics` runs a block
with each one at torch's default (and fails, naming it, on a torch function or dispatch mode left
on, which no setting can undo) and sets back what it found.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["DEFAULTS", "default_numerics", "numerics"]

#: torch's defaults for the settings :func:`default_numerics` sets. Each one changes the last bits
#: of this module's chat when set otherwise (matmul precision "medium": 2.4e-5 in a logprob; the
#: fused attention off, so the math kernel runs: 8.7e-6), or could (the rest).
DEFAULTS: dict[str, Any] = {
    "float32_matmul_precision": "highest",
    "mkldnn": True,
    "flash_sdp": True,  # the CPU's fused attention kernel obeys this flag too
    "math_sdp": True,
    "mem_efficient_sdp": True,
    "deterministic": False,
    "default_dtype": torch.float32,
    "grad": True,
}


def numerics() -> dict[str, Any]:
    """The settings as they are now, on this thread (grad and inference mode, the modes and the
    intra-op thread count are the calling thread's)."""
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "mkldnn": torch.backends.mkldnn.enabled,
        "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
        "math_sdp": torch.backends.cuda.math_sdp_enabled(),
        "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "default_device": torch.get_default_device(),
        "grad": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "function_modes": torch._C._len_torch_function_stack(),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "intra_op_threads": torch.get_num_threads(),
    }


def _apply(values: dict[str, Any]) -> None:
    if torch.get_float32_matmul_precision() != values["float32_matmul_precision"]:
        torch.set_float32_matmul_precision(values["float32_matmul_precision"])
    torch.backends.mkldnn.enabled = values["mkldnn"]
    torch.backends.cuda.enable_flash_sdp(values["flash_sdp"])
    torch.backends.cuda.enable_math_sdp(values["math_sdp"])
    torch.backends.cuda.enable_mem_efficient_sdp(values["mem_efficient_sdp"])
    torch.use_deterministic_algorithms(values["deterministic"])
    torch.set_default_dtype(values["default_dtype"])
    torch.set_grad_enabled(values["grad"])


@contextmanager
def default_numerics() -> Iterator[dict[str, Any]]:
    """Run the block with every setting of :data:`DEFAULTS` at torch's default, denormals not
    flushed, and no inference mode or autocast on this thread; yields what was found before
    (for a failure message). Fails at once on a torch function or dispatch mode left on (a
    default device other than the CPU is one): a mode runs its own code for every op, and only
    the code that pushed it can take it off."""
    found = numerics()
    left = {k: found[k] for k in ("function_modes", "dispatch_modes", "inference_mode", "autocast_cpu") if found[k]}
    if left:
        raise AssertionError(f"an earlier test left torch state on this thread that changes every op: {left}")
    _apply(DEFAULTS)
    torch.set_flush_denormal(False)  # no getter: torch's default, not set back after
    try:
        yield found
    finally:
        _apply(found)
