"""A job's records, checked on a side thread while the calling thread copies or writes them.

Loading a raw record is a copy plus a checksum pass over the same bytes. On one thread the two
passes add up, however they are interleaved: fused in 64 KiB chunks (:func:`~kvtier.records.format.decode_payload`),
a 2 MiB load ran at 0.73-0.79 of a plain copy. The passes are independent, though, and both
release the GIL (``numpy.copyto`` and XXH3 / HMAC over a buffer), so :func:`copy_and_check`
hands the checksums of a whole job to a side thread in one hop and copies meanwhile: an
``lmdb`` load then ran at 0.91-1.03 of a raw get and copy on 2 cores (``benchmarks/bench_disk.py``). A row whose check fails holds garbage and
is reported as bad, which callers serve as a miss; nothing is reported good before its check.
Where the native pass of :mod:`kvtier.records.xxcopy` is built, an unkeyed raw payload's copy
and checksum are one pass instead (about a copy's cost), and stay on the calling thread; so do
an AES-GMAC payload's copy and MAC where :data:`kvtier.records.mac.gmac_copy` is built
(:meth:`~kvtier.records.mac.RecordMac.one_pass`).

:func:`fill_and_check` is the same for rows filled by a read (the ``file`` tier's ``preadv``,
which releases the GIL too): a side thread checks each row once it is filled, while the next one
is read.

:class:`EncodedStream` does the same for writes: the side thread encodes (checksums, compresses)
the job's records in order while the writer puts and commits the ones already encoded.

One small pool of side threads serves the process; jobs under :data:`SIDE_MIN_BYTES` stay on the
calling thread, where the hop would cost more than it saves.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import xxhash

from kvtier.devices import usable_cpus
from kvtier.errors import CorruptBlockError
from kvtier.records import xxcopy
from kvtier.records.codec import NoneCodec
from kvtier.records.format import RecordHeader, RecordMac, decode_payload, verify_payload
from kvtier.records.record import CHECKED, HEADER, MAGIC, RECORD_VERSION

__all__ = [
    "SIDE_MIN_BYTES",
    "THREAD_PREFIX",
    "EncodedStream",
    "FasterWay",
    "HeadChecksum",
    "ProcessThreads",
    "RawPayload",
    "copy_and_check",
    "fill_and_check",
    "side_pool",
    "spare_core",
]

#: Jobs with fewer bytes than this are checked on the calling thread (a hop costs ~50 µs).
SIDE_MIN_BYTES = 1 << 20
_WORKERS = 2
#: Name prefix of the side threads (process-wide: they outlive every store).
THREAD_PREFIX = "kvtier-check"

T = TypeVar("T")
R = TypeVar("R")


class ProcessThreads:
    """A pool of ``workers`` threads for the whole process, created on first use and again in
    a forked child (the parent's pool has no threads there, yet would count its idle ones and
    never start one; and its lock may have been held by one of them)."""

    def __init__(self, workers: int, prefix: str) -> None:
        self.workers = workers
        self.prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.prefix)
                self._pid = os.getpid()
            return self._pool

    def _after_fork_in_child(self) -> None:
        self._pool = None
        self._lock = threading.Lock()


_side = ProcessThreads(_WORKERS, THREAD_PREFIX)


def side_pool() -> ThreadPoolExecutor:
    """The process's side threads (see :class:`ProcessThreads`)."""
    return _side.get()


def _submit(fn: Callable[..., R], *args: Any) -> Future[R] | None:
    """``fn(*args)`` on a side thread, or ``None`` when none can take it (the interpreter is
    shutting down): the caller then runs it itself."""
    try:
        return side_pool().submit(fn, *args)
    except RuntimeError:
        return None


class RawPayload(NamedTuple):
    """One record to load: its parsed ``header``, the ``head`` bytes it was parsed from (header
    and, keyed, the tag), the stored ``payload`` and the row ``out`` to decode it into."""

    key: bytes
    head: Any
    header: RecordHeader
    payload: Any
    out: memoryview


