"""The ``lmdb`` tier's one-pass read of warm jobs (``JobReader.read_in_one_pass``) against the
general read (``copy_in`` and ``copy_and_check``): the same bytes, the same misses, the same
records dropped and the same counters, whatever the job holds, plain or keyed."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvtier.backends import lmdb_layout
from kvtier.backends.lmdb_layout import INDEX
from kvtier.backends.lmdb_plain import host_rows
from lmdb_lookups import damaged_store, hook_lookups, layouts, slow_lookups_read_the_disk

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.records import xxcopy
from kvtier.records.checks import FasterWay
from kvtier.records.codec import NoneCodec
from kvtier.records.format import HEADER, HEADER_SIZE, MAGIC, RECORD_VERSION, encode_record
from kvtier.testing import make_key, random_block

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})


@pytest.fixture(autouse=True, params=["joined", "split"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on stores saved joined, then split (the layouts of small and large records)."""
    return layouts(monkeypatch, request.param)


SECRET = "a-test-secret-of-32-bytes-012345"


def _open(path: Path, **options: Any) -> Backend:
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path), **options)
    asyncio.run(backend.open(FMT))
    return backend


def _rows(n: int, shape: str) -> list[torch.Tensor]:
    """``n`` rows filled with 7s: tensors of their own, rows of one staging tensor (the
    manager's), or strided rows (not contiguous: read by the general code)."""
    if shape == "own":
        return [torch.full((FMT.block_bytes,), 7, dtype=torch.uint8) for _ in range(n)]
    if shape == "staging":
        return list(torch.full((n + 1, FMT.block_bytes), 7, dtype=torch.uint8)[1:].unbind(0))
    return list(torch.full((FMT.block_bytes, n), 7, dtype=torch.uint8).unbind(1))


def _read(
    path: Path, keys: list[bytes], plain: bool, monkeypatch: pytest.MonkeyPatch, rows: str = "own", **keyed: Any
) -> tuple[list[bool], list[torch.Tensor], dict[str, Any], set[bytes], int]:
    monkeypatch.setattr(lmdb_layout, "ONE_PASS_READS", plain)
    calls = []
    real = lmdb_layout.copy_and_check

    def counting(items: Any, mac: Any) -> Any:
        calls.append(len(items))
        return real(items, mac)

    monkeypatch.setattr(lmdb_layout, "copy_and_check", counting)
    backend = _open(path, **keyed)
    try:
        out = _rows(len(keys), rows)
        found = backend.read_blocks(keys, out)
        stats = {
            k: v for k, v in backend.stats().items() if k in ("blocks_read", "read_misses", "corrupt_records", "deleted", "bytes_read", "auth_failures")
        }
        listed = {r.key for r in backend.scan()}
    finally:
        asyncio.run(backend.aclose())
    return found, out, stats, listed, sum(calls)


@pytest.mark.parametrize(("keyed", "rows"), [(False, "own"), (False, "staging"), (False, "strided"), (True, "own")])
def test_a_one_pass_read_finds_drops_and_counts_what_the_general_read_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyed: bool, rows: str
) -> None:
    """Unkeyed rows of their own or of one staging tensor take the tight pass
    (``lmdb_plain.PlainReads``); strided rows, and keyed jobs, the one-pass loop."""
    options = {"mac_key": SECRET} if keyed else {}
    keys, data = damaged_store(tmp_path / "store", FMT, head_at=0, **options)
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    general = _read(tmp_path / "store", keys, False, monkeypatch, rows, **options)
    plain = _read(tmp_path / "copy", keys, True, monkeypatch, rows, **options)
    print(f"general: found {general[0]}, stats {general[2]}; plain: found {plain[0]}, stats {plain[2]}")
    assert general[0] == [True, False, False, False, True, True, True, True]
    assert plain[0] == general[0]
    for i, hit in enumerate(general[0]):
        if hit:
            assert torch.equal(general[1][i], data[i]) and torch.equal(plain[1][i], data[i])
    assert plain[2] == general[2] and general[2]["corrupt_records"] == 2 and general[2]["deleted"] == 2
    assert general[2]["auth_failures"] == (1 if keyed else 0)  # the flipped bit, refused by the MAC
    assert plain[3] == general[3] == {keys[i] for i in (0, 4, 5, 6, 7)}
    # The general read checked every record with a readable head through copy_and_check (all
    # but 3); the plain one handed it only those that are not plain and sound (2 and 6: the
    # whole record 5 holds its head in its value, as a joined one, and is read as one).
    assert general[4] == 6 and plain[4] == (6 if rows == "strided" else 2)


