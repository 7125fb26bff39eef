"""Adapter refs → the store's record of one version, cached and kept fresh by the store's
Redis events.

- `name@N` is immutable: cached until a `deleted` event for it.
- `name` means the latest version *when a request starts*: cached until a `published` or
  `deleted` event for the name. Running requests keep the version they were given.
- While the event subscription is down (or there is no Redis), `name` entries are trusted
  for `latest_ttl_s` only; when the subscription (re)connects every entry is re-checked
  with the store on its next use, since events may have been missed.
- When the store cannot answer, a cached entry is used even if stale (requests for
  adapters this replica already knows, usually resident, are still served); without one
  the request gets UNAVAILABLE naming the store.

The store is asked as the caller (`caller.Caller`: their bearer key is forwarded), so it
decides the tenant. Entries are cached per (caller key hash, ref) and never answer another
caller, so a tenant cannot reach another's adapter through this cache, not even the stale
fallback while the store is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from adapter_store.errors import FailedPrecondition, InvalidArgument
from adapter_store.names import parse_ref
from inference_svc.adapters.caller import ANONYMOUS, Caller
from inference_svc.adapters.store_errors import from_store_error, is_store_down
from inference_svc.engine.sequence import AdapterBinding

log = logging.getLogger("loraserve.resolver")

EVENTS_CHANNEL = "loraserve:events"  # the store's pub/sub channel (adapter_store.storage)
_CLOSE_TIMEOUT_S = 1.0


class AdapterLookup(Protocol):
    """The part of the store client the resolver uses."""

    async def get_adapter(self, ref: str, caller_key: str | None = None) -> Any:
        """protos.adapter_store_pb2.Adapter, asked as `caller_key` ("" = no key)."""
        ...


@dataclass(frozen=True)
class ResolverConfig:
    base_model_name: str  # adapters of any other base model are refused
    max_lora_rank: int
    store_address: str  # named in error messages
    redis_url: str | None = None  # events; None: `name` entries expire after latest_ttl_s
    latest_ttl_s: float = 5.0
    reconnect_s: float = 1.0

    def __post_init__(self) -> None:
        if self.latest_ttl_s < 0 or self.reconnect_s <= 0:
            raise ValueError("latest_ttl_s must be >= 0 and reconnect_s > 0")


@dataclass
class _Entry:
    adapter: AdapterBinding
    fetched_at: float
    pinned: bool  # ref named a version
    stale: bool = False  # re-check with the store before trusting it again


class AdapterResolver:
    def __init__(self, config: ResolverConfig, store: AdapterLookup) -> None:
        self.config = config
        self._store = store
        # (caller key hash, "name" or "name@N") -> entry
        self._cache: dict[tuple[str, str], _Entry] = {}
        self._events_live = False
        self._task: asyncio.Task | None = None
        self.lookups = 0  # store calls made (tests check caching with it)

    # -- resolution -----------------------------------------------------------------------

    async def resolve(self, ref: str, caller: Caller = ANONYMOUS) -> AdapterBinding:
        """The version `ref` means now, to `caller`."""
        parsed = parse_ref(ref)
        key = (caller.key_hash, str(parsed))
        entry = self._cache.get(key)
        if entry is not None and self._fresh(entry):
            return entry.adapter
        try:
            self.lookups += 1
            record = await self._store.get_adapter(str(parsed), caller_key=caller.api_key)
        except grpc.RpcError as error:
            if entry is not None and is_store_down(error):
                log.warning("store unavailable; serving %s from the cached record", ref)
                return entry.adapter
            raise from_store_error(error, self.config.store_address, f"adapter {ref!r}") from None
        adapter = self._check(ref, record, caller)
        self._cache[key] = _Entry(adapter, time.monotonic(), parsed.version is not None)
        if parsed.version is None:
            # The same record also answers `name@N` (to the same caller) from now on.
            self._cache[(caller.key_hash, adapter.label)] = _Entry(adapter, time.monotonic(), True)
        return adapter

    def _fresh(self, entry: _Entry) -> bool:
        if entry.stale:
            return False
        if entry.pinned or self._events_live:
            return True
        return time.monotonic() - entry.fetched_at < self.config.latest_ttl_s

    def _check(self, ref: str, record: Any, caller: Caller) -> AdapterBinding:
        if record.base_model != self.config.base_model_name:
            raise FailedPrecondition(
                f"adapter {record.name}@{record.version} is for base model "
                f"{record.base_model!r}; this server runs {self.config.base_model_name!r}"
            )
        if record.rank > self.config.max_lora_rank:
            raise FailedPrecondition(
                f"adapter {record.name}@{record.version} has rank {record.rank}, above this "
                f"server's max_lora_rank {self.config.max_lora_rank}"
            )
        if not record.sha256:
            raise InvalidArgument(f"adapter {ref!r}: the store's record has no sha256")
        return AdapterBinding(
            tenant=record.tenant,
            name=record.name,
            version=int(record.version),
            rank=int(record.rank),
            sha256=record.sha256,
            size_bytes=int(record.size_bytes),
            base_model=record.base_model,
            parts_sha256=record.parts_sha256,
            caller_key=caller.api_key,
        )

    def cached(self) -> Iterable[AdapterBinding]:
        return [entry.adapter for entry in self._cache.values()]

    # -- invalidation ---------------------------------------------------------------------

    def on_event(self, event: dict[str, Any]) -> None:
        """Apply one store event (`published` or `deleted` of tenant/name/version)."""
        tenant, name, version = event.get("tenant"), event.get("name"), event.get("version")
        kind = event.get("type")
        for key, entry in list(self._cache.items()):
            adapter = entry.adapter
            if adapter.tenant != tenant or adapter.name != name:
                continue
            # `name` (latest) changes on any event; `name@N` only when N is deleted.
            if not entry.pinned or (kind == "deleted" and adapter.version == version):
                del self._cache[key]

    def start(self) -> None:
        """Follow the store's events (no-op without a Redis URL)."""
        if self.config.redis_url and self._task is None:
            self._task = asyncio.create_task(self._follow_events(), name="adapter-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=2 * _CLOSE_TIMEOUT_S + 1)
            self._task = None

    @property
    def events_live(self) -> bool:
        return self._events_live

    async def _follow_events(self) -> None:
        import redis.asyncio as aioredis

        while True:
            client = aioredis.from_url(self.config.redis_url, socket_connect_timeout=2.0)
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(EVENTS_CHANNEL)
                # Events may have been missed while not subscribed; stale entries stay
                # usable as a fallback while the store is down.
                for entry in self._cache.values():
                    entry.stale = True
                self._events_live = True
                log.info("following adapter events on %s", EVENTS_CHANNEL)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self._apply_raw(message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down: fall back to TTLs and retry
                if self._events_live:
                    log.warning("adapter events lost (%s: %s)", type(exc).__name__, exc)
            finally:
                self._events_live = False
                # Bounded: closing a connection cancelled mid-read can wait on its own lock.
                for closing in (pubsub.aclose, client.aclose):
                    with contextlib.suppress(Exception, asyncio.TimeoutError):
                        await asyncio.wait_for(closing(), _CLOSE_TIMEOUT_S)
            await asyncio.sleep(self.config.reconnect_s)

    def _apply_raw(self, data: bytes | str | None) -> None:
        try:
            event = json.loads(data or b"")
        except ValueError:
            log.warning("ignoring malformed adapter event %r", (data or b"")[:200])
            return
        if isinstance(event, dict):
            self.on_event(event)
