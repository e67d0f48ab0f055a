"""``kvtier bench``: run the benchmark scripts, collect their JSON, draw one picture.

The scripts live in the source tree's ``benchmarks/`` folder and are installed with the package
as ``kvtier.tools.bench.scripts`` (see ``[tool.setuptools]`` in ``pyproject.toml``), so a plain
``pip install kvtier`` can run them. Each runs in its own interpreter (a benchmark must not be
disturbed by another's threads or memory) and prints one JSON object on stdout; each ratio in
it is measured against a raw baseline in that same process.

Everything goes to one output folder (default ``./kvtier-bench/``): ``results.json`` (all
figures), ``kvtier-bench.png`` (the picture; it needs matplotlib, the ``plot`` extra) and
``<name>.log`` (each script's command line, exit status, stderr and stdout).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_BENCHMARKS", "DISK_BENCHMARKS", "BenchJob", "BenchRun", "available", "check_disk_dir", "last_json",
    "median_of", "paired", "run_benchmarks", "run_jobs", "script_dir", "spread",
]

#: What ``kvtier bench`` runs by default: the ones that need no service or model download.
DEFAULT_BENCHMARKS = ("core", "disk", "connector")
#: The ones that measure a filesystem, and take ``--dir`` (``kvtier bench --dir``) to say which.
DISK_BENCHMARKS = frozenset({"disk", "disk_sizes"})
DEFAULT_OUTPUT = "kvtier-bench"


def script_dir(given: str | os.PathLike[str] | None = None) -> Path | None:
    """Where the ``bench_*.py`` scripts are: ``given``, else the installed
    ``kvtier.tools.bench.scripts`` package, else a source checkout's ``benchmarks/``."""
    if given is not None:
        return Path(given)
    try:
        spec = importlib.util.find_spec("kvtier.tools.bench.scripts")
    except ImportError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if any(Path(location).glob("bench_*.py")):
                return Path(location)
    checkout = Path(__file__).resolve().parent.parent.parent / "benchmarks"
    return checkout if checkout.is_dir() else None


def available(folder: Path | None) -> list[str]:
    """Benchmark names (``bench_<name>.py``) present in ``folder``."""
    if folder is None or not folder.is_dir():
        return []
    return sorted(p.stem.removeprefix("bench_") for p in folder.glob("bench_*.py"))


def last_json(text: str) -> Any:
    """The JSON object a benchmark printed (the whole output, or its last line that parses)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError("no JSON object in its output")


@dataclass(frozen=True)
class BenchJob:
    """One benchmark to run: its script (``bench_<script>.py``), the name its results and log
    go under, its arguments, and variables added to its environment (secrets go there, never on
    a command line)."""

    label: str
    script: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return " ".join([f"bench_{self.script}.py", *self.args])


@dataclass
class BenchRun:
    """What one ``kvtier bench`` did."""

    output: Path
    quick: bool
    scripts: Path | None
    results: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    disk_dir: str | None = None
    rounds: int = 1
    #: with ``kvtier bench --config``: what each configured tier was measured as, and where
    tiers: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            **({"tiers": self.tiers} if self.tiers else {}),
            "quick": self.quick,
            "scripts": None if self.scripts is None else str(self.scripts),
            "disk_dir": self.disk_dir,
            "results": self.results,
            "failures": self.failures,
            "missing": self.missing,
            "seconds": self.seconds,
            "rounds": self.rounds,
        }


def _log(cmd: Sequence[str], seconds: float, status: str, stdout: str, stderr: str) -> str:
    """A benchmark's log: what ran, how it ended, and everything it printed (never empty)."""

    def section(text: str) -> str:
        return "(nothing)\n" if not text else text if text.endswith("\n") else text + "\n"

    return f"$ {' '.join(cmd)}\n{status} after {seconds:.1f} s\n-- stderr --\n{section(stderr)}-- stdout --\n{section(stdout)}"


def check_disk_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as the folder the disk benchmarks measure, or a ConfigError saying why not."""
    from kvtier.errors import ConfigError

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--dir: {str(folder)!r} is not a directory (give a folder on the filesystem to measure)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--dir: {str(folder)!r} is not writable by this user")
    return folder.resolve()


def _run_one(folder: Path, job: BenchJob, timeout: float, env: dict[str, str], out: Path, run: BenchRun, suffix: str) -> Any:
    """Run one benchmark once: its JSON, or ``None`` (its failure recorded in ``run``)."""
    name = job.label
    cmd = [sys.executable, str(folder / f"bench_{job.script}.py"), *job.args]
    env = {**env, **job.env}
    started = time.perf_counter()
    log = out / f"{name}{suffix}.log"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        run.seconds[name] = round(run.seconds.get(name, 0) + time.perf_counter() - started, 2)
        run.failures[name] = f"timed out after {timeout:.0f} s"
        text = [b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (exc.stdout, exc.stderr)]
        log.write_text(_log(cmd, time.perf_counter() - started, run.failures[name], *text), encoding="utf-8")
        return None
    took = time.perf_counter() - started
    run.seconds[name] = round(run.seconds.get(name, 0) + took, 2)
    log.write_text(_log(cmd, took, f"exit status {proc.returncode}", proc.stdout, proc.stderr), encoding="utf-8")
    if proc.returncode != 0:
        run.failures[name] = f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"
        return None
    try:
        return last_json(proc.stdout)
    except ValueError as exc:
        run.failures[name] = str(exc)
        return None


def median_of(values: Sequence[Any]) -> Any:
    """The rounds' results of one benchmark as one: each number the median of its rounds, the
    rest (labels, lists) the first round's."""
    first = values[0]
    if isinstance(first, dict):
        return {k: median_of([v[k] for v in values if isinstance(v, dict) and k in v]) for k in first}
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if isinstance(first, (int, float)) and not isinstance(first, bool) and numbers:
        return statistics.median(numbers)
    return first


