"""Redis metadata: the index of adapter versions, version counters, base models, events.

Redis is a cache of S3's truth (`reindex` rebuilds it), but it is where visibility is
decided: a version exists for clients once its record is in Redis. Every write that changes
visibility is one transaction (MULTI/EXEC or a Lua script) that also emits the event, so a
reader never sees a record without its event or half of a delete.

Keys (tenant and name are validated, so they contain no ':'):
  loraserve:index_ready                    set when the index mirrors S3 (fresh or reindexed)
  loraserve:base_models                    hash  name -> BaseModelRecord JSON
  loraserve:tenants                        set of tenants with adapters
  loraserve:t:{tenant}:names               zset  adapter names (score 0: ordered by name)
  loraserve:t:{tenant}:a:{name}:versions   hash  version -> AdapterRecord JSON
  loraserve:t:{tenant}:a:{name}:counter    last version number handed out
  loraserve:t:{tenant}:stored              set of "name@version" indexed (the tenant's count)
Events go to pub/sub channel `loraserve:events` and stream `loraserve:events:stream`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, ParamSpec, TypeVar

import redis.asyncio as aioredis
import redis.exceptions

from adapter_store.errors import Unavailable
from adapter_store.records import AdapterRecord, BaseModelRecord

EVENTS_CHANNEL = "loraserve:events"
EVENTS_STREAM = "loraserve:events:stream"
EVENTS_STREAM_MAXLEN = 10_000
_READY = "loraserve:index_ready"
_BASE_MODELS = "loraserve:base_models"
_TENANTS = "loraserve:tenants"

P = ParamSpec("P")
T = TypeVar("T")

# -1 while the index is not known to mirror S3: a counter reset by a lost Redis must never
# hand out a version number that already exists in S3.
_ALLOCATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return redis.call('INCR', KEYS[2])
"""

# KEYS: versions, names, tenants, stored, stream.
# ARGV: version, record JSON, name, tenant, stored member, limit (0: none), channel, event.
# Returns 0 (refused: the tenant is at its limit of stored versions) or 1.
_COMMIT = f"""
local limit = tonumber(ARGV[6])
if limit > 0 and redis.call('SCARD', KEYS[4]) >= limit then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], 0, ARGV[3])
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('SADD', KEYS[4], ARGV[5])
redis.call('XADD', KEYS[5], 'MAXLEN', '~', '{EVENTS_STREAM_MAXLEN}', '*', 'event', ARGV[8])
redis.call('PUBLISH', ARGV[7], ARGV[8])
return 1
"""

# KEYS: versions, names, stream, stored. ARGV: channel, name, then (version, event JSON) pairs.
_DELETE = f"""
local deleted = {{}}
for i = 3, #ARGV, 2 do
  if redis.call('HDEL', KEYS[1], ARGV[i]) == 1 then
    table.insert(deleted, ARGV[i])
    redis.call('SREM', KEYS[4], ARGV[2] .. '@' .. ARGV[i])
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', '{EVENTS_STREAM_MAXLEN}', '*', 'event', ARGV[i + 1])
    redis.call('PUBLISH', ARGV[1], ARGV[i + 1])
  end
end
if redis.call('HLEN', KEYS[1]) == 0 then redis.call('ZREM', KEYS[2], ARGV[2]) end
return deleted
"""

_RAISE_COUNTER = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 0
"""


@dataclass(frozen=True)
class MetadataConfig:
    url: str
    connect_timeout_s: float = 2.0
    command_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"Redis URL {self.url!r} must start with redis://, rediss:// or unix://"
            )
        if self.connect_timeout_s <= 0 or self.command_timeout_s <= 0:
            raise ValueError("Redis timeouts must be positive")


@dataclass(frozen=True)
class AdapterEvent:
    """What the inference service hears about: a version published or deleted."""

    type: Literal["published", "deleted"]
    tenant: str
    name: str
    version: int
    sha256: str

    @classmethod
    def of(cls, type_: Literal["published", "deleted"], record: AdapterRecord) -> AdapterEvent:
        return cls(type_, record.tenant, record.name, record.version, record.sha256)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _redis_errors_unavailable(
    method: Callable[P, Awaitable[T]],
) -> Callable[P, Awaitable[T]]:
    """Redis down or timing out → Unavailable naming Redis."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as error:
            raise Unavailable(f"Redis is unavailable: {error}") from None
        except redis.exceptions.BusyLoadingError:
            raise Unavailable("Redis is loading its dataset; retry shortly") from None

    return wrapper


def _names_key(tenant: str) -> str:
    return f"loraserve:t:{tenant}:names"


def _versions_key(tenant: str, name: str) -> str:
    return f"loraserve:t:{tenant}:a:{name}:versions"


def _counter_key(tenant: str, name: str) -> str:
    return f"loraserve:t:{tenant}:a:{name}:counter"


def _stored_key(tenant: str) -> str:
    return f"loraserve:t:{tenant}:stored"


def _index(pipe: Any, record: AdapterRecord) -> None:
    """Queue the writes that make `record` listed and gettable."""
    pipe.hset(_versions_key(record.tenant, record.name), str(record.version), record.to_json())
    pipe.zadd(_names_key(record.tenant), {record.name: 0})
    pipe.sadd(_TENANTS, record.tenant)
    pipe.sadd(_stored_key(record.tenant), record.ref)