def copy_and_check(items: Sequence[RawPayload], mac: RecordMac | None) -> list[CorruptBlockError | None]:
    """Decode every item into its row and check it; per item, the error (``None``: good).

    Unkeyed raw payloads are copied and checked here in one pass where the native
    :func:`~kvtier.records.xxcopy.xxh3_copy` is built (:func:`~kvtier.records.xxcopy.fused`),
    and a keyed job's where its MAC is taken in the copy's pass
    (:meth:`~kvtier.records.mac.RecordMac.one_pass`):
    that pass runs at about a copy's speed (``benchmarks/bench_xxcopy.py``), which leaves a side
    thread nothing to take. Otherwise, for a job of at least
    :data:`SIDE_MIN_BYTES` of raw payloads, this thread copies them into
    their rows while a side thread checks them; once its copies are done this thread checks too,
    from the other end (a BLAKE3 or HMAC-SHA256 MAC is slower than a copy). What is checked:

    * with a plain checksum, the stored payload, while it is copied. The check guards against
      damage (bit rot, torn writes), which cannot change the bytes between the two reads, and
      both threads read the same clean cache lines: 0.95 of a plain copy, against 0.75 for
      checking the rows (lines just written by the other core);
    * with a keyed MAC, each row once it is copied: the row the caller gets. A MAC guards
      against tampering, and a file rewritten under the map between a check of the source and
      its copy must not slip through.

    The rest (small jobs, compressed payloads) is checked and decoded here, fused
    (:func:`~kvtier.records.format.decode_payload`). The payload buffers must stay valid until this
    returns (it waits for the side thread)."""
    errors: list[CorruptBlockError | None] = [None] * len(items)
    raw = [i for i, item in enumerate(items) if item.header.codec_id == NoneCodec.codec_id]
    shared = None
    one_pass = xxcopy.fused() if mac is None else mac.one_pass()
    if not one_pass and sum(len(items[i].out) for i in raw) >= SIDE_MIN_BYTES:
        shared = _SharedChecks([items[i] for i in raw], mac, _copy_payload, rows=mac is not None)
        if not shared.start():
            shared = None
    for i, item in enumerate(items):
        if shared is None or item.header.codec_id != NoneCodec.codec_id:
            try:
                decode_payload(item.key, item.head, item.header, item.payload, item.out, mac=mac)
            except CorruptBlockError as exc:
                errors[i] = exc
    if shared is not None:
        for i, error in zip(raw, shared.fill_then_help()):
            assert not isinstance(error, OSError)
            errors[i] = error
    return errors


def fill_and_check(
    items: Sequence[RawPayload], fill: Callable[[RawPayload], None], mac: RecordMac | None
) -> list[CorruptBlockError | OSError | None]:
    """Fill every item's row with ``fill(item)`` (a read into ``item.out``, say), in order, and
    check each row once filled; per item, the error (``None``: good; the ``OSError`` or
    ``CorruptBlockError`` that ``fill`` raised, or the check's ``CorruptBlockError``).

    Raw payloads only (``item.payload`` is not used). For a job of at least
    :data:`SIDE_MIN_BYTES`, a side thread checks the rows while this thread fills the next ones
    (``fill`` must release the GIL: ``os.preadv`` does); smaller jobs are filled and checked
    here, one row after the other."""
    shared = None
    if sum(len(item.out) for item in items) >= SIDE_MIN_BYTES:
        shared = _SharedChecks(items, mac, fill, rows=True)
        if not shared.start():
            shared = None
    if shared is not None:
        return shared.fill_then_help()
    errors: list[CorruptBlockError | OSError | None] = []
    for item in items:
        try:
            fill(item)
            verify_payload(item.key, item.head, item.header, item.out, mac=mac)
            errors.append(None)
        except (CorruptBlockError, OSError) as exc:
            errors.append(exc)
    return errors


