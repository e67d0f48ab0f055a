"""The ``kvtier bench`` picture: what an operator needs to choose tiers.

- **Bandwidth**: each tier's save and load beside a raw baseline measured in the same run (a
  plain copy for host memory, plain LMDB put/get, plain file reads), coloured by tier, labelled
  in GB/s or MB/s with the ratio to the baseline. A baseline is what the obvious code without
  kvtier does, not a limit: kvtier beats some (it batches, pipelines and uses threads).
- **Hits**: prefix-hit tokens as a share of an unbounded cache's, per workload, with the host
  tier at several sizes up to the workload's footprint (a tier that holds everything is near
  100 % by construction; the smaller ones show what an overflowing tier keeps).
- **Capacity**: blocks per GiB of capacity, plain and compressed.
- **Costs**: manager and connector time per key or step.

Only figures the results hold are drawn; a benchmark that did not run leaves its panel out, and
one that failed is named in red at the top of the picture with its error.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["BANDWIDTH", "bandwidth_rows", "build_figure", "failure_lines", "hit_curves", "plot_results", "summary"]

#: (benchmark, tier, operation, kvtier figure, raw figure or None, what the raw figure is)
BANDWIDTH: tuple[tuple[str, str, str, str, str | None, str], ...] = (
    ("core", "cpu", "save", "cpu_save_gbps", "raw_save_gbps", "raw copy"),
    ("core", "cpu", "load", "cpu_load_gbps", "raw_load_gbps", "raw copy"),
    ("disk", "lmdb", "save", "lmdb_save_gbps", "raw_lmdb_put_gbps", "raw LMDB put"),
    ("disk", "lmdb", "load", "lmdb_load_gbps", "raw_lmdb_get_gbps", "raw LMDB get"),
    ("disk", "file", "save", "file_save_gbps", "raw_file_write_gbps", "raw write+fdatasync+rename"),
    ("disk", "file", "load", "file_load_gbps", "file_read_preadv_thread_gbps", "raw preadv"),
    ("disk", "compressed", "save", "compressed_save_gbps", None, ""),
    ("disk", "compressed", "load", "compressed_load_gbps", None, ""),
    # with a CUDA device (kvtier bench --only gpu): the engine's cache on the GPU
    ("gpu", "cpu", "save from GPU", "cpu_save_GBps", "d2h_GBps", "raw D2H copy"),
    ("gpu", "cpu", "load to GPU", "cpu_load_GBps", "h2d_GBps", "raw H2D copy"),
    ("gpu", "gpu", "save", "gpu_save_GBps", "d2d_GBps", "raw D2D copy"),
    ("gpu", "gpu", "load", "gpu_load_GBps", "d2d_GBps", "raw D2D copy"),
    ("gpu", "lmdb", "save from GPU", "lmdb_save_GBps", None, ""),
    ("gpu", "lmdb", "load to GPU", "lmdb_load_GBps", None, ""),
    # with a redis server (kvtier bench --only redis): 2 MiB blocks
    ("redis", "redis", "save", "2MiB.kvtier_put_gbps", "2MiB.raw_best_put_gbps", "best raw redis-py"),
    ("redis", "redis", "load", "2MiB.kvtier_get_gbps", "2MiB.raw_best_get_gbps", "best raw redis-py"),
)
TIER_COLOURS = {
    "cpu": "#1f77b4",
    "lmdb": "#ff7f0e",
    "file": "#2ca02c",
    "compressed": "#9467bd",
    "redis": "#d62728",
    "gpu": "#8c564b",
}
RAW_COLOUR = "#b0b0b0"


def _num(results: Mapping[str, Any], bench: str, key: str | None) -> float | None:
    """``results[bench][key]`` as a float (``key`` may be dotted: ``"2MiB.kvtier_put_gbps"``)."""
    if key is None:
        return None
    value: Any = results.get(bench)
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def rate(gbps: float) -> str:
    """``2.6 GB/s``, ``265 MB/s``: decimal units, as disks and links are quoted."""
    return f"{gbps:.1f} GB/s" if gbps >= 1 else f"{gbps * 1000:.0f} MB/s"


def bandwidth_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (tier, operation) the results hold: label, value, raw value and label."""
    rows = []
    for bench, tier, op, key, raw_key, raw_label in BANDWIDTH:
        value = _num(results, bench, key)
        if value is None:
            continue
        raw = _num(results, bench, raw_key)
        rows.append({"tier": tier, "op": op, "gbps": value, "raw_gbps": raw, "raw_label": raw_label})
    return rows


