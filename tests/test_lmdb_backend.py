"""The lmdb tier: conformance suite plus persistence, map-full, corruption and thread tests."""

from __future__ import annotations

import asyncio
import threading
import types
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import torch
from kvtier.backends.lmdb_layout import INDEX
from lmdb_lookups import hook_lookups, layouts, slow_lookups_read_the_disk

from kvtier import record_jobs, registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ConfigError
from kvtier.records import xxcopy
from kvtier.records.codec import NoneCodec
from kvtier.records.format import HEADER, HEADER_SIZE, RECORD_VERSION, encode_record, parse_header
from kvtier.testing import BackendTests, cached_pages, evict_from_page_cache, make_key, random_block


def lmdb_backend(path: Path, capacity: int, **options: object) -> Backend:
    return registry.backends.get("lmdb")(capacity=capacity, path=str(path / "env"), **options)


class TestLmdbBackend(BackendTests):
    def make_backend(self, path: Path, capacity: int) -> Backend:
        return lmdb_backend(path, capacity)


class TestLmdbBackendZstdShuffleFast(BackendTests):
    def make_backend(self, path: Path, capacity: int) -> Backend:
        return lmdb_backend(path, capacity, codec={"name": "zstd-shuffle", "level": 1}, sync_mode="fast")


FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


def _open(backend: Backend, fmt: BlockFormat = FMT) -> Backend:
    asyncio.run(backend.open(fmt))
    return backend


def _blocks(n: int, seed: int = 0, size: int = FMT.block_bytes) -> list[torch.Tensor]:
    return [random_block(size, seed * 1000 + i) for i in range(n)]


def _env(path: Path) -> tuple[lmdb.Environment, object]:
    env = lmdb.open(str(path / "env"), max_dbs=3)
    return env, env.open_db(b"blocks")


def test_missing_path_is_a_config_error_naming_path() -> None:
    with pytest.raises(ConfigError, match="path"):
        registry.backends.get("lmdb")(capacity="1MiB")


def test_bad_options_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sync_mode"):
        lmdb_backend(tmp_path, 1 << 20, sync_mode="sometimes")
    with pytest.raises(ConfigError, match="codec"):
        lmdb_backend(tmp_path, 1 << 20, codec={"level": 3})
    with pytest.raises(ConfigError, match="level"):
        lmdb_backend(tmp_path, 1 << 20, codec={"name": "zstd", "level": 99})


def test_map_full_fails_only_the_keys_that_do_not_fit(tmp_path: Path) -> None:
    backend = _open(lmdb_backend(tmp_path, 8 * FMT.block_bytes))
    try:
        keys = [make_key(i) for i in range(20)]
        data = _blocks(20)
        sizes = backend.write_blocks(keys, data)
        stored = [i for i, s in enumerate(sizes) if s is not None]
        failed = [i for i, s in enumerate(sizes) if s is None]
        assert stored and failed
        assert backend.stats()["write_failures"] == len(failed)
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in stored]
        assert backend.read_blocks([keys[i] for i in stored], out) == [True] * len(stored)
        assert all(torch.equal(o, data[i]) for o, i in zip(out, stored))
        # Deleting makes room again: the manager's evict-and-retry works.
        backend.delete_blocks([keys[stored[0]]])
        assert backend.write_blocks([keys[failed[0]]], [data[failed[0]]])[0] is not None
    finally:
        asyncio.run(backend.aclose())


def test_map_size_is_the_capacity_and_sizes_are_page_rounded(tmp_path: Path) -> None:
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    try:
        assert backend.stats()["map_size"] == 1 << 20
        size = backend.write_blocks([make_key(1)], _blocks(1))[0]
        assert size == backend.reserve_bytes()
        assert size is not None and size % 4096 == 0 and size >= FMT.block_bytes + HEADER_SIZE
    finally:
        asyncio.run(backend.aclose())


def test_flipped_byte_is_detected_deleted_counted_and_a_miss(tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(3)]
    data = _blocks(3, seed=4)
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    backend.write_blocks(keys, data)
    asyncio.run(backend.aclose())
    env, db = _env(tmp_path)
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(keys[1]))
        value[HEADER_SIZE + 1234] ^= 0x10
        txn.put(keys[1], bytes(value))
    env.close()
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True, False, True]
        stats = backend.stats()
        assert stats["corrupt_records"] == 1 and stats["deleted"] == 1
        assert {r.key for r in backend.scan()} == {keys[0], keys[2]}
        assert backend.read_blocks([keys[1]], out[:1]) == [False]
        assert backend.stats()["corrupt_records"] == 1  # gone, so now a plain miss
    finally:
        asyncio.run(backend.aclose())


def test_record_under_another_key_fails_its_checksum(tmp_path: Path) -> None:
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    backend.write_blocks([make_key(1)], _blocks(1))
    asyncio.run(backend.aclose())
    env, db = _env(tmp_path)
    with env.begin(write=True, db=db) as txn:
        txn.put(make_key(2), bytes(txn.get(make_key(1))))
    env.close()
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8)]
        assert backend.read_blocks([make_key(2)], out) == [False]
        assert backend.stats()["corrupt_records"] == 1
    finally:
        asyncio.run(backend.aclose())


