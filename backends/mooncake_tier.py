"""``mooncake``: a tier shared by every host that names the same Mooncake Store master.

Mooncake Store pools the DRAM of many hosts behind one master. A record is one Mooncake object,
``<prefix>:<namespace digest, 16 hex>:<key, 64 hex>``, holding a :mod:`kvtier.records.format`
record (header, optional MAC tag, codec payload): namespaces never meet, and a record copied
under another key, damaged, or planted by someone without the fleet's ``mac_key`` is a miss,
deleted and counted, never wrong data. The machinery every remote tier shares (health and
backoff, the shared index, records, secrets) is :class:`~kvtier.backends.remote_tier.RemoteRecordBackend`;
this module keeps what is Mooncake's own.

**Where records live.** Mooncake keeps an object in the memory segment of a client that mounts
memory (``global_segment_size``). A tier with ``global_segment_size: 0`` (the default) mounts
none: its records live in the segments of standalone ``mooncake_client`` processes (or of
engines that mount memory) and outlive the writer. A writer that mounts its own segment serves
its records to others only while it lives.

**I/O**, one batched call per job (in chunks of the registered staging,
``local_buffer_size``): a record is put as two slices, its head from kvtier's registered
staging and its payload straight from the caller's row (``batch_put_from_multi_buffers``), and
read back the same way into the caller's row, whose checksum is then checked in place. A
compressed record (``codec``), a block that is not in host memory, and a record whose length is
not the expected one are read whole into staging and decoded from there. Mooncake's ``put``
keeps an object that exists already, which is harmless here: a key names its bytes, and a bad
record is removed (with ``force``, past a reader's lease) when a read finds it.

**The index follows the master**: every ``sync_interval_s`` the view lists the master's keys
through its admin HTTP (``admin_url``, ``/get_all_keys``) and adopts or forgets the difference;
lookups never touch the network. A key the master evicted is a load miss.

**Faults are misses.** A dead master (Mooncake's calls then take about 4.3 s each and return
−900) marks the tier down: stores fail and loads miss at once until the backoff runs out, and a
TCP connect to the master (``connect_timeout_s``) must succeed before a call is let through
again. A record whose segment's owner died is a transfer failure: a miss. A full pool (−200)
fails the store, counted. Nothing raises into the engine.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

from kvtier.backends.mooncake_session import (
    BUFFER_TOO_SMALL,
    NO_SPACE,
    NOT_FOUND,
    MooncakeSession,
    Staging,
    master_unreachable,
)
from kvtier.backends.remote_health import Down
from kvtier.backends.remote_rows import RowLease, is_block
from kvtier.backends.remote_tier import KEY_BYTES, ReadJob, RemoteRecordBackend, SweepSkipped, WriteJob, check_seconds

from kvtier.errors import ConfigError
from kvtier.records.codec import Codec, NoneCodec
from kvtier.records.counts import counts_add
from kvtier.records.format import (
    DEFAULT_MAC_ALGORITHM,
    decode_payload,
    decode_record,
    encode_record,
    parse_header,
    verify_payload,
)
from kvtier.records.xxcopy import rows_held
from kvtier.units import parse_size

__all__ = ["MooncakeBackend"]

log = logging.getLogger("kvtier")

_MASTER_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")
#: Blocks at least this large go as two slices, head from staging and payload straight from the
#: caller's row, and are read back the same way. Smaller ones go whole through the staging: Mooncake
#: moves each slice on its own, and measured here (64 KiB records, jobs of 128, same run) two
#: slices ran at 0.57-0.68 of a raw one-slice call where copy-then-checksum in staging ran at
#: 0.89-1.01; at 256 KiB and 2 MiB both ran at 1.0-1.1 of raw.
ZERO_COPY_MIN_BYTES = 256 << 10
#: The admin/metrics port ``mooncake_master`` listens on unless told otherwise (``--metrics_port``).
DEFAULT_ADMIN_PORT = 9003


def _check_text(field: str, value: Any, what: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or any(c.isspace() for c in value):
        raise ConfigError(f"{field}: expected {what}, got {value!r}")
    return value


def _check_http(field: str, value: Any) -> str:
    _check_text(field, value, "an http:// or https:// URL")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{field}: expected an http:// or https:// URL with a host, got {value!r}")
    return value


class MooncakeBackend(RemoteRecordBackend):
    """Records in a Mooncake Store (``master``); see the module doc."""

    name: ClassVar[str] = "mooncake"
    down_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)

    def __init__(
        self,
        *,
        capacity: int | str,
        master: str = "127.0.0.1:50051",
        metadata_server: str = "http://127.0.0.1:8080/metadata",
        protocol: str = "tcp",
        device_name: str = "",
        local_hostname: str = "127.0.0.1",
        global_segment_size: int | str = 0,
        local_buffer_size: int | str = "64MiB",
        admin_url: str | None = None,
        replica_num: int = 1,
        soft_pin_ttl_s: float | None = None,
        prefix: str = "kvtier",
        codec: str | dict[str, Any] | Codec | None = "none",
        mac_key: bytes | str | None = None,
        mac_key_env: str | None = None,
        mac_algorithm: str = DEFAULT_MAC_ALGORITHM,
        sync_interval_s: float = 1.0,
        connect_timeout_s: float = 0.5,
        admin_timeout_s: float = 5.0,
    ) -> None:
        match = _MASTER_RE.match(master) if isinstance(master, str) else None
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise ConfigError(f"master: expected the master's host:port (e.g. 10.0.0.5:50051), got {master!r}")
        super().__init__(
            capacity=capacity, where=master, prefix=prefix, codec=codec, mac_key=mac_key, mac_key_env=mac_key_env,
            mac_algorithm=mac_algorithm, sync_interval_s=sync_interval_s,
        )
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol: expected 'tcp' or 'rdma', got {protocol!r}")
        _check_text("device_name", device_name, "RDMA device names (e.g. 'mlx5_0,mlx5_1'), or ''", empty=True)
        _check_text("metadata_server", metadata_server, "the metadata server (http://host:port/metadata, or an etcd host:port)")
        _check_text("local_hostname", local_hostname, "this host's address as other hosts reach it")
        if admin_url is None:
            admin_url = f"http://{match.group(1)}:{DEFAULT_ADMIN_PORT}"
        _check_http("admin_url", admin_url)
        if isinstance(replica_num, bool) or not isinstance(replica_num, int) or replica_num < 1:
            raise ConfigError(f"replica_num: expected a positive number of replicas, got {replica_num!r}")
        if soft_pin_ttl_s is not None:
            check_seconds(soft_pin_ttl_s=soft_pin_ttl_s)
        check_seconds(connect_timeout_s=connect_timeout_s, admin_timeout_s=admin_timeout_s)
        self.master = master
        self.metadata_server = metadata_server
        self.protocol = protocol
        self.device_name = device_name
        self.local_hostname = local_hostname
        self.global_segment_size = parse_size(global_segment_size, field="global_segment_size")
        self.local_buffer_size = parse_size(local_buffer_size, field="local_buffer_size")
        self.admin_url = admin_url
        self.replica_num = replica_num
        self.soft_pin_ttl_s = None if soft_pin_ttl_s is None else float(soft_pin_ttl_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.admin_timeout_s = float(admin_timeout_s)
        self.session = MooncakeSession(
            master=master, metadata_server=metadata_server, protocol=protocol, device_name=device_name,
            local_hostname=local_hostname, global_segment_size=self.global_segment_size,
            local_buffer_size=self.local_buffer_size, admin_url=admin_url, replica_num=replica_num,
            soft_pin_ttl_ms=None if soft_pin_ttl_s is None else max(1, round(soft_pin_ttl_s * 1000)),
        )
        self._admin_warned = False
        #: Records longer than any of this tier's (left in place, not adopted again).
        self.odd_lengths = 0
        #: Records the store had no room for (−200: the pool is full, or no segment is mounted).
        self.full_refusals = 0

    def __repr__(self) -> str:
        return f"MooncakeBackend(master={self.master!r}, prefix={self.prefix!r})"

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data.update(
            master=self.master, metadata_server=self.metadata_server, protocol=self.protocol,
            device_name=self.device_name, local_hostname=self.local_hostname,
            global_segment_size=self.global_segment_size, local_buffer_size=self.local_buffer_size,
            admin_url=self.admin_url, replica_num=self.replica_num, connect_timeout_s=self.connect_timeout_s,
            admin_timeout_s=self.admin_timeout_s,
        )
        if self.soft_pin_ttl_s is not None:
            data["soft_pin_ttl_s"] = self.soft_pin_ttl_s
        return data

    async def open(self, fmt: Any) -> None:
        # Checked before anything connects: one record (head and block) must fit each half of
        # the staging, or no job could ever move.
        need = 2 * (fmt.block_bytes + self._head_bytes())
        if self.local_buffer_size < need:
            raise ConfigError(
                f"local_buffer_size: {self.local_buffer_size} bytes cannot stage one record each way "
                f"({need} bytes for {fmt.block_bytes}-byte blocks); give at least that, 64MiB is the default"
            )
        await super().open(fmt)

    # -- names on the server -------------------------------------------------------------------------
    def remote_key(self, key: bytes) -> bytes:
        return self._prefix_bytes + key.hex().encode()

    def block_key(self, rkey: bytes) -> bytes | None:
        plen = len(self._prefix_bytes)
        if len(rkey) != plen + 2 * KEY_BYTES or not rkey.startswith(self._prefix_bytes):
            return None
        try:
            return bytes.fromhex(rkey[plen:].decode())
        except ValueError:
            return None

    # -- the client ----------------------------------------------------------------------------------
    def _connect(self) -> None:
        if self.session.store is not None:
            return
        if not self.session.master_answers(self.connect_timeout_s):
            raise Down(f"the master {self.master} refuses connections")
        if not self.session.open():
            raise Down(f"the Mooncake client could not set up against {self.master} (metadata {self.metadata_server})")

    def _ready(self) -> MooncakeSession:
        """The session, connected; while the tier is down, only once the master accepts a
        connection again (a call to a dead master would wait about 4.3 s)."""
        if not self._health.up and not self.session.master_answers(self.connect_timeout_s):
            raise Down(f"the master {self.master} still refuses connections")
        self._connect()
        return self.session

    def _disconnect(self) -> None:
        self.session.close()

    def probe(self, timeout_s: float) -> str | None:
        if not self.session.master_answers(timeout_s):
            return f"mooncake {self.master}: the master does not accept connections (check master, or start mooncake_master)"
        problem = self.session.health(timeout_s)
        return None if problem is None else f"mooncake {self.master}: {problem} (check admin_url)"

    # -- the meta record -------------------------------------------------------------------------------
    def _read_meta(self) -> bytes | None:
        session = self._ready()
        key = self._meta_key.decode()
        size = session.size_of(key)
        if master_unreachable([size]):
            raise Down(f"the master {self.master} did not answer")
        if size < 0:
            return None
        staging = self._staging(session.get_staging)
        if size > staging.nbytes:
            return b""  # no meta record of ours is this large: damaged, replaced
        with staging.lock:
            got = session.get_into([key], [staging.base], [size])[0]
            if master_unreachable([got]):
                raise Down(f"the master {self.master} did not answer")
            return None if got < 0 else bytes(staging.view(0, got))

    def _write_meta(self, value: bytes, only_new: bool) -> None:
        session = self._ready()
        staging = self._staging(session.put_staging)
        key = self._meta_key.decode()
        with staging.lock:
            staging.view(0, len(value))[:] = value
            if only_new:
                rc = session.put_new(key, staging.base, len(value))
            else:
                rc = session.upsert([key], [staging.base], [len(value)])[0]
        if master_unreachable([rc]):
            raise Down(f"the master {self.master} did not answer")

    @staticmethod
    def _staging(staging: Staging | None) -> Staging:
        if staging is None:
            raise Down("the Mooncake client is closed")
        return staging

    # -- writes -------------------------------------------------------------------------------------------
    def _write_share(self, handle: Any, positions: list[int], *, job: WriteJob) -> None:
        session = self._ready()
        staging = self._staging(session.put_staging)
        session.register_rows([job.blocks[i] for i in positions])
        with staging.lock:
            pending = list(positions)
            while pending:
                done = self._put_chunk(session, staging, job, pending)
                pending = pending[done:]

    def _put_chunk(self, session: MooncakeSession, staging: Staging, job: WriteJob, pending: list[int]) -> int:
        """Put the leading records of ``pending`` that fit the staging in one call; how many."""
        keys: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        stored: list[int] = []
        sent: list[int] = []
        room, offset, base, bytes_ = staging.nbytes, 0, staging.base, staging.bytes
        hb, bb, dtype = self._head_bytes(), self.format.block_bytes, self._dtype_code()
        sliced = bb >= ZERO_COPY_MIN_BYTES
        raw_codec = self.codec.codec_id == NoneCodec.codec_id
        taken = 0
        for i in pending:
            block = job.blocks[i]
            host = block.is_cpu and block.is_contiguous()
            if keys and offset + (hb if sliced and host and raw_codec else hb + bb) > room:
                break  # the next chunk's
            taken += 1
            region = bytes_[offset + hb : offset + hb + bb]
            if host and not sliced:
                # A small block is copied next to its head (one slice), then checksummed there
                # while it is still in the CPU cache.
                with rows_held:  # no collection from the row's view to its copy (remote_rows)
                    copied = is_block(block, bb)
                    if copied:
                        region[:] = block.numpy().data
                if not copied:  # pointed at other memory since the job's checks: not sent
                    job.refused.append(i)
                    continue
                head, payload = encode_record(job.keys[i], region, self.codec, dtype, self.mac)
            elif host:  # its memory kept until the check after the put (WriteJob.moved)
                lease = job.lease(i)
                if lease is None:
                    continue  # no longer a block: not sent (WriteJob.refused)
                head, payload = self._encode_one(job.keys[i], lease.kept)
                if not lease.held():
                    continue  # its row left the memory encoded: not sent (WriteJob.left)
            else:
                head, payload = self._encode_one(job.keys[i], block)
            bytes_[offset : offset + hb] = head
            if sliced and host and len(payload) == bb:
                ptrs.append([base + offset, lease.ptr])  # the payload straight from the row's kept memory
                sizes.append([hb, bb])
                stored.append(hb + bb)
                offset += hb
            else:  # whole in staging: a small block, a compressed payload, a block off the host
                if payload is not region:
                    region[: len(payload)] = payload
                ptrs.append([base + offset])
                sizes.append([hb + len(payload)])
                stored.append(hb + len(payload))
                offset += hb + len(payload)
            keys.append(job.rkeys[i].decode())
            sent.append(i)
        if keys:
            codes = session.put_parts(keys, ptrs, sizes)
            if master_unreachable(codes):
                raise Down(f"the master {self.master} did not answer")
            for i, code, size in zip(sent, codes, stored):
                if code == 0:
                    job.sizes[i] = size
            refused = codes.count(NO_SPACE)
            if refused:  # (one add: shares run on threads of their own)
                counts_add(self, "full_refusals", refused)
        return taken

    # -- reads ----------------------------------------------------------------------------------------------
    def _read_share(self, handle: Any, positions: list[int], *, job: ReadJob) -> None:
        session = self._ready()
        staging = self._staging(session.get_staging)
        hb = self._head_bytes()
        block_bytes = self.format.block_bytes
        sliced = block_bytes >= ZERO_COPY_MIN_BYTES and self.codec.codec_id == NoneCodec.codec_id
        direct, whole = [], []
        for i in positions:
            row = job.out[i]
            if sliced and row.is_cpu and row.is_contiguous():
                direct.append(i)
            else:
                whole.append(i)
        leases = {i: RowLease(job.out[i], block_bytes) for i in direct}  # each row's memory kept until its read is checked
        session.register_rows([leases[i].kept for i in direct])  # the memory the transfers go to
        with staging.lock:
            for chunk in _chunks(direct, staging.nbytes // hb):
                keys = [job.rkeys[i].decode() for i in chunk]
                ptrs = [[staging.base + j * hb, leases[i].ptr] for j, i in enumerate(chunk)]
                codes = session.get_parts(keys, ptrs, [[hb, block_bytes]] * len(chunk))
                if master_unreachable(codes):
                    raise Down(f"the master {self.master} did not answer")
                for j, (i, code) in enumerate(zip(chunk, codes)):
                    if code == hb + block_bytes:
                        fill = self._check_in_place(job.keys[i], staging.view(j * hb, hb), code)
                        job.found[i] = self._accept(job, i, fill, lease=leases[i])
                    elif code != NOT_FOUND:
                        whole.append(i)  # another length (compressed, or junk), or a failed transfer: read it whole
            for chunk in _chunks(whole, staging.nbytes // (hb + block_bytes)):
                self._read_whole(session, staging, job, chunk, hb + block_bytes)

    def _read_whole(self, session: MooncakeSession, staging: Staging, job: ReadJob, chunk: list[int], slot: int) -> None:
        """Read records of up to ``slot`` bytes whole into staging, then check and decode them."""
        keys = [job.rkeys[i].decode() for i in chunk]
        codes = session.get_into(keys, [staging.base + j * slot for j in range(len(chunk))], [slot] * len(chunk))
        if master_unreachable(codes):
            raise Down(f"the master {self.master} did not answer")
        for j, (i, code) in enumerate(zip(chunk, codes)):
            if code >= 0:
                record = staging.view(j * slot, code)
                key = job.keys[i]
                job.found[i] = self._accept(job, i, lambda view, key=key, record=record: decode_record(key, record, view, mac=self.mac))
            elif code == BUFFER_TOO_SMALL:  # larger than any record of this format: not ours to judge
                job.unreadable.append(job.keys[i])
        odd = codes.count(BUFFER_TOO_SMALL)
        if odd:
            counts_add(self, "odd_lengths", odd)

    def _check_in_place(self, key: bytes, head: memoryview, length: int) -> Any:
        """What ``_accept`` runs for a record whose payload landed in the caller's row: check
        the header, then the checksum (or MAC) over the row where it lies."""
        mac = self.mac

        def fill(view: memoryview) -> None:
            header = parse_header(head, raw_length=len(view), available=length, mac=mac)
            if header.codec_id == NoneCodec.codec_id:
                verify_payload(key, head, header, view, mac=mac)
            else:  # a payload as long as the block but encoded: decode it from a copy
                decode_payload(key, head, header, bytes(view[: header.stored_length]), view, mac=mac)

        return fill

    # -- deletes and the index ----------------------------------------------------------------------------
    def _delete_records(self, handle: Any, rkeys: list[bytes]) -> int:
        codes = self._ready().remove([k.decode() for k in rkeys])
        if master_unreachable(codes):
            raise Down(f"the master {self.master} did not answer")
        return sum(1 for c in codes if c == 0)

    def _list_keys(self) -> Iterable[bytes]:
        prefix = self._prefix_bytes.decode()
        try:
            return [k.encode() for k in self.session.list_keys(self.admin_timeout_s) if k.startswith(prefix)]
        except OSError as exc:
            if not self.session.master_answers(self.connect_timeout_s):
                raise Down(f"the master {self.master} does not answer") from exc
            if not self._admin_warned:
                self._admin_warned = True
                log.warning("mooncake: the master %s answers but its admin_url %s does not (%s); the index "
                            "follows only this process's own writes until it does", self.master, self.admin_url, exc)
            raise SweepSkipped(str(exc)) from exc

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        data.update(master=self.master, protocol=self.protocol, odd_lengths=self.odd_lengths, full_refusals=self.full_refusals)
        if self.session.registers:
            data["registrations"] = self.session.registration_counts()
        return data


def _chunks(items: Sequence[int], most: int) -> Iterator[list[int]]:
    step = max(1, most)
    for start in range(0, len(items), step):
        yield list(items[start : start + step])

