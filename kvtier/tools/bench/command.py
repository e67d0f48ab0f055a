"""The ``kvtier bench`` command: its options, and what it prints.

Without ``--config`` it runs the shipped benchmarks (:func:`kvtier.tools.bench.run_benchmarks`)
and ends with one recommendation per tier kind measured. With ``--config FILE`` it measures the
tiers of that config as configured (:mod:`kvtier.tools.bench.configured`) and ends with one
line per configured tier.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.tools.output import print_json, table

__all__ = ["add_parser"]


def _started(i: int, total: int, job: Any) -> None:
    print(f"[{i}/{total}] {job.label}: {job.describe()}", file=sys.stderr)


def _measure_config(args: argparse.Namespace) -> tuple[Any, list[str], list[str], dict[str, Any]]:
    """Run ``--config``: the run, the per-tier lines, clean-up notes, and the picture's figures."""
    from pathlib import Path

    from kvtier.config import load_config_file
    from kvtier.errors import ConfigError
    from kvtier.tools.bench import BenchRun, script_dir
    from kvtier.tools.bench.configured import advice_lines, picture_results, run_configured

    try:
        cfg = load_config_file(args.config)
    except ConfigError as exc:
        raise ConfigError(f"--config: {exc}") from exc
    run = BenchRun(output=Path(args.out), quick=args.quick, scripts=script_dir(args.bench_dir), rounds=args.rounds)
    tiers, notes = run_configured(cfg, run, timeout=args.timeout, on_start=_started)
    return run, advice_lines(tiers, run), notes, picture_results(tiers, run)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError
    from kvtier.tools.bench import DEFAULT_BENCHMARKS, available, run_benchmarks, script_dir
    from kvtier.tools.bench.advice import recommendations
    from kvtier.tools.bench.plot import plot_results, summary

    folder = script_dir(args.bench_dir)
    if args.config is not None:
        if args.only or args.dir:
            raise ConfigError("--config measures the config's tiers where they are: give it without --only and --dir")
        run, advice, notes, figures = _measure_config(args)
    else:
        names = args.only or list(DEFAULT_BENCHMARKS)
        if not any(n in available(folder) for n in names):
            where = folder if folder is not None else "the installed package (kvtier.tools.bench.scripts) or ./benchmarks"
            print(f"kvtier bench: no benchmark scripts (bench_{{{','.join(names)}}}.py) in {where}", file=sys.stderr)
            return 1
        run = run_benchmarks(names, quick=args.quick, output=args.out, scripts=folder, timeout=args.timeout,
                             on_start=_started, disk_dir=args.dir, rounds=args.rounds)
        advice, notes, figures = recommendations(run.results), [], run.results
    script = {t["label"]: t["benchmark"] for t in run.tiers}  # --config: tier labels, each run by one script
    for name in run.missing:
        print(f"kvtier bench: bench_{script.get(name) or name}.py not found in {folder}; skipped "
              f"(have: {', '.join(available(folder))})", file=sys.stderr)
    results_path = run.output / "results.json"
    plot_note = "skipped (--no-plot)"
    if not args.no_plot:
        plot_path = run.output / "kvtier-bench.png"
        if plot_results(figures, plot_path, quick=args.quick, failures=run.failures):
            plot_note = str(plot_path)
        else:
            plot_note = "not written: matplotlib is not installed (pip install 'kvtier[plot]')"
    if args.json:
        print_json({**run.to_dict(), "output": str(run.output), "results_file": str(results_path), "plot": plot_note,
                    "recommendations": advice, "notes": notes})
        return 1 if run.failures else 0
    rows = [[n, "ok", f"{run.seconds.get(n, 0):.1f}", summary(script.get(n) or n, r)] for n, r in run.results.items()]
    rows += [[n, "FAILED", f"{run.seconds.get(n, 0):.1f}", f.splitlines()[-1] if f else "?"] for n, f in run.failures.items()]
    print(table(["benchmark", "status", "seconds", "headline figures (all in results.json) / error"], rows))
    for note in notes:
        print(f"warning: {note}")
    if advice:
        what = "each tier of " + args.config if args.config else "which tiers"
        print(f"{what}, from this run's figures" + (" (--quick: rough)" if args.quick else "") + ":")
        for line in advice:
            print(f"  {line}")
    if run.disk_dir:
        print(f"disk benchmarks measured: {run.disk_dir}")
    print(f"results: {results_path}")
    print(f"plot: {plot_note}")
    if run.rounds > 1:
        print(f"figures: the median of {run.rounds} interleaved rounds")
    logs = "<benchmark>.log" if run.rounds == 1 else "<benchmark>.<round>.log"
    print(f"logs: {run.output}/{logs} (command, exit status, stderr, stdout)")
    return 1 if run.failures else 0


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="run the benchmarks and draw a picture to choose tiers by",
                           description="Run the benchmark scripts shipped with kvtier (core: host-memory tier and "
                           "manager; disk: lmdb, file and compression; connector: hit rates and scheduler cost), "
                           "each in its own interpreter, and write results.json, one log per benchmark and "
                           "kvtier-bench.png into the output folder. The picture needs matplotlib: pip install "
                           "'kvtier[plot]' (without it, everything else is written and the command says so). Every "
                           "ratio is against a raw baseline run in the same process. With --config, measure the "
                           "tiers of a config file as configured instead, and end with one line per tier.")
    bench.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a minute or two in all; figures are rough)")
    bench.add_argument("--config", metavar="FILE",
                       help="measure this config's tiers where they are: lmdb/file in a temporary folder inside "
                       "their path (removed afterwards), redis on its server under a temporary key prefix (deleted "
                       "afterwards), cpu/compressed in memory at the benchmarks' own small sizes")
    bench.add_argument("--only", nargs="+", metavar="NAME",
                       help="run only these (default: core disk connector; any bench_NAME.py "
                       "of the scripts folder, e.g. redis)")
    bench.add_argument("--bench-dir", metavar="DIR", help="run the scripts in DIR instead of the installed ones")
    bench.add_argument("--dir", metavar="DIR",
                       help="measure the disk tiers on the filesystem holding DIR (where you mean to deploy them); "
                       "default: the system's temporary directory")
    bench.add_argument("--out", "-o", default="kvtier-bench", metavar="DIR",
                       help="output folder (default: ./kvtier-bench/)")
    bench.add_argument("--rounds", type=int, default=1, metavar="N",
                       help="run the benchmarks N times, interleaved, and keep each figure's median (load swings "
                       "on a shared machine hit every benchmark alike; default 1)")
    bench.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    bench.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS", help="limit per benchmark")
    bench.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    bench.set_defaults(func=_cmd_bench)
