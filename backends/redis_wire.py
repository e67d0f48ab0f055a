"""The bytes of a redis tier job on the wire: scatter sends and RESP2 replies read into place.

redis-py connects, authenticates (password, ACL user, TLS) and pools connections; a job then
borrows one connection and talks RESP2 on its socket directly, because redis-py's reply path
copies every value twice more than needed (into hiredis's buffer, then into a ``bytes``). Here a
record's header is read into a small buffer and a raw payload straight into the destination
block, checksummed piece by piece as it lands (each ``recv_into`` at most :data:`RECV_PIECE`
bytes, hashed while still in the CPU cache: one pass over memory, not a receive and then a
second pass). Writes go out as ``sendmsg`` scatter lists (command, header, payload views),
never joined. A put keeps exactly one ``SET`` in flight on each of a few connections
(:func:`send_one_each`), checksumming each record just before it goes out.

Why one request in flight per connection: redis-server reads as much of a socket as its query
buffer has room for. With records streamed back to back on one connection, a read takes one
record and the start of the next, so the server copies the first out of its buffer instead of
keeping the buffer as the value, and pays one more system call and event-loop turn per record.
With a single request on the socket, every read is exactly one command, which the server keeps
as it is. Measured here (2 cores, redis-server 7.0, 4096 puts of 64 KiB records, raw sockets):
the server's CPU per GB stored 1.12 s with four connections one request each against 1.23-1.64 s
streamed on one, page faults per MiB stored 272 against 304; 2 MiB records 0.67-0.71 s against
0.78-0.93 s, and 1.40-1.43 GB/s against 1.03-1.13 (``benchmarks/bench_redis_server.py`` shows the
same accounts for the tier and for LMCache's client, which works this way).

A :class:`Wire` lives for one exchange: every request sent is answered before the connection
goes back to the pool. Any exception leaves the stream in an unknown place, so callers then
disconnect the connection (redis-py reconnects it on next use).
"""

from __future__ import annotations

import mmap
import selectors
import socket
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

from kvtier.records.codec import NoneCodec, codec_for_id
from kvtier.records.format import (
    FLAG_MAC_GMAC,
    HEADER_SIZE,
    MAC_FLAGS,
    MAC_TAG_SIZE,
    RecordMac,
    check_digest,
    parse_header,
    payload_hasher,
    verify_payload,
)

try:
    import hiredis as _hiredis
except ImportError:  # pragma: no cover - comes with redis[hiredis]; the general parse then
    _hiredis = None

__all__ = [
    "PUT_CONNECTIONS",
    "RECV_PIECE",
    "ErrorReply",
    "Scratch",
    "Wire",
    "get_command",
    "receive_record",
    "send_one_each",
    "set_command",
    "unlink_command",
]

_IOV = 512  # buffers per sendmsg call (IOV_MAX is 1024 on Linux)
_BUFFER = 1 << 16
#: Most bytes one ``recv_into`` lands when each piece is checksummed as it arrives: small enough
#: to be hashed from the CPU cache (L2 is 2 MiB per core here), large enough that the system
#: calls stay few. Hashing a 2 MiB block after it was received ran at DRAM speed (8 GB/s here).
RECV_PIECE = 256 << 10


class ErrorReply(Exception):
    """An error reply (``-OOM ...``, ``-MOVED ...``): that request failed, the stream is fine."""


def set_command(rkey: bytes, head: bytes, length: int, ttl_ms: bytes) -> tuple[bytes, bytes]:
    """``(before, after)`` to send around a record's payload: ``SET key <head+payload> [PX ms]``."""
    if ttl_ms:
        before = b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (len(rkey), rkey, length, head)
        return before, b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(ttl_ms), ttl_ms)
    return b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (len(rkey), rkey, length, head), b"\r\n"


def get_command(rkey: bytes, ttl_ms: bytes) -> bytes:
    """``GET key``, or ``GETEX key PX ms`` (a sliding expiry) when the tier has a TTL."""
    if ttl_ms:
        return b"*4\r\n$5\r\nGETEX\r\n$%d\r\n%b\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(rkey), rkey, len(ttl_ms), ttl_ms)
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(rkey), rkey)


def unlink_command(rkey: bytes) -> bytes:
    return b"*2\r\n$6\r\nUNLINK\r\n$%d\r\n%b\r\n" % (len(rkey), rkey)


#: Connections a put share keeps one ``SET`` in flight on (see the module doc): four beat one
#: streamed connection on both record sizes measured; eight were no faster than four.
PUT_CONNECTIONS = 4


