"""``kvtier sim``: run the reference engine on a workload and report what the cache did.

By default the store is the default tier chain (pinned host memory in front of LMDB), sized
for a simulation, with the LMDB environment in its own directory under the user's cache
directory (so a simulation never touches a real cache's records). ``--config FILE`` uses a
YAML/JSON/TOML store config instead (same schema as the dict config). Progress goes to stderr;
the result is a table on stdout, or one JSON object with ``--json``. The exit status is 1 when
a corrupt block was served, a fence was violated, or request state / jobs were left over.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from kvtier.errors import KVTierError

__all__ = ["add_parser", "default_sim_config", "run"]

# Small on purpose: a default run overflows host memory, so blocks are demoted to LMDB and some
# hits are served from disk, and the whole tier chain is exercised and verified. Twice the
# simulated GPU pool, as host tiers are larger than the GPU in practice: at an equal size the
# promoted copies of disk hits mostly duplicate the engine's own prefix cache (measured: host
# hits fell from 3992 to 2400 tokens on the default chat run), at twice the size they do not.
SIM_CPU_CAPACITY = "2MiB"
SIM_DISK_CAPACITY = "256MiB"


def _lmdb_available() -> bool:
    from kvtier import registry

    try:
        return "lmdb" in registry.backends.names()
    except KVTierError:
        return False


def sim_disk_path() -> str:
    """The simulation's own LMDB directory (never a real cache's)."""
    from kvtier.config.cache import cache_dir

    return os.path.join(cache_dir(), "sim", "lmdb")


def default_sim_config() -> dict[str, Any]:
    """The default tiers, sized for a simulation: host memory, then LMDB under the cache dir."""
    path = sim_disk_path()
    tiers: list[dict[str, Any]] = [{"backend": "cpu", "capacity": SIM_CPU_CAPACITY, "pin_memory": "auto"}]
    if _lmdb_available():
        tiers.append({"backend": "lmdb", "capacity": SIM_DISK_CAPACITY, "path": path})
    return {"tiers": tiers, "policy": "lru", "write": "back"}


def _load_config_file(path: str) -> dict[str, Any]:
    from kvtier import config as config_module

    reader = getattr(config_module, "read_config_file", None)
    if reader is not None:
        data = reader(path)
    else:
        import yaml

        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    if not isinstance(data, dict):
        raise KVTierError(f"{path}: expected a mapping with 'tiers'")
    # Validate now, so a bad file fails with the file's name before anything is opened.
    loader = getattr(config_module, "load_config_file", None)
    if loader is not None:
        loader(path)
    else:
        config_module.load_config(data, source=path)
    return data


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``kvtier sim``."""
    from kvtier.sim.workloads import WORKLOADS

    p = subparsers.add_parser(
        "sim",
        help="run the reference engine on a workload and report cache hits and checks",
        description="Run the reference engine on a workload and report what the cache did: hits per tier, recomputed tokens, bytes moved, and the safety checks (corrupt blocks, fence violations, leftover state).",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="chat", help="workload to run (default: chat)")
    p.add_argument("--requests", type=int, default=48, help="number of requests (turns) (default: 48)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="store config file (YAML/JSON/TOML); default: its own small tiers, "
        f"{SIM_CPU_CAPACITY} of host memory + {SIM_DISK_CAPACITY} of LMDB under the kvtier cache directory "
        "(kvtier config show --sim prints them)",
    )
    p.add_argument("--gpu-blocks", type=int, default=None, help="engine blocks in the simulated GPU pool")
    p.add_argument(
        "--async-scheduling", action="store_true", help="model async scheduling (sampled tokens seen one step late)"
    )
    p.add_argument(
        "--keep-disk",
        action="store_true",
        help="reuse what earlier runs stored in the persistent tiers (shows persistence across "
        "processes; hits may then exceed this run's oracle). Default: empty them first (only the "
        "simulator's own records; a tier of another namespace is refused).",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)
    return p