def test_host_rows_of_one_staging_tensor_are_views_of_its_rows() -> None:
    """Rows cut from one tensor are sliced from one view of it, each at its own offset; rows
    of their own get one view each; a strided row or a device stand-in means no views."""
    staging = torch.zeros((5, 64), dtype=torch.float32).view(torch.uint8)  # rows of 256 bytes
    rows = [staging[i] for i in (3, 1, 4)]
    views = host_rows(rows, 256)
    assert views is not None and len(views) == 3
    assert len({id(view.obj) for view in views}) == 1  # slices of one view of the staging tensor
    for n, view in enumerate(views):
        view[:] = bytes([n + 1]) * 256
    for n, row in enumerate(rows):
        assert torch.equal(row, torch.full((256,), n + 1, dtype=torch.uint8))
    assert staging[0].count_nonzero() == 0 and staging[2].count_nonzero() == 0
    for borrowed in (False, True):  # rows of their own: by numpy(), or by address
        own = [torch.zeros(256, dtype=torch.uint8) for _ in range(2)]
        own.append(torch.zeros(300, dtype=torch.uint8)[40:296])  # a row at an offset in its storage
        views = host_rows(own, 256, borrowed=borrowed)
        assert views is not None and [len(v) for v in views] == [256] * 3
        assert all(v.format == "B" and not v.readonly for v in views)
        views[1][:] = b"x" * 256
        views[2][:] = b"y" * 256
        assert own[0].count_nonzero() == 0 and bytes(own[1].numpy()) == b"x" * 256 and bytes(own[2].numpy()) == b"y" * 256
        assert own[2]._base.numpy()[:40].sum() == 0 and own[2]._base.numpy()[296:].sum() == 0  # nothing around it
        strided = list(torch.zeros((256, 2), dtype=torch.uint8).unbind(1))
        assert host_rows(strided, 256, borrowed=borrowed) is None


@pytest.mark.parametrize("error", [lmdb.CorruptedError, lmdb.MapResizedError])
def test_an_lmdb_error_in_a_plain_read_is_a_miss_and_the_rest_is_read_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[lmdb.Error]
) -> None:
    """As in the general read: a damaged page drops the key, any other error keeps it."""
    keys = [make_key(i) for i in range(4)]
    data = [random_block(FMT.block_bytes, 600 + i) for i in range(4)]
    backend = _open(tmp_path / "store")
    backend.write_blocks(keys, data)
    failed: list[bytes] = []

    def lookup(key: bytes) -> None:
        if key == keys[1] and not failed:
            failed.append(key)
            raise error("injected")

    hook_lookups(monkeypatch, lookup)
    plain_reads = []
    real_plain = lmdb_layout.JobReader.read_in_one_pass
    monkeypatch.setattr(lmdb_layout.JobReader, "read_in_one_pass", lambda self, *a, **k: plain_reads.append(1) or real_plain(self, *a, **k))
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True, False, True, True]
        assert plain_reads and failed == [keys[1]]
        assert all(torch.equal(out[i], data[i]) for i in (0, 2, 3))
        dropped = error is lmdb.CorruptedError
        assert (keys[1] in {r.key for r in backend.scan()}) is not dropped
        assert backend.stats()["deleted"] == (1 if dropped else 0)
    finally:
        asyncio.run(backend.aclose())