def send_one_each(
    wires: Sequence[Wire],
    requests: Iterator[tuple[int, Sequence[Any]]],
    on_reply: Callable[[int, ErrorReply | None], None],
    timeout: float | None,
) -> None:
    """Send every ``(tag, buffers)`` request of ``requests``, keeping exactly one in flight on
    each wire: a wire's next request goes out once its reply is in, which ``on_reply(tag,
    error)`` is given (``error``: the server's error reply, or ``None``). One thread drives
    every wire. A request is made (the iterator advanced) only when a wire is free for it.

    Returns once every request sent has been answered. A wire that stays silent ``timeout``
    seconds raises ``TimeoutError``; any exception leaves the wires with replies unread."""
    waiting: dict[Wire, int] = {}
    with selectors.DefaultSelector() as sel:
        for wire in wires:
            request = next(requests, None)
            if request is None:
                break
            wire.send(request[1])
            waiting[wire] = request[0]
            sel.register(wire.sock, selectors.EVENT_READ, wire)
        while waiting:
            ready = sel.select(timeout)
            if not ready:
                raise TimeoutError(f"no reply from the server in {timeout} s")
            for key, _ in ready:
                wire = key.data
                tag = waiting.pop(wire)
                try:
                    wire.reply()
                    error = None
                except ErrorReply as exc:  # OOM under noeviction, MOVED while resharding
                    error = exc
                on_reply(tag, error)
                request = next(requests, None)
                if request is None:
                    sel.unregister(wire.sock)
                    continue
                wire.send(request[1])
                waiting[wire] = request[0]


