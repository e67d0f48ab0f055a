"""``kvtier bench``'s last lines: one recommendation per tier, from the figures of this run.

Each line says what the tier measured here and where it belongs in a tier list; a tier the run
did not measure gets no line. Loads are what skip prefill, so persistent tiers are compared on
their load speed; saves run after the engine moved on (write-through, phase 2), so they matter
only while they keep up with what the engine stores.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.tools.bench.plot import _num, rate

__all__ = ["recommendations", "tier_line"]

#: a compressed tier is worth its CPU cost when it holds this many times the blocks of cpu
WORTH_COMPRESSING = 1.2
#: the other disk tier is worth a switch when it loads this many times faster on the same filesystem
CLEARLY_FASTER = 1.2


def _memory(results: Mapping[str, Any], bench: str, tier: str) -> str | None:
    save = _num(results, bench, f"{tier}_save_gbps") or _num(results, bench, f"{tier}_save_GBps")
    load = _num(results, bench, f"{tier}_load_gbps") or _num(results, bench, f"{tier}_load_GBps")
    if save is None or load is None:
        return None
    where = "spare GPU memory, ahead of cpu" if tier == "gpu" else "the first tier (after gpu, if any)"
    return f"{where}: loads {rate(load)}, saves {rate(save)} here"


def _compressed(results: Mapping[str, Any]) -> str | None:
    plain, packed = _num(results, "disk", "cpu_blocks_per_gib"), _num(results, "disk", "compressed_blocks_per_gib")
    if not plain or not packed:
        return None
    gain = packed / plain
    verdict = ("put it after cpu when host memory is short" if gain >= WORTH_COMPRESSING
               else f"not worth its CPU time (below {WORTH_COMPRESSING}×): give cpu the memory instead")
    load = _num(results, "disk", "compressed_load_gbps")
    speed = "" if load is None else f", loads {rate(load)}"
    return f"holds {gain:.2f}× the blocks per GiB of cpu on this KV{speed}; {verdict}"


def _disks(results: Mapping[str, Any]) -> dict[str, tuple[float, float]] | None:
    """(load, save) GB/s of lmdb and file, when the results hold both tiers' figures."""
    disk = {t: (_num(results, "disk", f"{t}_load_gbps"), _num(results, "disk", f"{t}_save_gbps")) for t in ("lmdb", "file")}
    return {t: (load or 0.0, save or 0.0) for t, (load, save) in disk.items()} if all(v[0] is not None for v in disk.values()) else None


def _configured_disk(tier: str, results: Mapping[str, Any]) -> str | None:
    """The line of a configured lmdb or file tier, against the other measured on its filesystem."""
    disk = _disks(results)
    if disk is None:
        return None
    other = "file" if tier == "lmdb" else "lmdb"
    (load, save), other_load = disk[tier], disk[other][0]
    figures = f"loads {rate(load)}, saves {rate(save)} on its filesystem ({other} there loads {rate(other_load)})"
    if other_load < CLEARLY_FASTER * load:
        return f"{figures}: keep it"
    if tier == "lmdb":
        return f"{figures}: file loads faster here; consider backend: file"
    return f"{figures}: lmdb loads faster here; use lmdb unless several hosts share this filesystem"


def _redis(results: Mapping[str, Any], server: str) -> str | None:
    save, load = _num(results, "redis", "2MiB.kvtier_put_gbps"), _num(results, "redis", "2MiB.kvtier_get_gbps")
    if save is None or load is None:
        return None
    return f"shares blocks between engines and hosts: loads {rate(load)}, saves {rate(save)} (2 MiB blocks, {server}); put it last"


def recommendations(results: Mapping[str, Any]) -> list[str]:
    """One line per tier the results measured."""
    lines = [f"{tier}: {line}" for bench, tier in (("gpu", "gpu"), ("core", "cpu")) if (line := _memory(results, bench, tier))]
    if line := _compressed(results):
        lines.append(f"compressed: {line}")
    disk = _disks(results)
    if disk is not None:
        best = max(disk, key=lambda t: disk[t][0])
        other = "file" if best == "lmdb" else "lmdb"
        lines.append(f"{best}: the persistent tier for a local disk here: loads {rate(disk[best][0])} "
                     f"(vs {other} {rate(disk[other][0])}), saves {rate(disk[best][1])}")
        lines.append(f"file: the tier for a filesystem several hosts share (NFS): loads {rate(disk['file'][0])} "
                     f"on the measured filesystem (kvtier bench --dir on the shared one)")
    if line := _redis(results, "a local server"):
        lines.append(f"redis: {line}")
    return lines


def tier_line(backend: str, bench: str, result: Mapping[str, Any]) -> str | None:
    """The advice for one configured tier of ``backend`` that ``bench_<bench>.py`` measured
    (``result``: its figures), without the tier's name; ``None`` when they hold too little."""
    results = {bench: result}
    if backend in ("cpu", "gpu"):
        return _memory(results, bench, backend)
    if backend == "compressed":
        return _compressed(results)
    if backend in ("lmdb", "file"):
        return _configured_disk(backend, results)
    if backend == "redis":
        return _redis(results, "the configured server")
    return None
