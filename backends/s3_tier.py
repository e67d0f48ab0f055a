"""``s3``: a tier on any S3-compatible object store (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...).

One :mod:`kvtier.records.format` record (header, optional MAC tag, codec payload) per object,
named ``<prefix>/<namespace digest, 16 hex>/<key, 64 hex>`` in ``bucket``, so namespaces never
meet and one listing prefix finds a store's records. Everything a shared tier needs (the meta
record check, the shared index view, records bound to their key, health and backoff, secrets
kept out of logs) is :class:`kvtier.backends.remote_tier.RemoteRecordBackend`'s; this module
keeps what is S3's own:

* **I/O** through :class:`kvtier.backends.s3_client.S3Client` (obstore, chosen by measurement):
  a job's records go out as one batch with ``concurrency`` requests in flight; each object is
  one whole ``PUT`` (never multipart), so a partial record is never readable.
* **The index** follows the bucket with a paged listing (``list_page`` names per request), and
  a sweep lists at most ``max_listed`` names: past that bound the sweep keeps what it listed
  (logged once, counted in ``listing_truncated``); keys it did not reach are misses, never
  wrong data. Sweeps run every ``sync_interval_s`` (5 s by default: a listing costs the server
  more than a Redis ``SCAN``), and never take more than a tenth of their thread's time.
* **Eviction is the server's** (lifecycle rules, a TTL, an operator): an object that vanished
  is a load miss. kvtier deletes only records it found bad.
* **Faults**: no connection, a timeout or a 5xx marks the tier down (stores fail at once and
  loads miss until the backoff runs out); refused credentials or a missing bucket are logged as
  an error and treated the same way. Nothing raises into the engine.

Credentials come from the standard ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` variables,
or from the variables named by ``access_key_id_env`` / ``secret_access_key_env``; they are never
in the config, a log line, ``repr`` or ``to_dict`` (which keeps only the variables' names). With
neither, requests go unsigned (a public bucket).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any, ClassVar
from urllib.parse import urlsplit

from kvtier.backends.remote_secrets import read_secret
from kvtier.backends.remote_tier import KEY_BYTES, ReadJob, RemoteRecordBackend, check_seconds
from kvtier.backends.s3_client import S3Client, S3Down, S3Refused

from kvtier.errors import ConfigError
from kvtier.records.codec import Codec
from kvtier.records.format import DEFAULT_MAC_ALGORITHM, decode_record

__all__ = ["S3Backend"]

log = logging.getLogger("kvtier")

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_HEX = frozenset(b"0123456789abcdef")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
    return value


class S3Backend(RemoteRecordBackend):
    """Records as objects in an S3 bucket shared by every host that names it."""

    name: ClassVar[str] = "s3"
    down_errors: ClassVar[tuple[type[BaseException], ...]] = (S3Down, OSError)
    refused_errors: ClassVar[tuple[type[BaseException], ...]] = (S3Refused,)
    #: Object names may hold ``/`` too (``team/kv``), never at either end.
    prefix_pattern: ClassVar[re.Pattern[str]] = re.compile(r"^(?!/)[A-Za-z0-9_.\-/]{1,128}(?<!/)$")

    def __init__(
        self,
        *,
        capacity: int | str,
        bucket: str,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        prefix: str = "kvtier",
        access_key_id_env: str | None = None,
        secret_access_key_env: str | None = None,
        codec: str | dict[str, Any] | Codec | None = "none",
        mac_key: bytes | str | None = None,
        mac_key_env: str | None = None,
        mac_algorithm: str = DEFAULT_MAC_ALGORITHM,
        concurrency: int = 16,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 2.0,
        sync_interval_s: float = 5.0,
        list_page: int = 1000,
        max_listed: int = 1_000_000,
    ) -> None:
        if not isinstance(bucket, str) or not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise ConfigError(f"bucket: expected an S3 bucket name (3-63 of [a-z0-9.-]), got {bucket!r}")
        if endpoint_url is not None:
            parts = urlsplit(endpoint_url) if isinstance(endpoint_url, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"endpoint_url: expected an http:// or https:// URL, got {endpoint_url!r}")
            if parts.username is not None or parts.password is not None:
                raise ConfigError("endpoint_url: credentials do not belong in the URL; use access_key_id_env / secret_access_key_env")
            endpoint_url = endpoint_url.rstrip("/")
        if not isinstance(region, str) or not region:
            raise ConfigError(f"region: expected a region name, got {region!r}")
        self._access = read_secret("access_key_id", None, "access_key_id_env", access_key_id_env, default_env="AWS_ACCESS_KEY_ID")
        self._secret = read_secret(
            "secret_access_key", None, "secret_access_key_env", secret_access_key_env, default_env="AWS_SECRET_ACCESS_KEY"
        )
        if (self._access.value is None) != (self._secret.value is None):
            missing = self._secret if self._secret.value is None else self._access
            raise ConfigError(
                f"{missing.env_field}: only one of the key pair was found; set both AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or name both variables (access_key_id_env, secret_access_key_env)"
            )
        check_seconds(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        where = f"{endpoint_url or 'aws'}/{bucket}"
        super().__init__(
            capacity=capacity, where=where, prefix=prefix, codec=codec, mac_key=mac_key, mac_key_env=mac_key_env,
            mac_algorithm=mac_algorithm, sync_interval_s=sync_interval_s,
        )
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.region = region
        self.concurrency = _positive_int("concurrency", concurrency)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.list_page = min(_positive_int("list_page", list_page), 1000)
        self.max_listed = _positive_int("max_listed", max_listed)
        self.listing_truncated = 0
        self._client: S3Client | None = None

    def __repr__(self) -> str:
        return f"S3Backend({self.where!r}, prefix={self.prefix!r})"

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data.update(bucket=self.bucket, region=self.region)
        if self.endpoint_url is not None:
            data["endpoint_url"] = self.endpoint_url
        data.update(self._access.describe())  # a variable's name, never a key
        data.update(self._secret.describe())
        data.update(
            concurrency=self.concurrency, timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s,
            list_page=self.list_page, max_listed=self.max_listed,
        )
        return data

    def _new_client(self, timeout_s: float, connect_timeout_s: float) -> S3Client:
        return S3Client(
            endpoint_url=self.endpoint_url, bucket=self.bucket, region=self.region, access_key_id=self._access.value,
            secret_access_key=self._secret.value, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
            concurrency=self.concurrency,
        )

    def probe(self, timeout_s: float) -> str | None:
        """List one name under the prefix; ``None`` when the bucket answers, else what is wrong
        (unreachable, refused credentials, no such bucket), never naming a secret."""
        client = self._new_client(timeout_s, timeout_s)
        try:
            client.probe_bucket(f"{self.prefix}/")
        except (S3Down, S3Refused) as exc:
            return f"{self.where}: {exc}"
        finally:
            client.close()
        return None

    # -- the hooks of RemoteRecordBackend ---------------------------------------------------------
    def _connect(self) -> None:
        if self._client is None:
            self._client = self._new_client(self.timeout_s, self.connect_timeout_s)

    def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _s3(self) -> S3Client:
        if self._client is None:
            self._connect()
        assert self._client is not None
        return self._client

    @property
    def _folder(self) -> str:
        """``<prefix>/<namespace digest, 16 hex>/``: S3 listings (and obstore's paths) take a
        prefix as a folder, so the names use ``/`` where the other remote tiers use ``:``."""
        return self._prefix_bytes.decode().replace(":", "/")

    def remote_key(self, key: bytes) -> bytes:
        return (self._folder + key.hex()).encode()

    def block_key(self, rkey: bytes) -> bytes | None:
        folder = self._folder.encode()
        tail = rkey[len(folder) :]
        if len(tail) != 2 * KEY_BYTES or not rkey.startswith(folder) or not _HEX.issuperset(tail):
            return None
        return bytes.fromhex(tail.decode())

    def _read_meta(self) -> bytes | None:
        raw = self._s3().get_many([self._folder + "meta"])[0]
        return None if raw is None else bytes(raw)

    def _write_meta(self, value: bytes, only_new: bool) -> None:
        client = self._s3()
        if only_new:
            client.put_if_absent(self._folder + "meta", value)
        else:
            client.put_many([self._folder + "meta"], [[value]])

    def _put_records(self, route: Any, rkeys: list[bytes], records: list[tuple[bytes, Any]]) -> list[bool]:
        self._s3().put_many([k.decode() for k in rkeys], records)
        return [True] * len(rkeys)

    def _read_share(self, handle: Any, positions: list[int], *, job: ReadJob) -> None:
        """Check and decode each record into its row as soon as it arrives, on the client's
        loop, while the rest of the job is still in flight: the checks overlap the server's
        work, and no more than the records in flight are held in memory."""
        mac = self.mac

        def land(j: int, raw: Any) -> None:
            i = positions[j]
            key = job.keys[i]
            job.found[i] = self._accept(job, i, lambda view: decode_record(key, raw, view, mac=mac))

        self._s3().get_many([job.rkeys[i].decode() for i in positions], on_record=land)

    def _delete_records(self, route: Any, rkeys: list[bytes]) -> int:
        self._s3().delete_many([k.decode() for k in rkeys])
        return len(rkeys)

    def _list_keys(self) -> Iterator[bytes]:
        listed = 0
        for name in self._s3().list_keys(self._folder, self.list_page):
            if listed >= self.max_listed:
                self.listing_truncated += 1
                if self.listing_truncated == 1:
                    log.warning(
                        "s3: %s prefix %s holds more than max_listed=%d objects; the index follows the first %d",
                        self.where, self._folder, self.max_listed, self.max_listed,
                    )
                return
            listed += 1
            yield name.encode()

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        data["listing_truncated"] = self.listing_truncated
        return data
