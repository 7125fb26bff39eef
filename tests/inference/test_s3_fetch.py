"""S3 fetch against a real SeaweedFS: ranged parallel GETs, per-part and whole-file sha256
checks, error mapping."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest
import torch

from adapter_store.errors import FailedPrecondition, NotFound, Unavailable
from adapter_store.format import model_lora_shapes, serialize
from inference_svc.adapters.host_cache import HostAdapterCache, HostCacheConfig
from inference_svc.adapters.s3_fetch import S3AdapterFetcher, S3FetchConfig, adapter_prefix
from inference_svc.engine.sequence import AdapterBinding
from inference_svc.lora.packing import SlotPacking
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


PART = 16 * 1024  # the manifest's digest parts: several of them in the tiny adapter


@pytest.fixture
def stored(s3, s3_bucket):
    """A rank-8 adapter of the tiny model written to the store's layout, parts digested."""
    adapter = random_adapter(tiny_config("v3_q_lora").to_dict(), 8, seed=11)
    weights, manifest_json = serialize(adapter, part_bytes=PART)
    prefix = adapter_prefix(TENANT, NAME, VERSION)
    s3.put_object(Bucket=s3_bucket, Key=prefix + "weights.safetensors", Body=weights)
    s3.put_object(Bucket=s3_bucket, Key=prefix + "manifest.json", Body=manifest_json)
    return adapter, weights


@pytest.fixture
def stored_without_parts(s3, s3_bucket, stored):
    """The same version as a store from before part digests wrote it."""
    key = adapter_prefix(TENANT, NAME, VERSION) + "manifest.json"
    raw = json.loads(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    legacy = {k: v for k, v in raw.items() if k not in ("part_bytes", "part_sha256")}
    s3.put_object(Bucket=s3_bucket, Key=key, Body=json.dumps(legacy).encode())
    return stored


def _fetcher(endpoint: str, bucket: str, **kwargs) -> S3AdapterFetcher:
    return S3AdapterFetcher(S3FetchConfig(bucket=bucket, endpoint_url=endpoint, **kwargs))


def _store_next_version(s3, s3_bucket):
    """Another adapter stored as version VERSION + 1: (adapter, its weights file)."""
    other = random_adapter(tiny_config("v3_q_lora").to_dict(), 8, seed=12)
    other_weights, other_manifest = serialize(other, part_bytes=PART)
    prefix = adapter_prefix(TENANT, NAME, VERSION + 1)
    s3.put_object(Bucket=s3_bucket, Key=prefix + "weights.safetensors", Body=other_weights)
    s3.put_object(Bucket=s3_bucket, Key=prefix + "manifest.json", Body=other_manifest)
    return other, other_weights


def _assert_same(fetched, adapter, weights) -> None:
    assert fetched.refetched_parts == 0 and fetched.size_bytes == len(weights)
    assert fetched.adapter.manifest.sha256 == adapter.manifest.sha256
    assert fetched.adapter.tensors.keys() == adapter.tensors.keys()
    for name, tensor in adapter.tensors.items():
        assert torch.equal(fetched.adapter.tensors[name], tensor), name


def test_fetch_verified_by_parts_the_record_binds(s3_server, s3_bucket, stored) -> None:
    adapter, weights = stored
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket, part_size=4096, concurrency=4)
    fetched = fetcher.fetch(
        TENANT,
        NAME,
        VERSION,
        expected_sha256=adapter.manifest.sha256,
        expected_parts_sha256=adapter.manifest.parts_sha256,
    )
    # The GETs follow the manifest's parts, not the fetcher's part_size.
    assert fetched.verified_by == "parts" and fetched.parts == -(-len(weights) // PART) > 4
    assert fetched.adapter.manifest == adapter.manifest
    _assert_same(fetched, adapter, weights)
    fetcher.close()


def test_a_record_without_parts_verifies_the_whole_file(s3_server, s3_bucket, stored) -> None:
    adapter, weights = stored
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket, part_size=4096, concurrency=4)
    fetched = fetcher.fetch(TENANT, NAME, VERSION, expected_sha256=adapter.manifest.sha256)
    assert fetched.verified_by == "whole" and fetched.parts == -(-len(weights) // 4096)
    _assert_same(fetched, adapter, weights)
    fetcher.close()


def test_a_manifest_without_parts_verifies_the_whole_file(
    s3_server, s3_bucket, stored_without_parts
) -> None:
    adapter, weights = stored_without_parts
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket, part_size=4096)
    fetched = fetcher.fetch(TENANT, NAME, VERSION)
    assert fetched.verified_by == "whole" and fetched.adapter.manifest.part_sha256 == []
    _assert_same(fetched, adapter, weights)
    fetcher.close()


