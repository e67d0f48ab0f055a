"""A ``file`` tier closed while a read is under way (the read took the tier's one-pass reader,
then the close let the root's descriptor go): the one-pass read leaves its records to the
general path (which reads nothing once the tier is closed), on the native and the Python read, in either
layout; it never hands the closed descriptor's number to ``openat`` as a ``ValueError`` or a
read of whatever directory the number names next. A read, write or delete under way across the
close never reaches a store opened at the same path since."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.errors import ClosedError
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block


@pytest.mark.parametrize("layout", ["flat", "sharded"])
@pytest.mark.parametrize("way", ["native", "python"])
def test_a_read_that_outlives_the_tiers_close_is_left_to_the_general_path(tmp_path: Path, layout: str, way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if way == "python":
        monkeypatch.setattr(xxcopy, "xxh3_read_check_key", xxcopy.xxh3_read_check_key_python)
        monkeypatch.setattr(xxcopy, "xxh3_read_check_keys", xxcopy.xxh3_read_check_keys_python)
        monkeypatch.setattr(xxcopy, "xxh3_read_one", xxcopy.xxh3_read_one_python)
        monkeypatch.setattr(xxcopy, "xxh3_read_check", xxcopy.xxh3_read_check_python)
        monkeypatch.setattr(xxcopy, "xxh3_read_rows", None)  # (a build without it: the rows checked in Python)
        monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
    fmt = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
    backend = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path), sync_mode="fast", layout=layout)
    asyncio.run(backend.open(fmt))
    keys = [make_key(i) for i in range(3)]
    backend.write_blocks(keys, [random_block(fmt.block_bytes, 40 + i) for i in range(3)])
    out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
    assert backend.read_blocks(keys, out) == [True, True, True]
    assert backend.read_blocks(keys[:1], out[:1]) == [True]  # (the row's view is kept)
    plain = backend._plain
    assert plain is not None
    asyncio.run(backend.aclose())
    for rows in (None, [memoryview(o.numpy()) for o in out]):  # (rows given: the job's one call, in the flat layout)
        found = [False] * 3
        assert plain.read(keys, out, found, rows) == [0, 1, 2]
        assert found == [False, False, False]
    assert plain.read_one(keys[0], out[0], backend.counters) is None
    # The native job from its rows' checks (flat): counted, then every record the general path's.
    rows_job = plain.read_rows(keys, out)
    assert rows_job == (([False] * 3, [0, 1, 2]) if xxcopy.xxh3_read_rows is not None and layout == "flat" else None)
    assert plain.root.under_way == []
    with pytest.raises(ClosedError):
        backend.read_blocks(keys, out)


@pytest.mark.parametrize("layout", ["flat", "sharded"])
def test_a_read_that_outlives_the_tiers_close_reads_nothing_of_a_store_opened_since(tmp_path: Path, layout: str) -> None:
    """The closed root's descriptor number is handed out again (here to another store's root):
    the closed tier's one-pass read must not open its records beneath it."""
    fmt = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
    first = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path / "a"), sync_mode="fast", layout=layout)
    asyncio.run(first.open(fmt))
    keys = [make_key(i) for i in range(2)]
    out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
    first.write_blocks(keys, [random_block(fmt.block_bytes, 40 + i) for i in range(2)])
    assert first.read_blocks(keys, out) == [True, True]
    assert first.read_blocks(keys[:1], out[:1]) == [True]
    plain = first._plain
    assert plain is not None
    asyncio.run(first.aclose())
    second = registry.backends.get("file")(capacity=8 << 20, path=str(tmp_path / "b"), sync_mode="fast", layout=layout)
    asyncio.run(second.open(fmt))
    try:
        second.write_blocks(keys, [random_block(fmt.block_bytes, 50 + i) for i in range(2)])
        for rows in (None, [memoryview(o.numpy()) for o in out]):
            found = [False] * 2
            assert plain.read(keys, out, found, rows) == [0, 1]
            assert found == [False, False]
        assert plain.read_one(keys[0], out[0], first.counters) is None
    finally:
        asyncio.run(second.aclose())


