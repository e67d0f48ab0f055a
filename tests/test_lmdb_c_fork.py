"""A child forked by libc's ``fork()`` without Python's fork hooks (a C library's fork, ctypes')
must not use its parent's LMDB environment either: its save is refused (a ``BackendError``),
the parent's store holds nothing the child tried to write, and the parent saves and reads on;
its reads are refused too, the one-key and several-key straight reads as the general one (a
read transaction there takes a reader slot of the parent's environment, in the parent's name).
Run in a process of its own: a fork that skips Python's hooks is only safe where no other
thread runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_CHILD = """
import asyncio, ctypes, os, sys
import torch
from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.errors import BackendError
from kvtier.testing import make_key, random_block

fmt = BlockFormat(block_bytes=16 << 10, dtype="bfloat16", namespace={"model_id": "m"})
backend = registry.backends.get("lmdb")(capacity=64 << 20, path=sys.argv[1], sync_mode="durable")
asyncio.run(backend.open(fmt))
assert None not in backend.write_blocks([make_key(1)], [random_block(fmt.block_bytes, 1)])
rows = [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in range(2)]
assert backend.read_blocks([make_key(1)], rows[:1]) == [True]  # (the rows' views are kept: the straight reads take them)
assert backend.read_blocks([make_key(1), make_key(9)], rows) == [True, False]
read, write = os.pipe()
pid = ctypes.CDLL(None).fork()  # libc's fork: no os.register_at_fork hook runs
if pid == 0:
    said = []
    for job in (
        lambda: backend.read_blocks([make_key(1)], rows[:1]),
        lambda: backend.read_blocks([make_key(1), make_key(9)], rows),
        lambda: backend.write_blocks([make_key(2)], [random_block(fmt.block_bytes, 2)]),
    ):
        try:
            job()
            said.append("done")
        except BackendError as exc:
            said.append("refused" if "another process" in str(exc) else "other")
        except BaseException as exc:
            said.append("raised " + type(exc).__name__)
    os.write(write, " ".join(said).encode())
    os._exit(0)
os.close(write)
os.waitpid(pid, 0)
print(os.read(read, 200).decode())
assert None not in backend.write_blocks([make_key(3)], [random_block(fmt.block_bytes, 3)])
print(backend.read_blocks([make_key(i) for i in (1, 2, 3)], [torch.zeros(fmt.block_bytes, dtype=torch.uint8) for _ in range(3)]))
asyncio.run(backend.aclose())
"""


def test_a_child_of_a_c_fork_is_refused_and_the_parent_goes_on(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["refused refused refused", "[True, False, True]"]
