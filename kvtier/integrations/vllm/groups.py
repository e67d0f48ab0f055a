"""Several KV-cache groups of one vLLM engine (hybrid models: sliding-window and full-attention
layers), each offloaded as a kvtier store of its own.

vLLM's hybrid allocator gives every group its own block table over one block pool: a
group's block ``b`` is its layers' page ``b`` (the groups' layers may share one tensor, each
group using other block ids). vLLM names a block of group ``g`` by an offload key that ends
with ``g`` (``make_offload_key``), hands the manager the keys of all groups in one list, and
hands the worker one :class:`GPULoadStoreSpec` whose ``block_ids`` are the groups' blocks one
group after the other (``group_sizes[i]`` of group ``i``, from the request's block
``block_indices[i]`` on).

What kvtier does with that:

* **One store per group on every rank**: one :class:`~kvtier.transfer.layout.KVLayout` over
  the group's own tensors, one record size (the group's bytes per block, chunk of
  ``blocks_per_chunk`` blocks), one manager on the scheduler side. Records of two groups never
  alias, three ways over: their offload keys differ (the group index is part of them), each
  group's namespace names the group (``kv_layout`` carries ``group<g>``), and each group keeps
  its records apart (``<path>/r<rank>-of-<world>-g<g>``, a Redis ``prefix`` ending ``.g<g>``).
  One group keeps the names it always had (no ``-g`` suffix, the same namespace), so records
  written before stay valid. A tier's ``capacity`` is shared by the groups in proportion to
  their bytes per block, so every group holds the same number of blocks.
* **Transfers split by the group sizes vLLM sends** (:class:`WorkerGroups`): each group's
  blocks go with that group's plan; the vLLM job is finished when every group's part is.
* **Chunks whose leading blocks are null** (a sliding-window group whose window has moved past
  them: vLLM leaves their ids out of a store and says where the first one starts): the chunk
  is *not stored* (a miss; its key fails on every rank alike, counted
  ``null_chunks_not_stored``). A record holds a whole chunk, and bytes of blocks that were
  null when it was written could later be loaded into a block a request holds: wrong KV. A
  load never writes a block the request holds outside its range (see ``chunk_block_ids``).
* **Failed loads**: vLLM 0.32 refuses block-level load errors (``invalid_block_ids``) when
  there are several groups (block ids are unique only within a group) and raises in its
  scheduler. With several groups a load that did not bring every block back is reported as a
  failed receive of its request (:meth:`WorkerGroups.take_failed_loads`; the connector puts
  it in ``failed_recving``): vLLM then recomputes the request from its first token. With one
  group the failed blocks are reported as before (vLLM recomputes from the first of them).
* **Mamba state** is refused at start (:func:`check_kv_cache_groups`): its one block per
  request is a state that is overwritten in place as tokens arrive, not a prefix of blocks.

Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.config import StoreConfig
from kvtier.connector.ledger import Deletes
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.announce import OffloadKeyLog, adopted_announcements
from kvtier.integrations.vllm.deadlines import Abandoned, ResultDeadlines
from kvtier.integrations.vllm.engines import SchedulerEngine
from kvtier.integrations.vllm.follow import SharedFollowing
from kvtier.integrations.vllm.group_config import check_kv_cache_groups, group_layout, group_shares, group_tiers
from kvtier.integrations.vllm.ranks import RankTiers, build_manager
from kvtier.integrations.vllm.scheduler_side import DEFAULT_RESULT_DEADLINE_S, SchedulerSide
from kvtier.integrations.vllm.worker_side import WorkerSide
from kvtier.keys import Namespace, fold_block_hashes
from kvtier.manager import LoadPlan, StorePlan
from kvtier.manager.plan import TagWrites
from kvtier.transfer import JobResult

__all__ = [
    "RankGroups",
    "SchedulerGroups",
    "WorkerGroups",
    "check_kv_cache_groups",
    "group_layout",
    "group_shares",
    "group_tiers",
    "offload_group",
    "summed",
]

log = logging.getLogger("kvtier.vllm")

#: (rank, group position, "store" or "load", plan or load id, JobResult): one job part of one rank
GroupResult = tuple[int, int, str, int, JobResult]


def summed(counters: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Counters of several groups' engines, added up."""
    out: dict[str, int] = {}
    for mine in counters:
        for name, value in mine.items():
            out[name] = out.get(name, 0) + value
    return out


