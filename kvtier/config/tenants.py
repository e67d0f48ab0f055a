"""The ``tenants`` and ``tenancy`` sections of a store config.

.. code-block:: yaml

    tenants:                 # byte quotas per tier, by tier name
      chat: {cpu: 2GiB, lmdb: 100GiB}
      default: {cpu: 512MiB} # each tenant not named: a cap, without a reservation
    tenancy:
      top_n: 10              # tenants named in usage reports and metrics; the rest are "other"
      hash_ids: false        # true: tenant ids appear in logs and metric labels only hashed
      pin_budget: {cpu: 1GiB}  # bytes that may be pinned per tier (default: half the tier)

A tier's name is its ``name``, or its backend's name (``cpu``, ``lmdb``...), with its index
appended when two tiers share one (``cpu1``), as the store names them. Each problem (an unknown
tier, a quota larger than its tier, quotas that reserve more than a tier holds) is reported under
its own path, ``tenants.chat.cpu``. A tenant that has stored nothing yet may have a quota: tenants
are whatever the engine names (cache salts), so a quota may come before the tenant's first
request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from kvtier.errors import ConfigError
from kvtier.manager.tenants import DEFAULT_TENANT, MAX_TENANT_LEN, TenantRules
from kvtier.units import parse_size

__all__ = ["TenancyConfig", "TenantBytes", "hashed_tenant", "tenant_problems", "tenant_rules", "tier_names"]


def _bytes(value: Any) -> int:
    try:
        return parse_size(value, field="quota")
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix("quota: ")) from None


TenantBytes = Annotated[int, BeforeValidator(_bytes)]


class TenancyConfig(BaseModel):
    """How tenants are reported and how much may be pinned."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: tenants named (by bytes held) in usage reports and Prometheus labels; the rest: ``other``
    top_n: int = Field(default=10, ge=1, strict=True)
    #: show tenant ids only hashed (``t-`` and 12 hex digits) in logs and metric labels
    hash_ids: bool = False
    #: bytes that may be pinned, by tier name (a tier not listed: half its capacity)
    pin_budget: dict[str, TenantBytes] = Field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def tier_names(tiers: Sequence[Any]) -> list[str]:
    """The names the store gives ``tiers`` (each with ``name`` and ``backend``)."""
    names: list[str] = []
    for i, tier in enumerate(tiers):
        name = tier.name or tier.backend
        names.append(f"{name}{i}" if name in names else name)
    return names


def tenant_problems(
    tenants: Mapping[str, Mapping[str, int]] | None, tenancy: TenancyConfig, tiers: Sequence[Any], capacities: Sequence[int]
) -> list[tuple[str, str]]:
    """(field path, message) for each problem of the quotas and pin budgets against ``tiers``."""
    names = tier_names(tiers)
    out: list[tuple[str, str]] = []
    reserved = dict.fromkeys(names, 0)

    def check(where: str, tier: str, nbytes: int) -> bool:
        if tier not in reserved:
            out.append((where, f"no tier {tier!r}; the tiers are {names}"))
            return False
        capacity = capacities[names.index(tier)]
        if nbytes > capacity:
            out.append((where, f"{nbytes} bytes is larger than the tier ({capacity} bytes)"))
            return False
        return True

    for tenant, caps in (tenants or {}).items():
        if not tenant or len(tenant) > MAX_TENANT_LEN:
            out.append((f"tenants.{tenant}", f"a tenant id is a non-empty string of at most {MAX_TENANT_LEN} characters"))
            continue
        for tier, nbytes in caps.items():
            if check(f"tenants.{tenant}.{tier}", tier, nbytes) and tenant != DEFAULT_TENANT:
                reserved[tier] += nbytes
    for tier, total in reserved.items():
        capacity = capacities[names.index(tier)]
        if total > capacity:
            out.append(("tenants", f"the quotas of tier {tier!r} reserve {total} bytes, more than the tier holds ({capacity} bytes)"))
    for tier, nbytes in tenancy.pin_budget.items():
        check(f"tenancy.pin_budget.{tier}", tier, nbytes)
    return out


def tenant_rules(tenants: Mapping[str, Mapping[str, int]] | None, tenancy: TenancyConfig, names: Sequence[str]) -> TenantRules:
    """The manager's rules (by tier index) for the tiers the store opened as ``names``."""
    index = {name: i for i, name in enumerate(names)}
    return TenantRules(
        quotas={u: {index[t]: n for t, n in caps.items() if t in index} for u, caps in (tenants or {}).items()},
        pin_budget={index[t]: n for t, n in tenancy.pin_budget.items() if t in index},
        top_n=tenancy.top_n,
    )


def hashed_tenant(tenant: str, hash_ids: bool) -> str:
    """``tenant`` as logs and metric labels show it: itself, or ``t-`` and 12 hex digits of its
    SHA-256 when ``hash_ids`` (``default`` and ``other`` stay as they are)."""
    if not hash_ids or tenant in (DEFAULT_TENANT, "other"):
        return tenant
    return "t-" + hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:12]
