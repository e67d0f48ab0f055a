"""The ``lmdb`` and ``file`` tiers given a job's rows as one pool (:class:`PoolRows`): the pool is
checked once a job and each row found by its address, with the same bytes, found flags, sizes,
errors and counters as the same rows given as a list of views, in the native forms (the pool's
checks in C: ``kvtier/records/_hostrow.h``) and in the Python ones alike; and never a byte read
or written past the pool as it is when the job runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import file_tier, lmdb_lone, lmdb_one, lmdb_plain

from kvtier import registry
from kvtier.backend import Backend, BlockFormat
from kvtier.keys import KEY_BYTES
from kvtier.pool_rows import PoolRows
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block

SIZE = 4096
FMT = BlockFormat(block_bytes=SIZE, dtype="uint8")
_STATS = ("blocks_read", "bytes_read", "read_misses", "blocks_written", "bytes_written", "write_failures", "corrupt_records", "deleted")
_NATIVE = lmdb_plain.NATIVE_GUARD and xxcopy.xxh3_read_job is not None


@pytest.fixture(params=["native", "python", "general"])
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test with the tiers' row checks in their native form, in their Python form (a build
    without the extensions), and on the general path (no straight reads or saves)."""
    if request.param == "native" and not _NATIVE:
        pytest.skip("built without the native row checks")
    if request.param == "python":
        monkeypatch.setattr(lmdb_plain, "host_view", lmdb_plain.host_view_python)
        monkeypatch.setattr(lmdb_plain, "job_views", lmdb_plain.job_views_python)
        monkeypatch.setattr(lmdb_plain, "same_size", lmdb_plain.same_size_python)
        monkeypatch.setattr(lmdb_plain, "one_row", lmdb_plain.one_row_python)
        for name in ("one_read", "job_read", "straight_read"):
            monkeypatch.setattr(lmdb_plain, name, None)
        monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
        monkeypatch.setattr(xxcopy, "xxh3_read_rows", None)
    if request.param == "general":
        monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", False)
        monkeypatch.setattr(lmdb_lone, "LONE_SAVES", False)
        monkeypatch.setattr(file_tier, "PLAIN_READS", False)
    return str(request.param)


def _open(path: Path, tier: str) -> Backend:
    more: dict[str, Any] = {"layout": "flat"} if tier == "file" else {}
    backend = registry.backends.get(tier)(capacity=64 << 20, path=str(path), sync_mode="fast", **more)
    asyncio.run(backend.open(FMT))
    return backend


def _saved(backend: Backend, job: int) -> tuple[list[bytes], torch.Tensor]:
    """Records saved for the keys of a job of ``job``: the keys and their blocks."""
    keys, src = [make_key(i) for i in range(job)], _blocks(job)
    backend.write_blocks(keys, list(src))
    return keys, src


@contextlib.contextmanager
def _opened(path: Path, tier: str) -> Iterator[Backend]:
    backend = _open(path, tier)
    try:
        yield backend
    finally:
        asyncio.run(backend.aclose())


def _rounds(call: Callable[[list[bytes], Any], Any], numbers: Any, pool: torch.Tensor, as_list: bool, each: Callable[[], Any]) -> list[Any]:
    """The job of len(numbers) keys on the pool's rows three times (the first takes the general
    path, which keeps the rows' views; the next the straight ones), the rows as PoolRows or as a
    list of views: each round's outcome (or error) and what ``each()`` says after it."""
    keys = [make_key(i) for i in range(len(numbers))]
    got = []
    for _ in range(3):
        rows = PoolRows(pool, numbers)
        got.append((_outcome(lambda rows=rows: call(keys, _as_list(rows) if as_list else rows)), each()))  # type: ignore[misc]
    return got


def _stats(backend: Backend) -> dict[str, int]:
    return {name: getattr(backend.counters, name) for name in _STATS}


def _as_list(rows: PoolRows) -> list[torch.Tensor]:
    return [rows.pool[n] for n in rows.numbers]


