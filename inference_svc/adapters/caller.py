"""Who asked: the caller's API key as the inference service forwards it to the store.

The inference service keeps no key list of its own. It passes each caller's
`authorization: Bearer <key>` on to the store when it resolves or fetches an adapter, so the
store decides the tenant (NOT_FOUND for another tenant's adapter, UNAUTHENTICATED without a
known key when the store has keys). Anything cached from such an answer is keyed by the
key's sha256, never shared between callers, and the raw key is never logged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from adapter_store.auth import hash_key

_BEARER = "bearer "


@dataclass(frozen=True)
class Caller:
    api_key: str = field(default="", repr=False)  # "" when the caller sent none

    @property
    def key_hash(self) -> str:
        """The cache identity of this caller ("" for callers without a key)."""
        return hash_key(self.api_key) if self.api_key else ""

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller:
        """The caller of an RPC from its invocation metadata (a malformed header counts
        as no key: the store then answers UNAUTHENTICATED when it has keys)."""
        for key, value in metadata or ():
            bearer = isinstance(value, str) and value.lower().startswith(_BEARER)
            if key == "authorization" and bearer:
                return cls(value[len(_BEARER) :].strip())
        return cls()


ANONYMOUS = Caller()