def summary(bench: str, result: Mapping[str, Any]) -> str:
    """One line of ``bench``'s headline figures for the ``kvtier bench`` table: each tier's
    speed over its raw baseline (the picture's bars), the connector's hits and step cost."""
    parts = []
    for row in bandwidth_rows({bench: result}):
        ratio = f"{row['gbps'] / row['raw_gbps']:.2f}× raw" if row["raw_gbps"] else "no raw baseline"
        parts.append(f"{row['tier']} {row['op']} {rate(row['gbps'])} ({ratio})")
    data = {bench: result}
    hits, step, step_raw = (_num(data, bench, k) for k in ("hit_vs_oracle", "step_ms_256", "step_vs_raw"))
    curves = hit_curves(data)
    if curves:  # at a tier the workloads overflow: a tier that holds everything is near 100 % by construction
        at = min((x for pairs in curves.values() for x, _ in pairs), key=lambda x: abs(x - 0.25))
        shares = ", ".join(f"{w} {100 * y:.0f} %" for w, pairs in curves.items() for x, y in pairs if x == at)
        parts.append(f"hits of an unbounded cache's with the tier at {100 * at:.0f} % of the workload: {shares}")
    elif hits is not None:
        parts.append(f"hits {100 * hits:.0f} % of an unbounded cache")
    if step is not None:
        parts.append(f"step {step:.2f} ms" + (f" ({step_raw:.1f}× raw)" if step_raw is not None else ""))
    return "; ".join(parts) if parts else "see results.json"


def _bandwidth(ax: Any, rows: list[dict[str, Any]]) -> None:
    height = 0.38
    labels, ticks = [], []
    values = [r["gbps"] for r in rows] + [r["raw_gbps"] for r in rows if r["raw_gbps"]]
    top, bottom = max(values), max(min(values), 1e-6)
    # Host, disk and device tiers differ by three orders of magnitude: a log axis keeps every
    # bar readable when they share the picture.
    log = top / bottom > 100
    floor = bottom / 3 if log else 0.0

    def after(x: float) -> float:
        return x * 1.08 if log else x + top * 0.01

    for i, row in enumerate(rows):
        y = -i * 1.1
        colour = TIER_COLOURS.get(row["tier"], "#444444")
        ax.barh(y + height / 2, row["gbps"] - floor, height, left=floor, color=colour)
        text = rate(row["gbps"])
        if row["raw_gbps"]:
            text += f"  ({row['gbps'] / row['raw_gbps']:.2f}× raw)"
            ax.barh(y - height / 2, row["raw_gbps"] - floor, height, left=floor, color=RAW_COLOUR)
            ax.text(after(row["raw_gbps"]), y - height / 2, f"{row['raw_label']}: {rate(row['raw_gbps'])}",
                    va="center", fontsize=8, color="#555555")
        else:
            text += "  (no raw baseline measured)"
        ax.text(after(row["gbps"]), y + height / 2, text, va="center", fontsize=9, fontweight="bold")
        labels.append(f"{row['tier']} {row['op']}")
        ticks.append(y)
    ax.set_yticks(ticks, labels)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(floor, top * 15)
    else:
        ax.set_xlim(0, top * 1.45)
    ax.set_xlabel("GB/s (10⁹ bytes per second, more is better" + (", log scale)" if log else ")"))
    ax.set_title("Bandwidth per tier (coloured) beside a raw baseline without kvtier, same run (grey)", loc="left")
    from matplotlib.patches import Patch

    tiers = list(dict.fromkeys(r["tier"] for r in rows))
    handles = [Patch(color=TIER_COLOURS.get(t, "#444444"), label=f"kvtier {t} tier") for t in tiers]
    handles.append(Patch(color=RAW_COLOUR, label="raw baseline: the plain code without kvtier (not a limit)"))
    ax.legend(handles=handles, loc="lower right", fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)