def test_unknown_record_version_is_a_miss_not_corrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layouts(monkeypatch, "split")  # (joined records: tests/test_lmdb_joined.py)
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    backend.write_blocks([make_key(1)], _blocks(1))
    asyncio.run(backend.aclose())
    env, _ = _env(tmp_path)
    index = env.open_db(b"index")
    with env.begin(write=True, db=index) as txn:
        entry = bytearray(txn.get(make_key(1)))  # the split layout: the head is in the index entry
        fields = list(HEADER.unpack_from(entry, INDEX.size))
        fields[1] = RECORD_VERSION + 1
        HEADER.pack_into(entry, INDEX.size, *fields)
        txn.put(make_key(1), bytes(entry))
    env.close()
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    try:
        out = [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8)]
        assert backend.read_blocks([make_key(1)], out) == [False]
        stats = backend.stats()
        assert stats["corrupt_records"] == 0 and stats["read_misses"] == 1
        assert bool((out[0] == 7).all())  # never parsed, never copied
    finally:
        asyncio.run(backend.aclose())


def test_corrupt_environment_is_moved_aside_with_a_warning(tmp_path: Path) -> None:
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    backend.write_blocks([make_key(1)], _blocks(1))
    asyncio.run(backend.aclose())
    data_file = tmp_path / "env" / "data.mdb"
    data_file.write_bytes(b"\xde\xad" * 8192)
    backend = lmdb_backend(tmp_path, 1 << 20)
    with pytest.warns(RuntimeWarning, match="damaged"):
        _open(backend)
    try:
        moved = list((tmp_path / "env").glob("damaged-*/data.mdb"))
        assert len(moved) == 1 and moved[0].read_bytes().startswith(b"\xde\xad")
        assert list(backend.scan()) == []
        assert backend.write_blocks([make_key(2)], _blocks(1))[0] is not None
        assert backend.read_blocks([make_key(2)], [torch.zeros(FMT.block_bytes, dtype=torch.uint8)]) == [True]
    finally:
        asyncio.run(backend.aclose())


def test_other_namespace_is_refused_at_open(tmp_path: Path) -> None:
    asyncio.run(_open(lmdb_backend(tmp_path, 1 << 20)).aclose())
    other = BlockFormat(block_bytes=FMT.block_bytes, dtype="bfloat16", namespace_digest=b"\1" * 32)
    backend = lmdb_backend(tmp_path, 1 << 20)
    with pytest.raises(ConfigError, match="namespace"):
        asyncio.run(backend.open(other))
    again = lmdb_backend(tmp_path, 1 << 20)
    with pytest.raises(ConfigError, match="block_bytes"):
        asyncio.run(again.open(BlockFormat(block_bytes=8192, dtype="bfloat16")))


def test_stamps_survive_reopen(tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(3)]
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    backend.write_blocks(keys, _blocks(3))
    backend.touch_stamps([(keys[0], 30.0), (keys[1], 10.0), (keys[2], 20.0), (make_key(99), 5.0)])
    asyncio.run(backend.aclose())
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    try:
        records = {r.key: r for r in backend.scan()}
        assert set(records) == set(keys)
        assert [records[k].stamp for k in keys] == [30.0, 10.0, 20.0]
        assert all(r.stored_bytes == backend.reserve_bytes() for r in records.values())
    finally:
        asyncio.run(backend.aclose())


def test_compressed_records_take_less_space_and_round_trip(tmp_path: Path) -> None:
    plain = _open(lmdb_backend(tmp_path / "a", 1 << 22))
    packed = _open(lmdb_backend(tmp_path / "b", 1 << 22, codec="zstd-shuffle"))
    try:
        fmt = FMT
        base = torch.linspace(0.0, 1.0, fmt.block_bytes // 2).to(torch.bfloat16).view(torch.uint8)
        keys = [make_key(1)]
        a = plain.write_blocks(keys, [base])[0]
        b = packed.write_blocks(keys, [base])[0]
        assert a is not None and b is not None and b < a
        out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8)]
        assert packed.read_blocks(keys, out) == [True] and torch.equal(out[0], base)
    finally:
        asyncio.run(plain.aclose())
        asyncio.run(packed.aclose())


def test_concurrent_reads_while_writing_and_deleting(tmp_path: Path) -> None:
    backend = _open(lmdb_backend(tmp_path, 1 << 24, sync_mode="fast"))
    data = _blocks(16, seed=8)
    keys = [make_key(i) for i in range(16)]
    backend.write_blocks(keys[:8], data[:8])
    errors: list[BaseException] = []
    wrong: list[int] = []

    def reader() -> None:
        try:
            out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
            for _ in range(40):
                found = backend.read_blocks(keys, out)
                wrong.extend(i for i, ok in enumerate(found) if ok and not torch.equal(out[i], data[i]))
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for round_ in range(10):
        backend.write_blocks(keys[8:], data[8:])
        backend.delete_blocks(keys[round_ % 8 : round_ % 8 + 4])
        backend.write_blocks(keys[:8], data[:8])
    thread.join()
    try:
        assert not errors and not wrong
        assert backend.stats()["corrupt_records"] == 0
    finally:
        asyncio.run(backend.aclose())


def test_use_after_fork_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    try:
        monkeypatch.setattr("os.getpid", lambda: -1)
        # What a fork also moves: the count of forks that the straight reads, a save and the
        # general read check (lmdb_one.forks: native, else the pid).
        monkeypatch.setattr("kvtier.backends.lmdb_one.forks", lambda: -1)
        monkeypatch.setattr("kvtier.backends.lmdb_tier.forks", lambda: -1)
        straight = backend._straight  # type: ignore[attr-defined]
        if straight is not None:  # and the native read's: the count at the open, against the native count
            parts = straight.native_parts  # (..., the fork count, what the direct lookups take)
            monkeypatch.setattr(straight, "native_parts", (*parts[:-2], parts[-2] + 1, parts[-1]))
        with pytest.raises(Exception, match="another process"):
            backend.read_blocks([make_key(1)], [torch.zeros(FMT.block_bytes, dtype=torch.uint8)])
    finally:
        monkeypatch.undo()
        asyncio.run(backend.aclose())


