"""The simulator's deterministic content: prefix hashes, the bytes the "model" writes into each
slot, and the namespace its records live under.

A whole run is a pure function of the workload and seed: the forward pass writes a hash of
``(position, prefix hash)`` expanded to the slot's bytes in bf16, differently in each layer, and
samples the next token from the prefix hash too.
"""

from __future__ import annotations

import torch

from kvtier.keys import Namespace

__all__ = ["kv_content", "mix", "prefix_hash", "sim_namespace"]

_MASK = (1 << 64) - 1
_SIM_REVISION = "sim-content-v1"  # part of the namespace: a change of kv_content must never hit old records


def mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def prefix_hash(previous: int, token: int) -> int:
    """Hash of a prefix extended by ``token`` (63 bits, so it fits an int64 tensor)."""
    return mix(previous ^ (token * 0x9E3779B97F4A7C15 & _MASK)) >> 1


def kv_content(position_hashes: torch.Tensor, layer: int, width: int) -> torch.Tensor:
    """The bf16 content of slots whose prefix hashes (one per slot, int64) are given, for one layer.

    Every value is finite (the exponent field stays below 0x7F), so bf16 round trips are exact.
    """
    cols = torch.arange(width, dtype=torch.int64) + (layer + 1) * 0x10001
    x = position_hashes.view(-1, 1) * 0x2545F4914F6CDD1D + cols.view(1, -1) * 0x5851F42D4C957F2D
    x = x ^ (x >> 29)
    x = x * 0x1656067
    x = x ^ (x >> 32)
    return (x & 0x3FFF).to(torch.int16).view(torch.bfloat16)



def sim_namespace(block_size: int, kv_layout: str) -> Namespace:
    """The simulator's namespace: ``block_size`` tokens per engine block (the layout carries
    ``engine_blocks_per_block``), and the content revision, so a change of :func:`kv_content`
    never hits old records."""
    return Namespace(
        model_id="kvtier-sim",
        revision=_SIM_REVISION,
        dtype="bfloat16",
        kv_layout=kv_layout,
        block_size=block_size,
    )
