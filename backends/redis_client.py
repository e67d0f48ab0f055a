"""How the ``redis`` tier reaches its server: the URL and its credentials, redis-py's options, and
what a failed probe means.

A password in the URL (``redis://user:secret@host``, or ``?password=secret`` in its query) is
moved out of it at construction, so the URL kept (for ``repr``, ``to_dict`` and every log line)
holds no secret; the password itself follows :mod:`kvtier.backends.remote_secrets`.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from kvtier.backends.remote_secrets import Secret, read_secret

from kvtier.errors import ConfigError, MissingDependencyError

try:
    import redis
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import InvalidResponse
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - redis is a dependency; a broken install says so
    raise MissingDependencyError(f"the redis backend needs redis-py: pip install 'redis[hiredis]' ({exc})") from exc

__all__ = ["client_options", "credentials", "probe_problem", "split_url"]

#: Socket read size of the hiredis parser, redis-py's default: each connection keeps a buffer of
#: this size for as long as it lives, and redis-py only reads small replies here (a job's records
#: and a key log's entries go through :mod:`kvtier.backends.redis_wire`). At 1 MiB, the seven
#: connections a cluster's store holds after its open kept 7 MB resident (7 B per key at 10^6).
SOCKET_READ_BYTES = 1 << 16


def split_url(url: str) -> tuple[str, str | None, str | None]:
    """``(url without credentials, username, password)``; checks the scheme. Credentials come
    out of the user part (``redis://user:secret@host``) and out of the query
    (``?username=...&password=...``, which redis-py accepts too): the URL kept (for ``repr``,
    ``to_dict`` and every log line) holds neither."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"url: expected a redis:// or rediss:// URL, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"url: expected a redis:// or rediss:// URL, got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise ConfigError("url: the URL names no host")
    found = {"username": unquote(parts.username) if parts.username else None}
    found["password"] = unquote(parts.password) if parts.password is not None else None
    query = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in found:
            query.append((name, value))
        elif found[name] is not None:
            raise ConfigError(f"url: the {name} is given twice in the URL (user part or query)")
        else:
            found[name] = value
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    clean = urlunsplit((parts.scheme, netloc, parts.path, urlencode(query), ""))
    return clean, found["username"], found["password"]


def credentials(url: str, username: str | None, password: str | None, password_env: str | None) -> tuple[str, str | None, Secret]:
    """``(url without credentials, username, password)``: the password given inline, through
    ``password_env`` or in the URL, one way only."""
    clean, url_user, url_password = split_url(url)
    if url_user is not None and username is not None and url_user != username:
        raise ConfigError("username: given both in the URL and as an option, with different values")
    secret = read_secret("password", password, "password_env", password_env, also={"url": url_password})
    return clean, username if username is not None else url_user, secret


def probe_problem(exc: BaseException, url: str) -> str:
    """What a failed probe means, in the operator's terms (the exception's own text kept)."""
    text = f"{type(exc).__name__}: {exc}"
    causes = [exc, exc.__cause__, exc.__context__]
    if any(isinstance(c, ssl.SSLError) for c in causes) or "SSL" in str(exc):
        return f"the TLS handshake failed (check tls_ca_file, tls_cert_file, tls_key_file): {text}"
    if url.startswith("rediss://") and isinstance(exc, RedisTimeoutError):
        return f"no TLS handshake within the timeout (is this the server's TLS port?): {text}"
    if isinstance(exc, InvalidResponse):
        return f"what answered is not a Redis server (check host and port): {text}"
    upper = str(exc).upper()
    if isinstance(exc, redis.AuthenticationError) or any(w in upper for w in ("WRONGPASS", "NOAUTH", "NOPERM", "INVALID USERNAME")):
        return f"authentication refused (check username and password / password_env): {text}"
    if "DB INDEX" in upper:
        return f"the database number in the URL does not exist on the server: {text}"
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
        return f"not reachable (check host and port, or raise connect_timeout_s): {text}"
    return f"the server refused the connection: {text}"


def client_options(
    username: str | None, password: str | None, tls: dict[str, str | None], timeout: float, connect_timeout: float, connections: int
) -> dict[str, Any]:
    """Keyword arguments for redis-py's ``from_url`` (secrets included: never log them)."""
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": connect_timeout,
        "socket_read_size": SOCKET_READ_BYTES,
        "max_connections": connections,
        "health_check_interval": 0,
        "protocol": 2,  # the wire module reads RESP2 replies
    }
    if username is not None:
        options["username"] = username
    if password is not None:
        options["password"] = password
    for ours, theirs in (("tls_ca_file", "ssl_ca_certs"), ("tls_cert_file", "ssl_certfile"), ("tls_key_file", "ssl_keyfile")):
        if tls.get(ours):
            options[theirs] = tls[ours]
    return options
