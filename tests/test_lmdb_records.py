"""How a save builds a job's plain records (``backends/lmdb_records.py``): a record whose build
fails is left to the write transaction (``UNSUMMED``, its view kept), and ``all_built`` tells
whether any was, the one question both lmdb save paths ask before letting the rows' hold go."""

from __future__ import annotations

from typing import Any

from kvtier.backends import lmdb_plain, lmdb_records
from kvtier.backends.lmdb_records import UNSUMMED, all_built, build_joined


def _joined(head: bytes, key: bytes, view: Any) -> bytes:
    if view is None:
        raise ValueError("no row")
    return head + key + bytes(view)


def test_a_failed_build_is_left_to_the_transaction() -> None:
    good = build_joined(_joined, b"h", b"k", b"ab")
    assert good == (b"k", b"", b"hkab")
    bad = build_joined(_joined, b"h", b"l", None)
    assert bad == (b"l", UNSUMMED, None) and bad[1] is UNSUMMED


def test_all_built_asks_for_unsummed_by_identity() -> None:
    built = [build_joined(_joined, b"h", bytes([i]), b"x") for i in range(3)]
    assert all_built(built) and all_built([])
    assert not all_built([*built, build_joined(_joined, b"h", b"z", None)])
    assert not all_built([(b"k", UNSUMMED, b"view")])  # a split record's head, made in the transaction
    assert all_built([(b"k", bytes(len(UNSUMMED)), b"view")])  # equal bytes, another object: a real head


def test_the_rows_module_keeps_the_records_names() -> None:
    for name in ("UNSUMMED", "PlainReads", "FileGuard", "build_joined", "all_built"):
        assert getattr(lmdb_plain, name) is getattr(lmdb_records, name)
