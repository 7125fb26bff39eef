"""LoRA slot allocator: ref counts, LRU eviction, pinning, load states, metrics."""

from __future__ import annotations

import random

import pytest

from adapter_store.errors import ResourceExhausted
from inference_svc.engine.lora_slots import LoraSlotAllocator


def _loaded(slots: LoraSlotAllocator, key: str):
    handle = slots.acquire(key)
    if handle.needs_load:
        slots.mark_loaded(key)
    return handle


def test_hit_shares_slot_and_only_first_acquire_loads() -> None:
    slots = LoraSlotAllocator(2)
    first = slots.acquire("a")
    second = slots.acquire("a")
    assert first.needs_load and not second.needs_load
    assert first.slot == second.slot == 0
    assert slots.refs("a") == 2 and not slots.is_ready("a")
    slots.mark_loaded("a")
    assert slots.is_ready("a")
    metrics = slots.metrics()
    assert (metrics.loads, metrics.hits, metrics.misses, metrics.occupied) == (1, 1, 1, 1)
    assert metrics.occupancy == 0.5


def test_lru_evicts_least_recently_used_unreferenced() -> None:
    slots = LoraSlotAllocator(2)
    slots.release(_loaded(slots, "a"))
    slots.release(_loaded(slots, "b"))
    slots.release(_loaded(slots, "a"))  # a is now more recent than b
    c = slots.acquire("c")
    assert c.needs_load and c.evicted == "b" and c.slot == 1
    assert slots.slot_of("b") is None and slots.slot_of("a") == 0
    assert slots.metrics().evictions == 1


def test_referenced_slot_is_never_evicted() -> None:
    slots = LoraSlotAllocator(2)
    held = _loaded(slots, "a")  # a running request keeps it
    slots.release(_loaded(slots, "b"))
    c = _loaded(slots, "c")
    assert c.evicted == "b"
    assert not slots.can_allocate("d")
    with pytest.raises(ResourceExhausted, match="all 2 LoRA slots"):
        slots.acquire("d")
    assert slots.can_allocate("a")  # a hit needs no free slot
    slots.release(held)
    assert slots.acquire("d").evicted == "a"
    assert slots.slot_of("c") == c.slot


def test_adapters_that_waiting_requests_want_are_evicted_last() -> None:
    """A copy evicts the least recently used adapter nobody waits for before an older one
    that a waiting request needs; a look-ahead copy (`evict_wanted=False`) evicts none of
    those, and an admitted request's copy takes the least recently used wanted one last."""
    slots = LoraSlotAllocator(2)
    slots.release(_loaded(slots, "wanted"))  # the least recently used
    slots.release(_loaded(slots, "idle"))
    assert slots.acquire("c", wanted={"wanted"}).evicted == "idle"
    slots.release(slots.acquire("c"))
    slots.mark_loaded("c")
    both = {"wanted", "c"}
    assert not slots.can_allocate("d", both, evict_wanted=False)
    with pytest.raises(ResourceExhausted, match="or wanted by waiting requests"):
        slots.acquire("d", both, evict_wanted=False)
    assert slots.can_allocate("d", both)
    assert slots.acquire("d", both).evicted == "wanted"


def test_pinned_slot_survives_until_unpinned() -> None:
    slots = LoraSlotAllocator(1)
    slots.release(_loaded(slots, "a"))
    slots.pin("a")
    assert slots.is_pinned("a") and not slots.can_allocate("b")
    slots.unpin("a")
    assert slots.acquire("b").evicted == "a"


def test_loading_slot_is_not_evicted_and_failed_load_frees_it() -> None:
    slots = LoraSlotAllocator(1)
    loader = slots.acquire("a")
    slots.release(loader)  # e.g. the request was cancelled while its adapter streams in
    assert not slots.can_allocate("b")  # the copy is still in flight
    waiter = slots.acquire("a")
    assert slots.mark_load_failed("a") == 0
    assert slots.slot_of("a") is None and slots.can_allocate("b")
    retry = slots.acquire("a")
    assert retry.needs_load and retry.slot == 0
    slots.release(waiter)  # a stale handle must not touch the new assignment
    assert slots.refs("a") == 1


def test_release_twice_is_an_error() -> None:
    slots = LoraSlotAllocator(1)
    handle = _loaded(slots, "a")
    slots.release(handle)
    with pytest.raises(ValueError, match="already released"):
        slots.release(handle)


def test_unload_frees_only_idle_loaded_slots() -> None:
    slots = LoraSlotAllocator(2)
    handle = _loaded(slots, "a")
    with pytest.raises(ResourceExhausted, match="1 running request"):
        slots.unload("a")
    slots.release(handle)
    slots.pin("a")
    assert slots.unload("a") == 0  # UnloadAdapter also drops a pin
    assert slots.unload("a") is None
    assert slots.acquire("b").slot == 0


def test_random_workload_keeps_invariants() -> None:
    """Random acquire/release/pin traffic: refs match the handles out, never over capacity,
    referenced or pinned adapters are never evicted."""
    rng = random.Random(0)
    slots = LoraSlotAllocator(4)
    held: list = []
    for _ in range(2000):
        key = f"k{min(int(rng.paretovariate(1.2)), 12)}"
        action = rng.random()
        if action < 0.5 and slots.can_allocate(key):
            protected = {h.adapter_key for h in held} | {
                k for k, _ in slots.resident() if slots.is_pinned(k)
            }
            handle = _loaded(slots, key)
            assert handle.evicted not in protected
            held.append(handle)
        elif action < 0.9 and held:
            slots.release(held.pop(rng.randrange(len(held))))
        elif slots.slot_of(key) is not None:
            (slots.unpin if slots.is_pinned(key) else slots.pin)(key)
        resident = slots.resident()
        assert len(resident) <= 4 and len({slot for _, slot in resident}) == len(resident)
        for resident_key, _ in resident:
            assert slots.refs(resident_key) == sum(h.adapter_key == resident_key for h in held)
    metrics = slots.metrics()
    assert metrics.misses == metrics.loads
    assert metrics.loads - metrics.evictions == metrics.occupied
