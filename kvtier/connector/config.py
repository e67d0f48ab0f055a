"""How the connector cuts the engine's cache into offloaded blocks (:class:`ConnectorConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.connector.types import ConnectorError

__all__ = ["ConnectorConfig"]


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """How the engine's cache is cut into offloaded blocks.

    ``block_size`` is the engine's tokens per engine block; one offloaded block spans
    ``engine_blocks_per_block`` engine blocks. ``key_source="block_hashes"`` folds the engine's
    own chained block hashes (``request.block_hashes``, one per engine block) instead of
    hashing token ids. ``store_last_block_at_finish=False`` disables the finish walk (for
    measurement only: it loses every block completed by a request's last steps).
    ``step_loop=False`` is for engines that never call ``build_connector_meta`` (see
    ``docs/integrating.md``): ``request_finished`` then trusts ``request.num_computed_tokens``.
    ``promote=False`` turns off promotion of lower-tier hits into the first tier (for
    measurement). ``ack_deadline_s`` (``world_size > 1``): a store job that some workers
    reported and others did not within that many seconds is given up at the next
    ``update_connector_output`` (a dead or stuck rank): it counts as failed, its keys are
    released; its fence stays up until the missing workers are done reading its blocks.
    Loads are never given up (a worker may still write into the engine's blocks).
    """

    block_size: int
    engine_blocks_per_block: int = 1
    world_size: int = 1
    store_last_block_at_finish: bool = True
    key_source: Literal["tokens", "block_hashes"] = "tokens"
    step_loop: bool = True
    promote: bool = True
    ack_deadline_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "engine_blocks_per_block", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConnectorError(f"connector.{name}: expected a positive integer, got {value!r}")
        deadline = self.ack_deadline_s
        if deadline is not None and (
            not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or not deadline >= 0
        ):
            raise ConnectorError(f"connector.ack_deadline_s: expected seconds >= 0 or None, got {deadline!r}")
        if self.key_source not in ("tokens", "block_hashes"):
            raise ConnectorError(f"connector.key_source: expected 'tokens' or 'block_hashes', got {self.key_source!r}")

    @property
    def block_tokens(self) -> int:
        """Tokens per offloaded block."""
        return self.block_size * self.engine_blocks_per_block
