"""Per-request state of the scheduler side, and the keys of a request's offloaded blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.connector.config import ConnectorConfig
from kvtier.connector.types import ConnectorError, Request
from kvtier.keys import Namespace, block_keys, fold_block_hashes

__all__ = ["KeyChain", "RequestState"]


@dataclass(slots=True, eq=False)
class RequestState:
    """What the scheduler side remembers about one request until it is finished and idle."""

    request: Request
    keys: list[bytes] = field(default_factory=list)
    #: offloaded blocks [0, stored) are stored, being stored, or were present. It advances only
    #: when a store plan is made: a refused store is retried, and nothing is stored past a gap.
    stored: int = 0
    #: the job-table generation at the last refused store (see ``JobTable.generation``).
    refused_at: int = -1
    jobs: set[int] = field(default_factory=set)
    load_job: int | None = None
    intent: tuple[int, int, int] | None = None  # (first block, end block, tokens already valid)
    scheduled: bool = False
    finished: bool = False
    delay_free: bool = False
    final_block_ids: tuple[int, ...] = ()
    final_computed: int = 0


class KeyChain:
    """Extends a request's block keys as its tokens (or the engine's block hashes) arrive."""

    __slots__ = ("_block_tokens", "_hashes", "_n", "namespace")

    def __init__(self, namespace: Namespace, config: ConnectorConfig) -> None:
        self.namespace = namespace
        self._n = config.engine_blocks_per_block
        self._block_tokens = config.block_tokens
        self._hashes = config.key_source == "block_hashes"

    def extend(self, st: RequestState, want: int) -> None:
        """Make sure ``st.keys`` covers ``want`` offloaded blocks where the request allows it."""
        have = len(st.keys)
        if have >= want:
            return
        req = st.request
        if self._hashes:
            hashes = getattr(req, "block_hashes", None)
            if hashes is None:
                raise ConnectorError(
                    f"request {req.request_id!r}: key_source='block_hashes' needs request.block_hashes"
                )
            n = self._n
            want = min(want, len(hashes) // n)
            if want > have:
                picked = [hashes[(i + 1) * n - 1] for i in range(have, want)]
                st.keys.extend(fold_block_hashes(picked, namespace=self.namespace))
            return
        bt = self._block_tokens
        tokens = req.token_ids
        want = min(want, len(tokens) // bt)
        if want > have:
            parent = st.keys[-1] if have else None
            st.keys.extend(
                block_keys(list(tokens[have * bt : want * bt]), block_size=bt, namespace=self.namespace, parent=parent)
            )
