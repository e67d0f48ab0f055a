"""Engines close their stores from exit hooks; that must work while the interpreter shuts down."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_a_store_closed_from_an_atexit_hook_closes_cleanly(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import atexit, asyncio, torch, kvtier
        from kvtier.testing import make_key

        kv = [torch.randn(8, 4, 16)]
        cfg = {{"tiers": [{{"backend": "cpu", "capacity": "1MiB"}},
                          {{"backend": "lmdb", "path": {str(tmp_path / "db")!r}, "capacity": "8MiB"}}]}}
        store = asyncio.run(kvtier.KVStore(kvtier.config.load_config(cfg), kv_caches=kv).start())

        def bye():
            asyncio.run(store.aclose())
            print("closed", store.manager is not None and store._closed)

        atexit.register(bye)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "closed True"
    assert "Traceback" not in proc.stderr
