"""Adapter ref resolution: caching, invalidation by store events, TTL without events, the
stale fallback while the store is down, refusals, and the cache kept per caller."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from adapter_store.errors import FailedPrecondition, NotFound, Unavailable
from inference_svc.adapters.caller import Caller
from inference_svc.adapters.resolver import AdapterResolver, ResolverConfig
from protos import adapter_store_pb2 as pb


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeStore:
    def __init__(self) -> None:
        self.latest: dict[str, int] = {"a": 1}
        self.down = False
        self.calls: list[str] = []
        self.keys: list[str | None] = []  # the caller key each call was made with

    async def get_adapter(self, ref: str, caller_key: str | None = None) -> pb.Adapter:
        self.calls.append(ref)
        self.keys.append(caller_key)
        if self.down:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        name, _, version = ref.partition("@")
        if name not in self.latest:
            raise FakeRpcError(grpc.StatusCode.NOT_FOUND, f"adapter {name!r} not found")
        base = "other" if name == "foreign" else "tiny"
        rank = 64 if name == "wide" else 8
        return pb.Adapter(
            name=name, version=int(version or self.latest[name]), base_model=base, rank=rank,
            sha256="ab" * 32, size_bytes=10, tenant="default",
        )  # fmt: skip


def resolver(store: FakeStore, ttl: float = 60.0) -> AdapterResolver:
    config = ResolverConfig("tiny", 16, "store:1", latest_ttl_s=ttl)
    return AdapterResolver(config, store)


def test_cached_until_an_event_and_pins_survive_publishes() -> None:
    store = FakeStore()
    r = resolver(store)
    assert asyncio.run(r.resolve("a")).version == 1
    assert asyncio.run(r.resolve("a@1")).version == 1
    assert store.calls == ["a"]  # `a` answered `a@1` too
    store.latest["a"] = 2
    r.on_event({"type": "published", "tenant": "default", "name": "a", "version": 2})
    assert asyncio.run(r.resolve("a")).version == 2
    assert asyncio.run(r.resolve("a@1")).version == 1
    assert store.calls == ["a", "a"]
    r.on_event({"type": "deleted", "tenant": "default", "name": "a", "version": 1})
    asyncio.run(r.resolve("a@1"))
    assert store.calls[-1] == "a@1"


def test_latest_expires_without_events() -> None:
    store = FakeStore()
    r = resolver(store, ttl=0.0)
    asyncio.run(r.resolve("a"))
    asyncio.run(r.resolve("a"))
    assert store.calls == ["a", "a"]


def test_store_down_uses_known_records_else_unavailable() -> None:
    store = FakeStore()
    store.latest["b"] = 1
    r = resolver(store, ttl=0.0)
    asyncio.run(r.resolve("a"))
    store.down = True
    assert asyncio.run(r.resolve("a")).version == 1
    with pytest.raises(Unavailable, match="store:1"):
        asyncio.run(r.resolve("b"))


def test_refusals() -> None:
    store = FakeStore()
    store.latest.update(foreign=1, wide=1)
    r = resolver(store)
    with pytest.raises(NotFound):
        asyncio.run(r.resolve("missing"))
    with pytest.raises(FailedPrecondition, match="base model 'other'"):
        asyncio.run(r.resolve("foreign"))
    with pytest.raises(FailedPrecondition, match="max_lora_rank 16"):
        asyncio.run(r.resolve("wide"))


def test_cache_is_per_caller_and_forwards_the_key() -> None:
    store = FakeStore()
    r = resolver(store, ttl=60.0)
    alice, bob = Caller("sk-alice"), Caller("sk-bob")
    bound = asyncio.run(r.resolve("a", alice))
    assert bound.caller_key == "sk-alice" and "sk-alice" not in repr(bound) + repr(alice)
    asyncio.run(r.resolve("a@1", alice))
    assert store.keys == ["sk-alice"]  # alice's own entries answer alice
    asyncio.run(r.resolve("a@1", bob))
    assert store.keys == ["sk-alice", "sk-bob"]  # never alice's entry for bob
    asyncio.run(r.resolve("a@1"))
    assert store.keys[-1] == ""  # no key is forwarded as no key, not the replica's
    # While the store is down, only the caller's own cached entries are served.
    store.down = True
    assert asyncio.run(r.resolve("a", alice)).version == 1
    with pytest.raises(Unavailable):
        asyncio.run(r.resolve("a", Caller("sk-mallory")))
