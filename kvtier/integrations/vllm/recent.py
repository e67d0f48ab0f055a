"""The recent job ids a vLLM side remembers (reported, abandoned or settled ones), in a fixed
amount of memory.

vLLM numbers its offloading jobs with a counter, so the ids that can still matter (a late or
doubled report, a notice racing a report) are the newest ones. :class:`RecentIds` keeps one
byte for each of the newest ``span`` ids: 64 KiB for the default span, however many jobs an
engine has run. An ordered dict of the same ids held about 175 bytes per id, about 11 MiB per
table once full, and a 10-minute soak of two ranks (``scripts/soak_vllm_sides.py``) grew its
RSS by 8.8 % while those tables filled.
"""

from __future__ import annotations

__all__ = ["RecentIds"]

#: job ids remembered by default (a notice or a late report comes within a few steps)
SPAN = 1 << 16


class RecentIds:
    """Which of the newest ``span`` job ids were added. An id more than ``span`` below the
    highest one added is forgotten (``in`` is ``False``), as an older entry of a bounded
    table would be."""

    __slots__ = ("_marks", "_span", "_top")

    def __init__(self, span: int = SPAN) -> None:
        if span < 1:
            raise ValueError(f"RecentIds: span must be at least 1, got {span}")
        self._span = span
        self._marks = bytearray(span)  # slot id % span: whether that id was added
        self._top: int | None = None  # the highest id added

    def _window(self, job_id: int) -> bool:
        return self._top is not None and self._top - self._span < job_id <= self._top

    def __contains__(self, job_id: object) -> bool:
        return isinstance(job_id, int) and self._window(job_id) and bool(self._marks[job_id % self._span])

    def add(self, job_id: int) -> None:
        top = self._top
        if top is None or job_id > top:
            self._clear_above(top, job_id)
            self._top = job_id
        elif job_id <= top - self._span:
            return  # older than every id remembered
        self._marks[job_id % self._span] = 1

    def _clear_above(self, top: int | None, new_top: int) -> None:
        """Forget the slots the ids ``top + 1 .. new_top`` take over from older ids."""
        span = self._span
        if top is None or new_top - top >= span:
            self._marks[:] = bytes(span)
            return
        start, end = (top + 1) % span, new_top % span + 1
        if start < end:
            self._marks[start:end] = bytes(end - start)
        else:  # the run wraps around the end of the slots
            self._marks[start:] = bytes(span - start)
            self._marks[:end] = bytes(end)
