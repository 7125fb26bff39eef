"""Store test fixtures: an in-process store on real Redis + SeaweedFS, a tiny base model,
and PEFT adapter folders made by `peft` itself."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import grpc
import pytest

from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc
from tests.fixtures.servers import SeaweedS3Server
from tests.fixtures.tiny_models import tiny_config
from tests.normalize.peft_adapters import make_peft_adapter
from tests.store.harness import InProcessStore

BASE_MODEL = "tiny-v3"
ATTENTION_TARGETS = ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"]


@pytest.fixture(scope="session")
def tiny_config_json() -> str:
    return tiny_config("v3_q_lora").to_json_string()


def _save(files: dict[str, bytes], folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture(scope="session")
def peft_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two different PEFT adapters of the tiny base (attention LoRA, rank 4 and 8)."""
    root = tmp_path_factory.mktemp("peft")
    adapters = [
        make_peft_adapter("v3_q_lora", seed=1, r=4, lora_alpha=8, target_modules=ATTENTION_TARGETS),
        make_peft_adapter(
            "v3_q_lora", seed=2, r=8, lora_alpha=16, target_modules=ATTENTION_TARGETS
        ),
    ]
    return [_save(files, root / f"adapter{i}") for i, (_, files) in enumerate(adapters)]


def drop_bucket(endpoint_url: str, bucket: str) -> None:
    """Delete a bucket and its objects: SeaweedFS gives every bucket its own volumes, and the
    test server has room for only a few at a time."""
    client = boto3.client("s3", endpoint_url=endpoint_url)
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", ())]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
        client.delete_bucket(Bucket=bucket)
    except client.exceptions.NoSuchBucket:
        pass


@pytest.fixture
def s3_bucket(s3_server: SeaweedS3Server) -> Iterator[str]:
    """A fresh bucket for one test (created by the code under test), dropped afterwards."""
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    yield bucket
    drop_bucket(s3_server.endpoint_url, bucket)


@pytest.fixture
def store(redis_url: str, s3_server: SeaweedS3Server, s3_bucket: str) -> Iterator[InProcessStore]:
    harness = InProcessStore(redis_url, s3_server.endpoint_url, s3_bucket).start()
    yield harness
    harness.stop()


@pytest.fixture
def stub(store: InProcessStore) -> Iterator[adapter_store_pb2_grpc.AdapterStoreStub]:
    with grpc.insecure_channel(store.address) as channel:
        yield adapter_store_pb2_grpc.AdapterStoreStub(channel)


@pytest.fixture
def registered(stub, tiny_config_json: str) -> pb.BaseModel:
    return stub.RegisterBaseModel(
        pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=tiny_config_json), timeout=30
    )


def upload_requests(
    folder: Path, name: str, base_model: str = BASE_MODEL, chunk: int = 64 * 1024, **header
):
    """The UploadAdapter request stream of a PEFT folder."""
    yield pb.UploadAdapterRequest(
        header=pb.UploadHeader(name=name, base_model=base_model, **header)
    )
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        for start in range(0, max(len(data), 1), chunk):
            yield pb.UploadAdapterRequest(
                chunk=pb.FileChunk(filename=path.name, data=data[start : start + chunk])
            )


def fetch_all(stub, ref: str, chunk_size: int = 0) -> tuple[pb.Adapter, bytes, bytes]:
    """(adapter, manifest.json, weights) of a FetchAdapter stream."""
    messages = list(stub.FetchAdapter(pb.FetchAdapterRequest(ref=ref, chunk_size=chunk_size)))
    head, rest = messages[0], messages[1:]
    weights = b"".join(m.data for m in rest)
    assert [m.offset for m in rest] == [
        sum(len(x.data) for x in rest[:i]) for i in range(len(rest))
    ]
    return head.adapter, head.manifest_json, weights