def offload_group(key: bytes) -> int:
    """The KV-cache group index vLLM packs into an offload key (its last 4 bytes, big-endian:
    ``vllm.v1.kv_offload.base.make_offload_key``)."""
    return int.from_bytes(bytes(key[-4:]), "big")


@dataclass(frozen=True)
class RankGroups:
    """What worker ``rank`` opened, one :class:`RankTiers` per offloaded KV-cache group (in
    ``group_ids`` order, vLLM's ``OffloadingConfig.groups``); sent to the scheduler side."""

    rank: int
    world_size: int
    group_ids: tuple[int, ...]
    groups: tuple[RankTiers, ...]


def _split(block_ids: Sequence[Any], group_sizes: Sequence[int] | None, num_groups: int) -> list[list[int]]:
    ids = [int(b) for b in block_ids]
    sizes = list(group_sizes) if group_sizes is not None else [len(ids)]
    if len(sizes) != num_groups or sum(sizes) != len(ids):
        raise ValueError(f"{len(ids)} block ids in groups of {sizes}, expected {num_groups} groups")
    out, start = [], 0
    for size in sizes:
        out.append(ids[start : start + size])
        start += size
    return out


class WorkerGroups:
    """One rank's worker sides, one per offloaded KV-cache group, behind vLLM's job ids: a job
    is split by vLLM's group sizes and is finished when every group's part is. Never raises
    into vLLM: a job that cannot be split fails as a whole."""

    def __init__(self, sides: Sequence[WorkerSide]) -> None:
        self.sides = list(sides)
        self._lock = threading.Lock()
        #: vLLM job id -> [parts left, success, bytes, seconds]
        self._pending: dict[int, list[Any]] = {}
        self._settled: list[tuple[int, bool, int, float]] = []
        #: (group position, store plan id) -> (key left out, tiers it was to be written to)
        self._left_out: dict[tuple[int, int], tuple[bytes, tuple[int, ...]]] = {}
        self._failed_loads: set[int] = set()

    def _expect(self, job_id: int, parts: int) -> None:
        with self._lock:
            if parts:
                self._pending[job_id] = [parts, True, 0, 0.0]
            else:
                self._settled.append((job_id, True, 0, 0.0))

    def _fail(self, job_id: int, kind: str, exc: Exception) -> None:
        log.warning("kvtier: %s job %d could not be split by KV-cache group: %s", kind, job_id, exc)
        with self._lock:
            # vLLM asserts that a job succeeded; a store without results fails on the scheduler
            # side (missing rank), a load is reported as a failed receive (take_failed_loads).
            self._settled.append((job_id, True, 0, 0.0))
            if kind == "load":
                self._failed_loads.add(job_id)
        for side in self.sides:
            side._engine.counters["submit_failed"] += 1

    def _parts(
        self,
        job_id: int,
        kind: str,
        parts: int,
        block_ids: Sequence[Any],
        group_sizes: Sequence[int] | None,
        block_indices: Sequence[int] | None,
    ) -> tuple[list[list[int]], list[int]] | None:
        """Each group's block ids and first block index of a job of ``parts`` group parts, or
        None when vLLM's ids do not split by its sizes (the job failed: nothing was written,
        nothing read; a store without this rank's results fails on the scheduler side)."""
        try:
            per_group = _split(block_ids, group_sizes, len(self.sides))
        except ValueError as exc:
            self._fail(job_id, kind, exc)
            return None
        starts = [int(i) for i in block_indices] if block_indices is not None else [0] * len(self.sides)
        self._expect(job_id, parts)
        return per_group, starts

    def submit_store(
        self,
        job_id: int,
        plans: Sequence[tuple[int, StorePlan]],
        block_ids: Sequence[Any],
        group_sizes: Sequence[int] | None,
        block_indices: Sequence[int] | None,
    ) -> None:
        split = self._parts(job_id, "store", len(plans), block_ids, group_sizes, block_indices)
        if split is not None:
            per_group, starts = split
            for gpos, plan in plans:
                plan, ids = self._whole_chunks(gpos, plan, per_group[gpos], starts[gpos])
                self.sides[gpos].submit_store(job_id, plan, ids)

    def _whole_chunks(self, gpos: int, plan: StorePlan, ids: list[int], first_index: int) -> tuple[StorePlan, list[int]]:
        """Leave out the first chunk of a store when its leading blocks are null (vLLM left
        their ids out): see the module doc. Its key is reported failed with the result."""
        side = self.sides[gpos]
        n = side._n
        skip = first_index % n
        if not skip or not plan.keys or len(ids) != len(plan.keys) * n - skip:
            return plan, ids  # whole chunks (a count that does not fit fails in the transfer engine)
        first = plan.keys[0]
        tiers = (plan.tier, *(t for t, keys in plan.write_through if first in keys))
        with self._lock:
            self._left_out[(gpos, plan.plan_id)] = (first, tiers)
        side._engine.counters["null_chunks_not_stored"] += 1
        reduced = dataclasses.replace(
            plan,
            keys=plan.keys[1:],
            positions=plan.positions[1:],
            write_through=tuple((t, tuple(k for k in keys if k != first)) for t, keys in plan.write_through),
        )
        return reduced, ids[n - skip :]

    def submit_load(
        self,
        job_id: int,
        loads: Sequence[tuple[int, int, LoadPlan]],
        block_ids: Sequence[Any],
        group_sizes: Sequence[int] | None,
        block_indices: Sequence[int] | None,
    ) -> None:
        split = self._parts(job_id, "load", len(loads), block_ids, group_sizes, block_indices)
        if split is not None:
            per_group, starts = split
            for gpos, load_id, plan in loads:
                self.sides[gpos].submit_load(job_id, load_id, plan, per_group[gpos], starts[gpos])

    def finished(self) -> list[tuple[int, bool, int, float]]:
        """(vLLM job id, success, bytes, seconds) of every job whose parts have all finished."""
        parts = [entry for side in self.sides for entry in side.finished()]
        with self._lock:
            out, self._settled = self._settled, []
            for job_id, success, nbytes, seconds in parts:
                entry = self._pending.get(job_id)
                if entry is None:
                    out.append((job_id, success, nbytes, seconds))
                    continue
                entry[0] -= 1
                entry[1] = entry[1] and success
                entry[2] += nbytes
                entry[3] = max(entry[3], seconds)
                if entry[0] == 0:
                    del self._pending[job_id]
                    out.append((job_id, entry[1], entry[2], entry[3]))
        return out

    def take_results(self, rank: int) -> list[GroupResult]:
        """This rank's results of the job parts reported by ``finished`` since the last call."""
        out: list[GroupResult] = []
        for gpos, side in enumerate(self.sides):
            for kind, plan_id, result in side.take_outbox():
                with self._lock:
                    left_out = self._left_out.pop((gpos, plan_id), None) if kind == "store" else None
                if left_out is not None:
                    result = _with_failed(result, *left_out)
                out.append((rank, gpos, kind, plan_id, result))
        return out

    def submit_deletes(self, deletes: Sequence[tuple[int, Deletes]], tags: Sequence[tuple[int, TagWrites]] = ()) -> None:
        """Each group's deletes and tenant tags (see :meth:`WorkerSide.submit_deletes`)."""
        tags_of = {gpos: group_tags for gpos, group_tags in tags}
        deletes_of = {gpos: group_deletes for gpos, group_deletes in deletes}
        for gpos in sorted(set(deletes_of) | set(tags_of)):
            if 0 <= gpos < len(self.sides):
                self.sides[gpos].submit_deletes(deletes_of.get(gpos, ()), tags_of.get(gpos, ()))

    def abandon(self, notices: Sequence[tuple[int, Sequence[Abandoned]]]) -> None:
        """Settle the job parts each group's scheduler side gave up on (see :mod:`.deadlines`)."""
        for gpos, group_notices in notices:
            if 0 <= gpos < len(self.sides):
                self.sides[gpos].abandon(group_notices)

    def take_failed_block_ids(self) -> set[int]:
        """Engine blocks whose load failed, with one group; with several none (block ids are
        unique only within a group, and vLLM 0.32 raises on them: see take_failed_loads)."""
        bad = set().union(*(side.take_failed_block_ids() for side in self.sides))
        return bad if len(self.sides) == 1 else set()

    def take_failed_loads(self) -> set[int]:
        """vLLM job ids of loads to report as failed receives: with several groups, every load
        that did not bring every block back; with one, loads that could not be split (a
        failed block is reported by id then, and vLLM recomputes from it on)."""
        with self._lock:
            bad, self._failed_loads = self._failed_loads, set()
        by_parts = set().union(*(side.take_failed_loads() for side in self.sides))
        return bad | by_parts if len(self.sides) > 1 else bad

    def wait(self, job_ids: Collection[int]) -> None:
        for side in self.sides:
            side.wait(job_ids)


