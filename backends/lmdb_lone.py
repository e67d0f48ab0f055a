"""A lone save of one plain block, put joined, in one straight line (:class:`LoneSave`), and a
job of several such blocks in another (:meth:`LoneSave.save_job`).

Engines save mostly in jobs of one block, and a durable 4 KiB save is mostly its syncs: the
CPU between them is what a busy core delays. The general path (``LmdbWrites.write_blocks``)
spends it on the job's checks and views (``RowViews.of``), its record list
(``PlainReads.records``), a group-commit ticket (``GroupCommit.submit``) and a transaction loop
made for groups of jobs (``_commit_jobs``, ``_put_together``): measured with the syncs off, a
4 KiB save of one record took 13-22 µs of thread CPU where a raw ``put`` in its own
transaction took 6-9.

:meth:`LoneSave.save` takes a job of one key of an unkeyed, uncompressed store whose record is
put joined (at most :data:`~kvtier.backends.lmdb_entries.JOIN_MAX` bytes, head and block in one
value): the key's and the row's checks and view in one call
(:data:`~kvtier.backends.lmdb_plain.host_view`, a row whose view the store keeps); then, when no
commit runs and no batch waits (:meth:`GroupCommit.submit_alone`), under the write lock, one
write transaction in which, where the store's open probed LMDB's own put sound, the record is
written straight into the room that put reserves, as a job's records are (below: no ``bytes``
built and copied again by python-lmdb's put), and the commit. Where it is not so probed (or
``xxh3_joined`` is not the native build), the record is built whole first
(:func:`~kvtier.records.xxcopy.xxh3_joined`, the same bytes, before its transaction as the
general path builds a job of one record: a build that fails raises there) and put, with the
delete of the key's index entry while the index may hold a split one; where a commit runs or
batches wait, it is built so and the job joins them, as the general path's would. Durable, the
group commit's settle then syncs the meta page, as for every group: the save returns once the
block is on stable storage.

:meth:`LoneSave.save_job` takes a job of several keys of such a store the same way: every
key's and row's checks and view in one call (:data:`~kvtier.backends.lmdb_plain.job_views`,
rows whose views the store keeps), then, when no commit runs and no batch waits, under the
write lock, one write transaction in which each record is built just before its put (the
general path's order: a record's bytes are put while in this core's cache) and the split entry
the key may have deleted, in one call (:data:`~kvtier.backends.lmdb_plain.put_joined`), and the
commit. Where a commit runs or batches wait, its records are built whole at once and the job
joins them, as the general path's job would. Thread CPU, tier over raw puts and commit in the
same process, syncs off, three pairs alternated with the tree before (load 3.7-4.3): 4 KiB jobs
of 16 0.475, 0.539, 0.490 before, 0.660, 0.642, 0.638 after; 64 KiB 0.760, 0.761, 0.710 before,
0.781, 0.802, 0.813 after. What is left at 4 KiB is mostly the row checks (torch's own getters,
about 0.6 µs a record); the transaction costs what raw puts of records built by
``xxh3_joined`` cost.

Whether a job is written into the reserved room is decided once per store, at its open and
again whenever ``RESERVED_PUTS`` or ``put_reserved`` is set (``LoneSave.reserve_with``: the
builder whose bytes ``put_reserved`` writes, or ``None``), and both saves read that one answer,
against ``xxh3_joined`` as it is when the save runs (a test's builder builds its own records).

Anything else is the general path's, with nothing done: a key or row it does not take (the
general checks name what is wrong), a row not seen yet, rows stood in for a device's
(:data:`kvtier.devices.locate`). A failure in the
transaction (a full map, a record that fails to build, an LMDB error, LMDB refusing to begin
it) aborts it, and the same
job is committed again by the general ``_commit_jobs``, whose handling (one transaction per
record, a full map's retry, the counters, the errors) is then the save's: a failed transaction
commits nothing, so the second try starts from what the first found.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from kvtier.backends import lmdb_entries, lmdb_heap, lmdb_plain, lmdb_records
from kvtier.backends.lmdb_heap import keep_heap_for
from kvtier.backends.lmdb_one import forks as _forks

from kvtier import devices
from kvtier.keys import KEY_BYTES
from kvtier.pool_rows import PoolRows
from kvtier.records import xxcopy
from kvtier.records.counts import counts_add
from kvtier.records.record import HEADER

if TYPE_CHECKING:
    from kvtier.backends.group_commit import GroupCommit
    from kvtier.backends.lmdb_plain import RowViews
    from kvtier.backends.lmdb_records import PlainReads

    from kvtier.backend import BackendCounters

__all__ = ["LONE_SAVES", "RESERVED_PUTS", "ROWS_ASKED", "LoneSave", "put_joined", "views_stayed"]

log = logging.getLogger("kvtier.backends.lmdb_tier")

#: Lone jobs of one plain block go through :class:`LoneSave` first; ``False``: through the
#: general path alone (the path the tests compare it with).
LONE_SAVES = True
#: A job's records written straight into the room LMDB's own put reserves, where the store's open
#: probed that sound; ``False``: built and put through python-lmdb (``put_joined``, the path the
#: tests compare it with).
RESERVED_PUTS = True
#: A job's rows asked again in the call that copies (:meth:`LoneSave._commit_job`); ``False``:
#: not asked (what ``benchmarks/bench_save_recheck.py`` compares the cost of that question with).
ROWS_ASKED = True
_native = lmdb_plain._rowguard  # (None: not built, or a stale build)
put_reserved = _native.put_reserved if _native is not None else None
#: What each live :class:`LoneSave` decided at its open (``reserve_with``), decided again when a
#: flag it was decided from is set (:class:`_Flags`).
_LIVE: weakref.WeakSet[LoneSave] = weakref.WeakSet()
_DECIDED_FROM = frozenset({"RESERVED_PUTS", "put_reserved"})


def reserve_with(direct: object | None) -> Callable[..., bytes] | None:
    """The builder whose records a store with ``direct`` (what ``direct_gets`` gave at its open,
    or ``None``) writes into the room LMDB's own put reserves: the native ``xxh3_joined``, where
    the open probed that put sound, ``RESERVED_PUTS`` is on and ``put_reserved`` is built; else
    ``None`` (built and put through python-lmdb). A save is reserved only where
    ``xxcopy.xxh3_joined`` is that builder when it runs (``put_reserved`` writes the native
    build's bytes; another builder, a test's or the Python form, builds its records itself)."""
    if direct is None or not RESERVED_PUTS or put_reserved is None:
        return None
    return xxcopy.xxh3_joined_native
_U8 = torch.uint8
_TENSOR = torch.Tensor
_function_mode, _dispatch_modes = lmdb_plain.function_mode, lmdb_plain.dispatch_modes  # (modes_on, asked inline)
_NO_KEY = (bytes(KEY_BYTES),)  # (a lone save's key is checked before its row's views)


class _Store(Protocol):
    """What a lone save uses of its store (an ``LmdbWrites``)."""

    path: str
    counters: BackendCounters
    _closed: bool
    _forks: int
    _env: Any
    _blocks: Any
    _index: Any
    _splits: bool
    _listed: Any
    _write_lock: threading.Lock
    _commits: GroupCommit[Any, Any]

    def _env_or_raise(self) -> Any: ...

    def _begin_write(self, db: Any = None, buffers: bool = False) -> Any: ...

    def _guarded_env(self) -> Any: ...

    def _wrote(self) -> int | None: ...

    def _pages(self, record_bytes: int) -> int: ...

    def _commit_jobs(self, jobs: list[Any]) -> list[list[int | None]]: ...


class LoneSave:
    """Saves of jobs of plain blocks of one store, put joined (see the module doc)."""

    __slots__ = ("__weakref__", "commits", "direct", "head", "record", "reserve_with", "shape", "stored", "tier", "views")

    def __init__(self, tier: _Store, plain: PlainReads, views: RowViews, direct: object | None = None) -> None:
        """``plain`` and ``views``: the store's (its reader's), as the general path's saves use
        them. ``direct``: what :func:`~kvtier.backends.lmdb_direct.direct_gets` gave for the
        environment (a job's records are then written into the room LMDB's own put reserves),
        or ``None``."""
        self.tier = tier
        self.direct = direct
        self.commits = tier._commits
        self.head = plain.head  # the 24 checked head bytes every plain record of the store starts with
        self.shape, self.views = views.shape, views.views
        #: A joined record's bytes (head and block), and the map bytes it takes.
        self.record = HEADER.size + plain.size
        self.stored = tier._pages(self.record)
        #: The builder a job's records are written into the room LMDB's own put reserves with
        #: (:func:`reserve_with`), or ``None``: a job is reserved where ``xxcopy.xxh3_joined`` is
        #: this builder when it is saved (decided here and again whenever ``RESERVED_PUTS`` or
        #: ``put_reserved`` is set; the builder is asked at each save, as the general path builds
        #: with whatever ``xxh3_joined`` is then). Read by :meth:`save` and :meth:`save_job` alike.
        self.reserve_with = reserve_with(direct)
        _LIVE.add(self)

    def save(self, key: Any, row: Any) -> list[int | None] | None:
        """The job ``[key]``, ``[row]`` saved as ``write_blocks`` saves it (its sizes, its
        counters), or ``None`` with nothing done: the general path's job (see the module doc).
        ``row`` may be the job's rows given as one pool (a :class:`PoolRows` of one row).
        The errors of a closed store or one opened before a fork are the general path's."""
        if not LONE_SAVES or type(key) is not bytes or len(key) != KEY_BYTES or devices.locate is not None:
            return None
        if self.record > lmdb_entries.JOIN_MAX:
            return None  # put split: the general path's
        if _function_mode() or _dispatch_modes():  # (lmdb_plain.modes_on, written out: a frame fewer)
            return None  # a mode's handler may move the row once its address is read (lmdb_plain.python_in_torch)
        tier = self.tier
        # No collection from the row's checks to its copy (xxcopy.rows_hold: a finalizer run
        # between may free the row whose view is taken). Where LMDB's own put is probed sound,
        # the record is written into the room its put reserves, in the transaction, as a job's
        # records are (_commit_job: the hold let go there, before the group's settle); else, or
        # where a commit runs or batches wait, it is built here, before its transaction, as the
        # general path builds a job of one record (a build that fails raises here, as there),
        # and committed alone or with them, as the general path's job would be. The hold is
        # written out, not a ``with xxcopy.rows_held:``: the commit lets it go early (``held``,
        # xxcopy.rows_let_go_flag), and a hold object of its own for that flag cost ~210 ns a save more than
        # this list (benchmarks/bench_row_hold.py, flagged_object against flagged: 310 to 99 ns).
        held = [False]
        try:
            xxcopy.rows_hold_flag(held)  # (the hold and its flag in one call: an interrupt lands before both or after both)
            # The row's kept view (lmdb_plain.host_view); rows of one pool (a PoolRows of one):
            # the pool checked once, no view of the row made, its views holding its memory to the
            # copy (lmdb_plain.held_views)
            if type(row) is not PoolRows:
                view, taken = lmdb_plain.host_view(row, _TENSOR, _U8, self.shape, self.views), row
            else:
                viewed = lmdb_plain.held_views(_NO_KEY, row, self.shape, self.views)
                view, taken = (viewed[0], viewed.taken) if viewed is not None else (None, None)
            if view is None:
                return None  # not such a row, or one not seen yet: the general path makes its view
            # The store open in this process (LmdbBackend._env_or_raise asked inline, its errors
            # its own where it is not), then LMDB's own put where decided (reserve_with)
            if tier._closed or tier._env is None or tier._forks != _forks():
                tier._env_or_raise()
            commits = self.commits
            sizes = commits.submit_alone(((key,), (view,), held, taken, True), self._commit_job) if xxcopy.xxh3_joined is self.reserve_with else None
            if sizes is None:
                job = (key, b"", xxcopy.xxh3_joined(self.head, key, view))
                xxcopy.rows_let_go_flag(held)
                sizes = commits.submit_alone(job, self._commit)
                if sizes is None:
                    sizes = commits.submit([job])
        finally:
            xxcopy.rows_let_go_flag(held)
        if sizes[0] is not None:
            counts_add(tier.counters, "blocks_written", 1, "bytes_written", self.record)
        return sizes

    def save_job(self, keys: Any, rows: Any) -> list[int | None] | None:
        """The job ``keys``, ``rows`` (several keys) saved as ``write_blocks`` saves it (its
        sizes, its counters), or ``None`` with nothing done: the general path's job (a key or
        row it does not take, a row not seen yet; see the module doc)."""
        if not LONE_SAVES or devices.locate is not None or self.record > lmdb_entries.JOIN_MAX:
            return None
        if lmdb_plain.modes_on():
            return None  # a mode's handler may free a row whose view is taken (lmdb_plain.python_in_torch)
        # The rows held until the save returns: the views are by address and hold nothing (rows
        # of one pool as they are: lmdb_plain.job_views checks their pool once).
        keys, rows = tuple(keys), rows if type(rows) is PoolRows else tuple(rows)
        tier = self.tier
        # No collection from the first row's checks to the last copy (xxcopy.rows_hold: a
        # finalizer run between may free a row whose view is taken): let go once the records
        # are built, by the job's commit or here, not across the group's sync. Written out as
        # the lone save's is, for the same reason (an early let-go, cheapest with this flag).
        held = [False]
        try:
            xxcopy.rows_hold_flag(held)  # (the hold and its flag in one call: an interrupt lands before both or after both)
            views = lmdb_plain.held_views(keys, rows, self.shape, self.views)  # (rows of one pool: they hold its memory)
            if views is None:
                return None
            tier._env_or_raise()
            commits = self.commits
            reserving = xxcopy.xxh3_joined is self.reserve_with  # (the lone save's test)
            sizes = commits.submit_alone((keys, views, held, views.taken if type(rows) is PoolRows else rows, reserving), self._commit_job)
            if sizes is None:  # a commit runs or batches wait: built now, meanwhile, as the general path's
                head, joined, build = self.head, xxcopy.xxh3_joined, lmdb_records.build_joined
                records = [build(joined, head, key, view) for key, view in zip(keys, views)]
                if lmdb_records.all_built(records):  # (else one whose build failed: built from its view in the commit)
                    xxcopy.rows_let_go_flag(held)
                sizes = commits.submit(records)
        finally:
            xxcopy.rows_let_go_flag(held)
        stored = len(sizes) if None not in sizes else sum(size is not None for size in sizes)
        counts_add(tier.counters, "blocks_written", stored, "bytes_written", stored * self.record)
        return sizes

    def _commit_job(self, batches: list[tuple[Any, Any, list[bool], Any, bool]]) -> list[list[int | None]]:
        """``GroupCommit``'s commit of a job (its keys, their rows' views, its hold, what the views
        were taken of: the rows, or what a pool's checks kept, :attr:`HeldViews.taken`): under the
        store's write lock, one write transaction in which each record is written into the room
        LMDB's own put reserves (``put_reserved``, where the open probed that sound) or built just
        before its put (``put_joined``), and the split entries its keys may have deleted, then its
        commit; in one frame (a job of 16 records of 4 KiB costs about 25 µs: each call a frame
        fewer). On a failure in it (aborted, nothing committed), the general commit of the same job,
        its records built first (one that fails to build is built in that commit's transaction, its
        failure its own), whose try and handling are then the save's (a transaction LMDB will not
        begin is that commit's to fail too). Then the job's rows' hold let go (before the group's
        settle).

        The wait for the write lock and ``env.begin`` let the GIL go, and so does each put of
        python-lmdb's: another thread may move the rows meanwhile (``pool.resize_`` to more rows
        frees the memory their views point at, which no hold keeps). So the rows' addresses are
        asked again (:data:`views_stayed`: one ``data_ptr()`` for a :class:`PoolRows`' pool, against
        its address when its checks took the views, one a row for others) in the call that copies,
        the GIL held from the check to the copy: by ``put_reserved`` once begun, by ``put_joined``
        before each build. Where they moved, the job is not saved (a miss, never freed memory stored
        under a good checksum): its transaction aborted, each key's size ``None``, counted in
        ``write_failures``. Taking the views again where the rows are now, as a read goes on into
        them, would run the rows' checks again inside the write transaction, under the lock every
        writer waits for, for a save the engine may simply make again."""
        ((keys, views, held, taken, reserving),) = batches
        tier, asked = self.tier, taken if ROWS_ASKED else None
        try:
            with tier._write_lock:
                tier._listed = None
                keep = len(keys) * (self.stored + self.record)
                if keep > lmdb_heap._kept:  # (lmdb_writes: the commit's freed pages and built records kept; asked inline, a frame fewer once kept)
                    keep_heap_for(keep)
                blocks, index, unindex, txn = tier._blocks, tier._index, tier._splits, None
                try:
                    txn = tier._begin_write(blocks, True)  # (closed: BackendError, data.mdb cut short: DiskError; the general commit's again)
                    # Each record written where LMDB's own put reserved its room, in the pass
                    # that copies and hashes its block: one copy a block, not two
                    # (backends/_lmdbput.c); the same bytes as put_joined's.
                    done = put_reserved(self.direct, tier._env, txn, blocks, index, unindex, self.head, keys, views, asked) if reserving else False
                    if done is False:
                        done = put_joined(txn.put, txn.delete if unindex else None, index, self.head, keys, views, xxcopy.xxh3_joined, asked)
                    if done is None:  # a row moved since its view was taken: nothing of the job put
                        txn.abort()
                        return [self._moved(len(keys))]
                    txn.commit()
                    tier._wrote()
                    return [[self.stored] * len(keys)]
                except Exception:
                    if txn is not None:
                        txn.abort()
                except BaseException:
                    if txn is not None:
                        txn.abort()
                    raise
            # (built here, the rows asked again first: the general commit waits for the lock again)
            if asked is not None and not views_stayed(asked, views):
                return [self._moved(len(keys))]
            head, joined, build = self.head, xxcopy.xxh3_joined, lmdb_records.build_joined
            return tier._commit_jobs([[build(joined, head, key, view) for key, view in zip(keys, views)]])
        finally:
            xxcopy.rows_let_go_flag(held)

    def _moved(self, count: int) -> list[int | None]:
        """The sizes of a job of ``count`` keys not saved because its rows moved (see
        :meth:`_commit_job`), counted."""
        counts_add(self.tier.counters, "write_failures", count)
        log.debug("lmdb: a job of %d blocks not saved: its rows moved during the save", count)
        return [None] * count

    def _commit(self, batches: list[tuple[bytes, bytes, bytes]]) -> list[list[int | None]]:
        """``GroupCommit``'s commit of the lone job: its record put and committed in one write
        transaction; on a failure in it, the general commit of the same job."""
        (job,) = batches
        if self._transact(self.stored, _put_record, job):  # (lmdb_writes: the commit's freed pages kept)
            return self.tier._commit_jobs([[job]])
        return [[self.stored]]

    def _transact(self, keep: int, put: Callable[[LoneSave, Any, Any], None], job: Any) -> bool:
        """Under the store's write lock, ``put(self, txn, job)`` in one write transaction, then
        its commit: whether an ``Exception`` failed it (it is aborted, nothing committed: the
        caller hands the same job to the general commit, whose try and handling are then the
        save's; a transaction LMDB will not begin is that commit's to fail too). ``keep``: the
        heap bytes the commit may need kept (``keep_heap_for``)."""
        tier = self.tier
        with tier._write_lock:
            tier._listed = None
            keep_heap_for(keep)
            txn = None
            try:
                txn = tier._begin_write(tier._blocks, True)  # (closed: BackendError, data.mdb cut short: DiskError; the general commit's again)
                put(self, txn, job)
                txn.commit()
                tier._wrote()
            except Exception:
                if txn is not None:
                    txn.abort()
                return True
            except BaseException:
                if txn is not None:
                    txn.abort()
                raise
        return False


