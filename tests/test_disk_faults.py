"""Crash and fault injection for the persistent tiers.

The kill test forks a writer that stores blocks in a loop and reports each key on a pipe only
after ``write_blocks`` returned (i.e. once the block is durable), SIGKILLs it at a random moment,
then reopens the store in the parent: open must never fail, every reported block must be present
and byte-exact, and no other record may ever be served with wrong bytes.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_commit, lmdb_lone

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.errors import BackendError, ConfigError, DiskError
from kvtier.testing import make_key, random_block

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="needs fork and SIGKILL")

FMT = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "crash"})
PER_ROUND = 1000  # key space per round; a writer never gets near it before being killed


def _seed(round_: int, i: int) -> int:
    return round_ * PER_ROUND + i


def _block(seed: int) -> torch.Tensor:
    return random_block(FMT.block_bytes, seed)


def _backend(name: str, path: Path, **options: object) -> Backend:
    return registry.backends.get(name)(capacity=256 << 20, path=str(path), **options)


def _straight_lines() -> list[int]:
    """Count, in this (the writer's) process, the saves the ``lmdb`` tier's straight lines
    (:class:`~kvtier.backends.lmdb_lone.LoneSave`) stored."""
    took = [0]
    for attr in ("save", "save_job"):
        real = getattr(lmdb_lone.LoneSave, attr)

        def counted(self: Any, *args: Any, _real: Any = real) -> Any:
            out = _real(self, *args)
            if out is not None:
                took[0] += 1
            return out

        setattr(lmdb_lone.LoneSave, attr, counted)
    return took


def _writer(name: str, path: Path, round_: int, fd: int) -> None:
    """Saves of 1-3 blocks. ``lmdb-kept``: from three rows saved from again and again, each block
    copied in before its save: the store keeps their views, so the saves take the lone save's and
    the job save's straight lines (fresh rows never do)."""
    backend = _backend(name.removesuffix("-kept"), path)
    asyncio.run(backend.open(FMT))
    i = 0
    rng = random.Random(round_)
    kept = [torch.zeros_like(_block(0)) for _ in range(3)] if name.endswith("-kept") else None
    took = _straight_lines() if kept is not None else None
    while i < PER_ROUND - 4:
        n = rng.randint(1, 3)
        seeds = [_seed(round_, i + j) for j in range(n)]
        if kept is not None:
            for row, s in zip(kept, seeds):
                row.copy_(_block(s))
        assert took is None or i < 8 or took[0] > 0, "the kept rows' saves never took the straight lines"
        sizes = backend.write_blocks([make_key(s) for s in seeds], kept[:n] if kept is not None else [_block(s) for s in seeds])
        done = [s for s, size in zip(seeds, sizes) if size is not None]
        if done:
            os.write(fd, b"".join(b"%d\n" % s for s in done))
        i += n


def _run_round(name: str, path: Path, round_: int, rng: random.Random) -> list[int]:
    """Fork a writer, kill it at a random moment, return the seeds it reported as stored."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            _writer(name, path, round_, w)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    wanted = rng.randint(0, 12)
    buf = b""
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while buf.count(b"\n") < wanted:
            chunk = pipe.read(4096)
            if not chunk:
                break
            buf += chunk
        time.sleep(rng.uniform(0, 0.004))  # land anywhere: mid-put, mid-commit, mid-sync, mid-rename
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "writer died on its own"
        buf += pipe.read()  # lines written before the kill are complete writes too
    return [int(line) for line in buf.split()]


def _check_store(name: str, path: Path, reported: set[int], all_seeds: dict[bytes, int]) -> None:
    backend = _backend(name.removesuffix("-kept"), path)
    asyncio.run(backend.open(FMT))  # must never fail after a crash
    try:
        listed = {r.key for r in backend.scan()}
        must = {make_key(s) for s in reported}
        assert must <= listed, "a block reported stored is missing from scan"
        keys = sorted(listed | must)
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
        found = backend.read_blocks(keys, out)
        for key, ok, got in zip(keys, found, out):
            assert key in all_seeds, "a record under a key nobody wrote"
            if key in must:
                assert ok, "a block reported stored is not served"
            if ok:
                assert torch.equal(got, _block(all_seeds[key])), "wrong bytes served"
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.parametrize(("name", "rounds"), [("lmdb", 50), ("lmdb-kept", 30), ("file", 20)])
def test_kill_9_never_loses_reported_blocks_or_serves_bad_ones(name: str, rounds: int, tmp_path: Path) -> None:
    rng = random.Random(1234)
    path = tmp_path / name
    reported: set[int] = set()
    all_seeds: dict[bytes, int] = {}
    for round_ in range(rounds):
        all_seeds.update({make_key(_seed(round_, i)): _seed(round_, i) for i in range(PER_ROUND)})
        reported.update(_run_round(name, path, round_, rng))
        _check_store(name, path, reported, all_seeds)
    assert len(reported) > rounds  # the writers really did get blocks in before dying


def test_file_sync_failure_fails_the_write_and_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend("file", tmp_path / "store")
    asyncio.run(backend.open(FMT))
    try:
        assert backend.write_blocks([make_key(1)], [_block(1)]) != [None]

        def eio(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", eio)
        assert backend.write_blocks([make_key(2)], [_block(2)]) == [None]
        monkeypatch.undo()
        assert backend.stats()["write_failures"] == 1
        assert not list((tmp_path / "store").rglob("*.tmp"))
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in range(2)]
        assert backend.read_blocks([make_key(1), make_key(2)], out) == [True, False]
        assert torch.equal(out[0], _block(1))
    finally:
        asyncio.run(backend.aclose())


def test_lmdb_disk_error_on_put_fails_only_that_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmdb

    backend = _backend("lmdb", tmp_path / "env")
    asyncio.run(backend.open(FMT))
    try:
        module = sys.modules[type(backend).__module__]
        real_put = module.LmdbBackend._put
        calls = {"n": 0}

        def flaky(self: Backend, *args: object) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise lmdb.DiskError("injected ENOSPC")
            real_put(self, *args)

        def job_fails(self: Backend, *args: object) -> None:  # the job's one transaction fails on the same disk
            raise lmdb.DiskError("injected ENOSPC")

        monkeypatch.setattr(module.LmdbBackend, "_put", flaky)
        monkeypatch.setattr(module.LmdbBackend, "_put_together", job_fails)
        keys = [make_key(i) for i in range(3)]
        sizes = backend.write_blocks(keys, [_block(i) for i in range(3)])
        assert sizes[0] is not None and sizes[1] is None and sizes[2] is not None
        assert backend.stats()["write_failures"] == 1
        assert backend.read_blocks(keys, [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]) == [True, False, True]
    finally:
        asyncio.run(backend.aclose())


def test_lmdb_failed_sync_raises_disk_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmdb

    backend = _backend("lmdb", tmp_path / "env")
    asyncio.run(backend.open(FMT))
    try:
        env = backend._env  # type: ignore[attr-defined]

        class FailingSync:
            def __getattr__(self, name: str) -> object:
                return getattr(env, name)

            def sync(self, force: bool = False) -> None:
                raise lmdb.DiskError("injected EIO")

        monkeypatch.setattr(backend, "_env", FailingSync())
        with pytest.raises(DiskError, match="sync") as info:
            backend.write_blocks([make_key(1)], [_block(1)])
        assert isinstance(info.value.__cause__, lmdb.Error)
    finally:
        monkeypatch.undo()
        asyncio.run(backend.aclose())


# -- item 10: keyed records on stores others can write to -------------------------------------

MAC_SECRET = "fleet-secret-for-tests-0123456789"


def _plant_forgery(name: str, path: Path, key: bytes, raw: torch.Tensor) -> None:
    """What anyone with write access can do: a well-formed record with a valid checksum, made by
    a plain tier elsewhere and copied into the store by hand (a plain tier refuses to open it)."""
    made = path.with_name(path.name + "-forger")
    plain = _backend(name, made)
    asyncio.run(plain.open(FMT))
    try:
        assert plain.write_blocks([key], [raw]) != [None]
    finally:
        asyncio.run(plain.aclose())
    if name == "file":
        for record in made.rglob("*.kvb"):
            dest = path / record.relative_to(made)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(record.read_bytes())
        return
    import lmdb

    src, dst = lmdb.open(str(made), max_dbs=8, readonly=True, lock=False), lmdb.open(str(path), max_dbs=8)
    try:
        with src.begin() as rtxn, dst.begin(write=True) as wtxn:
            for name_ in [k for k, _ in rtxn.cursor()]:
                if name_ != b"meta":
                    db_src, db_dst = src.open_db(name_, txn=rtxn), dst.open_db(name_, txn=wtxn)
                    for k, v in rtxn.cursor(db=db_src):
                        wtxn.put(k, v, db=db_dst)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("name", ["lmdb", "file"])
def test_keyed_store_serves_no_forged_record(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_FAULT_SECRET", MAC_SECRET)
    path = tmp_path / name

    def keyed_backend() -> Backend:
        return registry.backends.get(name)(capacity=64 << 20, path=str(path), mac_key_env="KV_FAULT_SECRET")

    good = [make_key(i) for i in range(4)]
    keyed = keyed_backend()
    asyncio.run(keyed.open(FMT))
    try:
        assert None not in keyed.write_blocks(good, [_block(i) for i in range(4)])
    finally:
        asyncio.run(keyed.aclose())
    forged = make_key(100)
    _plant_forgery(name, path, forged, _block(999))
    keys = [*good, forged]
    out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8) for _ in keys]
    # A reader without the secret cannot check keyed records: refused at open, the records kept
    # (tests/test_keyed_store_open.py).
    plain = _backend(name, path)
    with pytest.raises(ConfigError, match="no mac_key"):
        asyncio.run(plain.open(FMT))
    asyncio.run(plain.aclose())
    keyed = keyed_backend()
    asyncio.run(keyed.open(FMT))
    try:
        found = keyed.read_blocks(keys, out)
        stats = keyed.stats()
        print(f"{name}: served {sum(found)} keyed, refused {stats['auth_failures']} forged, deleted {stats['deleted']}")
        assert found == [True, True, True, True, False]
        assert all(torch.equal(out[i], _block(i)) for i in range(4))
        assert stats["auth_failures"] == 1 and stats["corrupt_records"] == 1
    finally:
        asyncio.run(keyed.aclose())


# -- a damaged LMDB environment is a miss or a fresh start, never a crash (issue 11, items 3-8) --
#
# Risky probes run in a subprocess: a SIGBUS or SIGSEGV there fails the test instead of killing
# pytest. Each probe prints one JSON line per trial; the parent checks and prints the counts.

import json  # noqa: E402
import shutil  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import warnings  # noqa: E402

SMALL = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "damage"})
RECORDS = 24


def _small_block(i: int) -> torch.Tensor:
    return random_block(SMALL.block_bytes, 7000 + i)


def _make_pristine(path: Path, n: int = RECORDS, capacity: int = 8 << 20) -> None:
    backend = registry.backends.get("lmdb")(capacity=capacity, path=str(path))
    asyncio.run(backend.open(SMALL))
    try:
        assert None not in backend.write_blocks([make_key(i) for i in range(n)], [_small_block(i) for i in range(n)])
        # Half of them stamped, as a close writes the stamps of records read: those gain an index
        # entry (whole layout), the rest stay joined (no entry).
        backend.touch_stamps([(make_key(i), 1000.0 + i) for i in range(0, n, 2)])
    finally:
        asyncio.run(backend.aclose())


def _apply(damage: dict, data: Path) -> None:
    if damage["kind"] == "truncate":
        os.truncate(data, damage["size"])
    elif damage["kind"] == "flip":
        with open(data, "r+b") as f:
            f.seek(damage["offset"])
            byte = f.read(1)[0]
            f.seek(damage["offset"])
            f.write(bytes([byte ^ (1 << damage["bit"])]))
    elif damage["kind"] == "write":
        with open(data, "r+b") as f:
            f.seek(damage["offset"])
            f.write(bytes.fromhex(damage["hex"]))


def probe_trials(pristine: str, work: str, trials: list[dict]) -> None:
    """Subprocess side: damage a copy of ``pristine`` per trial, open it, read every key."""
    import logging

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    keys = [make_key(i) for i in range(RECORDS)]
    for n, damage in enumerate(trials):
        path = Path(work) / f"t{n}"
        shutil.copytree(pristine, path)
        _apply(damage, path / "data.mdb")
        line: dict[str, object] = {"trial": n, **damage}
        print(json.dumps({**line, "started": True}), flush=True)
        backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path))
        try:
            asyncio.run(backend.open(SMALL))
        except Exception as exc:  # a clean refusal is acceptable; a crash is not
            line.update(opened=False, error=f"{type(exc).__name__}: {exc}")
            print(json.dumps(line), flush=True)
            continue
        try:
            listed = {r.key for r in backend.scan()}
            out = [torch.zeros(SMALL.block_bytes, dtype=torch.uint8) for _ in keys]
            found = backend.read_blocks(keys, out)
            wrong = sum(1 for i, ok in enumerate(found) if ok and not torch.equal(out[i], _small_block(i)))
            moved = len(list(path.glob("damaged-*/data.mdb")))
            line.update(opened=True, listed=len(listed), hits=sum(found), misses=len(found) - sum(found), wrong=wrong, moved=moved)
            # Writing after damage works too (the store goes on).
            line["write_ok"] = backend.write_blocks([make_key(500)], [_small_block(500)]) != [None]
        finally:
            asyncio.run(backend.aclose())
        print(json.dumps(line), flush=True)


def _run_probe(pristine: Path, work: Path, trials: list[dict]) -> list[dict]:
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import test_disk_faults as t; "
        "t.probe_trials(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), str(pristine), str(work), json.dumps(trials)],
        capture_output=True, text=True, timeout=600,
    )
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    done = [x for x in lines if "started" not in x]
    if proc.returncode != 0:
        last = lines[-1] if lines else None
        raise AssertionError(
            f"probe died with status {proc.returncode} (signal {-proc.returncode if proc.returncode < 0 else None}) "
            f"during trial {last}; stderr: {proc.stderr[-2000:]}"
        )
    assert len(done) == len(trials)
    return done


def _summary(name: str, results: list[dict]) -> dict[str, int]:
    counts = {
        "trials": len(results),
        "opened": sum(1 for r in results if r.get("opened")),
        "refused": sum(1 for r in results if not r.get("opened")),
        "moved_aside": sum(1 for r in results if r.get("moved")),
        "hits": sum(int(r.get("hits", 0)) for r in results),
        "misses": sum(int(r.get("misses", 0)) for r in results),
        "wrong": sum(int(r.get("wrong", 0)) for r in results),
        "writes_ok": sum(1 for r in results if r.get("write_ok")),
    }
    print(f"{name}: {json.dumps(counts)}")
    return counts


def test_truncated_data_file_never_faults(tmp_path: Path) -> None:
    """Item 3: a truncated data.mdb used to open, then SIGBUS on the first read past its end."""
    pristine = tmp_path / "pristine"
    _make_pristine(pristine)
    size = (pristine / "data.mdb").stat().st_size
    rng = random.Random(3)
    sizes = sorted({rng.randrange(2 * 4096, size) for _ in range(28)} | {size - 4096, size // 2})
    results = _run_probe(pristine, tmp_path / "work", [{"kind": "truncate", "size": s} for s in sizes])
    counts = _summary("truncation", results)
    assert counts["wrong"] == 0
    assert counts["opened"] == counts["trials"], [r for r in results if not r.get("opened")]
    assert counts["writes_ok"] == counts["trials"]
    assert counts["moved_aside"] >= 1  # damage found at open moves the environment aside


def test_random_bit_flips_never_crash_or_serve_wrong_bytes(tmp_path: Path) -> None:
    """Item 3: single-bit flips anywhere in data.mdb (meta, branch, leaf and value pages)."""
    pristine = tmp_path / "pristine"
    _make_pristine(pristine)
    size = (pristine / "data.mdb").stat().st_size
    rng = random.Random(11)
    # Half the flips land in the first pages (meta pages, B-tree pages), half anywhere.
    trials = [{"kind": "flip", "offset": rng.randrange(0, 8 * 4096 if i % 2 else size), "bit": rng.randrange(8)} for i in range(60)]
    results = _run_probe(pristine, tmp_path / "work", trials)
    counts = _summary("bit flips", results)
    assert counts["wrong"] == 0
    assert counts["opened"] == counts["trials"], [r for r in results if not r.get("opened")]
    assert counts["hits"] > 0


def _page_flags(data: bytes, psize: int = 4096) -> list[int]:
    return [struct.unpack_from("<H", data, p * psize + 10)[0] for p in range(len(data) // psize)]


def _named_db_roots(path: Path) -> dict[bytes, int]:
    """Root page of each named database, read from the main database's leaf (small stores)."""
    data = (path / "data.mdb").read_bytes()
    metas = [struct.unpack_from("<QQ", data, p * 4096 + 136) for p in (0, 1)]
    main_root = struct.unpack_from("<Q", data, (0 if metas[0][1] > metas[1][1] else 1) * 4096 + 128)[0]
    page = data[main_root * 4096 : (main_root + 1) * 4096]
    lower = struct.unpack_from("<H", page, 12)[0]
    roots = {}
    for i in range((lower - 16) // 2):
        off = struct.unpack_from("<H", page, 16 + 2 * i)[0]
        ksize = struct.unpack_from("<H", page, off + 6)[0]
        key = page[off + 8 : off + 8 + ksize]
        roots[key] = struct.unpack_from("<Q", page, off + 8 + ksize + 40)[0]
    return roots


def test_damaged_index_or_meta_record_moves_the_environment_aside(tmp_path: Path) -> None:
    """Item 4: a damaged index page made every open raise DiskError; a flipped meta version byte
    made every open raise ConfigError. Both now move the environment aside and start empty."""
    pristine = tmp_path / "pristine"
    _make_pristine(pristine)
    roots = _named_db_roots(pristine)
    assert set(roots) == {b"blocks", b"index", b"meta"}
    data = (pristine / "data.mdb").read_bytes()
    meta_at = data.index(b"KVTM")
    trials = [
        # The index's root page: its flags say it is neither a leaf nor a branch.
        {"kind": "write", "offset": roots[b"index"] * 4096 + 10, "hex": "0000"},
        # The blocks database's root page, likewise.
        {"kind": "write", "offset": roots[b"blocks"] * 4096 + 10, "hex": "0000"},
        # One flipped bit in the meta record's version byte, to version 0, which no build wrote
        # (a higher version whose body's CRC holds is a newer kvtier's store: refused, and left
        # as it is; tests/test_unreadable_records.py).
        {"kind": "flip", "offset": meta_at + 4, "bit": 0},
    ]
    results = _run_probe(pristine, tmp_path / "work", trials)
    counts = _summary("index/meta damage", results)
    assert counts["opened"] == 3 and counts["moved_aside"] == 3 and counts["wrong"] == 0
    assert counts["writes_ok"] == 3
    for n in range(3):
        assert (tmp_path / "work" / f"t{n}").glob("damaged-*/REASON")


def test_a_damaged_environment_is_kept_for_verify(tmp_path: Path) -> None:
    from kvtier.tools import verify_tier

    path = tmp_path / "env"
    _make_pristine(path)
    _apply({"kind": "truncate", "size": (path / "data.mdb").stat().st_size // 2}, path / "data.mdb")
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path))
    with pytest.warns(RuntimeWarning, match="damaged"):
        asyncio.run(backend.open(SMALL))
    asyncio.run(backend.aclose())
    (moved,) = path.glob("damaged-*")
    assert "truncated" in (moved / "REASON").read_text()
    # verify can open what was kept (the pages that are still there) without faulting
    proc = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "verify", str(moved), "--json"], capture_output=True, text=True)
    print(f"verify of the kept environment: status {proc.returncode}, {proc.stdout.strip()[:200]} {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 1 and "damaged" in proc.stderr  # refused with a reason, never a fault
    with pytest.raises(DiskError, match="truncated"):
        verify_tier(moved)


@pytest.fixture
def tiny_fs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 1 MiB tmpfs, filled to the last byte (root only; skipped loudly otherwise)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0:
        warnings.warn("full-filesystem tests skipped: they mount a tmpfs and need root", RuntimeWarning, stacklevel=1)
        pytest.skip("SKIPPED LOUDLY: needs root to mount a small tmpfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        warnings.warn(f"full-filesystem tests skipped: mount failed: {proc.stderr.strip()}", RuntimeWarning, stacklevel=1)
        pytest.skip(f"SKIPPED LOUDLY: cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        (mount / "tier").mkdir()
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * 4096) > 0:
                pass
        except OSError:
            pass  # ENOSPC: the filesystem is full
        finally:
            os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


_FULL_FS_PROBE = (
    "import asyncio, sys, torch; from kvtier import registry; from kvtier.backend import BlockFormat\n"
    "from kvtier.testing import make_key\n"
    "for name in ('lmdb', 'file'):\n"
    "    b = registry.backends.get(name)(capacity=8 << 20, path=sys.argv[1] + '/' + name)\n"
    "    try:\n"
    "        asyncio.run(b.open(BlockFormat(block_bytes=16384)))\n"
    "    except Exception as exc:\n"
    "        print(name, type(exc).__name__, exc)\n"
    "        continue\n"
    "    out = [torch.zeros(16384, dtype=torch.uint8)]\n"
    "    hit = b.read_blocks([make_key(1)], out)[0]\n"
    "    wrote = b.write_blocks([make_key(2)], [torch.ones(16384, dtype=torch.uint8)])[0] is not None\n"
    "    asyncio.run(b.aclose())\n"
    "    print(name, 'opened', 'hit' if hit else 'miss', 'wrote' if wrote else 'write-refused')\n"
)


def test_opening_on_a_full_filesystem_is_a_clean_error(tiny_fs: Path) -> None:
    """Item 5: opening an LMDB tier on a full filesystem used to die with SIGBUS."""
    proc = subprocess.run([sys.executable, "-c", _FULL_FS_PROBE, str(tiny_fs / "tier")], capture_output=True, text=True, timeout=120)
    print(f"full filesystem, new tiers: status {proc.returncode}; {proc.stdout.strip()}")
    assert proc.returncode == 0, f"died with status {proc.returncode}: {proc.stderr[-1000:]}"
    lmdb_line = next(line for line in proc.stdout.splitlines() if line.startswith("lmdb"))
    assert "DiskError" in lmdb_line and "free" in lmdb_line


def test_an_existing_tier_on_a_filesystem_that_filled_up_still_serves(tiny_fs: Path) -> None:
    os.unlink(tiny_fs / "filler")
    for name in ("lmdb", "file"):
        b = registry.backends.get(name)(capacity=8 << 20, path=str(tiny_fs / "tier" / name))
        asyncio.run(b.open(BlockFormat(block_bytes=16384)))
        assert b.write_blocks([make_key(1)], [torch.full((16384,), 7, dtype=torch.uint8)]) != [None]
        asyncio.run(b.aclose())
    fd = os.open(tiny_fs / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096) > 0:
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    proc = subprocess.run([sys.executable, "-c", _FULL_FS_PROBE, str(tiny_fs / "tier")], capture_output=True, text=True, timeout=120)
    print(f"full filesystem, existing tiers: status {proc.returncode}; {proc.stdout.strip()}")
    assert proc.returncode == 0, f"died with status {proc.returncode}: {proc.stderr[-1000:]}"
    assert "lmdb opened hit" in proc.stdout


def test_lowering_the_capacity_drops_the_oldest_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Item 6: reopening with a smaller capacity failed with MDB_MAP_FULL on every attempt and
    deleted records silently."""
    path = tmp_path / "env"
    big = registry.backends.get("lmdb")(capacity=4 << 20, path=str(path))
    asyncio.run(big.open(SMALL))
    n = 0
    while n < 400:
        if big.write_blocks([make_key(n)], [_small_block(n)]) == [None]:
            break
        big.touch_stamps([(make_key(n), float(n))])  # oldest first
        n += 1
    asyncio.run(big.aclose())
    size_before = (path / "data.mdb").stat().st_size
    small = registry.backends.get("lmdb")(capacity=2 << 20, path=str(path))
    with caplog.at_level("WARNING"):
        asyncio.run(small.open(SMALL))
    try:
        kept = sorted(r.key for r in small.scan())
        size_after = (path / "data.mdb").stat().st_size
        dropped = n - len(kept)
        print(f"lowered capacity: stored {n}, kept {len(kept)}, dropped {dropped}; file {size_before} -> {size_after} bytes")
        assert 0 < len(kept) < n and size_after <= 2 << 20
        assert any(f"dropped the {dropped} oldest records" in r.getMessage() for r in caplog.records)
        assert kept == sorted(make_key(i) for i in range(dropped, n))  # the newest survive
        out = [torch.zeros(SMALL.block_bytes, dtype=torch.uint8) for _ in kept]
        assert all(small.read_blocks(kept, out))
        assert small.write_blocks([make_key(900)], [_small_block(900)]) != [None] or small.stats()["write_failures"] == 1
    finally:
        asyncio.run(small.aclose())
    again = registry.backends.get("lmdb")(capacity=2 << 20, path=str(path))
    asyncio.run(again.open(SMALL))  # and it opens again at the lowered capacity
    asyncio.run(again.aclose())


def test_a_second_opener_is_refused_naming_the_holder(tmp_path: Path) -> None:
    """Item 7: two processes on one LMDB path both opened and wrote with no error."""
    path = tmp_path / "env"
    first = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path))
    asyncio.run(first.open(SMALL))
    try:
        code = (
            "import asyncio, sys; from kvtier import registry; from kvtier.backend import BlockFormat\n"
            "b = registry.backends.get('lmdb')(capacity=8 << 20, path=sys.argv[1])\n"
            "try:\n"
            "    asyncio.run(b.open(BlockFormat(block_bytes=16384, dtype='bfloat16', namespace={'model_id': 'damage'})))\n"
            "    print('opened')\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
        print(f"second process: {proc.stdout.strip()}")
        assert proc.returncode == 0
        assert proc.stdout.startswith("BackendError") and f"process {os.getpid()}" in proc.stdout
        same = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path))
        with pytest.raises(BackendError, match=f"in use by process {os.getpid()}"):
            asyncio.run(same.open(SMALL))
    finally:
        asyncio.run(first.aclose())
    after = registry.backends.get("lmdb")(capacity=8 << 20, path=str(path))
    asyncio.run(after.open(SMALL))  # released at close
    asyncio.run(after.aclose())


def test_verify_delete_works_on_a_full_map(tmp_path: Path) -> None:
    """Item 8: ``kvtier verify --delete`` failed with MDB_MAP_FULL on a real-sized store."""
    from kvtier.tools import verify_tier

    path = tmp_path / "env"
    backend = registry.backends.get("lmdb")(capacity=2 << 20, path=str(path), sync_mode="fast")
    asyncio.run(backend.open(SMALL))
    n = 0
    while backend.write_blocks([make_key(n)], [_small_block(n)]) != [None]:
        n += 1
    asyncio.run(backend.aclose())
    data = bytearray((path / "data.mdb").read_bytes())
    at = data.index(bytes(_small_block(3).numpy()[:64]))  # damage one record's payload
    data[at + 100] ^= 0xFF
    (path / "data.mdb").write_bytes(bytes(data))
    from kvtier.backends.lmdb_files import HolderLock

    live = HolderLock(str(path))  # what an open tier holds
    live.acquire()
    try:  # never behind a live tier's back: its map could not follow
        with pytest.raises(BackendError, match=f"in use by process {os.getpid()}"):
            verify_tier(path, delete=True)
    finally:
        live.release()
    report = verify_tier(path, delete=True)
    print(f"verify --delete on a full map: {n} records, {len(report.bad)} bad, {report.deleted} deleted")
    assert len(report.bad) == 1 and report.deleted == 1
    assert verify_tier(path).ok


def test_a_bad_lmdb_read_is_a_per_key_miss_and_the_key_is_dropped(tmp_path: Path) -> None:
    """Issue 9, defect 5: any LMDB error while reading failed the whole load, and the bad key
    stayed ready for ever, offered to every later request."""
    import lmdb

    import kvtier
    from kvtier.testing import make_key as mk

    caches = [torch.randn(16, 16, 2, 4, 32).to(torch.bfloat16) for _ in range(2)]
    cfg = {"tiers": [{"backend": "lmdb", "path": str(tmp_path / "env"), "capacity": "64MiB"}], "namespace": {"model_id": "d5"}}
    keys = [mk(600 + i) for i in range(3)]

    async def run() -> tuple[int, int, int, dict]:
        async with kvtier.open(cfg, kv_caches=caches) as store:
            assert await store.save(keys, [0, 1, 2]) == 3
            backend = store.backends[0]
            env = backend._env  # type: ignore[attr-defined]

            class Txn:
                def __init__(self, txn: object) -> None:
                    self._txn = txn

                def get(self, key: bytes, default: object = None, db: object = None) -> object:  # python-lmdb's signature
                    if key == keys[1]:
                        raise lmdb.CorruptedError("injected MDB_CORRUPTED")
                    return self._txn.get(key, default, db=db)  # type: ignore[attr-defined]

                def abort(self) -> None:
                    self._txn.abort()  # type: ignore[attr-defined]

                def __enter__(self) -> object:
                    return self._txn.__enter__()  # type: ignore[attr-defined]

                def __exit__(self, *exc: object) -> object:
                    return self._txn.__exit__(*exc)  # type: ignore[attr-defined]

            class Env:
                def __getattr__(self, name: str) -> object:
                    return getattr(env, name)

                def begin(self, *args: object, **kw: object) -> Txn:
                    return Txn(env.begin(*args, **kw))

            backend._env = Env()  # type: ignore[attr-defined]
            try:
                first = await store.load(keys, [8, 9, 10])
                ready_after = await store.lookup(keys)
                second = await store.load(keys[:1], [11])
            finally:
                backend._env = env  # type: ignore[attr-defined]
            return first, ready_after, second, backend.stats()

    first, ready_after, second, stats = asyncio.run(run())
    print(f"bad read: first load filled {first}, lookup after {ready_after}, next load {second}, corrupt {stats['corrupt_records']}")
    assert first == 1  # the key before the bad one; the bad one is a miss, not a failed job
    assert ready_after == 1  # the bad key was dropped: nobody is offered it again
    assert second == 1


# -- file tier: symlinks, ownership, durable shard directories (issue 11, item 9) ------------------


def test_file_tier_never_follows_a_symlinked_shard_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    backend = _backend("file", root, layout="sharded")
    asyncio.run(backend.open(FMT))
    try:
        key = make_key(1)
        assert backend.write_blocks([key], [_block(1)]) != [None]
        h = key.hex()
        shard = root / h[:2] / h[2:4]
        outside = tmp_path / "outside"
        outside.mkdir()
        victim = outside / f"{h}.kvb"
        victim.write_bytes(b"not a record, and not the tier's to delete")
        shutil.rmtree(shard)
        shard.symlink_to(outside, target_is_directory=True)
        out = [torch.zeros(FMT.block_bytes, dtype=torch.uint8)]
        found = backend.read_blocks([key], out)
        written = backend.write_blocks([key], [_block(1)])
        backend.delete_blocks([key])
        stats = backend.stats()
        left = sorted(p.name for p in outside.iterdir())
        print(f"symlinked shard: read {found}, write {written}, outside dir holds {left}, corrupt {stats['corrupt_records']}")
        assert found == [False] and written == [None]
        assert victim.read_bytes().startswith(b"not a record") and left == [victim.name]  # untouched
    finally:
        asyncio.run(backend.aclose())


def test_file_tier_root_is_private_and_refused_when_another_user_owns_it(tmp_path: Path) -> None:
    root = tmp_path / "new-root"
    backend = _backend("file", root)
    asyncio.run(backend.open(FMT))
    asyncio.run(backend.aclose())
    mode = root.stat().st_mode & 0o777
    print(f"new root mode {oct(mode)}")
    assert mode == 0o700
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: chown to another user needs root")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 54321, 54321)
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="belongs to uid 54321"):
        asyncio.run(_backend("file", foreign).open(FMT))


def test_file_tier_fsyncs_new_shard_directories_into_their_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend("file", tmp_path / "root", layout="sharded")
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    try:
        asyncio.run(backend.open(FMT))  # makes the first level (00 … ff) and syncs the root
        root = str((tmp_path / "root").resolve())
        assert synced.count(root) == 2  # the meta record's entry, then the new directories'
        synced.clear()
        key = make_key(2)
        assert backend.write_blocks([key], [_block(2)]) != [None]
    finally:
        monkeypatch.undo()
        asyncio.run(backend.aclose())
    h = key.hex()
    print(f"fsync'ed directories: {synced}")
    assert os.path.join(root, h[:2]) in synced and os.path.join(root, h[:2], h[2:4]) in synced


def test_a_flat_store_syncs_each_record_then_the_root_once_per_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the flat layout a job's records share the root: every record's data is synced, then
    (after every rename) the root's entries, once for the whole job."""
    backend = _backend("file", tmp_path / "root")
    events: list[tuple[str, str]] = []
    real_fsync, real_fdatasync, real_replace = os.fsync, os.fdatasync, os.replace

    def spy(kind: str, real: Any) -> Any:
        def call(fd: int) -> None:
            events.append((kind, os.readlink(f"/proc/self/fd/{fd}")))
            real(fd)

        return call

    def replace(src: Any, dst: Any, **kw: Any) -> None:
        events.append(("rename", str(dst)))
        real_replace(src, dst, **kw)

    asyncio.run(backend.open(FMT))
    root = str((tmp_path / "root").resolve())
    assert [p.name for p in Path(root).iterdir()] == ["kvtier-meta.kvm"]  # no shard directories
    monkeypatch.setattr(file_commit, "NATIVE_SYNCS", False)  # each sync an os call, watched here
    monkeypatch.setattr(os, "fsync", spy("fsync", real_fsync))
    monkeypatch.setattr(os, "fdatasync", spy("fdatasync", real_fdatasync))
    monkeypatch.setattr(os, "replace", replace)
    keys = [make_key(60 + i) for i in range(6)]
    try:
        assert None not in backend.write_blocks(keys, [_block(i) for i in range(6)])
    finally:
        monkeypatch.undo()
        asyncio.run(backend.aclose())
    kinds = [kind for kind, _ in events]
    print(f"flat job: {kinds}")
    assert kinds == ["fdatasync"] * 6 + ["rename"] * 6 + ["fsync"]  # data, then names, then the directory
    assert events[-1] == ("fsync", root)
    assert sorted(os.path.basename(what) for kind, what in events if kind == "rename") == sorted(f"{k.hex()}.kvb" for k in keys)


def test_stamps_that_cannot_be_written_never_fail_a_close(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Item 4: with a damaged index, the stamp flush at aclose raised DiskError."""
    import lmdb

    import kvtier

    caches = [torch.randn(8, 16, 2, 4, 32).to(torch.bfloat16)]
    cfg = {"tiers": [{"backend": "lmdb", "path": str(tmp_path / "env"), "capacity": "32MiB"}], "namespace": {"model_id": "stamps"}}
    keys = [make_key(40 + i) for i in range(2)]

    async def run() -> None:
        store = await kvtier.open(cfg, kv_caches=caches)
        assert await store.save(keys, [0, 1]) == 2
        assert await store.load(keys, [2, 3]) == 2  # recency to persist at close
        backend = store.backends[0]
        env = backend._env  # type: ignore[attr-defined]

        class Env:
            def __getattr__(self, name: str) -> object:
                return getattr(env, name)

            def begin(self, *args: object, **kw: object) -> object:
                if kw.get("write", len(args) > 2 and args[2]):  # (db, parent, write, buffers)
                    raise lmdb.CorruptedError("injected MDB_CORRUPTED")
                return env.begin(*args, **kw)

        backend._env = Env()  # type: ignore[attr-defined]
        try:
            await store.aclose()  # must not raise
        finally:
            backend._env = env  # type: ignore[attr-defined]
            await backend.aclose()

    with caplog.at_level("WARNING"):
        asyncio.run(run())
    logged = [r.getMessage() for r in caplog.records if "access stamps" in r.getMessage()]
    print(f"stamps at close on a damaged index: {len(logged)} warning(s), no exception")
    assert logged
