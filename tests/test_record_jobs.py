"""A job's records checked on a side thread: what is checked, what a bad record becomes, and
the fallbacks (small jobs, no side thread)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvtier import record_jobs
from kvtier.errors import CorruptBlockError
from kvtier.records import mac as mac_module
from kvtier.records import xxcopy
from kvtier.records.checks import SIDE_MIN_BYTES, EncodedStream, HeadChecksum, RawPayload, copy_and_check
from kvtier.records.codec import NoneCodec, resolve_codec
from kvtier.records.format import RecordAuthError, RecordMac, encode_record, parse_header, record_checksum
from kvtier.records.record import CHECKED
from kvtier.testing import make_key, random_block

BLOCK = 512 << 10
SECRET = "record-jobs-test-secret-0123456789"


def _job(n: int, *, size: int = BLOCK, mac: RecordMac | None = None) -> tuple[list[RawPayload], list[torch.Tensor]]:
    blocks = [random_block(size, 70 + i) for i in range(n)]
    items = []
    for i, block in enumerate(blocks):
        key = make_key(i)
        head, payload = encode_record(key, block.numpy().data, NoneCodec(), 1, mac)
        header = parse_header(head, raw_length=size, available=len(head) + len(payload), mac=mac)
        out = torch.zeros(size, dtype=torch.uint8)
        items.append(RawPayload(key, head, header, bytes(payload), out.numpy().data))
    return items, blocks


def _damage(items: list[RawPayload], i: int) -> None:
    payload = bytearray(items[i].payload)
    payload[len(payload) // 3] ^= 0x20
    items[i] = items[i]._replace(payload=bytes(payload))


@pytest.fixture
def side_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = record_jobs._submit

    def counting(fn: Any, *args: Any) -> Any:
        calls.append(fn.__name__)
        return real(fn, *args)

    monkeypatch.setattr(record_jobs, "_submit", counting)
    return calls


NATIVE = [False, *([True] if xxcopy.fused() else [])]


@pytest.fixture(params=NATIVE, ids=lambda native: "native" if native else "python")
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """``xxcopy`` on its native path (where built) or its Python one: unkeyed raw payloads are
    checked on the side thread on the Python path, in the copy's one pass on the native one;
    AES-GMAC ones likewise with the native ``mac.gmac_copy`` (where built) or without it."""
    if not request.param:
        monkeypatch.setattr(xxcopy, "xxh3_copy", xxcopy.xxh3_copy_python)
        monkeypatch.setattr(mac_module, "gmac_copy", None)
    return bool(request.param)


@pytest.mark.parametrize("keyed", [False, True])
def test_a_large_job_checks_every_row_on_the_side_and_a_damaged_one_is_an_error(side_calls: list[str], keyed: bool, native: bool) -> None:
    mac = RecordMac(SECRET) if keyed else None
    items, blocks = _job(6, mac=mac)
    assert 6 * BLOCK >= SIDE_MIN_BYTES
    _damage(items, 4)
    errors = copy_and_check(items, mac)
    print(f"{'keyed' if keyed else 'plain'}: errors {[type(e).__name__ if e else None for e in errors]}, side hops {side_calls}")
    one_pass = native and (not keyed or mac_module.gmac_copy is not None)
    assert side_calls == ([] if one_pass else ["_side"])
    assert [e is None for e in errors] == [True, True, True, True, False, True]
    assert isinstance(errors[4], RecordAuthError if keyed else CorruptBlockError)
    for i in (0, 1, 2, 3, 5):
        assert bytes(items[i].out) == blocks[i].numpy().tobytes()


def test_a_keyed_job_checks_the_rows_the_caller_gets_not_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record rewritten between the check of its source and its copy must not pass: with a
    MAC, what is checked is the row after the copy. Simulated by a copy that lands other bytes.
    (Where the native AES-GMAC pass is built, it hashes the very registers it stores instead:
    tests/test_gmac_native.py.)"""
    monkeypatch.setattr(mac_module, "gmac_copy", None)
    mac = RecordMac(SECRET)
    items, _ = _job(4, mac=mac)
    real_copyto = np.copyto
    copies = {"n": 0}

    def tampered_copy(dst: np.ndarray, src: np.ndarray) -> None:
        real_copyto(dst, src)
        copies["n"] += 1
        if copies["n"] == 2:
            dst[100] ^= 0x01  # what the map held when it was copied, not when it was checked

    monkeypatch.setattr(record_jobs.np, "copyto", tampered_copy)
    errors = copy_and_check(items, mac)
    print(f"tampered between check and copy: errors {[type(e).__name__ if e else None for e in errors]}")
    assert copies["n"] == 4
    assert [e is None for e in errors] == [True, False, True, True]


def test_a_small_job_is_checked_on_the_calling_thread(side_calls: list[str]) -> None:
    items, blocks = _job(2, size=16 << 10)
    _damage(items, 0)
    errors = copy_and_check(items, None)
    assert side_calls == []
    assert isinstance(errors[0], CorruptBlockError) and errors[1] is None
    assert bytes(items[1].out) == blocks[1].numpy().tobytes()


def test_with_no_side_thread_the_job_is_checked_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_jobs, "_submit", lambda fn, *args: None)  # the pool is shut down
    items, blocks = _job(4)
    _damage(items, 1)
    errors = copy_and_check(items, None)
    assert [e is None for e in errors] == [True, False, True, True]
    assert bytes(items[3].out) == blocks[3].numpy().tobytes()


