"""The native AES-GMAC pass (``kvtier.records.mac.gmac_copy``, ``kvtier/records/_gmac.c``)
against the general path (``cryptography`` alone): the same tags at every length and split of
the data, the copy identical to its source, the same refusals by name; and through the
``lmdb`` tier, keyed records read with the pass and without it give the same hits, bytes,
misses and counters, for good records, a flipped payload bit, a flipped tag bit and a wrong
secret."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from lmdb_lookups import damaged_store, layouts, read_as_damaged

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records import mac as mac_module
from kvtier.records.checks import SIDE_MIN_BYTES
from kvtier.records.codec import NoneCodec
from kvtier.records.format import RecordAuthError, RecordMac, decode_record, encode_record, parse_header, verify_payload
from kvtier.records.record import HEAD_MAX
from kvtier.testing import make_key, random_block

NATIVE = mac_module.gmac_copy
needs_native = pytest.mark.skipif(NATIVE is None, reason="the native AES-GMAC pass is not built, or this CPU has no path for it")
SECRET = "a-test-secret-of-32-bytes-012345"
PATHS = ["general", *(["native"] if NATIVE is not None else [])]


def _reference(key: bytes, prefix: bytes, data: bytes) -> bytes:
    enc = Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()
    enc.authenticate_additional_data(prefix)
    enc.authenticate_additional_data(data)
    enc.finalize()
    return enc.tag


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """AES-GMAC records tagged and checked on one path for the test; the list counts the
    payload bytes the native pass took (it stays empty on the general path)."""
    seen: list[int] = []
    if request.param == "general":
        monkeypatch.setattr(mac_module, "gmac_copy", None)
        return seen
    assert NATIVE is not None

    def counting(key: Any, prefix: Any, src: Any, dst: Any = None) -> bytes:
        seen.append(memoryview(src).nbytes)
        return NATIVE(key, prefix, src, dst)

    monkeypatch.setattr(mac_module, "gmac_copy", counting)
    return seen


# -- the pass itself ------------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("prefix_len", [0, 1, 8, 15, 16, 56, 57, 64])
def test_the_pass_gives_the_tag_cryptography_gives_and_copies_its_source(prefix_len: int) -> None:
    assert NATIVE is not None
    rng = torch.Generator().manual_seed(prefix_len)
    # Around each step of the pass (16 blocks, 512 bytes, after a 64-byte carry) and its tails.
    for n in (0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 511, 512, 513, 575, 576, 577, 1087, 1088, 1089, 4096, 65536 + 13, 1 << 20):
        key = os.urandom(32)
        prefix = os.urandom(prefix_len)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).numpy().tobytes()
        expected = _reference(key, prefix, src)
        dst = bytearray(n)
        assert NATIVE(key, prefix, src, dst) == expected, n
        assert bytes(dst) == src, n
        assert NATIVE(key, prefix, src) == expected, n  # hashed in place
        assert NATIVE(key, prefix, src, None) == expected, n


@needs_native
def test_the_pass_hashes_what_it_stores_from_an_unaligned_source_into_an_unaligned_row() -> None:
    assert NATIVE is not None
    key = os.urandom(32)
    prefix = os.urandom(56)
    base = bytearray(os.urandom((1 << 16) + 64))
    for at in (0, 1, 8, 16, 33):
        src = memoryview(base)[at : at + (1 << 16)]
        row = bytearray((1 << 16) + 64)
        dst = memoryview(row)[at + 3 : at + 3 + (1 << 16)]
        assert NATIVE(key, prefix, src, dst) == _reference(key, prefix, bytes(src))
        assert bytes(dst) == bytes(src)


@needs_native
def test_the_pass_refuses_bad_arguments_by_name() -> None:
    assert NATIVE is not None
    key = bytes(32)
    with pytest.raises(ValueError, match="key: expected a 32-byte"):
        NATIVE(bytes(16), b"", b"abc")
    with pytest.raises(ValueError, match="dst: holds 2 bytes, src 3"):
        NATIVE(key, b"", b"abc", bytearray(2))
    with pytest.raises(TypeError, match="dst: expected a contiguous writable"):
        NATIVE(key, b"", b"abc", b"xyz")
    with pytest.raises(TypeError, match="src: expected"):
        NATIVE(key, b"", 3)
    shared = bytearray(64)
    with pytest.raises(ValueError, match="dst: overlaps src"):
        NATIVE(key, b"", memoryview(shared)[:32], memoryview(shared)[16:48])
    with pytest.raises(TypeError, match="expected 3 or 4 arguments"):
        NATIVE(key, b"")


# -- records: native and general agree -------------------------------------------------------------


def _record(mac: RecordMac, n: int, seed: int) -> tuple[bytes, bytes, bytes]:
    key = make_key(seed)
    head, payload = encode_record(key, memoryview(random_block(n, seed).numpy()), NoneCodec(), 1, mac)
    return key, head, bytes(payload)


@pytest.mark.parametrize("n", [4096, 65536 + 64, 1 << 20])
def test_a_record_tagged_on_either_path_is_checked_alike_on_both(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    mac = RecordMac(SECRET)
    other = RecordMac("another-secret-of-32-bytes-98765")
    records = {}
    for way in PATHS:
        monkeypatch.setattr(mac_module, "gmac_copy", NATIVE if way == "native" else None)
        records[way] = _record(mac, n, 7)
    for way, (key, head, payload) in records.items():
        for check in PATHS:
            monkeypatch.setattr(mac_module, "gmac_copy", NATIVE if check == "native" else None)
            out = bytearray(n)
            decode_record(key, head + payload, memoryview(out), mac=mac)
            assert bytes(out) == payload, (way, check)
            header = parse_header(head, raw_length=n, available=len(head) + n, mac=mac)
            verify_payload(key, head, header, payload, mac=mac)
            bad_payload = bytearray(payload)
            bad_payload[n // 2] ^= 0x04
            bad_tag = bytearray(head)
            bad_tag[HEAD_MAX - 3] ^= 0x80  # in the GHASH part of the tag
            bad_salt = bytearray(head)
            bad_salt[HEAD_MAX - 20] ^= 0x01  # in the salt: another record key
            for record in (bytes(head) + bytes(bad_payload), bytes(bad_tag) + payload, bytes(bad_salt) + payload):
                with pytest.raises(RecordAuthError):
                    decode_record(key, record, memoryview(bytearray(n)), mac=mac)
            with pytest.raises(RecordAuthError):
                decode_record(key, head + payload, memoryview(bytearray(n)), mac=other)
            with pytest.raises(RecordAuthError):
                decode_record(make_key(8), head + payload, memoryview(bytearray(n)), mac=mac)  # another key


@needs_native
def test_the_native_path_makes_the_tag_cryptography_makes() -> None:
    mac = RecordMac(SECRET)
    head = bytes(range(24))
    key = make_key(1)
    payload = os.urandom(70000)
    tag = mac.tag(head, key, payload)  # native, with a fresh salt
    h = mac.start(head, key, tag=tag)  # cryptography's GMAC under the same salt
    h.update(payload)
    assert h.digest() == tag


# -- through the lmdb tier ------------------------------------------------------------------------

FMT = BlockFormat(block_bytes=256 << 10, dtype="bfloat16", namespace={"model_id": "m"})


def _open(path: Path, secret: str = SECRET) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=16 << 20, path=str(path), mac_key=secret)
    asyncio.run(backend.open(FMT))
    return backend


@pytest.mark.parametrize("layout", ["joined", "split"])
@pytest.mark.parametrize("head_at", [12, 40, 60])  # the raw length, the salt, the GHASH part of the tag
def test_a_keyed_lmdb_job_reads_as_damaged_on_either_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: list[int], layout: str, head_at: int
) -> None:
    layouts(monkeypatch, layout)
    keys, data = damaged_store(tmp_path, FMT, head_at=head_at, mac_key=SECRET)
    assert len(keys) * FMT.block_bytes >= SIDE_MIN_BYTES  # a job the pass reads in one pass
    backend = _open(tmp_path)
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        stats = backend.stats()
    finally:
        asyncio.run(backend.aclose())
    read_as_damaged(found, out, data, stats)
    if mac_module.gmac_copy is not None:  # the native path: it read the raw records (0, 2, 4, 5, 7 at least)
        assert sum(n == FMT.block_bytes for n in path) >= 5


@pytest.mark.parametrize("jobs", [[8], [1] * 8, [3, 5]])
def test_keyed_lmdb_reads_find_the_same_on_either_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: list[int]) -> None:
    """Good records in jobs of one, several and more than SIDE_MIN_BYTES, then the same store
    read with a wrong secret: the same hits, bytes, misses and counters either way."""
    keys = [make_key(i) for i in range(8)]
    data = [random_block(FMT.block_bytes, 900 + i) for i in range(8)]
    seen: dict[str, Any] = {}
    for way in PATHS:
        monkeypatch.setattr(mac_module, "gmac_copy", NATIVE if way == "native" else None)
        store = tmp_path / way  # a wrong secret's read drops the records it refused
        writer = _open(store)
        writer.write_blocks(keys, data)
        asyncio.run(writer.aclose())
        results = []
        for secret in (SECRET, "another-secret-of-32-bytes-98765"):
            backend = _open(store, secret)
            try:
                out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
                found: list[bool] = []
                at = 0
                for size in jobs:
                    found += backend.read_blocks(keys[at : at + size], out[at : at + size])
                    at += size
                stats = backend.stats()
            finally:
                asyncio.run(backend.aclose())
            results.append((found, [o.clone() for o in out], stats["corrupt_records"], stats["blocks_read"]))
        seen[way] = results
    good, wrong = seen["general"]
    assert good[0] == [True] * 8 and all(torch.equal(o, d) for o, d in zip(good[1], data))
    assert wrong[0] == [False] * 8
    for way in PATHS:
        for mine, theirs in zip(seen[way], seen["general"]):
            assert mine[0] == theirs[0] and mine[2:] == theirs[2:], way
            assert all(torch.equal(a, b) for a, b, hit in zip(mine[1], theirs[1], mine[0]) if hit)


def test_a_large_keyed_job_is_read_in_one_pass_when_the_mac_is_in_it(tmp_path: Path, path: list[int]) -> None:
    keys = [make_key(i) for i in range(8)]
    data = [random_block(FMT.block_bytes, 300 + i) for i in range(8)]
    backend = _open(tmp_path)
    try:
        backend.write_blocks(keys, data)
        path.clear()  # the saves' tags
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 8
    finally:
        asyncio.run(backend.aclose())
    assert all(torch.equal(o, d) for o, d in zip(out, data))
    # every record copied and checked by the pass (none on the general path)
    assert path == ([] if mac_module.gmac_copy is None else [FMT.block_bytes] * 8)