def _blocks(count: int) -> torch.Tensor:
    return torch.stack([random_block(SIZE, 50 + i, torch.uint8) for i in range(count)])


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # (the same error either way, by type and message)
        return (type(exc).__name__, str(exc))


#: Row numbers of a pool of 12 rows: a range, one cut short of the pool's end, a tuple, a
#: reversed range, repeated rows, one row, none.
_NUMBERS: dict[str, Any] = {
    "range": range(8),
    "range from 2": range(2, 10),
    "tuple": (5, 0, 3, 7, 11),
    "reversed": range(11, 3, -1),
    "repeated": (2, 2, 5, 2),
    "one": (9,),
    "empty": range(0),
}


def _read_rounds(tmp_path: Path, tier: str, numbers: Any, as_list: bool, pool_of: Callable[[], torch.Tensor] = lambda: torch.zeros(12, SIZE, dtype=torch.uint8)) -> Any:
    """Records saved for keys 0..5 (keys 6.. are misses); then the job of len(numbers) keys read
    three times into the pool's rows (the first takes the general path, which keeps the rows'
    views; the next the straight ones): each round's flags and the pool's bytes, and the counters."""
    with _opened(tmp_path / ("list" if as_list else "pool"), tier) as backend:
        backend.write_blocks([make_key(i) for i in range(6)], list(_blocks(6)))
        pool = pool_of()

        def read(keys: list[bytes], rows: Any) -> Any:
            pool.zero_()
            return backend.read_blocks(keys, rows)

        return _rounds(read, numbers, pool, as_list, pool.clone), _stats(backend)


@pytest.mark.parametrize("tier", ["lmdb", "file"])
@pytest.mark.parametrize("which", list(_NUMBERS))
def test_reads_into_pool_rows_answer_as_into_a_list_of_views(tmp_path: Path, tier: str, which: str, form: str) -> None:
    numbers = _NUMBERS[which]
    by_pool = _read_rounds(tmp_path, tier, numbers, as_list=False)
    by_list = _read_rounds(tmp_path, tier, numbers, as_list=True)
    (rounds, stats), (list_rounds, list_stats) = by_pool, by_list
    assert stats == list_stats
    for (found, pool), (list_found, list_pool) in zip(rounds, list_rounds, strict=True):
        assert found == list_found
        assert torch.equal(pool, list_pool)
    found, pool = rounds[-1]
    assert found == [i < 6 for i in range(len(numbers))]
    src = _blocks(6)
    last = {n: i for i, n in enumerate(numbers)}  # (a repeated row holds the last key read into it)
    for n in range(12):
        want = src[last[n]] if n in last and last[n] < 6 else torch.zeros(SIZE, dtype=torch.uint8)
        assert torch.equal(pool[n], want), n


def _save_rounds(tmp_path: Path, tier: str, numbers: Any, as_list: bool, src: torch.Tensor | None = None) -> Any:
    """The job of len(numbers) keys saved from the pool's rows three times (the first takes the
    general path, which keeps the rows' views); each round's sizes, then each key's record read
    back into a row of its own, and the counters."""
    with _opened(tmp_path / ("list" if as_list else "pool"), tier) as backend:
        sizes = [size for size, _ in _rounds(backend.write_blocks, numbers, _blocks(12) if src is None else src, as_list, lambda: None)]
        keys = [make_key(i) for i in range(len(numbers))]
        back = [torch.zeros(SIZE, dtype=torch.uint8) for _ in keys]
        found = [backend.read_blocks([key], [row])[0] for key, row in zip(keys, back)]
        return sizes, found, back, _stats(backend)


@pytest.mark.parametrize("tier", ["lmdb", "file"])
@pytest.mark.parametrize("which", list(_NUMBERS))
def test_saves_from_pool_rows_answer_as_from_a_list_of_views(tmp_path: Path, tier: str, which: str, form: str) -> None:
    numbers = _NUMBERS[which]
    sizes, found, back, stats = _save_rounds(tmp_path, tier, numbers, as_list=False)
    list_sizes, list_found, list_back, list_stats = _save_rounds(tmp_path, tier, numbers, as_list=True)
    assert (sizes, found, stats) == (list_sizes, list_found, list_stats)
    assert all(torch.equal(a, b) for a, b in zip(back, list_back, strict=True))
    pool = _blocks(12)
    assert all(size is not None for size in sizes[-1]) and found == [True] * len(numbers)
    assert all(torch.equal(row, pool[n]) for row, n in zip(back, numbers, strict=True))