class HeadChecksum:
    """The checksum of unkeyed records that share one checked head (``head``, the header's
    first :data:`~kvtier.records.record.CHECKED` bytes: every raw record of one block size and
    dtype has the same, :meth:`plain`), as :func:`~kvtier.records.format.record_checksum`
    computes it. The head is hashed once (:attr:`prefix`); a record's sum goes on from a copy of
    that state with its key and payload: one copy and two updates a record instead of a new
    hasher and three."""

    __slots__ = ("head", "prefix")

    def __init__(self, head: bytes) -> None:
        if len(head) != CHECKED:
            raise ValueError(f"head: expected the {CHECKED} checked header bytes, got {len(head)}")
        self.head = bytes(head)
        #: record_checksum's state after the head (loops that inline the sum copy it).
        self.prefix = xxhash.xxh3_64()
        self.prefix.update(self.head)

    @classmethod
    def plain(cls, block_bytes: int, dtype_code: int) -> HeadChecksum:
        """For the raw, unkeyed records of ``block_bytes`` and ``dtype_code`` (what
        ``encode_record`` writes for a block neither compressed nor keyed)."""
        return cls(HEADER.pack(MAGIC, RECORD_VERSION, NoneCodec.codec_id, dtype_code, 0, block_bytes, block_bytes, 0)[:CHECKED])

    def __call__(self, key: bytes, payload: Any) -> int:
        h = self.prefix.copy()
        h.update(key)
        h.update(payload)
        return h.intdigest()  # type: ignore[no-any-return]


def _copy_payload(item: RawPayload) -> None:
    # numpy copies without the GIL, so the side thread checks meanwhile
    np.copyto(np.frombuffer(item.out, dtype=np.uint8), np.frombuffer(item.payload, dtype=np.uint8))


class _SharedChecks:
    """One job's raw rows: this thread fills them in order; the side thread checks them from
    the front (``rows``: each once it is filled, else the stored payloads); this thread, done
    filling, checks from the back."""

    def __init__(self, items: Sequence[RawPayload], mac: RecordMac | None, fill: Callable[[RawPayload], None], *, rows: bool) -> None:
        self.items = items
        self.mac = mac
        self.fill = fill
        self.rows = rows  # check the filled rows, not the source
        self.errors: list[CorruptBlockError | OSError | None] = [None] * len(items)
        self.failed: set[int] = set()  # rows whose fill failed: never checked
        self.todo = collections.deque(range(len(items)))
        self.filled = 0  # rows [0, filled) are filled (or failed)
        self.cond = threading.Condition()
        self.future: Future[None] | None = None

    def start(self) -> bool:
        self.future = _submit(self._side)
        return self.future is not None

    def fill_then_help(self) -> list[CorruptBlockError | OSError | None]:
        try:
            for i, item in enumerate(self.items):
                try:
                    self.fill(item)
                except (CorruptBlockError, OSError) as exc:
                    self.errors[i] = exc
                    with self.cond:
                        self.failed.add(i)
                if self.rows:
                    with self.cond:
                        self.filled = i + 1
                        self.cond.notify()
        except BaseException:
            # Nothing of the job may be read once this returns (the caller may end the read
            # transaction, or close the map): stop the side thread and wait for it.
            with self.cond:
                self.todo.clear()
                self.filled = len(self.items)
                self.cond.notify()
            assert self.future is not None
            self.future.result()
            raise
        with self.cond:
            self.filled = len(self.items)
            self.cond.notify()
        while True:
            with self.cond:
                if not self.todo:
                    break
                i = self.todo.pop()
            self._check(i)
        assert self.future is not None
        self.future.result()  # the side thread's last check
        return self.errors

    def _side(self) -> None:
        while True:
            with self.cond:
                while self.rows and self.todo and self.todo[0] >= self.filled:
                    self.cond.wait()
                if not self.todo:
                    return
                i = self.todo.popleft()
            self._check(i)

    def _check(self, i: int) -> None:
        with self.cond:
            if i in self.failed:
                return
        item = self.items[i]
        try:
            verify_payload(item.key, item.head, item.header, item.out if self.rows else item.payload, mac=self.mac)
        except CorruptBlockError as exc:
            self.errors[i] = exc