# -- record layout ------------------------------------------------------------------------------


def test_a_save_puts_the_block_as_it_is_and_its_head_in_the_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The split layout: no staging copy of the block to put a header before it."""
    layouts(monkeypatch, "split")  # (joined records: tests/test_lmdb_joined.py)
    data = _blocks(1, seed=8)
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    backend.write_blocks([make_key(1)], data)
    asyncio.run(backend.aclose())
    env, db = _env(tmp_path)
    index = env.open_db(b"index")
    with env.begin() as txn:
        value = txn.get(make_key(1), db=db)
        entry = txn.get(make_key(1), db=index)
    env.close()
    print(f"value {len(value)} bytes, index entry {len(entry)} bytes")
    assert value == data[0].numpy().tobytes()
    assert len(entry) == INDEX.size + HEADER_SIZE
    header = parse_header(entry[INDEX.size :], raw_length=FMT.block_bytes, available=HEADER_SIZE + len(value))
    assert header.stored_length == FMT.block_bytes


def _put_whole_record(path: Path, key: bytes, block: torch.Tensor, *, flip: bool = False) -> None:
    """Store ``block`` as earlier code did: the whole record in ``blocks``, 16 bytes of index."""
    head, payload = encode_record(key, block.numpy().data, NoneCodec(), 1)
    record = bytearray(head + bytes(payload))
    if flip:
        record[-5] ^= 0x01
    env, db = _env(path)
    index = env.open_db(b"index")
    with env.begin(write=True) as txn:
        txn.put(key, bytes(record), db=db)
        txn.put(key, INDEX.pack(1.0, len(record)), db=index)
    env.close()


def test_a_store_written_with_whole_records_is_read_and_rewritten_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layouts(monkeypatch, "split")  # (joined records: tests/test_lmdb_joined.py)
    data = _blocks(3, seed=9)
    keys = [make_key(i) for i in range(3)]
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    backend.write_blocks(keys[:1], data[:1])  # a split record next to the old ones
    asyncio.run(backend.aclose())
    _put_whole_record(tmp_path, keys[1], data[1])
    _put_whole_record(tmp_path, keys[2], data[2], flip=True)
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    try:
        assert {r.key for r in backend.scan()} == set(keys)
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        print(f"mixed layouts: found {found}, corrupt {backend.stats()['corrupt_records']}")
        assert found == [True, True, False]
        assert torch.equal(out[0], data[0]) and torch.equal(out[1], data[1])
        assert backend.stats()["corrupt_records"] == 1
        backend.write_blocks(keys[1:2], data[1:2])  # rewritten: now split
        assert backend.read_blocks(keys[1:2], out[1:2]) == [True] and torch.equal(out[1], data[1])
    finally:
        asyncio.run(backend.aclose())
    env, db = _env(tmp_path)
    with env.begin() as txn:
        assert txn.get(keys[1], db=db) == data[1].numpy().tobytes()
    env.close()


def test_access_stamps_of_both_layouts_persist_and_keep_their_records_readable(tmp_path: Path) -> None:
    data = _blocks(2, seed=12)
    keys = [make_key(i) for i in range(2)]
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    backend.write_blocks(keys[:1], data[:1])
    asyncio.run(backend.aclose())
    _put_whole_record(tmp_path, keys[1], data[1])
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    backend.touch_stamps([(keys[0], 1234.5), (keys[1], 6789.0)])
    asyncio.run(backend.aclose())
    backend = _open(lmdb_backend(tmp_path, 1 << 20))
    try:
        assert {r.key: r.stamp for r in backend.scan()} == {keys[0]: 1234.5, keys[1]: 6789.0}
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True, True]
        assert all(torch.equal(o, d) for o, d in zip(out, data))
    finally:
        asyncio.run(backend.aclose())


BIG = BlockFormat(block_bytes=512 << 10, dtype="bfloat16", namespace={"model_id": "m"})


@pytest.mark.parametrize("keyed", [False, True])
def test_a_large_job_is_checked_on_the_side_thread_and_a_bad_record_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyed: bool
) -> None:
    options = {"mac_key": "a-test-secret-of-32-bytes-012345"} if keyed else {}
    keys = [make_key(i) for i in range(4)]
    data = _blocks(4, seed=10, size=BIG.block_bytes)
    submitted: list[str] = []
    real_submit = record_jobs._submit

    def counting(fn: object, *args: object) -> object:
        submitted.append(getattr(fn, "__name__", repr(fn)))
        return real_submit(fn, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(record_jobs, "_submit", counting)
    # The general read (what a cold job takes): a warm plain one is read in one pass on the
    # calling thread (tests/test_lmdb_plain_reads.py); a warm keyed one this large is not where
    # its MAC is not taken in the copy's pass (tests/test_gmac_native.py for that pass).
    from kvtier.backends import lmdb_layout

    from kvtier.records import mac as mac_module

    monkeypatch.setattr(mac_module, "gmac_copy", None)
    if not keyed:
        monkeypatch.setattr(lmdb_layout, "ONE_PASS_READS", False)
        # The Python path of the copy's checksum: the native one checks in the copy's own pass,
        # on the calling thread (tests/test_xxcopy_tiers.py).
        monkeypatch.setattr(xxcopy, "xxh3_copy", xxcopy.xxh3_copy_python)
    backend = _open(lmdb_backend(tmp_path, 8 << 20, **options), BIG)
    assert backend.write_blocks(keys, data) == [backend.reserve_bytes()] * 4
    asyncio.run(backend.aclose())
    env, db = _env(tmp_path)
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(keys[2]))
        value[12345] ^= 0x04
        txn.put(keys[2], bytes(value))
    env.close()
    backend = _open(lmdb_backend(tmp_path, 8 << 20, **options), BIG)
    try:
        out = [torch.zeros(BIG.block_bytes, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        stats = backend.stats()
        print(f"side-thread check ({'keyed' if keyed else 'plain'}): found {found}, submitted {submitted}, corrupt {stats['corrupt_records']}")
        assert found == [True, True, False, True]
        assert all(torch.equal(out[i], data[i]) for i in (0, 1, 3))
        assert stats["corrupt_records"] == 1 and stats["auth_failures"] == (1 if keyed else 0)
        assert submitted.count("_side") == 1  # one hop for the job's checks
        # Keyed, one more for its encoding (the MACs); plain records are encoded in one loop on
        # the calling thread (lmdb_plain.PlainReads.records).
        assert submitted.count("_run") == (1 if keyed else 0)
    finally:
        asyncio.run(backend.aclose())


def test_opening_a_store_reads_a_page_per_value_not_the_whole_file(tmp_path: Path) -> None:
    """The walk at open touches each value's first page; with readahead on (as reads want it)
    that read the whole file (a store of 2 MiB blocks, the whole store, at every open)."""
    keys = [make_key(i) for i in range(16)]
    backend = _open(lmdb_backend(tmp_path, 32 << 20), BIG)
    backend.write_blocks(keys, _blocks(16, seed=11, size=BIG.block_bytes))
    asyncio.run(backend.aclose())
    data = tmp_path / "env" / "data.mdb"
    evict_from_page_cache(data)
    evicted, pages = cached_pages(data)
    if evicted > pages // 10:
        pytest.skip(f"CANNOT EVICT THE FILE HERE: {evicted} of {pages} pages stay cached after POSIX_FADV_DONTNEED")
    backend = _open(lmdb_backend(tmp_path, 32 << 20), BIG)
    try:
        resident, _ = cached_pages(data)
        print(f"open of {len(keys)} x 512 KiB records: {resident} of {pages} pages read ({evicted} before)")
        assert resident <= pages // 10
        out = [torch.zeros(BIG.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * len(keys)  # readahead is back for reads
        assert cached_pages(data)[0] >= len(keys) * BIG.block_bytes // 4096
    finally:
        asyncio.run(backend.aclose())


SECRET = "a-test-secret-of-32-bytes-012345"


def test_a_store_keyed_before_blake3_still_reads_and_a_mac_mismatch_is_refused_at_open(tmp_path: Path) -> None:
    """A keyed store written before BLAKE3 was the default (HMAC-SHA256 records, a meta record
    without a MAC field) opens with the default MAC and serves its records; a store whose meta
    record names one MAC is refused, at open, by a tier configured for the other."""
    from kvtier.records.format import decode_meta, encode_meta

    keys = [make_key(i) for i in range(3)]
    data = _blocks(3, seed=21)
    backend = _open(lmdb_backend(tmp_path, 4 << 20, mac_key=SECRET, mac_algorithm="hmac-sha256"))
    backend.write_blocks(keys[:2], data[:2])
    asyncio.run(backend.aclose())
    env = lmdb.open(str(tmp_path / "env"), max_dbs=3)
    meta_db = env.open_db(b"meta")
    with env.begin(write=True, db=meta_db) as txn:
        ((meta_key, raw),) = list(txn.cursor())
        assert decode_meta(raw).mac == "hmac-sha256"
        txn.put(meta_key, encode_meta(FMT))  # the meta record as older builds wrote it
    env.close()

    backend = _open(lmdb_backend(tmp_path, 4 << 20, mac_key=SECRET))  # the default: aes-gmac
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys[:2]]
        assert backend.read_blocks(keys[:2], out) == [True, True]
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        backend.write_blocks(keys[2:], data[2:])
        back = torch.zeros(FMT.block_bytes, dtype=torch.uint8)
        assert backend.read_blocks(keys[2:], [back]) == [True] and torch.equal(back, data[2])
    finally:
        asyncio.run(backend.aclose())
    # The new record is keyed AES-GMAC: a tier held to HMAC-SHA256 serves the old two only.
    backend = _open(lmdb_backend(tmp_path, 4 << 20, mac_key=SECRET, mac_algorithm="hmac-sha256"))
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True, True, False]
    finally:
        asyncio.run(backend.aclose())

    fresh = tmp_path / "fresh"
    asyncio.run(_open(lmdb_backend(fresh, 4 << 20, mac_key=SECRET)).aclose())  # a new store records aes-gmac
    for other in ("hmac-sha256", "blake3"):
        with pytest.raises(ConfigError, match=rf"keyed with aes-gmac, this tier's mac_algorithm is {other}.*mac_algorithm: aes-gmac"):
            _open(lmdb_backend(fresh, 4 << 20, mac_key=SECRET, mac_algorithm=other))


def test_a_blake3_store_opens_under_the_aes_gmac_default_and_keeps_its_records(tmp_path: Path) -> None:
    """A store keyed while BLAKE3 was the default: its meta record names blake3, and a tier left
    at the default reads its records, and writes AES-GMAC ones beside them."""
    keys = [make_key(i) for i in range(3)]
    data = _blocks(3, seed=22)
    backend = _open(lmdb_backend(tmp_path, 4 << 20, mac_key=SECRET, mac_algorithm="blake3"))
    backend.write_blocks(keys[:2], data[:2])
    asyncio.run(backend.aclose())
    backend = _open(lmdb_backend(tmp_path, 4 << 20, mac_key=SECRET))
    try:
        assert backend.mac is not None and backend.mac.algorithm == "aes-gmac"
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys[:2]]
        assert backend.read_blocks(keys[:2], out) == [True, True]
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        backend.write_blocks(keys[2:], data[2:])
    finally:
        asyncio.run(backend.aclose())
    # Its meta record still names blake3; a blake3 tier opens it and serves its own two only.
    backend = _open(lmdb_backend(tmp_path, 4 << 20, mac_key=SECRET, mac_algorithm="blake3"))
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True, True, False]
        assert all(torch.equal(o, d) for o, d in zip(out[:2], data[:2]))
    finally:
        asyncio.run(backend.aclose())


# -- cold jobs: the lookups on a thread of their own, overlapping the copies ---------------------


def _cold_store(tmp_path: Path, n: int, options: dict[str, object]) -> tuple[list[bytes], list[torch.Tensor]]:
    """``n`` records of BIG blocks, the third one's payload damaged."""
    keys = [make_key(i) for i in range(n)]
    data = _blocks(n, seed=31, size=BIG.block_bytes)
    backend = _open(lmdb_backend(tmp_path, 16 << 20, **options), BIG)
    assert backend.write_blocks(keys, data) == [backend.reserve_bytes()] * n
    asyncio.run(backend.aclose())
    env, db = _env(tmp_path)
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(keys[2]))
        value[777] ^= 0x01
        txn.put(keys[2], bytes(value))
    env.close()
    return keys, data