def _other_pools() -> dict[str, Callable[[], torch.Tensor]]:
    """Pools the pool's checks do not take: their rows are checked one by one."""
    wide = torch.zeros(12, 2 * SIZE, dtype=torch.uint8)
    return {
        "non-contiguous, rows contiguous": lambda: wide[:, SIZE:],
        "every other row": lambda: torch.zeros(24, SIZE, dtype=torch.uint8)[::2],
        "int8": lambda: torch.zeros(12, SIZE, dtype=torch.int8),
        "rows too long": lambda: torch.zeros(12, SIZE + 1, dtype=torch.uint8),
        "a subclass": lambda: torch.zeros(12, SIZE, dtype=torch.uint8).as_subclass(_Sub),
    }


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("tier", ["lmdb", "file"])
@pytest.mark.parametrize("which", list(_other_pools()))
def test_reads_into_other_pools_answer_as_their_rows_one_by_one(tmp_path: Path, tier: str, which: str, form: str) -> None:
    numbers = (3, 0, 7)
    rounds, stats = _read_rounds(tmp_path, tier, numbers, as_list=False, pool_of=_other_pools()[which])
    list_rounds, list_stats = _read_rounds(tmp_path, tier, numbers, as_list=True, pool_of=_other_pools()[which])
    assert stats == list_stats
    for (found, pool), (list_found, list_pool) in zip(rounds, list_rounds, strict=True):
        assert found == list_found
        assert torch.equal(pool, list_pool)
    if which in ("int8", "rows too long"):
        assert rounds[-1][0][0] == "LayoutError"  # refused by name, as rows of a list
    else:
        assert rounds[-1][0] == [True, True, True]


