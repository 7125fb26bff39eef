"""LoadAdapter / UnloadAdapter / ListLoadedAdapters, residency published to Redis, and the
Prometheus metrics."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import generate_latest

from inference_svc.adapters.residency_publisher import read_residency
from protos import inference_pb2 as pb
from tests.inference.client import PROMPTS, generate, request, status_of
from tests.inference.conftest import EMBEDDED_ADAPTERS

aioredis = pytest.importorskip("redis.asyncio")  # absent on the GPU machine


@pytest.fixture
def replica(start_inference):
    return start_inference(runtime=dict(max_loras=2))


@pytest.fixture
def stub(replica):
    with grpc.insecure_channel(replica.address) as channel:
        yield replica.stub(channel)


def listed(stub) -> dict[str, pb.LoadedAdapter]:
    reply = stub.ListLoadedAdapters(pb.ListLoadedAdaptersRequest(), timeout=10)
    return {f"{a.name}@{a.version}": a for a in reply.adapters}


def published(redis_url: str, replica_id: str) -> dict:
    async def read() -> dict:
        client = aioredis.from_url(redis_url)
        try:
            record = await read_residency(client, replica_id)
        finally:
            await client.aclose()
        return {} if record is None else record.adapters

    return asyncio.run(read())


def eventually(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_load_pin_list_unload_and_residency_records(stub, replica, redis_server) -> None:
    first = stub.LoadAdapter(pb.LoadAdapterRequest(adapter="shouty", pin=True), timeout=30)
    assert first.adapter.tier == pb.TIER_GPU and first.adapter.pinned
    assert first.adapter.slot >= 0 and first.adapter.version == 1 and first.adapter.rank == 8
    assert first.load_ms > 0
    again = stub.LoadAdapter(pb.LoadAdapterRequest(adapter="shouty@1"), timeout=30)
    assert again.load_ms == 0 and again.adapter.slot == first.adapter.slot

    reply = stub.ListLoadedAdapters(pb.ListLoadedAdaptersRequest(), timeout=10)
    assert (reply.slots_total, reply.slots_used, reply.max_lora_rank) == (2, 1, 16)
    entry = listed(stub)["shouty@1"]
    assert entry.last_used.endswith("Z") and entry.size_bytes > 0 and entry.active_requests == 0

    def gpu_record() -> None:
        record = published(redis_server.url, "test-replica")["default/shouty@1"]
        assert record == {"tier": "gpu", "slot": first.adapter.slot, "pinned": True}

    eventually(gpu_record)

    # The pinned adapter survives slot pressure from the other adapters.
    for name in EMBEDDED_ADAPTERS:
        generate(stub, request(name, PROMPTS[0], 2))
    assert listed(stub)["shouty@1"].slot == first.adapter.slot
    tiers = {key: a.tier for key, a in listed(stub).items()}
    assert tiers["docs-prose@1"] == pb.TIER_HOST  # evicted from its slot, still in host memory

    unloaded = stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter="shouty"), timeout=10)
    assert unloaded.unloaded
    assert "shouty@1" not in listed(stub)
    assert not stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter="shouty"), timeout=10).unloaded

    def record_gone() -> None:
        assert "default/shouty@1" not in published(redis_server.url, "test-replica")

    eventually(record_gone)


def test_unload_while_in_use_and_load_errors(stub) -> None:
    call = stub.Generate(request("docs-prose", PROMPTS[0], 300), timeout=60)
    next(call)
    busy = status_of(
        lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter="docs-prose"), timeout=10)
    )
    assert busy == grpc.StatusCode.RESOURCE_EXHAUSTED
    call.cancel()
    missing = status_of(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(adapter="nope"), timeout=10))
    assert missing == grpc.StatusCode.NOT_FOUND
    empty = status_of(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(), timeout=10))
    assert empty == grpc.StatusCode.INVALID_ARGUMENT


def test_metrics(stub, replica) -> None:
    generate(stub, request("unittest-style", PROMPTS[0], 5))
    generate(stub, request("", PROMPTS[1], 3))
    text = generate_latest(replica.app.metrics.registry).decode()

    def value(line_start: str) -> float:
        line = next(line for line in text.splitlines() if line.startswith(line_start))
        return float(line.rsplit(" ", 1)[1])

    assert value("loraserve_generated_tokens_total") == 8
    assert value('loraserve_adapter_generated_tokens_total{adapter="unittest-style"}') == 5
    assert value('loraserve_requests_total{adapter="-",finish_reason="length"}') == 1
    assert value("loraserve_time_to_first_token_seconds_count") == 2
    assert value("loraserve_inter_token_latency_seconds_count") == 6
    assert value('loraserve_adapter_load_seconds_count{tier="s3"}') == 1
    assert value('loraserve_adapter_load_seconds_count{tier="host"}') == 1
    assert value("loraserve_lora_slots_used") == 1
    assert value("loraserve_lora_slots_total") == 2
    assert value("loraserve_kv_pages_used") == 0
    assert value("loraserve_batch_tokens_count") >= 8
