"""Pinned host arena: first-fit blocks, merging on free, misuse refused; and the host cache
packing fetched adapters into it (evicting for room, never an entry being copied, nothing
half-stored when full)."""

from __future__ import annotations

import random

import pytest
import torch

from adapter_store.errors import ResourceExhausted
from adapter_store.format import model_lora_shapes
from inference_svc.adapters.host_cache import HostAdapterCache, HostCacheConfig, adapter_bytes
from inference_svc.adapters.pinned_arena import ARENA_ALIGN, ArenaBlock, PinnedArena
from inference_svc.lora.packing import PackedAdapter
from inference_svc.lora.pool import LoraPool, LoraPoolConfig
from tests.fixtures.random_adapters import random_adapter
from tests.fixtures.slot_checks import assert_slot_holds
from tests.fixtures.tiny_models import tiny_config

CONFIG = tiny_config("v3_q_lora").to_dict()
A = ARENA_ALIGN


def test_first_fit_alignment_and_merging() -> None:
    arena = PinnedArena(10 * A, pin=False)
    a, b, c = arena.allocate(1), arena.allocate(2 * A), arena.allocate(A + 1)
    assert (a, b, c) == (ArenaBlock(0, A), ArenaBlock(A, 2 * A), ArenaBlock(3 * A, 2 * A))
    assert arena.free_bytes == 5 * A
    arena.free(b)
    assert arena.allocate(3 * A) == ArenaBlock(5 * A, 3 * A)  # b's range is too short
    assert arena.allocate(2 * A) == ArenaBlock(A, 2 * A)  # first fit: b's range again
    arena.free(ArenaBlock(A, 2 * A))
    arena.free(a)  # merges with b's free range: 3·A from offset 0
    assert arena.allocate(3 * A) == ArenaBlock(0, 3 * A)
    assert arena.allocate(3 * A) is None and arena.largest_free_bytes == 2 * A


