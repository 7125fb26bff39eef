"""The caller's tenant, as the store says (its `WhoAmI` answer for the caller's key).

Requests that need no adapter (base-model Generate, ListLoadedAdapters, UnloadAdapter)
still need the caller's key checked and their tenant known, and the replica keeps no key
list of its own. Answers are cached per key hash for `ttl_s` so a busy caller does not cost
a store call per request; a key the store refuses is not cached (no negative entries: the
store's UNAUTHENTICATED goes to the caller every time). While the store cannot answer, an
expired entry for the same key hash is used (callers already known keep being served, as in
the resolver); without one the caller gets UNAVAILABLE naming the store. An adapter the
store resolved for a caller also tells their tenant (the store looks adapters up in the
caller's tenant only), so adapter requests fill this cache without a `WhoAmI` call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import grpc

from inference_svc.adapters.caller import Caller
from inference_svc.adapters.store_errors import from_store_error, is_store_down

log = logging.getLogger("loraserve.tenants")


class TenantLookup(Protocol):
    """The part of the store client this uses."""

    async def who_am_i(self, caller_key: str | None = None) -> str:
        """The tenant of `caller_key` ("" = no key); grpc.RpcError when refused."""
        ...


@dataclass(frozen=True)
class TenantCacheConfig:
    store_address: str  # named in error messages
    ttl_s: float = 10.0  # how long a key → tenant answer is trusted

    def __post_init__(self) -> None:
        if self.ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {self.ttl_s}")


@dataclass(frozen=True)
class _Entry:
    tenant: str
    fetched_at: float


class CallerTenants:
    def __init__(self, config: TenantCacheConfig, store: TenantLookup) -> None:
        self.config = config
        self._store = store
        # Key hash -> answer. Bounded by the store's keys: only accepted keys are cached.
        self._cache: dict[str, _Entry] = {}
        self.lookups = 0  # store calls made (tests check caching with it)

    async def tenant_of(self, caller: Caller) -> str:
        """The caller's tenant; raises Unauthenticated (from the store) for a bad key."""
        entry = self._cache.get(caller.key_hash)
        if entry is not None and time.monotonic() - entry.fetched_at < self.config.ttl_s:
            return entry.tenant
        try:
            self.lookups += 1
            tenant = await self._store.who_am_i(caller_key=caller.api_key)
        except grpc.RpcError as error:
            if entry is not None and is_store_down(error):
                log.warning("store unavailable; using the cached tenant of a known caller")
                return entry.tenant
            self._cache.pop(caller.key_hash, None)  # refused now: forget the old answer
            raise from_store_error(error, self.config.store_address, "the caller's key") from None
        self.remember(caller, tenant)
        return tenant

    def remember(self, caller: Caller, tenant: str) -> None:
        """Record the tenant the store answered for `caller` in another call."""
        self._cache[caller.key_hash] = _Entry(tenant, time.monotonic())