def _put_record(lone: LoneSave, txn: Any, job: tuple[bytes, bytes, bytes]) -> None:
    """The lone job's record put, and the key's index entry deleted where the index may hold a
    split record's entry for it."""
    key, tier = job[0], lone.tier
    txn.put(key, job[2])
    if tier._splits:
        txn.delete(key, b"", tier._index)


def put_joined_python(put: Any, delete: Any, index: Any, head: bytes, keys: Sequence[bytes], views: Sequence[Any], joined: Callable[..., bytes], taken: Any = None) -> bool | None:
    """:data:`put_joined` in Python: the same calls, in the same order, and answers."""
    if len(keys) != len(views):
        raise ValueError(f"put_joined: {len(keys)} keys but {len(views)} views")
    for i, (key, view) in enumerate(zip(keys, views)):
        if taken is not None and not views_stayed_python(taken, views, i, i + 1):
            return None
        put(key, joined(head, key, view))
        if delete is not None:
            delete(key, b"", index)
    return True


def views_stayed_python(taken: Any, views: Sequence[Any], first: int = 0, end: int | None = None) -> bool:
    """:data:`views_stayed` in Python, of ``views[first:end]``: ``taken`` a pool and its address
    when its rows' views were taken (``(pool, address)``: the pool asked once), else each row
    asked (the rows, a :class:`PoolRows` among them, or the one row of a job of one; what a
    pool's native checks kept cannot be asked here: ``False``)."""
    stop = len(views) if end is None else end
    if any(type(views[i]) is not memoryview for i in range(first, stop)):
        return False
    if type(taken) is tuple and len(taken) == 2 and type(taken[1]) is int:
        try:
            return bool(taken[0].data_ptr() == taken[1])
        except Exception:  # (a pool that cannot be asked is not where it was)
            return False
    for i in range(first, stop):
        try:
            row = taken[i] if type(taken) in (PoolRows, tuple, list) else taken if i == 0 else None
            if row.data_ptr() != xxcopy._address(views[i]):
                return False
        except Exception:  # (a row that cannot be asked is not where its view was)
            return False
    return True