def test_misuse_is_refused() -> None:
    arena = PinnedArena(4 * A, pin=False)
    block = arena.allocate(A)
    assert block is not None
    arena.free(block)
    with pytest.raises(ValueError, match="freed twice"):
        arena.free(block)
    with pytest.raises(ValueError, match="outside the arena"):
        arena.free(ArenaBlock(8 * A, A))
    with pytest.raises(ValueError, match="> 0 bytes"):
        arena.allocate(0)
    with pytest.raises(ValueError, match="do not fit"):
        arena.view(ArenaBlock(0, A), torch.float32, A // 4 + 1)


def test_random_allocations_never_overlap_and_all_merge_back() -> None:
    rng = random.Random(3)
    arena = PinnedArena(64 * A, pin=False)
    owner = [None] * 64  # which live block holds each A-sized unit
    live: list[ArenaBlock] = []
    for step in range(2000):
        if live and (rng.random() < 0.45 or len(live) > 20):
            block = live.pop(rng.randrange(len(live)))
            arena.free(block)
            for unit in range(block.offset // A, (block.offset + block.size) // A):
                owner[unit] = None
            continue
        block = arena.allocate(rng.randint(1, 6 * A))
        if block is None:
            # Only when no run of free units is long enough for the largest request.
            assert arena.largest_free_bytes < 6 * A
            continue
        units = range(block.offset // A, (block.offset + block.size) // A)
        assert all(owner[unit] is None for unit in units), f"overlap at step {step}"
        for unit in units:
            owner[unit] = step
        live.append(block)
        assert arena.free_bytes == A * owner.count(None)
    for block in live:
        arena.free(block)
    assert arena.allocate(64 * A) == ArenaBlock(0, 64 * A)


def test_view_is_the_blocks_memory() -> None:
    arena = PinnedArena(8 * A, pin=False)
    block = arena.allocate(2 * A)
    view = arena.view(block, torch.float16, 300)
    view.fill_(2.0)
    assert view.shape == (300,) and view.dtype == torch.float16
    assert view.data_ptr() == arena.buffer.data_ptr() + block.offset
    assert torch.all(arena.buffer[block.offset : block.offset + 600].view(torch.float16) == 2)


# -- the host cache on an arena -------------------------------------------------------------


def _pool() -> LoraPool:
    return LoraPool.from_config(
        model_lora_shapes(CONFIG), LoraPoolConfig(8, torch.float32, "cpu", max_loras=2)
    )


def _adapter(seed: int):
    return random_adapter(CONFIG, 4, modules=["attn.o", "attn.q_b"], seed=seed)


def _arena_cache(pool: LoraPool, entries: float) -> HostAdapterCache:
    """A cache of large logical capacity whose arena holds `entries` packed adapters."""
    packed = adapter_bytes(pool.packing.pack(_adapter(0)))
    config = HostCacheConfig(1 << 30, dtype=torch.float32, arena_bytes=int(entries * packed))
    return HostAdapterCache(config, pool.packing)


def _inside(cache: HostAdapterCache, stored: PackedAdapter) -> bool:
    begin = cache.arena.buffer.data_ptr()
    start = stored.flat.data_ptr()
    end = start + stored.flat.numel() * stored.flat.element_size()
    return begin <= start and end <= begin + cache.arena.capacity_bytes


def test_cache_packs_into_the_arena_and_evicts_for_room() -> None:
    pool = _pool()
    cache = _arena_cache(pool, 2.5)
    first = cache.insert("a", _adapter(1))
    cache.release("a")
    assert isinstance(first, PackedAdapter) and _inside(cache, first)
    cache.insert("b", _adapter(2))
    cache.release("b")
    stored = cache.insert("c", _adapter(3))  # the arena holds two: a (LRU) goes
    assert (
        _inside(cache, stored)
        and "a" not in cache
        and {"b", "c"} <= {e.key for e in cache.entries()}
    )
    assert cache.metrics().evictions == 1
    # The entry is the adapter: a slot load from it gives the adapter's weights.
    pool.load(0, stored)
    cache.release("c")
    assert_slot_holds(pool, 0, _adapter(3))


def test_full_arena_of_entries_in_use_refuses_and_stores_nothing() -> None:
    pool = _pool()
    cache = _arena_cache(pool, 2.5)
    cache.insert("a", _adapter(1))  # both in use: copies to the GPU in flight
    cache.insert("b", _adapter(2))
    free, metrics = cache.arena.free_bytes, cache.metrics()
    with pytest.raises(ResourceExhausted, match="pinned host arena full.*being copied"):
        cache.insert("c", _adapter(3))
    assert "c" not in cache and cache.arena.free_bytes == free and cache.metrics() == metrics
    cache.release("a")  # its copy landed: now it may go
    cache.insert("c", _adapter(3))
    assert "a" not in cache and "c" in cache


def test_racing_insert_of_the_same_version_frees_its_block() -> None:
    pool = _pool()
    cache = _arena_cache(pool, 3)
    free = cache.arena.free_bytes
    kept = cache.insert("a", _adapter(1))
    assert cache.insert("a", _adapter(1)) is kept  # the second fetch's copy is dropped
    cache.release("a")
    cache.release("a")
    cache.discard("a")
    assert cache.arena.free_bytes == free


def test_arena_config() -> None:
    pool = _pool()
    assert HostAdapterCache(HostCacheConfig(1 << 20, arena_bytes=0), pool.packing).arena is None
    assert HostAdapterCache(HostCacheConfig(1 << 20)).arena is None  # nothing packs into it
    default = HostAdapterCache(HostCacheConfig(1 << 20), pool.packing).arena
    assert default is not None and default.capacity_bytes == 1 << 20
    with pytest.raises(ValueError, match="arena_bytes must be >= 0"):
        HostCacheConfig(1 << 20, arena_bytes=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_arena_entries_are_pinned() -> None:
    pool = LoraPool.from_config(
        model_lora_shapes(CONFIG), LoraPoolConfig(8, torch.float32, "cuda", max_loras=2)
    )
    cache = _arena_cache(pool, 2)
    stored = cache.insert("a", _adapter(1))
    assert cache.arena.buffer.is_pinned() and stored.flat.is_pinned() and _inside(cache, stored)
    pool.load(0, stored).wait_on()
    cache.release("a")
    assert_slot_holds(pool, 0, _adapter(1))
