"""API keys → tenants.

Keys are configured as sha256 hashes (never in clear at rest), as JSON, from a file or an
environment variable:

    {"keys": [{"sha256": "<hex of sha256(key)>", "tenant": "acme",
               "base_models": ["deepseek-v2-lite"], "max_adapters": 100,
               "max_concurrent": 8}]}

`base_models` (optional; absent = all) lists the base models the tenant may see and use.
`max_adapters` / `max_concurrent` (optional; absent = the server's defaults, 0 = unlimited)
are the tenant's limits (adapter_store.tenant_limits).
Every RPC then needs `authorization: Bearer <key>`. With no keys configured, everyone is
tenant `default` with access to all base models; the server logs that auth is off.
`loractl hash-key KEY` prints the hash for a new key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from adapter_store.errors import InvalidArgument, PermissionDenied, Unauthenticated
from adapter_store.names import check_name
from adapter_store.tenant_limits import NO_LIMITS, TenantLimits

DEFAULT_TENANT = "default"
_BEARER = "bearer "


def hash_key(key: str) -> str:
    """The at-rest form of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant, the base models it may use (None = every one), its limits."""

    tenant: str
    base_models: frozenset[str] | None = None
    limits: TenantLimits = NO_LIMITS

    def may_use(self, base_model: str) -> bool:
        return self.base_models is None or base_model in self.base_models

    def check_base_model(self, base_model: str) -> None:
        if not self.may_use(base_model):
            raise PermissionDenied(f"tenant {self.tenant!r} may not use base model {base_model!r}")


def _optional_count(entry: dict, field: str) -> int | None:
    value = entry.get(field)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    return value


def parse_api_keys(
    text: str, source: str, default_limits: TenantLimits = NO_LIMITS
) -> dict[str, Principal]:
    """The key configuration JSON → {sha256 hex: principal}; InvalidArgument naming `source`.

    Entries without limits of their own get `default_limits`.
    """
    try:
        entries = json.loads(text)["keys"]
        principals: dict[str, Principal] = {}
        for entry in entries:
            digest = str(entry["sha256"]).lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"sha256 {digest[:80]!r} is not 64 hex digits")
            allowed = entry.get("base_models")
            principals[digest] = Principal(
                check_name(str(entry["tenant"]), "tenant"),
                None if allowed is None else frozenset(str(name) for name in allowed),
                default_limits.overridden(
                    _optional_count(entry, "max_adapters"), _optional_count(entry, "max_concurrent")
                ),
            )
    except (ValueError, KeyError, TypeError, InvalidArgument) as error:
        raise InvalidArgument(f"API keys in {source} are malformed: {error}") from None
    return principals


class Authenticator:
    """Resolves the caller of an RPC from its metadata."""

    def __init__(
        self, principals: Mapping[str, Principal], anonymous_limits: TenantLimits = NO_LIMITS
    ) -> None:
        self._principals = dict(principals)
        self._anonymous = Principal(DEFAULT_TENANT, limits=anonymous_limits)

    @property
    def enabled(self) -> bool:
        return bool(self._principals)

    def principal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """The caller; Unauthenticated without a known bearer key when auth is on."""
        if not self.enabled:
            return self._anonymous
        header = next((value for key, value in metadata or () if key == "authorization"), None)
        if not isinstance(header, str) or not header.lower().startswith(_BEARER):
            raise Unauthenticated("missing 'authorization: Bearer <api key>' metadata")
        principal = self._principals.get(hash_key(header[len(_BEARER) :].strip()))
        if principal is None:
            raise Unauthenticated("unknown API key")
        return principal
