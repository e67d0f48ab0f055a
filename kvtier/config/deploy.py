"""Deployability: can this configuration run on *this* machine?

:func:`load_config` checks that a configuration is well formed; :func:`check_deployment` checks
it against the machine, without opening a tier or writing a byte:

- **plugins**: every backend, policy and codec the config names is imported now (an entry point
  whose module or object fails to load is an error naming the field);
- **paths**: a persistent tier's ``path`` must be a directory, or creatable, and writable (a
  regular file such as ``/etc/passwd`` is an error);
- **disk space**: the capacities of the tiers on one filesystem must fit in its free space plus
  what those tiers already hold there;
- **memory**: host-memory tiers against the machine's memory (total: error; available:
  warning), pinned host memory against ``RLIMIT_MEMLOCK``, device tiers against the device;
- **remote servers** (only with ``probe_timeout_s``): each tier whose backend defines
  ``probe(timeout_s)`` (``redis``) connects once; no answer, refused credentials or a failed
  TLS handshake is an error naming the URL.

``kvtier config check`` runs it by default (``--no-deploy-check`` skips it) and fails on an
error; :meth:`kvtier.KVStore.start` logs each finding as a warning and opens anyway, so a store
never refuses to start for a reason only this pass sees.
"""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvtier import registry
from kvtier.config.loader import StoreConfig, build_backend
from kvtier.units import format_size

__all__ = ["Finding", "check_deployment", "host_memory", "log_findings", "tier_slots"]

log = logging.getLogger("kvtier.config.deploy")

#: Backends whose capacity lives in host memory (the compressed tier keeps its records in RAM).
HOST_MEMORY_BACKENDS = frozenset({"cpu", "compressed"})
DEVICE_MEMORY_BACKENDS = frozenset({"gpu"})


