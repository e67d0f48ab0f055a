"""The change feed of a ``redis`` tier: a capped Redis stream per namespace (see
:mod:`kvtier.backends.change_feed` for what a feed carries).

The stream is ``<prefix>:<namespace digest, 16 hex>:feed``, next to the namespace's records (in a
cluster it lives on the primary of its slot). Each entry is one field ``e`` holding one encoded
:class:`~kvtier.backends.change_feed.FeedEntry`.

* **publish**: one ``XADD <stream> MAXLEN ~ <maxlen> * e <entry>`` per job (a job larger than
  ``max_keys_per_entry`` keys sends its entries in one pipeline). The approximate cap lets the
  server trim whole macro nodes, so the stream costs about ``maxlen`` entries of memory and
  trimming costs nothing per write.
* **read**: ``XREAD COUNT 1000 BLOCK <ms> STREAMS <stream> <cursor>`` (no ``BLOCK`` for a read that
  must not wait): the server answers as
  soon as an entry arrives, so the staleness is one round trip, whatever the block time.
* **gaps**: after a read that returned entries, ``XINFO STREAM`` gives the stream's first entry.
  Trimming removes the oldest entries first, so if an entry after the cursor was trimmed, so
  was the cursor's own entry, and the first entry is then past the cursor: that is a gap (the
  follower sweeps). A follower that merely lags by less than ``maxlen`` entries never sees one.
  From the start cursor ``0-0`` (no stream yet when the follower started), the stream's
  ``entries-added`` against its ``length`` tells whether anything was trimmed. A stream that
  vanished (a server restart without persistence, ``FLUSHALL``, the key evicted) comes back
  with ids past the cursor and a first entry past it too: a gap, and a sweep.

ACL: the feed needs ``+xadd +xread +xinfo|stream`` on the ``<prefix>:*`` keys besides the
record commands (``docs/tiers.md``).

**waking** (a store's close): the ``XREAD`` goes out on a connection the read holds, and the
reply is waited for with ``poll`` on that socket and on a pipe of the feed's own, which
:meth:`~kvtier.backends.change_feed.ChangeFeed.wake` writes a byte to. A woken read drops its
connection (its reply is still owed; the server ends the blocked command when the connection
closes) and returns no entries: the follower stops at once instead of after the block time.
All on the client side: no ``CLIENT UNBLOCK`` (which would need ``+client|unblock``), no wake
entries written, the same under Redis, Redis Cluster and Valkey.

The feed uses a client of its own (two connections: the follower's blocking read never takes a
connection the tier's jobs wait for); in a cluster, a client of the primary that holds the
stream's slot. Errors are translated: ``publish`` returns ``False``, ``head``/``read`` raise
:class:`OSError`. After a redirection (the slot moved: a resharding, a failover) or a lost
connection the client is dropped, and the next command makes one again.
"""

from __future__ import annotations

import logging
import os
import select
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.backends.change_feed import ChangeFeed, FeedCursor, FeedEntry, FeedRead, decode_entry

from kvtier.records.counts import counts_add

try:
    from redis.exceptions import AskError, ClusterDownError, RedisError
    from redis.exceptions import ConnectionError as RedisConnectionError
except ImportError:  # pragma: no cover - redis is a dependency
    RedisError = RedisConnectionError = AskError = ClusterDownError = Exception  # type: ignore[assignment,misc]

__all__ = ["RedisFeed", "parse_stream_id"]

log = logging.getLogger("kvtier")

_READ_COUNT = 1000
_FIELD = b"e"
#: Seconds a blocked read waits for its reply beyond the block time before it gives up.
_REPLY_SLACK_S = 1.0