class _Progress:
    """A one-line progress bar on stderr, redrawn at most every few steps."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = max(1, total)
        self.enabled = enabled
        self._last = -1

    def __call__(self, engine: Any) -> None:
        if not self.enabled:
            return
        done = engine.report.requests - len(engine.waiting) - len(engine.running) - len(engine.loading)
        pct = min(100, int(100 * done / self.total))
        if pct == self._last:
            return
        self._last = pct
        bar = "#" * (pct // 4)
        sys.stderr.write(f"\rkvtier sim [{bar:<25}] {pct:3d}%  step {engine.step_no}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self._last >= 0:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _describe_tiers(tiers: list[dict[str, Any]]) -> str:
    from kvtier.units import format_size

    parts = []
    for t in tiers:
        where = f" at {t['path']}" if t.get("path") else " (host memory)" if t["backend"] == "cpu" else ""
        parts.append(f"{t['name']} {format_size(t['capacity_bytes'])}{where}")
    return " -> ".join(parts)


def _disk_usage(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def _table(report: dict[str, Any]) -> str:
    from kvtier.units import format_size

    rows: list[tuple[str, Any]] = [
        ("workload", report["workload"]),
        ("requests", report["requests"]),
        ("steps", report["steps"]),
        ("tiers", _describe_tiers(report["tiers"])),
    ]
    if any(t.get("path") for t in report["tiers"]):
        note = (
            "emptied before the run"
            + (f" ({report['emptied_records']} records)" if report["emptied_records"] else "")
            + "; --keep-disk keeps them"
            if report.get("emptied")
            else "kept from earlier runs (--keep-disk): hits may exceed the oracle"
        )
        rows.append(("  persistent tiers", note))
    for i, tier in enumerate(report["tiers"]):
        if tier.get("outages"):
            state = "down at the end of the run" if not tier.get("up_at_end") else "back up by the end of the run"
            rows.append((f"  {tier['name']} (tiers[{i}]) DOWN",
                         f"{tier['outages']} outage(s), {state}: its stores failed and its loads missed meanwhile"
                         + (f" ({tier['write_failures']} blocks not stored)" if tier.get("write_failures") else "")))
    reprefill = report["reprefill_tokens"]
    rows += [
        ("prompt tokens", report["prompt_tokens"]),
        (
            "prefill tokens",
            f"{report['prefill_tokens']}"
            + (f"  (prompts + {reprefill} prefilled again after {report['preemptions']} preemptions)" if reprefill else ""),
        ),
        ("  from GPU prefix cache", report["gpu_hit_tokens"]),
        ("  loaded from kvtier", report["loaded_tokens"]),
    ]
    for i, tier in enumerate(report["tiers"]):
        rows.append((f"    from {tier['name']} (tiers[{i}])", report["loaded_tokens_by_tier"].get(tier["name"], 0)))
    if not report.get("emptied", True):
        rows.append(("    stored by an earlier process", f"{report['earlier_process_tokens']}  (blocks this run never computed)"))
    rows.append(("  recomputed", report["recomputed_tokens"]))
    if report["preempted_unfinished_tokens"] or reprefill:
        rows.append(("  preempted before computed", f"{report['preempted_unfinished_tokens']}  (prefilled again at readmission)"))
    rows += [
        ("hit tokens / unbounded oracle", f"{report['hit_tokens']} / {report['oracle_hit_tokens']}"),
        ("decode tokens", report["decode_tokens"]),
        ("bytes stored", f"{report['bytes_stored']} ({format_size(report['bytes_stored'])})"),
        ("bytes loaded", f"{report['bytes_loaded']} ({format_size(report['bytes_loaded'])})"),
        ("last-block stores at finish", report["last_block_jobs"]),
        ("flushed store jobs", report["flushed_jobs"]),
        ("preemptions", report["preemptions"]),
        ("verified loaded blocks", report["verified_blocks"]),
        ("corrupt blocks", report["corrupt_blocks"]),
        ("fence violations", report["fence_violations"]),
        ("live request states", report["live_request_states"]),
        ("live jobs", report["live_jobs"]),
        ("seconds", f"{report['seconds']:.2f}"),
    ]
    for disk in report.get("disk", []):
        rows.append(("on disk", f"{disk['path']}: {format_size(disk['bytes'])}" + ("  (kvtier cache clear removes it)" if disk["in_cache_dir"] else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    from kvtier.sim.engine import SimConfig, run_sim

    try:
        config = _load_config_file(args.config) if args.config else default_sim_config()
        if not args.config and not args.keep_disk:
            # The simulator's own directory: its files go whatever namespace wrote them (an
            # older kvtier's sim records would otherwise refuse to open).
            for name in ("data.mdb", "lock.mdb"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(sim_disk_path(), name))
        options: dict[str, Any] = {"async_scheduling": bool(args.async_scheduling)}
        if args.gpu_blocks is not None:
            options["num_gpu_blocks"] = args.gpu_blocks
        sim = SimConfig(**options)
        progress = _Progress(args.requests, enabled=not args.no_progress and not args.json and sys.stderr.isatty())
        try:
            # Persistent tiers start empty unless --keep-disk: only records of the simulator's own
            # namespace are deleted (a tier written for a real model fails to open, untouched).
            report = run_sim(
                config,
                workload=args.workload,
                requests=args.requests,
                seed=args.seed,
                sim=sim,
                on_step=progress,
                empty_persistent=not args.keep_disk,
            )
        finally:
            progress.close()
    except KVTierError as exc:
        print(f"kvtier sim: {exc}", file=sys.stderr)
        return 1
    from kvtier.config.cache import cache_dir

    data = report.to_dict()
    data["emptied"] = not args.keep_disk
    root = os.path.realpath(cache_dir())
    data["disk"] = [
        {
            "path": t["path"],
            "bytes": _disk_usage(t["path"]),
            "in_cache_dir": os.path.realpath(t["path"]).startswith(root + os.sep),
        }
        for t in report.tiers
        if t.get("path") and os.path.isdir(t["path"])
    ]
    if args.json:
        print(json.dumps(data, sort_keys=True))
    else:
        print(_table(data))
    if not report.ok:
        print(
            "kvtier sim: FAILED: "
            f"corrupt_blocks={report.corrupt_blocks} fence_violations={report.fence_violations} "
            f"live_request_states={report.live_request_states} live_jobs={report.live_jobs} "
            f"fenced_blocks={report.fenced_blocks}",
            file=sys.stderr,
        )
        return 1
    return 0