@pytest.mark.parametrize("thread", [True, False])
@pytest.mark.parametrize("keyed", [False, True])
def test_a_cold_job_is_looked_up_on_its_own_thread_with_the_same_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyed: bool, thread: bool
) -> None:
    """Every lookup counted slow: after the first one, the job's lookups run on the cold read's
    thread (``thread``; else on the calling thread, in one pass), and what the job finds (hits,
    an absent key, a damaged record) is what a warm read finds."""
    from kvtier.backends import lmdb_layout

    options = {"mac_key": "a-test-secret-of-32-bytes-012345"} if keyed else {}
    keys, data = _cold_store(tmp_path, 5, options)
    threads: list[str] = []
    hook_lookups(monkeypatch, lambda key: threads.append(threading.current_thread().name))
    monkeypatch.setattr(lmdb_layout, "COLD_GET_S", -1.0)
    slow_lookups_read_the_disk(monkeypatch, thread=thread)
    backend = _open(lmdb_backend(tmp_path, 16 << 20, **options), BIG)
    try:
        job = [keys[0], keys[1], make_key(99), keys[2], keys[3], keys[4]]
        out = [torch.zeros(BIG.block_bytes, dtype=torch.uint8) for _ in job]
        assert backend.read_blocks(job, out) == [True, True, False, False, True, True]
        for i, d in ((0, 0), (1, 1), (4, 3), (5, 4)):
            assert torch.equal(out[i], data[d])
        assert threads[0] == threading.current_thread().name
        assert threads[1:] == ["kvtier-lmdb-cold" if thread else threads[0]] * 5
        stats = backend.stats()
        assert stats["corrupt_records"] == 1 and stats["auth_failures"] == (1 if keyed else 0)
        assert {r.key for r in backend.scan()} == set(keys) - {keys[2]}  # the damaged one deleted
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.parametrize("thread", [True, False])
def test_an_lmdb_error_in_a_cold_job_is_a_miss_for_that_key_and_the_rest_is_read_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread: bool
) -> None:
    from kvtier.backends import lmdb_layout

    keys, data = _cold_store(tmp_path, 5, {})
    failed: list[str] = []

    def lookup(key: bytes) -> None:
        if key == keys[1] and not failed:
            failed.append(threading.current_thread().name)
            raise lmdb.CorruptedError("a damaged page")

    hook_lookups(monkeypatch, lookup)
    monkeypatch.setattr(lmdb_layout, "COLD_GET_S", -1.0)
    slow_lookups_read_the_disk(monkeypatch, thread=thread)
    backend = _open(lmdb_backend(tmp_path, 16 << 20), BIG)
    try:
        job = [keys[0], keys[1], keys[3], keys[4]]
        out = [torch.zeros(BIG.block_bytes, dtype=torch.uint8) for _ in job]
        assert backend.read_blocks(job, out) == [True, False, True, True]
        assert failed == ["kvtier-lmdb-cold" if thread else threading.current_thread().name]
        assert torch.equal(out[0], data[0]) and torch.equal(out[2], data[3]) and torch.equal(out[3], data[4])
        assert {r.key for r in backend.scan()} == set(keys) - {keys[1]}  # dropped, as a warm read drops it
    finally:
        asyncio.run(backend.aclose())