class Scratch:
    """A growable byte buffer in an anonymous private mapping of its own, unmapped by
    :meth:`close`: for a large buffer that lives for one read (a cluster primary's key logs at a
    store's open). Such a buffer taken from ``malloc`` on a worker thread comes from that
    thread's arena, and when freed it stays resident at the top of the arena's heap, which
    ``malloc_trim`` does not give back for arenas other than the main one (measured: 20 bytes
    of RSS per key left after an open at 10^6 keys, the logs of three primaries read into
    ``bytearray`` and ``numpy`` buffers on the open's thread). A mapping of its own never
    touches the heap."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self._map = mmap.mmap(-1, max(mmap.PAGESIZE, capacity), flags=mmap.MAP_PRIVATE)
        self.size = 0

    def reserve(self, size: int) -> mmap.mmap:
        """The mapping, at least ``size`` bytes long (grown by ``mremap``: no copy through the heap)."""
        if size > len(self._map):
            self._map.resize(max(size, 2 * len(self._map)))
        return self._map

    def append(self, data: Any) -> None:
        end = self.size + len(data)
        self.reserve(end)[self.size : end] = data
        self.size = end

    def view(self) -> memoryview:
        """The bytes appended so far (release it before :meth:`close`)."""
        return memoryview(self._map)[: self.size]

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view of it still lives: unmapped when the last one goes
            pass


class Wire:
    """RESP2 over one connected socket, for one exchange."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._scatter = hasattr(sock, "sendmsg") and type(sock) is socket.socket  # not an SSLSocket
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    # -- sending ---------------------------------------------------------------------------------
    def send(self, buffers: Sequence[Any]) -> None:
        """Send every buffer, in order, with as few system calls as the kernel allows."""
        if not self._scatter:
            for b in buffers:
                self.sock.sendall(b)
            return
        views = [memoryview(b).cast("B") for b in buffers]
        i = 0
        while i < len(views):
            sent = self.sock.sendmsg(views[i : i + _IOV])
            while sent:
                n = len(views[i])
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0
            while i < len(views) and not len(views[i]):
                i += 1

    # -- receiving -------------------------------------------------------------------------------
    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            live = self._end - self._start
            self._buf[:live] = self._buf[self._start : self._end]
            self._start, self._end = 0, live
        got = self.sock.recv_into(self._view[self._end :])
        if not got:
            raise ConnectionError("the server closed the connection")
        self._end += got

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start : i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._buf):
                raise ConnectionError("a reply line longer than the read buffer")
            self._fill()

    def reply(self) -> Any:
        """A small reply: ``+`` as bytes, ``:`` as int, ``$`` as bytes or ``None``; ``-`` raises."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if line == b"_":
            return None
        if kind == b"-":
            raise ErrorReply(rest.decode(errors="replace"))
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = bytearray(n)
            self.read_into(memoryview(data))
            self.skip(2)
            return bytes(data)
        raise ConnectionError(f"unexpected reply {line[:32]!r}")

    def bulk_length(self) -> int:
        """The length of the next bulk reply, ``-1`` for nil; an error reply raises."""
        line = self._line()
        if line[:1] == b"$":
            return int(line[1:])
        if line == b"_":  # RESP3 null, should a server speak it
            return -1
        if line[:1] == b"-":
            raise ErrorReply(line[1:].decode(errors="replace"))
        raise ConnectionError(f"expected a bulk reply, got {line[:32]!r}")

    def bulk_bodies(self, count: int, head: bytes, skip: int, body: Scratch) -> tuple[list[int], dict[int, str], int]:
        """:meth:`bulk_bodies_general`'s result, parsed by hiredis where it is installed (its
        replies taken a buffer at a time and split by calls that loop in C: about a third of the
        time per reply). Only for the last replies in flight on the connection."""
        if _hiredis is None:
            return self.bulk_bodies_general(count, head, skip, body)
        return self._bulk_bodies_hiredis(count, head, skip, body)

    def _bulk_bodies_hiredis(self, count: int, head: bytes, skip: int, body: Scratch) -> tuple[list[int], dict[int, str], int]:
        assert _hiredis is not None
        reader = _hiredis.Reader()
        if self._end > self._start:  # already read: the reader takes it first
            reader.feed(self._buf, self._start, self._end - self._start)
        self._start = self._end = 0
        lengths: list[int] = []
        errors: dict[int, str] = {}
        unmarked = -1
        cut = itemgetter(slice(skip, None))
        while len(lengths) < count:
            values = list(iter(reader.gets, False))
            if not values:
                got = self.sock.recv_into(self._view)
                if not got:
                    raise ConnectionError("the server closed the connection")
                reader.feed(self._buf, 0, got)
                continue
            first = len(lengths)
            if first + len(values) > count:
                raise ConnectionError("more replies than were asked for")
            if all(map(isinstance, values, repeat(bytes))):
                lengths += map(len, values)
                if unmarked < 0 and (min(lengths[first:]) < skip or not all(map(bytes.startswith, values, repeat(head)))):
                    unmarked = first + next(i for i, v in enumerate(values) if len(v) < skip or not v.startswith(head))
            else:  # nil or error replies among them
                for i, value in enumerate(values, first):
                    if isinstance(value, bytes):
                        lengths.append(len(value))
                        bad = len(value) < skip or not value.startswith(head)
                    else:
                        lengths.append(-1 if value is None else -2)
                        if value is not None:
                            errors[i] = str(value)
                        bad = True
                    if bad and unmarked < 0:
                        unmarked = i
                values = [v for v in values if isinstance(v, bytes)]
            rests = list(map(cut, values))
            size = sum(map(len, rests))
            out = body.reserve(body.size + size)
            out.seek(body.size)
            deque(map(out.write, rests), maxlen=0)
            body.size += size
        if reader.has_data():
            raise ConnectionError("more replies than were asked for")
        return lengths, errors, unmarked

    def bulk_bodies_general(self, count: int, head: bytes, skip: int, body: Scratch) -> tuple[list[int], dict[int, str], int]:
        """``count`` bulk replies (small values, many of them: a ``GET`` pipeline), each value's
        bytes after its first ``skip`` appended to ``body`` as it is read. ``(lengths, errors,
        unmarked)``: each reply's length in order (``-1`` for nil, ``-2`` for an error reply,
        whose text ``errors`` holds by position), and the position of the first value that is
        shorter than ``skip`` or does not begin with ``head`` (``-1``: none). A reply of another
        kind is a protocol error."""
        lengths: list[int] = []
        errors: dict[int, str] = {}
        unmarked = -1
        buf, view = self._buf, self._view
        find, marked = buf.find, buf.startswith
        out, pos = body.reserve(0), body.size  # the body's bytes written here, no call per reply
        for i in range(count):
            # A reply whose length line and value are buffered is taken here, with no call per
            # reply (most of them: a few hundred bytes each); the rest as any reply is.
            start = self._start
            eol = find(b"\r\n", start, self._end)
            if eol > start and buf[start] == 36:  # "$"
                n = int(buf[start + 1 : eol])
                v = eol + 2
                if skip <= n and v + n + 2 <= self._end:
                    if unmarked < 0 and not marked(head, v):
                        unmarked = i
                    if n > skip:
                        end = pos + n - skip
                        if end > len(out):
                            out = body.reserve(end)
                        out[pos:end] = view[v + skip : v + n]
                        pos = end
                    self._start = v + n + 2
                    lengths.append(n)
                    continue
            line = self._line()
            kind = line[:1]
            if kind == b"$":
                n = int(line[1:])
                lengths.append(n)
                if n >= 0:  # short, or not all in the buffer: read whole, then split
                    value = bytearray(n)
                    self.read_into(memoryview(value))
                    self.skip(2)
                    if unmarked < 0 and (n < skip or not value.startswith(head)):
                        unmarked = i
                    if n > skip:
                        body.size = pos
                        body.append(memoryview(value)[skip:])
                        out, pos = body.reserve(0), body.size
                elif unmarked < 0:
                    unmarked = i
            elif kind == b"-":
                lengths.append(-2)
                errors[i] = line[1:].decode(errors="replace")
                if unmarked < 0:
                    unmarked = i
            elif line == b"_":
                lengths.append(-1)
                if unmarked < 0:
                    unmarked = i
            else:
                raise ConnectionError(f"expected a bulk reply, got {line[:32]!r}")
        body.size = pos
        return lengths, errors, unmarked

    def array_length(self) -> int:
        """The element count of the next array reply (``-1`` for a nil array); an error raises."""
        line = self._line()
        if line[:1] == b"*":
            return int(line[1:])
        if line[:1] == b"-":
            raise ErrorReply(line[1:].decode(errors="replace"))
        raise ConnectionError(f"expected an array reply, got {line[:32]!r}")

    def read_into(self, out: memoryview, update: Callable[[memoryview], Any] | None = None) -> None:
        """Fill ``out`` exactly: first from what is buffered, then straight from the socket.

        With ``update``, every piece is passed to it right after it landed (in order, at most
        :data:`RECV_PIECE` bytes each), while it is still in the CPU cache."""
        n = len(out)
        have = min(n, self._end - self._start)
        if have:
            out[:have] = self._view[self._start : self._start + have]
            self._start += have
            if update is not None:
                update(out[:have])
        pos = have
        recv_into = self.sock.recv_into
        step = n if update is None else RECV_PIECE
        while pos < n:
            got = recv_into(out[pos : pos + step])
            if not got:
                raise ConnectionError("the server closed the connection")
            if update is not None:
                update(out[pos : pos + got])
            pos += got

    def skip(self, n: int) -> None:
        """Discard ``n`` bytes of the stream (the CRLF after a value, or an unwanted value)."""
        while n > 0:
            if self._start == self._end:
                self._fill()
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    @property
    def drained(self) -> bool:
        """Whether nothing was read past the last reply (the connection can be reused)."""
        return self._start == self._end


def receive_record(wire: Wire, key: bytes, out: memoryview, length: int, mac: RecordMac | None) -> None:
    """Read the ``length``-byte record of ``key`` (and its CRLF) from ``wire`` into ``out``.

    The header (and tag) is read and checked first; a raw payload then lands straight in ``out``
    and is verified there (an unkeyed or AES-GMAC one piece by piece as it lands, see
    :meth:`Wire.read_into`; BLAKE3 and HMAC-SHA256 ones once whole, since BLAKE3 hashes a large
    buffer on several threads), a coded one is verified, then decoded into ``out``. A bad record
    raises ``CorruptBlockError`` (``UnsupportedRecordError`` for another format) only after the
    whole value was consumed, so the stream stays usable; ``out`` then holds garbage.
    """
    head = bytearray(min(length, HEADER_SIZE))
    wire.read_into(memoryview(head))
    rest = length - len(head)
    try:
        if len(head) == HEADER_SIZE and head[7] & MAC_FLAGS and rest >= MAC_TAG_SIZE:
            tag = bytearray(MAC_TAG_SIZE)
            wire.read_into(memoryview(tag))
            head += tag
            rest -= MAC_TAG_SIZE
        header = parse_header(head, raw_length=len(out), available=length, mac=mac)
        h = payload_hasher(key, memoryview(head), header, mac) if header.codec_id == NoneCodec.codec_id else None
    except BaseException:
        wire.skip(rest + 2)
        raise
    if h is not None:
        whole = header.keyed and not header.flags & FLAG_MAC_GMAC  # BLAKE3 threads a whole buffer
        wire.read_into(out, None if whole else h.update)
        wire.skip(2)
        if whole:
            h.update(out)
        check_digest(h, memoryview(head), header)
        return
    payload = bytearray(header.stored_length)
    wire.read_into(memoryview(payload))
    wire.skip(2)
    verify_payload(key, head, header, payload, mac=mac)
    codec_for_id(header.codec_id).decode_into(memoryview(payload), out, header.itemsize)