class MetadataStore:
    """Async Redis access; one instance per process (it owns a connection pool)."""

    def __init__(self, config: MetadataConfig) -> None:
        self.config = config
        self._redis = aioredis.Redis.from_url(
            config.url,
            socket_connect_timeout=config.connect_timeout_s,
            socket_timeout=config.command_timeout_s,
            decode_responses=True,
        )
        self._allocate = self._redis.register_script(_ALLOCATE)
        self._commit = self._redis.register_script(_COMMIT)
        self._delete = self._redis.register_script(_DELETE)
        self._raise_counter = self._redis.register_script(_RAISE_COUNTER)

    async def close(self) -> None:
        await self._redis.aclose()

    # --- index state ------------------------------------------------------------------

    @_redis_errors_unavailable
    async def index_ready(self) -> bool:
        return bool(await self._redis.exists(_READY))

    @_redis_errors_unavailable
    async def mark_index_ready(self, note: str) -> None:
        await self._redis.set(_READY, note)

    # --- base models -----------------------------------------------------------------

    @_redis_errors_unavailable
    async def get_base_model(self, name: str) -> BaseModelRecord | None:
        raw = await self._redis.hget(_BASE_MODELS, name)
        return None if raw is None else BaseModelRecord.from_json(raw)

    @_redis_errors_unavailable
    async def list_base_models(self) -> list[BaseModelRecord]:
        raw = await self._redis.hgetall(_BASE_MODELS)
        return [BaseModelRecord.from_json(raw[name]) for name in sorted(raw)]

    @_redis_errors_unavailable
    async def add_base_model(self, record: BaseModelRecord) -> bool:
        """Store `record` unless the name exists; True when this call stored it."""
        return bool(await self._redis.hsetnx(_BASE_MODELS, record.name, record.to_json()))

    @_redis_errors_unavailable
    async def restore_base_model(self, record: BaseModelRecord) -> None:
        """Index a base model read back from S3 (reindex; S3 wins)."""
        await self._redis.hset(_BASE_MODELS, record.name, record.to_json())

    # --- adapters --------------------------------------------------------------------

    @_redis_errors_unavailable
    async def allocate_version(self, tenant: str, name: str) -> int | None:
        """The next version number of `name` (atomic across replicas); None while the index
        is not known to mirror S3."""
        version = int(await self._allocate(keys=[_READY, _counter_key(tenant, name)]))
        return None if version < 0 else version

    @_redis_errors_unavailable
    async def commit_adapter(self, record: AdapterRecord, max_stored: int = 0) -> bool:
        """Make `record` visible and announce it, in one transaction; False (nothing
        written) when its tenant already has `max_stored` versions indexed (0: no limit)."""
        tenant = record.tenant
        committed = await self._commit(
            keys=[
                _versions_key(tenant, record.name),
                _names_key(tenant),
                _TENANTS,
                _stored_key(tenant),
                EVENTS_STREAM,
            ],
            args=[
                str(record.version),
                record.to_json(),
                record.name,
                tenant,
                record.ref,
                max_stored,
                EVENTS_CHANNEL,
                AdapterEvent.of("published", record).to_json(),
            ],
        )
        return bool(committed)

    @_redis_errors_unavailable
    async def stored_count(self, tenant: str) -> int:
        """How many adapter versions of `tenant` are indexed."""
        return int(await self._redis.scard(_stored_key(tenant)))

    @_redis_errors_unavailable
    async def delete_adapters(self, records: list[AdapterRecord]) -> list[int]:
        """Hide the versions of one name and announce each, atomically; returns the versions
        this call removed (others were already gone)."""
        if not records:
            return []
        tenant, name = records[0].tenant, records[0].name
        argv: list[Any] = [EVENTS_CHANNEL, name]
        for record in records:
            argv += [str(record.version), AdapterEvent.of("deleted", record).to_json()]
        keys = [_versions_key(tenant, name), _names_key(tenant), EVENTS_STREAM, _stored_key(tenant)]
        deleted = await self._delete(keys=keys, args=argv)
        return sorted(int(version) for version in deleted)

    @_redis_errors_unavailable
    async def restore_adapter(self, record: AdapterRecord) -> None:
        """Index a record read back from S3 (reindex); no event, the version is not new."""
        async with self._redis.pipeline(transaction=True) as pipe:
            _index(pipe, record)
            await pipe.execute()

    @_redis_errors_unavailable
    async def raise_counter(self, tenant: str, name: str, version: int) -> None:
        """Make sure no version ≤ `version` of `name` is handed out again."""
        await self._raise_counter(keys=[_counter_key(tenant, name)], args=[version])

    @_redis_errors_unavailable
    async def get_adapter(
        self, tenant: str, name: str, version: int | None
    ) -> AdapterRecord | None:
        """Version `version` of `name`, or the latest when None."""
        key = _versions_key(tenant, name)
        if version is None:
            versions = [int(v) for v in await self._redis.hkeys(key)]
            if not versions:
                return None
            version = max(versions)
        raw = await self._redis.hget(key, str(version))
        return None if raw is None else AdapterRecord.from_json(raw)

    @_redis_errors_unavailable
    async def adapter_versions(self, tenant: str, name: str) -> list[AdapterRecord]:
        """Every version of `name`, oldest first."""
        raw = await self._redis.hgetall(_versions_key(tenant, name))
        return [AdapterRecord.from_json(raw[v]) for v in sorted(raw, key=int)]

    @_redis_errors_unavailable
    async def adapter_names(self, tenant: str, after: str | None, count: int) -> list[str]:
        """Up to `count` adapter names of `tenant` in name order, strictly after `after`."""
        start = "-" if after is None else f"({after}"
        return await self._redis.zrangebylex(_names_key(tenant), start, "+", start=0, num=count)
