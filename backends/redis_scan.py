"""The redis tier's index sweep on the wire: ``SCAN`` steps pipelined, each reply's keys parsed
as one array.

A store's open lists every record of its namespace (10^6 and more). Through redis-py that is a
``bytes`` object per remote key built by the reply parser, a generator step per key, then a
second ``bytes`` per key for the block key with the prefix cut off. Here:

* the ``MATCH`` pattern is the namespace's prefix followed by one ``?`` per block-key byte, so
  the server returns only keys of exactly that length (records; never the meta record, the feed
  or the tags, whose names are shorter). Every element of a reply is then the same
  ``$<length>\\r\\n<prefix><key>\\r\\n``: the reply is a table of fixed-width rows, which numpy
  checks in one pass (every row's length line, prefix and line end) and from which the block
  keys are made in one call (``tolist`` of the key column, read as opaque fixed-width items). A
  row that does not match is a protocol error: the sweep fails and changes nothing, as with a
  dead server;
* the next ``SCAN`` is sent as soon as a reply's cursor is read, before its keys are: the
  server walks its table for the next step while this one's keys are parsed.

SCAN may return a key twice (when the server's table grows during the sweep); callers collect
the keys into a set.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from kvtier.backends.redis_wire import Wire

__all__ = ["record_pattern", "scan_block_keys", "scan_command"]


def record_pattern(prefix: bytes, key_bytes: int) -> bytes:
    """The ``MATCH`` pattern of the records under ``prefix``: one ``?`` per key byte. The prefix
    must hold no glob character (kvtier's prefixes are ``[A-Za-z0-9_.-:]``)."""
    if any(c in prefix for c in b"*?[]\\"):
        raise ValueError(f"prefix {prefix!r}: a glob character in a SCAN prefix")
    return prefix + b"?" * key_bytes


def scan_command(cursor: bytes, pattern: bytes, count: int) -> bytes:
    """``SCAN <cursor> MATCH <pattern> COUNT <count>`` in RESP."""
    n = b"%d" % count
    return b"*6\r\n$4\r\nSCAN\r\n$%d\r\n%b\r\n$5\r\nMATCH\r\n$%d\r\n%b\r\n$5\r\nCOUNT\r\n$%d\r\n%b\r\n" % (
        len(cursor), cursor, len(pattern), pattern, len(n), n,
    )


def scan_block_keys(wire: Wire, prefix: bytes, key_bytes: int, count: int) -> Iterator[list[bytes]]:
    """Every block key stored under ``prefix`` on the server behind ``wire``, a ``SCAN`` step's
    worth at a time (the prefix cut off; a key may come twice). Every reply has been read when
    the iteration ends; one left half-read (an exception, or a caller that stopped early)
    leaves the wire with replies unread (see :attr:`Wire.drained`)."""
    pattern = record_pattern(prefix, key_bytes)
    width = len(prefix) + key_bytes
    lead = b"$%d\r\n" % width + prefix  # what every row starts with
    stride = len(lead) + key_bytes + 2
    want = np.frombuffer(lead, dtype=np.uint8)
    wire.send([scan_command(b"0", pattern, count)])
    while True:
        if wire.array_length() != 2:
            raise ConnectionError("SCAN: expected a reply of two elements")
        cursor = wire.reply()
        if not isinstance(cursor, bytes):
            raise ConnectionError(f"SCAN: expected a cursor, got {cursor!r}")
        more = cursor != b"0"
        if more:  # the server's next step overlaps the parsing of this one
            wire.send([scan_command(cursor, pattern, count)])
        n = wire.array_length()
        if n > 0:
            raw = bytearray(n * stride)
            wire.read_into(memoryview(raw))
            rows = np.frombuffer(raw, dtype=np.uint8).reshape(n, stride)
            if not ((rows[:, : len(lead)] == want).all() and (rows[:, -2] == 13).all() and (rows[:, -1] == 10).all()):
                raise ConnectionError(f"SCAN: a reply element is not a key of {width} bytes under the prefix")
            # The keys as one strided column of opaque ``key_bytes``-wide items: ``tolist`` makes
            # every ``bytes`` in C (zero bytes kept, unlike a string dtype), from the reply itself.
            keys = np.ndarray((n,), dtype=np.dtype((np.void, key_bytes)), buffer=raw, offset=len(lead), strides=(stride,))
            yield keys.tolist()
        if not more:
            return
