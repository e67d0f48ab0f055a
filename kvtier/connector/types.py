"""Value types shared by the two halves of the connector.

The scheduler side and the worker side of a connector usually live in different processes, so
everything that crosses between them is a frozen value with a canonical msgpack encoding
(``to_bytes`` / ``from_bytes``): :class:`StepMetadata` goes from the scheduler to every worker,
:class:`WorkerOutput` comes back from each worker. No pickle is involved, so a metadata blob
can only ever decode into these types, and a malformed one raises :class:`ConnectorError`
(a ``ValueError``) rather than executing anything.

``StepMetadata.deletes`` and ``WorkerOutput.released`` were added within wire version 1 as
optional trailing elements: each is written only when not empty, so a message without them
encodes to the same bytes as before, and a blob without them decodes with ``()``.

:class:`Request` is the small protocol an engine's request object satisfies (usually with a few
properties), and :class:`SchedulerStep` is what an engine reports about one scheduler step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import msgpack

from kvtier.errors import KVTierError
from kvtier.manager import Demotion, LoadPlan, StorePlan

__all__ = [
    "ConnectorError",
    "ConnectorUpdate",
    "JobReport",
    "LoadJob",
    "Request",
    "SchedulerStep",
    "StepMetadata",
    "StoreJob",
    "WorkerOutput",
]

# Bumped whenever the wire layout changes; a blob of another version is refused, never guessed at.
WIRE_VERSION = 1


class ConnectorError(KVTierError, ValueError):
    """A connector message or call that does not fit the contract."""


@runtime_checkable
class Request(Protocol):
    """What the connector reads from an engine request.

    The connector keeps a reference to the object it was handed and reads these attributes
    again at every step, so they must reflect the request's current state.

    - ``token_ids``: every token the *scheduler* knows (prompt and output so far). Under async
      scheduling the newest sampled token may still be missing; keys simply catch up later.
    - ``num_computed_tokens``: slots whose K/V the engine has written (before this step's work).
    - ``block_ids``: the request's engine block table, in token order.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True, slots=True)
class SchedulerStep:
    """One scheduler step as the connector needs to see it.

    ``allocated_block_ids`` lists every engine block id handed out in this step: new
    allocations of any request *and* copy-on-write destinations. It drives the fence: a store
    job still reading one of these blocks must be flushed before the step's compute overwrites
    it. ``finished_request_ids`` and ``preempted_request_ids`` are the requests that finished
    since the previous step and those preempted (blocks freed) in this one.
    """

    step: int
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    allocated_block_ids: Sequence[int] = ()
    finished_request_ids: Sequence[str] = ()
    preempted_request_ids: Sequence[str] = ()


# -- scheduler -> workers ----------------------------------------------------------------------
def _keys(value: Any, what: str) -> tuple[bytes, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(k, bytes) for k in value):
        raise ConnectorError(f"{what}: expected a list of byte keys")
    return tuple(value)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConnectorError(f"{what}: expected a list of integers")
    return tuple(value)


def _encode_store_plan(plan: StorePlan) -> list[Any]:
    # ``skipped`` is scheduler-side bookkeeping; workers never need it.
    return [
        plan.plan_id,
        list(plan.keys),
        list(plan.positions),
        plan.tier,
        [[t, list(ks)] for t, ks in plan.write_through],
        [[t, list(ks)] for t, ks in plan.drops],
        [[d.src, d.dst, list(d.keys)] for d in plan.demotions],
    ]


def _tier_key_lists(value: Any, what: str) -> tuple[tuple[int, tuple[bytes, ...]], ...]:
    if not isinstance(value, (list, tuple)):
        raise ConnectorError(f"{what}: expected a list of [tier, keys] pairs")
    out: list[tuple[int, tuple[bytes, ...]]] = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ConnectorError(f"{what}: expected a list of [tier, keys] pairs")
        tier, keys = item
        if not isinstance(tier, int) or isinstance(tier, bool) or tier < 0:
            raise ConnectorError(f"{what}: a tier must be a non-negative integer, got {tier!r}")
        out.append((tier, _keys(keys, what)))
    return tuple(out)


def _decode_store_plan(raw: Any) -> StorePlan:
    try:
        plan_id, keys, positions, tier, through, drops, demotions = raw
        return StorePlan(
            plan_id=int(plan_id),
            keys=_keys(keys, "plan.keys"),
            positions=_ints(positions, "plan.positions"),
            tier=int(tier),
            write_through=tuple((int(t), _keys(ks, "plan.write_through")) for t, ks in through),
            drops=tuple((int(t), _keys(ks, "plan.drops")) for t, ks in drops),
            demotions=tuple(Demotion(int(s), int(d), _keys(ks, "plan.demotions")) for s, d, ks in demotions),
        )
    except (TypeError, ValueError) as exc:
        raise ConnectorError(f"store plan: malformed ({exc})") from None


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Copy ``plan.keys`` out of the engine blocks ``block_ids`` (``n`` ids per key)."""

    job_id: int
    request_id: str
    plan: StorePlan
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Fill the engine blocks ``block_ids`` (``n`` ids per key) from ``plan``."""

    job_id: int
    request_id: str
    plan: LoadPlan
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """What every worker must do for one step.

    ``stores`` are built this step and, unless flushed, submitted at the start of the *next*
    step (after this step's compute, so token generation is not slowed). ``loads`` are submitted
    at once. ``jobs_to_flush`` are store jobs whose source blocks are about to be overwritten:
    the worker submits each one still unsubmitted (even one built in this very step) and waits
    for it before the step's compute. ``stores`` are in build order, which is the order workers
    submit them in; stores of finished requests (whose blocks are already complete) come first.

    Built by :meth:`SchedulerConnector.build_immediate_meta` instead, it is run at once by
    :meth:`WorkerConnector.run_now`: stores submitted right away, loads waited for. The wire
    form is the same.

    ``deletes`` lists, per tier, keys whose bytes every worker must drop: keys of a job that
    did not succeed on every worker (a store that failed on one rank but was written on
    another, a key one rank could not load), which the scheduler side's manager no longer holds
    in that tier. The worker runs them on its store queue *before* this step's stores (and after
    every store of earlier steps), so the store queue executes deletes and stores in exactly the
    order the scheduler decided them: a delete never overtakes an earlier write of the key and
    a later re-store of the key never runs before it. Deleting an absent key is a no-op.
    """

    step: int
    stores: tuple[StoreJob, ...] = ()
    loads: tuple[LoadJob, ...] = ()
    jobs_to_flush: tuple[int, ...] = ()
    deletes: tuple[tuple[int, tuple[bytes, ...]], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.stores and not self.loads and not self.jobs_to_flush and not self.deletes

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [
                WIRE_VERSION,
                self.step,
                [[j.job_id, j.request_id, _encode_store_plan(j.plan), list(j.block_ids)] for j in self.stores],
                [
                    [
                        j.job_id,
                        j.request_id,
                        list(j.plan.keys),
                        list(j.plan.tiers),
                        list(j.plan.promote),
                        list(j.block_ids),
                    ]
                    for j in self.loads
                ],
                list(self.jobs_to_flush),
                # Optional trailing element (see the module docstring): absent when empty.
                *([[[t, list(ks)] for t, ks in self.deletes]] if self.deletes else []),
            ],
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StepMetadata:
        raw = _unpack(data, "step metadata")
        if not isinstance(raw, list) or len(raw) not in (5, 6):
            raise ConnectorError("step metadata: expected [version, step, stores, loads, flush(, deletes)]")
        version, step, stores, loads, flush = raw[:5]
        _check_version(version, "step metadata")
        deletes = _tier_key_lists(raw[5], "deletes") if len(raw) == 6 else ()
        try:
            return cls(
                step=int(step),
                stores=tuple(
                    StoreJob(int(jid), str(rid), _decode_store_plan(plan), _ints(ids, "stores.block_ids"))
                    for jid, rid, plan, ids in stores
                ),
                loads=tuple(
                    LoadJob(
                        int(jid),
                        str(rid),
                        LoadPlan(
                            _keys(keys, "loads.keys"), _ints(tiers, "loads.tiers"), _keys(promote, "loads.promote")
                        ),
                        _ints(ids, "loads.block_ids"),
                    )
                    for jid, rid, keys, tiers, promote, ids in loads
                ),
                jobs_to_flush=_ints(flush, "jobs_to_flush"),
                deletes=deletes,
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConnectorError):
                raise
            raise ConnectorError(f"step metadata: malformed ({exc})") from None


# -- workers -> scheduler ----------------------------------------------------------------------
def _tier_keys(mapping: Mapping[int, Sequence[bytes]]) -> list[list[Any]]:
    return [[int(t), list(ks)] for t, ks in mapping.items()]


@dataclass(frozen=True, slots=True)
class JobReport:
    """One worker's result for one job (see :class:`kvtier.transfer.JobResult`)."""

    job_id: int
    kind: Literal["store", "load"]
    success: bool
    nbytes: int = 0
    failed: Mapping[int, tuple[bytes, ...]] = field(default_factory=dict)
    missed: tuple[bytes, ...] = ()
    missed_tiers: tuple[int, ...] = ()
    sizes: Mapping[int, Mapping[bytes, int]] = field(default_factory=dict)
    error: str | None = None

    def _encode(self) -> list[Any]:
        return [
            self.job_id,
            self.kind,
            self.success,
            self.nbytes,
            _tier_keys(self.failed),
            list(self.missed),
            list(self.missed_tiers),
            [[int(t), [[k, int(s)] for k, s in per.items()]] for t, per in self.sizes.items()],
            self.error,
        ]

    @classmethod
    def _decode(cls, raw: Any) -> JobReport:
        try:
            jid, kind, success, nbytes, failed, missed, missed_tiers, sizes, error = raw
            if kind not in ("store", "load"):
                raise ConnectorError(f"job report: unknown kind {kind!r}")
            return cls(
                job_id=int(jid),
                kind=kind,
                success=bool(success),
                nbytes=int(nbytes),
                failed={int(t): _keys(ks, "failed") for t, ks in failed},
                missed=_keys(missed, "missed"),
                missed_tiers=_ints(missed_tiers, "missed_tiers"),
                sizes={int(t): {bytes(k): int(s) for k, s in per} for t, per in sizes},
                error=None if error is None else str(error),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConnectorError):
                raise
            raise ConnectorError(f"job report: malformed ({exc})") from None


@dataclass(frozen=True, slots=True)
class WorkerOutput:
    """What one worker reports after a step: the jobs it saw finish, with their results.

    ``released`` lists store jobs, still running, that no longer read the engine's blocks on
    this worker (their device read ended; their tier writes go on). Once every worker released
    a job, the scheduler side lifts its fence (``ConnectorUpdate.unfenced``) before the job
    completes, so a slow or stalled tier never holds engine blocks."""

    rank: int = 0
    finished: tuple[JobReport, ...] = ()
    released: tuple[int, ...] = ()

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [
                WIRE_VERSION,
                self.rank,
                [r._encode() for r in self.finished],
                # Optional trailing element (as StepMetadata.deletes): absent when empty.
                *([list(self.released)] if self.released else []),
            ],
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> WorkerOutput:
        raw = _unpack(data, "worker output")
        if not isinstance(raw, list) or len(raw) not in (3, 4):
            raise ConnectorError("worker output: expected [version, rank, finished(, released)]")
        version, rank, finished = raw[:3]
        _check_version(version, "worker output")
        if not isinstance(finished, list):
            raise ConnectorError("worker output: finished must be a list")
        released = _ints(raw[3], "worker output: released") if len(raw) == 4 else ()
        return cls(rank=int(rank), finished=tuple(JobReport._decode(r) for r in finished), released=released)


@dataclass(frozen=True, slots=True)
class ConnectorUpdate:
    """What the engine must act on after :meth:`SchedulerConnector.update_connector_output`.

    ``loaded[request_id]`` is the number of leading tokens whose K/V is now valid in the
    request's blocks; when it is below what ``get_num_new_matched_tokens`` promised, the engine
    recomputes the rest (a failed or partial load is never an error). ``freed`` lists finished
    requests whose blocks the engine kept (``delay_free``) and may free now. ``unfenced`` lists
    engine blocks that no store job reads any more (in this update their last reader was
    acknowledged, or every worker released it: done reading, tier writes still going on): an
    engine that fences by reference count unpins them.
    """

    loaded: Mapping[str, int] = field(default_factory=dict)
    freed: tuple[str, ...] = ()
    unfenced: tuple[int, ...] = ()


def _unpack(data: bytes, what: str) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ConnectorError(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise ConnectorError(f"{what}: not a valid msgpack message ({exc})") from None


def _check_version(version: Any, what: str) -> None:
    if version != WIRE_VERSION:
        raise ConnectorError(f"{what}: wire version {version!r} is not supported (expected {WIRE_VERSION})")
