"""Per-tenant concurrent Generate streams at one replica (`--tenant-max-concurrent`), counted
by the store's `ConcurrencyGate`."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from adapter_store.errors import ResourceExhausted
from adapter_store.tenant_limits import ConcurrencyGate
from tests.inference.client import PROMPTS, collect, request


def test_gate_counts_per_tenant_and_frees_places() -> None:
    gate = ConcurrencyGate()
    with gate.admit("a", 2), gate.admit("a", 2):
        with (
            pytest.raises(ResourceExhausted, match="tenant 'a' already has 2"),
            gate.admit("a", 2, "--tenant-max-concurrent"),
        ):
            pass
        with gate.admit("b", 2):  # another tenant is not affected
            assert gate.in_flight("b") == 1
        assert gate.in_flight("a") == 2
    assert gate.in_flight("a") == 0
    with gate.admit("a", 2):  # places come back, also after a failure inside the block
        pass
    with pytest.raises(RuntimeError), gate.admit("a", 2):
        raise RuntimeError("request failed")
    assert gate.in_flight("a") == 0


def test_zero_means_no_limit_and_negative_is_refused(app_config) -> None:
    gate = ConcurrencyGate()
    with gate.admit("a", 0), gate.admit("a", 0), gate.admit("a", 0):
        assert gate.in_flight("a") == 3
    with pytest.raises(ValueError):
        replace(app_config, tenant_max_concurrent=-1)


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
