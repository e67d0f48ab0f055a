"""The fence index: which unacknowledged store jobs read which engine blocks.

Fence before reuse (``docs/architecture.md``): while a store job that reads engine block ``b``
is built, unsubmitted or in flight, ``b`` is fenced. When the engine hands ``b`` out again (a
new allocation, a copy-on-write destination), every job in :meth:`FenceIndex.readers` of it
must run before the engine overwrites it. A block leaves the index when its last reader is
released; :meth:`FenceIndex.release` returns those blocks so that an engine that fences by
reference count can unpin them.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FenceIndex"]


class FenceIndex:
    """Engine block -> ids of the store jobs that still read it."""

    __slots__ = ("_readers",)

    def __init__(self) -> None:
        self._readers: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._readers)

    def __contains__(self, block: object) -> bool:
        return block in self._readers

    def blocks(self) -> set[int]:
        """Every fenced engine block."""
        return set(self._readers)

    def add(self, job_id: int, block_ids: Iterable[int]) -> None:
        """Fence ``block_ids`` for store job ``job_id``."""
        readers = self._readers
        for b in block_ids:
            jobs = readers.get(b)
            if jobs is None:
                readers[b] = {job_id}
            else:
                jobs.add(job_id)

    def release(self, job_id: int, block_ids: Iterable[int]) -> list[int]:
        """Job ``job_id`` no longer reads ``block_ids``; return the blocks no job reads now."""
        readers = self._readers
        unfenced: list[int] = []
        for b in block_ids:
            jobs = readers.get(b)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del readers[b]
                    unfenced.append(b)
        return unfenced

    def readers(self, block_ids: Iterable[int]) -> set[int]:
        """Ids of the jobs that read any of ``block_ids``."""
        readers = self._readers
        out: set[int] = set()
        if readers:
            for b in block_ids:
                jobs = readers.get(b)
                if jobs:
                    out.update(jobs)
        return out
