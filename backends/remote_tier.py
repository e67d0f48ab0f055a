"""What every remote tier shares: records on a server that several hosts read and write.

:class:`RemoteRecordBackend` is the base of the ``redis`` tier and of any tier that keeps one
:mod:`kvtier.records.format` record per key on a server (an object store, a distributed memory
pool). It does, once for all of them:

* **lifecycle**: ``open`` names the namespace's keys (``<prefix>:<namespace digest, 16 hex>:``),
  connects off the event loop and checks the meta record (:mod:`kvtier.backends.remote_meta`: a
  foreign one makes the tier serve nothing, never a refusal to start); an unreachable server at
  open is an outage, not an error. ``aclose`` stops the index view and the I/O threads, then
  disconnects.
* **the shared index**: a :class:`~kvtier.backends.shared_index.SharedIndexView` keeps the
  manager's local index of this tier in step with the server (a sweep of the keys every
  ``sync_interval_s``; ``scan`` at open lists them once); lookups never touch the network.
* **records**: encoded with the tier's codec and checksum or MAC, bound to their key and
  namespace; decoded into the caller's buffer. A damaged or forged record is a miss, deleted and
  counted; a record of another format or secret is a miss left in place and not offered again
  (bounded memory), until this tier writes that key.
* **job shares**: a job's records on one server are cut into shares
  (:mod:`kvtier.backends.remote_shares`), run at once on the calling thread and the tier's I/O
  threads (:func:`kvtier.shares.run_all`); every share has ended when a call returns, so nothing
  writes into the caller's rows afterwards.
* **health** (:mod:`kvtier.backends.remote_health`): a dead server fails fast until its backoff
  runs out, and every failure is counted in ``stats()``; nothing raises into the engine.
* **secrets** (:mod:`kvtier.backends.remote_secrets`): never logged, never in ``repr`` or
  ``to_dict``.

A subclass implements what its server does differently. Every hook runs on a worker thread
(never on the event loop) and may block; errors in :attr:`~RemoteRecordBackend.down_errors`
mean the server is unreachable, those in :attr:`~RemoteRecordBackend.refused_errors` that it
refused (both mark it down):

``_connect()``
    Build the client(s). Called at open and whenever the tier needs one; idempotent.
``_disconnect()``
    Close them (at ``aclose``; errors are logged, never raised).
``_read_meta() -> bytes | None`` and ``_write_meta(value, only_new)``
    The meta record under ``self._meta_key`` (``only_new``: write only if absent).
``_put_records(route, rkeys, records) -> list[bool]``
    Store each ``(head, payload)`` record under its remote key, in one batch; per record whether
    it was stored. ``payload`` is a view of the caller's block: send it, never keep it.
``_get_records(route, rkeys) -> list[buffer | None]``
    Fetch each record whole (``None``: missing), in one batch; the base checks and decodes it
    into the caller's buffer. A tier that can stream a record straight into place (``redis``)
    overrides ``_read_share`` instead.
``_delete_records(route, rkeys) -> int``
    Delete them (a missing key is not an error); how many were deleted.
``_list_keys() -> Iterable[bytes]``
    Every remote key under ``self._prefix_bytes``, paged by the server (never one reply for all);
    raise :class:`SweepSkipped` to skip a round without marking the server down. (The listing,
    and the faster ``_list_block_keys`` a tier may give instead, are
    :mod:`kvtier.backends.remote_listing`'s.)
``probe(timeout_s) -> str | None``
    Connect once without keeping anything: ``None`` if the server answers, else what is wrong,
    in the operator's terms (``kvtier config check`` calls it).

and, where the defaults do not fit: ``_routes`` (which server holds which keys: one route by
default, a node per hash-slot owner in a Redis Cluster), ``remote_key`` / ``block_key`` (the
name of a record on the server), ``_write_share`` / ``_read_share`` (a share's whole exchange),
``_note_failure`` (a share failed), ``_healths`` (every server's health, for ``stats``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, ClassVar

import torch
from kvtier.backends.change_feed import ChangeFeed
from kvtier.backends.feed_follower import FollowedTier
from kvtier.backends.remote_health import Busy, Down, Health
from kvtier.backends.remote_listing import KEY_BYTES, RemoteListing, SweepSkipped
from kvtier.backends.remote_meta import MetaVerdict, judge_meta, meta_value
from kvtier.backends.remote_rows import Count, RowLease, fill_row
from kvtier.backends.remote_shares import split_shares
from kvtier.backends.shared_index import SharedIndexView

from kvtier.backend import BlockFormat
from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.keys import check_keys
from kvtier.records.codec import Codec, NoneCodec, UnsupportedRecordError
from kvtier.records.format import DEFAULT_MAC_ALGORITHM, decode_record
from kvtier.records.record_backend import RecordBackend, _in_host_memory
from kvtier.shares import run_all

__all__ = ["KEY_BYTES", "ReadJob", "RemoteRecordBackend", "Route", "SweepSkipped", "WriteJob"]

log = logging.getLogger("kvtier")

#: Keys remembered as not loadable (see ``RemoteRecordBackend._unreadable``): 32 bytes each.
UNREADABLE_MAX = 100_000
#: Entries a namespace's change feed keeps (about; the server trims whole nodes).
FEED_MAXLEN = 100_000
#: The sweep's interval without a feed (it alone follows the other hosts), and with one (a backstop).
SWEEP_ALONE_S = 1.0
SWEEP_WITH_FEED_S = 60.0
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

#: ``(health, handle, positions)``: the server that holds some of a job's keys, what the
#: subclass needs to reach it (a connection pool, a client), and the keys' positions in the job.
Route = tuple[Health, Any, list[int]]


class WriteJob:
    """One ``write_blocks`` call of ``size``-byte blocks, as its shares see it: fill ``sizes[i]``
    for each record stored, and ``leases[i]`` for each record sent straight from its row
    (:meth:`sent_from`); ``refused`` lists the rows found no longer to be blocks (nothing sent)."""

    __slots__ = ("blocks", "keys", "leases", "refused", "rkeys", "size", "sizes")

    def __init__(self, keys: Sequence[bytes], rkeys: list[bytes], blocks: Sequence[torch.Tensor], size: int) -> None:
        self.keys, self.rkeys, self.blocks, self.size = keys, rkeys, blocks, size
        self.sizes: list[int | None] = [None] * len(keys)
        self.leases: list[RowLease | None] = [None] * len(keys)
        self.refused: list[int] = []

    def lease(self, i: int) -> RowLease | None:
        """Host row ``i``'s memory kept for its transfer (``leases[i]``), or ``None`` (listed in
        ``refused``) where the row was pointed at memory that is no longer a block since the checks."""
        lease = RowLease(self.blocks[i], self.size)
        if not lease.sound:
            self.refused.append(i)
            return None
        self.leases[i] = lease
        return lease

    def sent_from(self, i: int) -> torch.Tensor | None:
        """Block ``i`` as a save sends it (a host row's memory kept, :meth:`lease`), or ``None``: not sent."""
        block = self.blocks[i]
        if _in_host_memory(block):
            lease = self.lease(i)
            return None if lease is None else lease.kept
        return block

    def taken(self, positions: list[int]) -> list[tuple[int, torch.Tensor]]:
        """Each of ``positions`` with its block as a save sends it (:meth:`sent_from`), rows no longer blocks left out."""
        sent = [(i, self.sent_from(i)) for i in positions]
        return [(i, block) for i, block in sent if block is not None]

    def unmoved(self, sent: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """The ``(position, record)`` pairs of ``sent`` whose row has not left its kept memory
        (:meth:`left`, asked once a record, kept with its key): the others are not sent."""
        return [(i, record) for i, record in sent if not self.left(i)]

    def left(self, i: int) -> bool:
        """Whether row ``i`` was sent from kept memory it no longer points at: asked once its record
        is encoded (checksummed), such a record may be of bytes the row never had, and is not sent."""
        lease = self.leases[i]
        return lease is not None and not lease.held()

    def moved(self) -> list[int]:
        """The records whose row was pointed at other memory while they were sent (once every
        share is over): they may hold bytes the row no longer has, so they count as not stored."""
        moved = [i for i, lease in enumerate(self.leases) if lease is not None and not lease.held()]
        for i in moved:
            self.sizes[i] = None
        return moved


class ReadJob:
    """One ``read_blocks`` call, as its shares see it: ``found[i]`` per record loaded into
    ``out[i]``; keys of bad records (deleted afterwards) and of unreadable ones (not offered
    again) are appended to ``bad`` and ``unreadable``."""

    __slots__ = ("bad", "found", "keys", "out", "rkeys", "unreadable")

    def __init__(self, keys: Sequence[bytes], rkeys: list[bytes], out: Sequence[torch.Tensor]) -> None:
        self.keys, self.rkeys, self.out = keys, rkeys, out
        self.found = [False] * len(keys)
        self.bad: list[bytes] = []
        self.unreadable: list[bytes] = []


def check_seconds(**values: Any) -> None:
    """Each value a positive number of seconds (``ttl_s`` may be ``None``); else ``ConfigError``."""
    for name, value in values.items():
        if value is None and name == "ttl_s":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{name}: expected a positive number of seconds, got {value!r}")


class RemoteRecordBackend(RemoteListing, FollowedTier, RecordBackend):
    """Records on a server shared by every host; see the module doc for the hooks."""

    #: Records outlive the process; at open the store adopts what the server holds.
    persistent: ClassVar[bool] = True
    #: Other hosts write here too: the store never deletes records it has no room to adopt.
    shared: ClassVar[bool] = True
    #: The client library's errors for a server that could not be reached.
    down_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)
    #: Its errors for a server that refused (authentication, a cluster not ready).
    refused_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    #: What ``prefix`` may be.
    prefix_pattern: ClassVar[re.Pattern[str]] = _PREFIX_RE

    def __init__(
        self,
        *,
        capacity: int | str,
        where: str,
        prefix: str = "kvtier",
        codec: str | dict[str, Any] | Codec | None = "none",
        mac_key: bytes | str | None = None,
        mac_key_env: str | None = None,
        mac_algorithm: str = DEFAULT_MAC_ALGORITHM,
        sync_interval_s: float | None = None,
        feed: bool = True,
        feed_maxlen: int = FEED_MAXLEN,
    ) -> None:
        super().__init__(capacity=capacity, codec=codec, mac_key=mac_key, mac_key_env=mac_key_env, mac_algorithm=mac_algorithm)
        if not isinstance(prefix, str) or not self.prefix_pattern.match(prefix):
            raise ConfigError(f"prefix: expected 1-64 characters of [A-Za-z0-9_.-], got {prefix!r}")
        if not isinstance(feed, bool):
            raise ConfigError(f"feed: expected true or false, got {feed!r}")
        if isinstance(feed_maxlen, bool) or not isinstance(feed_maxlen, int) or feed_maxlen < 100:
            raise ConfigError(f"feed_maxlen: expected at least 100 entries, got {feed_maxlen!r}")
        #: Others' changes come through a change feed (:mod:`kvtier.backends.change_feed`),
        #: where the tier has one; the sweep every ``sync_interval_s`` is then the backstop.
        self.feed = feed
        self.feed_maxlen = feed_maxlen
        if sync_interval_s is None:
            sync_interval_s = SWEEP_WITH_FEED_S if feed else SWEEP_ALONE_S
        check_seconds(sync_interval_s=sync_interval_s)
        #: the server, as logged (never a secret)
        self.where = where
        self.prefix = prefix
        self.sync_interval_s = float(sync_interval_s)
        #: shares a job's records on one route are cut into (each on a thread of its own)
        self.job_connections = 1
        self._health = Health(where, kind=self.name)
        self._pool_threads: ThreadPoolExecutor | None = None
        self._prefix_bytes = b""
        self._meta_key = b""
        #: The server holds another store's meta record under this prefix: serve nothing from it.
        self._foreign = False
        #: Keys under the prefix that failed to load as ours (wrong type, unknown version): the
        #: sweeps do not adopt them again until this tier writes them (bounded, oldest dropped).
        self._unreadable: dict[bytes, None] = {}
        self._unreadable_lock = threading.Lock()
        self.rows_moved = Count()  # records not served or stored: their row moved in the transfer (remote_rows), from any thread
        #: a server unreachable, and either kind of failure (see the class attributes)
        self._down_errors: tuple[type[BaseException], ...] = (Down, *self.down_errors)
        self._failure_errors: tuple[type[BaseException], ...] = (*self._down_errors, *self.refused_errors)

    @property
    def view(self) -> SharedIndexView | None:
        """The sweep of the shared index (the follower's backstop), ``None`` when not open."""
        return self.follower.view if self.follower is not None else None

    def _feed_recovered(self) -> None:
        # The feed's own connection reached the server: end the outage now, so the keys it is
        # about to adopt are loaded rather than missed until the data path's backoff runs out.
        self._health.succeeded()

    # -- hooks (see the module doc) ----------------------------------------------------------------
    def _make_feed(self) -> ChangeFeed | None:
        """This namespace's change feed on the server (called at open), or ``None`` where the
        tier has none: the sweep alone then follows the other hosts."""
        return None

    def _connect(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _connect")

    def _disconnect(self) -> None:
        """Close the clients; the default has none."""

    def _read_meta(self) -> bytes | None:
        raise NotImplementedError(f"{type(self).__name__} must implement _read_meta")

    def _write_meta(self, value: bytes, only_new: bool) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _write_meta")

    def _put_records(self, route: Any, rkeys: list[bytes], records: list[tuple[bytes, Any]]) -> list[bool]:
        raise NotImplementedError(f"{type(self).__name__} must implement _put_records or _write_share")

    def _get_records(self, route: Any, rkeys: list[bytes]) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement _get_records or _read_share")

    def _delete_records(self, route: Any, rkeys: list[bytes]) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement _delete_records")

    def probe(self, timeout_s: float) -> str | None:
        raise NotImplementedError(f"{type(self).__name__} must implement probe")

    def _routes(self, rkeys: Sequence[bytes]) -> list[Route]:
        """Which server holds which keys; one server (this tier's health) by default."""
        return [(self._health, None, list(range(len(rkeys))))]

    def _note_failure(self, exc: BaseException) -> None:
        """A share or a sweep failed with ``exc`` (e.g. re-read a cluster's slot map)."""

    def _healths(self) -> list[Health]:
        """Every server's health, for ``stats``."""
        return [self._health]

    def _start_io_threads(self, workers: int) -> None:
        """The threads that run every share but the first of each job (once, at connect)."""
        if workers > 0 and self._pool_threads is None:
            self._pool_threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"kvtier-{self.name}")

    # -- lifecycle -------------------------------------------------------------------------------
    def reserve_bytes(self) -> int:
        return self.format.block_bytes + self._head_bytes()

    @property
    def variable_size(self) -> bool:
        """Whether records may be smaller than ``reserve_bytes()``: only behind a compressing
        codec. Without one, every record is its header and the whole block, so the manager
        accounts each at the reserve and keeps no size per key."""
        return self.codec.codec_id != NoneCodec.codec_id

    async def open(self, fmt: BlockFormat) -> None:
        await super().open(fmt)
        self._prefix_bytes = f"{self.prefix}:{fmt.namespace_digest[:8].hex()}:".encode()
        self._meta_key = self._prefix_bytes + b"meta"
        self._start_following(
            f"{self.name} {self.where}", sweep=self._sweep, record_bytes=self.reserve_bytes(),
            feed=self._make_feed() if self.feed else None, sweep_interval_s=self.sync_interval_s, mark=False,
        )
        await asyncio.to_thread(self._connect_and_check)

    def _connect_and_check(self) -> None:
        """Connect and check the meta record. An unreachable server is an outage, not an error:
        the tier starts empty and fills once the server answers. What a meta record found there
        means is :mod:`kvtier.backends.remote_meta`'s to judge: a foreign one makes this tier
        serve nothing, never a refusal to start."""
        try:
            self._connect()
            raw = self._read_meta()
            ours = meta_value(self.format, self.mac, self._meta_key)
            if raw is None:
                self._write_meta(ours, True)
            else:
                where = f"{self.name} {self.where} prefix {self._prefix_bytes.decode()}"
                verdict, reason = judge_meta(bytes(raw), self.format, self.mac, self._meta_key, where=where)
                if verdict is MetaVerdict.REPLACE:
                    log.warning("%s: the meta record under %r is not ours (%s); rewriting it", self.name, self._meta_key, reason)
                    self._write_meta(ours, False)
                elif verdict is MetaVerdict.FOREIGN:
                    self._foreign = True
                    message = (
                        f"{self.name}: {where} holds a meta record of another store ({reason}); this tier serves "
                        "nothing from it (reads miss, writes are refused). Use another prefix, or a mac_key "
                        "shared by the fleet so a planted record is told apart"
                    )
                    log.warning(message)
                    warnings.warn(message, RuntimeWarning, stacklevel=2)
        except self._down_errors as exc:
            self._health.failed(exc)
        except self.refused_errors as exc:  # refused auth, ACL denial, cluster not ready: loud, but not fatal
            log.error("%s: %s refused the connection set-up: %s", self.name, self.where, exc)
            self._health.failed(exc)
        else:
            self._health.succeeded()
            if self.follower is not None:  # the feed's head before the store lists the server
                self.follower.mark_start()

    async def aclose(self) -> None:
        if self._closed:
            return
        await super().aclose()
        if self.follower is not None:
            await asyncio.to_thread(self._stop_following)
        threads, self._pool_threads = self._pool_threads, None
        if threads is not None:
            threads.shutdown(wait=True)
        try:
            self._disconnect()
        except Exception as exc:  # closing sockets of a dead server must not fail a close
            log.debug("%s: close: %s", self.name, exc)

    # -- running a job's shares --------------------------------------------------------------------
    def _run_io(self, fn: Callable[[Any, list[int]], None], rkeys: list[bytes], record_bytes: int = 0) -> list[int]:
        """Run ``fn(handle, positions)`` per route (in shares, when the ``record_bytes``-byte
        records are worth several connections); return the positions that failed (a dead
        server's: it is marked down; every position when the routes cannot be had: the tier is)."""
        try:
            routes = self._routes(rkeys)
        except self._failure_errors as exc:
            self._note_failure(exc)
            self._health.failed(exc)
            return list(range(len(rkeys)))
        failed = self._run_routes(fn, routes, record_bytes)
        if len(failed) < len(rkeys) and self._health.succeeded() and self.follower is not None:
            self.follower.sweep_now()
        return failed

    def _run_routes(self, fn: Callable[[Any, list[int]], None], routes: list[Route], record_bytes: int = 0) -> list[int]:
        """Run ``fn`` per route, cut into shares of ``record_bytes``-byte records run on threads of
        their own (:mod:`kvtier.backends.remote_shares`), each server whose backoff has not run
        out skipped; return the positions of the shares that failed or were skipped. A server is
        marked down (or up) once per job, however many of its shares failed.

        Every share has ended when this returns, failed ones included: a share still running
        would go on writing into the caller's rows after the call returned."""
        runnable: list[Route] = []
        failed: list[int] = []
        for health, handle, positions in routes:
            if health.allow():
                runnable += ((health, handle, share) for share in split_shares(positions, record_bytes, self.job_connections))
            else:
                health.failed_fast(len(positions))
                failed.extend(positions)
        errors = run_all(self._pool_threads, [partial(self._run_share, fn, handle, share) for _, handle, share in runnable])
        verdict: dict[int, tuple[Health, BaseException | None]] = {}
        for (health, _, positions), exc in zip(runnable, errors):
            if exc is not None:
                failed.extend(positions)
            if isinstance(exc, Busy):
                continue  # says nothing of the server's health
            if verdict.get(id(health), (None, None))[1] is None:
                verdict[id(health)] = (health, exc)
        for health, exc in verdict.values():
            if exc is not None:
                health.failed(exc)
            elif health.succeeded() and self.follower is not None:
                self.follower.sweep_now()
        return failed

    def _run_share(self, fn: Callable[[Any, list[int]], None], handle: Any, positions: list[int]) -> BaseException | None:
        """One share of a job on one server; what made it fail (the server is then down, unless
        it is :class:`Busy`: no connection to give), or ``None``."""
        try:
            fn(handle, positions)
        except Busy as exc:  # our own load, not the server's state
            log.debug("%s: a share of %d records got no connection: %s", self.name, len(positions), exc)
            return exc
        except self._down_errors as exc:  # a dead server
            self._note_failure(exc)
            return exc.__cause__ or exc if isinstance(exc, Down) else exc
        except self.refused_errors as exc:  # auth refused, cluster down
            self._note_failure(exc)
            return exc
        return None

    # -- bulk I/O --------------------------------------------------------------------------------
    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        self._check_io(keys, blocks)
        n = len(keys)
        if self._foreign or not self._health.allow():
            self._health.failed_fast(n)
            self._count_writes(0, 0, n)
            return [None] * n
        job = WriteJob(keys, [self.remote_key(k) for k in keys], blocks, self.format.block_bytes)
        self._run_io(partial(self._write_share, job=job), job.rkeys, self.reserve_bytes())
        moved = job.moved()
        self.rows_moved.add(len(moved) + len(job.refused))
        if moved:  # removed: never a record of other bytes than the row's (kvtier.backends.remote_rows)
            self._delete([keys[i] for i in moved])
        sizes = job.sizes
        done = [keys[i] for i in range(n) if sizes[i] is not None]
        self._count_writes(len(done), sum(s for s in sizes if s is not None), n - len(done))
        if done and self.follower is not None:
            self._followed_writes(done)
        if done and self._unreadable:
            with self._unreadable_lock:
                for key in done:
                    self._unreadable.pop(key, None)
        return sizes

    def _write_share(self, handle: Any, positions: list[int], *, job: WriteJob) -> None:
        """Store the share's records (the default: encode them all, one ``_put_records`` batch)."""
        sent = job.unmoved([(i, self._encode_one(job.keys[i], block)) for i, block in job.taken(positions)])
        stored = self._put_records(handle, [job.rkeys[i] for i, _ in sent], [record for _, record in sent]) if sent else []
        for (i, (head, payload)), ok in zip(sent, stored):
            if ok:
                job.sizes[i] = len(head) + len(payload)

    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        size = self._check_io(keys, out)
        n = len(keys)
        if self._foreign or not self._health.allow():
            self._health.failed_fast(n)
            found = [False] * n
            self._count_reads(found, size, corrupt=0)
            return found
        job = ReadJob(keys, [self.remote_key(k) for k in keys], out)
        for i in self._run_io(partial(self._read_share, job=job), job.rkeys, self.reserve_bytes()):
            job.found[i] = False  # a server that failed mid-reply: its whole share is a miss
        if job.bad:
            self._delete(job.bad)
        if job.unreadable:
            self._remember_unreadable(job.unreadable)
        self._count_reads(job.found, size, corrupt=len(job.bad))
        if self.follower is not None:
            self._followed_reads(keys, job.found)
        return job.found

    def _read_share(self, handle: Any, positions: list[int], *, job: ReadJob) -> None:
        """Load the share's records (the default: one ``_get_records`` batch, each record then
        checked and decoded into its block)."""
        raws = self._get_records(handle, [job.rkeys[i] for i in positions])
        for i, raw in zip(positions, raws):
            if raw is not None:
                job.found[i] = self._accept(job, i, partial(self._decode_into, job.keys[i], raw))

    def _decode_into(self, key: bytes, raw: Any, view: memoryview) -> None:
        decode_record(key, raw, view, mac=self.mac)

    def _accept(self, job: ReadJob, i: int, fill: Callable[[memoryview], Any], *, lease: RowLease | None = None, landing: bool = False) -> bool:
        """Let ``fill`` land record ``i`` in its block (checked; :func:`fill_row` says how a row
        that moves meanwhile is a miss); ``False`` for a miss. A bad record is logged and queued
        in ``job.bad`` for deletion; one of another format or secret in ``job.unreadable``."""
        key = job.keys[i]
        try:
            landed = fill_row(job.out[i], self.format.block_bytes, fill, lease, landing)
        except UnsupportedRecordError as exc:
            # Another writer's format or secret: a miss here, theirs to keep.
            log.debug("%s: record %s… not readable here (%s)", self.name, key.hex()[:16], exc)
            job.unreadable.append(key)
            return False
        except CorruptBlockError as exc:
            log.warning("%s: bad record %s… on %s (%s); deleting it", self.name, key.hex()[:16], self.where, exc)
            self._count_auth(exc)
            job.bad.append(key)
            return False
        if not landed:
            self.rows_moved.add(1)  # its bytes landed where the row used to be (on a share's thread)
        return landed

    def _remember_unreadable(self, keys: list[bytes]) -> None:
        with self._unreadable_lock:
            book = self._unreadable
            for key in keys:
                book[key] = None
            while len(book) > UNREADABLE_MAX:
                del book[next(iter(book))]

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        keys = list(keys)
        check_keys(keys)  # before anything is sent: a deletion is also logged for every engine (redis)
        self._delete(keys)

    def _delete(self, keys: list[bytes]) -> None:
        if not keys:
            return
        if not self._health.allow():
            self._health.failed_fast(len(keys))
            if self.follower is not None:
                self.follower.note_deleted(keys)
            return  # the server is gone; its own eviction (or TTL) reclaims the records later
        rkeys = [self.remote_key(k) for k in keys]
        deleted = Count()  # (added to by each share, on a thread of its own)
        self._run_io(lambda handle, positions: deleted.add(self._delete_records(handle, [rkeys[i] for i in positions])), rkeys)
        self._count_deleted(deleted.value)
        if self.follower is not None:
            self._followed_deletes(keys)

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        every = self._healths()
        data.update(
            up=self._health.up,
            outages=sum(h.outages for h in every),
            connection_errors=sum(h.connection_errors for h in every),
            fast_failures=sum(h.fast_failures for h in every),
            rows_moved=self.rows_moved.value,
        )
        if self.follower is not None:
            data["follow"] = self.follower.stats()
            data["index"] = data["follow"]["index"]
        return data

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data.update(prefix=self.prefix, sync_interval_s=self.sync_interval_s)
        if not self.feed:
            data["feed"] = False
        if self.feed_maxlen != FEED_MAXLEN:
            data["feed_maxlen"] = self.feed_maxlen
        return data
