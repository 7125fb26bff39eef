"""S3 fetch against a real SeaweedFS: ranged parallel GETs, sha256 checks, error mapping."""

from __future__ import annotations

import asyncio

import pytest
import torch

from adapter_store.errors import FailedPrecondition, NotFound, Unavailable
from adapter_store.format import serialize
from inference_svc.adapters.s3_fetch import S3AdapterFetcher, S3FetchConfig, adapter_prefix
from tests.fixtures.random_adapters import random_adapter
from tests.fixtures.servers import free_port
from tests.fixtures.tiny_models import tiny_config

boto3 = pytest.importorskip("boto3")  # absent on the GPU machine

TENANT, NAME, VERSION = "acme", "support-bot", 3


@pytest.fixture
def s3(s3_server, s3_bucket):
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    client.create_bucket(Bucket=s3_bucket)
    return client


@pytest.fixture
def stored(s3, s3_bucket):
    """A rank-8 adapter of the tiny model written to the store's layout."""
    adapter = random_adapter(tiny_config("v3_q_lora").to_dict(), 8, seed=11)
    weights, manifest_json = serialize(adapter)
    prefix = adapter_prefix(TENANT, NAME, VERSION)
    s3.put_object(Bucket=s3_bucket, Key=prefix + "weights.safetensors", Body=weights)
    s3.put_object(Bucket=s3_bucket, Key=prefix + "manifest.json", Body=manifest_json)
    return adapter, weights


def _fetcher(endpoint: str, bucket: str, **kwargs) -> S3AdapterFetcher:
    return S3AdapterFetcher(S3FetchConfig(bucket=bucket, endpoint_url=endpoint, **kwargs))


def test_fetch_with_parallel_ranged_gets(s3_server, s3_bucket, stored) -> None:
    adapter, weights = stored
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket, part_size=16 * 1024, concurrency=4)
    fetched = asyncio.run(
        fetcher.fetch_async(TENANT, NAME, VERSION, expected_sha256=adapter.manifest.sha256)
    )
    assert fetched.parts == -(-len(weights) // (16 * 1024)) > 4
    assert fetched.downloads == 1 and fetched.size_bytes == len(weights)
    assert fetched.adapter.manifest == adapter.manifest
    assert fetched.adapter.tensors.keys() == adapter.tensors.keys()
    for name, tensor in adapter.tensors.items():
        assert torch.equal(fetched.adapter.tensors[name], tensor), name
    fetcher.close()


def test_one_corrupt_byte_is_refused_after_a_retry(s3, s3_server, s3_bucket, stored) -> None:
    _adapter, weights = stored
    corrupt = bytearray(weights)
    corrupt[len(corrupt) // 2] ^= 0x01
    key = adapter_prefix(TENANT, NAME, VERSION) + "weights.safetensors"
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(corrupt))
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket, part_size=4096)
    with pytest.raises(FailedPrecondition, match=r"weights.safetensors is corrupt: two downloads"):
        fetcher.fetch(TENANT, NAME, VERSION)


def test_truncated_object_is_refused(s3, s3_server, s3_bucket, stored) -> None:
    _adapter, weights = stored
    key = adapter_prefix(TENANT, NAME, VERSION) + "weights.safetensors"
    s3.put_object(Bucket=s3_bucket, Key=key, Body=weights[:-5000])
    with pytest.raises(FailedPrecondition, match="is corrupt"):
        _fetcher(s3_server.endpoint_url, s3_bucket, part_size=4096).fetch(TENANT, NAME, VERSION)


def test_manifest_disagreeing_with_the_store_record(s3_server, s3_bucket, stored) -> None:
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket)
    with pytest.raises(FailedPrecondition, match="the store's record says 0000"):
        fetcher.fetch(TENANT, NAME, VERSION, expected_sha256="0" * 64)


def test_unreadable_manifest(s3, s3_server, s3_bucket, stored) -> None:
    key = adapter_prefix(TENANT, NAME, VERSION) + "manifest.json"
    s3.put_object(Bucket=s3_bucket, Key=key, Body=b"{not json")
    with pytest.raises(FailedPrecondition, match="manifest.json in S3 is unreadable"):
        _fetcher(s3_server.endpoint_url, s3_bucket).fetch(TENANT, NAME, VERSION)


def test_missing_version_is_not_found(s3_server, s3_bucket, stored) -> None:
    with pytest.raises(NotFound, match=r"acme/support-bot@4: s3://.*/v4/manifest.json"):
        _fetcher(s3_server.endpoint_url, s3_bucket).fetch(TENANT, NAME, 4)


def test_s3_down_is_unavailable_naming_s3() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    fetcher = _fetcher(endpoint, "bucket", connect_timeout_s=0.5, max_attempts=1)
    with pytest.raises(Unavailable, match=f"S3 at {endpoint} is unavailable"):
        fetcher.fetch(TENANT, NAME, VERSION)


@pytest.mark.parametrize(
    "kwargs", [{"bucket": ""}, {"bucket": "b", "part_size": 0}, {"bucket": "b", "concurrency": 0}]
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        S3FetchConfig(**kwargs)
