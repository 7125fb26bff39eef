"""Per-tenant concurrent Generate streams at one replica (`--tenant-max-concurrent`)."""

from __future__ import annotations

import grpc
import pytest

from adapter_store.errors import ResourceExhausted
from inference_svc.tenant_limits import TenantConcurrencyLimit
from tests.inference.client import PROMPTS, collect, request


def test_limit_counts_per_tenant_and_frees_places() -> None:
    limit = TenantConcurrencyLimit(2)
    with limit.hold("a"), limit.hold("a"):
        with pytest.raises(ResourceExhausted, match="tenant 'a' already has 2"), limit.hold("a"):
            pass
        with limit.hold("b"):  # another tenant is not affected
            assert limit.active("b") == 1
        assert limit.active("a") == 2
    assert limit.active("a") == 0
    with limit.hold("a"):  # places come back, also after a failure inside the block
        pass
    with pytest.raises(RuntimeError), limit.hold("a"):
        raise RuntimeError("request failed")
    assert limit.active("a") == 0


def test_zero_means_no_limit_and_negative_is_refused() -> None:
    limit = TenantConcurrencyLimit(0)
    with limit.hold("a"), limit.hold("a"), limit.hold("a"):
        assert limit.active("a") == 3
    with pytest.raises(ValueError):
        TenantConcurrencyLimit(-1)


def test_replica_refuses_a_tenants_second_stream(start_inference) -> None:
    replica = start_inference(tenant_max_concurrent=1)
    with grpc.insecure_channel(replica.address) as channel:
        stub = replica.stub(channel)
        first = stub.Generate(request("shouty", PROMPTS[0], 64), timeout=120)
        next(first)  # the first stream is running (its first message arrived)
        with pytest.raises(grpc.RpcError) as refused:
            collect(stub.Generate(request("", PROMPTS[1], 4), timeout=60))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--tenant-max-concurrent" in refused.value.details()
        rest = collect(first)
        assert rest.finish_reason  # the first stream completed normally
        assert collect(stub.Generate(request("", PROMPTS[1], 4), timeout=60)).token_ids