def hit_curves(results: Mapping[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Per workload, (host tier size as a fraction of its footprint, hits over the unbounded
    cache's) from ``connector.hits_by_tier_size``, smallest tier first."""
    sweep = results.get("connector", {}).get("hits_by_tier_size")
    out: dict[str, list[tuple[float, float]]] = {}
    for workload, data in (sweep or {}).items() if isinstance(sweep, Mapping) else ():
        points = data.get("points", []) if isinstance(data, Mapping) else []
        pairs = [(float(p["tier_fraction"]), float(p["hit_vs_oracle"])) for p in points
                 if isinstance(p, Mapping) and {"tier_fraction", "hit_vs_oracle"} <= set(p)]
        if pairs:
            out[str(workload)] = sorted(pairs)
    return out


def _hits(ax: Any, results: Mapping[str, Any]) -> bool:
    curves = hit_curves(results)
    if not curves:
        return False
    for workload, pairs in curves.items():
        xs, ys = [100 * x for x, _ in pairs], [100 * y for _, y in pairs]
        ax.plot(xs, ys, marker="o", label=workload)
    ax.set_xlim(0, 105)
    ax.set_ylim(0, 105)
    ax.set_xlabel("host tier size, % of what the workload stores")
    ax.set_ylabel("% of an unbounded cache's hits")
    ax.set_title("Prefix hits vs tier size (reference engine)", loc="left")
    ax.legend(fontsize=8, frameon=False, loc="lower right")
    ax.grid(alpha=0.3)
    return True


def _capacity(ax: Any, results: Mapping[str, Any]) -> bool:
    plain = _num(results, "disk", "cpu_blocks_per_gib")
    packed = _num(results, "disk", "compressed_blocks_per_gib")
    if plain is None and packed is None:
        return False
    candidates = [("uncompressed", plain, TIER_COLOURS["cpu"]), ("compressed (zstd-shuffle)", packed, TIER_COLOURS["compressed"])]
    items = [(label, v, colour) for label, v, colour in candidates if v is not None]
    ys = list(range(len(items)))[::-1]
    for y, (_, v, colour) in zip(ys, items):
        ax.barh(y, v, color=colour, height=0.6)
        ax.text(v * 0.98, y, f"{v:.0f}", va="center", ha="right", color="white", fontweight="bold")
    ax.set_yticks(ys, [i[0] for i in items])
    block = _num(results, "disk", "block_bytes")
    ax.set_xlabel("blocks per GiB of capacity" + (f" ({block / 2**20:.0f} MiB blocks)" if block else ""))
    ax.set_title("Capacity", loc="left")
    return True


def _costs(ax: Any, results: Mapping[str, Any]) -> bool:
    lines = []
    for bench, key, label, unit in (
        ("core", "lookup_us_per_key", "lookup", "µs/key"),
        ("core", "store_us_per_key", "store", "µs/key"),
        ("core", "load_us_per_key", "load", "µs/key"),
        ("core", "index_bytes_per_key", "index memory", "B/key"),
        ("connector", "step_ms_256", "step, 256 requests", "ms"),
        ("disk", "lmdb_scan_seconds", "LMDB index scan", "s"),
    ):
        value = _num(results, bench, key)
        if value is not None:
            lines.append(f"{label}: {value:.3g} {unit}")
    if not lines:
        return False
    ax.axis("off")
    ax.set_title("Bookkeeping costs", loc="left")
    ax.text(0.0, 0.95, "\n".join(lines), va="top", ha="left", fontsize=9, family="monospace", transform=ax.transAxes)
    return True


def failure_lines(failures: Mapping[str, str] | None) -> list[str]:
    """One line per failed benchmark: its name and the last line of its error."""
    lines = []
    for name, error in sorted((failures or {}).items()):
        last = error.strip().splitlines()[-1] if error.strip() else "no error text"
        lines.append(f"FAILED: {name}: {last[:140]} (see {name}.log)")
    return lines


def plot_results(
    results: Mapping[str, Any], target: str | Path, *, quick: bool = False, failures: Mapping[str, str] | None = None
) -> bool:
    """Draw the picture into ``target`` (PNG); ``False`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = build_figure(results, quick=quick, failures=failures)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return True


def build_figure(results: Mapping[str, Any], *, quick: bool = False, failures: Mapping[str, str] | None = None) -> Any:
    """The picture as a matplotlib figure (the caller saves and closes it)."""
    import matplotlib.pyplot as plt

    rows = bandwidth_rows(results)
    fig = plt.figure(figsize=(13, 4.2 + 0.55 * max(1, len(rows))), layout="constrained")
    grid = fig.add_gridspec(2, 3, height_ratios=[max(1, len(rows)) * 0.55 + 0.8, 2.4])
    top = fig.add_subplot(grid[0, :])
    if rows:
        _bandwidth(top, rows)
    else:
        top.axis("off")
        top.set_title("Bandwidth: no core or disk results", loc="left")
    for slot, draw in zip(range(3), (_hits, _capacity, _costs)):
        ax = fig.add_subplot(grid[1, slot])
        if not draw(ax, results):
            ax.axis("off")
    title = "kvtier bench" + (" (--quick: small sizes, figures are rough)" if quick else "")
    failed = failure_lines(failures)
    if failed:
        title += "\n" + "\n".join(failed)
    fig.suptitle(title, x=0.01, ha="left", fontweight="bold", color="#b00000" if failed else "black")
    return fig
