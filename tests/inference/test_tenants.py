"""The caller → tenant cache: per key hash, for its TTL, refusals never cached, the stale
answer only for the same key while the store is down."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from adapter_store.errors import Unauthenticated, Unavailable
from inference_svc.adapters.caller import ANONYMOUS, Caller
from inference_svc.adapters.tenants import CallerTenants, TenantCacheConfig
from tests.inference.test_resolver import FakeRpcError

ALPHA, BRAVO = Caller("key-alpha"), Caller("key-bravo")


class FakeStore:
    def __init__(self) -> None:
        self.tenants = {"key-alpha": "alpha", "key-bravo": "bravo"}
        self.down = False
        self.keys: list[str | None] = []

    async def who_am_i(self, caller_key: str | None = None) -> str:
        self.keys.append(caller_key)
        if self.down:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if caller_key not in self.tenants:
            raise FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        return self.tenants[caller_key]


def tenants(store: FakeStore, ttl: float = 60.0) -> CallerTenants:
    return CallerTenants(TenantCacheConfig("store:1", ttl), store)


def test_cached_per_key_for_the_ttl() -> None:
    store = FakeStore()
    t = tenants(store)
    assert asyncio.run(t.tenant_of(ALPHA)) == "alpha"
    assert asyncio.run(t.tenant_of(ALPHA)) == "alpha"
    assert asyncio.run(t.tenant_of(BRAVO)) == "bravo"
    assert store.keys == ["key-alpha", "key-bravo"]
    expiring = tenants(store, ttl=0.0)
    asyncio.run(expiring.tenant_of(ALPHA))
    asyncio.run(expiring.tenant_of(ALPHA))
    assert expiring.lookups == 2


def test_refusals_are_not_cached_and_drop_the_old_answer() -> None:
    store = FakeStore()
    t = tenants(store, ttl=0.0)
    for _ in range(2):
        with pytest.raises(Unauthenticated, match="caller's key: unknown API key"):
            asyncio.run(t.tenant_of(ANONYMOUS))
    assert t.lookups == 2
    asyncio.run(t.tenant_of(ALPHA))
    del store.tenants["key-alpha"]  # the key was revoked
    with pytest.raises(Unauthenticated):
        asyncio.run(t.tenant_of(ALPHA))
    store.down = True  # the revoked key's old answer is gone, not a stale fallback
    with pytest.raises(Unavailable, match="store:1"):
        asyncio.run(t.tenant_of(ALPHA))


def test_store_down_answers_only_known_keys_from_their_own_entry() -> None:
    store = FakeStore()
    t = tenants(store, ttl=0.0)
    t.remember(BRAVO, "bravo")  # e.g. learnt from an adapter the store resolved for bravo
    asyncio.run(t.tenant_of(ALPHA))
    store.down = True
    assert asyncio.run(t.tenant_of(ALPHA)) == "alpha"
    assert asyncio.run(t.tenant_of(BRAVO)) == "bravo"
    for stranger in (ANONYMOUS, Caller("key-other")):
        with pytest.raises(Unavailable, match="store:1"):
            asyncio.run(t.tenant_of(stranger))


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        TenantCacheConfig("store:1", ttl_s=-1.0)