#: ``put_joined(put, delete, index, head, keys, views, joined, taken=None)``: for each key, in
#: order, ``put(key, joined(head, key, view))``, then ``delete(key, b"", index)`` unless
#: ``delete`` is ``None``: a job's records each built just before its put, in one call (native:
#: ``backends/_rowsave.c``). ``True``; ``None`` where the rows ``taken`` (what the views were
#: taken of; ``None``: not asked) moved before a record's build (:data:`views_stayed`, asked
#: before each: the put before it let the GIL go), that record and those after it not put.
put_joined: Callable[..., bool | None] = _native.put_joined if _native is not None else put_joined_python
#: ``views_stayed(taken, views)``: whether each view still starts where its row is now, asked
#: after a step that let the GIL go, in which a pool grown in place (``pool.resize_``) frees the
#: memory the views point at. ``taken``: what the views were taken of: what a pool's checks kept
#: (:attr:`~kvtier.backends.lmdb_plain.HeldViews.taken`, native: the pool asked once, against
#: its address then), a tuple or list of tensors or a :class:`PoolRows` (each row asked), or the
#: one row of a job of one (native: ``backends/_rowsave.c``, the reads' ``host_rows_stayed``).
views_stayed: Callable[..., bool] = _native.views_stayed if _native is not None else views_stayed_python


class _Flags(types.ModuleType):
    """This module, whose ``RESERVED_PUTS`` and ``put_reserved``, set by whoever sets them (a
    test's ``monkeypatch`` and its undo among them), make every live :class:`LoneSave` decide its
    ``reserve_with`` again, so that no save reads a decision made from flags since changed.
    (Reads of the module's names are the plain module's: its own code reads them as globals.)"""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _DECIDED_FROM:
            for lone in list(_LIVE):
                lone.reserve_with = reserve_with(lone.direct)


sys.modules[__name__].__class__ = _Flags
