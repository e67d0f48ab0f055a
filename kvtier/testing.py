"""A conformance suite for backends, for kvtier's own and for plugin authors.

Subclass :class:`BackendTests` in a pytest module and implement ``make_backend``::

    from kvtier.testing import BackendTests

    class TestMyBackend(BackendTests):
        def make_backend(self, path, capacity):
            return MyBackend(capacity=capacity, path=str(path / "store"))

Every test opens the backend with a small :class:`~kvtier.backend.BlockFormat`, drives it through
the protocol and asserts the contract in :mod:`kvtier.backend`. Set ``persistent = True`` (taken
from the backend class by default) to also check that a reopened backend serves what an earlier
instance stored. A backend whose class sets ``takes_pool_rows`` is also written and read through
:class:`~kvtier.pool_rows.PoolRows` (``test_pool_rows_if_the_backend_takes_them``). A failure says which call broke which promise, with what it returned (for
example ``read_blocks([written key, never-written key]) returned [True, True]; a missing key is
False, not an exception``), never a bare ``AssertionError``.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import mmap
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from kvtier.backend import Backend, BlockFormat
from kvtier.errors import ClosedError, ConfigError, LayoutError
from kvtier.pool_rows import PoolRows

__all__ = ["BackendTests", "cached_pages", "evict_from_page_cache", "make_key", "mapping_flags", "random_block"]


def make_key(i: int) -> bytes:
    """A deterministic 32-byte key for tests."""
    return hashlib.sha256(b"kvtier-test-key" + i.to_bytes(8, "little")).digest()


def evict_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Write ``path`` back and drop its pages from the page cache (``POSIX_FADV_DONTNEED``; a
    page mapped by a live process stays). Check with :func:`cached_pages`: some filesystems
    (tmpfs) keep everything."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mapping_flags(address: int) -> list[str] | None:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (``hg``: advised huge
    pages); ``None`` where ``/proc/self/smaps`` cannot be read or no mapping holds it."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def cached_pages(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(pages of the file at path in the page cache, pages of the file)``, by ``mincore``
    (Linux; ``OSError`` where it fails)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    if not size:
        return 0, 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), size, vec)
        del view  # the map cannot close while a view exports it
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"mincore of {os.fspath(path)!r} failed")
    return sum(v & 1 for v in vec), pages


def random_block(nbytes: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A 1-D uint8 block whose bytes look like KV activations of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point and itemsize >= 2:
        values = (torch.randn(nbytes // itemsize, generator=g) * 0.5).to(dtype)
        return values.view(torch.uint8).clone()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class BackendTests:
    """The protocol every backend must honour. Subclasses implement :meth:`make_backend`."""

    block_bytes: int = 4096
    capacity_blocks: int = 32
    dtype: str = "bfloat16"
    #: ``None``: take ``persistent`` from the backend class.
    persistent: bool | None = None

    def make_backend(self, path: Path, capacity: int) -> Backend:
        raise NotImplementedError("subclasses of BackendTests implement make_backend")

    # -- helpers ---------------------------------------------------------------------------
    def block_format(self) -> BlockFormat:
        return BlockFormat(
            block_bytes=self.block_bytes,
            dtype=self.dtype,
            namespace_digest=hashlib.sha256(b"kvtier-conformance").digest(),
            namespace={"model_id": "conformance"},
        )

    @contextmanager
    def opened(self, path: Path, capacity: int | None = None) -> Iterator[Backend]:
        cap = capacity if capacity is not None else self.block_bytes * self.capacity_blocks
        backend = self.make_backend(path, cap)
        asyncio.run(backend.open(self.block_format()))
        try:
            yield backend
        finally:
            asyncio.run(backend.aclose())

    def blocks(self, n: int, seed: int = 0) -> list[torch.Tensor]:
        return [random_block(self.block_bytes, seed * 100003 + i) for i in range(n)]

    def empty(self, n: int) -> list[torch.Tensor]:
        return [torch.zeros(self.block_bytes, dtype=torch.uint8) for _ in range(n)]

    # -- the contract ----------------------------------------------------------------------
    # Every assertion says what the backend did wrong, in terms of the protocol in kvtier.backend.
    def test_constructor_does_no_io(self, tmp_path: Path) -> None:
        before = sorted(p.name for p in tmp_path.iterdir())
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        assert not backend.is_open, "a new backend must not be open before `await open(fmt)`"
        after = sorted(p.name for p in tmp_path.iterdir())
        assert after == before, f"the constructor created {sorted(set(after) - set(before))}: constructors do no I/O"

    def test_round_trip_is_byte_exact(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            keys = [make_key(i) for i in range(8)]
            data = self.blocks(8)
            sizes = _checked_sizes(backend.write_blocks(keys, data), 8)
            assert all(s is not None for s in sizes), (
                f"write_blocks of 8 blocks into an empty backend with room for {self.capacity_blocks} returned {sizes}"
            )
            out = self.empty(8)
            found = _checked_found(backend.read_blocks(keys, out), 8)
            assert found == [True] * 8, f"read_blocks of 8 keys just written returned {found}"
            for i, (got, want) in enumerate(zip(out, data)):
                _assert_same_bytes(got, want, f"block {i} read back")

    def test_read_in_other_order_and_subset(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            keys = [make_key(i) for i in range(6)]
            data = self.blocks(6, seed=3)
            backend.write_blocks(keys, data)
            order = [4, 0, 5]
            out = self.empty(3)
            found = _checked_found(backend.read_blocks([keys[i] for i in order], out), 3)
            assert found == [True] * 3, f"read_blocks of 3 of 6 written keys, in another order, returned {found}"
            for got, i in zip(out, order):
                _assert_same_bytes(got, data[i], f"block {i} read in the order {order} (out[i] must match keys[i])")

    def test_missing_key_is_a_miss(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            backend.write_blocks([make_key(1)], self.blocks(1))
            out = self.empty(2)
            sentinel = out[1].clone()
            found = _checked_found(backend.read_blocks([make_key(1), make_key(2)], out), 2)
            assert found == [True, False], (
                f"read_blocks([written key, never-written key]) returned {found}; a missing key is False, not an exception"
            )
            _assert_same_bytes(out[1], sentinel, "the out row of a missing key (a miss must not write into it)")

    def test_delete_makes_a_miss_and_keeps_others(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            keys = [make_key(i) for i in range(3)]
            data = self.blocks(3, seed=5)
            backend.write_blocks(keys, data)
            backend.delete_blocks([keys[1], make_key(99)])
            out = self.empty(3)
            found = _checked_found(backend.read_blocks(keys, out), 3)
            assert found == [True, False, True], (
                f"after delete_blocks([keys[1], a never-written key]), read_blocks(keys[0:3]) returned {found}; "
                "expected only keys[1] to be gone (absent keys are ignored by delete)"
            )
            _assert_same_bytes(out[0], data[0], "block 0 after deleting block 1")
            _assert_same_bytes(out[2], data[2], "block 2 after deleting block 1")

    def test_stored_keys_lists_what_is_stored_oldest_first(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            keys = [make_key(i) for i in range(4)]
            backend.write_blocks(keys[:2], self.blocks(2))
            backend.write_blocks(keys[2:], self.blocks(2, seed=1))
            backend.delete_blocks([keys[1]])
            listed = backend.stored_keys()
            if listed is None:
                _skip("backend does not list its keys")
            assert listed == [keys[0], keys[2], keys[3]], (
                "stored_keys() after writing keys 0-3 and deleting key 1 must list keys 0, 2, 3 in the order "
                f"they were written; got {[k.hex()[:8] for k in listed]}"
            )

    def test_rewrite_after_delete_serves_new_bytes(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            key = make_key(7)
            first, second = self.blocks(2, seed=9)
            backend.write_blocks([key], [first])
            backend.delete_blocks([key])
            backend.write_blocks([key], [second])
            out = self.empty(1)
            found = _checked_found(backend.read_blocks([key], out), 1)
            assert found == [True], f"a key written, deleted and written again reads as {found}"
            _assert_same_bytes(out[0], second, "a key rewritten after a delete (the old bytes were served)")

    def test_wrong_block_shape_is_rejected_before_any_write(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            good = self.blocks(1)[0]
            bad = torch.zeros(self.block_bytes + 1, dtype=torch.uint8)
            with _must_raise(LayoutError, f"write_blocks with a block of {self.block_bytes + 1} bytes (one too many)"):
                backend.write_blocks([make_key(1), make_key(2)], [good, bad])
            found = backend.read_blocks([make_key(1)], self.empty(1))
            assert found == [False], (
                f"the good block of a rejected write_blocks call was stored (read_blocks returned {found}); "
                "check every block before writing any"
            )

    def test_counters_track_io(self, tmp_path: Path) -> None:
        with self.opened(tmp_path) as backend:
            keys = [make_key(i) for i in range(3)]
            backend.write_blocks(keys, self.blocks(3))
            backend.read_blocks(keys[:2], self.empty(2))
            stats = backend.stats()
            for name, want in (("blocks_written", 3), ("blocks_read", 2)):
                assert name in stats, f"stats() has no {name!r}; keep super().stats() (BackendCounters) in it"
                assert stats[name] == want, (
                    f"stats()[{name!r}] is {stats[name]} after writing 3 blocks and reading 2; "
                    f"count each block in self.counters.{name}"
                )

    def test_capacity_below_one_block_is_a_config_error(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes // 2)
        with _must_raise(ConfigError, f"open() with a capacity of half a block ({self.block_bytes // 2} bytes)", "capacity"):
            asyncio.run(backend.open(self.block_format()))

    def test_calls_after_close_raise(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        asyncio.run(backend.open(self.block_format()))
        asyncio.run(backend.aclose())
        with _must_raise(ClosedError, "write_blocks after aclose()"):
            backend.write_blocks([make_key(1)], self.blocks(1))
        with _must_raise(ClosedError, "read_blocks after aclose()"):
            backend.read_blocks([make_key(1)], self.empty(1))

    def test_async_forms_match_blocking_ones(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        data = self.blocks(2, seed=11)
        keys = [make_key(20), make_key(21)]

        async def scenario() -> list[bool]:
            async with backend:
                await backend.open(self.block_format())
                await backend.write(keys, data)
                out = self.empty(2)
                found = await backend.read(keys, out)
                for i in range(2):
                    _assert_same_bytes(out[i], data[i], f"block {i} through the async write/read")
                await backend.delete(keys[:1])
                return list(found) + list(await backend.read(keys, self.empty(2)))

        got = asyncio.run(scenario())
        assert got == [True, True, False, True], (
            f"await read() after await write() gave {got[:2]}, and after await delete(keys[:1]) {got[2:]}; "
            "expected [True, True] then [False, True]"
        )

    def test_to_dict_round_trip(self, tmp_path: Path) -> None:
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        data = backend.to_dict()
        assert data.get("backend") == backend.name, (
            f"to_dict()['backend'] is {data.get('backend')!r}, expected the class's name {backend.name!r}"
        )
        again = type(backend).from_dict(data)
        assert again.to_dict() == data, (
            f"from_dict(to_dict()) built a backend whose to_dict() is {again.to_dict()}, not {data}; "
            "to_dict() must list every option the constructor takes"
        )

    def test_reopen_serves_earlier_blocks_if_persistent(self, tmp_path: Path) -> None:
        persistent = self.persistent
        backend = self.make_backend(tmp_path, self.block_bytes * self.capacity_blocks)
        if persistent is None:
            persistent = type(backend).persistent
        if not persistent:
            _skip("backend is not persistent")
        keys = [make_key(i) for i in range(4)]
        data = self.blocks(4, seed=13)
        with self.opened(tmp_path) as first:
            sizes = first.write_blocks(keys, data)
            assert all(s is not None for s in sizes), f"write_blocks of 4 blocks returned {sizes}"
        with self.opened(tmp_path) as second:
            listed: dict[bytes, Any] = {r.key: r for r in second.scan()}
            assert set(listed) == set(keys), (
                f"scan() of a reopened backend lists {len(set(listed) & set(keys))} of the 4 keys written before "
                f"close, and {len(set(listed) - set(keys))} others"
            )
            out = self.empty(4)
            found = second.read_blocks(keys, out)
            assert found == [True] * 4, f"a reopened backend's read_blocks of 4 keys written before close returned {found}"
            for i in range(4):
                _assert_same_bytes(out[i], data[i], f"block {i} after reopening")


    def test_pool_rows_if_the_backend_takes_them(self, tmp_path: Path) -> None:
        """A backend that sets ``takes_pool_rows`` gets its rows as a :class:`PoolRows` of a pool:
        it must store and serve the same bytes as from a list of views, for jobs of one and
        of several rows, rows in any order of the pool, rows that do not start a pool's
        allocation (a pool cut from a wider tensor), a slice of a ``PoolRows``, and a miss."""
        flag = getattr(type(self.make_backend(tmp_path / "flag", self.block_bytes * self.capacity_blocks)), "takes_pool_rows", False)
        assert isinstance(flag, bool), f"takes_pool_rows is {flag!r}; it must be a bool (a class attribute)"
        if not flag:
            _skip("backend does not set takes_pool_rows: it gets lists")
        size = self.block_bytes
        with self.opened(tmp_path) as backend:
            keys = [make_key(300 + i) for i in range(8)]
            data = self.blocks(8, seed=23)
            wide = torch.zeros(10, size + 24, dtype=torch.uint8)
            pool = wide[:, 8 : 8 + size]  # rows a pool's stride apart, none at the tensor's start
            numbers = [9, 2, 5, 0, 7, 1, 3, 8]
            for i, n in enumerate(numbers):
                pool[n].copy_(data[i])
            listed = _checked_sizes(backend.write_blocks([make_key(400), make_key(401)], data[:2]), 2)
            backend.delete_blocks([make_key(400), make_key(401)])  # (room for the rest in a small tier)
            written = (
                _checked_sizes(backend.write_blocks(keys[:6], PoolRows(pool, numbers[:6])), 6)
                + _checked_sizes(backend.write_blocks(keys[6:7], PoolRows(pool, numbers[6:7])), 1)
                + _checked_sizes(backend.write_blocks(keys[7:], PoolRows(pool, numbers)[7:]), 1)
            )
            assert all(s is not None for s in written), f"write_blocks from a PoolRows into an empty backend returned {written}"
            assert written[:2] == listed, f"write_blocks stored sizes {written} from a PoolRows, {listed} from a list of the same blocks"
            out = torch.full((12, size + 16), 0xA5, dtype=torch.uint8)
            rows = out[:, 16:]
            want = [4, 0, None, 7, 6]  # None: a key never written
            targets = [11, 3, 5, 0, 8]
            asked = [keys[i] if i is not None else make_key(499) for i in want]
            found = _checked_found(backend.read_blocks(asked, PoolRows(rows, targets)), 5)
            assert found == [i is not None for i in want], (
                f"read_blocks(4 written keys and a never-written one) into a PoolRows returned {found}"
            )
            for w, t in zip(want, targets):
                if w is not None:
                    _assert_same_bytes(rows[t], data[w], f"block {w} read into a PoolRows row {t}")
            untouched = [r for r in range(12) if r not in targets or want[targets.index(r)] is None]
            for r in untouched:
                assert bool((out[r] == 0xA5).all()), f"read_blocks into a PoolRows wrote into pool row {r}, which holds no hit"
            assert bool((out[:, :16] == 0xA5).all()), "read_blocks into a PoolRows wrote outside its rows (before the pool's columns)"
            one = torch.zeros(3, size, dtype=torch.uint8)
            assert _checked_found(backend.read_blocks([keys[5]], PoolRows(one, [2])), 1) == [True], "a read of one key into a PoolRows missed"
            _assert_same_bytes(one[2], data[5], "block 5 read alone into a PoolRows")
            listed_out = self.empty(5)
            again = _checked_found(backend.read_blocks(asked, listed_out), 5)
            assert again == found, f"read_blocks answered {found} into a PoolRows and {again} into a list, for the same keys"
            bad = torch.zeros(2, size + 1, dtype=torch.uint8)
            with _must_raise(LayoutError, f"write_blocks from a PoolRows of rows of {size + 1} bytes (one too many)"):
                backend.write_blocks([make_key(480), make_key(481)], PoolRows(bad, range(2)))
            assert backend.read_blocks([make_key(480)], self.empty(1)) == [False], (
                "a block of a rejected write_blocks call from a PoolRows was stored; check every block before writing any"
            )

def _checked_sizes(sizes: Any, n: int) -> list[int | None]:
    assert isinstance(sizes, list) and len(sizes) == n, (
        f"write_blocks of {n} blocks returned {sizes!r}; expected a list of {n} sizes (bytes stored, None on failure)"
    )
    for s in sizes:
        assert s is None or (isinstance(s, int) and not isinstance(s, bool) and s > 0), (
            f"write_blocks returned {sizes!r}; each entry is the positive number of bytes stored, or None"
        )
    return sizes


def _checked_found(found: Any, n: int) -> list[bool]:
    assert isinstance(found, list) and len(found) == n and all(isinstance(f, bool) for f in found), (
        f"read_blocks of {n} keys returned {found!r}; expected a list of {n} bools (False is a miss)"
    )
    return found


def _assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if torch.equal(got, want):
        return
    differ = (got != want).nonzero()
    first = int(differ[0]) if differ.numel() else -1
    raise AssertionError(
        f"{what}: {differ.numel()} of {want.numel()} bytes differ from those written (first at offset {first}); "
        "a read must return exactly the bytes stored under that key"
    )


def _skip(reason: str) -> NoReturn:
    # pytest is imported here, not at the top: benchmarks use this module's helpers after a
    # plain install, without the ``testing`` extra.
    import pytest

    pytest.skip(reason)


@contextmanager
def _must_raise(expected: type[BaseException], call: str, match: str | None = None) -> Iterator[None]:
    try:
        yield
    except expected as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{call} raised {type(exc).__name__}({exc}), which should mention {match!r}") from exc
        return
    except Exception as exc:
        raise AssertionError(f"{call} raised {type(exc).__name__}: {exc}; expected {expected.__name__}") from exc
    raise AssertionError(f"{call} returned normally; expected it to raise {expected.__name__}")