#: What every child script below begins with: the imports they share, a scratch directory
#: ``tmp`` with ``root`` in it (a store's path), the block format ``fmt``, and ``opened``: a
#: ``file`` tier opened at ``path`` (``model``: its namespace's model id; ``extra``: options).
_PRELUDE = r"""
import asyncio, os, shutil, signal, sys, tempfile, threading, torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import file_reads
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
tmp = tempfile.mkdtemp()
root = f"{tmp}/root"
fmt = BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": "m"})
def opened(path=root, *, layout="sharded", model="m", **extra):
    backend = registry.backends.get("file")(capacity=8 << 20, path=path, sync_mode="fast", layout=layout, **extra)
    asyncio.run(backend.open(BlockFormat(block_bytes=16384, dtype="bfloat16", namespace={"model_id": model})))
    return backend
"""

_RACE = _PRELUDE + r"""
first = opened(f"{tmp}/a", layout="flat")
keys = [make_key(i) for i in range(2)]
data = [random_block(fmt.block_bytes, 40 + i) for i in range(2)]
first.write_blocks(keys, data)
out = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in keys]
first.read_blocks(keys, out)
real, entered, go = getattr(xxcopy, sys.argv[1]), threading.Event(), threading.Event()
def held(*args):  # the read's native call, held before its descriptor is read (the job's) or opened
    if not entered.is_set():
        entered.set()
        go.wait()
    return real(*args)
setattr(xxcopy, sys.argv[1], held)
if sys.argv[1] != "xxh3_read_job":  # (the job's one call from its checks to its counters set aside)
    xxcopy.xxh3_read_job = None
if sys.argv[1] == "xxh3_read_check_keys":  # the job's rows checked in Python, then its one call
    xxcopy.xxh3_read_rows = None
plain = first._plain
def read():  # the tier's job (its one call); or its one-pass read a record at a time (no rows' views given)
    if sys.argv[1] != "xxh3_read_check_key":
        return first.read_blocks(keys, out)
    found = [False] * len(keys)
    plain.read(keys, out, found)  # (what it leaves would go to the general read: a miss once closed)
    return found
got = []
reader = threading.Thread(target=lambda: got.append(read()))
reader.start()
entered.wait()
closed = threading.Event()
closer = threading.Thread(target=lambda: (asyncio.run(first.aclose()), closed.set()))
closer.start()
if not closed.wait(0.5):  # the close waits for the read under way: let the read go on first
    go.set()
closer.join()
second = opened(f"{tmp}/b", layout="flat")  # may take the closed root's descriptor number
second.write_blocks(keys, [random_block(fmt.block_bytes, 50 + i) for i in range(2)])
go.set()
reader.join()
print(got[0], all(torch.equal(o, d) for o, d, hit in zip(out, data, got[0]) if hit))
asyncio.run(second.aclose())
"""


