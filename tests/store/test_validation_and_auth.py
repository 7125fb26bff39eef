"""Bad input is refused with a status that says why, before anything is stored; tenants are
isolated; limits stop a stream before it is read whole."""

from __future__ import annotations

import json

import grpc
import pytest

from adapter_store.auth import hash_key
from adapter_store.service import StoreConfig
from adapter_store.upload import UploadLimits
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc
from tests.store.conftest import BASE_MODEL, upload_requests
from tests.store.harness import InProcessStore


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code(), error.value.details()


def test_base_model_reregistration(stub, registered, tiny_config_json) -> None:
    same = json.dumps(json.loads(tiny_config_json))  # other whitespace, same content
    again = stub.RegisterBaseModel(
        pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=same), timeout=10
    )
    assert again.config_sha256 == registered.config_sha256
    assert "attn.qkv_a" in again.lora_modules and "moe.gate_up" in again.lora_modules
    changed = json.loads(tiny_config_json) | {"hidden_size": 128}
    code, details = _code(
        lambda: stub.RegisterBaseModel(
            pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=json.dumps(changed)),
            timeout=10,
        )
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS and "different config" in details
    code, _ = _code(
        lambda: stub.RegisterBaseModel(
            pb.RegisterBaseModelRequest(name="bad", config_json="{not json"), timeout=10
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    listed = stub.ListBaseModels(pb.ListBaseModelsRequest(), timeout=10).base_models
    assert [m.name for m in listed] == [BASE_MODEL]


@pytest.mark.parametrize("name", ["", "a/b", "../x", "x" * 129, "with space", "a@b", "é"])
def test_bad_names_are_invalid_argument(stub, registered, peft_dirs, name) -> None:
    code, _ = _code(lambda: stub.UploadAdapter(upload_requests(peft_dirs[0], name), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_adapter_stores_nothing(store, stub, registered, peft_dirs, tmp_path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    config = json.loads((peft_dirs[0] / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    weights = (peft_dirs[0] / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(weights)
    code, details = _code(lambda: stub.UploadAdapter(upload_requests(folder, "x"), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dora" in details.lower()

    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    code, details = _code(lambda: stub.UploadAdapter(upload_requests(folder, "x"), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    (folder / "adapter_model.bin").unlink()

    code, _ = _code(lambda: stub.UploadAdapter(upload_requests(folder, "x", "no-such"), timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND
    assert store.run(store.objects.list_objects("tenants/")) == []
    assert not stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters


def test_stream_must_start_with_header(stub, registered) -> None:
    chunk = pb.UploadAdapterRequest(chunk=pb.FileChunk(filename="a.json", data=b"{}"))
    code, details = _code(lambda: stub.UploadAdapter(iter([chunk]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "header" in details


def test_size_limit_stops_the_stream_early(
    redis_url, s3_server, s3_bucket, tiny_config_json
) -> None:
    limits = UploadLimits(max_total_bytes=2 * 1024 * 1024, max_files=3)
    store = InProcessStore(
        redis_url, s3_server.endpoint_url, s3_bucket, config=StoreConfig(limits=limits)
    ).start()
    sent = 0

    def huge():
        nonlocal sent
        yield pb.UploadAdapterRequest(header=pb.UploadHeader(name="big", base_model=BASE_MODEL))
        for _ in range(200):  # 200 MiB offered
            sent += 1
            yield pb.UploadAdapterRequest(
                chunk=pb.FileChunk(filename="adapter_model.safetensors", data=bytes(1 << 20))
            )

    def many_files():
        yield pb.UploadAdapterRequest(header=pb.UploadHeader(name="many", base_model=BASE_MODEL))
        for i in range(10):
            yield pb.UploadAdapterRequest(chunk=pb.FileChunk(filename=f"f{i}", data=b"x"))

    try:
        with grpc.insecure_channel(store.address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            stub.RegisterBaseModel(
                pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=tiny_config_json)
            )
            code, details = _code(lambda: stub.UploadAdapter(huge(), timeout=60))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in details
            assert sent < 100, f"the client got to send {sent} MiB past a 2 MiB limit"
            code, _ = _code(lambda: stub.UploadAdapter(many_files(), timeout=60))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert store.metrics.upload_failures.labels("resource_exhausted")._value.get() == 2
    finally:
        store.stop()


KEYS = {"key-acme": "acme", "key-globex": "globex", "key-limited": "limited"}


@pytest.fixture
def authed_store(redis_url, s3_server, s3_bucket):
    from adapter_store.auth import parse_api_keys

    entries = [{"sha256": hash_key(k), "tenant": t} for k, t in KEYS.items() if t != "limited"]
    entries.append({"sha256": hash_key("key-limited"), "tenant": "limited", "base_models": []})
    principals = parse_api_keys(json.dumps({"keys": entries}), "test")
    store = InProcessStore(redis_url, s3_server.endpoint_url, s3_bucket, principals=principals)
    yield store.start()
    store.stop()


def _as(key: str | None) -> list[tuple[str, str]]:
    return [] if key is None else [("authorization", f"Bearer {key}")]


def test_auth_and_tenant_isolation(authed_store, peft_dirs, tiny_config_json) -> None:
    with grpc.insecure_channel(authed_store.address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        code, _ = _code(lambda: stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _code(
            lambda: stub.ListAdapters(pb.ListAdaptersRequest(), metadata=_as("wrong"), timeout=10)
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _code(lambda: stub.UploadAdapter(upload_requests(peft_dirs[0], "x"), timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        for key in (None, "wrong"):
            code, _ = _code(
                lambda key=key: stub.WhoAmI(pb.WhoAmIRequest(), metadata=_as(key), timeout=10)
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED
        for key, tenant in (("key-acme", "acme"), ("key-globex", "globex")):
            assert stub.WhoAmI(pb.WhoAmIRequest(), metadata=_as(key), timeout=10).tenant == tenant

        stub.RegisterBaseModel(
            pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=tiny_config_json),
            metadata=_as("key-acme"),
            timeout=10,
        )
        mine = stub.UploadAdapter(
            upload_requests(peft_dirs[0], "secret"), metadata=_as("key-acme"), timeout=60
        )
        assert mine.tenant == "acme" and mine.storage_prefix.startswith("tenants/acme/")
        # Another tenant cannot see it, and the same name there is its own adapter.
        for call in (
            lambda: stub.GetAdapter(
                pb.GetAdapterRequest(ref="secret@1"), metadata=_as("key-globex"), timeout=10
            ),
            lambda: list(
                stub.FetchAdapter(
                    pb.FetchAdapterRequest(ref="secret"), metadata=_as("key-globex"), timeout=10
                )
            ),
            lambda: stub.DeleteAdapter(
                pb.DeleteAdapterRequest(ref="secret"), metadata=_as("key-globex"), timeout=10
            ),
        ):
            assert _code(call)[0] == grpc.StatusCode.NOT_FOUND
        theirs = stub.UploadAdapter(
            upload_requests(peft_dirs[1], "secret"), metadata=_as("key-globex"), timeout=60
        )
        assert (theirs.tenant, theirs.version) == ("globex", 1)
        listed = stub.ListAdapters(pb.ListAdaptersRequest(), metadata=_as("key-acme"), timeout=10)
        assert [(a.tenant, a.sha256) for a in listed.adapters] == [("acme", mine.sha256)]
        stub.DeleteAdapter(pb.DeleteAdapterRequest(ref="secret"), metadata=_as("key-globex"))
        assert (
            stub.GetAdapter(
                pb.GetAdapterRequest(ref="secret"), metadata=_as("key-acme"), timeout=10
            )
            == mine
        )

        # A tenant without access to the base model can neither see nor use it.
        code, _ = _code(
            lambda: stub.GetBaseModel(
                pb.GetBaseModelRequest(name=BASE_MODEL), metadata=_as("key-limited"), timeout=10
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert not stub.ListBaseModels(
            pb.ListBaseModelsRequest(), metadata=_as("key-limited"), timeout=10
        ).base_models
        code, _ = _code(
            lambda: stub.UploadAdapter(
                upload_requests(peft_dirs[0], "x"), metadata=_as("key-limited"), timeout=10
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
