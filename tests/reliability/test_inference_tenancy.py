"""The inference service acts as its caller: it forwards `authorization: Bearer …` to the
store when it resolves and fetches adapters, so tenant B cannot generate with (or load)
tenant A's adapter, and a caller without a known key is refused. Real store and inference
processes; the replica fetches weights through the store (no S3 of its own), so the fetch
is checked as the caller too. Requests without an adapter (base-model Generate,
ListLoadedAdapters, UnloadAdapter) are checked through the store's WhoAmI and see the
caller's tenant only. TLS on both servers with a self-signed certificate."""

from __future__ import annotations

import json
from pathlib import Path

import grpc

from adapter_store.auth import hash_key
from protos import inference_pb2 as pb
from tests.reliability.inference_stack import (
    bearer,
    channel_to,
    failure_of,
    generate_as,
    inference_process,
    inference_stub,
    start_store,
    upload_embedded,
)
from tests.reliability.test_tenancy import KEY_A, KEY_B, self_signed_cert

NOT_FOUND, UNAUTHENTICATED = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED


def keys_file(folder: Path) -> Path:
    """Keys of tenants alpha (KEY_A) and bravo (KEY_B), hashed, both on every base model."""
    path = folder / "api_keys.json"
    tenants = {KEY_A: "alpha", KEY_B: "bravo"}
    entries = [{"sha256": hash_key(key), "tenant": name} for key, name in tenants.items()]
    path.write_text(json.dumps({"keys": entries}))
    return path


def test_generate_as_the_caller(tmp_path, redis_url, s3_server, s3_bucket, tally) -> None:
    keys = ["--api-keys-file", str(keys_file(tmp_path))]
    store = start_store(tmp_path, redis_url, s3_server.endpoint_url, s3_bucket, *keys)
    inference = inference_process(tmp_path, store, "--redis-url", redis_url)
    try:
        upload_embedded(store, {"a-only": "shouty", "shared": "shouty"}, KEY_A)
        upload_embedded(store, {"b-docs": "docs-prose", "shared": "docs-prose"}, KEY_B)
        inference.start()
        with channel_to(inference) as channel:
            _check_isolation(inference_stub(channel), tally)
    finally:
        inference.stop()
        store.stop()
    log = inference.log_text()
    assert KEY_A not in log and KEY_B not in log  # keys are forwarded, never logged


def _check_isolation(stub, tally) -> None:
    a_only = generate_as(stub, "a-only", KEY_A)
    assert a_only.adapter_version == 1 and len(a_only.token_ids) == 6
    # Cached for alpha now; bravo still gets NOT_FOUND (the cache is per caller).
    for ref in ("a-only", "a-only@1"):
        code, details = failure_of(lambda ref=ref: generate_as(stub, ref, KEY_B))
        assert code == NOT_FOUND, details
        tally.add("inference: cross-tenant Generate/LoadAdapter refused")
    code, _ = failure_of(
        lambda: stub.LoadAdapter(pb.LoadAdapterRequest(adapter="a-only"), metadata=bearer(KEY_B))
    )
    assert code == NOT_FOUND
    tally.add("inference: cross-tenant Generate/LoadAdapter refused")
    for key in (None, "sk-not-a-key"):
        code, details = failure_of(lambda key=key: generate_as(stub, "a-only", key))
        assert code == UNAUTHENTICATED, details
        tally.add("inference: no key / unknown key refused")
    # One name, two tenants: each caller runs its own tenant's weights.
    assert generate_as(stub, "shared", KEY_A).token_ids == a_only.token_ids
    b_docs = generate_as(stub, "b-docs", KEY_B)
    assert generate_as(stub, "shared", KEY_B).token_ids == b_docs.token_ids
    assert b_docs.token_ids != a_only.token_ids
    _check_base_model_and_control_calls(stub, tally)


def listed_as(stub, key: str | None) -> set[str]:
    request = pb.ListLoadedAdaptersRequest()
    reply = stub.ListLoadedAdapters(request, timeout=10, metadata=bearer(key))
    return {f"{a.name}@{a.version}" for a in reply.adapters}


def unload_as(stub, ref: str, key: str) -> bool:
    request = pb.UnloadAdapterRequest(adapter=ref)
    return stub.UnloadAdapter(request, timeout=10, metadata=bearer(key)).unloaded


def _check_base_model_and_control_calls(stub, tally) -> None:
    """No adapter to look up: the replica asks the store who the caller is (WhoAmI)."""
    for key in (None, "sk-not-a-key"):
        code, details = failure_of(lambda key=key: generate_as(stub, "", key))
        assert code == UNAUTHENTICATED, details
        tally.add("inference: base-model Generate without a valid key refused")
        assert failure_of(lambda key=key: listed_as(stub, key))[0] == UNAUTHENTICATED
        tally.add("inference: ListLoadedAdapters without a valid key refused")
    assert len(generate_as(stub, "", KEY_A).token_ids) == 6
    assert len(generate_as(stub, "", KEY_B).token_ids) == 6
    # Each tenant sees its own resident adapters only (both have a `shared@1`).
    assert listed_as(stub, KEY_A) == {"a-only@1", "shared@1"}
    assert listed_as(stub, KEY_B) == {"b-docs@1", "shared@1"}
    tally.add("inference: ListLoadedAdapters scoped to the caller's tenant", 2)
    # Unload reaches the caller's tenant only: bravo cannot drop alpha's adapters.
    assert not unload_as(stub, "a-only", KEY_B)
    assert unload_as(stub, "shared", KEY_B)
    assert listed_as(stub, KEY_A) == {"a-only@1", "shared@1"}
    assert listed_as(stub, KEY_B) == {"b-docs@1"}
    tally.add("inference: cross-tenant UnloadAdapter has no effect")


def test_tls_on_both_servers(tmp_path, redis_url, s3_server, s3_bucket, tally) -> None:
    """Store and replica each serve TLS (self-signed); the replica trusts the store's
    certificate through `--store-tls-ca`, clients trust the replica's."""
    cert, key = self_signed_cert(tmp_path)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    keys = ["--api-keys-file", str(keys_file(tmp_path))]
    store = start_store(
        tmp_path, redis_url, s3_server.endpoint_url, s3_bucket, *keys, *tls, tls_ca=cert
    )
    inference = inference_process(tmp_path, store, "--store-tls-ca", str(cert), *tls, tls_ca=cert)
    try:
        upload_embedded(store, {"a-only": "shouty"}, KEY_A, tls_ca=cert)
        inference.start()
        with channel_to(inference) as channel:
            assert len(generate_as(inference_stub(channel), "a-only", KEY_A).token_ids) == 6
        with grpc.insecure_channel(inference.address) as plain:
            code, _ = failure_of(lambda: generate_as(inference_stub(plain), "a-only", KEY_A, 6, 5))
            assert code == grpc.StatusCode.UNAVAILABLE
        tally.add("inference: TLS generate (both hops) + plain-TCP refusal")
    finally:
        inference.stop()
        store.stop()
    assert "TLS is on" in inference.log_text()