@pytest.mark.parametrize("tier", ["lmdb", "file"])
@pytest.mark.parametrize("job", [1, 4])
def test_a_pool_cut_short_after_its_rows_were_named_is_never_read_or_written_past(tmp_path: Path, tier: str, job: int, form: str) -> None:
    """The pool shrunk (``resize_``) after the PoolRows was made, its rows' views kept: a row
    number past its end now is not a row. The job fails by name (the rows' IndexError) and
    touches nothing past the pool: not the memory past its end (still its storage's), not a
    record, not a counter."""
    with _opened(tmp_path / "t", tier) as backend:
        keys, src = _saved(backend, job)
        pool = torch.zeros(8, SIZE, dtype=torch.uint8)
        numbers = (7,) if job == 1 else (1, 2, 7, 3)
        rows = PoolRows(pool, numbers)
        for _ in range(3):  # (the rows' views kept: the straight paths take the next job)
            assert backend.read_blocks(keys, rows) == [True] * job
            backend.write_blocks(keys, rows)
        storage = pool.untyped_storage()
        pool.resize_(6, SIZE)  # (the storage keeps its bytes: rows 6 and 7 are past the pool now)
        whole = torch.empty(0, dtype=torch.uint8).set_(storage).view(8, SIZE)
        whole[6:].fill_(0x5A)
        stats = _stats(backend)
        with pytest.raises(IndexError, match="out of bounds"):
            backend.read_blocks(keys, rows)
        assert bool((whole[6:] == 0x5A).all())  # nothing read past the pool
        assert _stats(backend) == stats
        with pytest.raises(IndexError, match="out of bounds"):
            backend.write_blocks(keys, rows)
        assert _stats(backend) == stats
        out = [torch.zeros(SIZE, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * job
        assert all(torch.equal(out[i], src[i]) for i in range(job) if numbers[i] != 7)
        assert not any(bool((row == 0x5A).all()) for row in out)  # the bytes past the pool never saved


@pytest.mark.parametrize("tier", ["lmdb", "file"])
@pytest.mark.parametrize("job", [1, 4])
def test_a_pool_moved_by_set_is_read_and_saved_where_it_is_now(tmp_path: Path, tier: str, job: int, form: str) -> None:
    """``pool.set_(other)`` after the PoolRows was made and its rows' views kept: the job reads
    into, and saves from, the pool's new memory, never its old."""
    with _opened(tmp_path / "t", tier) as backend:
        keys, src = _saved(backend, job)
        pool = torch.zeros(8, SIZE, dtype=torch.uint8)
        old = pool.view(-1)  # holds the old memory
        rows = PoolRows(pool, range(2, 2 + job))
        for _ in range(3):
            assert backend.read_blocks(keys, rows) == [True] * job
        old.zero_()
        moved = torch.zeros(8, SIZE, dtype=torch.uint8)
        pool.set_(moved)
        assert backend.read_blocks(keys, rows) == [True] * job
        assert torch.equal(moved[2 : 2 + job], src) and not bool(old.any())
        fresh = _blocks(12)[6 : 6 + job]
        moved[2 : 2 + job].copy_(fresh)
        old.fill_(7)
        assert all(size is not None for size in backend.write_blocks(keys, rows))
        out = [torch.zeros(SIZE, dtype=torch.uint8) for _ in keys]
        assert backend.read_blocks(keys, out) == [True] * job
        assert all(torch.equal(o, f) for o, f in zip(out, fresh, strict=True))


@pytest.mark.parametrize("tier", ["lmdb", "file"])
@pytest.mark.parametrize(("job", "way"), [(1, "native"), (16, "native"), (16, "python")])
def test_warm_jobs_of_pool_rows_make_no_view_of_a_row(tmp_path: Path, tier: str, job: int, way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the rows' views are kept, a job of pool rows is read and saved without a view of a
    row made (the pool's checks once, each row by its address), natively, and by the Python
    forms of a job of several (a build without the extensions; the lmdb tier's read of a job
    after its data file grew): PoolRows is never iterated nor indexed."""
    if way == "native" and not _NATIVE:
        pytest.skip("built without the native row checks")
    if way == "python":
        for name in ("one_read", "job_read", "straight_read"):
            monkeypatch.setattr(lmdb_plain, name, None)
        monkeypatch.setattr(lmdb_plain, "job_views", lmdb_plain.job_views_python)
        monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
        monkeypatch.setattr(xxcopy, "xxh3_read_rows", None)
    backend = _open(tmp_path / "t", tier)
    try:
        keys = [make_key(i) for i in range(job)]
        pool = _blocks(job + 2)
        rows = PoolRows(pool, range(1, 1 + job))
        for _ in range(3):  # (the rows' views kept, the thread's first straight read marked)
            backend.write_blocks(keys, rows)
            backend.read_blocks(keys, rows)
        made: list[str] = []
        monkeypatch.setattr(PoolRows, "__iter__", lambda self: made.append("iter") or iter(_as_list(self)))
        monkeypatch.setattr(PoolRows, "__getitem__", lambda self, i: made.append("item") or _as_list(self)[i])
        for _ in range(2):
            assert all(size is not None for size in backend.write_blocks(keys, rows))
            pool.zero_()
            assert backend.read_blocks(keys, rows) == [True] * job
        assert made == []
        assert torch.equal(pool[1 : 1 + job], _blocks(job + 2)[1 : 1 + job])
    finally:
        asyncio.run(backend.aclose())


def _job_views_cases() -> dict[str, Callable[[torch.Tensor], Any]]:
    def shrunk(pool: torch.Tensor) -> PoolRows:
        rows = PoolRows(pool, (1, 5, 7))
        pool.resize_(6, SIZE)
        return rows

    def moved(pool: torch.Tensor) -> PoolRows:
        rows = PoolRows(pool, range(3))
        pool.set_(torch.zeros(8, SIZE, dtype=torch.uint8))
        return rows

    def numbers_changed(pool: torch.Tensor) -> PoolRows:
        rows = PoolRows(pool, range(3))
        rows.numbers = [0, 1, 2]  # type: ignore[assignment]  (a list: its rows one by one)
        return rows

    return {
        "range": lambda pool: PoolRows(pool, range(3)),
        "reversed": lambda pool: PoolRows(pool, range(7, 4, -1)),
        "tuple": lambda pool: PoolRows(pool, (6, 0, 6)),
        "shrunk": shrunk,
        "moved": moved,
        "numbers changed": numbers_changed,
        "non-contiguous": lambda pool: PoolRows(torch.zeros(8, 2 * SIZE, dtype=torch.uint8)[:, :SIZE], range(3)),
        "int8": lambda pool: PoolRows(pool.view(torch.int8), range(3)),
        "a subclass": lambda pool: PoolRows(pool.as_subclass(_Sub), range(3)),
        "count differs": lambda pool: PoolRows(pool, range(2)),
    }


@pytest.mark.parametrize("pool_type", ["Tensor", "a subclass", "a subclass with a __torch_function__ of its own"])
def test_python_in_torch_asks_a_pools_type_once_as_of_each_of_its_rows(pool_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = torch.zeros(4, SIZE, dtype=torch.uint8)
    if pool_type != "Tensor":
        pool = pool.as_subclass(_Sub if pool_type == "a subclass" else _Hooked)
    rows = PoolRows(pool, range(4))
    one_by_one = lmdb_plain.python_in_torch(list(rows))
    monkeypatch.setattr(PoolRows, "__iter__", lambda self: pytest.fail("iterated"))
    assert lmdb_plain.python_in_torch(rows) is one_by_one is (pool_type == "a subclass with a __torch_function__ of its own")


class _Hooked(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("which", list(_job_views_cases()))
def test_job_views_of_pool_rows_answer_as_of_their_rows_one_by_one(which: str) -> None:
    """``job_views`` (the lmdb tier's save and its reads' loop) and ``pool_addresses``'s Python
    loop given rows of one pool answer as given the same rows as a list of views: the same view
    objects, or ``None``; a row past the pool now has none."""
    pool = torch.zeros(8, SIZE, dtype=torch.uint8)
    views = lmdb_plain.RowViews(SIZE)
    views.of([bytes(KEY_BYTES)] * 8, list(pool))  # every row of the pool seen
    rows = _job_views_cases()[which](pool)
    keys = [bytes(KEY_BYTES)] * 3
    forms = [lmdb_plain.job_views_python] + ([lmdb_plain._rowguard.job_views] if lmdb_plain.NATIVE_GUARD else [])  # type: ignore[union-attr]
    args = (torch.Tensor, torch.uint8, views.shape, views.views, KEY_BYTES)
    for job_views in forms:
        got = job_views(keys, rows, *args)
        if which == "shrunk":
            assert got is None
            continue
        one_by_one = job_views(keys, list(rows), *args)
        assert (got is None) == (one_by_one is None), job_views
        if got is not None:
            assert all(a is b for a, b in zip(got, one_by_one, strict=True))
    expect_views = which in ("range", "reversed", "tuple", "numbers changed")  # (the others: rows not seen, or not such)
    assert (forms[-1](keys, rows, *args) is not None) == expect_views


_POOL_VIEWS = {  # what pool_views answers for each case: its rows' views, None, or NotImplemented (their rows one by one)
    "range": "views", "reversed": "views", "tuple": "views", "moved": "views", "shrunk": None, "numbers changed": NotImplemented,
    "non-contiguous": NotImplemented, "int8": NotImplemented, "a subclass": NotImplemented, "count differs": None,
    "a bad key": None, "not made": "views if seen", "not a pool": NotImplemented,
}


@pytest.mark.skipif(not lmdb_plain.NATIVE_GUARD, reason="built without the native row checks")
@pytest.mark.parametrize("seen", [True, False])
@pytest.mark.parametrize("which", list(_POOL_VIEWS))
def test_pool_views_answer_alike_native_and_in_python(which: str, seen: bool) -> None:
    """``pool_views`` (``RowViews.of``'s one native call for rows of one pool, seen before or
    not) and its Python form: the same views (by the rows they view) or answer (``None``,
    ``NotImplemented``), the views of rows not seen yet made alike (``unseen_at``, asked with
    the same addresses in the same order), the same views kept."""
    outcomes = []
    for pool_views in (lmdb_plain._rowguard.pool_views, lmdb_plain.pool_views_python):  # type: ignore[union-attr]
        pool = torch.zeros(8, SIZE, dtype=torch.uint8)
        kept: dict[int, memoryview] = {}
        rows: Any = list(pool) if which == "not a pool" else _job_views_cases()["range" if which in ("a bad key", "not made") else which](pool)
        base = pool.data_ptr()
        if seen:  # its rows' views kept before
            kept.update((base + n * SIZE, memoryview(bytearray(SIZE))) for n in range(8))
        keys: list[Any] = [bytes(KEY_BYTES), b"short" if which == "a bad key" else bytes(KEY_BYTES), bytes(KEY_BYTES)]
        asked: list[int] = []

        def made(at: int, asked: list[int] = asked, base: int = base, kept: dict[int, memoryview] = kept) -> memoryview | None:
            asked.append((at - base) // SIZE)
            return None if which == "not made" else kept.setdefault(at, memoryview(bytearray(SIZE)))

        got = pool_views(keys, rows, torch.Tensor, torch.uint8, torch.Size([SIZE]), kept, KEY_BYTES, made)
        rows_viewed = {id(view): (at - base) // SIZE for at, view in kept.items()}
        answer = got if got is None or got is NotImplemented else [rows_viewed[id(view)] for view in got]
        outcomes.append((answer, asked, sorted(rows_viewed.values())))
    assert outcomes[0] == outcomes[1]
    expected = _POOL_VIEWS[which]
    if expected == "views if seen":
        expected = "views" if seen else None
    answer = outcomes[0][0]
    assert answer == expected if expected != "views" else isinstance(answer, list) and len(answer) == 3
    # the rows not seen yet whose views were made, up to the first refused key or row
    made_for = {"range": [0, 1, 2], "reversed": [7, 6, 5], "tuple": [6, 0], "moved": [0, 1, 2], "not made": [0], "shrunk": [1, 5], "a bad key": [0]}
    assert outcomes[0][1] == ([] if seen else made_for.get(which, []))


@pytest.mark.parametrize("which", list(_job_views_cases()))
def test_row_views_of_pool_rows_answer_as_of_their_rows_one_by_one(which: str) -> None:
    """``RowViews.of`` (a job's checks and views, the rows not seen yet viewed) given rows of one
    pool: the same views, by the same addresses, as given the same rows as a list."""
    pool = torch.zeros(8, SIZE, dtype=torch.uint8)
    views = lmdb_plain.RowViews(SIZE)
    rows = _job_views_cases()[which](pool)
    keys = [bytes(KEY_BYTES)] * 3
    if which == "shrunk":
        assert views.of(keys, rows) is None  # (row 7 is past the pool: no view of it)
        with pytest.raises(IndexError):
            views.of(keys, list(rows))
        return
    got = views.of(keys, rows)
    one_by_one = views.of(keys, list(rows))
    assert (got is None) == (one_by_one is None)
    if got is not None:
        assert all(a is b for a, b in zip(got, one_by_one, strict=True))
        assert [bytes(a) == bytes(SIZE) for a in got] == [True] * 3


@pytest.mark.skipif(xxcopy.xxh3_read_rows is None, reason="built without the native job read")
@pytest.mark.parametrize("which", list(_job_views_cases()))
def test_the_file_tiers_native_rows_read_takes_pool_rows_as_their_rows_one_by_one(tmp_path: Path, which: str) -> None:
    """``xxh3_read_rows`` (the file tier's job read, its rows' checks in C) given rows of one
    pool: the same found flags and bytes as given the same rows as a list, or ``None`` alike."""
    backend = _open(tmp_path / "t", "file")
    try:
        keys = [make_key(i) for i in range(3)]
        src = _blocks(3)
        backend.write_blocks(keys, list(src))
        plain = backend._plain  # type: ignore[attr-defined]
        read = xxcopy.xxh3_read_rows
        assert read is not None
        outcomes = []
        # Every pool's memory, before and after its case changed it, lives to the end: rows seen
        # in the first round stay where no tensor of the second (a moved pool's new memory) can
        # land, so neither round finds its rows seen by chance of where a fresh tensor lands.
        held: list[torch.Tensor] = []
        for as_list in (False, True):
            pool = torch.zeros(8, SIZE, dtype=torch.uint8)
            lmdb_plain.RowViews(SIZE).of([bytes(KEY_BYTES)] * 8, list(pool))  # every row seen
            held.append(pool.view(-1))
            rows = _job_views_cases()[which](pool)
            held.append(pool)
            job: Any = list(rows) if as_list and which != "shrunk" else rows
            found = [False] * 3
            root = plain.root
            rest = read(root.under_way, root.dir_at, plain.checksum.head, keys, job, plain._kind, plain.piece, found)
            outcomes.append((rest, found, [bytes(r.numpy()) for r in (_as_list(rows) if which != "shrunk" else [])]))
        if which == "shrunk":
            assert outcomes[0][0] is None and outcomes[0][1] == [False] * 3
        else:
            assert outcomes[0] == outcomes[1]
    finally:
        asyncio.run(backend.aclose())


_MOVED = r"""
import asyncio, sys, tempfile, torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.pool_rows import PoolRows
from kvtier.records import xxcopy
from kvtier.testing import make_key, random_block
job = int(sys.argv[1])
if sys.argv[2] == "python":
    from kvtier.backends import lmdb_plain
    lmdb_plain.straight_read = lmdb_plain.job_read = lmdb_plain.one_read = None
b = registry.backends.get("lmdb")(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast")
asyncio.run(b.open(BlockFormat(block_bytes=4096, dtype="uint8")))
keys = [make_key(i) for i in range(job)]
b.write_blocks(keys, [random_block(4096, i, torch.uint8) for i in range(job)])
pool = torch.zeros(16384, 4096, dtype=torch.uint8)  # 64 MiB: its memory mapped alone, unmapped when freed
if sys.argv[3] == "every other row":  # rows contiguous, the pool not: its rows checked one by one
    pool = torch.empty(0, dtype=torch.uint8).set_(torch.zeros(2 * 16384 * 4096, dtype=torch.uint8).untyped_storage(), 0, (16384, 4096), (8192, 1))
    assert not pool.is_contiguous() and pool._base is None  # (nothing else holds its memory)
rows = PoolRows(pool, range(16384 - job, 16384))
for _ in range(3):
    assert b.read_blocks(keys, rows) == [True] * job
real = xxcopy.xxh3_check_copy
moved = []
def check(*args):
    if not moved:  # the pool moved (its old memory's last holder let go) once its rows' views are taken
        moved.append(pool.set_(torch.zeros(16384, 4096, dtype=torch.uint8)))  # (its rows still rows: a later key's copy sees the move)
    return real(*args)
xxcopy.xxh3_check_copy = check
got = b.read_blocks(keys, rows)
print(len(moved), got)
"""


@pytest.mark.parametrize("pool", ["contiguous", "every other row"])
@pytest.mark.parametrize("way", ["native", "python"])
@pytest.mark.parametrize("job", [1, 4])
def test_a_pool_moved_while_its_job_copies_leaves_its_memory_to_the_job(job: int, way: str, pool: str) -> None:
    """The straight read holds the pool's memory (its storage, or the views of its rows where
    they are checked one by one) from the pool's checks to the last copy: a pool moved in
    between (here by the record check's caller, where another thread could while a copy lets
    the GIL go) leaves its old memory to the job, which then copies into memory still its own
    (freed, it was unmapped under the copy: a crash)."""
    if way == "native" and not _NATIVE:
        pytest.skip("built without the native row checks")
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _MOVED, str(job), way, pool], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split()[0] == "1"  # the pool moved during the job
