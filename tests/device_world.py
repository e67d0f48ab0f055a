"""A transfer engine over a stack of tiers on the CUDA stand-in, with the checks a device needs.

``DeviceWorld(standin, tiers, write=...)`` builds a KV cache on ``cuda:0``, the tiers named in
``tiers`` (``"gpu"``: a pool on ``cuda:0``; ``"gpu1"``: a pool on ``cuda:1``; ``"cpu"``: a pinned
host pool; ``"bytes"``: a byte tier in a dict), a manager and a transfer engine. Its ``store`` and
``load`` run one job to its end and check, on the stand-in's log, that

* nothing a kvtier thread queued on a device is still unordered with the host once the job is
  reported (so the engine may reuse or read its blocks, and every row the job used, at once);
* nothing a tier call queued still touches that call's rows once the call has returned
  (``audit`` wraps each tier's ``write_blocks`` / ``read_blocks``);
* a load fills its leading run with the bytes stored under those keys (``check_load``).

``Faults`` makes chosen calls raise: ``faults.arm(site, n)`` fails the ``n``-th call at ``site``
(``"gather"``, ``"scatter"``, ``"gather_chunk"``, ``"scatter_chunk"``, ``"write:<tier>"``,
``"read:<tier>"``), once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from kvtier.backends.memory import CpuBackend, GpuBackend
from test_transfer import DictBackend

from kvtier.backend import Backend, BlockFormat, MemoryBackend
from kvtier.devices import tensor_device
from kvtier.manager import TierManager, TierSpec
from kvtier.manager.policies import LRUPolicy
from kvtier.transfer import TransferEngine
from kvtier.transfer.jobs import Applied, JobResult, apply_result
from kvtier.transfer.layout import KVLayout
from kvtier.transfer.staging import StagedCopier

if TYPE_CHECKING:
    from cuda_standin import CudaStandIn, Op

HANG_GUARD = 30.0  # seconds; a job still unfinished then is a failure (no deadline is set)


class InjectedFault(RuntimeError):
    """What an armed fault raises."""


class Faults:
    """Counts calls per site and raises at the armed ones."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.armed: set[tuple[str, int]] = set()
        self.fired: list[tuple[str, int]] = []

    def arm(self, site: str, n: int) -> None:
        self.armed.add((site, n))

    def hit(self, site: str) -> None:
        n = self.calls.get(site, 0)
        self.calls[site] = n + 1
        if (site, n) in self.armed:
            self.armed.discard((site, n))
            self.fired.append((site, n))
            raise InjectedFault(f"injected fault at {site} call {n}")


class BytesTier(DictBackend):
    """A byte tier in a dict. A device row comes to the host by a blocking copy, as a record
    encoder's ``.cpu()`` does."""

    name = "bytes"

    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        host = [b.to("cpu") if tensor_device(b).type != "cpu" else b for b in blocks]
        return super().write_blocks(keys, host)