def test_fetches_reuse_one_download_buffer_and_keep_tensors_of_their_own(
    s3, s3_server, s3_bucket, stored
) -> None:
    """The second fetch downloads into the buffer the first one used; the first fetch's
    tensors are copies, so its adapter is untouched by the second download."""
    adapter, weights = stored
    other, other_weights = _store_next_version(s3, s3_bucket)
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket)
    leased = []
    acquire = fetcher.buffers.acquire
    fetcher.buffers.acquire = lambda nbytes: leased.append(acquire(nbytes)) or leased[-1]
    first = fetcher.fetch(TENANT, NAME, VERSION, adapter.manifest.sha256)
    second = fetcher.fetch(TENANT, NAME, VERSION + 1, other.manifest.sha256)
    assert len(leased) == 2 and leased[0] is leased[1]
    assert fetcher.buffers.idle_bytes == len(leased[0]) >= max(len(weights), len(other_weights))
    _assert_same(first, adapter, weights)
    _assert_same(second, other, other_weights)
    fetcher.close()


def test_fetch_into_lends_views_of_the_buffer_for_the_call_only(
    s3, s3_server, s3_bucket, stored
) -> None:
    """`fetch_into` hands `consume` tensors that view the download buffer (no parse copy);
    a packing host cache copies them, and the next download into the same buffer leaves the
    cached adapter as it was."""
    adapter, weights = stored
    other, other_weights = _store_next_version(s3, s3_bucket)
    shapes = model_lora_shapes(tiny_config("v3_q_lora").to_dict())
    cache = HostAdapterCache(
        HostCacheConfig(1 << 24, dtype=torch.float32), SlotPacking.for_shapes(shapes, torch.float32)
    )
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket)
    storage_bytes = []

    def insert(fetched):
        _assert_same(fetched, adapter, weights)
        # Views: each tensor's storage is the whole download buffer.
        storage_bytes.extend(t.untyped_storage().nbytes() for t in fetched.adapter.tensors.values())
        return cache.insert("first", fetched.adapter, borrowed=True)

    binding = AdapterBinding(
        TENANT, NAME, VERSION, 8, adapter.manifest.sha256, len(weights), "tiny",
        parts_sha256=adapter.manifest.parts_sha256,
    )  # fmt: skip
    stored_first = fetcher.fetch_into(binding, insert)
    assert storage_bytes and min(storage_bytes) >= len(weights)
    second = fetcher.fetch(TENANT, NAME, VERSION + 1, other.manifest.sha256)  # same buffer
    _assert_same(second, other, other_weights)
    assert max(t.untyped_storage().nbytes() for t in second.adapter.tensors.values()) < len(
        other_weights
    )  # `fetch`: tensors of their own
    for name, tensor in adapter.tensors.items():
        assert torch.equal(stored_first.tensors[name], tensor.float()), name
    fetcher.close()


def test_a_refused_fetch_hands_its_buffer_back(s3, s3_server, s3_bucket, stored) -> None:
    adapter, weights = stored
    _corrupt_one_byte(s3, s3_bucket, weights, 5)
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket)
    with pytest.raises(FailedPrecondition, match="is corrupt"):
        fetcher.fetch(TENANT, NAME, VERSION, adapter.manifest.sha256, adapter.manifest.parts_sha256)
    assert fetcher.buffers.idle_bytes >= len(weights)
    fetcher.close()


class _OnePartFailsOneIsSlow(S3AdapterFetcher):
    """S3 refuses the first part at once while the second part's GET is still writing."""

    def __init__(self, config: S3FetchConfig) -> None:
        super().__init__(config)
        self.slow_part_done = threading.Event()

    def _get_into(self, key: str, label: str, start: int, dest: memoryview) -> int:
        if start == 0:
            raise Unavailable("S3 refused the first part")
        received = super()._get_into(key, label, start, dest)
        if start == PART:
            time.sleep(0.3)
            dest[0] ^= 0x01
            self.slow_part_done.set()
        return received


@pytest.mark.parametrize("by_parts", [True, False], ids=["parts", "whole"])
def test_a_failed_fetch_returns_after_its_last_write_into_the_buffer(
    s3_server, s3_bucket, stored, by_parts
) -> None:
    """The buffer goes back to the pool for the next fetch, which verifies its bytes once:
    no part of the failed fetch may still be writing into it then."""
    adapter, _weights = stored
    config = S3FetchConfig(bucket=s3_bucket, endpoint_url=s3_server.endpoint_url, part_size=PART)
    fetcher = _OnePartFailsOneIsSlow(config)
    parts = adapter.manifest.parts_sha256 if by_parts else ""
    with pytest.raises(Unavailable, match="refused the first part"):
        fetcher.fetch(TENANT, NAME, VERSION, adapter.manifest.sha256, parts)
    assert fetcher.slow_part_done.is_set()
    assert fetcher.buffers.idle_bytes > 0
    fetcher.close()


def _corrupt_one_byte(s3, s3_bucket, weights: bytes, offset: int) -> None:
    corrupt = bytearray(weights)
    corrupt[offset] ^= 0x01
    key = adapter_prefix(TENANT, NAME, VERSION) + "weights.safetensors"
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(corrupt))


