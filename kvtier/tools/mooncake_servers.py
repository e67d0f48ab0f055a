"""A private Mooncake Store on loopback: one ``mooncake_master`` and a standalone ``mooncake_client``.

The master runs with its HTTP metadata server and its admin/metrics port (``/health``,
``/get_all_keys``, ``/get_all_segments``), each on a free 127.0.0.1 port, in a folder of the
caller's, until ``stop()``. A Mooncake object lives in the memory segment of the client that
mounted it, so records outlive the process that wrote them only when a standalone
``mooncake_client`` mounts the memory (``segment_size``) and engines write with
``global_segment_size: 0``, as a deployment does. Both binaries come with the PyPI wheel
``mooncake-transfer-engine-non-cuda`` (``pip install 'kvtier[mooncake]'``), which links
``libibverbs.so.1`` even for TCP (Debian package ``libibverbs1``).

kvtier's tests and ``benchmarks/bench_mooncake.py`` start theirs with it; every process is
started in a session of its own and stopped by its pid.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.tools.servers import free_ports

__all__ = ["MISSING", "MooncakeServers", "mooncake_binaries", "mooncake_missing"]

#: Why the Mooncake tests and benchmarks cannot run here, in capitals (``None``: they can).
MISSING = (
    "MOONCAKE NOT INSTALLED: the mooncake tier tests are SKIPPED "
    "(pip install 'kvtier[mooncake]' and apt-get install -y libibverbs1, as .ci/run does)"
)


def mooncake_binaries() -> tuple[Path, Path] | None:
    """``(mooncake_master, mooncake_client)`` shipped in the installed ``mooncake`` package, or
    ``None``. Found without importing the package (its store module loads native libraries)."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        master, client = Path(folder) / "mooncake_master", Path(folder) / "mooncake_client"
        if master.is_file() and client.is_file():
            for binary in (master, client):
                if not os.access(binary, os.X_OK):
                    binary.chmod(binary.stat().st_mode | 0o111)
            return master, client
    return None


def mooncake_missing() -> str | None:
    """What keeps a private Mooncake Store from running here (in capitals), or ``None``."""
    if mooncake_binaries() is None:
        return MISSING
    try:
        import mooncake.store  # noqa: F401  (the Python client: native libraries, libibverbs)
    except ImportError as exc:
        return f"{MISSING}: {exc}"
    return None


def _get_json(url: str, timeout: float = 1.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read() or b"null")


class _Process:
    """One binary in a session of its own; ``kill`` (SIGKILL) or ``stop`` (SIGTERM, then SIGKILL)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args, self.log = args, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class MooncakeServers:
    """A master (with its HTTP metadata server and admin port) and, with ``segment_size``, a
    standalone client that mounts that much memory for everyone's records.

    ``master_flags`` are added to the master's command line (``--client_ttl=3``, say). The ports
    stay the same across ``kill_master`` / ``start_master``, so clients reconnect after a restart.
    """

    def __init__(self, directory: Path, *, segment_size: str = "512MB", master_flags: tuple[str, ...] = ()) -> None:
        found = mooncake_binaries()
        if found is None:
            raise RuntimeError(MISSING)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Four distinct picks: two probes of free_port() can return the same free port, and the
        # master or the client then fails to bind its second listener.
        self.rpc_port, self.metadata_port, self.admin_port, self.client_port = free_ports(4)
        self.segment_size = segment_size
        master_bin, client_bin = found
        self._master = _Process(
            [
                str(master_bin),
                f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.admin_port}",
                *master_flags,
            ],
            self.directory / "master.log",
        )
        self._client = _Process(
            [
                str(client_bin),
                "--host=127.0.0.1",
                f"--port={self.client_port}",
                f"--global_segment_size={segment_size}",
                f"--master_server_address={self.master}",
                f"--metadata_server={self.metadata_server}",
                "--protocol=tcp",
            ],
            self.directory / "client.log",
        )

    # -- what a tier is configured with --------------------------------------------------------
    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def ports(self) -> tuple[int, int, int, int]:
        """The ports handed to the master (RPC, metadata, admin) and to the client."""
        return self.rpc_port, self.metadata_port, self.admin_port, self.client_port

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def tier_options(self) -> dict[str, Any]:
        """The ``mooncake`` tier's options for this store (a client that mounts no memory)."""
        return {
            "master": self.master,
            "metadata_server": self.metadata_server,
            "admin_url": self.admin_url,
            "local_hostname": "127.0.0.1",
            "global_segment_size": 0,
        }

    # -- the processes -----------------------------------------------------------------------------
    def start(self) -> MooncakeServers:
        self.start_master()
        self.start_client()
        return self

    def start_master(self) -> None:
        self._master.start()
        self._wait(lambda: (_get_json(f"{self.admin_url}/health") or {}).get("status") == "ok", self._master, "mooncake_master")

    def start_client(self) -> None:
        """Start the standalone client and wait until the master lists its segment."""
        before = self.segments()
        self._client.start()
        self._wait(lambda: len(self.segments()) > len(before), self._client, "mooncake_client")

    def segments(self) -> list[str]:
        """The memory segments the master knows (``/get_all_segments``)."""
        try:
            with urllib.request.urlopen(f"{self.admin_url}/get_all_segments", timeout=1.0) as reply:
                return [line for line in reply.read().decode().split() if line]
        except (OSError, urllib.error.URLError):
            return []

    def keys(self) -> list[str]:
        """Every key the master holds (``/get_all_keys``)."""
        with urllib.request.urlopen(f"{self.admin_url}/get_all_keys", timeout=5.0) as reply:
            return [line for line in reply.read().decode().split("\n") if line]

    def _wait(self, ready: Any, process: _Process, name: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except (OSError, ValueError, urllib.error.URLError):
                pass
            if not process.alive or time.monotonic() > deadline:
                tail = process.tail()
                self.stop()
                raise RuntimeError(f"{name} did not start (log {process.log}):\n{tail}")
            time.sleep(0.05)

    def processes(self) -> dict[str, _Process]:
        """The two server processes by binary name (their ``alive``, ``log`` and ``tail()``)."""
        return {"mooncake_master": self._master, "mooncake_client": self._client}

    def kill_master(self) -> None:
        """SIGKILL the master, as a crash would (it keeps its metadata in memory: all lost)."""
        self._master.kill()

    def kill_client(self) -> None:
        """SIGKILL the standalone client: its segment, and every record in it, is gone."""
        self._client.kill()

    def stop(self) -> None:
        self._client.stop()
        self._master.stop()

    def __enter__(self) -> MooncakeServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
