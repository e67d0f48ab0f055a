"""``kvtier bench --config FILE``: measure the tiers of an operator's config as configured.

Each tier runs the shipped benchmark that measures its backend, with the tier's own parameters:

* ``lmdb`` and ``file``: ``bench_disk.py --only lmdb file --dir T [--sync-mode M]`` (``M``: the
  tier's ``sync_mode``, applied to both tiers and their raw baselines), where ``T`` is a fresh
  temporary folder made inside the tier's ``path`` (or, while that does not exist yet, inside
  its nearest existing parent: the same filesystem). Both tiers are measured there, so the
  line can say whether the other one loads faster on that filesystem. ``T`` is removed
  afterwards, whatever happened; nothing else under the path is read or written.
* ``redis``: ``bench_redis.py --connection-env VAR --prefix P`` against the tier's server, with
  the tier's connection options (``url``, ``cluster``, credentials, TLS files) passed in the
  benchmark's environment, never on its command line. ``P`` is a fresh prefix
  (``kvtier-bench-<random>``); every key under ``P:`` and ``P.<part>:`` is deleted afterwards,
  whatever happened. A server that does not answer a probe is reported, not measured.
* ``cpu``: ``bench_core.py --bandwidth-only`` with the config's ``copy_threads``; ``compressed``:
  ``bench_disk.py --only compressed``; both in memory, at the benchmarks' own bounded sizes
  (never the tier's capacity). ``gpu``: ``bench_gpu.py``, which needs a CUDA device.
* any other backend (a plugin): named, not measured.

A tier that cannot be measured is a failure named by its tier (``tiers[i] backend``); the
others are still measured. Each measured tier gets one line of advice
(:func:`kvtier.tools.bench.advice.tier_line`).
"""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.tools.bench import BenchJob, BenchRun, run_jobs, write_results

__all__ = ["CONNECTION_OPTIONS", "ConfiguredTier", "plan_tiers", "run_configured"]

#: the redis tier options the benchmark connects with (the rest: capacity, prefix, codec, ... are the tier's own)
CONNECTION_OPTIONS = (
    "url", "cluster", "username", "password", "password_env", "tls_ca_file", "tls_cert_file", "tls_key_file",
    "connect_timeout_s", "socket_timeout_s",
)
#: how long the probe of a configured server waits per socket call before the tier is reported down
PROBE_TIMEOUT_S = 3.0


@dataclass
class ConfiguredTier:
    """One tier of the config: what measures it, where, or why nothing does."""

    index: int
    backend: str
    where: str
    job: BenchJob | None = None
    problem: str | None = None

    @property
    def label(self) -> str:
        return f"tier{self.index}-{self.backend}"

    @property
    def name(self) -> str:
        return f"tiers[{self.index}] {self.backend}"

    def to_dict(self) -> dict[str, Any]:
        script = None if self.job is None else self.job.script
        return {"index": self.index, "backend": self.backend, "where": self.where, "label": self.label,
                "benchmark": script, "problem": self.problem}


def _nearest_folder(path: str) -> Path:
    here = Path(path).expanduser().absolute()
    while not here.exists() and here.parent != here:
        here = here.parent
    return here


def _disk(tier: ConfiguredTier, options: dict[str, Any], parts: tuple[str, ...], quick: bool, stack: ExitStack) -> None:
    path = options["path"]
    base = _nearest_folder(path)
    tier.where = path if base == Path(path).expanduser().absolute() else f"{path} (not there yet: measured in {base})"
    try:
        folder = tempfile.mkdtemp(prefix=".kvtier-bench-", dir=base)
    except OSError as exc:
        tier.problem = f"cannot make a temporary folder in {base}: {type(exc).__name__}: {exc}"
        return
    stack.callback(shutil.rmtree, folder, ignore_errors=True)
    sync = ("--sync-mode", str(options["sync_mode"])) if "sync_mode" in options else ()
    tier.job = BenchJob(tier.label, "disk", (*(("--quick",) if quick else ()), "--dir", folder, *sync, "--only", *parts))


def _delete_keys(tier_cfg: Any, index: int, prefix: str, notes: list[str]) -> None:
    """Delete every key the benchmark may have left under ``prefix`` (a note if that fails)."""
    from kvtier.config import build_backend
    from kvtier.tools.clear import redis_keys

    try:
        for doomed in redis_keys(index, build_backend(type(tier_cfg).from_dict({**tier_cfg.to_dict(), "prefix": prefix}), index)):
            doomed.delete()
    except Exception as exc:  # a server lost mid-run: say so, the operator's to check
        notes.append(f"tiers[{index}] redis: could not delete the benchmark's keys under {prefix!r}: {type(exc).__name__}: {exc}")


