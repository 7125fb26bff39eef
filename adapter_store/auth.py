"""API keys → tenants.

Keys are configured as sha256 hashes (never in clear at rest), as JSON, from a file or an
environment variable:

    {"keys": [{"sha256": "<hex of sha256(key)>", "tenant": "acme",
               "base_models": ["deepseek-v2-lite"]}]}

`base_models` (optional; absent = all) lists the base models the tenant may see and use.
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

DEFAULT_TENANT = "default"
_BEARER = "bearer "


def hash_key(key: str) -> str:
    """The at-rest form of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant and the base models it may use (None = every one)."""

    tenant: str
    base_models: frozenset[str] | None = None

    def may_use(self, base_model: str) -> bool:
        return self.base_models is None or base_model in self.base_models

    def check_base_model(self, base_model: str) -> None:
        if not self.may_use(base_model):
            raise PermissionDenied(f"tenant {self.tenant!r} may not use base model {base_model!r}")


def parse_api_keys(text: str, source: str) -> dict[str, Principal]:
    """The key configuration JSON → {sha256 hex: principal}; InvalidArgument naming `source`."""
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
            )
    except (ValueError, KeyError, TypeError, InvalidArgument) as error:
        raise InvalidArgument(f"API keys in {source} are malformed: {error}") from None
    return principals


class Authenticator:
    """Resolves the caller of an RPC from its metadata."""

    def __init__(self, principals: Mapping[str, Principal]) -> None:
        self._principals = dict(principals)

    @property
    def enabled(self) -> bool:
        return bool(self._principals)

    def principal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """The caller; Unauthenticated without a known bearer key when auth is on."""
        if not self.enabled:
            return Principal(DEFAULT_TENANT)
        header = next((value for key, value in metadata or () if key == "authorization"), None)
        if not isinstance(header, str) or not header.lower().startswith(_BEARER):
            raise Unauthenticated("missing 'authorization: Bearer <api key>' metadata")
        principal = self._principals.get(hash_key(header[len(_BEARER) :].strip()))
        if principal is None:
            raise Unauthenticated("unknown API key")
        return principal
