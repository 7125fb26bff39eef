"""Publish which adapter versions this replica holds (GPU slot / host cache) to Redis, so a
router can send a request where its adapter is warm.

One hash per replica, rewritten whole in a MULTI transaction on every publish (readers
never see half an update) and given a TTL, so a replica that dies without cleaning up
disappears after `ttl_s`:

    loraserve:residency:{replica_id}    (hash, TTL ttl_s)
      "_replica"                -> {"address": "host:port", "updated_at": <unix s>}
      "{tenant}/{name}@{version}" -> {"tier": "gpu"|"host", "slot": int|null, "pinned": bool}

An adapter on the GPU is published as "gpu" only (it is usually in the host cache too).
Publishes happen every `interval_s` and soon after `notify()`; a Redis outage is logged and
retried, never raised into serving. redis-py's asyncio client is imported lazily.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

KEY_PREFIX = "loraserve:residency:"
REPLICA_FIELD = "_replica"
Tier = Literal["gpu", "host"]


def residency_key(replica_id: str) -> str:
    return f"{KEY_PREFIX}{replica_id}"


def adapter_field(tenant: str, name: str, version: int) -> str:
    return f"{tenant}/{name}@{version}"


@dataclass(frozen=True)
class ResidencyEntry:
    tenant: str
    name: str
    version: int
    tier: Tier
    slot: int | None = None  # GPU slot, None in the host tier
    pinned: bool = False


@dataclass(frozen=True)
class ResidencyPublisherConfig:
    redis_url: str
    replica_id: str
    address: str  # where a router reaches this replica's Inference service
    ttl_s: float = 15.0
    interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.replica_id or ":" in self.replica_id:
            raise ValueError(f"replica_id must be non-empty without ':', got {self.replica_id!r}")
        if not 0 < self.interval_s < self.ttl_s:
            raise ValueError(
                f"need 0 < interval_s < ttl_s (a live replica must refresh before it "
                f"expires), got interval_s={self.interval_s}, ttl_s={self.ttl_s}"
            )


def residency_hash(entries: Iterable[ResidencyEntry], address: str) -> dict[str, str]:
    """The hash fields of one replica; GPU wins over host for the same version."""
    fields: dict[str, str] = {}
    for entry in sorted(entries, key=lambda e: e.tier != "gpu"):  # gpu entries first
        field = adapter_field(entry.tenant, entry.name, entry.version)
        if field not in fields:
            fields[field] = json.dumps(
                {"tier": entry.tier, "slot": entry.slot, "pinned": entry.pinned}
            )
    fields[REPLICA_FIELD] = json.dumps({"address": address, "updated_at": time.time()})
    return fields


class ResidencyPublisher:
    """Background task that keeps `loraserve:residency:{replica_id}` current."""

    def __init__(
        self, config: ResidencyPublisherConfig, snapshot: Callable[[], Iterable[ResidencyEntry]]
    ) -> None:
        import redis.asyncio as aioredis

        self.config = config
        self._snapshot = snapshot
        self._redis = aioredis.from_url(config.redis_url, socket_timeout=2.0)
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._healthy = True
        self.publishes = 0

    @property
    def key(self) -> str:
        return residency_key(self.config.replica_id)

    def notify(self) -> None:
        """Residency changed: publish soon rather than at the next interval."""
        self._changed.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="residency-publisher")

    async def stop(self, delete: bool = True) -> None:
        """Stop publishing; `delete` removes the key now (a clean shutdown), otherwise it
        expires after the TTL like a crashed replica's."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if delete:
            with contextlib.suppress(Exception):
                await self._redis.delete(self.key)
        await self._redis.aclose()

    async def publish_once(self) -> None:
        """Write the current residency (raises on Redis errors)."""
        fields = residency_hash(self._snapshot(), self.config.address)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            pipe.hset(self.key, mapping=fields)
            pipe.pexpire(self.key, int(self.config.ttl_s * 1000))
            await pipe.execute()
        self.publishes += 1

    async def _run(self) -> None:
        while True:
            self._changed.clear()
            try:
                await self.publish_once()
                if not self._healthy:
                    log.info("residency publishing to Redis resumed")
                self._healthy = True
            except Exception as exc:  # Redis down or slow: keep serving, retry next round
                if self._healthy:
                    log.warning(
                        "cannot publish residency to Redis: %s: %s", type(exc).__name__, exc
                    )
                self._healthy = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.config.interval_s)


@dataclass(frozen=True)
class ReplicaResidency:
    replica_id: str
    address: str
    updated_at: float
    adapters: dict[str, dict[str, Any]]  # "{tenant}/{name}@{version}" -> tier, slot, pinned


async def read_residency(redis: Any, replica_id: str) -> ReplicaResidency | None:
    """What a router reads: one replica's residency, None when it has expired."""
    raw = await redis.hgetall(residency_key(replica_id))
    if not raw:
        return None
    fields = {_text(k): json.loads(v) for k, v in raw.items()}
    replica = fields.pop(REPLICA_FIELD)
    return ReplicaResidency(replica_id, replica["address"], replica["updated_at"], fields)


async def list_replicas(redis: Any) -> list[str]:
    """Replica ids with a live residency key."""
    found = [_text(key) async for key in redis.scan_iter(match=f"{KEY_PREFIX}*")]
    return sorted(key.removeprefix(KEY_PREFIX) for key in found)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
