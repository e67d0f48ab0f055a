"""Where an ``lmdb`` tier keeps a record's parts, and how a job of records is read back.

Three layouts are read; the first two are written:

* **joined** (records of at most :data:`~kvtier.backends.lmdb_entries.JOIN_MAX` bytes, head
  and payload): ``blocks[key]`` holds the whole record (head, then payload) and ``index`` holds
  nothing for it. A save is one B-tree put, a load one lookup. The head costs a staging copy of
  the payload (python-lmdb has no ``MDB_RESERVE``), which at 4-64 KiB is cheaper than the second
  tree: raw python-lmdb, durable, jobs of 16, a load with one lookup ran at 1.03 of a raw get at
  4 KiB against 0.69 with the index lookup too (``benchmarks/bench_disk_sizes.py`` and the
  module :mod:`kvtier.backends.lmdb_entries` say where the line is drawn). Its stamp is the
  open's time until ``touch_stamps`` writes one: then it gains a 16-byte entry and is a whole
  record.
* **split** (larger records): ``blocks[key]`` holds the payload alone and ``index[key]`` holds
  ``<d Q`` (last-access stamp, stored bytes) followed by the record's head (the
  :mod:`kvtier.records.format` header and, keyed, its tag). The payload is put straight from
  the caller's block: at 2 MiB the staging copy cost 8 % of a save (0.84 of a raw put, 0.92
  without it; ``benchmarks/bench_disk.py``).
* **whole** (written by earlier code, and a joined record once stamped): ``blocks[key]`` holds
  the whole record and ``index[key]`` the 16 bytes of stamp and size.

The index entry tells them apart: none, joined; 16 bytes, whole; longer, split (its length
says keyed or not). A split entry is always the current record's: a split save rewrites it, and
a joined save deletes the key's entry in its transaction while the store may hold one. A
16-byte entry may be older than its value (a stamped record saved joined again keeps it): it
gives the record's stamp, and the open takes the size from the value; read, such a value is
a whole record as a joined one is. A value longer than the raw block holds its head whatever its entry
(:func:`~kvtier.backends.lmdb_entries.head_in_value`: a split value is never that long), so a
raw joined record is read with one lookup. A value whose head does not check is corrupt, in
any layout: a split value that lost its entry is read as joined and fails its header check.

:class:`JobReader` reads a job: one read transaction, every record's head parsed and its extent
checked before a byte of its payload is touched, then :func:`~kvtier.records.checks.copy_and_check`.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lmdb
import torch
from kvtier.backends.lmdb_cold import ColdRead
from kvtier.backends.lmdb_entries import (
    COLD_GET_S,
    ENTRY_SIZES,
    INDEX,
    JOINED,
    ReadOutcome,
    entry_stamp,
    head_in_value,
    index_entry,
    join_record,
    restamp,
)
from kvtier.backends.lmdb_one import copy_keyed, copy_plain
from kvtier.backends.lmdb_plain import RowViews, host_rows
from kvtier.backends.lmdb_records import FileGuard, PlainReads

from kvtier.errors import CorruptBlockError
from kvtier.records.checks import SIDE_MIN_BYTES, FasterWay, RawPayload, copy_and_check, spare_core
from kvtier.records.codec import UnsupportedRecordError
from kvtier.records.format import (
    RecordAuthError,
    RecordBackend,
    RecordMac,
    parse_header,
)

__all__ = ["COLD_GET_S", "DAMAGE_ERRORS", "ENTRY_SIZES", "INDEX", "JOINED", "ColdRead", "JobReader", "ReadOutcome", "Temperature", "entry_stamp", "index_entry", "join_record", "restamp"]

log = logging.getLogger("kvtier.backends.lmdb_tier")

#: Warm jobs of raw records are read in one pass on the calling thread
#: (:meth:`JobReader.read_in_one_pass`): every plain job, keyed jobs of fewer than
#: :data:`~kvtier.records.checks.SIDE_MIN_BYTES`, and keyed jobs whose MAC is taken in the
#: copy's pass (:meth:`~kvtier.records.mac.RecordMac.one_pass`); ``False``: every job by the
#: general read, which checks jobs of ``SIDE_MIN_BYTES`` or more on a side thread. Another keyed
#: job that large keeps the side thread: AES-GMAC through ``cryptography`` runs at 2.9 GB/s on
#: one core here (38 µs more per record), 2.3 times a copy, and two threads sharing it gain more
#: than the hand-offs cost; with the native pass, 2 MiB records in jobs of 8 read at 0.87-0.88 of
#: a plain load in one pass, against 0.48-0.68 on the side thread (load 3). Measured
#: (``benchmarks/bench_disk.py --quick``, 2 MiB records in jobs of 8, load 2, adjacent runs): a
#: warm load at 0.71-0.82 of a raw get and copy in one pass, 0.54-0.59 with the side thread,
#: whose hand-offs and second pass over the map cost more than the overlap gains when the
#: other core is busy; at 64 KiB in jobs of 16, 0.51 against 0.22. A plain job never takes the
#: side thread, not even as a probe while the load average looks low: a fresh reader probed it
#: on its second job whenever the 1-minute load average was under half a core, as it is at the
#: start of a run on a quiet machine (before the caller's own thread shows in it), and those
#: probes alone took jobs of 16 at 64 and 256 KiB from 0.77 to 0.23-0.26 of a raw get and copy.
ONE_PASS_READS = True
#: LMDB errors on a lookup that are LMDB's own checks of the record's pages failing: the record
#: is dropped. Any other error on a lookup (``MapResizedError`` after another process grew the
#: map, reader-slot errors, ...) says nothing about the record: a miss for this read, kept.
DAMAGE_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError)


def _thread_major_faults() -> int:
    """Page faults of the calling thread that waited for the disk (Linux)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt


#: Major page faults of the calling thread so far, or ``None`` where the system does not say.
major_faults: Callable[[], int] | None = _thread_major_faults if hasattr(resource, "RUSAGE_THREAD") else None


class Temperature:
    """Whether the last job of a reader found its values on disk (``cold``): one flag, set and
    read by whichever thread reads a job (a stale answer costs a thread or a wait, never a
    wrong byte); and how many jobs are being read (``readers``, counted by :meth:`enter`).

    A lookup is told slow by its wall time, which also counts the time its thread waited for
    the GIL afterwards: with several jobs read at once (4 callers on 2 cores here), that wait
    alone passed :data:`COLD_GET_S`, warm jobs were read as cold, each with a thread of its own
    and its checks on the side threads, and the tier's loads fell from 0.6 to 0.05 of raw in
    some runs. So a lookup counts as slow only while its job is the only one being read; with
    several, the others' copies overlap any disk read anyway.

    Wall time also counts the time the thread was preempted: on a loaded machine (load 3-4 on
    2 cores) a warm 4 KiB lookup passed :data:`COLD_GET_S` often enough that warm jobs of a
    lone reader went cold, and 4 KiB loads fell from 0.18 to 0.05 GB/s. So where the system
    counts a thread's major page faults (:data:`major_faults`, Linux), a slow lookup counts as
    a disk read only if the thread waited for the disk since its last slow lookup (or its first
    job: :meth:`begin`). The mark moves only then, so asking the system costs nothing per job
    (1 µs a call, a sixth of a 4 KiB job's own time), and a fault of an earlier job counts at
    most once.

    The marks are kept by thread ident (:attr:`marks`), so a caller tells whether its thread
    has begun with one lookup (``get_ident() in marks``, 0.07 µs, where the call of
    :meth:`begin`, with its ``threading.local`` lookup, cost 0.3 µs of a 4 KiB one-record
    job); a thread's mark is dropped when the thread ends (:class:`_Forget`), before its ident
    can be another thread's."""

    __slots__ = ("_local", "cold", "jobs", "marks")

    def __init__(self) -> None:
        self.cold = False
        #: One item per job being read (append and pop are atomic): :meth:`enter` and
        #: :meth:`leave`, or a caller that appends and pops itself.
        self.jobs: list[None] = []
        #: Thread ident -> its major faults at its mark (``None`` where the system does not say).
        self.marks: dict[int, int | None] = {}
        self._local = threading.local()  # holds each thread's _Forget: freed when the thread ends

    @property
    def readers(self) -> int:
        return len(self.jobs)

    def enter(self) -> None:
        """A job is being read on this thread (until :meth:`leave`). No lock: a lock taken
        and released twice per job cost about 2 µs of a 4 KiB one-record job's 30."""
        self.jobs.append(None)
        self.begin()

    def begin(self) -> None:
        """This thread starts looking up a job's keys: the first time, its major faults so far
        are taken as the mark that later ones are counted from (:meth:`slow` moves the mark).
        A caller may skip the call where ``get_ident() in marks`` (it would do nothing)."""
        ident = threading.get_ident()
        if ident not in self.marks:
            self._mark(ident, None if major_faults is None else major_faults())

    def _mark(self, ident: int, faults: int | None) -> None:
        marks = self.marks
        if ident not in marks:  # this thread's first mark: dropped when the thread ends
            self._local.forget = _Forget(marks, ident)
        marks[ident] = faults

    def leave(self) -> None:
        self.jobs.pop()

    def slow(self, start: float) -> bool:
        """Whether a lookup that began at ``start`` (``time.perf_counter()``) read from disk, as
        far as can be told (see the class doc)."""
        if time.perf_counter() - start <= COLD_GET_S or self.readers > 1:
            return False
        if major_faults is None:
            return True
        ident = threading.get_ident()
        before, now = self.marks.get(ident), major_faults()
        self._mark(ident, now)
        return before is None or now > before


