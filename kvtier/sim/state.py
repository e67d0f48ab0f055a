"""The engine's state: its block pool (ref counts, free queue, its own prefix cache) and the
requests it tracks."""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["BlockPool", "SimRequest"]


class BlockPool:
    """Engine blocks with ref counts, a free queue and the engine's own prefix cache."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks from the front of the free queue, or ``None`` (and no change)."""
        if count > len(self._free):
            return None
        out = []
        for _ in range(count):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of[b]
            if h is not None:  # reallocation evicts the block from the prefix cache
                self._hash_of[b] = None
                if self._cached.get(h) == b:
                    del self._cached[h]
                self.evictions += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def lookup(self, hashes: list[int]) -> list[int]:
        """Blocks of the leading run of ``hashes`` held by the prefix cache (not yet taken)."""
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def count_free(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if self._refs[b] == 0)

    def take(self, blocks: list[int]) -> None:
        """Share cached ``blocks`` with one more request."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Release a request's blocks, tail first: its prefix stays cached the longest."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
            elif self._refs[b] < 0:
                raise AssertionError(f"block {b} freed twice")

    def cache(self, block: int, h: int) -> None:
        if h not in self._cached and self._hash_of[block] is None:
            self._cached[h] = block
            self._hash_of[block] = h


class SimRequest:
    """One request as the engine tracks it; satisfies :class:`kvtier.connector.Request`."""

    __slots__ = (
        "admit_len",
        "block_ids",
        "hashes",
        "hidden",
        "load_base",
        "max_tokens",
        "num_computed_tokens",
        "num_output",
        "request_id",
        "session",
        "status",
        "tokens",
        "turn",
    )

    def __init__(
        self, request_id: str, prompt: list[int], prompt_hashes: list[int], max_tokens: int, session: int, turn: int
    ) -> None:
        self.request_id = request_id
        self.tokens = prompt
        self.hashes = prompt_hashes
        self.max_tokens = max_tokens
        self.num_output = 0
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = "waiting"
        self.hidden = 0  # sampled tokens the scheduler has not seen yet (async scheduling)
        self.admit_len = 0
        self.load_base = 0
        self.session = session
        self.turn = turn

    @property
    def token_ids(self) -> list[int]:
        return self.tokens[: len(self.tokens) - self.hidden] if self.hidden else self.tokens
