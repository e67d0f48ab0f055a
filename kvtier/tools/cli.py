"""The ``kvtier`` command: one entry point, one subcommand per job.

``kvtier config check FILE``   validate a config file and print the resolved tiers
``kvtier config show [FILE]``  print the default config, or FILE as kvtier reads it (``--sim``: ``kvtier sim``'s tiers)
``kvtier cache show|clear``    what kvtier keeps in its cache directory; remove it
``kvtier clear --config FILE`` delete what a config's tiers hold (asks first; ``--tier N``, ``--yes``)
``kvtier inspect PATH``        blocks, bytes, namespaces, codecs and format of an lmdb or file tier
``kvtier verify PATH``         check every record's checksum (``--delete`` removes bad ones)
``kvtier bench``               run the shipped benchmarks into ./kvtier-bench/ (results.json, logs, a PNG with matplotlib)
``kvtier bench --config FILE`` measure a config's tiers where they are configured (:mod:`kvtier.tools.bench.configured`)
``kvtier sim``                 the workload simulator (registered by :mod:`kvtier.sim.cli`)

Output is a readable table on stdout; ``--json`` prints one JSON document instead. Progress of
long operations goes to stderr, and only when stderr is a terminal. Exit status: 0 success,
1 a problem was found (invalid config, bad records, a failed benchmark), 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierError
from kvtier.tools.output import print_json as _print_json
from kvtier.tools.output import table as _table

__all__ = ["build_parser", "main"]


# -- output helpers ------------------------------------------------------------------------


class _ProgressBar:
    """A one-line progress bar on stderr; silent when stderr is not a terminal."""

    def __init__(self, label: str, stream: Any = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        width = 30
        frac = done / total if total else 1.0
        bar = "#" * int(frac * width)
        self.stream.write(f"\r{self.label} [{bar:<{width}}] {done}/{total}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _size(n: int | None) -> str:
    from kvtier.units import format_size

    return "-" if n is None else format_size(n)


# -- config --------------------------------------------------------------------------------


def _namespace_line(fields: dict[str, Any], given: dict[str, Any]) -> str:
    """The namespace a store of this config uses (``given``: the fields the config sets),
    defaults left out but for model_id."""
    from kvtier.keys import Namespace

    defaults = {f.name: f.default for f in dataclasses.fields(Namespace) if f.init}
    shown = [f"model_id={fields['model_id']}"]
    shown += [f"{k}={v}" for k, v in fields.items() if k not in ("model_id", "tenant_salt") and v != defaults.get(k)]
    if fields.get("tenant_salt"):
        shown.append("tenant_salt=(set)")
    note = ""
    if "model_id" not in given:
        note = "  (namespace.model_id not set: the default; an engine integration sets the engine's model)"
    return "namespace: " + ", ".join(shown) + note


def _cmd_config_check(args: argparse.Namespace) -> int:
    from kvtier.config import load_config_file
    from kvtier.config.deploy import check_deployment, tier_slots
    from kvtier.errors import ConfigError
    from kvtier.keys import Namespace
    from kvtier.units import parse_size

    cfg = load_config_file(args.file, env=not args.no_env, block_bytes=args.block_bytes)
    probe = args.probe_timeout if args.probe_timeout > 0 else None
    findings = [] if args.no_deploy_check else check_deployment(cfg, probe_timeout_s=probe)
    errors = [f for f in findings if f.severity == "error"]
    block = cfg.block_bytes or (parse_size(args.block_bytes, field="--block-bytes") if args.block_bytes else None)
    namespace = Namespace.from_dict(cfg.namespace_fields()).to_dict()
    tiers: list[dict[str, Any]] = []
    for i, tier in enumerate(cfg.tiers):
        options = {k: v for k, v in tier.options().items() if k != "capacity"}
        slots, more = tier_slots(cfg, i, block) if block else (None, False)
        tiers.append(
            {
                "index": i,
                "name": tier.name or tier.backend,
                "backend": tier.backend,
                "capacity_bytes": tier.capacity,
                "slots": slots,
                "slots_may_grow": more,
                "policy": tier.policy or cfg.policy,
                "options": options,
            }
        )
    model = None
    if args.model is not None:
        from kvtier.config.sizing import read_model_config

        model = read_model_config(args.model, kv_dtype=args.kv_dtype)
        for flag, value in (("--tp", args.tp), ("--block-size", args.block_size)):
            if value < 1:
                raise ConfigError(f"{flag}: {value} is not a positive integer")
    if args.json:
        _print_json(
            {
                "model": None if model is None else {**model.to_dict(), **_model_sizes(model, args)},
                "file": str(args.file),
                "valid": not errors,
                "deploy_checked": not args.no_deploy_check,
                "findings": [f.to_dict() for f in findings],
                "block_bytes": block,
                "namespace": namespace,
                "config": cfg.to_dict(),
                "tiers": tiers,
            }
        )
        return 1 if errors else 0
    if errors:
        print(f"{args.file}: well formed, but cannot run on this machine ({len(errors)} problem{'s' if len(errors) > 1 else ''}):")
    elif args.no_deploy_check:
        print(f"{args.file}: valid (not checked against this machine: --no-deploy-check)")
    else:
        print(f"{args.file}: valid, and deployable on this machine")
    for f in findings:
        print(f"  {f.severity}: {f}")
    print(f"write: {cfg.write}   policy: {cfg.policy}   block: {_size(block) if block else 'unknown (give --block-bytes)'}")
    print(_namespace_line(namespace, cfg.namespace or {}))
    rows = [
        [t["index"], t["name"], t["backend"], _size(t["capacity_bytes"]),
         "-" if t["slots"] is None else f"{t['slots']}{'+' if t['slots_may_grow'] else ''}", t["policy"],
         ", ".join(f"{k}={v}" for k, v in t["options"].items())]
        for t in tiers
    ]
    print(_table(["#", "name", "backend", "capacity", "slots", "policy", "options"], rows))
    if any(t["slots"] is not None for t in tiers):
        print("slots: the blocks each tier holds before it evicts (its own bookkeeping and record headers counted)"
              + ("; +: more once its codec compresses" if any(t["slots_may_grow"] for t in tiers) else ""))
    if model is not None:
        _print_model_sizes(cfg, model, args)
    return 1 if errors else 0


def _model_sizes(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    block = model.bytes_per_token * args.block_size
    rank_block = block if model.mla_width is not None else block // args.tp
    return {"block_size": args.block_size, "tp": args.tp, "block_bytes": block, "block_bytes_per_rank": rank_block}


def _print_model_sizes(cfg: Any, model: Any, args: argparse.Namespace) -> None:
    from kvtier.config.sizing import tier_tokens

    sizes = _model_sizes(model, args)
    print(f"model {model.source}: {model.formula()} = {_size(model.bytes_per_token)} of KV per token")
    print(f"a block of {args.block_size} tokens: {_size(sizes['block_bytes'])}"
          + (f", {_size(sizes['block_bytes_per_rank'])} per rank at TP={args.tp}" if args.tp > 1 else ""))
    rows = [[t["index"], t["name"], _size(t["capacity_bytes"]), f"{t['tokens']:,}", f"{t['tokens_per_gib']:,}"]
            for t in tier_tokens(cfg, model, ranks=args.tp)]
    print(_table(["#", "name", "capacity", "tokens it holds", "tokens per GiB"], rows))
    print("capacity is the engine's, over all its ranks (each rank's tier gets capacity / ranks); "
          "record headers take a little more (slots above count them)")


def _cmd_config_show(args: argparse.Namespace) -> int:
    from kvtier import registry
    from kvtier.config import default_config

    if args.file is not None:
        from kvtier.config import load_config_file

        data = load_config_file(args.file).to_dict()
        title = f"# {args.file} as kvtier reads it (defaults filled in, paths expanded, KVTIER_* overrides applied)"
    elif args.sim:
        from kvtier.sim.cli import default_sim_config

        data = default_sim_config()
        title = "# the tiers `kvtier sim` uses when given no --config (small on purpose, emptied before each run)"
    else:
        data = default_config()
        title = (
            "# kvtier default configuration (kvtier.config.default_config()).\n"
            "# `kvtier sim` does not use it: it has its own small tiers (`kvtier config show --sim`)."
        )
    if args.json:
        _print_json(data)
        return 0
    import yaml

    print(title)
    print(yaml.safe_dump(data, sort_keys=False).rstrip())
    print()
    for reg in (registry.backends, registry.codecs, registry.policies):
        entries = reg.entries()
        listed = ", ".join(f"{n} ({'/'.join(d)})" for n, d in sorted(entries.items())) or "(none)"
        print(f"# installed {'policies' if reg.kind == 'policy' else reg.kind + 's'}: {listed}")
    return 0


# -- cache -------------------------------------------------------------------------------


def _cmd_cache_show(args: argparse.Namespace) -> int:
    from kvtier.config.cache import cache_dir, cache_entries

    root = cache_dir()
    entries = cache_entries(root)
    if args.json:
        _print_json({"cache_dir": root, "entries": [{"path": e.path, "bytes": e.bytes, "kind": e.kind} for e in entries]})
        return 0
    print(f"kvtier cache directory: {root}" + ("" if entries else " (empty)"))
    if entries:
        print(_table(["path", "kind", "on disk"], [[e.path, e.kind, _size(e.bytes)] for e in entries]))
        print(f"total: {_size(sum(e.bytes for e in entries))}; `kvtier cache clear` removes it")
    return 0


def _cmd_cache_clear(args: argparse.Namespace) -> int:
    from kvtier.config.cache import cache_dir, clear_cache
    from kvtier.errors import ConfigError

    if args.file is not None:
        raise ConfigError(
            f"kvtier cache clear takes no file: it clears kvtier's own cache directory only. To delete what the "
            f"tiers of {args.file} hold: kvtier clear --config {args.file} [--tier N]"
        )

    root = cache_dir()
    removed = clear_cache(root, only="sim" if args.sim else None, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        _print_json({"cache_dir": root, "dry_run": args.dry_run, verb.replace(" ", "_"): [{"path": e.path, "bytes": e.bytes} for e in removed]})
        return 0
    if not removed:
        print(f"nothing to remove under {root}")
        return 0
    for e in removed:
        print(f"{verb} {e.path} ({e.kind}, {_size(e.bytes)})")
    print(f"{verb} {_size(sum(e.bytes for e in removed))} in all")
    return 0


# -- inspect / verify ----------------------------------------------------------------------


def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvtier.tools import find_tiers, inspect_tier

    folders = find_tiers(args.path)
    reports = []
    for folder in folders:
        bar = _ProgressBar(f"inspect {folder.name}")
        try:
            reports.append(inspect_tier(folder, progress=bar))
        finally:
            bar.close()
    if args.json:  # one tier: its report; a folder of per-rank tiers: {"tiers": [reports]}
        _print_json(reports[0].to_dict() if folders == [Path(args.path)] else {"tiers": [r.to_dict() for r in reports]})
        return 0
    for i, report in enumerate(reports):
        print(("\n" if i else "") + _inspect_table(report))
    return 0


def _inspect_table(report: Any) -> str:
    ratio = report.codec_ratio
    rows: list[list[Any]] = [
        ["path", report.path],
        ["backend", report.kind],
        ["format version", report.format_version],
        ["block size", _size(report.block_bytes)],
        ["dtype", report.dtype],
        ["blocks", report.blocks],
        ["stored bytes", _size(report.stored_bytes)],
        ["raw bytes", _size(report.raw_bytes)],
        ["codec ratio", "-" if ratio is None else f"{ratio:.2f}x"],
        ["codecs", ", ".join(f"{k}: {v}" for k, v in sorted(report.codecs.items())) or "-"],
        ["unreadable headers", report.unreadable],
    ]
    for ns in report.namespaces:
        rows.append(["namespace", ", ".join(f"{k}={v}" for k, v in ns.items() if v not in ("", None))])
    for tenant, usage in sorted(report.tenants.items(), key=lambda item: -item[1]["bytes"]):
        rows.append([f"tenant {tenant}", f"{usage['blocks']} blocks, {_size(usage['bytes'])}, {usage['pinned']} pinned"])
    return _table(["field", "value"], rows)


def _cmd_verify(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError
    from kvtier.records.format import DEFAULT_MAC_ALGORITHM, RecordMac
    from kvtier.tools import find_tiers, verify_tier

    if args.mac_algorithm is not None and not args.mac_key_env:
        raise ConfigError("--mac-algorithm: give the MAC secret too (--mac-key-env VAR)")
    algorithm = args.mac_algorithm or DEFAULT_MAC_ALGORITHM
    mac = RecordMac.from_options(mac_key_env=args.mac_key_env, algorithm=algorithm) if args.mac_key_env else None
    folders = find_tiers(args.path)
    reports = []
    for folder in folders:
        bar = _ProgressBar(f"verify {folder.name}")
        try:
            reports.append(verify_tier(folder, delete=args.delete, progress=bar, mac=mac))
        finally:
            bar.close()
    if args.json:  # one tier: its report; a folder of per-rank tiers: {"tiers": [reports]}
        _print_json(reports[0].to_dict() if folders == [Path(args.path)] else {"tiers": [r.to_dict() for r in reports]})
    for report in [] if args.json else reports:
        print(f"{report.path}: checked {report.checked} records, {len(report.bad)} bad, {report.deleted} deleted")
        if report.bad:
            print(_table(["key", "problem"], [[b["key"][:16] + "…", b["reason"]] for b in report.bad]))
            if not args.delete:
                print("run again with --delete to remove them")
    return 0 if all(r.ok for r in reports) or args.delete else 1


# -- parser --------------------------------------------------------------------------------


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a tiered, persistent KV cache for LLM inference engines.",
        epilog="Run 'kvtier COMMAND --help' for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    config = sub.add_parser("config", help="validate or show a store configuration",
                            description="Validate a config file, or show the defaults.")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION")
    check = config_sub.add_parser("check", help="validate FILE and print the resolved tiers",
                                  description="Validate a YAML or TOML config file (with KVTIER_* overrides "
                                  "applied), check that it can run on this machine, and print each tier with its "
                                  "capacity and slot count. Exit status 1 on any error.")
    check.add_argument("file", metavar="FILE", help="a .yaml, .yml, .json or .toml file")
    check.add_argument("--block-bytes", metavar="SIZE", help="block size for slot counts when FILE sets none (e.g. 2MiB)")
    check.add_argument("--no-env", action="store_true", help="ignore KVTIER_* environment overrides")
    check.add_argument("--no-deploy-check", action="store_true",
                       help="only check the file, not this machine (free disk space against capacity, paths and "
                       "permissions, plugins that fail to import, host/pinned/device memory, remote servers)")
    check.add_argument("--probe-timeout", type=float, default=2.0, metavar="SECONDS",
                       help="connect to each remote tier's server (redis) and wait at most this long per "
                       "socket call (default: 2; 0: do not connect)")
    check.add_argument("--model", metavar="CONFIG_JSON",
                       help="a model's Hugging Face config.json (or its folder): print its KV bytes per token and "
                       "block, and the tokens each tier holds")
    check.add_argument("--tp", type=int, default=1, metavar="N", help="with --model: tensor-parallel size (default 1)")
    check.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                       help="with --model: tokens per block (vLLM --block-size, SGLang --page-size; default 16)")
    check.add_argument("--kv-dtype", metavar="DTYPE", help="with --model: the KV cache dtype, if not the model's (e.g. fp8)")
    _add_json(check)
    check.set_defaults(func=_cmd_config_check)
    show = config_sub.add_parser("show", help="print the default configuration",
                                 description="Print the default config (pinned cpu + lmdb in the kvtier cache "
                                 "directory) and the installed backends, codecs and policies.")
    show.add_argument("file", metavar="FILE", nargs="?",
                      help="a config file: print it as kvtier reads it (defaults filled in, ~ and $VARS expanded, "
                      "KVTIER_* overrides applied)")
    show.add_argument("--sim", action="store_true", help="print the small tiers `kvtier sim` uses instead")
    _add_json(show)
    show.set_defaults(func=_cmd_config_show)
    config.set_defaults(func=lambda a: _help(config))

    cache = sub.add_parser("cache", help="show or clear what kvtier keeps in its cache directory",
                           description="The kvtier cache directory ($KVTIER_CACHE_DIR, or the platform's user "
                           "cache directory) holds the default config's LMDB tier (lmdb/) and kvtier sim's "
                           "tiers (sim/). Tiers configured elsewhere are never touched.")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="ACTION")
    cache_show = cache_sub.add_parser("show", help="list what is in the cache directory, with sizes")
    _add_json(cache_show)
    cache_show.set_defaults(func=_cmd_cache_show)
    cache_clear = cache_sub.add_parser("clear", help="remove what is in the cache directory",
                                       description="Remove everything under the kvtier cache directory (or, with "
                                       "--sim, only kvtier sim's tiers) and print what went. Close stores that use "
                                       "these tiers first.")
    cache_clear.add_argument("file", metavar="FILE", nargs="?", help=argparse.SUPPRESS)
    cache_clear.add_argument("--sim", action="store_true", help="only kvtier sim's tiers (sim/)")
    cache_clear.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    _add_json(cache_clear)
    cache_clear.set_defaults(func=_cmd_cache_clear)
    cache.set_defaults(func=lambda a: _help(cache))

    inspect = sub.add_parser("inspect", help="summarise a tier directory",
                             description="Blocks, bytes, namespaces, codec ratio and format version of a "
                             "persistent tier: an lmdb tier (a directory holding data.mdb) or a file tier "
                             "(a directory holding kvtier-meta.kvm). Read-only.")
    inspect.add_argument("path", metavar="PATH", help="the tier's directory (lmdb or file), or a folder of per-rank tier "
                         "directories (the path in a vLLM or SGLang config: each is inspected)")
    _add_json(inspect)
    inspect.set_defaults(func=_cmd_inspect)

    verify = sub.add_parser("verify", help="check every record's checksum",
                            description="Check the header and checksum of every record of an lmdb or file "
                            "tier; exit status 1 if any is bad (unless --delete removed them). Read-only "
                            "unless --delete.")
    verify.add_argument("path", metavar="PATH", help="the tier's directory (lmdb or file), or a folder of per-rank tier "
                        "directories (the path in a vLLM or SGLang config: each is verified)")
    verify.add_argument("--delete", action="store_true", help="delete the bad records (lmdb: and their index entries)")
    verify.add_argument("--mac-key-env", metavar="VAR", default=None,
                        help="check keyed records with the MAC secret held in environment variable VAR")
    verify.add_argument("--mac-algorithm", choices=["aes-gmac", "blake3", "hmac-sha256"], default=None,
                        help="the tier's MAC (default aes-gmac, which also checks blake3 and hmac-sha256 "
                        "records; blake3 also checks hmac-sha256 ones; hmac-sha256 reports the others as "
                        "unsupported); needs --mac-key-env")
    _add_json(verify)
    verify.set_defaults(func=_cmd_verify)

    from kvtier.tools.bench.command import add_parser as add_bench

    add_bench(sub)
    from kvtier.tools.clear import add_parser as add_clear

    add_clear(sub)
    try:
        from kvtier.sim.cli import add_parser as add_sim
    except ModuleNotFoundError as exc:  # the simulator is optional in a partial checkout
        if exc.name not in ("kvtier.sim", "kvtier.sim.cli"):
            raise
    else:
        add_sim(sub)
    return parser


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


class _WarningsToStderr(logging.Handler):
    """kvtier's warnings and errors on stderr as ``warning: ...`` lines: a tier server lost, a
    corrupt record deleted, a config finding at open. kvtier itself only logs (a library must
    not print); the command is the application, so it shows them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = f"{record.levelname.lower()}: {record.getMessage()}\n"
            if line == self._last:
                return  # the same news again, say from a second instance of a tier (sim's empty pass, then its store)
            self._last = line
            sys.stderr.write(line)
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    handler = _WarningsToStderr()
    logger = logging.getLogger("kvtier")
    logger.addHandler(handler)
    try:
        return int(func(args) or 0)
    except KVTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        logger.removeHandler(handler)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