def _with_failed(result: JobResult, key: bytes, tiers: tuple[int, ...]) -> JobResult:
    failed = {t: tuple(keys) for t, keys in result.failed.items()}
    for t in tiers:
        failed[t] = (*failed.get(t, ()), key)
    return dataclasses.replace(result, keys=(key, *result.keys), failed=failed)


class _Group:
    """One group's scheduler state: its manager and side, the fold of its offload keys into
    kvtier keys (namespace of the group), and the offload key of each kvtier key stored."""

    def __init__(self, engine: SchedulerEngine, side: SchedulerSide, namespace: Namespace, cap: int) -> None:
        self.engine = engine
        self.side = side
        self.namespace = namespace
        self.cap = cap
        self.key_cache: OrderedDict[bytes, bytes] = OrderedDict()  # offload key -> kvtier key
        self.offload_key: OrderedDict[bytes, bytes] = OrderedDict()  # kvtier key -> offload key

    def kkey(self, key: bytes) -> bytes:
        k = self.key_cache.get(key)
        if k is None:
            k = fold_block_hashes([bytes(key)], namespace=self.namespace)[0]
            self.key_cache[key] = k
            if len(self.key_cache) > self.cap:
                self.key_cache.popitem(last=False)
        return k

    def remember(self, kkeys: Collection[bytes], keys: Collection[bytes]) -> None:
        for k, v in zip(kkeys, keys):
            self.offload_key[k] = v
            self.offload_key.move_to_end(k)
        while len(self.offload_key) > self.cap:
            self.offload_key.popitem(last=False)


