"""The admin endpoint under vLLM: pin, unpin and delete prompts by token ids, delete a tenant,
and list usage per tenant per tier, while the engine runs (no vLLM import).

A small HTTP server in the scheduler's process (the connector's scheduler side), on its own
thread. **Off by default**: it runs only when ``kv_connector_extra_config`` has an ``admin``
section. It binds ``127.0.0.1`` unless told otherwise, and every call must carry the token
(``Authorization: Bearer <token>``), given as ``token``, ``token_file`` or ``token_env``; the
token is never logged. Routes (JSON in, JSON out; ``docs/operations.md`` has a worked example):

* ``GET /v1/usage``: blocks, bytes, hits, evictions, pins per tenant per tier; ``GET /metrics``
  the same as Prometheus's ``kvtier_tenant_*`` series (top N tenants, ids hashed if asked);
* ``POST /v1/lookup``, ``/v1/pin``, ``/v1/unpin``, ``/v1/delete`` with ``token_ids`` and
  optionally ``cache_salt`` (the tenant; ``tenant`` is the same field) and, to pin, ``tier``;
  ``/v1/delete`` with ``tenant`` alone deletes every block of that tenant.

Bad input gets a 4xx naming the problem and changes nothing: 400 (a field), 401 (the token),
404 / 405 (route, method), 409 (a pin over a tier's pin budget), 413 (body too large), 503
(the engine has not opened its tiers yet). A call that finds nothing to do answers 200 with
``"noop": true``. What each call does to the scheduler side and the ranks, and why it never
blocks the step loop: :mod:`.admin_ops`.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvtier.errors import ConfigError, QuotaError
from kvtier.integrations.vllm.admin_ops import AdminOps, NotReady, check_token_ids

__all__ = ["AdminServer", "AdminSettings", "admin_settings"]

log = logging.getLogger("kvtier.vllm")

#: the shortest token accepted (characters)
MIN_TOKEN_LEN = 16
_FIELDS = {"host", "port", "token", "token_file", "token_env", "max_tokens", "wait_s"}


@dataclass(frozen=True)
class AdminSettings:
    """``kv_connector_extra_config.admin``; the token never appears in ``repr``."""

    token: str = field(repr=False)
    host: str = "127.0.0.1"
    port: int = 0
    #: token ids one call may name
    max_tokens: int = 1 << 20
    #: seconds a delete waits for loads still reading its blocks before it skips them
    wait_s: float = 2.0


def admin_settings(extra_config: Mapping[str, Any]) -> AdminSettings | None:
    """The endpoint's settings from vLLM's ``kv_connector_extra_config`` (``None``: off)."""
    raw = extra_config.get("admin")
    if raw is None or raw is False:
        return None
    where = "kv_connector_extra_config.admin"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping (host, port, token / token_file / token_env)")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown field; the fields are {sorted(_FIELDS)}")
    given = [name for name in ("token", "token_file", "token_env") if raw.get(name) is not None]
    if len(given) != 1:
        raise ConfigError(f"{where}: give exactly one of token, token_file or token_env (got {given or 'none'})")
    source = given[0]
    value = raw[source]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.{source}: expected a non-empty string")
    if source == "token_file":
        try:
            with open(value, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"{where}.token_file: cannot read {value!r}: {exc.strerror}") from None
    elif source == "token_env":
        token = os.environ.get(value, "").strip()
        if not token:
            raise ConfigError(f"{where}.token_env: environment variable {value!r} is not set or empty")
    else:
        token = value
    if len(token) < MIN_TOKEN_LEN:
        raise ConfigError(f"{where}.{source}: the token must have at least {MIN_TOKEN_LEN} characters")
    host = raw.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"{where}.host: expected a host name or address, got {host!r}")
    port = raw.get("port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"{where}.port: expected a port number 0-65535 (0: any free port), got {port!r}")
    max_tokens = raw.get("max_tokens", AdminSettings.max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"{where}.max_tokens: expected a positive integer, got {max_tokens!r}")
    wait_s = raw.get("wait_s", AdminSettings.wait_s)
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= 60:
        raise ConfigError(f"{where}.wait_s: expected seconds between 0 and 60, got {wait_s!r}")
    return AdminSettings(token=token, host=host, port=port, max_tokens=max_tokens, wait_s=float(wait_s))


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _salt(body: Mapping[str, Any]) -> str | None:
    """The prompt's ``cache_salt`` (``None``: no salt). ``tenant`` names the same thing under
    vLLM, with ``default`` for the requests without a salt."""
    salt, tenant = body.get("cache_salt"), body.get("tenant")
    if salt is not None and tenant is not None and salt != tenant:
        raise ConfigError("cache_salt / tenant: give one (they are the same under vLLM), or the same value")
    if salt is None:
        if tenant is None or tenant == "default":
            return None  # a request without a salt: the default tenant
        salt = tenant
    if not isinstance(salt, str) or not salt:
        raise ConfigError(f"cache_salt: expected a non-empty string, got {salt!r}")
    return salt


_PREFIX_FIELDS = {"token_ids", "cache_salt", "tenant"}
_ROUTES: dict[str, set[str]] = {
    "/v1/lookup": _PREFIX_FIELDS,
    "/v1/pin": _PREFIX_FIELDS | {"tier"},
    "/v1/unpin": _PREFIX_FIELDS | {"tier"},
    "/v1/delete": _PREFIX_FIELDS,
}


class AdminServer:
    """The endpoint: an HTTP server on its own daemon thread over :class:`AdminOps`."""

    def __init__(self, settings: AdminSettings, ops: AdminOps) -> None:
        self.settings = settings
        self.ops = ops
        self._expected = f"Bearer {settings.token}".encode()
        try:
            self._server = ThreadingHTTPServer((settings.host, settings.port), self._handler())
        except OSError as exc:
            raise ConfigError(
                f"kv_connector_extra_config.admin: cannot listen on {settings.host}:{settings.port}: {exc.strerror}"
            ) from None
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtier-admin", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> AdminServer:
        self._thread.start()
        host, port = self.address
        log.info("kvtier: admin endpoint on http://%s:%d (token required)", host, port)
        if host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("kvtier: admin endpoint listens on %s, not only on this host", host)
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    # -- requests --------------------------------------------------------------------------
    def authorised(self, header: str | None) -> bool:
        return header is not None and hmac.compare_digest(header.encode(), self._expected)

    def handle(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """One call (after the token check): (HTTP status, JSON answer). Never raises."""
        try:
            return 200, self._route(method, path, body)
        except HttpError as exc:
            return exc.status, {"error": str(exc)}
        except QuotaError as exc:
            return 409, {"error": str(exc)}
        except ConfigError as exc:
            return 400, {"error": str(exc)}
        except NotReady as exc:
            return 503, {"error": str(exc)}
        except Exception as exc:  # never a dead endpoint thread; the engine goes on
            log.exception("kvtier: admin call %s %s failed", method, path)
            return 500, {"error": f"internal error: {type(exc).__name__}"}

    def _route(self, method: str, path: str, body: Any) -> dict[str, Any]:
        if path == "/metrics":
            raise HttpError(405, f"{path}: use GET")
        if path == "/v1/usage":
            if method != "GET":
                raise HttpError(405, f"{path}: use GET")
            return {"tiers": self.ops.usage()}
        fields = _ROUTES.get(path)
        if fields is None:
            raise HttpError(404, f"no route {path}; the routes are /metrics, /v1/usage and {', '.join(sorted(_ROUTES))}")
        if method != "POST":
            raise HttpError(405, f"{path}: use POST with a JSON body")
        if not isinstance(body, dict):
            raise ConfigError("body: expected a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown field for {path}; the fields are {sorted(fields)}")
        if path == "/v1/delete" and "token_ids" not in body:
            tenant = body.get("tenant", body.get("cache_salt"))
            if tenant is None:
                raise ConfigError("delete: give token_ids (and cache_salt), or tenant alone")
            if body.get("cache_salt", tenant) != tenant:
                raise ConfigError("cache_salt / tenant: give one (they are the same under vLLM), or the same value")
            return self.ops.delete_tenant(tenant, wait_s=self.settings.wait_s)
        tokens = check_token_ids(body.get("token_ids"), limit=self.settings.max_tokens)
        salt = _salt(body)
        if path == "/v1/lookup":
            return self.ops.lookup(tokens, salt)
        if path == "/v1/pin":
            return self.ops.pin(tokens, salt, body.get("tier"))
        if path == "/v1/unpin":
            return self.ops.unpin(tokens, salt, body.get("tier"))
        return self.ops.delete_prefix(tokens, salt, wait_s=self.settings.wait_s)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "kvtier-admin"
            MAX_BODY = 16 << 20

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("kvtier admin: %s %s", self.command, self.path.split("?")[0])

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self) -> None:
                path = self.path.split("?")[0]
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not server.authorised(self.headers.get("Authorization")):
                    log.warning("kvtier: admin call %s %s refused: bad or missing token", self.command, path)
                    self._answer(401, {"error": "Authorization: expected 'Bearer <token>' with the admin token"})
                    return
                if not 0 <= length <= self.MAX_BODY:
                    self._answer(413, {"error": f"body: at most {self.MAX_BODY} bytes with a Content-Length"})
                    return
                body: Any = None
                if length:
                    try:
                        body = json.loads(self.rfile.read(length))
                    except ValueError as exc:
                        self._answer(400, {"error": f"body: not JSON ({exc})"})
                        return
                if path == "/metrics" and self.command == "GET":
                    self._metrics()
                    return
                status, payload = server.handle(self.command, path, body)
                self._answer(status, payload)

            def _metrics(self) -> None:
                try:
                    data = server.ops.metrics()
                except NotReady as exc:
                    self._answer(503, {"error": str(exc)})
                    return
                except ImportError:
                    self._answer(501, {"error": "/metrics needs prometheus_client: pip install 'kvtier[metrics]'"})
                    return
                except Exception as exc:  # never a dead endpoint thread
                    log.exception("kvtier: admin /metrics failed")
                    self._answer(500, {"error": f"internal error: {type(exc).__name__}"})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = _serve
            do_POST = _serve
            do_PUT = _serve
            do_DELETE = _serve

        return Handler