def _jobs_with_slow_lookups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, thread: bool | None
) -> tuple[Backend, list[bytes], Callable[[set[bytes]], tuple[list[str], bool]]]:
    """A store of 4 good records and ``job(slow_keys)``: reads them in one job whose lookups of
    ``slow_keys`` read from disk (the cold rest of a job on a thread of its own when ``thread``,
    in one pass when not, as ``JobReader._cold_way`` says when ``None``); it checks the bytes and gives the threads that looked the keys up and whether
    the reader is cold after the job. The reader times its lookups on a clock of the test's
    own, which only a slow lookup advances: on a loaded machine a real lookup may take longer
    than COLD_GET_S, and that would make a job cold which a test needs warm."""
    from kvtier.backends import lmdb_layout

    keys, data = _cold_store(tmp_path, 5, {})
    good = [keys[0], keys[1], keys[3], keys[4]]
    want = [data[0], data[1], data[3], data[4]]
    threads: list[str] = []
    slow: set[bytes] = set()
    clock = [0.0]
    monkeypatch.setattr(lmdb_layout, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    slow_lookups_read_the_disk(monkeypatch, thread=thread)

    def lookup(key: bytes) -> None:
        threads.append(threading.current_thread().name)
        if key in slow:
            clock[0] += 2 * lmdb_layout.COLD_GET_S  # a lookup that read from disk

    hook_lookups(monkeypatch, lookup)
    backend = _open(lmdb_backend(tmp_path, 16 << 20), BIG)

    def job(slow_keys: set[bytes]) -> tuple[list[str], bool]:
        slow.clear()
        slow.update(slow_keys)
        threads.clear()
        out = [torch.zeros(BIG.block_bytes, dtype=torch.uint8) for _ in good]
        assert backend.read_blocks(good, out) == [True] * 4
        assert all(torch.equal(o, w) for o, w in zip(out, want))
        return list(threads), backend._reader.temperature.cold  # type: ignore[attr-defined]

    return backend, keys, job


def test_after_a_slow_lookup_the_next_jobs_are_looked_up_on_the_side_from_their_first_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold job's slow lookup is often its last (the read-around of an earlier value read the
    others): that job cannot overlap its copies any more, so the next one is read cold from
    its first key, on the cold read's thread. A job with no slow lookup makes the reader warm
    again: the job after it is looked up on the calling thread. The bytes are the same each
    time."""
    backend, keys, job = _jobs_with_slow_lookups(tmp_path, monkeypatch, thread=True)
    me, cold = threading.current_thread().name, "kvtier-lmdb-cold"
    try:
        assert job(set())[0] == [me] * 4  # warm: no thread
        assert job({keys[4]})[0] == [me] * 4  # the last lookup slow: nothing left to overlap here
        assert job(set())[0] == [cold] * 4  # ... so the next job is read cold
        assert job(set())[0] == [me] * 4  # that one found every value in memory: warm again
        assert job({keys[1]})[0] == [me, me, cold, cold]  # slow midway: as before
        assert job(set())[0] == [cold] * 4
    finally:
        asyncio.run(backend.aclose())


def test_on_a_busy_machine_a_cold_job_is_read_in_one_pass_and_the_reader_still_goes_cold_and_warm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no core spare, the cold thread is never tried: a job after a slow lookup is read on
    the calling thread (a get, a copy and a check per key, the raw read's shape), timed as the
    cold way 0; the reader still goes cold after a slow lookup and warm after a job with none,
    and the bytes are the same each time."""
    from kvtier.backends import lmdb_layout

    monkeypatch.setattr(lmdb_layout, "spare_core", lambda: False)
    backend, keys, job = _jobs_with_slow_lookups(tmp_path, monkeypatch, thread=None)  # the gate as it is
    backend_reader = backend._reader  # type: ignore[attr-defined]
    me = threading.current_thread().name
    try:
        assert job(set()) == ([me] * 4, False)
        assert job({keys[1]}) == ([me] * 4, True)  # slow midway: read on here, the reader cold
        assert backend_reader.cold_ways._cost == [None, None]  # a warm job's time is not a cold way's
        assert job({keys[4]}) == ([me] * 4, True)  # a cold job, read here, still slow
        assert backend_reader.cold_ways._cost[0] is not None and backend_reader.cold_ways._cost[1] is None
        assert job(set()) == ([me] * 4, False)  # a cold job that found every value in memory: warm
        assert job(set()) == ([me] * 4, False)
        assert backend.stats()["blocks_read"] == 20
    finally:
        asyncio.run(backend.aclose())


