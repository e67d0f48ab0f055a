"""A remote tier's ``delete_blocks`` refuses malformed keys by name, before anything is sent: on
a ``redis`` tier a deletion is also appended to the namespace's key log, which every engine's
open reads, and an entry of another length would put the log out of step (its next open then
distrusts it and lists the server with ``SCAN``)."""

from __future__ import annotations

import pytest
from redis_logs import close_tier, general_keys, open_tier, reopen_tier, write_keys
from redis_servers import RedisServer
from test_redis_keylog import _log

from kvtier.errors import InvalidKeyError
from kvtier.testing import make_key


@pytest.mark.parametrize("case", ["short", "long", "hex", "str"])
def test_a_delete_of_a_malformed_key_is_refused_by_name_and_changes_nothing(redis_server: RedisServer, case: str) -> None:
    namespace = b"bad-delete-" + case.encode()
    writer = open_tier(namespace, redis_server.url)
    try:
        keys = [make_key(i) for i in range(20)]
        write_keys(writer, keys)
        log_before = _log(writer)
        bad = {"short": keys[1][:31], "long": keys[1] + b"x", "hex": keys[1].hex().encode(), "str": keys[1].hex()}[case]
        with pytest.raises(InvalidKeyError, match=r"keys\[1\]"):
            writer.delete_blocks([keys[0], bad])
        assert _log(writer) == log_before  # nothing appended to the log
        assert general_keys(writer) == set(keys)  # nothing deleted, the well-formed key either
        reader, opened, counters = reopen_tier(namespace, redis_server.url)
        try:
            assert sorted(opened) == sorted(keys)
            assert counters["opens"] == 1 and counters["fallbacks"] == 0  # the log is still read
        finally:
            close_tier(reader)
    finally:
        close_tier(writer)
