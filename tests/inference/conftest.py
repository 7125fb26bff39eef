"""Inference service fixtures: one real store (Redis + SeaweedFS) per test module with the
embedded demo model registered and its PEFT adapters uploaded, and in-process inference
replicas wired as `serve` wires them.

The store harness (redis, boto3) is imported inside the fixtures: the GPU machine lacks
those packages and still collects this folder for its `gpu` tests."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from adapter_store.client import StoreClient
from inference_svc.adapters.s3_fetch import S3FetchConfig
from inference_svc.app import AppConfig
from inference_svc.model.tiny import EMBEDDED_ADAPTERS_DIR, EMBEDDED_BASE_DIR
from inference_svc.runtime import RuntimeConfig
from tests.fixtures.servers import RedisServer, SeaweedS3Server
from tests.inference.client import load_peft_oracle
from tests.inference.harness import InProcessInference

BASE_MODEL = "tiny"
EMBEDDED_ADAPTERS = ("docs-prose", "shouty", "unittest-style")


def scaled_adapter(source: Path, folder: Path, factor: float) -> Path:
    """A copy of a PEFT folder with every lora_B scaled: a distinct adapter of the same
    shapes (cheap extra adapters for slot-pressure tests)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = load_file(source / "adapter_model.safetensors")
    scaled = {k: v * factor if "lora_B" in k else v for k, v in tensors.items()}
    save_file(scaled, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    return folder


async def _upload(address: str, uploads: list[tuple[Path, str]]) -> None:
    async with StoreClient(address) as client:
        config = (EMBEDDED_BASE_DIR / "config.json").read_text()
        await client.register_base_model(BASE_MODEL, config)
        for folder, name in uploads:
            await client.upload_dir(folder, name=name, base_model=BASE_MODEL)


def upload(store, uploads: list[tuple[Path, str]]) -> None:
    asyncio.run(_upload(store.address, uploads))


@pytest.fixture(scope="module")
def module_bucket(s3_server: SeaweedS3Server) -> Iterator[str]:
    from tests.store.conftest import drop_bucket

    bucket = f"inf-{uuid.uuid4().hex[:10]}"
    yield bucket
    drop_bucket(s3_server.endpoint_url, bucket)


@pytest.fixture(scope="module")
def store(redis_server: RedisServer, s3_server: SeaweedS3Server, module_bucket: str):
    """A store holding the embedded adapters (version 1 each) of base model 'tiny'."""
    from tests.store.harness import InProcessStore

    redis_server.flushall()
    harness = InProcessStore(redis_server.url, s3_server.endpoint_url, module_bucket).start()
    upload(harness, [(EMBEDDED_ADAPTERS_DIR / name, name) for name in EMBEDDED_ADAPTERS])
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def app_config(
    store, redis_server: RedisServer, s3_server: SeaweedS3Server, module_bucket
) -> AppConfig:
    return AppConfig(
        runtime=RuntimeConfig(
            model="tiny",
            base_model_name=BASE_MODEL,
            max_loras=4,
            max_lora_rank=16,
            host_cache_gb=0.5,
            kv_pages=256,
            max_num_seqs=32,
            max_batch_tokens=256,
        ),
        store_address=store.address,
        replica_id="test-replica",
        advertise_address="127.0.0.1:0",
        redis_url=redis_server.url,
        s3=S3FetchConfig(bucket=module_bucket, endpoint_url=s3_server.endpoint_url),
        residency_interval_s=0.5,
        residency_ttl_s=5.0,
    )


@pytest.fixture
def start_inference(app_config: AppConfig) -> Iterator[Callable[..., InProcessInference]]:
    """Start a replica; keyword arguments override RuntimeConfig (runtime=…) or AppConfig."""
    started: list[InProcessInference] = []

    def start(**overrides) -> InProcessInference:
        runtime = replace(app_config.runtime, **overrides.pop("runtime", {}))
        replica = InProcessInference(replace(app_config, runtime=runtime, **overrides)).start()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.stop()


@pytest.fixture(scope="session")
def peft_oracle():
    return load_peft_oracle(EMBEDDED_ADAPTERS)
