"""How a remote tier lists what its server holds: the sweep behind the shared index, and the
listing a store adopts at open.

:class:`RemoteListing` is mixed into :class:`kvtier.backends.remote_tier.RemoteRecordBackend`.
A record is stored under ``<prefix><32-byte block key>`` (``remote_key``); the listing asks the
server for the keys under the prefix, keeps the block keys of records and leaves everything
else under the prefix out (the meta record, the change feed, tags). Two hooks list the server:

``_list_keys() -> Iterable[bytes]``
    Every remote key under the prefix, paged by the server (never one reply for all); the
    listing cuts the prefix off (with ``block_key``, where a tier names records otherwise).
``_list_block_keys() -> Iterable[Sequence[bytes]] | None``
    Where the tier can do better: the block keys themselves, in batches (the ``redis`` tier
    parses each ``SCAN`` reply as one array, :mod:`kvtier.backends.redis_scan`). ``None``, the
    default, means ``_list_keys``.

Either may raise :class:`SweepSkipped` to skip a round without marking the server down. A
store's open adopts ``_open_table()`` (:meth:`RemoteListing.scan_columns`): the listing by
default, a faster source where the tier keeps one (the ``redis`` tier's key log); ``scan()`` is
always the server's own listing.

The listing is a set (a server may list a key twice while its table grows); keys of records
that failed to load as ours are left out until this tier writes them again, and a server that
holds another store's meta record lists nothing. A store's open takes the listing as columns
(:class:`kvtier.bulk.RecordColumns`): one object per record, its key; every record at the
reserve size and stamped now (the server keeps no access time we could read in bulk). The
sweeps gather the keys into a dict batch by batch as the server lists them (which drops a key
listed twice). A store's open gathers them into one list instead (``repeats``: a key log names a
key at each write) and builds no dict on its listing thread: the tables a growing dict outgrows
stayed free at the top of that thread's heap. The adopting thread drops the repeats
(:meth:`RecordColumns.distinct`, which builds the table the manager's index copies whole), and
the list becomes the eviction order's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import repeat
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

import numpy as np
from kvtier.backends.feed_follower import TierFollower
from kvtier.backends.remote_health import Health

from kvtier.backend import RecordInfo
from kvtier.bulk import READY, RecordColumns

__all__ = ["KEY_BYTES", "Dropped", "Listed", "RemoteListing", "SweepSkipped"]

log = logging.getLogger("kvtier")

KEY_BYTES = 32
#: What a listing gives: a dict of the keys (each mapped to ``READY``), or, for a store's open, a
#: list of them in listing order that may name a key more than once.
Listed = dict[bytes, int] | list[bytes]


class Dropped(list):  # type: ignore[type-arg]
    """A batch of keys to leave out of the listing gathered so far (a log of what was stored and
    deleted, replayed in order: :mod:`kvtier.backends.redis_keylog`)."""


class SweepSkipped(Exception):
    """Raised by ``_list_keys``: skip this sweep (back-pressure), the server is not down."""


class RemoteListing:
    """The listing half of a remote tier (see the module doc)."""

    name: ClassVar[str]
    follower: TierFollower | None
    _closed: bool
    _health: Health
    _prefix_bytes: bytes
    _foreign: bool
    _unreadable: dict[bytes, None]
    _unreadable_lock: threading.Lock
    _failure_errors: tuple[type[BaseException], ...]

    if TYPE_CHECKING:  # the backend's, declared for the type checker only (no stub shadows them)

        def _check_open(self) -> Any: ...
        def _note_failure(self, exc: BaseException) -> None: ...
        def reserve_bytes(self) -> int: ...

    def _list_keys(self) -> Iterable[bytes]:
        raise NotImplementedError(f"{type(self).__name__} must implement _list_keys")

    def _list_block_keys(self) -> Iterable[Sequence[bytes]] | None:
        """The block keys of every record on the server, in batches (the prefix cut off, other
        keys left out), where the tier can list them so faster than ``_list_keys``; ``None``
        (the default): the sweep lists ``_list_keys`` and cuts the prefix itself."""
        return None

    def remote_key(self, key: bytes) -> bytes:
        """A block key's name on the server."""
        return self._prefix_bytes + key

    def block_key(self, rkey: bytes) -> bytes | None:
        """The block key named ``rkey`` on the server, or ``None`` for anything else under the prefix."""
        plen = len(self._prefix_bytes)
        return rkey[plen:] if len(rkey) == plen + KEY_BYTES and rkey.startswith(self._prefix_bytes) else None

    def _sweep(self) -> AbstractSet[bytes] | None:
        """Every key of this namespace on the server, or ``None`` when the server is down, its
        backoff has not run out, or the round was skipped."""
        found = self._listing()
        return None if found is None else found.keys()

    @overload
    def _listing(self, batches_of: Callable[[], Iterable[Sequence[bytes]]] | None = None) -> dict[bytes, int] | None: ...

    @overload
    def _listing(self, batches_of: Callable[[], Iterable[Sequence[bytes]]] | None, *, as_list: Literal[True]) -> Listed | None: ...

    def _listing(self, batches_of: Callable[[], Iterable[Sequence[bytes]]] | None = None, *, as_list: bool = False) -> Listed | None:
        """:meth:`_sweep`'s keys as a dict, each mapped to :data:`kvtier.bulk.READY` (what a
        store's open hands the manager whole, see :class:`RecordColumns`). The keys of a batch
        go in as it comes, so the dict is built while the server lists the next one.
        ``batches_of``: where the keys come from instead of the server's listing (the open's
        :meth:`_open_table`, from a log the tier keeps).

        ``as_list`` (a store's open): the keys in one list as they come, a key maybe more than
        once, and no dict, unless a batch drops keys (a log's deletions are replayed in the dict,
        from there on) or keys are to be left out. A dict built here grows by outgrowing tables,
        and those below glibc's mmap threshold stay free at the top of this thread's heap, which
        ``malloc_trim`` leaves (about 3 B a key at 10^5); the adopting thread drops the repeats
        (:meth:`RecordColumns.distinct`), and the list itself becomes the eviction order's."""
        if self._closed or not self._health.allow():
            return None
        found: dict[bytes, int] = {}
        keys: list[bytes] | None = [] if as_list else None
        try:
            batches = self._list_block_keys() if batches_of is None else batches_of()
            if batches is not None:  # the tier lists block keys itself, in bulk
                for batch in batches:
                    if type(batch) is Dropped:
                        if keys is not None:  # replayed in a dict from here on, as the sweeps do
                            found, keys = dict.fromkeys(keys, READY), None
                        for key in batch:
                            found.pop(key, None)
                    elif keys is not None:
                        keys += batch
                    else:
                        found.update(zip(batch, repeat(READY)))
            elif type(self).block_key is RemoteListing.block_key:  # the key follows the prefix: one pass in C
                plen, prefix = len(self._prefix_bytes), self._prefix_bytes
                want = plen + KEY_BYTES
                found.update((rkey[plen:], READY) for rkey in self._list_keys() if len(rkey) == want and rkey.startswith(prefix))
            else:
                found.update((key, READY) for key in map(self.block_key, self._list_keys()) if key is not None)
            if batches is None:  # listed into the dict above
                keys = None
        except SweepSkipped as exc:  # back-pressure: the index stays as it is until the next round
            log.debug("%s: index sweep skipped: %s", self.name, exc)
            return None
        except self._failure_errors as exc:
            self._note_failure(exc)
            self._health.failed(exc)
            return None
        self._health.succeeded()
        if self._foreign:
            return {}
        if keys is not None:
            if not self._unreadable:
                return keys
            found = dict.fromkeys(keys, READY)  # keys to leave out: a dict after all
        if self._unreadable:
            with self._unreadable_lock:
                for key in self._unreadable:
                    found.pop(key, None)
        return found

    def _open_table(self) -> Listed | None:
        """The table a store's open adopts (:meth:`scan_columns`): the server's listing, or what
        a tier lists faster at open (the ``redis`` tier's key log,
        :mod:`kvtier.backends.redis_keylog`)."""
        return self._listing()

    def scan(self) -> Iterator[RecordInfo]:
        """The keys on the server now (its own listing: never a log of what was stored)."""
        listed = self._columns(self._listing)
        return iter([RecordInfo(k, n, t) for k, n, t in listed])

    def scan_columns(self) -> RecordColumns:
        """The keys a store's open adopts (:meth:`_open_table`; none while the server is down),
        as columns: each stamped now, at the reserve size (no object per record but its key); a
        key may come more than once (``repeats``: ``distinct()`` keeps each once)."""
        return self._columns(self._open_table)

    def _columns(self, listing: Callable[[], Listed | None]) -> RecordColumns:
        self._check_open()
        started = time.perf_counter()
        listed = listing() or {}
        # A list (a store's open): the keys as listed, maybe repeated, the adopter drops repeats.
        keys, table = (listed, None) if type(listed) is list else (list(listed), listed)
        n = len(keys)
        if self.follower is not None:
            self.follower.note_listed(n, time.perf_counter() - started)
        # One size and one stamp for all, as read-only columns of a single element each: no
        # memory per record (arrays made on this thread would outlive the open in its arena).
        stored = np.broadcast_to(np.int64(self.reserve_bytes()), (n,))
        return RecordColumns(keys, stored, np.broadcast_to(np.float64(time.time()), (n,)), oldest_first=True, table=table, repeats=table is None)