def test_compressed_payloads_in_a_large_job_are_checked_and_decoded_here(side_calls: list[str], native: bool) -> None:
    codec = resolve_codec({"name": "zstd", "level": 1})
    raw, raw_blocks = _job(4)
    block = torch.zeros(BLOCK, dtype=torch.uint8)  # compresses well
    key = make_key(99)
    head, payload = encode_record(key, block.numpy().data, codec, 1)
    header = parse_header(head, raw_length=BLOCK, available=len(head) + len(payload))
    assert header.codec_id != NoneCodec.codec_id
    out = torch.full((BLOCK,), 5, dtype=torch.uint8)
    items = [*raw, RawPayload(key, head, header, bytes(payload), out.numpy().data)]
    errors = copy_and_check(items, None)
    assert errors == [None] * 5 and side_calls == ([] if native else ["_side"])
    assert bool((out == 0).all())
    assert all(bytes(raw[i].out) == raw_blocks[i].numpy().tobytes() for i in range(4))


def test_the_encoded_stream_keeps_order_runs_on_the_side_and_raises_at_the_failing_item(side_calls: list[str]) -> None:
    threads: set[str] = set()

    def encode(x: int) -> int:
        threads.add(threading.current_thread().name)
        if x == 3:
            raise ValueError("item 3 cannot be encoded")
        return x * 10

    got: list[int] = []
    with pytest.raises(ValueError, match="item 3"), EncodedStream(encode, list(range(6)), sizes=[SIDE_MIN_BYTES]) as stream:
        for value in stream:
            got.append(value)
    assert got == [0, 10, 20]
    assert side_calls == ["_run"] and all(name.startswith("kvtier-check") for name in threads)


def test_a_small_encoded_stream_runs_lazily_on_the_calling_thread(side_calls: list[str]) -> None:
    seen: list[int] = []
    stream = EncodedStream(lambda x: seen.append(x) or x, [1, 2, 3], sizes=[10])
    assert seen == []
    assert list(stream) == [1, 2, 3] and side_calls == []


def test_a_closed_stream_stops_its_side_thread() -> None:
    started = threading.Event()
    release = threading.Event()
    done: list[int] = []

    def encode(x: int) -> int:
        started.set()
        release.wait(5)
        done.append(x)
        return x

    stream = EncodedStream(encode, list(range(50)), sizes=[SIDE_MIN_BYTES])
    assert started.wait(5)
    stream.close()
    release.set()
    assert stream.future is not None
    stream.future.result(5)  # the side thread returned
    print(f"closed after the first item: {len(done)} of 50 encoded")
    assert done == [0]


def test_a_forked_child_gets_side_threads_of_its_own() -> None:
    """The parent's pool is inherited without its threads; a child that used it would wait for
    ever on a check no thread runs."""
    import multiprocessing

    items, _ = _job(4)
    assert copy_and_check(items, None) == [None] * 4  # the parent's pool exists now
    job, _ = _job(4)  # built here: torch's own threads are not fork-safe, numpy and xxhash are
    _damage(job, 2)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()

    def child() -> None:
        queue.put([e is None for e in copy_and_check(job, None)])

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the forked child's job never finished (its side thread never ran)")
    assert proc.exitcode == 0
    assert queue.get() == [True, True, False, True]


def test_an_unexpected_error_while_filling_stops_the_side_thread_before_it_propagates() -> None:
    """The caller ends its read transaction (or closes the map) once the call returns: the side
    thread must not read a payload after that."""
    items, _ = _job(6)
    checked_after: list[int] = []
    returned = threading.Event()
    real_verify = record_jobs.verify_payload

    def slow_verify(key: bytes, *args: Any, **kwargs: Any) -> None:
        import time

        time.sleep(0.02)
        if returned.is_set():
            checked_after.append(1)
        real_verify(key, *args, **kwargs)

    def fill(item: RawPayload) -> None:
        if item is items[2]:
            raise ValueError("unexpected")
        np.copyto(np.frombuffer(item.out, dtype=np.uint8), np.frombuffer(item.payload, dtype=np.uint8))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(record_jobs, "verify_payload", slow_verify)
        with pytest.raises(ValueError, match="unexpected"):
            record_jobs.fill_and_check(items, fill, None)
        returned.set()
        import time

        time.sleep(0.2)
    assert checked_after == []


@pytest.mark.parametrize("size", [2, 4096, 65 << 10, 2 << 20])
def test_a_head_checksum_is_the_record_checksum(size: int) -> None:
    """The checksum that goes on from a head hashed once equals the one hashed from scratch
    (what ``encode_record`` stores), for every record of that head; a flipped bit changes it."""
    block = random_block(size, 7)
    head, _ = encode_record(make_key(0), block.numpy().data, NoneCodec(), 1)
    sums = HeadChecksum(head[:CHECKED])
    for i in range(3):
        key = make_key(i)
        payload = random_block(size, 40 + i).numpy().data
        assert sums(key, payload) == record_checksum(head[:CHECKED], key, payload)
        damaged = bytearray(payload)
        damaged[size // 2] ^= 0x04
        assert sums(key, damaged) != sums(key, payload)
    with pytest.raises(ValueError, match="24 checked header bytes, got 32"):
        HeadChecksum(head)
