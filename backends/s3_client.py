"""A thin S3 client for the ``s3`` tier: batched, concurrent puts, gets, deletes and paged listing.

The client is ``obstore`` (Rust ``object_store`` under Python), chosen by measurement
(``benchmarks/bench_s3_clients.py``: against SeaweedFS on loopback it was the fastest of
``boto3``, ``obstore`` and NIXL's ``OBJ`` plugin in every cell, put and get, 64 KiB and 2 MiB).
A batch is one call from the tier's thread: its requests are gathered on one private event loop
(a thread of this client's), at most ``concurrency`` in flight, while obstore's own runtime moves
the bytes. A put sends the record's head and payload as two buffers of one ``PUT`` (no join,
never multipart): an object is written whole or not at all, so no partial object is ever
readable. A get returns obstore's buffer (no copy); the tier checks and decodes it into the
caller's row.

Errors come out as three kinds, which is all the tier needs to know:

* a missing object is ``None`` (a miss: evicted by a lifecycle rule, a TTL, another host);
* :class:`S3Refused`: the server answered but refused (wrong keys, no such bucket, 401/403);
* :class:`S3Down`: anything else (no connection, a timeout, a 5xx such as SeaweedFS's "no
  writable volumes"): the tier marks the server down and backs off.

Retries are off (``max_retries`` 0): the tier's health and backoff decide when to try again, and
a dead server costs one refused connection per backoff, never a retry loop inside a job.
Credentials are passed to obstore and kept nowhere else; they never appear in ``repr``, in an
error or in a log line.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from kvtier.errors import MissingDependencyError

try:
    import obstore
    from obstore.exceptions import AlreadyExistsError, BaseError, PermissionDeniedError, UnauthenticatedError
    from obstore.store import S3Store
except ImportError as exc:  # pragma: no cover - depends on the install
    raise MissingDependencyError(f"the s3 backend needs obstore: pip install 'kvtier[s3]' ({exc})") from exc

__all__ = ["S3Client", "S3Down", "S3Refused"]

T = TypeVar("T")


class S3Down(Exception):
    """The server could not be reached or failed (connection, timeout, 5xx)."""


class S3Refused(Exception):
    """The server refused the request (credentials, permissions, a missing bucket)."""


_CODE_RE = re.compile(r"<Code>([^<]{1,64})</Code>")
_MESSAGE_RE = re.compile(r"<Message>([^<]{1,200})</Message>")
#: S3 error codes of a request the server refused (the caller's fault, not an outage).
_REFUSALS = ("NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidBucketName")


def _short(exc: BaseException) -> str:
    """One line for a log: the first line of obstore's error (its later lines are a debug dump
    of the request) without the XML body, plus the S3 error code and message from that body."""
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else ""
    first = first.split(": <?xml", 1)[0]
    code, message = _CODE_RE.search(text), _MESSAGE_RE.search(text)
    if code is not None:
        first += f" ({code.group(1)}{': ' + message.group(1) if message else ''})"
    return f"{type(exc).__name__}: {first}"[:500]


def _translate(exc: BaseException) -> BaseException | None:
    """``None`` for a missing object, else the :class:`S3Down` / :class:`S3Refused` to raise."""
    if isinstance(exc, FileNotFoundError):
        return None
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)):
        return S3Refused(_short(exc))
    text = str(exc)
    if any(code in text for code in _REFUSALS) or " 403 Forbidden" in text or " 401 Unauthorized" in text:
        return S3Refused(_short(exc))
    return S3Down(_short(exc))


class S3Client:
    """One bucket on one S3 endpoint; every method blocks its calling thread and may be called
    from several threads at once."""

    def __init__(
        self,
        *,
        endpoint_url: str | None,
        bucket: str,
        region: str,
        access_key_id: str | None,
        secret_access_key: str | None,
        timeout_s: float,
        connect_timeout_s: float,
        concurrency: int,
    ) -> None:
        config: dict[str, Any] = {"region": region}
        if endpoint_url:
            config.update(endpoint=endpoint_url, virtual_hosted_style_request=False)
        if access_key_id is not None and secret_access_key is not None:
            config.update(access_key_id=access_key_id, secret_access_key=secret_access_key)
        else:
            config["skip_signature"] = True
        self._store = S3Store(
            bucket,
            config=config,  # type: ignore[arg-type]
            client_options={
                "allow_http": bool(endpoint_url and endpoint_url.startswith("http://")),
                "timeout": f"{max(1, round(timeout_s * 1000))}ms",
                "connect_timeout": f"{max(1, round(connect_timeout_s * 1000))}ms",
                "pool_max_idle_per_host": str(concurrency),
            },
            retry_config={
                "max_retries": 0,
                "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(milliseconds=50), "base": 2.0},
                "retry_timeout": timedelta(seconds=timeout_s),
            },
        )
        self.concurrency = concurrency
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "S3Client(<credentials hidden>)"

    # -- the private event loop ----------------------------------------------------------------
    def _run(self, coro: Awaitable[T]) -> T:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="kvtier-s3-loop", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()  # type: ignore[arg-type]

    async def _gather(self, calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(call: Callable[[], Awaitable[T]]) -> T | BaseException:
            async with gate:
                try:
                    return await call()
                except Exception as exc:  # sorted by the caller: a miss, refused or down
                    return exc

        return list(await asyncio.gather(*(one(c) for c in calls)))

    def close(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            if not thread.is_alive():
                loop.close()

    @staticmethod
    def _raise_first(results: Sequence[Any]) -> None:
        """Raise the batch's first refusal, else its first failure (missing objects are fine).
        An error that is not the client's (a bug in a callback) is raised as it is."""
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors:
            if not isinstance(error, (BaseError, OSError)):
                raise error
        failures = [t for t in map(_translate, errors) if t is not None]
        for kind in (S3Refused, S3Down):
            for failure in failures:
                if isinstance(failure, kind):
                    raise failure

    # -- batches ---------------------------------------------------------------------------------
    def put_many(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> None:
        """Store each object whole from its buffers (sent in order, not joined). Raises
        :class:`S3Down` / :class:`S3Refused` if any put failed: the objects that did land are
        whole and valid, and the caller fails the batch (a miss later, never wrong data)."""
        store = self._store

        def put(key: str, buffers: Sequence[Any]) -> Callable[[], Awaitable[Any]]:
            return lambda: obstore.put_async(store, key, list(buffers), use_multipart=False)

        self._raise_first(self._run(self._gather([put(k, p) for k, p in zip(keys, parts)])))

    def get_many(self, keys: Sequence[str], on_record: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Each object's bytes (a buffer), or ``None`` where it does not exist. With
        ``on_record``, each object is handed to ``on_record(position, buffer)`` on the client's
        loop as soon as it arrives (while the others are still in flight) and not kept: the
        list then says only which were found (``True``) and which were missing (``None``)."""
        store = self._store

        def get(i: int, key: str) -> Callable[[], Awaitable[Any]]:
            async def fetch() -> Any:
                buffer = await (await obstore.get_async(store, key)).bytes_async()
                if on_record is None:
                    return buffer
                on_record(i, buffer)
                return True

            return fetch

        results = self._run(self._gather([get(i, k) for i, k in enumerate(keys)]))
        self._raise_first(results)
        return [None if isinstance(r, BaseException) else r for r in results]

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete them (missing ones are not an error), in batches of up to 1000 per request."""
        store = self._store
        batches = [list(keys[i : i + 1000]) for i in range(0, len(keys), 1000)]

        def delete(batch: list[str]) -> Callable[[], Awaitable[Any]]:
            return lambda: obstore.delete_async(store, batch)

        self._raise_first(self._run(self._gather([delete(b) for b in batches])))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` unless it exists; whether this call created it. A server that does
        not honour conditional puts overwrites (harmless for the meta record: same value)."""
        async def create() -> Any:
            return await obstore.put_async(self._store, key, data, mode="create", use_multipart=False)

        try:
            self._run(create())
        except AlreadyExistsError:
            return False
        except Exception as exc:
            raise (_translate(exc) or S3Down(_short(exc))) from exc
        return True

    def list_keys(self, prefix: str, page: int) -> Iterator[str]:
        """Every object name under ``prefix``, ``page`` names per request (``ListObjectsV2``
        pages, fetched one at a time as the caller iterates)."""
        stream = obstore.list(self._store, prefix=prefix, chunk_size=page)
        while True:
            try:
                batch = self._run(self._next_page(stream))
            except Exception as exc:
                raise (_translate(exc) or S3Down(_short(exc))) from exc
            if batch is None:
                return
            for meta in batch:
                yield meta["path"]

    @staticmethod
    async def _next_page(stream: Any) -> Any:
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None

    def probe_bucket(self, prefix: str) -> None:
        """One listing request of at most one name: raises :class:`S3Down` / :class:`S3Refused`."""
        for _ in self.list_keys(prefix, 1):
            return