def spread(values: Sequence[float]) -> dict[str, float]:
    """The rounds of one figure as its minimum, quartiles and maximum (rounded): what a
    benchmark reports beside a median, so a swing from one run to the next shows in each."""
    ordered = sorted(values)
    if len(ordered) > 1:
        q1, q2, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q2 = q3 = ordered[0]
    return {k: round(v, 3) for k, v in (("min", ordered[0]), ("q1", q1), ("median", q2), ("q3", q3), ("max", ordered[-1]))}


def paired(base_seconds: Sequence[float], side_seconds: Sequence[float]) -> list[float]:
    """Per round, ``base``'s seconds over ``side``'s in that same round (the side's speed as a
    share of the baseline's): drift across a run hits both terms of each ratio alike."""
    return [b / s for b, s in zip(base_seconds, side_seconds, strict=True)]


def write_results(run: BenchRun) -> Path:
    """Write ``results.json`` into the run's output folder; its path."""
    path = run.output / "results.json"
    path.write_text(json.dumps(run.to_dict(), indent=2, sort_keys=True), encoding="utf-8")
    return path


def _check_rounds(rounds: int) -> None:
    if not isinstance(rounds, int) or rounds < 1:
        from kvtier.errors import ConfigError

        raise ConfigError(f"--rounds: expected an integer >= 1, got {rounds!r}")


def run_jobs(
    jobs: Sequence[BenchJob], run: BenchRun, *, timeout: float = 3600.0,
    on_start: Callable[[int, int, BenchJob], None] | None = None,
) -> BenchRun:
    """Run ``jobs`` from ``run.scripts`` ``run.rounds`` times, interleaved (a, b, c, a, b, ...),
    so a swing of the machine's load hits every benchmark alike, and keep each figure's median
    over the rounds in ``run.results[label]``; a job that failed in any round is failed. A job
    whose script is not there is listed in ``run.missing``. Writes ``results.json``."""
    _check_rounds(run.rounds)
    folder = run.scripts
    run.output.mkdir(parents=True, exist_ok=True)
    present = [j for j in jobs if folder is not None and (folder / f"bench_{j.script}.py").is_file()]
    run.missing += [j.label for j in jobs if j not in present]
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    got: dict[str, list[Any]] = {}
    for r in range(run.rounds):
        for i, job in enumerate(present, 1):
            if on_start is not None:
                on_start(r * len(present) + i, run.rounds * len(present), job)
            assert folder is not None
            suffix = "" if run.rounds == 1 else f".{r + 1}"
            outcome = _run_one(folder, job, timeout, env, run.output, run, suffix)
            if outcome is not None:
                got.setdefault(job.label, []).append(outcome)
    for name, values in got.items():
        if name not in run.failures:
            run.results[name] = median_of(values)
    write_results(run)
    return run


def run_benchmarks(
    names: Sequence[str] | None = None,
    *,
    quick: bool = False,
    output: str | os.PathLike[str] = DEFAULT_OUTPUT,
    scripts: str | os.PathLike[str] | None = None,
    timeout: float = 3600.0,
    on_start: Callable[[int, int, BenchJob], None] | None = None,
    disk_dir: str | os.PathLike[str] | None = None,
    rounds: int = 1,
) -> BenchRun:
    """Run ``bench_<name>.py`` for each name (default :data:`DEFAULT_BENCHMARKS`), write
    ``results.json`` and the logs into ``output``, and return what happened. ``disk_dir`` is
    the filesystem the disk benchmarks (:data:`DISK_BENCHMARKS`) measure (their ``--dir``).
    ``rounds``: see :func:`run_jobs`."""
    _check_rounds(rounds)
    where = None if disk_dir is None else check_disk_dir(disk_dir)
    run = BenchRun(output=Path(output), quick=quick, scripts=script_dir(scripts),
                   disk_dir=None if where is None else str(where), rounds=rounds)
    jobs = []
    for name in names or DEFAULT_BENCHMARKS:
        args = ["--quick"] if quick else []
        if where is not None and name in DISK_BENCHMARKS:
            args += ["--dir", str(where)]
        jobs.append(BenchJob(name, name, tuple(args)))
    return run_jobs(jobs, run, timeout=timeout, on_start=on_start)
