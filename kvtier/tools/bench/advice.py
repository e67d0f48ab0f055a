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

__all__ = ["recommendations"]

#: a compressed tier is worth its CPU cost when it holds this many times the blocks of cpu
WORTH_COMPRESSING = 1.2


def recommendations(results: Mapping[str, Any]) -> list[str]:
    """One line per tier the results measured."""
    lines = []
    for bench, tier in (("gpu", "gpu"), ("core", "cpu")):
        save, load = _num(results, bench, f"{tier}_save_gbps") or _num(results, bench, f"{tier}_save_GBps"), (
            _num(results, bench, f"{tier}_load_gbps") or _num(results, bench, f"{tier}_load_GBps"))
        if save is not None and load is not None:
            where = "spare GPU memory, ahead of cpu" if tier == "gpu" else "the first tier (after gpu, if any)"
            lines.append(f"{tier}: {where}: loads {rate(load)}, saves {rate(save)} here")
    plain, packed = _num(results, "disk", "cpu_blocks_per_gib"), _num(results, "disk", "compressed_blocks_per_gib")
    if plain and packed:
        gain = packed / plain
        verdict = ("put it after cpu when host memory is short" if gain >= WORTH_COMPRESSING
                   else f"not worth its CPU time (below {WORTH_COMPRESSING}×): give cpu the memory instead")
        load = _num(results, "disk", "compressed_load_gbps")
        speed = "" if load is None else f", loads {rate(load)}"
        lines.append(f"compressed: holds {gain:.2f}× the blocks per GiB of cpu on this KV{speed}; {verdict}")
    disk = {t: (_num(results, "disk", f"{t}_load_gbps"), _num(results, "disk", f"{t}_save_gbps")) for t in ("lmdb", "file")}
    if all(load is not None for load, _ in disk.values()):
        best = max(disk, key=lambda t: disk[t][0] or 0.0)
        other = "file" if best == "lmdb" else "lmdb"
        lines.append(f"{best}: the persistent tier for a local disk here: loads {rate(disk[best][0] or 0)} "
                     f"(vs {other} {rate(disk[other][0] or 0)}), saves {rate(disk[best][1] or 0)}")
        lines.append(f"file: the tier for a filesystem several hosts share (NFS): loads {rate(disk['file'][0] or 0)} "
                     f"on the measured filesystem (kvtier bench --dir on the shared one)")
    save, load = _num(results, "redis", "2MiB.kvtier_put_gbps"), _num(results, "redis", "2MiB.kvtier_get_gbps")
    if save is not None and load is not None:
        lines.append(f"redis: shares blocks between engines and hosts: loads {rate(load)}, saves {rate(save)} (2 MiB "
                     f"blocks, a local server); put it last")
    return lines
