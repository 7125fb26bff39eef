"""Host adapter cache: LRU by bytes, in-use entries kept, dtype/pinning, metrics; and the
whole chain S3 → host cache → GPU slot pool on the CPU."""

from __future__ import annotations

import pytest
import torch

from adapter_store.errors import ResourceExhausted
from adapter_store.format import model_lora_shapes, serialize
from inference_svc.adapters.host_cache import (
    HostAdapterCache,
    HostCacheConfig,
    adapter_bytes,
)
from inference_svc.adapters.s3_fetch import S3AdapterFetcher, S3FetchConfig, adapter_prefix
from inference_svc.lora.packing import PackedAdapter
from inference_svc.lora.pool import LoraPool, LoraPoolConfig
from tests.fixtures.random_adapters import random_adapter
from tests.fixtures.slot_checks import assert_slot_empty, assert_slot_holds
from tests.fixtures.tiny_models import tiny_config

boto3 = pytest.importorskip("boto3")  # absent on the GPU machine

CONFIG = tiny_config("v3_q_lora").to_dict()


def _small(seed: int):
    return random_adapter(CONFIG, 4, modules=["attn.o"], seed=seed)


SIZE = adapter_bytes(_small(0))


def _cache(entries: float, **kwargs) -> HostAdapterCache:
    return HostAdapterCache(HostCacheConfig(capacity_bytes=int(entries * SIZE), **kwargs))


def _put(cache: HostAdapterCache, key, seed: int) -> None:
    cache.insert(key, _small(seed))
    cache.release(key)


def test_hit_miss_and_stored_tensors() -> None:
    cache = _cache(3)
    adapter = _small(1)
    assert cache.acquire("a") is None
    stored = cache.insert("a", adapter)
    cache.release("a")
    assert cache.acquire("a") is stored
    cache.release("a")
    for name, tensor in adapter.tensors.items():
        assert torch.equal(stored.tensors[name], tensor)
        assert not stored.tensors[name].is_pinned()  # no CUDA here: nothing to pin for
    metrics = cache.metrics()
    assert (metrics.hits, metrics.misses, metrics.inserts, metrics.entries) == (1, 1, 1, 1)
    assert metrics.bytes_used == SIZE


def test_evicts_least_recently_used_by_size() -> None:
    cache = _cache(2.5)
    _put(cache, "a", 1)
    _put(cache, "b", 2)
    assert cache.acquire("a") is not None  # a is now the most recent
    cache.release("a")
    _put(cache, "c", 3)
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.metrics().evictions == 1 and cache.metrics().bytes_used == 2 * SIZE
    assert [entry.key for entry in cache.entries()] == ["a", "c"]


def test_entry_being_copied_is_never_evicted() -> None:
    cache = _cache(2)
    cache.insert("a", _small(1))  # in use: a copy to the GPU is in flight
    _put(cache, "b", 2)
    _put(cache, "c", 3)  # must evict b, not a
    assert "a" in cache and "b" not in cache
    cache.acquire("c")  # now both entries are in use
    with pytest.raises(ResourceExhausted, match="being copied to the GPU"):
        cache.insert("d", _small(4))
    cache.release("a")
    _put(cache, "d", 4)
    assert "a" not in cache and "c" in cache and "d" in cache


def test_too_large_for_the_cache() -> None:
    with pytest.raises(ResourceExhausted, match="more than its capacity"):
        _cache(0.5).insert("a", _small(1))


def test_discard_waits_for_the_copy() -> None:
    cache = _cache(2)
    cache.insert("a", _small(1))
    assert cache.discard("a") and cache.acquire("a") is None
    assert cache.entries() == []
    cache.release("a")
    assert "a" not in cache and cache.metrics().bytes_used == 0
    assert not cache.discard("a")


def test_insert_revives_an_entry_discarded_while_in_use() -> None:
    cache = _cache(2)
    first = cache.insert("a", _small(1))  # a copy to the GPU is in flight
    cache.discard("a")
    assert cache.insert("a", _small(1)) is first  # fetched again before the copy ended
    cache.release("a")
    cache.release("a")
    assert "a" in cache and cache.metrics().bytes_used == SIZE


def test_second_insert_of_the_same_version_keeps_the_first() -> None:
    cache = _cache(3)
    first = cache.insert("a", _small(1))
    assert cache.insert("a", _small(1)) is first
    assert cache.entries()[0].in_use == 2


def test_dtype_conversion_on_insert() -> None:
    cache = _cache(3, dtype=torch.bfloat16)
    adapter = _small(1)
    stored = cache.insert("a", adapter)
    assert stored.manifest.dtype == "bfloat16"
    for name, tensor in adapter.tensors.items():
        assert torch.equal(stored.tensors[name], tensor.to(torch.bfloat16))
    assert cache.metrics().bytes_used == SIZE // 2


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_a_borrowed_adapter_is_never_aliased(dtype) -> None:
    """`borrowed`: the tensors are lent for the call (they view a reused download buffer);
    what the cache keeps does not share their memory, converted or not."""
    cache = _cache(3, dtype=dtype)
    lent = _small(4)
    expected = {name: tensor.clone() for name, tensor in lent.tensors.items()}
    stored = cache.insert("a", lent, borrowed=True)
    for tensor in lent.tensors.values():
        tensor.fill_(7.0)  # the next download overwrites the buffer
    for name, tensor in stored.tensors.items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        HostCacheConfig(capacity_bytes=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            HostCacheConfig(capacity_bytes=1, pin_memory=True)


@pytest.mark.parametrize("packed", [False, True])
def test_s3_to_host_to_slot(s3_server, s3_bucket, packed: bool) -> None:
    """The three tiers chained: fetch from S3, cache on the host (packed for the pool or
    not), copy into a slot."""
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    s3.create_bucket(Bucket=s3_bucket)
    adapter = random_adapter(CONFIG, 8, moe_layout="shared_outer", seed=5)
    weights, manifest_json = serialize(adapter)
    prefix = adapter_prefix("t", "chain", 1)
    s3.put_object(Bucket=s3_bucket, Key=prefix + "weights.safetensors", Body=weights)
    s3.put_object(Bucket=s3_bucket, Key=prefix + "manifest.json", Body=manifest_json)

    fetcher = S3AdapterFetcher(S3FetchConfig(bucket=s3_bucket, endpoint_url=s3_server.endpoint_url))
    pool_config = LoraPoolConfig(16, torch.float16, "cpu", max_loras=2)
    pool = LoraPool.from_config(model_lora_shapes(CONFIG), pool_config)
    cache = HostAdapterCache(
        HostCacheConfig(capacity_bytes=1 << 24, dtype=torch.float16),
        pool.packing if packed else None,
    )
    key = ("t", "chain", 1)

    assert cache.acquire(key) is None
    host = cache.insert(key, fetcher.fetch(*key, expected_sha256=adapter.manifest.sha256).adapter)
    assert isinstance(host, PackedAdapter) == packed
    load = pool.load(1, host)
    assert load.done()
    cache.release(key)
    assert_slot_holds(pool, 1, adapter)
    assert_slot_empty(pool, 0)
    fetcher.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_when_cuda_is_available() -> None:
    stored = _cache(2).insert("a", _small(1))
    assert all(tensor.is_pinned() for tensor in stored.tensors.values())
