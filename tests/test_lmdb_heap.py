"""The ``lmdb`` tier has glibc keep a large commit's freed pages on its heap
(:mod:`kvtier.backends.lmdb_heap`): a second job of large records faults none of them in again,
and the adaptation is made once per larger size, capped where glibc caps it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.backends import lmdb_heap

# A fresh interpreter (glibc's thresholds are the process's): three jobs of 16 records of
# ``argv[3]`` bytes (256 KiB: 4 MiB a commit) through the tier; prints the minor faults of the
# third. ``off``: with the tier's call to ``keep_heap_for`` made a no-op.
_JOBS = r"""
import asyncio, resource, sys
import torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.backends import lmdb_heap, lmdb_writes
from kvtier.testing import make_key
if sys.argv[2] == "off":
    lmdb_writes.keep_heap_for = lambda nbytes: False
elif lmdb_heap._glibc() is None:
    print("no-glibc")
    raise SystemExit(0)
size, job = int(sys.argv[3]), 16
backend = registry.backends.get("lmdb")(capacity=256 << 20, path=sys.argv[1], sync_mode="fast")
asyncio.run(backend.open(BlockFormat(block_bytes=size, dtype="uint8")))
blocks = [torch.full((size,), i, dtype=torch.uint8) for i in range(job)]
faults = []
for r in range(3):
    keys = [make_key(r * job + i) for i in range(job)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert None not in backend.write_blocks(keys, blocks)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
out = [torch.zeros(size, dtype=torch.uint8) for _ in range(job)]
assert backend.read_blocks([make_key(2 * job + i) for i in range(job)], out) == [True] * job
assert all(torch.equal(o, b) for o, b in zip(out, blocks))
asyncio.run(backend.aclose())
print(faults[2])
"""
#: Pages of one commit: 16 values of 256 KiB and their page headers.
_PAGES = 16 * (256 + 4) // 4


def _third_job_faults(tmp_path: Path, arm: str, size: int = 256 << 10) -> int:
    child = subprocess.run([sys.executable, "-c", _JOBS, str(tmp_path / arm), arm, str(size)], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    if child.stdout.strip() == "no-glibc":
        pytest.skip("glibc's malloc is not this process's")
    return int(child.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_later_job_of_large_records_faults_no_page_of_its_commit_in_again(tmp_path: Path) -> None:
    kept = _third_job_faults(tmp_path, "on")
    assert kept < _PAGES // 8, f"the third 4 MiB commit faulted {kept} pages in (of {_PAGES})"
    # Without the adaptation glibc trims the heap after every commit here, and the same job
    # faults each page in again: what the call above saves.
    trimmed = _third_job_faults(tmp_path, "off")
    if trimmed < _PAGES // 2:
        pytest.skip(f"glibc here kept the heap without the tier's call ({trimmed} faults): nothing to compare")
    assert kept < trimmed // 8


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_later_job_of_joined_records_faults_neither_its_commit_nor_its_records_in_again(tmp_path: Path) -> None:
    """64 KiB records are put joined, each built whole (a new ``bytes``) before the commit and
    freed after it: the heap kept must hold those too. Kept for the commit's pages alone, the
    two frees together passed glibc's trim threshold, and each job faulted about 30 pages a
    record in again (480 here)."""
    pages = 16 * (64 + 4) // 4
    kept = _third_job_faults(tmp_path, "on", 64 << 10)
    assert kept < pages // 8, f"the third 1 MiB commit of joined records faulted {kept} pages in (of {pages})"


class _Libc:
    """Stands for glibc: records each ``malloc``'s size and each ``free``."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def malloc(self, size: int) -> int:
        self.calls.append(("malloc", size))
        return 0 if self.fail else 4096 + len(self.calls)

    def free(self, pointer: int) -> None:
        self.calls.append(("free", pointer))


def _fresh(monkeypatch: pytest.MonkeyPatch, libc: _Libc | None) -> None:
    monkeypatch.setattr(lmdb_heap, "_libc", libc)
    monkeypatch.setattr(lmdb_heap, "_looked", True)
    monkeypatch.setattr(lmdb_heap, "_kept", 128 << 10)


def test_one_chunk_a_larger_size_mapped_untouched_and_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _Libc()
    _fresh(monkeypatch, libc)
    page = lmdb_heap.mmap.PAGESIZE
    assert lmdb_heap.keep_heap_for(64 << 10) is False  # below glibc's starting threshold
    assert lmdb_heap.keep_heap_for((4 << 20) + 100) is True
    size = (4 << 20) + page  # rounded up to a page
    # Its request plus glibc's header is mapped as a chunk of exactly that size, then freed.
    assert libc.calls == [("malloc", size - page), ("free", 4096 + 1)]
    assert lmdb_heap.kept_bytes() == size
    assert lmdb_heap.keep_heap_for(4 << 20) is False  # nothing larger: no call
    assert lmdb_heap.keep_heap_for(size) is False
    assert len(libc.calls) == 2
    assert lmdb_heap.keep_heap_for(8 << 20) is True
    assert libc.calls[2] == ("malloc", (8 << 20) - page)


def test_the_chunk_is_capped_below_glibcs_limit_and_then_nothing_more_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _Libc()
    _fresh(monkeypatch, libc)
    page = lmdb_heap.mmap.PAGESIZE
    assert lmdb_heap.keep_heap_for(64 << 20) is True
    # A chunk of exactly 32 MiB raises no threshold (glibc compares its size field, flag bits
    # and all, with the cap): one page less.
    assert libc.calls[0] == ("malloc", lmdb_heap.MOST_BYTES - 2 * page)
    assert lmdb_heap.kept_bytes() == lmdb_heap.MOST_BYTES - page
    assert lmdb_heap.keep_heap_for(1 << 30) is False
    assert len(libc.calls) == 2


def test_nothing_is_allocated_where_malloc_is_not_glibcs(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh(monkeypatch, None)
    assert lmdb_heap.keep_heap_for(16 << 20) is False
    assert lmdb_heap.keep_heap_for(32 << 20) is False  # decided once: no lookup again


def test_a_refused_malloc_frees_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _Libc(fail=True)
    _fresh(monkeypatch, libc)
    assert lmdb_heap.keep_heap_for(4 << 20) is False
    assert [c for c, _ in libc.calls] == ["malloc"]


# A ``malloc`` put in front of glibc's that also answers to ``__libc_malloc``, as gperftools'
# tcmalloc and jemalloc built to override glibc's names do (this one hands each request on
# to glibc, so the process runs as before; what matters is whose ``malloc`` it is).
_FRONT = r"""
#include <stddef.h>
extern void *__libc_memalign(size_t alignment, size_t size);
void *malloc(size_t size) { return __libc_memalign(16, size); }
void *__libc_malloc(size_t size) __attribute__((alias("malloc")));
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_malloc_in_front_of_glibcs_that_also_takes_its_name_is_not_taken_for_glibcs(tmp_path: Path) -> None:
    if lmdb_heap._glibc() is None:
        pytest.skip("glibc's malloc is not this process's")
    source, shim = tmp_path / "front.c", tmp_path / "front.so"
    source.write_text(_FRONT)
    try:
        built = subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(shim), str(source)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("no C compiler")
    if built.returncode != 0:
        pytest.skip(f"the shim does not build here: {built.stderr[-300:]}")
    code = "from kvtier.backends import lmdb_heap; print(lmdb_heap._glibc() is None)"
    env = {**__import__("os").environ, "LD_PRELOAD": str(shim)}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split()[-1] == "True", "a malloc that is not glibc's was taken for glibc's"