@pytest.mark.parametrize(
    "call", ["xxh3_read_check_key", "xxh3_read_check_keys", *(["xxh3_read_rows"] if xxcopy.xxh3_read_rows else []), *(["xxh3_read_job"] if xxcopy.xxh3_read_job else [])]
)
def test_a_close_waits_for_a_read_under_way_before_its_root_descriptor_is_reused(call: str) -> None:
    """A read whose native open comes after a close began: the close waits for it, so the
    read opens the closed store's own records, never those of a store opened since under the
    descriptor's number (child process: a close that never ends fails the test, not the run).
    ``xxh3_read_check_key``: the one-pass read a record at a time; ``xxh3_read_check_keys``:
    the tier's job in one call, which reads the descriptor itself before each open (its rows
    checked in Python); ``xxh3_read_rows``: the job from its rows' checks in one call, held
    before it counts itself (the close then need not wait: the descriptor, read before each
    open, says closed); ``xxh3_read_job``: the same from the job's mode checks to its counters."""
    child = subprocess.run([sys.executable, "-c", _RACE, call], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    if call == "xxh3_read_check_key":
        # The held record is read before the close ends; the next is a miss where the close got
        # there first (the tier closed under the job), never another store's record.
        assert child.stdout.split() in (["[True,", "True]", "True"], ["[True,", "False]", "True"]), child.stdout
    else:  # held before it read the descriptor: it opens nothing once the close has begun
        assert child.stdout.split() in (["[True,", "True]", "True"], ["[False,", "False]", "True"]), child.stdout


_BY_PATH = _PRELUDE + r"""
extra = {"mac_key": "a-test-secret-of-32-bytes-012345"} if sys.argv[1] == "keyed" else {}
first = opened(layout="flat", model="m1", **extra)
key = make_key(0)
ours = random_block(16384, 1)
first.write_blocks([key], [ours])
out = [torch.zeros(16384, dtype=torch.uint8)]
entered, go = threading.Event(), threading.Event()
def hold(real):
    def held(*args, **kwargs):  # the job, held after its open check and before its first record
        entered.set()
        go.wait()
        return real(*args, **kwargs)
    return held
if first._plain is not None:
    first._plain.read = hold(first._plain.read)
else:
    first._leaf = hold(first._leaf)
got = []
reader = threading.Thread(target=lambda: got.append(first.read_blocks([key], out)))
reader.start()
entered.wait()
closed = threading.Event()
closer = threading.Thread(target=lambda: (asyncio.run(first.aclose()), closed.set()))
closer.start()
if not closed.wait(0.5):  # a close that waits for the read under way: let the read go on first
    go.set()
closer.join()
shutil.rmtree(f"{tmp}/root")  # the root cleared, and a store of another model opened there
second = opened(layout="flat", model="m2", **extra)
theirs = random_block(16384, 2)
second.write_blocks([key], [theirs])
go.set()
reader.join()
print(got[0][0], torch.equal(out[0], ours), torch.equal(out[0], theirs))
asyncio.run(second.aclose())
"""


@pytest.mark.parametrize("kind", ["plain", "keyed"])
def test_a_read_that_outlives_the_tiers_close_reads_no_record_of_a_store_opened_since_at_its_root(kind: str) -> None:
    """The general read (a keyed store's only read; a plain store's once its root is closed)
    opens records by the root's path: a job under way across the close must not read, as a
    hit, the record of a store opened at the same path since (child process)."""
    child = subprocess.run([sys.executable, "-c", _BY_PATH, kind], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    hit, ours, theirs = child.stdout.split()
    assert theirs == "False", child.stdout
    assert hit == "False" or ours == "True", child.stdout  # a hit is the closed store's own record


_CHANGE_BY_PATH = _PRELUDE + r"""
from kvtier.backends.file_tree import FileTree
from kvtier.errors import ClosedError
first = opened()
key = make_key(0)
entered, go = threading.Event(), threading.Event()
def hold(real):
    def held(*args, **kwargs):  # the job, held after its open check and before its record's directory
        entered.set()
        go.wait()
        return real(*args, **kwargs)
    return held
if sys.argv[1] == "write":
    first._shards.open_leaf = hold(first._shards.open_leaf)
    job = lambda: first.write_blocks([key], [random_block(16384, 1)])
else:
    first.write_blocks([key], [random_block(16384, 1)])
    first._unlink_record = hold(first._unlink_record)
    job = lambda: first.delete_blocks([key])
got = []
def run():
    try:
        got.append(job())
    except ClosedError:
        got.append("closed")
reader = threading.Thread(target=run)
reader.start()
entered.wait()
closed = threading.Event()
closer = threading.Thread(target=lambda: (asyncio.run(first.aclose()), closed.set()))
closer.start()
if not closed.wait(0.5):  # a close that waits for the job under way: let the job go on first
    go.set()
closer.join()
second = opened()  # the same store, opened again at its path
theirs = random_block(16384, 2)
if sys.argv[1] == "delete":
    second.write_blocks([key], [theirs])
go.set()
reader.join()
leaf = FileTree._leaf_at(f"{tmp}/root", key, layout="sharded")
on_disk = leaf is not None and os.path.exists(f"{tmp}/root/{key.hex()[0:2]}/{key.hex()[2:4]}/{key.hex()}.kvb")
if leaf is not None:
    os.close(leaf[0])
# a record on disk is one the store opened since knows of (its own, or listed at its open)
print(on_disk, on_disk == (second._sizes.get(key) > 0))
asyncio.run(second.aclose())
"""


@pytest.mark.parametrize("change", ["write", "delete"])
def test_a_write_or_delete_that_outlives_the_tiers_close_leaves_a_store_opened_since_alone(change: str) -> None:
    """A job under way across the close reaches its record's directory by the root's path (the
    sharded layout's walk): it must not plant a record in, or delete one from, the store opened
    at that path since (child process)."""
    child = subprocess.run([sys.executable, "-c", _CHANGE_BY_PATH, change], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    on_disk, known = child.stdout.split()
    assert known == "True", child.stdout
    assert on_disk == "True" or change == "write", child.stdout  # the record written since stays


_FORKED_CLOSE = _PRELUDE + r"""
backend = opened()
key = make_key(0)
backend.write_blocks([key], [random_block(16384, 1)])
entered, go = threading.Event(), threading.Event()
real = backend._leaf
def held(k):  # a read job under way on another thread when the process forks
    entered.set()
    go.wait()
    return real(k)
backend._leaf = held
backend._plain = None
reader = threading.Thread(target=lambda: backend.read_blocks([key], [torch.zeros(16384, dtype=torch.uint8)]))
reader.start()
entered.wait()
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: the reading thread is not there, its count is
    signal.alarm(60)
    backend._leaf = real
    out = torch.zeros(16384, dtype=torch.uint8)
    hit = backend.read_blocks([key], [out])
    asyncio.run(backend.aclose())
    os.write(write, f"{hit[0]} closed".encode())
    os._exit(0)
os.close(write)
_, status = os.waitpid(pid, 0)
go.set()
reader.join()
print(os.read(read, 100).decode() or f"killed by signal {os.WTERMSIG(status)}")
asyncio.run(backend.aclose())
"""


def test_a_child_forked_during_a_read_reads_and_closes_the_tier() -> None:
    """The child of a fork inherits the count of a read under way on another thread of the
    parent, but not the thread: its close must not wait for that read (child process)."""
    child = subprocess.run([sys.executable, "-c", _FORKED_CLOSE], capture_output=True, text=True, timeout=180)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["True", "closed"], child.stdout


_STUCK = _PRELUDE + r"""
file_reads.CLOSE_WAIT_S = 0.2
backend = opened()
key = make_key(0)
backend.write_blocks([key], [random_block(16384, 1)])
entered = threading.Event()
def stuck(k):  # a read that never returns (a hung filesystem)
    entered.set()
    threading.Event().wait()
backend._leaf = stuck
backend._plain = None
threading.Thread(target=lambda: backend.read_blocks([key], [torch.zeros(16384, dtype=torch.uint8)]), daemon=True).start()
entered.wait()
fd = backend._beneath.fd
asyncio.run(backend.aclose())
kept = os.path.samestat(os.fstat(fd), os.stat(root))  # left open: its number is not handed out again
print("closed", kept, flush=True)
os._exit(0)
"""


def test_a_close_waits_for_a_read_that_never_ends_a_bounded_time_and_keeps_the_root_open() -> None:
    """A read stuck for good (a hung filesystem) holds the close for ``CLOSE_WAIT_S`` at most
    (as the ``lmdb`` tier's close); the root's descriptor is then left open, so its number is
    never handed to another directory under the read (child process)."""
    child = subprocess.run([sys.executable, "-c", _STUCK], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["closed", "True"], child.stdout


#: The two children whose job outlives the close's wait: a sharded store whose close waits 0.2 s.
_OUTLIVED = _PRELUDE + r"""
file_reads.CLOSE_WAIT_S = 0.2
first = opened()
keys = [make_key(0), make_key(1)]
"""

_RESUMED = _OUTLIVED + r"""
first.write_blocks(keys[:1], [random_block(16384, 1)])
entered, go = threading.Event(), threading.Event()
real = first._leaf
def held(k):  # the job's first record, held past the close's wait (a slow filesystem)
    if not entered.is_set():
        entered.set()
        go.wait()
    return real(k)
first._leaf = held
first._plain = None
out = [torch.zeros(16384, dtype=torch.uint8) for _ in keys]
got = []
reader = threading.Thread(target=lambda: got.append(first.read_blocks(keys, out)))
reader.start()
entered.wait()
asyncio.run(first.aclose())  # gives up waiting for the read, the root's descriptor left open
shutil.rmtree(root)
second = opened()
theirs = random_block(16384, 2)
second.write_blocks(keys[1:], [theirs])
go.set()
reader.join()
print(got[0][1], torch.equal(out[1], theirs))
asyncio.run(second.aclose())
"""


def test_a_read_that_outlives_the_closes_wait_reads_no_further_record() -> None:
    """A read job still under way when the close gave up waiting for it (``CLOSE_WAIT_S``)
    finishes the record it was on, and reads none of its others: they would be opened by the
    root's path, where a store may have been opened since (child process)."""
    child = subprocess.run([sys.executable, "-c", _RESUMED], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["False", "False"], child.stdout


# A write held (by the held step set up before it) past the close's wait, a store opened at the
# root's path meanwhile: prints whether the write failed both records and planted none there.
_WRITE_HELD = r"""
got = []
writer = threading.Thread(target=lambda: got.append(first.write_blocks(keys, [random_block(16384, i) for i in range(2)])))
writer.start()
entered.wait()
asyncio.run(first.aclose())  # gives up waiting for the write, the root's descriptor left open
shutil.rmtree(root)
second = opened()
go.set()
writer.join()
planted = [os.path.exists(f"{root}/{k.hex()[0:2]}/{k.hex()[2:4]}/{k.hex()}.kvb") for k in keys]
print(got[0] == [None, None], planted == [False, False])
asyncio.run(second.aclose())
"""

_WRITE_RESUMED = _OUTLIVED + r"""
entered, go = threading.Event(), threading.Event()
real = first._shards.open_leaf
def held(*args):  # the job's first record's directory, held past the close's wait (a slow filesystem)
    if not entered.is_set():
        entered.set()
        go.wait()
    return real(*args)
first._shards.open_leaf = held
""" + _WRITE_HELD


def test_a_write_that_outlives_the_closes_wait_plants_no_record() -> None:
    """A write job still under way when the close gave up waiting for it (``CLOSE_WAIT_S``)
    fails its records rather than reach their directories by the root's path, where a store
    may have been opened since (child process)."""
    child = subprocess.run([sys.executable, "-c", _WRITE_RESUMED], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["True", "True"], child.stdout


_DELETE_RESUMED = _OUTLIVED + r"""
first.write_blocks(keys, [random_block(16384, i) for i in range(2)])
entered, go = threading.Event(), threading.Event()
real = first._unlink_record
def held(*args, **kwargs):  # the job's first record, held past the close's wait before its walk (a slow filesystem)
    if not entered.is_set():
        entered.set()
        go.wait()
    return real(*args, **kwargs)
first._unlink_record = held
deleter = threading.Thread(target=lambda: first.delete_blocks(keys))
deleter.start()
entered.wait()
asyncio.run(first.aclose())  # gives up waiting for the delete, the root's descriptor left open
shutil.rmtree(root)
second = opened()
second.write_blocks(keys, [random_block(16384, 5 + i) for i in range(2)])
go.set()
deleter.join()
kept = [os.path.exists(f"{root}/{k.hex()[0:2]}/{k.hex()[2:4]}/{k.hex()}.kvb") for k in keys]
print(*kept, second.read_blocks(keys, [torch.zeros(16384, dtype=torch.uint8) for _ in keys]) == [True, True])
asyncio.run(second.aclose())
"""


def test_a_delete_that_outlives_the_closes_wait_removes_no_record_of_a_store_opened_since() -> None:
    """A delete job still under way when the close gave up waiting for it (``CLOSE_WAIT_S``)
    reaches its records' directories by the root's path, where a store may have been opened
    since: it must remove none of that store's records, neither the one it was on nor the
    next (child process)."""
    child = subprocess.run([sys.executable, "-c", _DELETE_RESUMED], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["True", "True", "True"], child.stdout


_WALK_RESUMED = _OUTLIVED + r"""
from kvtier.backends.file_tree import FileTree
entered, go = threading.Event(), threading.Event()
real = FileTree._leaf_at
def held(*args, **kwargs):  # the walk to the job's first record's directory, held past the close's wait
    if not entered.is_set():
        entered.set()
        go.wait()
    return real(*args, **kwargs)
FileTree._leaf_at = staticmethod(held)
""" + _WRITE_HELD


def test_a_write_whose_walk_outlives_the_closes_wait_plants_no_record() -> None:
    """A write stuck in the walk to its record's directory (by the root's path) past the
    close's wait is checked again once the directory is reached: the path may lead to a store
    opened since, which must not get a record it does not know of (child process)."""
    child = subprocess.run([sys.executable, "-c", _WALK_RESUMED], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["True", "True"], child.stdout


_RECORD_RESUMED = _OUTLIVED + r"""
first.write_blocks(keys[:1], [random_block(16384, 1)])
entered, go = threading.Event(), threading.Event()
real = first._leaf
def held(k):  # the walk to the job's only record, held past the close's wait (a slow filesystem)
    entered.set()
    go.wait()
    return real(k)
first._leaf = held
first._plain = None
out = [torch.zeros(16384, dtype=torch.uint8)]
got = []
reader = threading.Thread(target=lambda: got.append(first.read_blocks(keys[:1], out)))
reader.start()
entered.wait()
asyncio.run(first.aclose())  # gives up waiting for the read, the root's descriptor left open
shutil.rmtree(root)
second = opened()
theirs = random_block(16384, 2)
second.write_blocks(keys[:1], [theirs])  # the same key, in the store opened since
go.set()
reader.join()
print(got[0][0], torch.equal(out[0], theirs))
asyncio.run(second.aclose())
"""


def test_the_record_a_read_was_on_when_the_close_gave_up_is_not_another_stores() -> None:
    """A read stuck in the walk to its record (by the root's path) past the close's wait is
    checked again once the record is open: the path may lead to a store opened since, whose
    record must not come back as the closed store's hit (child process)."""
    child = subprocess.run([sys.executable, "-c", _RECORD_RESUMED], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["False", "False"], child.stdout


_TOUCH_BY_PATH = _PRELUDE + r"""
first = opened()
key = make_key(0)
first.write_blocks([key], [random_block(16384, 1)])
entered, go = threading.Event(), threading.Event()
real = first._leaf
def held(k):  # the walk to the record's directory, held until the close is done
    entered.set()
    go.wait()
    return real(k)
first._leaf = held
toucher = threading.Thread(target=lambda: first.touch_stamps([(key, 1000.0)]))
toucher.start()
entered.wait()
asyncio.run(first.aclose())
second = opened()  # the same store, opened again at its path
second.write_blocks([key], [random_block(16384, 2)])
go.set()
toucher.join()
h = key.hex()
print(os.stat(f"{tmp}/root/{h[0:2]}/{h[2:4]}/{h}.kvb").st_mtime != 1000.0)
asyncio.run(second.aclose())
"""


def test_a_stamp_under_way_across_the_close_is_not_set_on_a_store_opened_since() -> None:
    """``touch_stamps`` reaches each record's directory by the root's path: once the close has
    begun, the stamp is not set there, where a store opened since may be (child process)."""
    child = subprocess.run([sys.executable, "-c", _TOUCH_BY_PATH], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["True"], child.stdout
