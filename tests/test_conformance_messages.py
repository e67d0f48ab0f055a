"""The conformance suite's failures say what a backend did wrong (not a bare AssertionError)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.backend import Backend
from kvtier.testing import BackendTests


class StubBackend(Backend):
    """What a plugin author gets by copying a sketch with ``...`` bodies: every call returns None."""

    name = "stub"

    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> Any:
        ...

    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> Any:
        ...

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        ...


class LyingBackend(Backend):
    """Says yes to everything and never copies: reads 'hit' with zero bytes, writes nothing."""

    name = "lying"

    def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> list[int | None]:
        return [self._check_open().block_bytes for _ in keys]

    def read_blocks(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        self._check_open()
        return [True for _ in keys]

    def delete_blocks(self, keys: Sequence[bytes]) -> None:
        pass


class _Suite(BackendTests):
    backend_cls: type[Backend] = StubBackend

    def make_backend(self, path: Path, capacity: int) -> Backend:
        return self.backend_cls(capacity=capacity)


def _failure(cls: type[Backend], test: str, tmp_path: Path) -> str:
    suite = _Suite()
    suite.backend_cls = cls
    with pytest.raises(AssertionError) as info:
        getattr(suite, test)(tmp_path)
    return str(info.value)


@pytest.mark.parametrize(
    ("cls", "test", "says"),
    [
        (StubBackend, "test_round_trip_is_byte_exact", "write_blocks of 8 blocks returned None"),
        (StubBackend, "test_missing_key_is_a_miss", "read_blocks of 2 keys returned None"),
        (StubBackend, "test_wrong_block_shape_is_rejected_before_any_write", "returned normally; expected it to raise LayoutError"),
        (StubBackend, "test_counters_track_io", "stats()['blocks_written'] is 0"),
        (LyingBackend, "test_round_trip_is_byte_exact", "block 0 read back: "),
        (LyingBackend, "test_missing_key_is_a_miss", "returned [True, True]; a missing key is False"),
        (LyingBackend, "test_delete_makes_a_miss_and_keeps_others", "expected only keys[1] to be gone"),
        (StubBackend, "test_calls_after_close_raise", "write_blocks after aclose() returned normally; expected it to raise ClosedError"),
        (LyingBackend, "test_rewrite_after_delete_serves_new_bytes", "a key rewritten after a delete"),
    ],
)
def test_conformance_failures_name_the_broken_promise(cls: type[Backend], test: str, says: str, tmp_path: Path) -> None:
    assert says in _failure(cls, test, tmp_path)


def test_a_correct_backend_passes_the_same_checks(tmp_path: Path) -> None:
    from kvtier.backends.memory import CpuBackend

    class Good(BackendTests):
        def make_backend(self, path: Path, capacity: int) -> Backend:
            return CpuBackend(capacity=capacity)

    suite = Good()
    for i, test in enumerate(("test_round_trip_is_byte_exact", "test_missing_key_is_a_miss", "test_counters_track_io")):
        (tmp_path / str(i)).mkdir()
        getattr(suite, test)(tmp_path / str(i))


def test_the_suite_runs_without_pytest_asyncio_so_a_plugin_project_gets_no_warning_from_it(tmp_path: Path) -> None:
    """What the ``testing`` extra installs: pytest and hypothesis, no pytest-asyncio (whose
    unset-loop-scope deprecation warning every plugin project would see). The suite must pass
    without it, with deprecation warnings as errors."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    extra = re.search(r"^testing = \[(.*)\]$", (root / "pyproject.toml").read_text(), re.M)
    assert extra is not None and "pytest-asyncio" not in extra.group(1)
    (tmp_path / "test_plugin_suite.py").write_text(
        "from kvtier import registry\n"
        "from kvtier.testing import BackendTests\n\n"
        "class TestCompressed(BackendTests):\n"
        "    def make_backend(self, path, capacity):\n"
        "        return registry.backends.get('compressed')(capacity=capacity)\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # a plugin project's own, empty settings
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:asyncio", "-p", "no:cacheprovider", "-W", "error::DeprecationWarning",
         str(tmp_path / "test_plugin_suite.py")],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "passed" in proc.stdout and "warning" not in proc.stdout.lower(), proc.stdout[-2000:]
