"""What a simulated engine is (:class:`SimConfig`, its KV cache) and what a run did (:class:`SimReport`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvtier.errors import ConfigError

__all__ = ["SimConfig", "SimReport", "make_caches"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Shape of the simulated engine. ``block_size`` is tokens per engine block; one offloaded
    block spans ``engine_blocks_per_block`` engine blocks."""

    block_size: int = 8
    engine_blocks_per_block: int = 2
    num_gpu_blocks: int = 256
    num_layers: int = 4
    head_dim: int = 32
    max_num_batched_tokens: int = 512
    max_running: int = 8
    async_scheduling: bool = False
    #: The engine's own GPU prefix cache; off, every reused prefix must come from kvtier.
    prefix_caching: bool = True
    store_last_block_at_finish: bool = True
    #: Promote lower-tier hits into the first tier after a load (the connector's ``promote``).
    promote: bool = True
    answer_mean: int = 40  # expected answer length (the model's EOS rate)
    vocab_size: int = 32000
    eos_token: int = 2
    #: Wait for each step's transfers before reporting (deterministic results); engines poll.
    wait_for_transfers: bool = True
    max_steps: int = 200_000

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "engine_blocks_per_block",
            "num_gpu_blocks",
            "num_layers",
            "head_dim",
            "max_num_batched_tokens",
            "max_running",
            "answer_mean",
            "max_steps",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"sim.{name}: expected a positive integer, got {value!r}")

    @property
    def width(self) -> int:
        """bf16 values per slot and layer (K and V side by side)."""
        return 2 * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SimConfig:
        return cls(**dict(data))


def make_caches(config: SimConfig) -> list[torch.Tensor]:
    """The engine's paged KV cache: one bf16 tensor per layer, ``[blocks, block_size, 2*head_dim]``."""
    return [
        torch.zeros((config.num_gpu_blocks, config.block_size, config.width), dtype=torch.bfloat16)
        for _ in range(config.num_layers)
    ]


@dataclass(slots=True)
class SimReport:
    """What a run did. ``corrupt_blocks``, ``fence_violations``, ``live_request_states``,
    ``live_jobs`` and ``fenced_blocks`` must all be 0 after a correct run."""

    workload: str = ""
    requests: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    #: Every admission's tokens: the prompts, plus each preempted request's tokens again when
    #: it is readmitted. Equals gpu_hit + loaded + recomputed + preempted_unfinished_tokens.
    prefill_tokens: int = 0
    gpu_hit_tokens: int = 0
    loaded_tokens: int = 0
    loaded_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    #: Tokens of readmissions after a preemption (part of ``prefill_tokens``).
    reprefill_tokens: int = 0
    #: Tokens admitted for prefill whose request was preempted before they were computed; they
    #: are prefilled again (and counted again) when it is readmitted.
    preempted_unfinished_tokens: int = 0
    #: The store's tiers, fastest first: name, backend, capacity_bytes, path (persistent tiers),
    #: and where it happened: outages and up_at_end (a server that went away), write_failures.
    tiers: list[dict[str, Any]] = field(default_factory=list)
    #: Records removed from persistent tiers before the run (``run_sim(empty_persistent=True)``).
    emptied_records: int = 0
    decode_tokens: int = 0
    #: Per admission, the leading prompt tokens an unbounded cache of every block this run had
    #: computed or loaded so far would serve (measured on this run's own schedule).
    oracle_hit_tokens: int = 0
    #: Loaded tokens of blocks no step of this run computed: stored by an earlier process
    #: (``--keep-disk``); always 0 when the persistent tiers start empty.
    earlier_process_tokens: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    stored_blocks: int = 0
    last_block_jobs: int = 0
    flushed_jobs: int = 0
    deferred_lookups: int = 0
    preemptions: int = 0
    load_missed_blocks: int = 0
    verified_blocks: int = 0
    corrupt_blocks: int = 0
    fence_violations: int = 0
    live_request_states: int = 0
    live_jobs: int = 0
    fenced_blocks: int = 0
    seconds: float = 0.0

    @property
    def hit_tokens(self) -> int:
        return self.gpu_hit_tokens + self.loaded_tokens

    @property
    def ok(self) -> bool:
        return not (
            self.corrupt_blocks
            or self.fence_violations
            or self.live_request_states
            or self.live_jobs
            or self.fenced_blocks
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hit_tokens"] = self.hit_tokens
        data["ok"] = self.ok
        return data