@dataclass(frozen=True, slots=True)
class Finding:
    """One reason this config may not run here. ``field`` is a path such as ``tiers[0].path``."""

    field: str
    message: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return {"field": self.field, "message": self.message, "severity": self.severity}


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of host memory, ``None`` where the system does not say."""
    total = available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    value = int(rest.split()[0]) * 1024
                    if name == "MemTotal":
                        total = value
                    else:
                        available = value
    except (OSError, ValueError):
        pass
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = None
    return total, available


def _existing_ancestor(path: str) -> str:
    here = os.path.abspath(path)
    while not os.path.exists(here):
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    return here


def _bytes_under(path: str) -> int:
    """Disk bytes a tier already holds under ``path`` (0 if absent)."""
    total = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def _held(path: str, measure: bool) -> int | None:
    """Bytes a tier already holds at ``path``; ``None`` when not measured (a walk was not wanted)."""
    if not os.path.isdir(path):
        return 0
    if measure:
        return _bytes_under(path)
    data = os.path.join(path, "data.mdb")  # an LMDB environment: one file, cheap to measure
    if os.path.isfile(data):
        return os.stat(data).st_blocks * 512
    try:
        with os.scandir(path) as entries:
            return None if next(entries, None) is not None else 0
    except OSError:
        return None


def _check_plugins(cfg: StoreConfig) -> list[Finding]:
    out: list[Finding] = []

    def load(reg: registry.Registry, name: str, where: str) -> None:
        try:
            reg.get(name)
        except Exception as exc:
            out.append(Finding(where, f"the {reg.kind} {name!r} cannot be loaded: {exc}"))

    load(registry.policies, cfg.policy, "policy")
    for i, tier in enumerate(cfg.tiers):
        load(registry.backends, tier.backend, f"tiers[{i}].backend")
        if tier.policy:
            load(registry.policies, tier.policy, f"tiers[{i}].policy")
        codec = tier.options().get("codec")
        name = codec.get("name") if isinstance(codec, Mapping) else codec
        if isinstance(name, str):
            load(registry.codecs, name, f"tiers[{i}].codec")
    return out


def _check_path(where: str, backend: str, path: str) -> Finding | None:
    if os.path.exists(path):
        if not os.path.isdir(path):
            return Finding(where, f"{path!r} exists and is not a directory; the {backend} tier needs a directory of its own")
        if not os.access(path, os.W_OK | os.X_OK):
            return Finding(where, f"the directory {path!r} is not writable by this user (uid {os.getuid()})")
        return None
    parent = _existing_ancestor(path)
    if not os.path.isdir(parent):
        return Finding(where, f"{path!r} cannot be created: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        return Finding(where, f"{path!r} cannot be created: {parent!r} is not writable by this user (uid {os.getuid()})")
    return None


def _check_disks(cfg: StoreConfig, measure_used: bool) -> list[Finding]:
    out: list[Finding] = []
    groups: dict[int, list[tuple[int, str, int]]] = {}  # st_dev -> [(tier, path, capacity)]
    for i, tier in enumerate(cfg.tiers):
        path = tier.options().get("path")
        if not isinstance(path, (str, os.PathLike)):
            continue
        path = os.fspath(path)
        problem = _check_path(f"tiers[{i}].path", tier.backend, path)
        if problem is not None:
            out.append(problem)
            continue
        try:
            dev = os.stat(_existing_ancestor(path)).st_dev
        except OSError:
            continue
        groups.setdefault(dev, []).append((i, path, tier.capacity))
    for members in groups.values():
        anchor = _existing_ancestor(members[0][1])
        try:
            st = os.statvfs(anchor)
        except OSError:
            continue
        free = st.f_bavail * st.f_frsize
        size = st.f_blocks * st.f_frsize
        held = [_held(p, measure_used) for _, p, _ in members]
        if None in held:
            continue  # not measured here; that tier checks its own space when it opens
        used = sum(h or 0 for h in held)
        want = sum(c for _, _, c in members)
        if want <= free + used:
            continue
        names = " + ".join(f"tiers[{i}] {format_size(c)}" for i, _, c in members)
        what = f"capacity {format_size(want)}" + (f" ({names})" if len(members) > 1 else "")
        if want > size:
            message = f"{what} is more than the whole filesystem at {anchor!r} holds ({format_size(size)})"
        else:
            message = (
                f"{what} is more than the {format_size(free)} free at {anchor!r}"
                + (f" plus the {format_size(used)} these tiers already use" if used else "")
                + "; writes will fail once the disk is full"
            )
        for i, _, _ in members:
            out.append(Finding(f"tiers[{i}].capacity", message))
    return out


def _pins(options: Mapping[str, Any]) -> bool:
    pin = options.get("pin_memory", "auto")
    if pin is True:
        return True
    if pin != "auto":
        return False
    import torch

    return bool(torch.cuda.is_available())


def _check_memory(cfg: StoreConfig) -> list[Finding]:
    out: list[Finding] = []
    total, available = host_memory()
    host = [(i, t) for i, t in enumerate(cfg.tiers) if t.backend in HOST_MEMORY_BACKENDS]
    want = sum(t.capacity for _, t in host)
    if host:
        names = " + ".join(f"tiers[{i}] {format_size(t.capacity)}" for i, t in host)
        if total is not None and want > total:
            for i, _ in host:
                out.append(Finding(f"tiers[{i}].capacity", f"host memory tiers need {format_size(want)} ({names}), more than this machine's {format_size(total)} of memory"))
        elif available is not None and want > available:
            for i, _ in host:
                out.append(
                    Finding(
                        f"tiers[{i}].capacity",
                        f"host memory tiers need {format_size(want)} ({names}), more than the {format_size(available)} available now",
                        "warning",
                    )
                )
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    for i, tier in host:
        if tier.backend != "cpu" or not _pins(tier.options()):
            continue
        if soft != resource.RLIM_INFINITY and tier.capacity > soft:
            out.append(
                Finding(
                    f"tiers[{i}].capacity",
                    f"{format_size(tier.capacity)} of pinned memory is more than the locked-memory limit "
                    f"(RLIMIT_MEMLOCK, ulimit -l) of {format_size(soft)}; pinning may fail or be refused. "
                    "Raise the limit, or set pin_memory: false",
                    "warning",
                )
            )
        if available is not None and tier.capacity > available:
            out.append(Finding(f"tiers[{i}].capacity", f"{format_size(tier.capacity)} of pinned memory cannot be swapped out and is more than the {format_size(available)} available"))
    for i, tier in enumerate(cfg.tiers):
        if tier.backend not in DEVICE_MEMORY_BACKENDS:
            continue
        import torch

        device = str(tier.options().get("device", "cuda"))
        if device.startswith("cuda") and not torch.cuda.is_available():
            out.append(Finding(f"tiers[{i}].device", f"{device!r}: CUDA is not available on this machine"))
            continue
        if device.startswith("cuda"):
            try:
                free, total_dev = torch.cuda.mem_get_info(torch.device(device))
            except Exception as exc:
                out.append(Finding(f"tiers[{i}].device", f"{device!r} cannot be queried: {exc}"))
                continue
            if tier.capacity > total_dev:
                out.append(Finding(f"tiers[{i}].capacity", f"{format_size(tier.capacity)} is more than {device}'s {format_size(total_dev)} of memory"))
            elif tier.capacity > free:
                out.append(Finding(f"tiers[{i}].capacity", f"{format_size(tier.capacity)} is more than the {format_size(free)} free on {device} now", "warning"))
    return out


def tier_slots(cfg: StoreConfig, index: int, block_bytes: int) -> tuple[int | None, bool]:
    """(blocks tier ``index`` holds at ``block_bytes`` per block, whether it may hold more), built
    from the backend itself without opening it (:meth:`kvtier.backend.Backend.blocks_for`): an
    LMDB tier's bookkeeping and every record's header and page rounding are counted, so the
    figure is where eviction starts. ``(None, False)`` when the backend cannot be built here.
    "May hold more": a compressing codec stores smaller records than the worst case counted."""
    from kvtier.backend import BlockFormat

    try:
        backend = build_backend(cfg.tiers[index], index)
        slots = backend.blocks_for(BlockFormat(block_bytes=block_bytes))
    except Exception:  # reported by load_config or the plugin check
        return None, False
    codec = getattr(getattr(backend, "codec", None), "name", "none")
    return slots, codec != "none"


def _check_remote(cfg: StoreConfig, timeout_s: float) -> list[Finding]:
    """Ask each tier that can be probed (a backend with ``probe(timeout_s)``: ``redis``, and any
    plugin that defines it) whether its server answers, one connection each, nothing kept."""
    out: list[Finding] = []
    for i, tier in enumerate(cfg.tiers):
        try:
            backend = build_backend(tier, i)
        except Exception:  # a backend that cannot be built was reported by load_config or _check_plugins
            continue
        probe = getattr(backend, "probe", None)
        if not callable(probe):
            continue
        try:
            problem = probe(timeout_s)
        except Exception as exc:  # a plugin's probe that raises instead of answering
            problem = f"the probe failed: {type(exc).__name__}: {exc}"
        if problem:
            out.append(Finding(f"tiers[{i}]", f"the {tier.backend} server does not answer: {problem}"))
    return out


def check_deployment(cfg: StoreConfig, *, measure_used: bool = True, probe_timeout_s: float | None = None) -> list[Finding]:
    """Every reason ``cfg`` may not run on this machine, errors first. Writes nothing.

    ``measure_used`` walks each persistent tier's directory to count what it already holds
    (free space + held bytes is what the tier may fill); without it the check is quicker and
    may report a full disk that the tier itself fills. ``probe_timeout_s`` also connects to
    each remote tier's server (at most that long per socket call) and reports one that does
    not answer, refuses the credentials or fails the TLS handshake; ``None`` (what a store
    does at open) touches no network.
    """
    findings = _check_plugins(cfg) + _check_disks(cfg, measure_used) + _check_memory(cfg)
    if probe_timeout_s is not None:
        findings += _check_remote(cfg, probe_timeout_s)
    return sorted(findings, key=lambda f: f.severity != "error")


def log_findings(cfg: StoreConfig, logger: logging.Logger | None = None) -> list[Finding]:
    """Run :func:`check_deployment` and log each finding as a warning (what a store does at open)."""
    try:
        findings = check_deployment(cfg, measure_used=False)
    except Exception as exc:  # the check must never stop a store from opening
        (logger or log).debug("kvtier deployability check failed: %s", exc)
        return []
    for finding in findings:
        (logger or log).warning("kvtier config: %s", finding)
    return findings
