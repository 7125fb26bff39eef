"""Upload → get → fetch through the real gRPC API, against real Redis and SeaweedFS."""

from __future__ import annotations

import hashlib
import json
import time

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from adapter_store.format import deserialize
from adapter_store.normalize import normalize_peft
from protos import adapter_store_pb2 as pb
from tests.store.conftest import BASE_MODEL, fetch_all, upload_requests


def test_upload_get_fetch_round_trip(stub, registered, peft_dirs, tiny_config_json) -> None:
    folder = peft_dirs[0]
    uploaded = stub.UploadAdapter(
        upload_requests(folder, "chat", description="hello", labels={"team": "a"}), timeout=60
    )
    assert (uploaded.name, uploaded.version, uploaded.tenant) == ("chat", 1, "default")
    assert stub.WhoAmI(pb.WhoAmIRequest(), timeout=10).tenant == "default"  # no keys: everyone
    assert uploaded.storage_prefix == "tenants/default/adapters/chat/v1/"
    assert uploaded.rank == 4 and uploaded.labels == {"team": "a"}
    assert set(uploaded.target_modules) == {"attn.qkv_a", "attn.q_b", "attn.kv_b", "attn.o"}

    got = stub.GetAdapter(pb.GetAdapterRequest(ref="chat"), timeout=10)
    assert got == uploaded
    adapter, manifest_json, weights = fetch_all(stub, "chat@1", chunk_size=4096)
    assert adapter == uploaded
    assert hashlib.sha256(weights).hexdigest() == uploaded.sha256
    assert len(weights) == uploaded.size_bytes

    # The stored tensors are exactly what the normalizer makes of the same files.
    stored = deserialize(weights, manifest_json)
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    expected = normalize_peft(
        files, json.loads(tiny_config_json), base_model=BASE_MODEL, max_rank=256
    )
    assert stored.tensors.keys() == expected.tensors.keys()
    for name, tensor in expected.tensors.items():
        torch.testing.assert_close(stored.tensors[name], tensor, rtol=0, atol=0)


def test_metrics_count_rpcs_and_bytes(store, stub, registered, peft_dirs) -> None:
    adapter = stub.UploadAdapter(upload_requests(peft_dirs[0], "counted"), timeout=60)
    fetch_all(stub, "counted")
    with pytest.raises(grpc.RpcError):
        stub.GetAdapter(pb.GetAdapterRequest(ref="absent"), timeout=10)
    # The server records a status after the client has it: give it a moment.
    deadline = time.monotonic() + 5
    while "NOT_FOUND" not in (text := generate_latest(store.metrics.registry).decode()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    peft_bytes = sum(path.stat().st_size for path in peft_dirs[0].iterdir())
    for line in (
        'loraserve_store_rpcs_total{code="OK",method="UploadAdapter"} 1.0',
        'loraserve_store_rpcs_total{code="OK",method="FetchAdapter"} 1.0',
        'loraserve_store_rpcs_total{code="NOT_FOUND",method="GetAdapter"} 1.0',
        'loraserve_store_rpc_seconds_count{method="UploadAdapter"} 1.0',
        "loraserve_store_uploads_total 1.0",
        f"loraserve_store_upload_received_bytes_total {float(peft_bytes)}",
        f"loraserve_store_upload_stored_bytes_total {float(adapter.size_bytes)}",
        f"loraserve_store_fetch_bytes_total {float(adapter.size_bytes)}",
    ):
        assert line in text, line


def test_unknown_adapter_is_not_found(stub, registered) -> None:
    with pytest.raises(grpc.RpcError) as error:
        stub.GetAdapter(pb.GetAdapterRequest(ref="nope"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