class SchedulerGroups:
    """The scheduler side of all offloaded KV-cache groups of one engine: routes every offload
    key to its group's manager (by the group index in the key) and settles every job part with
    every rank's result. Until :meth:`adopt` every lookup misses and nothing is stored."""

    def __init__(
        self,
        engines: Sequence[SchedulerEngine],
        store_cfg: StoreConfig,
        key_log: OffloadKeyLog,
        namespace_of: Callable[[int, str], Namespace],
        *,
        result_deadline_s: float = DEFAULT_RESULT_DEADLINE_S,
        shared: SharedFollowing | None = None,
    ) -> None:
        self.engines = list(engines)
        #: shared tiers followed live, and the offload keys of other engines' blocks (.follow)
        self.shared = shared
        self._deadline_s = result_deadline_s
        self._position = {e.group: i for i, e in enumerate(self.engines)}
        self._store_cfg = store_cfg
        self._key_log = key_log
        self._namespace_of = namespace_of
        self.groups: list[_Group] = []
        #: per group: whether each tier is a memory tier
        self.memory_tiers: tuple[bool, ...] = ()
        self.tier_names: tuple[str, ...] = ()
        self.shared_tiers: tuple[bool, ...] = ()
        self._tier_index: dict[str, int] = {}

    @property
    def ready(self) -> bool:
        return bool(self.groups)

    def adopt(self, ranks: Mapping[int, RankGroups]) -> list[tuple[int, bytes]]:
        """Build each group's manager from what every rank opened; returns the (tier, offload
        key) of every adopted block the offload key log names (announced as stored)."""
        group_ids = tuple(e.group for e in self.engines)
        for r, desc in ranks.items():
            if desc.group_ids != group_ids:
                raise ConfigError(f"kvtier: rank {r} opened KV-cache groups {desc.group_ids}, expected {group_ids}")
        groups: list[_Group] = []
        adopted_keys: dict[int, list[bytes]] = {}
        at_start: list[tuple[int, int, list[bytes]]] = []
        orphaned = 0
        for gpos, engine in enumerate(self.engines):
            per_rank = {r: desc.groups[gpos] for r, desc in ranks.items()}
            manager, orphans, adopted = build_manager(per_rank, self._store_cfg)
            side = SchedulerSide(engine, manager, ResultDeadlines(engine.world_size, self._deadline_s))
            for tier, keys in orphans.items():
                side.ledger.remember(tier, keys)
            orphaned += sum(len(k) for k in orphans.values())
            engine.manager = manager
            # Head-group records: the ranks' own namespace, the same at every TP size.
            engine.namespace = per_rank[0].key_namespace or self._namespace_of(gpos, per_rank[0].layout)
            engine.memory_tiers = tuple(t.memory for t in per_rank[0].tiers)
            engine.counters["blocks_adopted"] = sum(len(keys) for keys in adopted.values())
            cap = max(
                1024,
                4 * sum(manager.tier_spec(i).capacity_bytes // manager.tier_spec(i).block_reserve for i in range(manager.num_tiers)),
            )
            groups.append(_Group(engine, side, engine.namespace, cap))
            for tier, keys in adopted.items():
                adopted_keys.setdefault(tier, []).extend(keys)
                at_start.append((gpos, tier, keys))
        first = groups[0].engine
        assert first.manager is not None
        self.memory_tiers = first.memory_tiers
        self._tier_index = {first.manager.tier_spec(i).name: i for i in range(first.manager.num_tiers)}
        #: per tier: its name and whether other engines write it too (KV events name both)
        self.tier_names = tuple(first.manager.tier_spec(i).name for i in range(first.manager.num_tiers))
        self.shared_tiers = tuple(room.shared for room in ranks[min(ranks)].groups[0].tiers)
        # Tell routers which blocks this process already holds (vLLM named them in an earlier
        # process; the log next to the persistent tier remembers their offload keys).
        events, keep = adopted_announcements(adopted_keys, self._key_log.load())
        for k, v in keep.items():
            at = self._position.get(offload_group(v))
            if at is not None:
                groups[at].remember([k], [v])
        self._key_log.rewrite(keep)
        first.counters["blocks_announced"] = len(keep)
        self.groups = groups
        if self.shared is not None:
            described = [ranks[min(ranks)].groups[gpos] for gpos in range(len(groups))]
            self.shared.start(group_ids, described, [g.engine.manager for g in groups])
            for gpos, tier, keys in at_start:  # adopted blocks the log does not name: ask the directory
                for key in keys:
                    if key not in keep:
                        self.shared.ask(gpos, key, tier)
        log.info(
            "kvtier: scheduler side of engine %s over %d ranks, %d KV-cache groups: %d blocks adopted, %d orphan records to delete",
            first.engine_id,
            len(ranks),
            len(groups),
            sum(len(k) for k in adopted_keys.values()),
            orphaned,
        )
        return events

    def _by_group(self, keys: Sequence[bytes]) -> Iterator[tuple[int, list[int]]]:
        """(group position, indices into ``keys``) of each group with keys, in group order;
        keys of a group that is not offloaded are left out (logged)."""
        parts: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            gpos = self._position.get(offload_group(key))
            if gpos is None:
                log.warning("kvtier: offload key of KV-cache group %d, which is not offloaded; ignored", offload_group(key))
                continue
            parts.setdefault(gpos, []).append(i)
        yield from sorted(parts.items())

    def lookup(self, key: bytes) -> bool:
        gpos = self._position.get(offload_group(key))
        if not self.groups or gpos is None:
            self.engines[0].counters["lookup_misses"] += 1
            return False
        group = self.groups[gpos]
        assert group.engine.manager is not None
        hit = group.engine.manager.lookup_key(group.kkey(key))
        group.engine.counters["lookup_hits" if hit else "lookup_misses"] += 1
        return hit

    def prepare_load(self, keys: Sequence[bytes], request_id: str | None = None) -> tuple[tuple[int, int, LoadPlan], ...]:
        loads = []
        for gpos, idx in self._by_group(keys):
            group = self.groups[gpos]
            sub = [keys[i] for i in idx]
            kkeys = [group.kkey(k) for k in sub]
            load_id, plan = group.side.prepare_load(kkeys, request_id)
            group.remember(kkeys, sub)
            loads.append((gpos, load_id, plan))
        return tuple(loads)

    def touch(self, keys: Sequence[bytes]) -> None:
        for gpos, idx in self._by_group(keys):
            group = self.groups[gpos]
            assert group.engine.manager is not None
            group.engine.manager.touch([group.kkey(keys[i]) for i in idx])

    def complete_load(self, keys: Sequence[bytes]) -> None:
        for gpos, idx in self._by_group(keys):
            group = self.groups[gpos]
            group.side.complete_load([group.kkey(keys[i]) for i in idx])

    def request_finished(self, request_id: str) -> None:
        """vLLM request ``request_id`` ended (finished or aborted): its open loads are settled
        once no rank reads for them (see :mod:`.scheduler_side`)."""
        for group in self.groups:
            group.side.request_finished(request_id)

    def prepare_store(
        self, keys: Sequence[bytes], tenant: str | None = None
    ) -> tuple[list[bytes], tuple[tuple[int, StorePlan], ...]] | None:
        """The keys to store (``tenant``'s: its usage, under its quotas) and each group's plan,
        or None when no group can store any."""
        chosen: list[bytes] = []
        plans = []
        for gpos, idx in self._by_group(keys):
            group = self.groups[gpos]
            sub = [keys[i] for i in idx]
            plan = group.side.prepare_store([group.kkey(k) for k in sub], tenant)
            if plan is None:
                continue
            picked = [sub[p] for p in plan.positions]
            if plan.keys:
                group.remember(plan.keys, picked)
            chosen.extend(picked)
            plans.append((gpos, plan))
        return (chosen, tuple(plans)) if plans else None

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> list[tuple[bytes, bytes]]:
        """Settle the store plans of ``keys``; the (kvtier key, offload key) of each block stored."""
        pairs: list[tuple[bytes, bytes]] = []
        for gpos, idx in self._by_group(keys):
            group = self.groups[gpos]
            stored = group.side.complete_store([group.kkey(keys[i]) for i in idx], success)
            pairs.extend((k, group.offload_key[k]) for k in stored if k in group.offload_key)
        if self.shared is not None:
            self.shared.publish(pairs)
        return pairs

    def worker_output(self, results: Collection[GroupResult], counts: Mapping[int, int]) -> dict[int, int]:
        """One step's worker output (every rank's results, vLLM's completion counts by job id):
        each group's side takes its results; returns the counts vLLM may apply, those every
        group allows (a job id a group does not know passes it unchanged)."""
        if not self.groups:
            return dict(counts)
        per_group: list[list[tuple[int, str, int, JobResult]]] = [[] for _ in self.groups]
        for rank, gpos, kind, plan_id, result in results:
            if 0 <= gpos < len(per_group):
                per_group[gpos].append((rank, kind, plan_id, result))
        allowed = dict(counts)
        for group, mine in zip(self.groups, per_group):
            ok = group.side.worker_output(mine, counts)
            allowed = {j: min(c, ok[j]) for j, c in allowed.items() if j in ok}
        return allowed

    def receive(self, results: Collection[GroupResult]) -> None:
        """Results without vLLM's counts (tests below vLLM)."""
        self.worker_output(results, {})

    def issued(
        self,
        job_id: int,
        kind: str,
        parts: Sequence[tuple[int, int]],
        block_ids: Sequence[Any] = (),
        group_sizes: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> None:
        """vLLM hands job ``job_id`` (``parts``: group position, plan or load id) of request
        ``request_id`` to every rank: each part's result deadline starts (a load's part with its
        group's GPU blocks)."""
        per_group: list[list[int]] = [[] for _ in self.groups]
        if kind == "load":
            try:
                per_group = _split(block_ids, group_sizes, len(self.groups))
            except ValueError:
                pass  # the workers fail the job as a whole (WorkerGroups)
        for gpos, plan_id in parts:
            if 0 <= gpos < len(self.groups):
                side = self.groups[gpos].side
                side.deadlines.issued(job_id, kind, plan_id, tuple(per_group[gpos]))
                if kind == "load" and request_id is not None:
                    side.attach(plan_id, request_id)

    def take_notices(self) -> tuple[tuple[int, tuple[Abandoned, ...]], ...]:
        """Each group's notices of job parts given up on (connector metadata)."""
        out = []
        for gpos, group in enumerate(self.groups):
            notices = group.side.take_notices()
            if notices:
                out.append((gpos, notices))
        return tuple(out)

    def close(self) -> None:
        """Stop following the shared tiers (the scheduler side shuts down)."""
        if self.shared is not None:
            self.shared.close()

    def take_deletes(self) -> tuple[tuple[int, Deletes], ...]:
        return tuple((g, d) for g, d in ((g, group.side.take_deletes()) for g, group in enumerate(self.groups)) if d)

    def take_tags(self) -> tuple[tuple[int, TagWrites], ...]:
        """Each group's tenant tags and pin changes for the ranks to save (with the deletes)."""
        return tuple((g, t) for g, t in ((g, group.side.take_tags()) for g, group in enumerate(self.groups)) if t)

    def take_events(self) -> Iterator[tuple[bytes, int, bool]]:
        """(offload key, tier index, removed) of each block the managers stored or removed."""
        for gpos, group in enumerate(self.groups):
            mgr = group.engine.manager
            assert mgr is not None
            for event in mgr.take_events():
                vkey = group.offload_key.get(event.key)
                if vkey is None:  # adopted from another engine: its offload key is looked up
                    if event.kind == "stored" and self.shared is not None:
                        self.shared.ask(gpos, event.key, self._tier_index.get(event.tier, 0))
                    continue
                if event.kind == "removed" and mgr.status(event.key).tier is None:
                    group.offload_key.pop(event.key, None)
                yield vkey, self._tier_index.get(event.tier, 0), event.kind == "removed"
        for gpos, key, vkey, tier in self.shared.take_found() if self.shared is not None else ():
            group = self.groups[gpos]
            assert group.engine.manager is not None
            if group.engine.manager.status(key).tier is not None:  # still held: announce it
                group.remember([key], [vkey])
                yield vkey, tier, False
