"""Residency publisher against a real Redis: keys appear, follow changes, expire."""

from __future__ import annotations

import asyncio
import json

import pytest

from inference_svc.adapters.residency_publisher import (
    ResidencyEntry,
    ResidencyPublisher,
    ResidencyPublisherConfig,
    list_replicas,
    read_residency,
    residency_hash,
)
from tests.fixtures.servers import free_port

aioredis = pytest.importorskip("redis.asyncio")  # absent on the GPU machine
redis_exceptions = pytest.importorskip("redis.exceptions")


async def _wait_for(condition, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


def test_residency_appears_follows_changes_and_expires(redis_url: str) -> None:
    entries = [
        ResidencyEntry("acme", "bot", 2, "gpu", slot=3, pinned=True),
        ResidencyEntry("acme", "bot", 2, "host"),  # also in host memory: published as gpu
        ResidencyEntry("acme", "old", 1, "host"),
    ]
    config = ResidencyPublisherConfig(
        redis_url, "replica-a", "10.0.0.5:50052", ttl_s=1.0, interval_s=0.5
    )

    async def scenario() -> None:
        reader = aioredis.from_url(redis_url)
        publisher = ResidencyPublisher(config, lambda: list(entries))
        publisher.start()
        await _wait_for(lambda: read_residency(reader, "replica-a"))
        state = await read_residency(reader, "replica-a")
        assert state.address == "10.0.0.5:50052"
        assert state.adapters == {
            "acme/bot@2": {"tier": "gpu", "slot": 3, "pinned": True},
            "acme/old@1": {"tier": "host", "slot": None, "pinned": False},
        }
        assert 0 < await reader.pttl(publisher.key) <= 1000
        assert await list_replicas(reader) == ["replica-a"]

        # A change is published at once on notify, without waiting for the interval.
        entries[:] = [ResidencyEntry("acme", "new", 1, "gpu", slot=0)]
        publisher.notify()

        async def shows_new() -> bool:
            state = await read_residency(reader, "replica-a")
            return state is not None and set(state.adapters) == {"acme/new@1"}

        await _wait_for(shows_new, timeout=0.35)  # < interval_s

        # Refreshed while alive: still there after more than one TTL.
        await asyncio.sleep(1.2)
        assert await read_residency(reader, "replica-a") is not None

        # A crashed replica (no cleanup) disappears after its TTL.
        await publisher.stop(delete=False)
        await asyncio.sleep(1.1)
        assert await read_residency(reader, "replica-a") is None
        assert await list_replicas(reader) == []
        await reader.aclose()

    asyncio.run(scenario())


def test_clean_stop_deletes_at_once(redis_url: str) -> None:
    async def scenario() -> None:
        reader = aioredis.from_url(redis_url)
        config = ResidencyPublisherConfig(redis_url, "replica-b", "h:1", ttl_s=30, interval_s=10)
        publisher = ResidencyPublisher(config, lambda: [])
        await publisher.publish_once()
        state = await read_residency(reader, "replica-b")
        assert state is not None and state.adapters == {}  # alive, holding nothing
        await publisher.stop()
        assert not await reader.exists(publisher.key)
        await reader.aclose()

    asyncio.run(scenario())


def test_redis_down_does_not_stop_the_publisher(caplog) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    config = ResidencyPublisherConfig(url, "replica-c", "h:1", ttl_s=1.0, interval_s=0.05)

    async def scenario() -> None:
        publisher = ResidencyPublisher(config, lambda: [])
        with pytest.raises(redis_exceptions.ConnectionError):
            await publisher.publish_once()
        publisher.start()
        await asyncio.sleep(0.3)
        assert publisher._task is not None and not publisher._task.done()
        await publisher.stop()

    asyncio.run(scenario())
    assert caplog.text.count("cannot publish residency to Redis") == 1  # once per outage


def test_hash_fields() -> None:
    fields = residency_hash([ResidencyEntry("t", "n", 7, "host")], "addr:1")
    assert json.loads(fields["t/n@7"]) == {"tier": "host", "slot": None, "pinned": False}
    assert json.loads(fields["_replica"])["address"] == "addr:1"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"replica_id": ""},
        {"replica_id": "a:b"},
        {"interval_s": 5.0, "ttl_s": 5.0},
        {"interval_s": 0.0},
    ],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ResidencyPublisherConfig(
            **{"redis_url": "redis://x", "replica_id": "r", "address": "a"} | kwargs
        )