def test_a_job_found_cold_midway_decides_its_cold_way_once_and_times_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two slow lookups midway in one job, a core spare: the way its cold rest is read is
    picked once (the second slow lookup goes the same way), and that pick is timed as the
    way's cost, so the next jobs are judged by it (picked at every slow lookup and never
    timed, a probe of the other way came again at each)."""
    from kvtier.backends import lmdb_layout

    monkeypatch.setattr(lmdb_layout, "spare_core", lambda: True)
    backend, keys, job = _jobs_with_slow_lookups(tmp_path, monkeypatch, thread=None)  # the gate as it is
    ways = backend._reader.cold_ways  # type: ignore[attr-defined]
    me = threading.current_thread().name
    try:
        assert job({keys[1], keys[3]}) == ([me] * 4, True)  # way 0 first (FasterWay tries each once)
        assert ways._jobs == 1 and ways._cost[0] is not None and ways._cost[1] is None
    finally:
        asyncio.run(backend.aclose())


def test_the_cold_thread_is_tried_only_while_a_core_seems_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    """No spare core: way 0 and no pick (the ways' choice is left as it was); a spare core:
    each way once, then the faster."""
    from kvtier.backends import lmdb_layout

    reader = lmdb_layout.JobReader(blocks=None, index=None, psize=4096, map_base=None, path="p", block_bytes=4096, plain=None)  # type: ignore[arg-type]
    monkeypatch.setattr(lmdb_layout, "spare_core", lambda: False)
    assert [reader._cold_way() for _ in range(3)] == [0, 0, 0]
    monkeypatch.setattr(lmdb_layout, "spare_core", lambda: True)
    assert reader._cold_way() == 0
    reader.cold_ways.record(0, 2.0, 100)
    assert reader._cold_way() == 1
    reader.cold_ways.record(1, 1.0, 100)
    assert reader._cold_way() == 1  # the thread was the faster


# -- open: the blocks database's keys come from the page walk, not from a cursor over the map ----


def test_the_page_walk_lists_the_keys_of_a_named_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layouts(monkeypatch, "split")  # (joined records: tests/test_lmdb_joined.py)
    from kvtier.backends.lmdb_pages import check_file_trees

    keys = [make_key(i) for i in range(200)]  # several leaf pages, so a branch page too
    backend = _open(lmdb_backend(tmp_path, 8 << 20))
    backend.write_blocks(keys, _blocks(200, seed=3))
    backend.delete_blocks(keys[:7])
    asyncio.run(backend.aclose())
    path = str(tmp_path / "env")
    listed = check_file_trees(path, keys_of=b"blocks")
    assert listed is not None and listed.keys() == set(keys[7:])
    assert all(listed[key] is key for key in listed)  # each key maps to itself: an open keeps these objects
    assert check_file_trees(path, keys_of=b"index").keys() == set(keys[7:])  # type: ignore[union-attr]
    assert check_file_trees(path, keys_of=b"no-such-database") == {}
    assert check_file_trees(path) is None
    assert check_file_trees(str(tmp_path / "nothing-here")) is None


def test_open_lists_only_records_whose_value_is_stored(tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(4)]
    backend = _open(lmdb_backend(tmp_path, 4 << 20))
    backend.write_blocks(keys, _blocks(4, seed=8))
    asyncio.run(backend.aclose())
    env, db = _env(tmp_path)
    with env.begin(write=True, db=db) as txn:
        txn.delete(keys[1])  # its index entry stays
    env.close()
    backend = _open(lmdb_backend(tmp_path, 4 << 20))
    try:
        assert {r.key for r in backend.scan()} == {keys[0], keys[2], keys[3]}
    finally:
        asyncio.run(backend.aclose())


def test_open_reads_no_page_of_a_value(tmp_path: Path) -> None:
    """A cold open reads the B-trees' pages and never a value's: no value's first page is
    cached after it (a cursor walk of the blocks database touched every one of them)."""
    import mmap

    import numpy as np
    from kvtier.backends.lmdb_files import map_base

    big = BlockFormat(block_bytes=2 << 20, dtype="bfloat16", namespace={"model_id": "m"})
    keys = [make_key(i) for i in range(12)]
    backend = _open(lmdb_backend(tmp_path, 64 << 20), big)
    backend.write_blocks(keys, _blocks(12, seed=9, size=big.block_bytes))
    asyncio.run(backend.aclose())
    env, db = _env(tmp_path)
    base = map_base(str(tmp_path / "env"))
    assert base is not None
    with env.begin(buffers=True, db=db) as txn:
        firsts = [(int(np.frombuffer(txn.get(k), dtype=np.uint8, count=1).ctypes.data) - base) // mmap.PAGESIZE for k in keys]
    env.close()
    data = tmp_path / "env" / "data.mdb"
    evict_from_page_cache(data)
    if cached_pages(data)[0] > len(keys):
        pytest.skip("this filesystem keeps its pages cached (tmpfs?)")
    backend = _open(lmdb_backend(tmp_path, 64 << 20), big)
    try:
        resident = _resident(data)
        cached = [p for p in firsts if resident[p]]
        assert len(cached) < len(keys) // 2, f"{len(cached)} of {len(keys)} values' first pages read at open"
        out = [torch.zeros(big.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * len(keys)
    finally:
        asyncio.run(backend.aclose())


def _resident(path: Path) -> list[bool]:
    """Per page of the file at ``path``, whether it is in the page cache (``mincore``)."""
    import ctypes
    import mmap

    import numpy as np

    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        assert libc.mincore(ctypes.c_void_p(view.ctypes.data), size, vec) == 0
        del view
    return [bool(v & 1) for v in vec]


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("error", [lmdb.MapResizedError, lmdb.ReadersFullError, lmdb.BadRslotError])
def test_a_transient_lmdb_error_on_a_lookup_is_a_miss_and_never_deletes_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool, error: type[lmdb.Error]
) -> None:
    """An error that says nothing about the record (another process grew the map, reader
    slots) is a miss for that read alone: the record stays, and the next read serves it."""
    from kvtier.backends import lmdb_layout

    keys, data = _cold_store(tmp_path, 5, {})
    failed: list[bytes] = []

    def lookup(key: bytes) -> None:
        if key == keys[1] and not failed:
            failed.append(key)
            raise error("transient")

    hook_lookups(monkeypatch, lookup)
    if cold:
        monkeypatch.setattr(lmdb_layout, "COLD_GET_S", -1.0)
        slow_lookups_read_the_disk(monkeypatch)
    slow_lookups_read_the_disk(monkeypatch)
    backend = _open(lmdb_backend(tmp_path, 16 << 20), BIG)
    try:
        job = [keys[0], keys[1], keys[3], keys[4]]
        out = [torch.zeros(BIG.block_bytes, dtype=torch.uint8) for _ in job]
        assert backend.read_blocks(job, out) == [True, False, True, True]
        assert failed == [keys[1]]
        assert torch.equal(out[0], data[0]) and torch.equal(out[2], data[3]) and torch.equal(out[3], data[4])
        stats = backend.stats()
        assert stats["corrupt_records"] == 0 and stats["deleted"] == 0
        assert keys[1] in {r.key for r in backend.scan()}  # kept
        again = [torch.zeros(BIG.block_bytes, dtype=torch.uint8)]
        assert backend.read_blocks([keys[1]], again) == [True]
        assert torch.equal(again[0], data[1])
    finally:
        asyncio.run(backend.aclose())


def _blocks_leaf_pages(data_file: Path) -> list[int]:
    """Leaf pages of the blocks database's current tree, in page order."""
    import os
    import struct

    from kvtier.backends import lmdb_salvage
    from kvtier.backends.lmdb_files import read_meta_pages

    found = read_meta_pages(str(data_file.parent))
    assert found is not None
    meta = max((m for m in found[0] if m is not None), key=lambda m: m.txnid)
    fd = os.open(data_file, os.O_RDONLY)
    try:
        reader = lmdb_salvage._Reader(fd, meta.psize, meta.last_pgno)
        page = os.pread(fd, meta.psize, found[0].index(meta) * meta.psize)
        at = lmdb_salvage._MAIN_DB_AT
        dbs = reader.tree(page[at : at + lmdb_salvage._DB.size])
        blocks = lmdb_salvage._Reader(fd, meta.psize, meta.last_pgno)
        blocks.tree(dbs[b"blocks"][1])
        leaves = []
        for pgno in sorted(blocks.seen):
            flags = struct.unpack_from("<H", os.pread(fd, 16, pgno * meta.psize), 10)[0]
            if flags & 0x02:
                leaves.append(pgno)
        return leaves
    finally:
        os.close(fd)


@pytest.mark.parametrize("block_bytes", [1024, 16384])
def test_a_zeroed_page_costs_its_records_not_the_store(tmp_path: Path, block_bytes: int) -> None:
    """One zeroed leaf page of the blocks database: the environment is moved aside (kept for
    ``kvtier verify``) and every record that still checks is salvaged into the fresh one.
    Checksums decide: a record whose value was damaged elsewhere is not salvaged."""
    fmt = BlockFormat(block_bytes=block_bytes, dtype="bfloat16", namespace={"model_id": "m"})
    n = 240
    keys = [make_key(i) for i in range(n)]
    data = _blocks(n, seed=5, size=block_bytes)
    backend = _open(lmdb_backend(tmp_path, 32 << 20), fmt)
    for i in range(0, n, 16):
        assert None not in backend.write_blocks(keys[i : i + 16], data[i : i + 16])
    asyncio.run(backend.aclose())
    data_file = tmp_path / "env" / "data.mdb"
    leaves = _blocks_leaf_pages(data_file)
    assert len(leaves) >= 3
    raw = bytearray(data_file.read_bytes())
    raw[leaves[1] * 4096 : (leaves[1] + 1) * 4096] = bytes(4096)  # one zeroed leaf page
    damaged_value = bytes(data[n - 1][:64].numpy())
    at = raw.find(damaged_value)
    assert at > 0
    while at > 0:  # the last record's value damaged too (every copy of it: LMDB copies pages on write)
        raw[at + 10] ^= 0x01
        at = raw.find(damaged_value, at + 1)
    data_file.write_bytes(bytes(raw))
    backend = lmdb_backend(tmp_path, 32 << 20)
    with pytest.warns(RuntimeWarning, match="salvaged [0-9]+ sound records"):
        _open(backend, fmt)
    try:
        assert len(list((tmp_path / "env").glob("damaged-*/data.mdb"))) == 1
        assert backend._reader.guard.seen == data_file.stat().st_size  # type: ignore[attr-defined]  # (the file guard told what the salvage wrote)
        kept = {r.key for r in backend.scan()}
        assert keys[n - 1] not in kept  # its checksum failed: not salvaged
        assert n // 2 < len(kept) < n - 1  # one page's records lost, not the store
        order = [i for i, k in enumerate(keys) if k in kept]
        out = [torch.zeros(block_bytes, dtype=torch.uint8) for _ in order]
        assert backend.read_blocks([keys[i] for i in order], out) == [True] * len(order)
        assert all(torch.equal(o, data[i]) for o, i in zip(out, order))
        assert backend.stats()["corrupt_records"] == 0
    finally:
        asyncio.run(backend.aclose())
    # The values are read and handed over a batch at a time, most recently used first, and a
    # full map (put answering False) stops the copy there.
    from kvtier.backends.lmdb_salvage import salvage_records

    (moved,) = (tmp_path / "env").glob("damaged-*")
    batches: list[list[bytes]] = []

    def put(batch: list) -> bool:
        batches.append([r.key for r in batch])
        return len(batches) < 3

    kept, _, why, _ = salvage_records(str(moved), fmt, None, put, batch_bytes=1)
    assert why is None and kept == 2 and [len(b) for b in batches] == [1, 1, 1]
    assert batches[0][0] in set(keys[n - 16 : n - 1])  # a record of the last job (the newest) first
