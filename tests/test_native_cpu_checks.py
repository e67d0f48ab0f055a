"""Every instruction set a C extension compiles a function for (``__attribute__((target(...)))``)
is asked of the CPU (``__builtin_cpu_supports``) in that extension's sources before the
function can run: a CPU, or a virtual machine, that hides one of them (AES-NI switched off in
the firmware, ``-cpu host,-aes``) must get the portable path, never an illegal instruction in
the engine's process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]
_TARGET = re.compile(r'target\("([^"]+)"\)')
_ASKED = re.compile(r'__builtin_cpu_supports\("([^"]+)"\)')


def features(ext: dict) -> tuple[set[str], set[str]]:
    """The instruction sets ``ext``'s sources compile for, and those they ask the CPU about."""
    text = "\n".join((ROOT / p).read_text() for p in (*ext["sources"], *ext.get("depends", ())))
    targets = {name.strip() for group in _TARGET.findall(text) for name in group.split(",")}
    return targets, set(_ASKED.findall(text))


def test_the_scan_finds_the_vector_paths() -> None:
    """The scan sees the target attributes it is meant to check (else the next test is empty)."""
    found = {e["name"]: features(e)[0] for e in EXTENSIONS}
    assert {"avx512f", "vpclmulqdq", "aes"} <= found["kvtier.records._gmac"]
    assert {"avx2", "avx512f"} <= found["kvtier.records._xxcopy"]


@pytest.mark.parametrize("ext", EXTENSIONS, ids=[e["name"] for e in EXTENSIONS])
def test_every_targeted_instruction_set_is_asked_of_the_cpu(ext: dict) -> None:
    targets, asked = features(ext)
    assert targets <= asked, f"{ext['name']} compiles for {sorted(targets - asked)} without asking the CPU (__builtin_cpu_supports)"