def _redis(tier: ConfiguredTier, tier_cfg: Any, quick: bool, stack: ExitStack, notes: list[str]) -> None:
    from kvtier.config import build_backend

    options = tier_cfg.options()
    tier.where = str(options.get("url", "redis://127.0.0.1:6379/0"))
    try:
        backend = build_backend(tier_cfg, tier.index)
        tier.where = backend.url  # without credentials
        problem = backend.probe(PROBE_TIMEOUT_S)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        tier.problem = f"the redis server does not answer: {problem}"
        return
    prefix = f"kvtier-bench-{secrets.token_hex(6)}"
    stack.callback(_delete_keys, tier_cfg, tier.index, prefix, notes)
    variable = f"KVTIER_BENCH_REDIS_{tier.index}"
    connection = {k: options[k] for k in CONNECTION_OPTIONS if k in options}
    args = (*(("--quick",) if quick else ()), "--connection-env", variable, "--prefix", prefix)
    tier.job = BenchJob(tier.label, "redis", args, {variable: json.dumps(connection)})


def plan_tiers(cfg: Any, *, quick: bool, stack: ExitStack, notes: list[str]) -> list[ConfiguredTier]:
    """What measures each tier of ``cfg``; the temporary folders and key deletions are
    registered on ``stack``, so closing it removes what the benchmarks made."""
    planned = []
    for i, tier_cfg in enumerate(cfg.tiers):
        tier = ConfiguredTier(i, tier_cfg.backend, "memory")
        options = tier_cfg.options()
        if tier.backend in ("lmdb", "file"):
            if isinstance(options.get("path"), str):
                _disk(tier, options, ("lmdb", "file"), quick, stack)
            else:
                tier.where, tier.problem = "-", "no path configured; not measured"
        elif tier.backend == "redis":
            _redis(tier, tier_cfg, quick, stack, notes)
        elif tier.backend == "cpu":
            threads = () if cfg.copy_threads == "auto" else ("--copy-threads", str(cfg.copy_threads))
            tier.job = BenchJob(tier.label, "core", (*(("--quick",) if quick else ()), "--bandwidth-only", *threads))
        elif tier.backend == "compressed":
            folder = tempfile.mkdtemp(prefix="kvtier-bench-")
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
            tier.job = BenchJob(tier.label, "disk", (*(("--quick",) if quick else ()), "--dir", folder, "--only", "compressed"))
        elif tier.backend == "gpu":
            tier.where = f"device {options.get('device', 'cuda')}"
            tier.job = BenchJob(tier.label, "gpu", ("--quick",) if quick else ())
        else:
            tier.where = "-"
            tier.problem = f"kvtier bench has no benchmark for the {tier.backend!r} backend; not measured"
        planned.append(tier)
    return planned


def run_configured(
    cfg: Any, run: BenchRun, *, timeout: float = 3600.0, on_start: Callable[[int, int, BenchJob], None] | None = None,
) -> tuple[list[ConfiguredTier], list[str]]:
    """Measure each tier of ``cfg`` into ``run`` (results and failures under each tier's
    label), remove what the benchmarks made, and return the tiers and notes on the clean-up."""
    notes: list[str] = []
    with ExitStack() as stack:
        tiers = plan_tiers(cfg, quick=run.quick, stack=stack, notes=notes)
        run_jobs([t.job for t in tiers if t.job is not None], run, timeout=timeout, on_start=on_start)
    for tier in tiers:
        if tier.problem is not None:
            run.failures[tier.label] = tier.problem
    run.tiers = [t.to_dict() for t in tiers]
    write_results(run)
    return tiers, notes


def advice_lines(tiers: list[ConfiguredTier], run: BenchRun) -> list[str]:
    """One line per tier: its advice from this run's figures, or why it has none."""
    from kvtier.tools.bench.advice import tier_line

    lines = []
    for tier in tiers:
        result = run.results.get(tier.label)
        line = None if result is None or tier.job is None else tier_line(tier.backend, tier.job.script, result)
        if line is None:
            failure = run.failures.get(tier.label) or "no figures"
            line = f"not measured: {failure.strip().splitlines()[-1] if failure.strip() else 'no error text'}"
        lines.append(f"{tier.name} ({tier.where}): {line}")
    return lines


def picture_results(tiers: list[ConfiguredTier], run: BenchRun) -> dict[str, Any]:
    """The run's figures keyed by benchmark, as the picture reads them: where two tiers ran the
    same benchmark, the later tier's figures win, but an lmdb or file tier's own figures (and
    their raw baselines) are those measured at its path."""
    merged: dict[str, dict[str, Any]] = {}
    own: dict[str, Any] = {}
    for tier in tiers:
        result = run.results.get(tier.label)
        if tier.job is not None and isinstance(result, dict):
            merged.setdefault(tier.job.script, {}).update(result)
            if tier.backend in ("lmdb", "file"):
                own.update({k: v for k, v in result.items() if k.startswith((f"{tier.backend}_", f"raw_{tier.backend}_"))})
    if own:
        merged["disk"].update(own)
    return merged
