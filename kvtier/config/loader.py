"""Store configuration: block size, the ordered tiers, write mode, policy and namespace.

Sources, applied in this order:

1. a mapping, or a YAML (``.yaml``/``.yml``/``.json``) or TOML (``.toml``) file
   (:func:`load_config_file`);
2. environment overrides ``KVTIER_<FIELD>[__<FIELD or INDEX>...]`` (:func:`apply_env`), e.g.
   ``KVTIER_POLICY=arc``, ``KVTIER_WRITE=through``, ``KVTIER_TIERS__0__CAPACITY=4GiB``. Segments
   are separated by a double underscore and matched case-insensitively; a number indexes a
   list (one past the end appends); values are read as YAML scalars, so quote a value to keep
   it a string (``KVTIER_NAMESPACE__REVISION='"0123"'``). ``KVTIER_CONFIG`` (a file path) and
   ``KVTIER_CACHE_DIR`` (see :mod:`kvtier.config.cache`) are not overrides; any other ``KVTIER_``
   variable must name a setting.

Validation happens in two passes that report together: the schema (pydantic: unknown keys,
sizes, names of backends, codecs and policies checked against :mod:`kvtier.registry`, capacity
against the block size), then every tier's backend is *instantiated* with its options
(constructors do no I/O), so an option the backend rejects is reported under its own path.
Every problem becomes part of ONE :class:`~kvtier.errors.ConfigError` whose message names the
source (the file, or ``config``), the field path (``tiers[1].capacity``), the environment
variable that set it if any, and what was expected.

Every configurable object round-trips: ``load_config(cfg.to_dict()) == cfg``, and the same
holds for :class:`TierConfig` and :class:`MetricsConfig`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvtier import registry
from kvtier.config.env import ENV_PREFIX, apply_env_to, field_path
from kvtier.config.head_groups import HeadGroupsConfig
from kvtier.config.paths import expand_tier_paths
from kvtier.config.schema import (
    BlockBytes,
    FlushBytes,
    InlineBytes,
    MetricsConfig,
    StagingBytes,
    TierConfig,
    check_name,
    known_names,
)
from kvtier.config.tenants import TenancyConfig, TenantBytes, tenant_problems
from kvtier.errors import ConfigError, KVTierError, MissingDependencyError, UnknownNameError
from kvtier.units import parse_size

__all__ = [
    "DEFAULT_MODEL_ID",
    "ENV_PREFIX",
    "MetricsConfig",
    "StoreConfig",
    "TierConfig",
    "apply_env",
    "build_backend",
    "default_config",
    "load_config",
    "load_config_file",
    "read_config_file",
]



class StoreConfig(BaseModel):
    """A whole store. ``tiers`` are ordered fastest first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tiers: list[TierConfig] = Field(min_length=1)
    policy: str = "lru"
    write: Literal["back", "through"] = "through"
    #: write-through: store jobs that may wait for the tier writes (behind the group being
    #: written) before a job's copies to byte tiers are deferred to write-back
    write_through_backlog: int = Field(default=16, ge=0, strict=True)
    engine_blocks_per_block: int = Field(default=1, ge=1)
    block_bytes: BlockBytes | None = None
    staging_blocks: int = Field(default=32, ge=1)
    #: device staging for copies between a GPU cache and host tiers (0: none, copy slices in batches)
    staging_bytes: StagingBytes = 256 << 20
    #: threads that copy one job between a host KV cache and a host tier ("auto": a quarter of
    #: the CPUs, 1 to 4; see kvtier.transfer.copies)
    copy_threads: Literal["auto"] | Annotated[int, Field(ge=1, strict=True)] = "auto"
    #: save/load jobs up to this size that touch only host memory tiers run on the caller's
    #: thread, without the two thread hand-offs (0: never; see kvtier.transfer.inline)
    inline_max_bytes: InlineBytes = 32 << 20
    #: seconds a transfer job may take before it is failed and its keys released (None: no limit)
    job_deadline_s: float | None = Field(default=120.0, gt=0)
    namespace: dict[str, Any] | None = None
    metrics: MetricsConfig = MetricsConfig()
    #: on a clean close, seconds spent writing blocks held only in memory tiers back to the
    #: persistent tier (0: no write-back; see kvtier.transfer.flush)
    flush_on_close_s: float = Field(default=60.0, ge=0)
    #: and at most this many bytes of them (None: no limit)
    flush_on_close_bytes: FlushBytes | None = None
    #: byte quotas per tenant per tier name (see kvtier.config.tenants)
    tenants: dict[str, dict[str, TenantBytes]] | None = None
    tenancy: TenancyConfig = TenancyConfig()
    #: how byte tiers lay out records: one per (block, head group) by default (kvtier.config.head_groups)
    head_groups: HeadGroupsConfig = HeadGroupsConfig()

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        return check_name(registry.policies, value)

    @field_validator("namespace")
    @classmethod
    def _valid_namespace(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        from kvtier.keys import Namespace

        try:
            Namespace.from_dict(_namespace_fields(value))
        except ConfigError as exc:
            raise ValueError(_namespace_problem(str(exc), value)) from None
        return value

    def namespace_fields(self) -> dict[str, Any]:
        """The namespace a store builds from this config when the caller passes none: the
        ``namespace`` fields given, the rest at their defaults (``model_id``: ``default``)."""
        return _namespace_fields(self.namespace or {})

    def to_dict(self) -> dict[str, Any]:
        data = self.model_dump(exclude_none=True)
        data["tiers"] = [t.to_dict() for t in self.tiers]
        if self.metrics == MetricsConfig():
            del data["metrics"]
        if self.tenancy == TenancyConfig():
            del data["tenancy"]
        if self.head_groups == HeadGroupsConfig():
            del data["head_groups"]
        else:
            data["head_groups"] = self.head_groups.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        return load_config(data)


#: ``model_id`` of a namespace that names none (a config without ``namespace``, or one that sets
#: only other fields such as ``tp_rank``). Engine integrations put the engine's model name here.
DEFAULT_MODEL_ID = "default"


def _namespace_fields(given: Mapping[str, Any]) -> dict[str, Any]:
    return {"model_id": DEFAULT_MODEL_ID, **given}


def _namespace_problem(message: str, given: Mapping[str, Any]) -> str:
    """``message`` from :class:`~kvtier.keys.Namespace`, with the hint a rank/size problem needs:
    a rank names its size, which defaults to 1 (``tp_rank: 3`` alone is out of range)."""
    for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
        if message.startswith(f"namespace.{rank}:") and size not in given:
            var = f"{ENV_PREFIX}NAMESPACE__{size.upper()}"
            return f"{message}; namespace.{size} is 1 unless set: set it too (e.g. {var}=4)"
    return message


def default_config() -> dict[str, Any]:
    """The default store: a pinned host-memory tier in front of a persistent LMDB tier in the
    kvtier cache directory (:func:`kvtier.config.cache.cache_dir`). ``kvtier sim`` uses smaller tiers of
    its own (``kvtier.sim.cli.default_sim_config``). A fresh dict."""
    from kvtier.config.cache import cache_dir

    return {
        "tiers": [
            {"backend": "cpu", "capacity": "4GiB", "pin_memory": "auto"},
            {"backend": "lmdb", "capacity": "32GiB", "path": os.path.join(cache_dir(), "lmdb")},
        ],
        "policy": "lru",
        "write": "through",
    }


# -- errors ----------------------------------------------------------------------------------


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = StoreConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(str(part))
        ann = getattr(info, "annotation", None) if info else None
        if ann in (MetricsConfig, TenancyConfig, HeadGroupsConfig):
            model = ann
        elif part == "tiers":
            model = TierConfig
    return sorted(model.model_fields)


def _describe(error: Any) -> tuple[str, str]:
    """(field path, message) for one pydantic error, with messages a person can act on."""
    loc = tuple(error["loc"])
    kind = error["type"]
    msg = str(error["msg"])
    if kind == "extra_forbidden":
        return field_path(loc), f"unknown key; expected one of: {', '.join(_allowed_keys(loc))}"
    if kind == "missing":
        return field_path(loc), "required setting is missing"
    if kind == "too_short" and loc == ("tiers",):
        return "tiers", "expected at least one tier"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if loc == ("namespace",) and (m := _NAMESPACE_FIELD.match(msg)):
        return m.group(1), m.group(2)  # the namespace's own field, so "(set by KVTIER_...)" finds it
    if "input" in error and kind not in ("missing",) and not isinstance(error["input"], (dict, list)):
        if repr(error["input"]) not in msg:
            msg = f"{msg} (got {error['input']!r})"
    return field_path(loc), msg


class _Problems:
    """Collects (path, message) pairs and raises them as one ConfigError."""

    def __init__(self, source: str, origins: Mapping[str, str]) -> None:
        self.source = source
        self.origins = origins
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        origin = next((var for p, var in self.origins.items() if path == p or path.startswith((p + ".", p + "["))), None)
        where = f"{path} (set by {origin})" if origin else path
        self.items.append(f"{where}: {message}" if where else message)

    def raise_if_any(self) -> None:
        if not self.items:
            return
        if len(self.items) == 1:
            raise ConfigError(f"{self.source}: {self.items[0]}")
        body = "\n".join(f"  - {item}" for item in self.items)
        raise ConfigError(f"{self.source}: {len(self.items)} problems in the kvtier configuration:\n{body}")


# -- backends --------------------------------------------------------------------------------

_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")
_MISSING = re.compile(r"missing \d+ required (?:keyword-only |positional )?arguments?: (.*)")
_UNKNOWN_OPTIONS = re.compile(r"unknown option\(s\) \[([^\]]*)\]")
_LEADING_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$", re.S)
_NAMESPACE_FIELD = re.compile(r"^(namespace\.\w+): (.*)$", re.S)


def _accepted_options(cls: type) -> list[str]:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    hidden = set(getattr(cls, "hidden_options", ()))
    return sorted(
        p.name
        for p in params
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self" and p.name not in hidden
    )


def _backend_option_names(cls: type) -> list[str] | None:
    """Every option ``cls`` accepts, or ``None`` when it takes ``**kwargs`` (any name may be valid)."""
    model = getattr(cls, "options_model", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return None if model.model_config.get("extra") == "allow" else sorted(model.model_fields)
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]


def _backend_problems(tier: TierConfig, index: int, cls: type) -> list[tuple[str, str]]:
    """Problems with ``tier``'s options, found by instantiating the backend (no I/O)."""
    here = f"tiers[{index}]"
    options = tier.options()
    codec = options.get("codec")
    if codec is not None:
        name = codec.get("name") if isinstance(codec, Mapping) else codec
        if isinstance(name, str) and ":" not in name and name not in registry.codecs.names():
            return [(f"{here}.codec", f"unknown codec {name!r}; {known_names(registry.codecs)}")]
    model = getattr(cls, "options_model", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        try:
            model.model_validate(options)
        except ValidationError as exc:
            return [(field_path((here, *e["loc"])), _describe(e)[1]) for e in exc.errors()]
    try:
        cls(**options)
    except TypeError as exc:
        text = str(exc)
        accepted_names = _accepted_options(cls)
        if m := _UNEXPECTED.search(text):
            return [(f"{here}.{m.group(1)}", f"unknown option for the {tier.backend!r} backend; accepted: {', '.join(accepted_names)}")]
        if m := _MISSING.search(text):
            names = re.findall(r"'(\w+)'", m.group(1))
            return [(f"{here}.{n}", f"required by the {tier.backend!r} backend") for n in names]
        return [(here, f"{tier.backend!r} backend rejected its options: {text}")]
    except UnknownNameError as exc:
        return [(f"{here}.codec" if "codec" in str(exc) else here, str(exc))]
    except MissingDependencyError as exc:
        return [(f"{here}.backend", str(exc))]
    except ConfigError as exc:
        text = str(exc)
        if m := _UNKNOWN_OPTIONS.search(text):
            names = re.findall(r"'(\w+)'", m.group(1))
            accepted = ", ".join(_accepted_options(cls))
            return [(f"{here}.{n}", f"unknown option for the {tier.backend!r} backend; accepted: {accepted}") for n in names]
        if m := _LEADING_FIELD.match(text):
            path, rest = m.groups()
            if path.startswith("tiers["):
                return [(path, rest)]
            return [(f"{here}.{path}", rest)]
        return [(here, text)]
    return []


def build_backend(tier: TierConfig, index: int = 0) -> Any:
    """Instantiate ``tier``'s backend; a rejected option is a ConfigError naming ``tiers[index].<option>``."""
    cls = registry.backends.get(tier.backend)
    problems = _Problems("config", {})
    for path, message in _backend_problems(tier, index, cls):
        problems.add(path, message)
    problems.raise_if_any()
    return cls(**tier.options())


def apply_env(data: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Return ``data`` with ``KVTIER_...`` overrides applied, and {field path: variable} of what they set
    (see :mod:`kvtier.config.env`)."""
    return apply_env_to(data, environ, set(StoreConfig.model_fields))


# -- loading ---------------------------------------------------------------------------------


def load_config(
    config: Mapping[str, Any] | StoreConfig,
    *,
    source: str = "config",
    env: Mapping[str, str] | bool = False,
    block_bytes: int | str | None = None,
) -> StoreConfig:
    """Validate ``config`` into a frozen :class:`StoreConfig`.

    ``env=True`` applies ``KVTIER_...`` overrides from ``os.environ`` (or pass a mapping).
    ``block_bytes`` (when the config has none) is used only to check that every capacity holds
    at least one block. Every problem is reported in one :class:`ConfigError` naming ``source``.
    """
    if isinstance(config, StoreConfig) and env is False and block_bytes is None:
        return config  # already validated
    if isinstance(config, StoreConfig):
        data: Mapping[str, Any] = config.to_dict()
    elif isinstance(config, Mapping):
        data = config
    else:
        raise ConfigError(f"{source}: expected a mapping of settings, got {type(config).__name__}")
    origins: dict[str, str] = {}
    if env is not False:
        try:
            data, origins = apply_env(data, None if env is True else env)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    problems = _Problems(source, origins)
    data, unknown = _strip_unknown_keys(data)
    data, unexpanded = expand_tier_paths(data)  # ~ and $VAR: see kvtier.config.paths
    for where, message in unexpanded:
        problems.add(where, message)
    suggested: set[str] = set()
    for where, key, message, hint in unknown:
        var = origins.get(f"{where}.{key}" if where else key)
        problems.add(where, f"{message} (set by {var})" if var else message)
        if hint:
            suggested.add(f"{where}.{hint}" if where else hint)
    cfg: StoreConfig | None = None
    try:
        cfg = StoreConfig.model_validate(dict(data))
    except ValidationError as exc:
        for error in exc.errors():
            path, message = _describe(error)
            if error["type"] == "missing" and path in suggested:
                continue  # already reported as the misspelt key
            problems.add(path, message)
    # The tiers are checked against their backends even when other settings are wrong, so one
    # run reports every problem rather than one layer at a time.
    size = cfg.block_bytes if cfg is not None else _quiet_size(data.get("block_bytes"))
    if size is None and block_bytes is not None:
        size = parse_size(block_bytes, field="block_bytes")
    for i, tier in _valid_tiers(cfg, data):
        if size and tier.capacity < size:
            problems.add(
                f"tiers[{i}].capacity",
                f"{tier.capacity} bytes is below one block ({size} bytes); expected at least block_bytes",
            )
            continue
        try:
            cls = registry.backends.get(tier.backend)
        except KVTierError as exc:
            problems.add(f"tiers[{i}].backend", str(exc))
            continue
        except Exception as exc:  # a plugin that fails to import in some other way
            problems.add(f"tiers[{i}].backend", f"the {tier.backend!r} backend cannot be loaded: {type(exc).__name__}: {exc}")
            continue
        for path, message in _backend_problems(tier, i, cls):
            problems.add(path, message)
    if cfg is not None:
        for path, message in tenant_problems(cfg.tenants, cfg.tenancy, cfg.tiers, [t.capacity for t in cfg.tiers]):
            problems.add(path, message)
    problems.raise_if_any()
    assert cfg is not None
    return cfg


def _quiet_size(value: Any) -> int | None:
    try:
        return None if value is None else parse_size(value, field="block_bytes") or None
    except ConfigError:
        return None


def _valid_tiers(cfg: StoreConfig | None, data: Mapping[str, Any]) -> list[tuple[int, TierConfig]]:
    if cfg is not None:
        return list(enumerate(cfg.tiers))
    raw = data.get("tiers")
    out: list[tuple[int, TierConfig]] = []
    for i, tier in enumerate(raw if isinstance(raw, list) else []):
        try:
            out.append((i, TierConfig.model_validate(tier)))
        except ValidationError:
            continue  # its errors came with the whole config's
    return out


def _suggest(key: Any, allowed: list[str]) -> str | None:
    match = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
    return match[0] if match else None


def _tier_keys(backend: Any) -> tuple[set[str], list[str]] | None:
    """(every key a tier of ``backend`` accepts, the ones to suggest), or ``None`` when unknown."""
    if not isinstance(backend, str):
        return None
    try:
        if backend not in registry.backends:
            return None
        cls = registry.backends.get(backend)
    except Exception:  # reported by the backend check
        return None
    options = _backend_option_names(cls)
    if options is None:
        return None
    accepted = set(TierConfig.model_fields) | set(options)
    return accepted, sorted(accepted - set(getattr(cls, "hidden_options", ())))


def _strip_unknown_keys(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str, str, str | None]]]:
    """A copy of ``data`` without unknown keys, and (where, key, message, suggestion) for each one.

    Keys are checked at every level (top, ``metrics``, ``namespace``, each tier against its
    backend's options) before the schema runs, so a misspelt key is reported by its own name
    with the nearest known one, instead of as a missing setting.
    """
    from kvtier.keys import Namespace

    found: list[tuple[str, str, str, str | None]] = []

    def sift(node: Mapping[str, Any], where: str, accepted: set[str], listed: list[str]) -> dict[str, Any]:
        kept = {}
        for key, value in node.items():
            if key in accepted:
                kept[key] = value
                continue
            hint = _suggest(key, listed)
            tail = f"did you mean {hint!r}?" if hint else f"expected one of: {', '.join(listed)}"
            found.append((where, str(key), f"unknown key {key!r} — {tail}", hint))
        return kept

    top = sorted(StoreConfig.model_fields)
    out = sift(data, "", set(top), top)
    for section, model in (("metrics", MetricsConfig), ("tenancy", TenancyConfig)):
        node = out.get(section)
        if isinstance(node, Mapping):
            names = sorted(model.model_fields)
            out[section] = sift(node, section, set(names), names)
    namespace = out.get("namespace")
    if isinstance(namespace, Mapping):
        names = sorted(f.name for f in dataclasses.fields(Namespace) if f.init)
        out["namespace"] = sift(namespace, "namespace", set(names), names)
    tiers = out.get("tiers")
    if isinstance(tiers, list):
        checked: list[Any] = []
        for i, tier in enumerate(tiers):
            keys = _tier_keys(tier.get("backend")) if isinstance(tier, Mapping) else None
            checked.append(tier if keys is None else sift(tier, f"tiers[{i}]", *keys))
        out["tiers"] = checked
    return out, found


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML, JSON or TOML file into a dict (no validation). Errors name the file."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the config file: {exc.strerror or exc}") from exc
    if file.suffix.lower() == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError as exc:
                raise MissingDependencyError(f"{file}: reading TOML on Python 3.10 needs 'pip install tomli'") from exc
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: not valid TOML: {exc}") from exc
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file}: not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a mapping of settings at the top level, got {type(data).__name__}")
    return data


def load_config_file(
    path: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | bool = True,
    block_bytes: int | str | None = None,
) -> StoreConfig:
    """Read and validate a config file; ``KVTIER_...`` overrides apply unless ``env=False``."""
    return load_config(read_config_file(path), source=str(path), env=env, block_bytes=block_bytes)