def parse_stream_id(raw: bytes | str) -> FeedCursor:
    """``b"1700000000000-3"`` -> ``FeedCursor(1700000000000, 3)``."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return FeedCursor(int(ms), int(seq or 0))


def _get(info: dict[Any, Any], name: str) -> Any:
    return info.get(name, info.get(name.encode()))


class RedisFeed(ChangeFeed):
    """A capped stream ``stream`` on the server ``make_client()`` connects to."""

    def __init__(
        self,
        stream: bytes,
        make_client: Callable[[], Any],
        *,
        writer: bytes | None = None,
        maxlen: int = 100_000,
    ) -> None:
        super().__init__(writer)
        if maxlen < 100:
            raise ValueError(f"feed_maxlen: expected at least 100 entries, got {maxlen!r}")
        self.stream = stream
        self.maxlen = int(maxlen)
        self._make_client = make_client
        self._client: Any = None
        self._pipe: tuple[int, int] | None = None  # (read end, write end): wakes a blocked read
        self.commands = 0  # commands sent (the benchmark's figure)

    def _conn(self) -> Any:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def append(self, values: Sequence[bytes]) -> bool:
        try:
            client = self._conn()
            if len(values) == 1:
                client.xadd(self.stream, {_FIELD: values[0]}, maxlen=self.maxlen, approximate=True)
            else:
                pipe = client.pipeline(transaction=False)
                for value in values:
                    pipe.xadd(self.stream, {_FIELD: value}, maxlen=self.maxlen, approximate=True)
                pipe.execute()
            counts_add(self, "commands", len(values))
        except (RedisError, OSError) as exc:
            log.debug("redis feed %r: XADD failed: %s", self.stream, exc)
            self._failed(exc)
            return False
        return True

    def _info(self) -> dict[Any, Any] | None:
        """``XINFO STREAM``, or ``None`` when there is no stream."""
        counts_add(self, "commands", 1)
        try:
            return dict(self._conn().xinfo_stream(self.stream))
        except RedisError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise

    def head(self) -> FeedCursor:
        try:
            info = self._info()
        except (RedisError, OSError) as exc:
            self._failed(exc)
            raise OSError(f"redis feed: XINFO STREAM failed: {exc}") from exc
        if info is None:
            return FeedCursor()
        return parse_stream_id(_get(info, "last-generated-id"))

    def read(self, cursor: FeedCursor, wait_s: float) -> FeedRead:
        try:
            reply = self._blocking_read(cursor, wait_s)
            if not reply:  # nothing within the block time, or woken
                return FeedRead((), cursor)
            items = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
            entries: list[FeedEntry] = []
            skipped = nbytes = 0
            last = cursor
            for raw_id, fields in items:
                last = parse_stream_id(raw_id)
                value = fields.get(_FIELD, fields.get(_FIELD.decode())) if fields else None
                entry = decode_entry(value) if value is not None else None
                nbytes += len(value) if value is not None else 0
                if entry is None:
                    skipped += 1
                else:
                    entries.append(entry)
            info = self._info()
        except (RedisError, OSError) as exc:
            self._failed(exc)
            raise OSError(f"redis feed: XREAD failed: {exc}") from exc
        return FeedRead(tuple(entries), last, self._lost(cursor, info), skipped, nbytes)

    def _wake_fd(self) -> int:
        """The read end of the wake pipe (made at the first read, closed by :meth:`close`)."""
        if self._pipe is None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._pipe = (r, w)
        return self._pipe[0]

    def wake(self) -> None:
        super().wake()
        pipe = self._pipe
        if pipe is not None:
            try:
                os.write(pipe[1], b"w")
            except OSError:  # full (a wake is pending anyway) or closed (nothing to wake)
                pass

    def _blocking_read(self, cursor: FeedCursor, wait_s: float) -> Any:
        """``XREAD ... BLOCK`` on a connection held for it; its reply (RESP2, parsed as
        redis-py does), or ``None`` when woken first."""
        wake_fd = self._wake_fd()  # before the wake is looked at: a later wake writes to it
        if self._woken.is_set():
            self._drain_wake()
            return None
        client = self._conn()
        if hasattr(client, "get_node_from_key"):  # a cluster client: the stream's primary
            client = client.get_redis_connection(client.get_node_from_key(self.stream))
        pool = client.connection_pool
        conn = pool.get_connection()
        answered = False
        try:
            counts_add(self, "commands", 1)
            # No wait: no BLOCK (a server times blocked commands out at its ``hz``, 100 ms by
            # default, so even ``BLOCK 1`` would take that long on a stream with nothing new).
            block_ms = max(1, int(wait_s * 1000)) if wait_s > 0 else 0
            block = ("BLOCK", block_ms) if block_ms else ()
            conn.send_command("XREAD", "COUNT", _READ_COUNT, *block, "STREAMS", self.stream, str(cursor))
            poller = select.poll()
            poller.register(conn._sock, select.POLLIN)
            poller.register(wake_fd, select.POLLIN)
            ready = {fd for fd, _ in poller.poll((block_ms / 1000 + _REPLY_SLACK_S) * 1000)}
            if wake_fd in ready:
                self._drain_wake()
                return None
            if not ready:
                raise TimeoutError(f"no XREAD reply within {block_ms / 1000 + _REPLY_SLACK_S:g} s")
            reply = client.parse_response(conn, "XREAD")
            answered = True
            return reply
        finally:
            if not answered:  # the reply is still owed (woken, timed out) or the stream is unknown
                conn.disconnect()
            pool.release(conn)

    def _drain_wake(self) -> None:
        self._take_wake()
        if self._pipe is not None:
            try:
                while os.read(self._pipe[0], 64):
                    pass
            except BlockingIOError:
                pass

    @staticmethod
    def _lost(cursor: FeedCursor, info: dict[Any, Any] | None) -> bool:
        """Whether entries after ``cursor`` were trimmed before they were read."""
        if info is None:
            return True  # the stream vanished after answering: its entries are gone
        first = _get(info, "first-entry")
        if not first:
            return False
        if cursor == FeedCursor():
            added, length = _get(info, "entries-added"), _get(info, "length")
            return added is None or int(added) > int(length)
        return parse_stream_id(first[0]) > cursor

    def _failed(self, exc: BaseException) -> None:
        """Drop the client after a redirection or a lost connection (see the module doc)."""
        if isinstance(exc, (AskError, ClusterDownError, RedisConnectionError, OSError)):  # MovedError is an AskError
            self._drop_client()

    def close(self) -> None:
        self._drop_client()
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            os.close(pipe[0])
            os.close(pipe[1])

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # closing sockets of a dead server must not fail a close
                log.debug("redis feed: close: %s", exc)