def test_one_corrupt_byte_is_refused_naming_its_part(s3, s3_server, s3_bucket, stored) -> None:
    adapter, weights = stored
    offset = 3 * PART + 17
    _corrupt_one_byte(s3, s3_bucket, weights, offset)
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket)
    parts = -(-len(weights) // PART)
    expected = rf"bytes {3 * PART}-{4 * PART - 1} \(part 4 of {parts}\) hashed to sha256 "
    with pytest.raises(FailedPrecondition, match=rf"weights.safetensors is corrupt: {expected}"):
        fetcher.fetch(TENANT, NAME, VERSION, adapter.manifest.sha256, adapter.manifest.parts_sha256)


def test_one_corrupt_byte_is_refused_after_a_whole_retry(
    s3, s3_server, s3_bucket, stored_without_parts
) -> None:
    _adapter, weights = stored_without_parts
    _corrupt_one_byte(s3, s3_bucket, weights, len(weights) // 2)
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket, part_size=4096)
    with pytest.raises(FailedPrecondition, match=r"weights.safetensors is corrupt: two downloads"):
        fetcher.fetch(TENANT, NAME, VERSION)


class _TornOnce(S3AdapterFetcher):
    """A flaky network between a healthy S3 and the fetcher: the first GET of one byte
    range arrives with a flipped byte."""

    def __init__(self, config: S3FetchConfig, torn_start: int) -> None:
        super().__init__(config)
        self.torn_start, self.torn = torn_start, 0

    def _get_into(self, key: str, label: str, start: int, dest: memoryview) -> int:
        received = super()._get_into(key, label, start, dest)
        if start == self.torn_start and not self.torn:
            self.torn += 1
            dest[received - 1] ^= 0x80
        return received


def test_a_torn_part_is_fetched_again_alone(s3_server, s3_bucket, stored) -> None:
    adapter, weights = stored
    config = S3FetchConfig(bucket=s3_bucket, endpoint_url=s3_server.endpoint_url)
    fetcher = _TornOnce(config, torn_start=2 * PART)
    fetched = fetcher.fetch(
        TENANT, NAME, VERSION, adapter.manifest.sha256, adapter.manifest.parts_sha256
    )
    assert fetcher.torn == 1 and fetched.refetched_parts == 1 and fetched.verified_by == "parts"
    for name, tensor in adapter.tensors.items():
        assert torch.equal(fetched.adapter.tensors[name], tensor), name
    fetcher.close()


def test_truncated_object_is_refused(s3, s3_server, s3_bucket, stored) -> None:
    adapter, weights = stored
    key = adapter_prefix(TENANT, NAME, VERSION) + "weights.safetensors"
    s3.put_object(Bucket=s3_bucket, Key=key, Body=weights[:-5000])
    with pytest.raises(FailedPrecondition, match="is corrupt"):
        _fetcher(s3_server.endpoint_url, s3_bucket).fetch(
            TENANT, NAME, VERSION, adapter.manifest.sha256, adapter.manifest.parts_sha256
        )


def test_rewritten_weights_and_part_list_are_refused(s3, s3_server, s3_bucket, stored) -> None:
    """Someone rewrites the weights and the manifest's part digests to match them, leaving
    its whole-file sha256 alone: the record's binding (or, for a record without one, the
    whole-file digest) refuses them."""
    adapter, weights = stored
    forged = bytearray(weights)
    forged[-1] ^= 0x01
    prefix = adapter_prefix(TENANT, NAME, VERSION)
    s3.put_object(Bucket=s3_bucket, Key=prefix + "weights.safetensors", Body=bytes(forged))
    raw = json.loads(adapter.manifest.to_json())
    last_part = adapter.manifest.part_range(len(raw["part_sha256"]) - 1)[0]
    raw["part_sha256"][-1] = hashlib.sha256(bytes(forged[last_part:])).hexdigest()
    s3.put_object(Bucket=s3_bucket, Key=prefix + "manifest.json", Body=json.dumps(raw).encode())
    fetcher = _fetcher(s3_server.endpoint_url, s3_bucket)
    with pytest.raises(FailedPrecondition, match="lists part digests that hash to [0-9a-f]{64}, "):
        fetcher.fetch(TENANT, NAME, VERSION, adapter.manifest.sha256, adapter.manifest.parts_sha256)
    with pytest.raises(FailedPrecondition, match="is corrupt: two downloads"):
        fetcher.fetch(TENANT, NAME, VERSION, adapter.manifest.sha256)
    fetcher.close()


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
    "kwargs",
    [
        {"bucket": ""},
        {"bucket": "b", "part_size": 0},
        {"bucket": "b", "concurrency": 0},
        {"bucket": "b", "idle_buffer_bytes": -1},
    ],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        S3FetchConfig(**kwargs)
