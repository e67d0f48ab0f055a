"""The tenant of each vLLM request: its ``cache_salt`` (no vLLM import).

vLLM folds a request's ``cache_salt`` into its block hashes, so two salts never share a block;
kvtier also counts each block as its salt's tenant and stores it under that tenant's quotas
(``tenants:`` in the kvtier config, keyed by the salt). The connector notes each request's
salt when vLLM first asks about the request (``get_num_new_matched_tokens``) and forgets it when
the request ends; the offloading manager looks the tenant up by request id when it plans a
store. A request without a salt is the ``default`` tenant's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RequestTenants"]


class RequestTenants:
    """Request id -> tenant (the request's ``cache_salt``), for the requests running."""

    def __init__(self) -> None:
        self._of: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._of)

    def note(self, request: Any) -> None:
        """Remember ``request``'s tenant (a vLLM ``Request``: ``request_id``, ``cache_salt``)."""
        salt = getattr(request, "cache_salt", None)
        if isinstance(salt, str) and salt:
            self._of[request.request_id] = salt[:256]

    def tenant(self, request_id: Any) -> str | None:
        """The tenant of the request ``request_id`` (``None``: the default tenant)."""
        return self._of.get(request_id) if isinstance(request_id, str) else None

    def forget(self, request_id: str) -> None:
        self._of.pop(request_id, None)
