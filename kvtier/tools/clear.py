"""``kvtier clear --config FILE [--tier N] [--yes]``: delete what a config's tiers hold.

What it deletes, per tier (``--tier N``: that tier only):

* a tier with a ``path`` (``lmdb``, ``file``): each kvtier tier directory at that path, or in
  its subfolders two levels down (the per-rank folders the vLLM and SGLang integrations make),
  and nothing else: a path that holds no tier directory is left alone, and so is any other file;
* a ``redis`` tier: every key under its ``prefix`` (``<prefix>:*``) and under the per-rank
  prefixes the engine integrations add (``<prefix>.*:*``), on every primary of a cluster;
* a memory tier (``cpu``, ``gpu``, ``compressed``): nothing; it empties when its process ends.

With ``--tenant T`` only tenant ``T``'s blocks go: in each lmdb or file tier directory, the
records its saved tenant tags give to ``T`` (and their tags and pins); a ``redis`` tier's
records tagged ``T`` in its tags hash. Blocks stored before their tenant's tags were saved (a
crash) are the default tenant's. A running engine deletes by tenant without a restart:
``store.delete(tenant=T)``, or the vLLM admin endpoint.

It lists what it will delete and asks first; ``--yes`` skips the question (a script must pass
it: without a terminal to ask on, nothing is deleted). Stop the engines that use the tiers first.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Doomed", "add_parser", "plan_clear", "redis_keys"]


@dataclass(frozen=True, slots=True)
class Doomed:
    """One thing ``kvtier clear`` deletes, and how."""

    tier: int
    what: str
    delete: Callable[[], int]  # returns how many items (folders, keys) went


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _tenant_records(index: int, folder: Path, tenant: str) -> list[Doomed]:
    """The records of ``tenant`` in the tier directory ``folder``, by its saved tags."""
    from kvtier.backends.tag_log import TAG_LOG_NAME, read_tag_log, write_tag_log
    from kvtier.tools.offline import _backend_class, detect_tier

    log_path = str(folder / TAG_LOG_NAME)
    owners, pins = read_tag_log(log_path)
    keys = [key for key, owner in owners.items() if owner == tenant]
    if not keys:
        return []
    cls = _backend_class(detect_tier(folder))

    def delete() -> int:
        gone = int(cls.delete_raw_records(folder, keys))
        doomed = set(keys)
        kept = [(key, owner) for key, owner in owners.items() if key not in doomed]
        write_tag_log(log_path, kept, [(key, True) for key in pins if key not in doomed], whole=True)
        return gone

    return [Doomed(index, f"tiers[{index}]: {len(keys):,} blocks of tenant {tenant!r} in {folder}", delete)]


def _path_tier(index: int, path: str, tenant: str | None = None) -> list[Doomed]:
    from kvtier.errors import ConfigError
    from kvtier.tools.offline import find_tiers

    if not Path(path).is_dir():
        return []
    try:
        folders = find_tiers(path)
    except ConfigError:
        return []
    out = []
    for folder in folders:
        if tenant is not None:
            out += _tenant_records(index, folder, tenant)
            continue
        size = _folder_bytes(folder)

        def delete(folder: Path = folder) -> int:
            shutil.rmtree(folder)
            return 1

        out.append(Doomed(index, f"tiers[{index}]: folder {folder} ({size:,} bytes)", delete))
    return out


def redis_keys(index: int, backend: Any, tenant: str | None = None) -> list[Doomed]:
    """The keys under a redis tier's prefixes (or only ``tenant``'s records, by the tier's tags
    hash), as one deletion (none: an empty list)."""
    import redis
    from redis.cluster import RedisCluster

    options: dict[str, Any] = {"socket_timeout": 10, "socket_connect_timeout": 5}
    if getattr(backend, "username", None):
        options["username"] = backend.username
    if getattr(backend, "_password", None):
        options["password"] = backend._password
    for ours, theirs in (("tls_ca_file", "ssl_ca_certs"), ("tls_cert_file", "ssl_certfile"), ("tls_key_file", "ssl_keyfile")):
        if (getattr(backend, "tls", None) or {}).get(ours):
            options[theirs] = backend.tls[ours]
    client: Any = RedisCluster.from_url(backend.url, **options) if backend.cluster else redis.Redis.from_url(backend.url, **options)
    nodes = [client.get_redis_connection(n) for n in client.get_primaries()] if backend.cluster else [client]
    patterns = [f"{backend.prefix}:*", f"{backend.prefix}.*:*"]
    if tenant is not None:
        return _redis_tenant(index, backend, client, nodes, patterns, tenant)
    keys = [(node, key) for node in nodes for pattern in patterns for key in node.scan_iter(match=pattern, count=1000)]

    def delete() -> int:
        gone = 0
        for node in nodes:
            mine = [k for n, k in keys if n is node]
            for i in range(0, len(mine), 500):
                gone += int(node.unlink(*mine[i : i + 500]))
        client.close()
        return gone

    if not keys:
        client.close()
        return []
    where = f"redis {backend.url} keys {' and '.join(patterns)}"
    return [Doomed(index, f"tiers[{index}]: {len(keys):,} {where}", delete)]


def _redis_tenant(index: int, backend: Any, client: Any, nodes: list[Any], patterns: list[str], tenant: str) -> list[Doomed]:
    """``tenant``'s records of a redis tier, by the tags hash of each namespace under its prefixes."""
    from kvtier.backends.redis_keylog import DELETED, KEYLOG_SUFFIX, entries_of
    from kvtier.backends.redis_slotlogs import slot_entries
    from kvtier.backends.redis_tags import PINS_SUFFIX, TAGS_SUFFIX, read_redis_tags

    found: list[tuple[bytes, list[bytes]]] = []  # (namespace prefix, record keys)
    for node in nodes:
        for pattern in patterns:
            for hash_key in node.scan_iter(match=pattern[:-1] + "*:" + TAGS_SUFFIX.decode(), count=1000):
                prefix = bytes(hash_key)[: -len(TAGS_SUFFIX)]
                owners, _ = read_redis_tags(client, prefix)
                mine = [key for key, owner in owners.items() if owner == tenant]
                if mine:
                    found.append((prefix, mine))

    def delete() -> int:
        gone = 0
        for prefix, keys in found:
            for i in range(0, len(keys), 500):
                part = keys[i : i + 500]
                gone += sum(int(client.unlink(prefix + key)) for key in part)  # one slot per key in a cluster
                # the next open's key log (a cluster's slot logs) replays the deletions
                for name, entries in slot_entries(prefix, part, DELETED) if backend.cluster else [(prefix + KEYLOG_SUFFIX, entries_of(part, DELETED))]:
                    client.append(name, entries)
                client.hdel(prefix + TAGS_SUFFIX, *part)
                client.srem(prefix + PINS_SUFFIX, *part)
        client.close()
        return gone

    if not found:
        client.close()
        return []
    total = sum(len(keys) for _, keys in found)
    return [Doomed(index, f"tiers[{index}]: {total:,} records of tenant {tenant!r} in redis {backend.url} under {backend.prefix!r}", delete)]


