"""Facts about the host a benchmark ran on, read alongside its figures."""

from __future__ import annotations

__all__ = ["CpuSteal"]


class CpuSteal:
    """The share of this host's CPU time that the hypervisor gave to others while the block
    ran (``steal`` in ``/proc/stat``), or ``None`` where that file is missing: a run with
    much steal measures the neighbours as much as the code."""

    def __init__(self) -> None:
        self.share: float | None = None

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])

    def __enter__(self) -> CpuSteal:
        self._start = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._read()
        if self._start is not None and end is not None and end[1] > self._start[1]:
            self.share = round((end[0] - self._start[0]) / (end[1] - self._start[1]), 4)