class DeviceWorld:
    """See the module doc."""

    def __init__(
        self,
        standin: CudaStandIn,
        tiers: Sequence[str],
        *,
        blocks: Sequence[int] | None = None,
        write: str = "back",
        num_blocks: int = 16,
        block_words: int = 64,
        staging_blocks: int = 4,
        chunk_blocks: int = 1,
        faults: Faults | None = None,
        seed: int = 0,
    ) -> None:
        self.s = standin
        self.faults = faults or Faults()
        g = torch.Generator().manual_seed(seed)
        self.cache = torch.randint(0, 256, (num_blocks, block_words), dtype=torch.uint8, generator=g).to("cuda")
        self.layout = KVLayout([self.cache], staging_bytes=4 * chunk_blocks * block_words)
        fmt = BlockFormat(block_bytes=self.layout.block_bytes)
        caps = list(blocks) if blocks is not None else [4] * len(tiers)
        self.backends: list[Backend] = []
        specs = []
        for i, (kind, cap) in enumerate(zip(tiers, caps)):
            nbytes = cap * fmt.block_bytes
            backend: Backend
            if kind == "gpu":
                backend = GpuBackend(capacity=nbytes, device="cuda:0")
            elif kind == "gpu1":
                backend = GpuBackend(capacity=nbytes, device="cuda:1")
            elif kind == "cpu":
                backend = CpuBackend(capacity=nbytes)
            elif kind == "bytes":
                backend = BytesTier(capacity=nbytes)
            else:
                raise ValueError(f"unknown tier kind {kind!r}")
            asyncio.run(backend.open(fmt))
            self.audit(backend, i)
            self.backends.append(backend)
            specs.append(TierSpec(f"{kind}{i}", nbytes, fmt.block_bytes, LRUPolicy(cap)))
        self.manager = TierManager(specs, write=write)  # type: ignore[arg-type]
        self.engine = TransferEngine(self.layout, self.backends, staging_blocks=staging_blocks)
        self._inject_copies()
        #: the bytes stored under each key (the engine block's bytes when it was saved)
        self.stored: dict[bytes, torch.Tensor] = {}
        self.violations: list[str] = []

    # -- instrumentation -------------------------------------------------------------------------
    def audit(self, backend: Backend, tier: int) -> None:
        """Wrap the tier's bulk calls: faults first, then the after-return check."""
        for call in ("write_blocks", "read_blocks"):
            inner = getattr(backend, call)
            site = f"{call.split('_')[0]}:{tier}"
            setattr(backend, call, self._audited(inner, site, f"tier {tier} {call}"))

    def _audited(self, inner: Callable[..., Any], site: str, what: str) -> Callable[..., Any]:
        def call(keys: Sequence[bytes], rows: Sequence[torch.Tensor]) -> Any:
            self.faults.hit(site)
            try:
                return inner(keys, rows)
            finally:
                self.quiet(what, rows)

        return call

    def _inject_copies(self) -> None:
        layout, faults = self.layout, self.faults
        for name, site in (("gather", "gather"), ("scatter", "scatter")):
            inner = getattr(layout, name)

            def wrapped(*args: Any, _inner: Callable[..., Any] = inner, _site: str = site, **kwargs: Any) -> Any:
                faults.hit(_site)
                return _inner(*args, **kwargs)

            setattr(layout, name, wrapped)
        copier = layout.staging
        for name, site in (("_gather_chunk", "gather_chunk"), ("_scatter_chunk", "scatter_chunk")):
            inner = getattr(StagedCopier, name)

            def chunk(*args: Any, _inner: Callable[..., Any] = inner, _site: str = site, **kwargs: Any) -> Any:
                faults.hit(_site)
                return _inner(copier, *args, **kwargs)

            setattr(copier, name, chunk)

    def quiet(self, what: str, rows: Sequence[torch.Tensor] = ()) -> Op:
        """Mark the host now; note every device op of a kvtier thread logged before it that is
        not ordered before it (with ``rows``: only those touching one of them)."""
        mark = self.s.mark(f"after {what}", on_host=True)
        with self.s._lock:
            log = [op for op in self.s.log if op.seq < mark.seq and op.stream is not None]
        log = [op for op in log if op.thread.startswith("kvtier-")]
        if rows:
            log = [op for op in log if any(self.s.touches(op, r) for r in rows)]
        for op in log:
            if not self.s.happens_before(op, mark):
                self.violations.append(f"{op} still queued {what}")
        return mark

    # -- jobs ------------------------------------------------------------------------------------
    def record(self, block: int) -> torch.Tensor:
        return self.cache[block].clone()

    def store(self, keys: Sequence[bytes], ids: Sequence[int]) -> tuple[JobResult, Applied] | None:
        plan = self.manager.prepare_store(list(keys))
        if plan is None:
            return None
        want = {k: self.record(b) for k, b in zip(keys, ids)}
        chosen = [ids[list(keys).index(k)] for k in plan.keys]
        (result,) = self.engine.wait([self.engine.submit_store(plan, chosen)], timeout=HANG_GUARD)
        self.quiet(f"store job {result.job_id} was reported")
        applied = apply_result(self.manager, plan, result)
        failed = set(result.failed.get(plan.tier, ())) if result.error is None else set(plan.keys)
        for k in plan.keys:
            if k not in failed:
                self.stored[k] = want[k]
        self.engine.wait_idle(HANG_GUARD)
        return result, applied

    def load(self, keys: Sequence[bytes], ids: Sequence[int]) -> tuple[JobResult, Applied] | None:
        hits = self.manager.lookup(list(keys))
        if hits == 0:
            return None
        plan = self.manager.prepare_load(list(keys[:hits]), promote=False)
        (result,) = self.engine.wait([self.engine.submit_load(plan, list(ids[:hits]))], timeout=HANG_GUARD)
        self.quiet(f"load job {result.job_id} was reported")
        applied = apply_result(self.manager, plan, result)
        self.check_load(plan.keys, ids, applied.done)
        self.engine.wait_idle(HANG_GUARD)
        return result, applied

    def check_load(self, keys: Sequence[bytes], ids: Sequence[int], done: int) -> None:
        for k, b in list(zip(keys, ids))[:done]:
            if not torch.equal(self.cache[b], self.stored[k]):
                self.violations.append(f"block {b} holds wrong bytes for key {k.hex()[:8]}")

    def close(self) -> None:
        self.engine.close()
        for b in self.backends:
            asyncio.run(b.aclose())


def pool_of(backend: Backend) -> torch.Tensor:
    assert isinstance(backend, MemoryBackend)
    return backend.pool