def _second_lookup_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> tuple[list[bytes], list[torch.Tensor], Backend, list[str]]:
    """A store of five records whose second lookup reads from disk, as the reader tells it (on
    a clock of the test's own, which only that lookup advances), and the list of the threads
    that looked each key up."""
    keys = [make_key(i) for i in range(5)]
    data = [random_block(FMT.block_bytes, seed + i) for i in range(5)]
    backend = _open(tmp_path / "store")
    backend.write_blocks(keys, data)
    clock = [0.0]
    monkeypatch.setattr(lmdb_layout, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    slow_lookups_read_the_disk(monkeypatch)
    threads: list[str] = []

    def lookup(key: bytes) -> None:
        threads.append(threading.current_thread().name)
        if key == keys[1]:
            clock[0] += 2 * lmdb_layout.COLD_GET_S

    hook_lookups(monkeypatch, lookup)
    return keys, data, backend, threads


def test_a_slow_lookup_in_a_plain_read_makes_the_rest_of_the_job_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys after a slow lookup are looked up on the cold read's thread, as in the general
    read; the bytes are the same."""
    keys, data, backend, threads = _second_lookup_slow(tmp_path, monkeypatch, 700)
    me = threading.current_thread().name
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 5
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        assert threads == [me, me] + ["kvtier-lmdb-cold"] * 3
    finally:
        asyncio.run(backend.aclose())


_CUT_UNDER_THE_STORE = """
import asyncio, os, sys
import torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_plain
from kvtier.errors import DiskError
from kvtier.testing import make_key, random_block

path, guarded = sys.argv[1], sys.argv[2] == "guarded"
if not guarded:
    lmdb_plain.FileGuard.check = lambda self: None
fmt = BlockFormat(block_bytes=65536, dtype="uint8")
backend = registry.backends.get("lmdb")(capacity=8 << 20, path=path, sync_mode="fast")
asyncio.run(backend.open(fmt))
keys = [make_key(i) for i in range(4)]
backend.write_blocks(keys, [random_block(fmt.block_bytes, i) for i in range(4)])
out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
assert backend.read_blocks(keys, out) == [True] * 4
data = os.path.join(path, "data.mdb")
os.truncate(data, os.path.getsize(data) // 2)  # the newest values' pages are cut off
print("cut", flush=True)
try:
    print("read", backend.read_blocks(keys, out), flush=True)
except DiskError as exc:
    print("refused", exc, flush=True)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_data_file_cut_short_under_an_open_store_is_refused_not_read(tmp_path: Path, guarded: bool) -> None:
    """python-lmdb's ``get`` touches every page of the value it returns, so a value whose pages
    were cut off the file faults the process inside the lookup, before any check of where the
    value lies could run. The reader therefore checks once per job that ``data.mdb`` has not
    shrunk (LMDB never shrinks it while open), and refuses the job with a ``DiskError`` (the
    manager serves it as misses). Without that check (``guarded=False``), the same read dies of
    SIGBUS: what the check is for. In a child process, so the fault is observed, not suffered."""
    child = subprocess.run(
        [sys.executable, "-c", _CUT_UNDER_THE_STORE, str(tmp_path / "store"), "guarded" if guarded else "bare"],
        capture_output=True, text=True, timeout=120,
    )
    print(child.stdout, child.stderr[-2000:])
    assert "cut" in child.stdout
    if guarded:
        assert child.returncode == 0 and "refused" in child.stdout and "shorter than" in child.stdout
    else:
        assert child.returncode == -signal.SIGBUS and "read" not in child.stdout.split("cut", 1)[1]


def test_the_head_a_plain_read_expects_is_the_one_the_tier_writes(tmp_path: Path, layout: str) -> None:
    """The one-pass read takes a record only when it holds an unkeyed head of a raw payload of
    the store's block size, in its index entry (split) or before the payload in its value
    (joined, no entry): what write_blocks puts (else every read would take the general path,
    unseen)."""
    backend = _open(tmp_path / "store")
    key = make_key(1)
    backend.write_blocks([key], [random_block(FMT.block_bytes, 1)])
    asyncio.run(backend.aclose())
    env = lmdb.open(str(tmp_path / "store"), max_dbs=3)
    index, blocks = env.open_db(b"index"), env.open_db(b"blocks")
    with env.begin() as txn:
        entry = txn.get(key, db=index)
        value = txn.get(key, db=blocks)
    env.close()
    if layout == "split":
        assert entry is not None and len(entry) == INDEX.size + HEADER_SIZE and len(value) == FMT.block_bytes
        head = entry[INDEX.size :]
    else:
        assert entry is None and len(value) == HEADER_SIZE + FMT.block_bytes
        head = value[:HEADER_SIZE]
    magic, version, codec_id, _, flags, raw, stored, _ = HEADER.unpack_from(head, 0)
    assert (magic, version, codec_id, flags, raw, stored) == (MAGIC, RECORD_VERSION, NoneCodec.codec_id, 0, FMT.block_bytes, FMT.block_bytes)


def test_a_slow_lookup_while_other_jobs_are_read_does_not_make_the_reader_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With several jobs read at once, a lookup's wall time also counts its wait for the GIL:
    it is not taken for a disk read, and the job stays on its thread (alone, the same lookup
    sends the rest of the job to the cold read's thread)."""
    keys, data, backend, threads = _second_lookup_slow(tmp_path, monkeypatch, 710)
    me = threading.current_thread().name
    temperature = backend._reader.temperature  # type: ignore[attr-defined]
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        temperature.enter()  # another job being read meanwhile
        try:
            assert backend.read_blocks(keys, out) == [True] * 5
        finally:
            temperature.leave()
        assert threads == [me] * 5 and not temperature.cold and temperature.readers == 0
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        threads.clear()
        assert backend.read_blocks(keys, out) == [True] * 5  # alone
        assert threads == [me, me] + ["kvtier-lmdb-cold"] * 3
    finally:
        asyncio.run(backend.aclose())


def test_a_slow_lookup_that_did_not_wait_for_the_disk_does_not_make_the_reader_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup's wall time also counts the time its thread was preempted: where the system
    counts the thread's major page faults, a slow lookup with none since its job began is not a
    disk read, and the job stays on its thread (with a fault each time, as above, it goes cold)."""
    keys, data, backend, threads = _second_lookup_slow(tmp_path, monkeypatch, 720)
    me = threading.current_thread().name
    faults = [5]
    monkeypatch.setattr(lmdb_layout, "major_faults", lambda: faults[0])
    temperature = backend._reader.temperature  # type: ignore[attr-defined]
    try:
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * 5
        assert threads == [me] * 5 and not temperature.cold
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        threads.clear()
        monkeypatch.setattr(lmdb_layout, "major_faults", lambda: faults.append(faults[-1] + 1) or faults[-1])
        assert backend.read_blocks(keys, out) == [True] * 5
        assert threads == [me, me] + ["kvtier-lmdb-cold"] * 3
    finally:
        asyncio.run(backend.aclose())


def test_the_faster_way_is_taken_and_the_other_is_tried_now_and_then() -> None:
    """Each way once, then the one with the lower moving cost per byte; every ``probe``-th
    job the other one, so that a change in the machine shows: here the side thread's way
    becomes the faster, and is taken from then on."""
    ways = FasterWay(probe=4, weight=1.0)  # the latest job's cost alone
    assert ways.pick() == 0
    ways.record(0, 1.0, 100)
    assert ways.pick() == 1
    ways.record(1, 2.0, 100)
    picks = []
    for _ in range(8):
        way = ways.pick()
        picks.append(way)
        ways.record(way, 1.0 if way == 0 else 0.1, 100)  # the other core freed: way 1 now wins
    # Jobs 3-10: the faster (0), the probe of the other at job 4, which now wins; the probe of
    # way 0 at job 8, which does not.
    assert picks == [0, 1, 1, 1, 1, 0, 1, 1]


def test_probes_of_a_way_that_keeps_losing_come_ever_further_apart() -> None:
    """Every probe that changes nothing doubles the distance to the next (8, 16, then the cap
    of 16); one that changes the best way brings it back to 4."""
    ways = FasterWay(probe=4, weight=1.0, max_probe=16)
    ways.record(ways.pick(), 1.0, 100)
    ways.record(ways.pick(), 3.0, 100)  # way 1 is slower

    def run(jobs: int, cost: tuple[float, float]) -> list[int]:
        probes = []
        for _ in range(jobs):
            way = ways.pick()
            if way == 1:
                probes.append(ways._jobs)  # type: ignore[attr-defined]
            ways.record(way, cost[way], 100)
        return probes

    assert run(60, (1.0, 3.0)) == [4, 12, 28, 44, 60]
    # Way 1 is the faster from now on: the probe at job 76 finds it, and it is taken from then
    # on, but for the probe of way 0 four jobs later.
    assert run(20, (1.0, 0.5)) == [76, 77, 78, 79, 81, 82]
    assert ways.pick() == 1


def test_a_way_judged_by_a_slow_first_job_is_taken_again_after_one_probe() -> None:
    """Way 0's first job was slow (a cold start) and way 1 then looked faster; the first probe
    of way 0 that is faster than way 1 makes it the best again, whatever the moving weight
    (averaged in at 0.3, the slow first job kept way 0 losing for hundreds of jobs)."""
    ways = FasterWay(probe=4, weight=0.3)
    ways.record(ways.pick(), 10.0, 100)  # way 0, cold
    ways.record(ways.pick(), 2.0, 100)  # way 1
    picks = []
    for _ in range(8):
        way = ways.pick()
        picks.append(way)
        ways.record(way, 1.0 if way == 0 else 2.0, 100)  # way 0 is in truth twice as fast
    assert picks[:3] == [1, 0, 0]  # the probe at job 4 finds it, and it is taken from then on
    assert picks.count(1) <= 2  # and way 1 is only probed from then on


@pytest.mark.parametrize("native", [False, *([True] if xxcopy.fused() else [])])
@pytest.mark.parametrize("spare", [False, True])
def test_a_large_plain_job_is_read_in_one_pass_as_the_general_read_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spare: bool, native: bool
) -> None:
    """A warm unkeyed job of SIDE_MIN_BYTES or more is read in one pass on the calling thread,
    even while a core seems spare and ``FasterWay`` would pick the side thread (its probes cost
    a fresh reader its second job on a quiet machine): no side thread, and the same finds,
    bytes, drops and counters as the general read, on a damaged store. The general read checks
    the job on the side thread on the Python path of ``xxcopy``, and on the calling thread, in
    the copy's pass, on the native one."""
    from kvtier.records import checks

    if not native:
        monkeypatch.setattr(xxcopy, "xxh3_copy", xxcopy.xxh3_copy_python)

    monkeypatch.setattr(lmdb_layout, "SIDE_MIN_BYTES", FMT.block_bytes * 4)
    monkeypatch.setattr(checks, "SIDE_MIN_BYTES", FMT.block_bytes * 4)
    monkeypatch.setattr(FasterWay, "pick", lambda self: 1)
    monkeypatch.setattr(lmdb_layout, "spare_core", lambda: spare)
    sides: list[Any] = []
    real_submit = checks._submit
    monkeypatch.setattr(checks, "_submit", lambda fn, *a: sides.append(fn) or real_submit(fn, *a))
    keys, data = damaged_store(tmp_path / "store", FMT, head_at=0)
    shutil.copytree(tmp_path / "store", tmp_path / "copy")
    general = _read(tmp_path / "store", keys, False, monkeypatch)
    assert len(sides) == (0 if native else 1)  # the general read checked the job on the side thread (Python path)
    chosen = _read(tmp_path / "copy", keys, True, monkeypatch)
    assert len(sides) == (0 if native else 1)  # ... and the one pass took none
    assert chosen[0] == general[0] == [True, False, False, False, True, True, True, True]
    for i, hit in enumerate(general[0]):
        if hit:
            assert torch.equal(chosen[1][i], data[i])
    assert chosen[2] == general[2] and chosen[3] == general[3]
    assert chosen[4] == 2 and general[4] == 6  # one pass hands copy_and_check the odd ones only


def _dump(path: Path) -> dict[bytes, tuple[bytes, bytes]]:
    """Every record of a closed store: key -> (blocks value, index entry less its stamp: the
    stored size and the head)."""
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=False)
    blocks, index = env.open_db(b"blocks", create=False), env.open_db(b"index", create=False)
    with env.begin() as txn:
        got = {bytes(k): (bytes(v), bytes(txn.get(k, db=index) or b"")[8:]) for k, v in txn.cursor(db=blocks)}
    env.close()
    return got


@pytest.mark.parametrize(("rows", "side_min"), [("own", 1 << 20), ("staging", 1 << 20), ("own", 1 << 14)])
def test_a_plain_job_is_saved_as_the_general_encoder_saves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: str, side_min: int, layout: str
) -> None:
    """An unkeyed, uncompressed job is encoded by ``PlainReads.records`` (one XXH3 state per
    store); the store holds the same bytes as after the general encoder (``encode_record``,
    inline or, for a job of ``SIDE_MIN_BYTES`` or more, on a side thread), and reads back
    through both read paths."""
    from kvtier.backends import lmdb_writes

    from kvtier.records import checks

    monkeypatch.setitem(checks.EncodedStream.__init__.__kwdefaults__, "min_bytes", side_min)

    keys = [make_key(i) for i in range(6)]
    data = [random_block(FMT.block_bytes, 900 + i) for i in range(6)]
    stores = {}
    written: dict[str, int] = {}
    from kvtier.backends import lmdb_plain

    calls = []
    real = lmdb_plain.PlainReads.records
    monkeypatch.setattr(lmdb_plain.PlainReads, "records", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    for way in ("plain", "general"):
        if way == "general":
            assert calls == [1]  # the plain way took the tight encoder
            monkeypatch.setattr(lmdb_writes, "host_rows", lambda blocks, size: None)
        if rows == "own":
            blocks = [d.clone() for d in data]
        else:
            blocks = list(torch.stack(data).unbind(0))
        backend = _open(tmp_path / way)
        if way == "general":  # no row views either: the general checks and encoder
            backend._reader = dataclasses.replace(backend._reader, views=None)  # type: ignore[attr-defined]
            backend._ready_writes()  # type: ignore[attr-defined]  # (what saves take from the reader, worked out at the open)
        try:
            assert backend.write_blocks(keys, blocks) == [backend._pages(HEADER_SIZE + FMT.block_bytes)] * 6  # type: ignore[attr-defined]
            assert backend.stats()["blocks_written"] == 6
            written[way] = backend.stats()["bytes_written"]
        finally:
            asyncio.run(backend.aclose())
        stores[way] = _dump(tmp_path / way)
    assert calls == [1]  # ... and the general way did not
    assert written["plain"] == written["general"] == 6 * (HEADER_SIZE + FMT.block_bytes)  # counted alike
    assert stores["plain"] == stores["general"] and len(stores["plain"]) == 6
    for key, d in zip(keys, data):
        head, payload = encode_record(key, d.numpy().data, NoneCodec(), 1, None)  # bfloat16: dtype code 1
        value, entry = stores["plain"][key]
        if layout == "split":
            assert (value, entry[8:]) == (bytes(payload), bytes(head))  # (entry: stored size, then the head)
        else:
            assert (value, entry) == (bytes(head) + bytes(payload), b"")  # (joined: no entry)
    for plain in (True, False):
        found, out, *_ = _read(tmp_path / "plain", keys, plain, monkeypatch)
        assert found == [True] * 6 and all(torch.equal(o, d) for o, d in zip(out, data))


def test_a_core_seems_spare_only_while_the_load_leaves_room_for_two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the load average at the cores' count, or one other busy thread on 2 cores, no core
    seems spare (the cold thread is not tried); a load under the cores less one and a half
    leaves one."""
    from kvtier.records import checks

    monkeypatch.setattr(checks, "usable_cpus", lambda: 2)
    monkeypatch.setattr(checks.os, "getloadavg", lambda: (2.0, 2.0, 2.0))
    assert not checks.spare_core()
    monkeypatch.setattr(checks.os, "getloadavg", lambda: (1.2, 2.0, 2.0))
    assert not checks.spare_core()
    monkeypatch.setattr(checks.os, "getloadavg", lambda: (0.4, 2.0, 2.0))
    assert checks.spare_core()