def plan_clear(cfg: Any, only: int | None = None, tenant: str | None = None) -> tuple[list[Doomed], list[str]]:
    """What clearing ``cfg``'s tiers (or tier ``only``; or only ``tenant``'s blocks) deletes,
    and notes on the tiers it skips."""
    from kvtier import registry
    from kvtier.config import build_backend
    from kvtier.errors import ConfigError

    if only is not None and not 0 <= only < len(cfg.tiers):
        raise ConfigError(f"--tier: {only} is not a tier of this config (it has tiers 0 to {len(cfg.tiers) - 1})")
    doomed: list[Doomed] = []
    notes: list[str] = []
    for i, tier in enumerate(cfg.tiers):
        if only is not None and i != only:
            continue
        options = tier.options()
        if isinstance(options.get("path"), str):
            found = _path_tier(i, options["path"], tenant)
            doomed += found
            if not found:
                what = f"no block of tenant {tenant!r}" if tenant is not None else "no kvtier tier directory"
                notes.append(f"tiers[{i}] ({tier.backend}): {what} at {options['path']}")
        elif tier.backend == "redis":
            try:
                found = redis_keys(i, build_backend(tier, i), tenant)
            except Exception as exc:  # a server down is the operator's to fix first
                raise ConfigError(f"tiers[{i}] (redis): cannot list its keys: {type(exc).__name__}: {exc}") from exc
            doomed += found
            if not found:
                notes.append(f"tiers[{i}] (redis): no keys under prefix {options.get('prefix', 'kvtier')!r}")
        elif getattr(registry.backends.get(tier.backend), "persistent", False):
            notes.append(f"tiers[{i}] ({tier.backend}): kvtier clear does not know where this plugin keeps its data")
        else:
            notes.append(f"tiers[{i}] ({tier.backend}): a memory tier; nothing outlives its process")
    return doomed, notes


def _cmd_clear(args: argparse.Namespace) -> int:
    from kvtier.config import load_config_file

    cfg = load_config_file(args.config)
    doomed, notes = plan_clear(cfg, args.tier, args.tenant)
    for note in notes:
        print(note)
    if not doomed:
        print("nothing to delete")
        return 0
    print("kvtier clear will delete:")
    for d in doomed:
        print(f"  {d.what}")
    if not args.yes:
        if not sys.stdin.isatty():
            print("kvtier clear: not deleting without --yes (no terminal to ask on)", file=sys.stderr)
            return 1
        answer = input("delete these? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("nothing deleted")
            return 1
    gone = sum(d.delete() for d in doomed)
    print(f"deleted {gone:,} item{'s' if gone != 1 else ''} ({len(doomed)} folder or key set{'s' if len(doomed) != 1 else ''})")
    return 0


def add_parser(sub: Any) -> None:
    clear = sub.add_parser(
        "clear", help="delete what a config's tiers hold (asks first)",
        description="Delete what the tiers of a config file hold: each lmdb or file tier directory at a tier's path "
        "(with the per-rank folders engine integrations make), each redis tier's keys under its prefix. Memory "
        "tiers hold nothing between processes. Lists what it will delete and asks first. Stop the engines first.",
    )
    clear.add_argument("--config", required=True, metavar="FILE", help="the kvtier config file (KVTIER_* overrides apply)")
    clear.add_argument("--tier", type=int, metavar="N", help="only tier N (0 is the first)")
    clear.add_argument("--tenant", metavar="T", help="only the blocks of tenant T (by the tiers' saved tenant tags)")
    clear.add_argument("--yes", "-y", action="store_true", help="do not ask (needed without a terminal)")
    clear.set_defaults(func=_cmd_clear)