class _Forget:
    """Drops a thread's mark from :attr:`Temperature.marks` when the thread ends: held by the
    thread's own ``threading.local`` values, which CPython frees as the thread's state is
    cleared, before its ident can be reused."""

    __slots__ = ("ident", "marks")

    def __init__(self, marks: dict[int, int | None], ident: int) -> None:
        self.marks, self.ident = marks, ident

    def __del__(self) -> None:
        self.marks.pop(self.ident, None)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobReader:
    """Reads jobs of records of one open environment into caller rows (see the module doc)."""

    blocks: Any  # the environment's databases
    index: Any
    psize: int
    map_base: int | None  # where data.mdb is mapped (None: unknown, not Linux)
    path: str
    block_bytes: int
    plain: PlainReads  # the tight pass over warm jobs of plain records
    keyed: PlainReads | None = None  # the same over raw records of the store's MAC (keyed stores)
    views: RowViews | None = None  # the rows' views of unkeyed jobs, checked and kept by address
    guard: FileGuard | None = None  # refuses reads of a data.mdb cut short under the store
    temperature: Temperature = field(default_factory=lambda: Temperature())
    #: For cold jobs: way 0 reads them in one pass on the calling thread (a get, a copy and a
    #: check per key, as a raw read does), way 1 looks their keys up on a thread of their own
    #: (:class:`ColdRead`), tried only while a core seems spare (see :meth:`_cold_way`).
    cold_ways: FasterWay = field(default_factory=lambda: FasterWay())

    def read_job(
        self, env: lmdb.Environment, keys: Sequence[bytes], out: Sequence[torch.Tensor], mac: RecordMac | None, rows: Sequence[memoryview] | None = None
    ) -> ReadOutcome:
        """:meth:`read`, counted among the jobs being read (:class:`Temperature`). The count is
        taken first in the ``try`` (not by :meth:`Temperature.enter`): an interrupt as a call
        returns or begins, once counted, is inside it, and the close never waits for a read
        that has ended."""
        temperature = self.temperature
        temperature.begin()
        try:
            temperature.jobs.append(None)
            return self.read(env, keys, out, mac, rows)
        finally:
            temperature.jobs.pop()

    def read(
        self, env: lmdb.Environment, keys: Sequence[bytes], out: Sequence[torch.Tensor], mac: RecordMac | None, rows: Sequence[memoryview] | None = None
    ) -> ReadOutcome:
        """Read a job (see :meth:`_read`). How the cold rest of a job is read, where a lookup
        midway finds it cold, is decided once for the job (:meth:`_cold_way_of`) and timed
        here, from that lookup to the job's end, as that way's cost."""
        outcome = self._read(env, keys, out, mac, rows)
        pick = outcome.cold_pick
        if pick is not None:
            outcome.cold_pick = None
            way, start, nbytes = pick
            if start is not None:
                self.cold_ways.record(way, time.perf_counter() - start, nbytes)
        return outcome

    def _read(
        self, env: lmdb.Environment, keys: Sequence[bytes], out: Sequence[torch.Tensor], mac: RecordMac | None, rows: Sequence[memoryview] | None
    ) -> ReadOutcome:
        """``rows``: writable views of ``out`` (host memory), when the caller has them.

        Every failure is confined to its key: an absent, corrupt or unsupported record, and
        an LMDB error while looking one up, are a miss for that key alone; bad records and keys
        whose lookup met a damaged page (:data:`DAMAGE_ERRORS`) are listed in ``bad`` (to be
        dropped), keys whose lookup failed otherwise in ``transient`` (kept). LMDB errors
        beginning a transaction propagate, and so does the ``DiskError`` of a file cut short
        under the store (:meth:`_begin`).

        python-lmdb's ``get`` touches every page of the value it returns (with the GIL
        released), so a value that is not in the page cache is read from disk inside the
        lookup. Once a lookup takes longer than :data:`COLD_GET_S`, the rest of the job is read
        **cold**: where a core is spare (:meth:`_cold_way`), a thread of its own looks up the
        remaining keys while this thread copies and checks the values already found, so the
        disk reads overlap the copies (:class:`ColdRead`); else this thread reads on, a get,
        a copy and a check per key, as a raw read does. A warm job takes no thread. (Only a
        value's first lookup can be slow to tell: the read-around of the value before may have
        read it already.)

        The read-around makes most lookups of a cold job fast: a slow one reads the next
        values too, and often it is the job's last. So once a job had a slow lookup, the
        next jobs are read cold from their first key, until one has none
        (:class:`Temperature`)."""
        cold = self.temperature.cold and len(keys) > 1 and self.temperature.readers <= 1
        nbytes = len(keys) * self.block_bytes
        if cold:
            way = self._cold_way()
            start = time.perf_counter()
            if way:
                outcome = self._read_general(env, keys, out, mac, cold=True)
            else:
                self.temperature.cold = False  # set again by a slow lookup of this job
                outcome = self.read_in_one_pass(env, keys, out, mac, threaded=False, rows=rows)
            self.cold_ways.record(way, time.perf_counter() - start, nbytes)
            return outcome
        if ONE_PASS_READS and (mac is None or nbytes < SIDE_MIN_BYTES or mac.one_pass()):
            # Unkeyed jobs of any size too: their checks on a side thread lost here at every
            # size, even with the other core nearly free (ONE_PASS_READS); and keyed ones
            # whose MAC is taken in the copy's pass (RecordMac.one_pass).
            return self.read_in_one_pass(env, keys, out, mac, rows=rows)
        return self._read_general(env, keys, out, mac, cold=False)

    def _cold_way(self) -> int:
        """How to read the rest of a job found cold: 1 on a :class:`ColdRead` thread, 0 in one
        pass here. The thread overlaps the disk reads with the copies only where it has a core
        of its own: on 2 busy cores the reads slowed by a third beside copies
        (``bench_disk.py``, ``cold_get_beside_copies_ratio`` 0.65), and cold loads ran at 0.53
        of raw with the thread against 0.79 in one pass (2 MiB records in jobs of 8, load 5). So
        it is tried only while a core seems spare, and then taken when it has been the faster
        of late (:class:`~kvtier.records.checks.FasterWay`)."""
        return self.cold_ways.pick() if spare_core() else 0

    def _cold_way_of(self, outcome: ReadOutcome, nbytes: int) -> int:
        """:meth:`_cold_way` for the cold rest of the job whose outcome is ``outcome`` (``nbytes``
        from the lookup that found it cold), decided once per job: a later slow lookup of the
        same job goes the same way. A way that ``FasterWay`` picked (a core seemed spare) is
        timed by :meth:`read` at the job's end; one taken for want of a spare core is not
        (nothing was picked)."""
        pick = outcome.cold_pick
        if pick is None:
            picked = spare_core()  # else _cold_way takes way 0 without a pick: nothing to time
            pick = outcome.cold_pick = (self._cold_way(), time.perf_counter() if picked else None, nbytes)
        return pick[0]

    def _read_general(self, env: lmdb.Environment, keys: Sequence[bytes], out: Sequence[torch.Tensor], mac: RecordMac | None, *, cold: bool) -> ReadOutcome:
        """The general read of a job (see :meth:`read`): its keys looked up (``cold``: on a
        :class:`ColdRead`'s thread from the first key), then copied and checked
        (:func:`~kvtier.records.checks.copy_and_check`: jobs of
        :data:`~kvtier.records.checks.SIDE_MIN_BYTES` or more on a side thread)."""
        outcome = ReadOutcome(len(keys))
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        left: int | None = None
        if cold:
            # The last job read from disk: this one is looked up on the side from its first key.
            txn = self._begin(env)
            pairs: list[Any] = []
        else:
            txn, pairs = self._lookup(env, keys, outcome)
        try:
            if len(pairs) == len(keys):
                self.copy_in(range(len(keys)), keys, out, pairs, mac, outcome, copies)
            else:
                left = ColdRead(self, txn, keys, outcome, time.perf_counter).run(pairs, out, mac, copies)
        finally:
            txn.abort()
        for dst, staging in copies:
            dst.copy_(staging)  # a row whose record was refused holds garbage either way
        if left is not None and left < len(keys):
            # An LMDB error stopped the cold read at a key: the rest in a fresh transaction.
            outcome.take(left, self.read(env, keys[left:], out[left:], mac))
        return outcome

    def read_in_one_pass(
        self,
        env: lmdb.Environment,
        keys: Sequence[bytes],
        out: Sequence[torch.Tensor],
        mac: RecordMac | None,
        *,
        threaded: bool | None = None,
        rows: Sequence[memoryview] | None = None,
    ) -> ReadOutcome:
        """:meth:`read` for a warm job of raw records, in one pass on this thread: per key, a
        lookup, the head compared with what a raw record of this store holds, then the value
        copied into the row and its checksum taken in the same pass (:mod:`kvtier.records.xxcopy`),
        or, keyed, the row's MAC while it is in the CPU's cache. An unkeyed job whose rows are host memory goes through the tight pass of
        :class:`~kvtier.backends.lmdb_records.PlainReads` first (a 4 KiB record: 4-6 µs, against
        about 16 µs for the loop below and 3-5 µs for a raw get and copy into a tensor).

        Whatever is not that case goes through the general code, so its outcome and errors are
        the general path's: a record in another layout, compressed, with a bad check, or whose
        row is not host memory is handed to :meth:`copy_in` in the same transaction; an LMDB
        error on a lookup is a miss (:meth:`drop`) and the rest is read afresh; and a slow
        lookup makes the reader cold, and the rest of the job is looked up on a thread when
        ``threaded`` (``None``: as :meth:`_cold_way` says then), else read on here."""
        outcome = ReadOutcome(len(keys))
        bad = outcome.bad
        size = self.block_bytes
        rest: int | None = None  # where the general read takes over
        slow = False
        first, slow_at, slow_pair = 0, -1, None  # the first key the loop below reads; one found slow to look up
        txn = self._begin(env)
        try:
            reads = self.plain
            if mac is not None and self.keyed is not None and mac.one_pass():
                reads = self.keyed  # raw records of the store's MAC: the same pass, MACed
                if rows is None:
                    rows = host_rows(out, size, borrowed=True)
            elif rows is None and mac is None:
                rows = host_rows(out, size, borrowed=True)  # out outlives the pass
            if rows is not None:
                stop = reads.read(
                    txn, keys, rows, outcome.found, time.perf_counter, self.temperature.slow,
                    lambda i, entry, value: self._read_odd(i, keys, out, self.checked_pair(keys[i], entry, value, bad), mac, outcome),
                    COLD_GET_S,
                )
                if stop is None:
                    return outcome  # every key read (the transaction ends below)
                if stop[1] is not None:  # an LMDB error on key stop[0]
                    self.drop(outcome, keys[stop[0]], stop[1])
                    first, rest = len(keys), stop[0] + 1
                else:  # the lookup of key stop[0] read from disk: the loop below goes on from it
                    first = slow_at = stop[0]
                    slow_pair = None if stop[3] is None else self.checked_pair(keys[first], stop[2], stop[3], bad)
            for i in range(first, len(keys)):
                key = keys[i]
                start = time.perf_counter()
                try:
                    pair = slow_pair if i == slow_at else self.pair(txn, key, bad)
                except lmdb.Error as exc:
                    self.drop(outcome, key, exc)
                    rest = i + 1
                    break
                slow = i == slow_at or self.temperature.slow(start)
                if pair is None:
                    outcome.corrupt += key in bad
                if slow and i + 1 < len(keys) and (self._cold_way_of(outcome, (len(keys) - i) * size) == 1 if threaded is None else threaded):
                    # Read from disk: the rest of the job is cold. As in read(), a thread looks up
                    # the rest in this transaction while this one copies and checks this record.
                    self.temperature.cold = True
                    rest = self._cold_rest(txn, keys, out, mac, i, pair, outcome)
                    break
                if pair is None:
                    pass
                elif not (copy_plain(key, pair, out[i], size) if mac is None else copy_keyed(key, pair, out[i], size, mac)):
                    self._read_odd(i, keys, out, pair, mac, outcome)
                else:
                    outcome.found[i] = True
                if slow:  # the job's last lookup read from disk: the next job is read cold
                    self.temperature.cold = True
        finally:
            txn.abort()
        if rest is not None and rest < len(keys):
            outcome.take(rest, self.read(env, keys[rest:], out[rest:], mac))
            if slow:  # this job read from disk: the next one is read cold too, as in read()
                self.temperature.cold = True
        return outcome

    def _read_odd(self, i: int, keys: Sequence[bytes], out: Sequence[torch.Tensor], pair: Any, mac: RecordMac | None, outcome: ReadOutcome) -> None:
        """Read key ``i``, looked up as ``pair`` (``None``: absent or bad), by the general code."""
        if pair is None:
            outcome.corrupt += keys[i] in outcome.bad
            return
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.copy_in((i,), keys, out, (pair,), mac, outcome, copies)
        for dst, staging in copies:
            dst.copy_(staging)

    def _cold_rest(
        self,
        txn: lmdb.Transaction,
        keys: Sequence[bytes],
        out: Sequence[torch.Tensor],
        mac: RecordMac | None,
        i: int,
        pair: Any,
        outcome: ReadOutcome,
    ) -> int | None:
        """Read keys ``i`` on of a job whose lookup of key ``i`` (``pair``) was slow: a
        :class:`ColdRead` in ``txn``; into ``outcome``. The position to go on from in a fresh
        transaction, or ``None``."""
        part = ReadOutcome(len(keys) - i)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        left = ColdRead(self, txn, keys[i:], part, time.perf_counter).run([pair], out[i:], mac, copies)
        for dst, staging in copies:
            dst.copy_(staging)
        outcome.take(i, part)
        return None if left is None else i + left

    def copy_in(
        self,
        where: Iterable[int],
        keys: Sequence[bytes],
        out: Sequence[torch.Tensor],
        pairs: Sequence[Any],
        mac: RecordMac | None,
        outcome: ReadOutcome,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Parse, copy and check the looked-up ``pairs`` of the keys at ``where`` (in order) into
        their rows, recording each in ``outcome``; rows that need a staging copy back to their
        device are added to ``copies``."""
        items: list[RawPayload] = []
        found: list[int] = []
        for i, pair in zip(where, pairs):
            key = keys[i]
            if pair is None:
                outcome.corrupt += key in outcome.bad
                continue
            try:
                head, header, payload = self._parse(pair, mac)
            except CorruptBlockError as exc:
                self._refuse(outcome, key, exc)
                continue
            view, staging = RecordBackend._host_view(out[i])
            if staging is not None:
                copies.append((out[i], staging))
            items.append(RawPayload(key, head, header, payload, view))
            found.append(i)
        for i, item, error in zip(found, items, copy_and_check(items, mac)):
            if error is None:
                outcome.found[i] = True
            else:
                self._refuse(outcome, item.key, error)

    def _parse(self, pair: tuple[Any, Any], mac: RecordMac | None) -> tuple[Any, Any, Any]:
        entry, value = pair
        if len(entry) == INDEX.size:  # whole layout: the head starts the value
            header = parse_header(value, raw_length=self.block_bytes, available=len(value), mac=mac)
            start = header.payload_offset
            return value, header, memoryview(value)[start : start + header.stored_length]
        head = memoryview(entry)[INDEX.size :]
        header = parse_header(head, raw_length=self.block_bytes, available=len(head) + len(value), mac=mac)
        return head, header, value

    def _refuse(self, outcome: ReadOutcome, key: bytes, exc: CorruptBlockError) -> None:
        if isinstance(exc, UnsupportedRecordError):
            # Another format, codec or secret: a miss here, kept for a reader that has it (an
            # unkeyed tier on a store keyed before meta records named the MAC would else empty it).
            log.warning("lmdb: record %s… cannot be read by this build (%s); a miss, kept", key.hex()[:16], exc)
            return
        log.warning("lmdb: corrupt record %s… in %s (%s); deleting it", key.hex()[:16], self.path, exc)
        outcome.corrupt += 1
        outcome.auth += isinstance(exc, RecordAuthError)
        outcome.bad[key] = str(exc)

    def _lookup(self, env: lmdb.Environment, keys: Sequence[bytes], outcome: ReadOutcome) -> tuple[lmdb.Transaction, list[Any]]:
        """One read transaction and each key's ``(index entry,
        value)`` buffers (``None``: absent or bad, with the reason in ``outcome.bad``). An LMDB
        error on a key makes it a miss (:meth:`drop`) and starts over in a fresh transaction (a
        failed lookup may leave one unusable, and its buffers with it). Stops after a lookup that took longer than
        :data:`COLD_GET_S` (the job is cold from there, see :meth:`read`): fewer pairs than keys."""
        bad = outcome.bad
        while True:
            txn = self._begin(env)
            pairs: list[Any] = []
            try:
                for key in keys:
                    if key in bad or key in outcome.transient:
                        pairs.append(None)
                        continue
                    start = time.perf_counter()
                    pairs.append(self.pair(txn, key, bad))
                    if self.temperature.slow(start):
                        self.temperature.cold = True
                        if len(pairs) < len(keys) and self._cold_way_of(outcome, (len(keys) - len(pairs)) * self.block_bytes):
                            return txn, pairs
                return txn, pairs
            except lmdb.Error as exc:
                txn.abort()
                self.drop(outcome, keys[len(pairs)], exc)

    def _begin(self, env: lmdb.Environment) -> lmdb.Transaction:
        """A read transaction, once the file is known not to have been cut short
        (:class:`~kvtier.backends.lmdb_records.FileGuard`: ``DiskError``)."""
        if self.guard is not None:
            self.guard.check()
        return env.begin(None, None, False, True)  # (db, parent, write, buffers): by position, 0.2 µs less than by name

    def drop(self, outcome: ReadOutcome, key: bytes, exc: lmdb.Error) -> None:
        """``key``'s lookup failed with ``exc``: a miss; the key is dropped (put in ``bad``) only
        when LMDB found a page of it damaged (:data:`DAMAGE_ERRORS`), else kept (``transient``)."""
        if isinstance(exc, DAMAGE_ERRORS):
            log.warning("lmdb: reading %s… from %s failed (%s); a miss, dropping the key", key.hex()[:16], self.path, exc)
            outcome.bad[key] = str(exc)
        else:
            log.warning("lmdb: reading %s… from %s failed (%s); a miss for this read, the record is kept", key.hex()[:16], self.path, exc)
            outcome.transient.add(key)

    def pair(self, txn: lmdb.Transaction, key: bytes, bad: dict[bytes, str]) -> tuple[Any, Any] | None:
        """``key``'s ``(index entry, value)`` buffers in ``txn``, or ``None`` (absent, or bad: the
        reason is put in ``bad``); LMDB errors propagate."""
        value = txn.get(key, db=self.blocks)
        if value is None:
            return None
        if head_in_value(value, self.block_bytes):
            return JOINED, value  # the head is in the value: no index lookup (module doc)
        return self.checked_pair(key, txn.get(key, db=self.index), value, bad)

    def checked_pair(self, key: bytes, entry: Any, value: Any, bad: dict[bytes, str]) -> tuple[Any, Any] | None:
        """``(entry, value)`` of a present ``key`` (``entry`` :data:`JOINED` when it has none:
        a joined record), or ``None`` when its index entry is unreadable (the reason is put in
        ``bad``)."""
        if entry is None:
            return JOINED, value
        if len(entry) not in ENTRY_SIZES:
            log.warning("lmdb: record %s… in %s has no readable index entry; a miss, dropping it", key.hex()[:16], self.path)
            bad[key] = "no readable index entry"
            return None
        return entry, value