def spare_core() -> bool:
    """Whether this machine seems to have a core to spare for a side thread: its 1-minute load
    average is below the cores this process may use less one and a half, room for the
    caller's thread and a side thread (``True`` where the load is unknown). At load 1.1-1.2 on
    2 cores the side thread still lost: 256 KiB jobs of 16 read at 5.4-5.7 GB/s against
    9.2-10.5 in one pass, 2 MiB at 4.3-4.7 against 5.4-5.7. Coarse, and cheap (a few µs): it
    keeps :class:`FasterWay` from trying a side thread on a machine that is busy anyway, where
    each try cost a job at half speed."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return True
    return load < usable_cpus() - 1.5


class FasterWay:
    """Which of two ways of doing a kind of job runs faster here and now. Each job is timed
    (seconds per byte, a moving average per way) and the faster way is taken; now and then a
    job takes the other way (a probe), so that a change in the machine (its other core freed or
    taken) shows. Probes come every ``probe`` jobs, twice as far apart after each probe that
    changes nothing (up to ``max_probe``), and every ``probe`` again once one does: a way that
    keeps losing costs little. For choices that hang on a free core: checks on a side thread
    beat checks on the calling thread only while the side thread has a core to itself.
    Shared by the threads that read jobs: a stale average costs time, never a wrong byte."""

    __slots__ = ("_cost", "_interval", "_jobs", "_next", "max_probe", "probe", "weight")

    def __init__(self, probe: int = 8, weight: float = 0.3, max_probe: int = 64) -> None:
        self.probe = probe
        self.max_probe = max_probe
        self.weight = weight
        self._cost: list[float | None] = [None, None]
        self._jobs = 0
        self._interval = probe
        self._next = probe  # the job that probes next

    def _best(self) -> int | None:
        first, second = self._cost
        if first is None or second is None:
            return None
        return 0 if first <= second else 1

    def pick(self) -> int:
        """The way (0 or 1) to take for the next job: each once first, then the faster."""
        self._jobs += 1
        if self._cost[0] is None:
            return 0
        best = self._best()
        if best is None:
            return 1
        return 1 - best if self._jobs >= self._next else best

    def record(self, way: int, seconds: float, nbytes: int) -> None:
        """A job of ``nbytes`` took ``seconds`` the ``way`` way."""
        before = self._best()
        cost = seconds / max(1, nbytes)
        old = self._cost[way]
        probe = before is not None and way != before
        # A probe's job replaces its way's cost: probes are rare, so averaged in they left
        # that way judged by its first job (often a cold one) for hundreds of jobs.
        self._cost[way] = cost if old is None or probe else old + self.weight * (cost - old)
        if probe:
            self._interval = self.probe if self._best() != before else min(2 * self._interval, self.max_probe)
            self._next = self._jobs + self._interval


class EncodedStream(Generic[T, R]):
    """``encode(item)`` for each item, in order, on a side thread (one hop per job); iterate to
    take each result as soon as it is ready, while the side thread works ahead.

    An exception raised by ``encode`` is raised by the iteration at that item. ``close()`` (or
    leaving a ``with`` block) stops the side thread after its current item. A job below
    ``min_bytes`` (by ``size(item)``) is encoded lazily on the calling thread instead."""

    def __init__(self, encode: Callable[[T], R], items: Sequence[T], *, sizes: Iterable[int] = (), min_bytes: int = SIDE_MIN_BYTES) -> None:
        self._encode = encode
        self._items = items
        self._results: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._stopped = False
        #: The side thread's task (``None``: encoded on the calling thread).
        self.future = _submit(self._run) if sum(sizes) >= min_bytes and len(items) > 1 else None

    def _run(self) -> None:
        for item in self._items:
            if self._stopped:
                return
            try:
                self._results.put((True, self._encode(item)))
            except BaseException as exc:  # handed to the caller, who raises it at this item
                self._results.put((False, exc))
                return

    def __iter__(self) -> Any:
        if self.future is None:
            for item in self._items:
                yield self._encode(item)
            return
        for _ in self._items:
            ok, value = self._results.get()
            if not ok:
                raise value
            yield value

    def close(self) -> None:
        self._stopped = True

    def __enter__(self) -> EncodedStream[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
